"""One training step of a plan: the state it holds and the operations it runs.

:class:`offremat.executor.PlanExecutor` makes a :class:`_Step` for each forward; the step runs
the host actions of the plan's forward half, and, when autograd calls back, those of its
backward half. The design notes of :mod:`offremat.executor` apply; this module is their
mechanics: where each plan tensor is (:class:`_PlanTensor`) and what each op does to it; what
the step measured is in :mod:`offremat._stats`.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Sequence
from contextlib import ExitStack, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.autograd.graph import GradientEdge, get_gradient_edge

from offremat._deferred import DeferringPacker, Refill, StopRecomputation
from offremat._memory import Residency, StorageRecord, TensorRef
from offremat._rng import RngState, cuda_device_indices, module_generators, replayed_rng
from offremat._schedule import ISSUE, RELEASE, HostAction
from offremat._stage import (
    AutocastState,
    GradSlot,
    SavedTensorPacker,
    check_unmodified,
    check_versions,
    enter_stage,
    frozen_running_stats,
    norm_layers,
    parameter_storages,
)
from offremat._stats import OutOfMemoryAdvice, StepTiming
from offremat._tensors import Structure, flatten, is_differentiable, storage_key, unflatten
from offremat.measure import StepMemory
from solvers.plan import (
    ACTIVATION,
    BACKWARD,
    F_ALL,
    F_NONE,
    FREE,
    OFFLOAD,
    PREFETCH,
    SAVED,
    Op,
)

if TYPE_CHECKING:
    from offremat.executor import PlanExecutor


class _PlanTensor:
    """One of the plan's tensors (a_i, x̄_i or δ_i): references to its tensors, storages held.

    For x̄_i, ``edges`` are the gradient edges of stage i's outputs (the roots of B(i)),
    ``packer`` holds what autograd saved and ``slot`` receives δ_{i-1}.
    """

    __slots__ = ("diff", "edges", "packer", "records", "refs", "slot", "structure")

    def __init__(
        self,
        refs: list[TensorRef | None],
        structure: Structure | None,
        records: tuple[StorageRecord, ...],
    ):
        self.refs = refs
        self.structure = structure
        self.records = records
        self.edges: list[GradientEdge | None] = []
        self.packer: SavedTensorPacker | None = None
        self.slot: GradSlot | None = None
        self.diff: list[int] = []

    @property
    def tensors(self) -> list[torch.Tensor | None]:
        """The tensors, over the storages resident now."""
        return [None if ref is None else ref.get() for ref in self.refs]


@dataclass
class _KeptGraph:
    """The graph of a stage's latest F_ck or F_none, its saved tensors still to recompute."""

    packer: DeferringPacker
    slot: GradSlot | None
    diff: list[int]
    edges: list[GradientEdge | None]


class _Step:
    """The state of one training step, from the forward to the end of the backward."""

    def __init__(
        self,
        executor: PlanExecutor,
        tensors: list[torch.Tensor],
        structure: Structure,
        device: torch.device,
        trainable: list[bool],
    ):
        self.executor = executor
        self.ops = executor.plan.ops
        self.length = executor.chain.length
        self.names = executor.chain.stage_names
        self.device = device
        pool, self.streams = executor._resources(device)
        self.excluded = parameter_storages(executor.stages)
        self.residency = Residency(device, pool, self.streams, fixed=self.excluded)
        # A forward whose output is dropped never gets its backward: close then, on collection.
        self._closer = weakref.finalize(self, self.residency.close)
        self.anchor = executor._anchor(device)
        self.norms = [norm_layers(stage) for stage in executor.stages]
        self.cuda_devices = cuda_device_indices(device)
        self.generators = [module_generators(stage) for stage in executor.stages]
        self.autocast = [AutocastState.capture(t) for t in sorted({device.type, "cpu"})]
        self.trainable = trainable
        # flags[i][k]: whether tensor k of a_i carries a gradient, as in plain autograd.
        self.flags: dict[int, list[bool]] = {
            0: [t.requires_grad and is_differentiable(t) for t in tensors]
        }
        # A plan tensor can have a version on the device and another whose bytes are on the
        # host (the same one after a prefetch, a different one after a recomputation).
        self.on_device: dict[tuple[str, int], _PlanTensor] = {}
        self.on_host: dict[tuple[str, int], _PlanTensor] = {}
        self.offloaded_by: dict[int, _PlanTensor] = {}
        self.grads: dict[int, _PlanTensor] = {}
        self.rng: dict[int, RngState] = {}
        self.kept: dict[int, _KeptGraph] = {}
        self.produced: dict[tuple[str, int], Any] = {}
        self.in_backward = False
        self.accumulate = True
        self.peak = 0
        self.output_structure: Structure | None = None
        self.outputs: list[torch.Tensor] | None = None
        self.marks: list[Any] = []
        self.memory = StepMemory(device, tensors) if executor.measure_memory else None
        # The caller's input: resident for the whole step, never moved.
        refs: list[TensorRef | None] = [TensorRef(t) for t in tensors]
        source = _PlanTensor(refs, structure, self.residency.hold(refs, movable=False))
        self.on_device[(ACTIVATION, 0)] = source

    # The two halves of the plan.

    def run_forward(self) -> tuple[torch.Tensor, ...]:
        if self.memory is not None:
            self.memory.__enter__()
        self._mark()
        self.peak = self.residency.live_bytes
        try:
            with self._out_of_memory_advice():
                self._run(self.executor.forward_actions)
        except BaseException:
            self._close()
            raise
        finally:
            if self.memory is not None:
                self.memory.pause()
        self._mark()
        assert self.outputs is not None
        outputs, self.outputs = self.outputs, None
        return tuple(output.detach() for output in outputs)

    def abandon(self) -> None:
        """The backward will not run: settle copies and give back everything now."""
        if self.memory is not None:
            self.memory.resume()
            self.memory.__exit__(None, None, None)
        self._close()

    def run_backward(
        self, grads: tuple[torch.Tensor | None, ...], accumulate: bool = True
    ) -> list[torch.Tensor | None]:
        """The plan's backward half; with ``accumulate`` False, parameters' .grad is left alone."""
        self.accumulate = accumulate
        if self.streams is not None:
            self.streams.compute = torch.cuda.current_stream(self.device)
        if self.memory is not None:
            self.memory.resume()
        try:
            self._mark()
            self.in_backward = True
            refs = [None if g is None else TensorRef(g) for g in grads]
            held = self.residency.hold(r for r in refs if r is not None)
            self.grads[self.length] = _PlanTensor(refs, None, held)
            with self._out_of_memory_advice():
                self._run(self.executor.backward_actions)
            first_grads = self.grads.pop(0).tensors
        finally:
            self._close()
        self._mark()
        if self.memory is not None:
            self.memory.__exit__(None, None, None)
        self.executor._last = StepTiming(self.device, self.peak, self.marks, self.memory)
        wanted = self.flags[0]  # the input tensors that carry a gradient
        return [g if want else None for g, want in zip(first_grads, wanted, strict=True)]

    def _close(self) -> None:
        """Settle copies and give back host buffers; drop every tensor of the step."""
        self._closer()  # closes the residency once, whoever calls first
        self.on_device.clear()
        self.on_host.clear()
        self.offloaded_by.clear()
        self.grads.clear()
        self.kept.clear()

    def _run(self, actions: Sequence[HostAction]) -> None:
        for action in actions:
            op = self.ops[action.position]
            if action.kind == RELEASE:
                self._release(action.position, op)
            elif action.kind == ISSUE:
                self._memory_op(action.position, op)
            elif op.kind == BACKWARD:
                self._backward(op.index)
            elif action.position in self.executor.refills and op.index in self.kept:
                self._refill(op.index)
            else:
                self._forward(op)

    # Memory operations.

    def _release(self, position: int, op: Op) -> None:
        """Free the device bytes that the offload at ``position`` copied, unless needed again."""
        offloaded = self.offloaded_by.pop(position)
        still_away = self.on_host.get(op.tensor) is offloaded
        if still_away and self.on_device.get(op.tensor) is not offloaded:
            self.residency.release(offloaded.records)

    def _memory_op(self, position: int, op: Op) -> None:
        key = op.tensor
        if op.kind == OFFLOAD:
            tensor = self.on_device.pop(key)
            previous = self.on_host.get(key)
            self.residency.offload(
                tensor.records, self.produced.get(key), newly_away=previous is not tensor
            )
            if previous is not None and previous is not tensor:
                self.residency.drop(previous.records, resident=False)
            self.on_host[key] = tensor
            self.offloaded_by[position] = tensor
        elif op.kind == PREFETCH:
            tensor = self.on_host[key]
            self.residency.prefetch(tensor.records)
            self.on_device[key] = tensor
            self.produced.pop(key, None)
            self.peak = max(self.peak, self.residency.live_bytes)
        elif op.kind == FREE:
            self._drop_resident(key)

    def _drop(self, key: tuple[str, int]) -> None:
        """Nothing reads ``key`` again: its host copy goes first, then its device bytes."""
        away = self.on_host.pop(key, None)
        if away is not None:
            self.residency.drop(away.records, resident=False)
        self._drop_resident(key)

    def _source(self, index: int) -> _PlanTensor:
        """The resident a_index: by itself, or as the output of x̄_index."""
        for key in ((ACTIVATION, index), (SAVED, index)):
            if key in self.on_device:
                return self.on_device[key]
        raise RuntimeError(f"a{index} is not resident; the plan was validated, so this is a bug")

    # Compute operations.

    def _forward(self, op: Op) -> None:
        i = op.index
        name = self.names[i - 1]
        stage = self.executor.stages[i - 1]
        source = self._source(i - 1)
        self.residency.use(source.records)
        # A checkpoint changed in place since it was made would recompute another activation.
        check_versions(name, source.refs)
        inputs = source.tensors
        first = i not in self.flags
        if first:
            rng = RngState.capture(self.cuda_devices, self.generators[i - 1])
        else:
            rng = self.rng.get(i)
        versions = [tensor._version for tensor in inputs]
        packer = slot = None
        diff: list[int] = []
        excluded = self.excluded
        with ExitStack() as stack:
            if not first:
                if rng is not None:
                    stack.enter_context(replayed_rng(rng))
                copies = stack.enter_context(frozen_running_stats(self.norms[i - 1]))
                excluded = excluded | {storage_key(copy) for copy in copies}
            for state in self.autocast:
                state.enter(stack)
            # F_ck and F_none keep their graph without its saved tensors (see _deferred).
            grad = op.kind == F_ALL or self.trainable[i - 1] or any(self.flags[i - 1])
            if grad:
                stack.enter_context(torch.enable_grad())
                diff = [k for k, flag in enumerate(self.flags[i - 1]) if flag]
                if op.kind == F_ALL:
                    packer = SavedTensorPacker(name, inputs, excluded)
                else:
                    expected = self.executor.pack_counts.get(i)
                    packer = DeferringPacker(name, inputs, excluded, expected)
                slot = GradSlot()
                inputs = enter_stage(inputs, diff, slot, self.anchor)
                stack.enter_context(packer.hooks())
                if isinstance(packer, DeferringPacker):
                    stack.enter_context(packer.watching())
            else:
                stack.enter_context(torch.no_grad())
            result = stage(unflatten(inputs, source.structure))
        check_unmodified(name, source.tensors, versions)
        tensors, structure = flatten(result)
        del result
        if first:
            self.flags[i] = self._gradient_flags(i, grad, inputs, tensors)
            if rng is not None and not rng.unchanged():
                self.rng[i] = rng
            del rng
        del inputs
        is_output = i == self.length and self.outputs is None and not self.in_backward
        if is_output:
            self.outputs, self.output_structure = tensors, structure
        refs = [TensorRef(t.detach(), original=t) for t in tensors]
        held = refs + (packer.refs if packer is not None else [])
        records = self.residency.hold(held, movable=not is_output)
        produced = _PlanTensor(refs, structure, records)
        edges = [get_gradient_edge(t) if t.requires_grad else None for t in tensors]
        if packer is not None:
            packer.inputs = []  # B(i) binds whichever copy of a_{i-1} is resident then
        if op.kind == F_ALL:
            produced.edges = edges
            produced.packer, produced.slot, produced.diff = packer, slot, diff
        elif isinstance(packer, DeferringPacker):
            self.kept[i] = _KeptGraph(packer, slot, diff, edges)
            # The latest count: a compiled stage's first forward runs eagerly (_deferred).
            self.executor.pack_counts[i] = len(packer.slots)
        del edges
        del tensors
        key = (SAVED if op.kind == F_ALL else ACTIVATION, i)
        self.on_device[key] = produced
        if self.streams is not None:
            self.produced[key] = self.streams.compute.record_event()
        self.peak = max(self.peak, self.residency.live_bytes)
        if op.kind == F_NONE:
            self._drop_resident((ACTIVATION, i - 1))

    def _gradient_flags(
        self, i: int, grad: bool, inputs: list[torch.Tensor], outputs: list[torch.Tensor]
    ) -> list[bool]:
        """Which of a_i's tensors carry a gradient in plain autograd.

        A grad-enabled forward knows it from autograd. A forward without autograd assumes so
        for every floating output of a stage with a trainable parameter or a gradient-carrying
        input, except what it passes on unchanged from an input without one (a target, a mask).
        """
        if grad:
            return [t.requires_grad and is_differentiable(t) for t in outputs]
        upstream = self.trainable[i - 1] or any(self.flags[i - 1])
        constant = {
            storage_key(t) for t, flag in zip(inputs, self.flags[i - 1], strict=True) if not flag
        }
        return [
            upstream and is_differentiable(t) and storage_key(t) not in constant for t in outputs
        ]

    def _refill(self, i: int) -> None:
        """F_all(i) right before B(i), on the graph an earlier forward kept: see _deferred."""
        kept = self.kept.pop(i)
        name = self.names[i - 1]
        source = self._source(i - 1)
        self.residency.use(source.records)
        check_versions(name, source.refs)
        refs = []
        if not kept.packer.empty:
            refill = Refill(kept.packer)
            rng = self.rng.get(i)
            with ExitStack() as stack:
                if rng is not None:
                    stack.enter_context(replayed_rng(rng))
                stack.enter_context(frozen_running_stats(self.norms[i - 1]))
                for state in self.autocast:
                    state.enter(stack)
                stack.enter_context(torch.enable_grad())
                inputs = enter_stage(source.tensors, kept.diff, GradSlot(), self.anchor)
                stack.enter_context(refill.running())
                with suppress(StopRecomputation):
                    self.executor.stages[i - 1](unflatten(inputs, source.structure))
                if not refill.complete:
                    raise refill.incomplete()
                del inputs
            refs = refill.refs
        produced = _PlanTensor([], None, self.residency.hold(refs))
        produced.edges, produced.packer = kept.edges, kept.packer
        produced.slot, produced.diff = kept.slot, kept.diff
        self.on_device[(SAVED, i)] = produced
        if self.streams is not None:
            self.produced[(SAVED, i)] = self.streams.compute.record_event()
        self.peak = max(self.peak, self.residency.live_bytes)

    def _drop_resident(self, key: tuple[str, int]) -> None:
        tensor = self.on_device.pop(key, None)
        if tensor is not None:
            self.residency.drop(tensor.records, resident=True)

    def _backward(self, i: int) -> None:
        saved = self.on_device[(SAVED, i)]
        grad = self.grads[i]
        source = self._source(i - 1)
        self.residency.use(saved.records)
        self.residency.use(source.records)
        assert saved.packer is not None and saved.slot is not None
        saved.packer.inputs = source.tensors
        pairs = [
            (edge, g)
            for edge, g in zip(saved.edges, grad.tensors, strict=True)
            if g is not None and edge is not None
        ]
        if pairs and (self.accumulate or saved.diff):
            # Without accumulation only the path to the stage's inputs runs: through
            # StageInput, whose input is the anchor.
            torch.autograd.backward(
                [e for e, _ in pairs],
                [g for _, g in pairs],
                inputs=None if self.accumulate else [self.anchor],
            )
        grads: list[torch.Tensor | None] = [None] * len(source.refs)
        for k, g in zip(saved.diff, saved.slot.grads or (), strict=False):
            grads[k] = g
        saved.slot.grads = None
        refs = [None if g is None else TensorRef(g) for g in grads]
        del grads, pairs
        held = self.residency.hold(r for r in refs if r is not None)
        self.grads[i - 1] = _PlanTensor(refs, None, held)
        self.peak = max(self.peak, self.residency.live_bytes)
        gone = self.grads.pop(i)
        self.residency.drop(gone.records)
        # Nothing reads x̄_i, or a_{i-1} by itself, after B(i).
        for key in ((SAVED, i), (ACTIVATION, i - 1)):
            self._drop(key)

    def _mark(self) -> None:
        if self.streams is not None:
            self.marks.append(
                self.streams.compute.record_event(torch.cuda.Event(enable_timing=True))
            )
        else:
            self.marks.append(time.perf_counter())

    def _out_of_memory_advice(self) -> OutOfMemoryAdvice:
        return OutOfMemoryAdvice(self.executor.plan)
