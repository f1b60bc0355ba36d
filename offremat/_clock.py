"""Timing a stage on its device's clock: CUDA events on the stage's stream, else the host's
counter, so that a GPU's asynchronous work is timed where it runs."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from offremat._stage import SavedTensorPacker


class MarkingPacker(SavedTensorPacker):
    """Packs as the executor does, with a clock mark each time it holds a saved tensor."""

    def __init__(
        self,
        stage: str,
        inputs: Sequence[torch.Tensor],
        excluded: set[int],
        marks: list[Any],
        device: torch.device,
    ):
        super().__init__(stage, inputs, excluded)
        self.marks = marks
        self.device = device

    @torch.compiler.disable
    def pack(self, tensor: torch.Tensor) -> Any:
        held = len(self.refs)
        packed = super().pack(tensor)
        if len(self.refs) > held:
            self.marks.append(mark(self.device))
        return packed


def mark(device: torch.device) -> Any:
    """Now, on ``device``'s clock: a recorded CUDA event, or the host's counter."""
    if device.type == "cuda":
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event
    return time.perf_counter()


def seconds(device: torch.device, first: Any, last: Any) -> float:
    """Seconds between two :func:`mark` marks whose work has finished."""
    if device.type == "cuda":
        return first.elapsed_time(last) / 1000
    return last - first


def timed(device: torch.device, work: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``work``; its result and its duration in seconds on ``device``."""
    if device.type == "cuda":
        # On the model's device and its current stream, not the current device's.
        stream = torch.cuda.current_stream(device)
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record(stream)
        with torch.cuda.device(device):
            result = work()
        end.record(stream)
        end.synchronize()
        return result, start.elapsed_time(end) / 1000
    began = time.perf_counter()
    result = work()
    return result, time.perf_counter() - began
