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
import statistics
import weakref
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.autograd.graph import get_gradient_edge

from offremat._blocks import (
    chain_blocks,
    check_device,
    group_evenly,
    group_name,
    stage_module,
    untouched,
)
from offremat._clock import MarkingPacker, mark, seconds, timed
from offremat._link import measure_link
from offremat._scan import fixed_storages, scan_modules
from offremat._stage import (
    GradSlot,
    SavedTensorPacker,
    check_unmodified,
    enter_stage,
)
from offremat._tensors import (
    allocated_bytes,
    copied,
    flatten,
    is_differentiable,
    storage_allocated_bytes,
    storage_bytes,
    unflatten,
    unique_storages,
)
from offremat.measure import StepMemory
from solvers.budget import parse_bandwidth
from solvers.chain import Chain, Stage

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Measured:
    """One stage's figures, before they become a :class:`Stage`."""

    fwd_s: float
    bwd_s: float
    out_bytes: int
    saved_bytes: int
    fwd_tmp_bytes: int
    bwd_tmp_bytes: int
    nograd_fwd_tmp_bytes: int
    grad_bytes: int
    refill_s: float | None = None


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
    with untouched(modules, device):
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
            nograd_fwd_tmp_bytes=m.nograd_fwd_tmp_bytes,
            grad_bytes=m.grad_bytes,
            refill_s=m.refill_s,
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
        frozen_stages=frozen_prefix([stage_module(group) for group in grouped], input_tensors),
        input_bytes=storage_bytes(input_tensors),
        input_grad_bytes=gradient_bytes(input_tensors),
        # The caller's output and the gradient it seeds stay alive to the end of the backward.
        held_bytes=chain_stages[-1].out_bytes + chain_stages[-1].grad_bytes,
        stages=chain_stages,
        link=link,
        metadata=metadata,
    )


def frozen_prefix(stages: Sequence[nn.Module], inputs: Sequence[torch.Tensor]) -> int:
    """How many first stages need no backward: with an input that needs no gradient, those
    before the first with a trainable parameter (all of them: none, as nothing trains)."""
    if any(t.requires_grad for t in inputs):
        return 0
    return next((k for k, stage in enumerate(stages) if scan_modules(stage).trainable), 0)


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


def _profile_all(
    stages: Sequence[tuple[str, nn.Module]],
    example_input: Any,
    warmup: int,
    repeats: int,
    sizes_only: bool = False,
) -> list[_Measured]:
    """Profile each stage on the output of the one before, starting from the example input.

    Storages of the example input that a stage passes on (targets, masks) are the input a_0's,
    resident for the whole step and counted once there, never in a stage's sizes.
    """
    tensors, structure = flatten(example_input)
    flags = [t.requires_grad and is_differentiable(t) for t in tensors]
    excluded = set(fixed_storages(scan_modules(module) for _, module in stages))
    shared = set(unique_storages(tensors))
    value = unflatten([t.detach() for t in tensors], structure)
    results = []
    for name, module in stages:
        # Sizes only group blocks into stages; the in-place check is for the stages themselves.
        stage = _StageProfile(name, module, value, flags, excluded | shared, not sizes_only)
        last = len(results) == len(stages) - 1
        measured, output = stage.measure(warmup, repeats, sizes_only, last)
        results.append(measured)
        out_tensors, out_structure = flatten(output)
        # The grad-enabled forward knows which outputs carry a gradient, as plain autograd.
        flags = [t.requires_grad and is_differentiable(t) for t in out_tensors]
        value = unflatten([t.detach() for t in out_tensors], out_structure)
    return results


class _StageProfile:
    """One stage run as the executor runs it: the same boundary, hooks and gradient flow."""

    def __init__(
        self,
        name: str,
        module: nn.Module,
        value: Any,
        flags: list[bool],
        excluded: set[int],
        check_inputs: bool = True,
    ):
        self.name = name
        self.module = module
        self.tensors, self.structure = flatten(value)
        self.device = self.tensors[0].device if self.tensors else torch.device("cpu")
        self.excluded = excluded
        self.diff = [k for k, flag in enumerate(flags) if flag]
        self.anchor = torch.empty(0, device=self.device, requires_grad=True)
        self.check_inputs = check_inputs

    def forward(
        self, grad: bool, marks: list[Any] | None = None
    ) -> tuple[Any, GradSlot, SavedTensorPacker]:
        """One forward; with ``grad``, through the executor's boundary and pack hooks. With
        ``marks``, a clock mark (:func:`offremat._clock.mark`) at its start and at each tensor it
        holds."""
        slot = GradSlot()
        if marks is None:
            packer = SavedTensorPacker(self.name, self.tensors, self.excluded)
        else:
            marks.append(mark(self.device))
            packer = MarkingPacker(self.name, self.tensors, self.excluded, marks, self.device)
        versions = [t._version for t in self.tensors]
        with ExitStack() as stack:
            if grad:
                stack.enter_context(torch.enable_grad())
                stack.enter_context(packer.hooks())
                inputs = enter_stage(self.tensors, self.diff, slot, self.anchor)
            else:
                stack.enter_context(torch.no_grad())
                inputs = self.tensors
            output = self.module(unflatten(inputs, self.structure))
        if self.check_inputs:
            check_unmodified(self.name, self.tensors, versions)
        return output, slot, packer

    @staticmethod
    def incoming(output: Any) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """The outputs that carry a gradient, and a δ_i for them (resident before B(i))."""
        outputs = [t for t in flatten(output)[0] if t.requires_grad]
        return outputs, [torch.ones_like(t) for t in outputs]

    def backward(
        self, outputs: list[torch.Tensor], grads: list[torch.Tensor], slot: GradSlot
    ) -> list[torch.Tensor]:
        """B(i) as in training: parameter gradients accumulate, δ_{i-1} lands in the slot."""
        if outputs:
            torch.autograd.backward(outputs, grads)
        return [g for g in slot.grads or () if g is not None]

    def measure(
        self, warmup: int, repeats: int, sizes_only: bool, last: bool
    ) -> tuple[_Measured, Any]:
        """Sizes and temporaries, measured independently (:mod:`offremat.measure`); times.
        ``last``: the chain's last stage, whose outputs its caller keeps through B(i)."""
        # Gradients exist, as in every training step after the first: a backward then holds
        # only transient parameter gradients, which count as its temporaries. They exist for
        # this stage alone, so that profiling a new shape mid-training costs one stage's.
        made = [p for p in self.module.parameters() if p.requires_grad and p.grad is None]
        for parameter in made:
            parameter.grad = torch.zeros_like(parameter)
        try:
            return self._measure(warmup, repeats, sizes_only, last)
        finally:
            for parameter in made:
                parameter.grad = None

    def _measure(
        self, warmup: int, repeats: int, sizes_only: bool, last: bool
    ) -> tuple[_Measured, Any]:
        if self.device.type == "cuda":  # first-call workspaces (autotuning) are no temporaries
            output, slot, _ = self.forward(grad=True)
            self.backward(*self.incoming(output), slot)
            del output, slot
        with StepMemory(self.device) as forward_memory:
            output, slot, packer = self.forward(grad=True)
        out_tensors = flatten(output)[0]
        grad_bytes = gradient_bytes(out_tensors)
        out_storages = unique_storages(out_tensors)
        out_bytes = sum(
            storage_allocated_bytes(s) for k, s in out_storages.items() if k not in self.excluded
        )
        by_nodes = packer.saved_storages()
        saved = {**by_nodes, **out_storages}
        saved_bytes = sum(
            storage_allocated_bytes(s) for k, s in saved.items() if k not in self.excluded
        )
        # The outputs this stage made go to the next stage as copies, so that the backward
        # below holds them only as B(i) does: the chain's output stays (its caller holds it);
        # any other goes as B(i) starts, or once the node that saved it has run
        # (offremat._step_compute). The backward frees the saved tensors as it goes.
        inputs = unique_storages(self.tensors)
        made = set() if last else out_storages.keys() - self.excluded - inputs.keys()
        handed = unflatten(copied(out_tensors, made), flatten(output)[1])
        backward_memory = StepMemory(
            self.device,
            existing=[
                s
                for k, s in saved.items()
                if k not in self.excluded and (k not in out_storages or k in made)
            ],
        )
        # Measured from after that release: the peak above a baseline that still held them
        # could not fall below it, and bytes let go at once would read as no change at all.
        # Only what really goes: a module that keeps its output (as logging code does) holds it.
        unsaved = [
            (weakref.ref(s), storage_allocated_bytes(s))
            for k, s in out_storages.items()
            if k in made and k not in by_nodes
        ]
        outputs, grads = self.incoming(output)
        roots = [get_gradient_edge(t) for t in outputs]
        del saved, out_storages, packer, by_nodes, inputs, output, outputs
        out_tensors.clear()  # the profiler's last reference to the outputs, as at B(i)'s start
        let_go = sum(nbytes for storage, nbytes in unsaved if storage() is None)
        del unsaved
        with backward_memory:
            produced = sum(
                map(
                    storage_allocated_bytes,
                    unique_storages(self.backward(roots, grads, slot)).values(),
                )
            )
        del slot, grads, roots
        with StepMemory(self.device) as plain_memory:
            plain_output = self.forward(grad=False)[0]
        # A forward without autograd (F_ck, F_none) frees its intermediates as it goes, so its
        # transient peak above its output differs from the grad-enabled one above x̄_i.
        fwd_tmp = max(forward_memory.step_peak_bytes - saved_bytes, 0)
        nograd_fwd_tmp = max(plain_memory.step_peak_bytes - out_bytes, 0)
        # The incoming gradient δ_i existed before the backward; δ_{i-1} is counted by the plan.
        # Negative when the backward has freed part of x̄_i by its peak (solvers.chain.Stage).
        bwd_tmp = max(backward_memory.step_peak_bytes - produced - let_go, -saved_bytes)
        del plain_output
        if sizes_only:
            return (
                _Measured(
                    0.0, 0.0, out_bytes, saved_bytes, fwd_tmp, bwd_tmp, nograd_fwd_tmp, grad_bytes
                ),
                handed,
            )
        forward_times, backward_times, refill_times = [], [], []
        for attempt in range(warmup + repeats):
            marks: list[Any] = []
            (timed_output, timed_slot, _), forward_s = timed(
                self.device, partial(self.forward, True, marks)
            )
            incoming = self.incoming(timed_output)
            _, backward_s = timed(self.device, partial(self.backward, *incoming, timed_slot))
            if attempt >= warmup:
                forward_times.append(forward_s)
                backward_times.append(backward_s)
                # A refill (offremat._deferred) runs this forward up to the last tensor it
                # holds, and nothing at all for a stage that holds none.
                refill_times.append(seconds(self.device, marks[0], marks[-1]))
            del timed_output, timed_slot, incoming
        forward_s = statistics.median(forward_times)
        measured = _Measured(
            forward_s,
            statistics.median(backward_times),
            out_bytes,
            saved_bytes,
            fwd_tmp,
            bwd_tmp,
            nograd_fwd_tmp,
            grad_bytes,
            min(statistics.median(refill_times), forward_s),
        )
        return measured, handed


def gradient_bytes(tensors: Sequence[torch.Tensor]) -> int:
    """Bytes of the gradients of ``tensors``: one per tensor that carries a gradient, as the
    device's allocator counts it (:func:`offremat._tensors.allocated_bytes`)."""
    return sum(
        allocated_bytes(t.numel() * t.element_size(), t.device)
        for t in tensors
        if t.requires_grad and is_differentiable(t)
    )
