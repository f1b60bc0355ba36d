"""Run a plan (``offremat.plan/1``) as the training step of a chain of PyTorch modules.

The whole chain is one autograd function (:mod:`offremat._plan_function`), like the
reentrant variant of ``torch.utils.checkpoint``: its forward runs the plan's operations up to
the first backward, its backward runs the rest, keeping, offloading (Beaumont, Eyraud-Dubois,
Shilova 2021) and recomputing (Herrmann, Beaumont et al. 2019) activations exactly as the plan
says.

Design notes.

- One step's state and operations: :mod:`offremat._step`. Stages and their gradients: see
  :mod:`offremat._stage` (boundary, saved sets, RNG, BatchNorm, autocast). Each B(i) calls
  ``torch.autograd.backward`` on stage i's graph, so parameter gradients accumulate into
  ``.grad`` as plain autograd's do; like the reentrant checkpoint, this supports
  ``loss.backward()`` but not ``torch.autograd.grad`` with respect to parameters.
- Memory and copies: see :mod:`offremat._memory` (storages, deferred frees, pinned host arena) and
  :mod:`solvers.host` (what the host issues around each compute op, and where the
  simulator's memory admission becomes a wait on an offload's event).
- Direct forwards. Saved-tensor hooks let the step hold, move and rebuild what autograd
  saves, at a Python call per saved tensor. An F_all(i) after which the plan neither moves
  nor recomputes a_{i-1}, x̄_{i-1} or x̄_i before B(i)
  (:func:`solvers.semantics.undisturbed_forwards`) needs none of that: it runs without hooks,
  its graph keeps what it saves exactly as long as the plan keeps x̄_i, and autograd checks
  in-place changes itself. Every other forward packs through :mod:`offremat._stage`.
- Keep-all plans. A plan that keeps everything and offloads nothing is plain autograd's
  schedule: unless the step is measured, it runs as plain autograd (:mod:`offremat._plain`).
- Graph roots. B(i) starts from the gradient edges of stage i's outputs, not from the output
  tensors: the step keeps a_i only through references it can drop when the plan offloads it.
- Measurement, opt-in: with ``measure_memory=True`` each step is measured independently of
  this module (:mod:`offremat.measure`: the allocator on CUDA, a dispatch-mode tracker of live
  storages on CPU); it resets CUDA's process-wide peak statistics, hence opt-in. A plan whose
  chain was not profiled at its shape (read from a plan cache, or predicted from other
  shapes) has its first step measured (``verify_next``; a keep-all plan, run as plain
  autograd, through its backward: :mod:`offremat._plain_measured`); one measured over its
  budget, less the parameters' gradients the step made (:mod:`offremat._step_budget`), is
  marked (``over_budget``), and :mod:`offremat._shapes` profiles its shape. The executor's
  own count of the storages it holds is kept as a diagnostic
  (``bookkept_peak_bytes``). Steps are timed with events that are only synchronised when
  :attr:`PlanExecutor.stats` is read.
- State: everything about one step lives in a :class:`_Step`, made by the forward and kept by
  the autograd graph until the backward has used it. Its residency is closed on every exit,
  an exception included, so no copy stays in flight and no host buffer is lost.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import torch
from torch import nn

from offremat._call_checks import (
    holds_compiled_code,
    in_functorch_transform,
    refuse_functorch_transforms,
    refuse_outer_saved_tensor_hooks,
)
from offremat._graph_saved import StageReading
from offremat._host import CudaStreams, DeviceResources, HostArena
from offremat._plain import run_plainly
from offremat._plain_measured import PlainMeasurement
from offremat._plan_function import PlanFunction
from offremat._scan import fixed_storages, scan_modules
from offremat._stage_sizes import Outgrown, StageSizes
from offremat._stage_state import refuse_module_tracker
from offremat._stats import OutOfMemoryAdvice, StepStats, StepTiming
from offremat._step import StepsInFlight, _Step
from offremat._step_reports import report_grown_sizes
from offremat._tensors import (
    flatten,
    unflatten,
)
from solvers.baselines import keep_all
from solvers.chain import Chain
from solvers.host import COMPUTE
from solvers.plan import (
    BACKWARD,
    FORWARD_KINDS,
    OFFLOAD,
    SAVED,
    Plan,
    PlanError,
    validate,
)
from solvers.semantics import refills, undisturbed_forwards
from solvers.simulator import simulate


class PlanExecutor:
    """Runs ``plan`` over ``stages``, the modules of ``chain``'s stages in order."""

    def __init__(
        self,
        stages: Sequence[nn.Module],
        plan: Plan,
        chain: Chain,
        measure_memory: bool = False,
        in_flight: StepsInFlight | None = None,
        resources: DeviceResources | None = None,
    ):
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
        self.measure_memory = measure_memory
        # Shared by the executors of one model (one per input shape).
        self.in_flight = StepsInFlight() if in_flight is None else in_flight
        # So are the host arena and the copy streams of each device.
        self.resources = DeviceResources() if resources is None else resources
        # Plain autograd's own schedule, run as plain autograd (offremat._plain).
        self.plain = plan.ops == keep_all(chain).ops
        self.simulation = simulate(plan, chain, plan.budget_bytes)
        # The host arena's first size: every copy the plan makes (a step then keeps them all).
        self.host_bytes = sum(
            chain.saved_bytes(op.index) if op.target == SAVED else chain.activation_bytes(op.index)
            for op in plan.ops
            if op.kind == OFFLOAD
        )
        actions = self.simulation.host_actions
        # The backward half starts at B(L) itself: what the host does on the way to it (frees,
        # waits for offloads, prefetches) is done before the forward returns, so the caller's
        # code between the two halves (a head, a loss) runs beside the memory the simulator
        # has at B(L), no more.
        first_backward = next(
            k
            for k, action in enumerate(actions)
            if action.kind == COMPUTE and plan.ops[action.position].kind == BACKWARD
        )
        # F_all(i) right before B(i) refills the graph an earlier forward kept (_deferred).
        self.refills = refills(plan.ops)
        # F_all(i) whose input and saved set stay on the device as they are until B(i): their
        # graph keeps what it saves, with autograd's own checks and no saved-tensor hooks.
        self.direct = undisturbed_forwards(plan.ops)
        # Stages whose graph hides what a node saved (offremat._graph_saved): their forwards
        # run with saved-tensor hooks, never direct.
        self.hooked: set[int] = set()
        # Tensors each stage's deferred forward packs (offremat._deferred), once known.
        self.pack_counts: dict[int, int] = {}
        # Stages whose deferred forward writes to a tensor it saved: refilled to the end. So
        # are compiled stages, unwatched: the watch would run their first forward eagerly,
        # which draws other random numbers (dropout masks) than the compiled code the model
        # runs; and a compiled forward packs its saved tensors together at its end anyway.
        self.changes_saved: set[int] = {
            i for i, stage in enumerate(self.stages, 1) if holds_compiled_code(stage)
        }
        # The stages the plan runs forward more than once (offremat._buffers).
        forwards = Counter(op.index for op in plan.ops if op.kind in FORWARD_KINDS)
        self.recomputed = frozenset(i for i, count in forwards.items() if count > 1)
        _refuse_recomputed_renorm(self.stages, self.recomputed, chain.stage_names)
        self.reported_over_budget: set[str] = set()  # the reasons warned of
        # Measure the next step (a chain not profiled at this shape), and what it found.
        self.verify_next = False
        self.verify_again = False  # the next step's check is the second (offremat._step_budget)
        # The shapes of the blocks' inputs in the first step (ShapePlans.for_chain_input).
        self.first_chain_input_shapes: str | None = None
        self.over_budget = False
        # The most each stage held, and the model's outputs took, in steps measured, or
        # simulated on their sizes, within the budget (offremat._stage_sizes).
        self.checked_sizes = StageSizes()
        self.checked_output_bytes = 0
        # The most each stage held in steps said to pass the budget on their sizes, and the
        # most a measured step said to pass it held (offremat._step_budget).
        self.said_sizes = StageSizes()
        self.said_over_bytes = 0
        # The chain grown to the sizes a step held, over the budget on this plan: the next
        # step plans it again (offremat._outgrown).
        self.outgrown: Outgrown | None = None
        # Made for the sizes a step held (offremat._outgrown), not profiled on a batch: a
        # step over on it is no sign of values or a shape its plan was not profiled on.
        self.sized_by_step = False
        # Its chain grown from a step's sizes by estimate (temporaries grown as saved sets),
        # not profiled: a step on it over the budget has its batch profiled (_outgrown).
        self.sizes_grown = False
        # The sizes it was grown to, until a measured step holds them: its steps are measured
        # till then (a step on a smaller batch, within, left the rest unsaid, a review).
        self.unreached_sizes: StageSizes | None = None
        # Steps called on it, and whether the next is measured for a check alone
        # (offremat._outgrown.checked_now_and_then).
        self.steps_run = 0
        self.sampling = False
        # A measured step passed the budget where its plan's chain was profiled at its shape
        # (or grown to a step's sizes): the next call profiles that step's batch (_outgrown);
        # at most once in PROFILED_EVERY steps (profiled_at: steps_run then).
        self.profile_due = False
        self.profiled_at: int | None = None
        # Over, on CUDA, by no more than the gradients the step made, at both checks.
        self.over_within_gradients = False
        # A keep-all step run as plain autograd, measured, whose backward has not ended; and
        # whether one kept its graph (retain_graph), which no check can take as over.
        self.plain_measurement: PlainMeasurement | None = None
        self.retains_graph = False
        self.forward_actions = actions[:first_backward]
        self.backward_actions = actions[first_backward:]
        self._anchors: dict[torch.device, torch.Tensor] = {}
        self._last: StepTiming | None = None

    @property
    def stats(self) -> StepStats | None:
        """Figures of the last step, once it completes: None from when a step starts until
        it completes, and after a step that failed (on CUDA, reading them waits for its end)."""
        return None if self._last is None else self._last.resolve()

    def standing_in(self) -> PlanExecutor:
        """An executor of this plan and chain with step state of its own, to stand in for
        other values: their steps' verdicts must not touch this plan's own key's (a review:
        a stand-in step measured within budget cleared the over its own key's step had left,
        and that key's later steps ran over the budget, unmeasured)."""
        return PlanExecutor(
            self.stages, self.plan, self.chain, self.measure_memory, self.in_flight, self.resources
        )

    def clear_stats(self) -> None:
        """Forget the last step's figures: a step starts, which may fail."""
        self._last = None

    @property
    def host_buffer_bytes(self) -> int:
        """Host memory kept for offloads between steps, by this executor and those that share
        its resources (the model's other input shapes and states)."""
        return self.resources.host_bytes

    def release_host_memory(self) -> None:
        """Give back the host buffers kept for offloads; the next step allocates them again."""
        self.resources.release()

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickle, deepcopy) starts without this process's anchors and last step
        # (DeviceResources drops the host buffers and CUDA streams): made again at its first
        # step.
        state = dict(self.__dict__)
        state.update(_anchors={}, _last=None, plain_measurement=None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        # One pickled before the sizes were checked starts with none known to fit.
        self.__dict__.update(
            checked_sizes=StageSizes(),
            checked_output_bytes=0,
            said_sizes=StageSizes(),
            said_over_bytes=0,
            outgrown=None,
            sized_by_step=False,
            sizes_grown=False,
            unreached_sizes=None,
            steps_run=0,
            sampling=False,
            profile_due=False,
            profiled_at=None,
            hooked=set(),
            plain_measurement=None,
            retains_graph=False,
        )
        self.__dict__.update(state)
        if isinstance(self.outgrown, Chain):  # pickled before the sizes were kept with it
            self.outgrown = Outgrown(self.outgrown, StageSizes())

    def __call__(self, value: Any) -> Any:
        """The model's output for input ``value``; its backward follows the plan."""
        self.clear_stats()  # until this step completes
        if self.plain_measurement is not None:  # the last step's backward never ended
            self.plain_measurement.discard()
        tensors, structure = flatten(value)
        if not tensors:
            raise TypeError("the model input holds no tensor; pass the example input's kind")
        device = self._device(tensors)
        if not torch.is_grad_enabled():
            for stage in self.stages:
                value = stage(value)
            return value
        measuring = self.measure_memory or (self.verify_next and not self.plain)
        if self.plain and not self.measure_memory and in_functorch_transform():
            # Plain autograd's schedule needs no bookkeeping, which wrapped tensors refuse.
            return run_plainly(self.stages, value, device, self._finished)
        refuse_functorch_transforms()
        scans = [scan_modules(stage) for stage in self.stages]
        trainable = [bool(scan.trainable) for scan in scans]
        frozen = self.chain.frozen_stages
        if frozen and (any(trainable[:frozen]) or any(t.requires_grad for t in tensors)):
            raise RuntimeError(
                f"the first {frozen} stages of this chain needed no gradient, and were frozen "
                "when its plan was made (so it runs no backward for them), but now a parameter "
                "in them or the input requires grad: call offremat.optimize again after "
                "changing which parameters train"
            )
        if not (any(trainable) or any(t.requires_grad for t in tensors)):
            for stage in self.stages:
                value = stage(value)
            return value
        if self.plain and not measuring:
            with OutOfMemoryAdvice(self.plan):
                if self.verify_next:
                    self.plain_measurement = PlainMeasurement(self, tensors, device, scans)
                    return self.plain_measurement.run(self.stages, value)
                if self.plan.budget_bytes is None:  # no budget to hold: no sizes to read
                    return run_plainly(self.stages, value, device, self._finished)
                reading = StageReading(self._anchor(device), fixed_storages(scans))
                value = run_plainly(self.stages, value, device, self._finished, reading)
                report_grown_sizes(self, reading.sizes)
                return value
        refuse_outer_saved_tensor_hooks()
        refuse_module_tracker()
        step = _Step(self, tensors, structure, device, scans, measuring)
        self.in_flight.add(step)
        outputs = PlanFunction.apply(step, self._anchor(device), *tensors)
        return unflatten(outputs, step.output_structure)

    def _finished(self, timing: StepTiming) -> None:
        self._last = timing

    def _device(self, tensors: Sequence[torch.Tensor]) -> torch.device:
        """The step's device: the stages' parameters', else the first input tensor's.

        A CPU tensor among a CUDA model's inputs (lengths, say) must not make a CPU step.
        """
        for stage in self.stages:
            for parameter in stage.parameters():
                return parameter.device
        return tensors[0].device

    def _anchor(self, device: torch.device) -> torch.Tensor:
        if device not in self._anchors:
            self._anchors[device] = torch.empty(0, device=device, requires_grad=True)
        return self._anchors[device]

    def _resources(self, device: torch.device) -> tuple[HostArena, CudaStreams | None]:
        return self.resources.of(device, self.host_bytes)


def _refuse_recomputed_renorm(
    stages: Sequence[nn.Module], recomputed: frozenset[int], names: Sequence[str]
) -> None:
    """An embedding with ``max_norm`` renormalises its weight in place in every forward: a
    recomputation would do it a second time (see offremat/_buffers.py)."""
    for i in sorted(recomputed):
        for module in stages[i - 1].modules():
            if isinstance(module, nn.Embedding) and module.max_norm is not None:
                raise ValueError(
                    f"stage {names[i - 1]!r} holds an nn.Embedding with max_norm, which "
                    "renormalises its weight in place in every forward, and the plan "
                    "recomputes that stage, which would renormalise it again: use a plan that "
                    "keeps or offloads this stage (a larger budget, or solver='offload-all' "
                    "with a link), or renormalise outside the forward"
                )
