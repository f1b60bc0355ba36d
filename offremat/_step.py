"""One training step of a plan: the state it holds and the operations it runs.

:class:`offremat.executor.PlanExecutor` makes a :class:`_Step` for each forward; the step runs
the host actions of the plan's forward half, and, when autograd calls back, those of its
backward half, as the simulator listed them (:mod:`solvers.host`). The design notes of
:mod:`offremat.executor` apply; this module is their mechanics: where each plan tensor is
(:class:`~offremat._step_compute.PlanTensor`) and the memory ops; the compute ops are in
:mod:`offremat._step_compute`, what the step measured in :mod:`offremat._stats`.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from offremat._backend_flags import BackendFlags
from offremat._buffers import FirstForward, shared_buffer_keys
from offremat._call_checks import refuse_disabled_saved_tensor_hooks
from offremat._call_state import callers_saved_tensor_hooks_set_aside
from offremat._clock import mark
from offremat._held import TensorRef
from offremat._memory import Residency
from offremat._rng import HostRandomReader, RngState, cuda_device_indices
from offremat._scan import ModuleScan, fixed_storages
from offremat._shared_grads import SharedGradients
from offremat._stage import AutocastState
from offremat._stage_sizes import StageSizes
from offremat._stats import OutOfMemoryAdvice, StepTiming
from offremat._step_budget import fresh_parameters, gradient_bytes
from offremat._step_compute import Compute, KeptGraph, PlanTensor
from offremat._step_reports import report_grown_sizes, report_held_over_budget
from offremat._step_settle import settle_measurement
from offremat._tensors import Structure, TensorKind, is_differentiable, reached_bytes
from offremat.measure import StepMemory, is_measurement_hook
from solvers.host import ISSUE, RELEASE, HostAction
from solvers.plan import (
    ACTIVATION,
    BACKWARD,
    FREE,
    OFFLOAD,
    PREFETCH,
    Op,
)
from solvers.semantics import stage_input

if TYPE_CHECKING:
    from offremat.executor import PlanExecutor


logger = logging.getLogger(__name__)


# Every step, of any model, whose backward has not run: a hooked parameter two of them hold
# is refused when one backward runs both (see steps_sharing).
_PENDING: weakref.WeakSet[_Step] = weakref.WeakSet()


class StepsInFlight:
    """The steps of one model whose forward ran and whose backward has not yet.

    The budget is per step: a second training forward before the first one's backward (R-Drop,
    a siamese pair) holds both steps' activations. That is the caller's choice, said once.
    Different models (a GAN's generator and discriminator) have budgets of their own.
    """

    def __init__(self) -> None:
        self.steps: weakref.WeakSet[_Step] = weakref.WeakSet()
        self.warned = False

    def add(self, step: _Step) -> None:
        """Count ``step``, warning once if another still waits for its backward."""
        if not self.warned and any(other.awaiting_backward for other in self.steps):
            self.warned = True
            logger.warning(
                "a training forward began while an earlier forward of the same model still "
                "waits for its backward: both steps' activations are held, up to twice the "
                "budget; run each backward before the next forward, or put both inputs in "
                "one batch. (torch.autograd.grad, or backward(inputs=...), with respect to "
                "the chain's parameters does not run it: use loss.backward() and read .grad)"
            )
        self.steps.add(step)
        _PENDING.add(step)

    def __getstate__(self) -> dict[str, bool]:
        # A copy (pickle, deepcopy) has no step in flight: those belong to this process.
        return {"warned": self.warned}

    def __setstate__(self, state: dict[str, bool]) -> None:
        self.steps = weakref.WeakSet()
        self.warned = state["warned"]


class _Step(Compute):
    """The state of one training step, from the forward to the end of the backward."""

    def __init__(
        self,
        executor: PlanExecutor,
        tensors: list[torch.Tensor],
        structure: Structure,
        device: torch.device,
        scans: list[ModuleScan],
        measuring: bool = False,
    ):
        self.executor = executor
        self.ops = executor.plan.ops
        self.length = executor.chain.length
        self.names = executor.chain.stage_names
        self.device = device
        arena, self.streams = executor._resources(device)
        self.excluded = fixed_storages(scans)
        # Those keys are addresses. A forward that replaces a buffer (a counter) frees the old
        # one's storage, whose address a saved tensor could then take and be mistaken for a
        # parameter: held to the end of the step, they keep their addresses.
        self.fixed_alive = [
            tensor
            for scan in scans
            for tensor in (*scan.parameters, *(m._buffers[n] for m, n in scan.buffers))
        ]
        self.residency = Residency(device, arena, self.streams, fixed=self.excluded)
        self.anchor = executor._anchor(device)
        self.norms = [scan.norms for scan in scans]
        self.modules = [scan.modules for scan in scans]
        self.buffers = [scan.buffers for scan in scans]
        # Buffers that more than one stage holds: offremat._buffers keeps their copies.
        self.shared_buffers = (
            shared_buffer_keys(self.buffers) if executor.recomputed else frozenset()
        )
        self.parameters = [scan.parameters for scan in scans]
        # Per recomputed stage, its buffers' values from before its first forward and its
        # parameters' versions.
        self.first_forwards: dict[int, FirstForward] = {}
        # Per stage, the dtype, shape and device of each output of its first forward.
        self.output_kinds: dict[int, list[TensorKind]] = {}
        self.cuda_devices = cuda_device_indices(device)
        self.generators = [scan.generators for scan in scans]
        self.autocast = AutocastState.of_step(device)
        # The kernels the first forwards run, which every recomputation runs too.
        self.backend_flags = BackendFlags.now()
        self.trainable = [bool(scan.trainable) for scan in scans]
        self.shared = SharedGradients([scan.trainable for scan in scans])
        # flags[i][k]: whether tensor k of a_i carries a gradient, as in plain autograd.
        self.flags: dict[int, list[bool]] = {
            0: [t.requires_grad and is_differentiable(t) for t in tensors]
        }
        # A plan tensor can have a version on the device and another whose bytes are on the
        # host (the same one after a prefetch, a different one after a recomputation).
        self.on_device: dict[tuple[str, int], PlanTensor] = {}
        self.on_host: dict[tuple[str, int], PlanTensor] = {}
        self.offloaded_by: dict[int, PlanTensor] = {}
        self.grads: dict[int, PlanTensor] = {}
        # Per recomputed stage, the generators' states its recomputations replay.
        self.rng: dict[int, RngState] = {}
        self.host_random = HostRandomReader()
        self.kept: dict[int, KeptGraph] = {}
        self.produced: dict[tuple[str, int], Any] = {}
        self.in_backward = False
        self.accumulate = True
        # The step's node in the autograd graph, set by its forward (weak: the node holds it).
        self.node: weakref.ref[Any] | None = None
        self.peak = 0
        # What each stage held, against its chain's sizes (offremat._stage_sizes).
        self.sizes = StageSizes()
        self.output_structure: Structure | None = None
        self.outputs: list[torch.Tensor] | None = None
        self.marks: list[Any] = []
        # The parameters whose gradients this step makes: the budget does not count them.
        fresh = fresh_parameters(scans) if measuring else []
        self.memory = (
            StepMemory(device, tensors, gradients_of=fresh, allocator=False) if measuring else None
        )
        self.verifying = executor.verify_next
        # Measured for a check now and then alone (offremat._outgrown.checked_now_and_then).
        self.sampled, executor.sampling = executor.sampling, False
        # That check falls to the next step where this one's backward never runs (emptied
        # when it starts): the next was measured as a verification, its over said "planned
        # anew", its batch never profiled (a review of the keep-all path's twin).
        self.check_handed_on = [executor] if self.sampled else []
        # A forward whose output is dropped never gets its backward: close then, on collection.
        self._closer = weakref.finalize(
            self, _settle, self.residency, self.memory, self.check_handed_on
        )
        self.new_grad_bytes = gradient_bytes(fresh)
        # The caller's input: resident for the whole step, never moved.
        refs: list[TensorRef | None] = [TensorRef(t) for t in tensors]
        source = PlanTensor(refs, structure, self.residency.hold(refs, movable=False))
        self.residency.count_reached(reached_bytes(tensors))
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

    @property
    def awaiting_backward(self) -> bool:
        """Whether the forward has run and neither the backward nor an error closed it."""
        return self._closer.alive and not self.in_backward

    def abandon(self) -> None:
        """The backward will not run: settle copies and give back everything now."""
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
            if self.executor.recomputed:  # a recomputation packs with hooks of its own
                refuse_disabled_saved_tensor_hooks("this plan's backward recomputes, and runs")
            self._mark()
            self.in_backward = True
            self.check_handed_on.clear()
            refs = [None if g is None else TensorRef(g) for g in grads]
            held = self.residency.hold(r for r in refs if r is not None)
            self.grads[self.length] = PlanTensor(refs, None, held)
            with self._out_of_memory_advice(), callers_saved_tensor_hooks_set_aside():
                self._run(self.executor.backward_actions)
            first_grads = self.grads.pop(self.executor.chain.frozen_stages).tensors
            if self.memory is not None:
                self.memory.__exit__(None, None, None)
        finally:
            self._close()  # after an error, without a measurement
        self._mark()
        budgeted = None
        if self.memory is not None:
            budgeted = settle_measurement(
                self.executor,
                self.memory,
                self.new_grad_bytes,
                self.sizes,
                self.verifying,
                self.sampled,
            )
        else:
            report_held_over_budget(self.executor, self.peak)
            report_grown_sizes(self.executor, self.sizes)
        self.executor._last = StepTiming(
            self.device,
            self.peak,
            self.marks,
            self.memory,
            budgeted,
            self.executor.plan.budget_bytes,
        )
        wanted = self.flags[0]  # the input tensors that carry a gradient
        if self.executor.chain.frozen_stages:  # the input needs none, a_p's gradient is unused
            return [None] * len(wanted)
        return [g if want else None for g, want in zip(first_grads, wanted, strict=True)]

    def hooked_parameters(self) -> list[torch.Tensor]:
        """The trainable parameters of the stages that have hooks on their gradient."""
        return [
            p
            for parameters in self.parameters
            for p in parameters
            if p.requires_grad
            and (
                p._backward_hooks
                or not all(map(is_measurement_hook, (p._post_accumulate_grad_hooks or {}).values()))
            )
        ]

    def steps_sharing(self, hooked: list[torch.Tensor]) -> list[_Step]:
        """The other pending steps that this backward also runs and that hold one of
        ``hooked``.

        Each step's backward accumulates into ``.grad`` on its own, so the hooks of a
        parameter two steps hold (a model called twice before one backward, a block shared by
        two optimized models) would run once per step, each time on part of the gradient.
        """
        ids = {id(p) for p in hooked}
        sharing = []
        for other in list(_PENDING):
            node = None if other is self or other.node is None else other.node()
            if (
                node is not None
                and other.awaiting_backward
                and torch._C._will_engine_execute_node(node)
                and any(id(p) in ids for parameters in other.parameters for p in parameters)
            ):
                sharing.append(other)
        return sharing

    def _close(self) -> None:
        """Settle copies and give back host buffers; drop every tensor of the step."""
        self._closer()  # settles the residency and the measurement once, whoever calls first
        self.on_device.clear()
        self.on_host.clear()
        self.offloaded_by.clear()
        self.grads.clear()
        self.kept.clear()
        self.first_forwards.clear()
        self.fixed_alive.clear()

    def _run(self, actions: Sequence[HostAction]) -> None:
        for action in actions:
            op = self.ops[action.position]
            if action.kind == RELEASE:
                self._release(action.position, op)
            elif action.kind == ISSUE:
                self._memory_op(action.position, op)
            elif op.kind == BACKWARD:
                self._backward(op)
            elif action.position in self.executor.refills and op.index in self.kept:
                self._refill(op.index)
            else:
                self._forward(op, direct=action.position in self.executor.direct)

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
                self.residency.let_go(previous.refs)
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
            if self.on_device.get(key) is not away:
                self.residency.let_go(away.refs)
        self._drop_resident(key)

    def _source(self, i: int) -> PlanTensor:
        """Stage i's input a_{i-1} as resident now: by itself, or as the output of x̄_{i-1}."""
        key = stage_input(i, self.on_device)
        if key is None:
            raise RuntimeError(
                f"a{i - 1} is not resident; the plan was validated, so this is a bug"
            )
        return self.on_device[key]

    def _drop_resident(self, key: tuple[str, int]) -> None:
        tensor = self.on_device.pop(key, None)
        if tensor is not None:
            self.residency.drop(tensor.records, resident=True)
            if self.on_host.get(key) is not tensor:  # gone for good: no rebuild to come
                self.residency.let_go(tensor.refs)

    def _mark(self) -> None:
        # On CUDA the step's compute stream is the current one (set as each half starts).
        self.marks.append(mark(self.device))

    def _out_of_memory_advice(self) -> OutOfMemoryAdvice:
        return OutOfMemoryAdvice(self.executor.plan)


def _settle(
    residency: Residency, memory: StepMemory | None, check_handed_on: list[PlanExecutor]
) -> None:
    """Close a step's residency and drop its measurement, once: by its backward, an error, or
    the collection of a step whose backward never ran (whose hooks would stay on the
    parameters, taken for the caller's), whose check falls to the next step."""
    residency.close()
    if memory is not None:
        memory.discard()
    for executor in check_handed_on:
        executor.sampling = True
