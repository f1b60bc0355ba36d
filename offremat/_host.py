"""Host memory for offloaded copies, and the CUDA streams that move them.

Design note. Host copies live in one arena per device and model, shared by the executors of
all its input shapes and states (:class:`DeviceResources`), sized from the largest plan and
released on demand (:class:`HostArena`). It remembers the event of the last step's end: a
later step's copies into it wait for that event, whatever stream that step runs on. Steps in
flight together (two forwards, then their backwards) carve their copies one after the other,
and the arena is reused only once none of them is left: a step that began and ended between
another's forward and backward must not write over that step's copies. On CPU the arena is
plain memory and the copies are synchronous.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import _disable_current_modes


class HostArena:
    """One host buffer per device and model, pinned for CUDA, that every host copy of a step
    lives in.

    Copies are carved from it one after the other and the whole arena is reused once no step
    that carved from it is in flight (:meth:`open`, :meth:`reset`), so pinned memory is
    allocated once, at the size the plans need, instead of one power-of-two buffer per tensor
    size. ``capacity`` starts at the largest plan's offloaded bytes (:meth:`reserve`); steps
    that need more take the rest from overflow buffers, and the arena grows to what they used
    for the next ones.
    """

    ALIGNMENT = 64

    def __init__(self, pinned: bool, capacity: int = 0):
        self.pinned = pinned
        self.capacity = capacity
        self._buffer: torch.Tensor | None = None
        self._offset = 0
        self._overflow: list[torch.Tensor] = []
        self._used = 0
        self._steps = 0  # in flight: opened and not yet reset
        self.last_use: torch.cuda.Event | None = None

    @property
    def allocated_bytes(self) -> int:
        """Host bytes held now: the arena and this step's overflow buffers."""
        held = 0 if self._buffer is None else self._buffer.numel()
        return held + sum(buffer.numel() for buffer in self._overflow)

    def reserve(self, nbytes: int) -> None:
        """Make the arena at least ``nbytes``: now if no step is in flight, else once it is
        reused."""
        self.capacity = max(self.capacity, nbytes)
        if not self._steps and self._buffer is not None and self._buffer.numel() < nbytes:
            self._buffer = None

    def open(self) -> None:
        """A step begins: its copies stay valid until its :meth:`reset`."""
        self._steps += 1

    def take(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of host memory for one copy, valid until its step's :meth:`reset`."""
        size = -(-nbytes // self.ALIGNMENT) * self.ALIGNMENT
        self._used += size
        if self._buffer is None and self._offset == 0 and self.capacity > 0:
            self._buffer = self._allocate(self.capacity)
        if self._buffer is not None and self._offset + size <= self._buffer.numel():
            view = self._buffer[self._offset : self._offset + nbytes]
            self._offset += size
            return view
        self._overflow.append(self._allocate(nbytes))
        return self._overflow[-1]

    def reset(self) -> None:
        """A step is over: its copies are no longer read. Once no other step's are, reuse the
        arena, grown to what the steps used if more."""
        self._steps = max(0, self._steps - 1)
        if self._steps:
            return
        self.capacity = max(self.capacity, self._used)
        if self._buffer is not None and self._buffer.numel() < self.capacity:
            self._buffer = None
        self._overflow.clear()
        self._offset = 0
        self._used = 0

    def release(self) -> None:
        """Give the arena back (pinned memory returns to torch's host cache); the next step
        allocates it again."""
        if self.last_use is not None:
            self.last_use.synchronize()
            self.last_use = None
        self._buffer = None
        self._overflow.clear()
        if not self._steps:
            self._offset = 0
            self._used = 0

    def _allocate(self, nbytes: int) -> torch.Tensor:
        # Host memory, not the device's: on CPU, where both are the same RAM, it is allocated
        # outside any dispatch mode so that the step's measurement leaves it out (design.md).
        with _disable_current_modes():
            return torch.empty(nbytes, dtype=torch.uint8, device="cpu", pin_memory=self.pinned)


class CudaStreams:
    """The compute stream of the current step and the two copy streams of one device."""

    def __init__(self, device: torch.device):
        self.device = device
        self.d2h = torch.cuda.Stream(device)
        self.h2d = torch.cuda.Stream(device)
        self.compute = torch.cuda.current_stream(device)


class DeviceResources:
    """The host arena and CUDA copy streams of each device, shared by the executors of one
    model (one per input shape, block-input kind and state), so that host memory follows the
    largest plan rather than the number of shapes seen."""

    def __init__(self) -> None:
        self.arenas: dict[torch.device, HostArena] = {}
        self.streams: dict[torch.device, CudaStreams] = {}

    def of(self, device: torch.device, host_bytes: int) -> tuple[HostArena, CudaStreams | None]:
        """``device``'s arena, made to hold at least ``host_bytes``, and its streams."""
        if device not in self.arenas:
            cuda = device.type == "cuda"
            self.arenas[device] = HostArena(pinned=cuda, capacity=host_bytes)
            if cuda:
                self.streams[device] = CudaStreams(device)
        arena = self.arenas[device]
        arena.reserve(host_bytes)
        streams = self.streams.get(device)
        if streams is not None:
            streams.compute = torch.cuda.current_stream(device)
        return arena, streams

    @property
    def host_bytes(self) -> int:
        """Host memory kept for offloads between steps."""
        return sum(arena.allocated_bytes for arena in self.arenas.values())

    def release(self) -> None:
        """Give back every arena; the next step allocates its own again."""
        for arena in self.arenas.values():
            arena.release()

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) starts without this process's buffers and streams.
        return {}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.arenas = {}
        self.streams = {}
