"""Run a plan (``offremat.plan/1``) as the training step of a chain of PyTorch modules.

The whole chain is one autograd function, like the reentrant variant of
``torch.utils.checkpoint``: its forward runs the plan's operations up to the first backward,
its backward runs the rest, keeping, offloading (Beaumont, Eyraud-Dubois, Shilova 2021) and
recomputing (Herrmann, Beaumont et al. 2019) activations exactly as the plan says.

Design notes.

- Stages and their gradients: see :mod:`offremat._stage` (boundary, saved sets, RNG,
  BatchNorm, autocast). Each B(i) calls ``torch.autograd.backward`` on stage i's graph, so
  parameter gradients accumulate into ``.grad`` as plain autograd's do; like the reentrant
  checkpoint, this supports ``loss.backward()`` but not ``torch.autograd.grad`` with respect
  to parameters.
- Memory and copies: see :mod:`offremat._memory` (storages, deferred frees, pinned pool) and
  :mod:`offremat._schedule` (what the host issues around each compute op, and where the
  simulator's memory admission becomes a wait on an offload's event).
- Measurement: the executor counts the device bytes of the distinct storages it holds, the
  way the simulator counts (an op's output is counted before its inputs are released), and
  keeps the peak. On CUDA it also reads the allocator's peak, and times the step with events
  that are only synchronised when :attr:`PlanExecutor.stats` is read.
- State: everything about one step lives in a :class:`_Step`, made by the forward and kept by
  the autograd graph until the backward has used it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from offremat._memory import CudaStreams, HostBufferPool, Residency, StorageRecord
from offremat._schedule import COMPUTE, ISSUE, RELEASE, HostAction, host_schedule
from offremat._stage import (
    AutocastState,
    GradSlot,
    RngState,
    SavedTensorPacker,
    check_unmodified,
    cuda_device_indices,
    enter_stage,
    frozen_running_stats,
    has_trainable_parameters,
    norm_layers,
    parameter_storages,
    replayed_rng,
)
from offremat._tensors import (
    Structure,
    flatten,
    is_differentiable,
    storage_key,
    unflatten,
    unique_storages,
)
from solvers.budget import format_bytes
from solvers.chain import Chain
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
    Plan,
    PlanError,
    validate,
)
from solvers.simulator import simulate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class StepStats:
    """What the executor measured during one training step.

    - ``peak_activation_bytes``: the most device bytes held at once by the step's tensors
      (input, activations, saved sets, gradients of activations), counted per distinct storage
      the way the simulator counts them; temporaries inside an op are not seen.
    - ``step_time_s``: ``forward_time_s`` + ``backward_time_s``, the plan's forward and backward
      halves (the caller's loss in between is not counted), timed with CUDA events on a GPU.
    - ``max_memory_allocated_delta_bytes``: on CUDA, the allocator's peak during the step above
      what was allocated when it began (the step resets the peak statistics); None on CPU.
    """

    peak_activation_bytes: int
    step_time_s: float
    forward_time_s: float
    backward_time_s: float
    max_memory_allocated_delta_bytes: int | None
    device: str


class PlanExecutor:
    """Runs ``plan`` over ``stages``, the modules of ``chain``'s stages in order."""

    def __init__(self, stages: Sequence[nn.Module], plan: Plan, chain: Chain):
        if len(stages) != chain.length or plan.length != chain.length:
            raise ValueError(
                f"the plan has {plan.length} stages, the chain {chain.length} and the model "
                f"{len(stages)}: make the plan for this chain and the chain for this model"
            )
        problems = validate(plan, chain)
        if problems:
            raise PlanError(problems)
        self.stages = list(stages)
        self.plan = plan
        self.chain = chain
        self.simulation = simulate(plan, chain, plan.budget_bytes)
        actions = host_schedule(plan.ops, self.simulation)
        # The backward half starts with what the host does on the way to B(L).
        first_backward = next(
            action.turn
            for action in actions
            if action.kind == COMPUTE and plan.ops[action.position].kind == BACKWARD
        )
        self.forward_actions = tuple(a for a in actions if a.turn < first_backward)
        self.backward_actions = tuple(a for a in actions if a.turn >= first_backward)
        self._streams: dict[torch.device, CudaStreams] = {}
        self._pools: dict[torch.device, HostBufferPool] = {}
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._last: _Timing | None = None

    @property
    def stats(self) -> StepStats | None:
        """Figures of the last completed step (on CUDA, reading them waits for its end)."""
        return None if self._last is None else self._last.resolve()

    def __call__(self, value: Any) -> Any:
        """The model's output for input ``value``; its backward follows the plan."""
        tensors, structure = flatten(value)
        if not tensors:
            raise TypeError("the model input holds no tensor; pass the example input's kind")
        device = tensors[0].device
        trainable = [has_trainable_parameters(stage) for stage in self.stages]
        if not torch.is_grad_enabled() or not (
            any(trainable) or any(t.requires_grad for t in tensors)
        ):
            for stage in self.stages:
                value = stage(value)
            return value
        step = _Step(self, tensors, structure, device, trainable)
        outputs = _PlanFunction.apply(step, self._anchor(device), *tensors)
        return unflatten(outputs, step.output_structure)

    def _anchor(self, device: torch.device) -> torch.Tensor:
        if device not in self._anchors:
            self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return self._anchors[device]

    def _resources(self, device: torch.device) -> tuple[HostBufferPool, CudaStreams | None]:
        if device not in self._pools:
            cuda = device.type == "cuda"
            self._pools[device] = HostBufferPool(pinned=cuda)
            if cuda:
                self._streams[device] = CudaStreams(device)
        streams = self._streams.get(device)
        if streams is not None:
            streams.compute = torch.cuda.current_stream(device)
        return self._pools[device], streams


class _PlanFunction(torch.autograd.Function):
    """The chain as one autograd function: forward and backward follow the plan."""

    @staticmethod
    def forward(ctx: Any, step: _Step, anchor: torch.Tensor, *tensors: torch.Tensor) -> Any:
        outputs = step.run_forward()
        ctx.step = step
        ctx.set_materialize_grads(False)
        ctx.mark_non_differentiable(*[o for o in outputs if not is_differentiable(o)])
        return outputs

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> Any:
        step = ctx.step
        if step is None:
            raise RuntimeError(
                "backward ran twice through an offremat-optimized model; the plan frees its "
                "activations as it goes, so retain_graph=True is not supported: run the "
                "forward again"
            )
        ctx.step = None
        return (None, None, *step.run_backward(grads))


class _PlanTensor:
    """One of the plan's tensors (a_i, x̄_i or δ_i): torch tensors and the storages held."""

    __slots__ = ("diff", "packer", "records", "slot", "structure", "tensors")

    def __init__(
        self,
        tensors: list[torch.Tensor | None],
        structure: Structure | None,
        records: tuple[StorageRecord, ...],
    ):
        self.tensors = tensors
        self.structure = structure
        self.records = records
        self.packer: SavedTensorPacker | None = None
        self.slot: GradSlot | None = None
        self.diff: list[int] = []


@dataclass
class _Timing:
    """Clock readings of one step, resolved into :class:`StepStats` when asked."""

    device: torch.device
    peak_activation_bytes: int
    marks: list[Any]
    allocated_before: int | None
    allocated_peak: int | None

    def resolve(self) -> StepStats:
        if self.device.type == "cuda":
            self.marks[-1].synchronize()
            forward = self.marks[0].elapsed_time(self.marks[1]) / 1000
            backward = self.marks[2].elapsed_time(self.marks[3]) / 1000
        else:
            forward = self.marks[1] - self.marks[0]
            backward = self.marks[3] - self.marks[2]
        delta = None
        if self.allocated_peak is not None and self.allocated_before is not None:
            delta = self.allocated_peak - self.allocated_before
        return StepStats(
            peak_activation_bytes=self.peak_activation_bytes,
            step_time_s=forward + backward,
            forward_time_s=forward,
            backward_time_s=backward,
            max_memory_allocated_delta_bytes=delta,
            device=str(self.device),
        )


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
        self.device = device
        pool, self.streams = executor._resources(device)
        self.residency = Residency(pool, self.streams)
        self.anchor = executor._anchor(device)
        self.excluded = parameter_storages(executor.stages)
        self.norms = [norm_layers(stage) for stage in executor.stages]
        self.cuda_devices = cuda_device_indices(device)
        self.autocast = [AutocastState.capture(t) for t in {device.type, "cpu"}]
        # needs_grad[i]: whether a_i's floating tensors carry gradients in plain autograd.
        self.needs_grad = [any(t.requires_grad for t in tensors)]
        for i in range(1, self.length + 1):
            self.needs_grad.append(self.needs_grad[-1] or trainable[i - 1])
        self.input_requires_grad = [t.requires_grad for t in tensors]
        # A plan tensor can have a version on the device and another whose bytes are on the
        # host (the same one after a prefetch, a different one after a recomputation).
        self.on_device: dict[tuple[str, int], _PlanTensor] = {}
        self.on_host: dict[tuple[str, int], _PlanTensor] = {}
        self.offloaded_by: dict[int, _PlanTensor] = {}
        self.grads: dict[int, _PlanTensor] = {}
        self.rng: dict[int, RngState] = {}
        self.produced: dict[tuple[str, int], Any] = {}
        self.in_backward = False
        self.peak = 0
        self.output_structure: Structure | None = None
        self.outputs: list[torch.Tensor] | None = None
        self.marks: list[Any] = []
        self.allocated_before: int | None = None
        source = _PlanTensor(
            list(tensors), structure, self.residency.hold(unique_storages(tensors), external=True)
        )
        self.on_device[(ACTIVATION, 0)] = source

    # The two halves of the plan.

    def run_forward(self) -> tuple[torch.Tensor, ...]:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            self.allocated_before = torch.cuda.memory_allocated(self.device)
        self._mark()
        self.peak = self.residency.live_bytes
        with self._out_of_memory_advice():
            self._run(self.executor.forward_actions)
        self._mark()
        assert self.outputs is not None
        return tuple(output.detach() for output in self.outputs)

    def run_backward(self, grads: tuple[torch.Tensor | None, ...]) -> list[torch.Tensor | None]:
        if self.streams is not None:
            self.streams.compute = torch.cuda.current_stream(self.device)
        self._mark()
        self.in_backward = True
        present = [g for g in grads if g is not None]
        self.grads[self.length] = _PlanTensor(
            list(grads), None, self.residency.hold(unique_storages(present))
        )
        with self._out_of_memory_advice():
            self._run(self.executor.backward_actions)
        first_grads = self.grads.pop(0).tensors
        self.residency.close()
        self._mark()
        allocated_peak = None
        if self.device.type == "cuda":
            allocated_peak = torch.cuda.max_memory_allocated(self.device)
        self.executor._last = _Timing(
            self.device, self.peak, self.marks, self.allocated_before, allocated_peak
        )
        wanted = self.input_requires_grad
        return [g if want else None for g, want in zip(first_grads, wanted, strict=True)]

    def _run(self, actions: Sequence[HostAction]) -> None:
        for action in actions:
            op = self.ops[action.position]
            if action.kind == RELEASE:
                self._release(action.position, op)
            elif action.kind == ISSUE:
                self._memory_op(action.position, op)
            elif op.kind == BACKWARD:
                self._backward(op.index)
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
            self._drop_device(key)

    def _drop_device(self, key: tuple[str, int]) -> None:
        tensor = self.on_device.pop(key, None)
        if tensor is not None:
            self.residency.drop(tensor.records, resident=True)

    def _drop_host(self, key: tuple[str, int]) -> None:
        tensor = self.on_host.pop(key, None)
        if tensor is not None:
            self.residency.drop(tensor.records, resident=False)

    def _source(self, index: int) -> _PlanTensor:
        """The resident a_index: by itself, or as the output of x̄_index."""
        for key in ((ACTIVATION, index), (SAVED, index)):
            if key in self.on_device:
                return self.on_device[key]
        raise RuntimeError(f"a{index} is not resident; the plan was validated, so this is a bug")

    # Compute operations.

    def _forward(self, op: Op) -> None:
        i = op.index
        stage = self.executor.stages[i - 1]
        source = self._source(i - 1)
        inputs = list(source.tensors)
        self.residency.use(source.records)
        first = i not in self.rng
        if first:
            self.rng[i] = RngState.capture(self.cuda_devices)
        versions = [tensor._version for tensor in inputs]
        packer = slot = None
        diff: list[int] = []
        excluded = self.excluded
        with ExitStack() as stack:
            if not first:
                stack.enter_context(replayed_rng(self.rng[i]))
                copies = stack.enter_context(frozen_running_stats(self.norms[i - 1]))
                excluded = excluded | {storage_key(copy) for copy in copies}
            if self.in_backward:
                for state in self.autocast:
                    state.enter(stack)
            if op.kind == F_ALL:
                stack.enter_context(torch.enable_grad())
                diff = [
                    k
                    for k, tensor in enumerate(inputs)
                    if is_differentiable(tensor)
                    and (self.input_requires_grad[k] if i == 1 else self.needs_grad[i - 1])
                ]
                packer = SavedTensorPacker(inputs, excluded)
                slot = GradSlot()
                inputs = enter_stage(inputs, diff, slot, self.anchor)
                stack.enter_context(packer.hooks())
            else:
                stack.enter_context(torch.no_grad())
            result = stage(unflatten(inputs, source.structure))
        check_unmodified(self.executor.chain.stage(i).name, source.tensors, versions)
        tensors, structure = flatten(result)
        is_output = i == self.length and self.outputs is None
        if is_output:
            self.outputs, self.output_structure = tensors, structure
        output_storages = unique_storages(tensors)
        records = self.residency.hold(output_storages, external=is_output)
        if packer is not None:
            others = {k: s for k, s in packer.storages.items() if k not in output_storages}
            records += self.residency.hold(others)
        produced = _PlanTensor(tensors, structure, records)
        produced.packer, produced.slot, produced.diff = packer, slot, diff
        key = (SAVED if op.kind == F_ALL else ACTIVATION, i)
        self.on_device[key] = produced
        if self.streams is not None:
            self.produced[key] = self.streams.compute.record_event()
        self.peak = max(self.peak, self.residency.live_bytes)
        if op.kind == F_NONE:
            self._drop_device((ACTIVATION, i - 1))

    def _backward(self, i: int) -> None:
        saved = self.on_device[(SAVED, i)]
        grad = self.grads[i]
        source = self._source(i - 1)
        self.residency.use(saved.records)
        self.residency.use(source.records)
        assert saved.packer is not None and saved.slot is not None
        saved.packer.inputs = list(source.tensors)
        pairs = [
            (output, g)
            for output, g in zip(saved.tensors, grad.tensors, strict=True)
            if g is not None and output.requires_grad
        ]
        if pairs:
            torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        grads: list[torch.Tensor | None] = [None] * len(source.tensors)
        for k, g in zip(saved.diff, saved.slot.grads or (), strict=False):
            grads[k] = g
        present = [g for g in grads if g is not None]
        self.grads[i - 1] = _PlanTensor(grads, None, self.residency.hold(unique_storages(present)))
        self.peak = max(self.peak, self.residency.live_bytes)
        gone = self.grads.pop(i)
        self.residency.drop(gone.records)
        # Nothing reads x̄_i, or a_{i-1} by itself, after B(i): host copies go too.
        for key in ((SAVED, i), (ACTIVATION, i - 1)):
            self._drop_device(key)
            self._drop_host(key)

    def _mark(self) -> None:
        if self.streams is not None:
            self.marks.append(
                self.streams.compute.record_event(torch.cuda.Event(enable_timing=True))
            )
        else:
            self.marks.append(time.perf_counter())

    def _out_of_memory_advice(self) -> _OutOfMemoryAdvice:
        return _OutOfMemoryAdvice(self.executor.plan)


class _OutOfMemoryAdvice:
    """Re-raise a device out-of-memory error with the plan's figures and what to do."""

    def __init__(self, plan: Plan):
        self.plan = plan

    def __enter__(self) -> None:
        return None

    def __exit__(self, kind: Any, error: BaseException | None, traceback: Any) -> bool:
        if isinstance(error, torch.OutOfMemoryError):
            plan = self.plan
            peak = plan.predicted_peak_bytes
            budget = plan.budget_bytes
            raise torch.OutOfMemoryError(
                f"out of device memory while running the {plan.solver} plan "
                f"(predicted activation peak {format_bytes(peak) if peak is not None else '?'}, "
                f"budget {format_bytes(budget) if budget is not None else 'none'}). The chain no "
                f"longer matches the model (another batch or sequence size?) or the rest of the "
                f"memory (weights, gradients, optimizer state) leaves less than the budget: "
                f"profile again with the input you train on (offremat.optimize(model, x, ...)) "
                f"and lower the budget. Original error: {error}"
            ) from error
        return False
