"""Profile a chain of PyTorch modules into a :class:`solvers.chain.Chain`.

Per stage it measures what rotor's cost model needs (Herrmann, Beaumont et al., "Optimal
checkpointing for heterogeneous chains", 2019): forward and backward times (warm-ups, then the
median of repeats; CUDA events on a GPU, ``perf_counter`` on a CPU), the output's bytes x_i and
the saved set's bytes x̄_i, and on CUDA the transient peaks of the forward and the backward.
Sizes come from ``saved_tensors_hooks`` and count distinct storages, neither the stage's input
nor parameters, exactly as the executor holds them (:mod:`offremat._stage`). On CUDA it also
measures the pinned host link used to offload (Beaumont, Eyraud-Dubois, Shilova 2021).

Profiling leaves the model as it was: the global RNG states, every buffer (BatchNorm running
statistics) and the parameters' ``.grad`` are untouched.
"""

from __future__ import annotations

import logging
import re
import statistics
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn

from offremat._blocks import chain_blocks, group_evenly, group_name, stage_module
from offremat._stage import (
    GradSlot,
    SavedTensorPacker,
    check_unmodified,
    cuda_device_indices,
    enter_stage,
    parameter_storages,
)
from offremat._tensors import flatten, is_differentiable, storage_bytes, unflatten, unique_storages
from solvers.budget import format_bytes, parse_budget
from solvers.chain import Chain, Link, Stage

logger = logging.getLogger(__name__)

LINK_SIZES = (2**23, 2**26, 2**28)
"""Bytes per copy when measuring the link: 8 MiB, 64 MiB, 256 MiB."""


@dataclass(frozen=True)
class _Measured:
    """One stage's figures, before they become a :class:`Stage`."""

    fwd_s: float
    bwd_s: float
    out_bytes: int
    saved_bytes: int
    fwd_tmp_bytes: int
    bwd_tmp_bytes: int


def profile_model(
    model: nn.Module | Sequence[nn.Module],
    example_input: Any,
    *,
    stages: int | None = None,
    bandwidth: Any = None,
    warmup: int = 2,
    repeats: int = 5,
    name: str | None = None,
) -> Chain:
    """The chain of ``model`` (an ``nn.Sequential`` or a list of blocks) on ``example_input``.

    One stage per block, or ``stages`` stages of consecutive blocks balanced by saved bytes
    (the grouping is logged and kept in ``chain.metadata["grouping"]``). ``bandwidth`` sets
    the link (see :func:`parse_bandwidth`); otherwise it is measured on CUDA and absent on
    a CPU.
    """
    if warmup < 0 or repeats < 1:
        raise ValueError(f"need warmup >= 0 and repeats >= 1, got {warmup} and {repeats}")
    blocks = chain_blocks(model)
    modules = [module for _, module in blocks]
    input_tensors, _ = flatten(example_input)
    if not input_tensors:
        raise TypeError("the example input holds no tensor; pass what the model's forward takes")
    device = input_tensors[0].device
    check_device(modules, device)
    with _untouched(modules, device):
        if stages is None or stages == len(blocks):
            groups = [range(k, k + 1) for k in range(len(blocks))]
        else:
            sizes = [
                m.saved_bytes for m in _profile_all(blocks, example_input, 0, 1, sizes_only=True)
            ]
            # +1: blocks that save nothing still have to go somewhere.
            groups = group_evenly([size + 1 for size in sizes], stages)
        grouped = [[blocks[k] for k in group] for group in groups]
        names = [group_name([block_name for block_name, _ in group]) for group in grouped]
        measured = _profile_all(
            [(n, stage_module(g)) for n, g in zip(names, grouped, strict=True)],
            example_input,
            warmup,
            repeats,
        )
    chain_stages = tuple(
        Stage(
            name=stage_name,
            fwd_s=m.fwd_s,
            bwd_s=m.bwd_s,
            out_bytes=m.out_bytes,
            saved_bytes=m.saved_bytes,
            fwd_tmp_bytes=m.fwd_tmp_bytes,
            bwd_tmp_bytes=m.bwd_tmp_bytes,
        )
        for stage_name, m in zip(names, measured, strict=True)
    )
    metadata: dict[str, Any] = {
        "device": str(device),
        "grouping": {
            stage_name: [block_name for block_name, _ in group]
            for stage_name, group in zip(names, grouped, strict=True)
        },
        "profile": {"warmup": warmup, "repeats": repeats},
    }
    if stages is not None and stages != len(blocks):
        logger.info(
            "grouped %d blocks into %d stages: %s",
            len(blocks),
            len(names),
            "; ".join(f"{n} ({len(g)} blocks)" for n, g in zip(names, grouped, strict=True)),
        )
    link = None
    if bandwidth is not None:
        link = parse_bandwidth(bandwidth)
    elif device.type == "cuda":
        link, metadata["link_measurements"] = measure_link(device)
    return Chain(
        name=name or type(model).__name__,
        input_bytes=storage_bytes(input_tensors),
        stages=chain_stages,
        link=link,
        metadata=metadata,
    )


def stage_modules(model: nn.Module | Sequence[nn.Module], chain: Chain) -> list[nn.Module]:
    """The module of each stage of ``chain``, from the blocks of ``model``."""
    blocks = chain_blocks(model)
    grouping = chain.metadata.get("grouping")
    if grouping is None:
        if chain.length != len(blocks):
            raise ValueError(
                f"the chain has {chain.length} stages but the model has {len(blocks)} blocks and "
                "the chain does not say how they were grouped: profile this model with "
                "offremat.profile_model (or `offremat profile`) to get its chain"
            )
        return [module for _, module in blocks]
    by_name = dict(blocks)
    order = [name for name, _ in blocks]
    listed = [block for name in chain.stage_names for block in grouping.get(name, [])]
    if listed != order:
        raise ValueError(
            f"the chain groups blocks {listed} but the model's blocks are {order}: profile this "
            "model to get its chain"
        )
    return [
        stage_module([(block, by_name[block]) for block in grouping[name]])
        for name in chain.stage_names
    ]


def parse_bandwidth(value: Any) -> Link:
    """A link from bytes per second: a number, ``"25GB/s"``, a (d2h, h2d) pair or a Link."""
    if isinstance(value, Link):
        return value
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"bandwidth pair {value!r} must be (device-to-host, host-to-device)")
        return Link(_bytes_per_second(value[0]), _bytes_per_second(value[1]))
    rate = _bytes_per_second(value)
    return Link(rate, rate)


def _bytes_per_second(value: Any) -> float:
    if isinstance(value, str):
        text = re.sub(r"\s*/\s*s(ec)?\s*$", "", value.strip())
        try:
            rate = float(text)
        except ValueError:
            try:
                rate = float(parse_budget(text))
            except ValueError:
                raise ValueError(
                    f"bandwidth {value!r} is not a rate: write bytes per second (2.5e10) or a "
                    "size per second (25GB/s, 12GiB/s)"
                ) from None
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
    else:
        raise ValueError(f"bandwidth {value!r} is not a rate in bytes per second")
    if not rate > 0:
        raise ValueError(f"bandwidth must be positive, got {value!r}")
    return rate


def measure_link(
    device: torch.device, sizes: Sequence[int] = LINK_SIZES, repeats: int = 3
) -> tuple[Link, list[dict[str, float]]]:
    """Pinned device-to-host and host-to-device bandwidth on ``device``.

    Each size is copied in each direction alone and in both directions at once; the link is
    the slower of the two readings per direction at the largest size that fits, since the
    simulator runs the two channels at once.
    """
    free_bytes, _ = torch.cuda.mem_get_info(device)
    usable = [size for size in sizes if 4 * size <= free_bytes] or [min(sizes)]
    readings = []
    streams = (torch.cuda.Stream(device), torch.cuda.Stream(device))
    for size in usable:
        hosts = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(2)]
        devices = [torch.empty(size, dtype=torch.uint8, device=device) for _ in range(2)]
        d2h = [(hosts[0], devices[0])]
        h2d = [(devices[1], hosts[1])]
        alone_d2h = _median_copy_times(device, streams, d2h, repeats)[0]
        alone_h2d = _median_copy_times(device, streams, h2d, repeats)[0]
        both_d2h, both_h2d = _median_copy_times(device, streams, d2h + h2d, repeats)
        readings.append(
            {
                "bytes": size,
                "d2h_alone_bytes_per_s": size / alone_d2h,
                "h2d_alone_bytes_per_s": size / alone_h2d,
                "d2h_both_bytes_per_s": size / both_d2h,
                "h2d_both_bytes_per_s": size / both_h2d,
            }
        )
    last = readings[-1]
    link = Link(
        min(last["d2h_alone_bytes_per_s"], last["d2h_both_bytes_per_s"]),
        min(last["h2d_alone_bytes_per_s"], last["h2d_both_bytes_per_s"]),
    )
    logger.info(
        "link on %s: device-to-host %s/s, host-to-device %s/s",
        device,
        format_bytes(link.d2h_bytes_per_s),
        format_bytes(link.h2d_bytes_per_s),
    )
    return link, readings


def _median_copy_times(
    device: torch.device,
    streams: tuple[torch.cuda.Stream, torch.cuda.Stream],
    copies: list[tuple[torch.Tensor, torch.Tensor]],
    repeats: int,
) -> list[float]:
    """Median seconds from a common start to the end of each copy, each on its own stream."""
    times: list[list[float]] = [[] for _ in copies]
    for attempt in range(repeats + 1):
        torch.cuda.synchronize(device)
        start = torch.cuda.Event(enable_timing=True)
        start.record(torch.cuda.current_stream(device))
        ends = []
        for (destination, source), stream in zip(copies, streams, strict=False):
            stream.wait_event(start)
            with torch.cuda.stream(stream):
                destination.copy_(source, non_blocking=True)
            ends.append(stream.record_event(torch.cuda.Event(enable_timing=True)))
        torch.cuda.synchronize(device)
        if attempt > 0:  # the first round warms up
            for k, end in enumerate(ends):
                times[k].append(start.elapsed_time(end) / 1000)
    return [statistics.median(t) for t in times]


def _profile_all(
    stages: Sequence[tuple[str, nn.Module]],
    example_input: Any,
    warmup: int,
    repeats: int,
    sizes_only: bool = False,
) -> list[_Measured]:
    """Profile each stage on the output of the one before, starting from the example input."""
    tensors, structure = flatten(example_input)
    flags = [t.requires_grad for t in tensors]
    excluded = parameter_storages([module for _, module in stages])
    value = unflatten([t.detach() for t in tensors], structure)
    results = []
    upstream_trainable = any(flags)
    for name, module in stages:
        measured, output = _profile_stage(
            name, module, value, flags, excluded, warmup, repeats, sizes_only
        )
        results.append(measured)
        upstream_trainable = upstream_trainable or any(p.requires_grad for p in module.parameters())
        out_tensors, out_structure = flatten(output)
        flags = [is_differentiable(t) and upstream_trainable for t in out_tensors]
        value = unflatten([t.detach() for t in out_tensors], out_structure)
    return results


def _profile_stage(
    name: str,
    module: nn.Module,
    value: Any,
    flags: list[bool],
    excluded: set[int],
    warmup: int,
    repeats: int,
    sizes_only: bool,
) -> tuple[_Measured, Any]:
    tensors, structure = flatten(value)
    device = tensors[0].device if tensors else torch.device("cpu")
    cuda = device.type == "cuda"
    parameters = [p for p in module.parameters() if p.requires_grad]

    diff = [k for k, flag in enumerate(flags) if flag]
    anchor = torch.empty(0, device=device, requires_grad=True)

    def prepared() -> tuple[Any, GradSlot]:
        # The same boundary as the executor's, so autograd saves the same tensors.
        slot = GradSlot()
        return unflatten(enter_stage(tensors, diff, slot, anchor), structure), slot

    def backward(output: Any, slot: GradSlot) -> list[torch.Tensor | None]:
        outputs = [t for t in flatten(output)[0] if t.requires_grad]
        if not outputs:
            return []
        grads = torch.autograd.grad(
            outputs,
            [anchor, *parameters],
            [torch.ones_like(t) for t in outputs],
            allow_unused=True,
        )
        return [*grads[1:], *(slot.grads or ())]

    def run(stage_input: Any) -> Any:
        versions = [t._version for t in tensors]
        output = module(stage_input)
        check_unmodified(name, tensors, versions)
        return output

    # Sizes, and temporaries from the allocator's statistics on CUDA.
    stage_input, slot = prepared()
    packer = SavedTensorPacker(tensors, excluded)
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    with torch.enable_grad(), packer.hooks():
        output = run(stage_input)
    out_tensors, _ = flatten(output)
    out_storages = unique_storages(out_tensors)
    saved = {**packer.storages, **out_storages}
    out_bytes = sum(s.nbytes() for s in out_storages.values())
    saved_bytes = sum(s.nbytes() for s in saved.values())
    fwd_tmp = bwd_tmp = 0
    if cuda:
        torch.cuda.synchronize(device)
        fwd_tmp = max(
            0, torch.cuda.max_memory_allocated(device) - torch.cuda.memory_allocated(device)
        )
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        grads = backward(output, slot)
        torch.cuda.synchronize(device)
        produced = storage_bytes(g for g in grads if g is not None)
        bwd_tmp = max(0, torch.cuda.max_memory_allocated(device) - before - produced)
        del grads
        # A forward without autograd (F_ck, F_none) frees its intermediates as it goes, so its
        # transient peak above its output can exceed the grad-enabled one; the cost model has
        # one fwd_tmp for both, so keep the larger.
        torch.cuda.synchronize(device)
        before = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        with torch.no_grad():
            plain_output = run(unflatten(tensors, structure))
        torch.cuda.synchronize(device)
        plain_peak = torch.cuda.max_memory_allocated(device) - before
        fwd_tmp = max(fwd_tmp, plain_peak - storage_bytes(flatten(plain_output)[0]))
        del plain_output
    else:
        backward(output, slot)
    del packer, saved, out_storages
    if sizes_only:
        return _Measured(0.0, 0.0, out_bytes, saved_bytes, fwd_tmp, bwd_tmp), output

    forward_times, backward_times = [], []
    for attempt in range(warmup + repeats):
        stage_input, slot = prepared()
        with torch.enable_grad():
            timed_output, forward_s = _timed(device, partial(run, stage_input))
        _, backward_s = _timed(device, partial(backward, timed_output, slot))
        if attempt >= warmup:
            forward_times.append(forward_s)
            backward_times.append(backward_s)
        del timed_output
    measured = _Measured(
        statistics.median(forward_times),
        statistics.median(backward_times),
        out_bytes,
        saved_bytes,
        fwd_tmp,
        bwd_tmp,
    )
    return measured, output


def _timed(device: torch.device, work: Callable[[], Any]) -> tuple[Any, float]:
    """Run ``work``; its result and its duration in seconds on ``device``."""
    if device.type == "cuda":
        start = torch.cuda.Event(enable_timing=True)
        end = torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize(device)
        start.record()
        result = work()
        end.record()
        end.synchronize()
        return result, start.elapsed_time(end) / 1000
    began = time.perf_counter()
    result = work()
    return result, time.perf_counter() - began


def check_device(modules: Sequence[nn.Module], device: torch.device) -> None:
    """Refuse an input on another device than the model's parameters, saying how to fix it."""
    parameter = next((p for module in modules for p in module.parameters()), None)
    if parameter is not None and parameter.device != device:
        raise ValueError(
            f"the input is on {device} but the model's parameters are on {parameter.device}: "
            f"move the input with x.to({str(parameter.device)!r}) or the model with "
            f"model.to({str(device)!r})"
        )


@contextmanager
def _untouched(modules: Sequence[nn.Module], device: torch.device) -> Iterator[None]:
    """Restore RNG states, buffers and parameter gradients after profiling."""
    cuda_devices = cuda_device_indices(device)
    buffers = [(buffer, buffer.clone()) for module in modules for buffer in module.buffers()]
    grads = [(p, p.grad) for module in modules for p in module.parameters()]
    with torch.random.fork_rng(devices=cuda_devices):
        try:
            yield
        finally:
            with torch.no_grad():
                for buffer, copy in buffers:
                    buffer.copy_(copy)
            for parameter, grad in grads:
                parameter.grad = grad
