"""One plan per input shape: a training step never runs on a plan made for another shape.

Activation sizes and times grow with the batch and the sequence length, so a plan made for
one input shape can break its budget on a larger one. Following Mimose (Liao et al. 2022), an
optimized model keeps a plan per input signature (the shapes, dtypes and devices of its
tensor inputs, and its other arguments) and makes one, before the step runs, the first time a
signature is seen. The budget stays the same number of bytes for every shape: it is the
memory the device has. A new shape that differs from profiled ones in one size (a batch or a
sequence length) and lies between two of them, or near three of them, gets a chain predicted
from theirs (:mod:`solvers.predict`); any other is profiled for real (one timed repeat, no
warm-up: sizes exact, times rough). The stage grouping is the first shape's, so every plan
runs the same stage modules. With a slow solver (the MILP), a new shape's first step runs on a
quick solver's plan (the DP's) and the slow one replaces it at the shape's next step. Each
state of the stages has plans of its own: their modules, their tensors and their configs'
implementations (``model.to(...)``, a layer frozen, unfrozen or widened, a submodule replaced
by another kind, another attention implementation) and each module's training or eval mode
(dropout off, a batch norm frozen). The plans of the last few states stay, for states that
alternate (a GAN's discriminator frozen for every generator step). Within a shape, blocks'
inputs of another kind than the plan was made on (a padding mask where the example had none)
get a plan of their own in the step that meets them (:meth:`ShapePlans.for_chain_input`).
A Python number, string or object among the call's arguments (a count, a temperature, a
caption) keys plans by value until
one more profile, of a call that differs from a profiled one in it alone, shows it sizes
nothing; then by type, and its later values reuse the plan (:mod:`offremat._numbers`). Each
state keeps the plans of its last :data:`offremat._shape_solving.KEPT_SIGNATURES`
signatures, so numbers that do size tensors cannot grow them without end.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from torch import nn

from offremat import _shape_solving
from offremat._host import DeviceResources
from offremat._number_learning import learn, sibling
from offremat._numbers import NumberPlaces
from offremat._outgrown import (
    SizedStep,
    checked_now_and_then,
    measured_until_reached,
    profiled_on_step,
    replanned,
)
from offremat._plan_cache import PlanCache
from offremat._shape_prediction import predicted_chain
from offremat._shape_solving import ShapeCache, ShapeSolving
from offremat._shape_variants import (
    KEPT_VARIANTS,
    VariantPlanning,
    parametrize_cache_suspended,
)
from offremat._signatures import Signature, VariantKey, describe, input_signature
from offremat._stage_state import StageState, describe_change, stage_state
from offremat._stand_ins import StandIns
from offremat._state_plans import StatePlans, swapped
from offremat._step import StepsInFlight
from offremat._step_budget import warn_unsure
from offremat._value_checks import trim
from offremat.executor import PlanExecutor
from solvers.chain import Chain
from solvers.plan import Plan

logger = logging.getLogger(__name__)


class ShapePlans(VariantPlanning, ShapeSolving):
    """The executors of an optimized model, one per input signature, made on first sight.

    ``profile`` profiles a batch of a new shape into a chain of the same stages; ``solve``
    makes its plan. With ``quick``, a new shape's first plan is ``quick``'s where it fits, and
    ``solve`` replaces it at the shape's next step. ``profile_blocks`` profiles the blocks on
    a chain input of another kind than a shape's plan was made on (:meth:`for_chain_input`).
    Plans hold for the state of ``model`` (its modules, parameters, hooks and modes) as they
    were made, or of the stages when the model is the chain.
    """

    def __init__(
        self,
        stages: Sequence[nn.Module],
        profile: Callable[[Any], Chain],
        solve: Callable[[Chain], Plan],
        measure_memory: bool,
        disk: PlanCache | None = None,
        quick: Callable[[Chain], Plan] | None = None,
        profile_blocks: Callable[[Chain, Any], Chain] | None = None,
        model: nn.Module | None = None,
    ):
        self.stages = list(stages)
        # Whose state the plans are made for: the whole model where code around the stages
        # (an embedding, a head) adds to the step's memory, else the stages.
        self.watched = self.stages if model is None else [model]
        self.profile_blocks = profile_blocks
        self.profile = profile
        self.solve = solve
        self.quick = quick
        self.measure_memory = measure_memory
        self.disk = disk
        self.executors: dict[Signature, PlanExecutor] = {}
        self.profiled: dict[Signature, Chain] = {}
        self.provisional: set[Signature] = set()
        # Signatures whose chain was not profiled at their shape (read from the disk cache,
        # or predicted): their first step is measured, and profiled if over the budget.
        self.unprofiled: set[Signature] = set()
        self.variants: dict[VariantKey, PlanExecutor] = {}
        self.sizing_values: dict[Signature, frozenset[int]] = {}
        self.value_blames: dict[tuple[Signature, int], int] = {}
        # Plans standing in for new values of the blocks' and of the call's keyed values.
        self.stand_ins = StandIns(KEPT_VARIANTS)
        self.call_stand_ins = StandIns(KEPT_VARIANTS)
        self.call_measured: tuple[PlanExecutor, bool] | None = None
        # The call that checks a plan made for grown sizes, until the next (offremat._outgrown).
        self.sized_step: SizedStep | None = None
        self.mode_values: dict[tuple[Signature, int], dict[str, None]] = {}
        # The fields of the error each refused kind raises (see for_chain_input).
        self.refused: dict[VariantKey, tuple[Any, ...]] = {}
        self.cache = ShapeCache()
        self.last: PlanExecutor | None = None
        self.in_flight = StepsInFlight()
        self.resources = DeviceResources()
        self.module_state, self.modes = stage_state(self.watched)
        # What changed in the stages at this call, where it made a new state to plan for.
        self.state_change: str | None = None
        # The plans of the other states of the stages seen lately (see executor).
        self.by_state: dict[StageState, StatePlans] = {}
        # The disk cache holds plans for the stages as optimize saw them only.
        self.disk_state = (self.module_state, self.modes)
        # Which numbers among the call's arguments key plans (offremat._numbers).
        self.numbers = NumberPlaces(learns=profile_blocks is not None)

    def add(self, batch: Any, chain: Chain, plan: Plan, from_disk: bool = False) -> PlanExecutor:
        """Register the plan made at ``optimize`` time for the example batch (read from the
        disk cache: its first step is measured, as for any chain not profiled here)."""
        executor = PlanExecutor(
            self.stages, plan, chain, self.measure_memory, self.in_flight, self.resources
        )
        signature = self.numbers.key(input_signature(batch))
        if from_disk:
            self.unprofiled.add(signature)
            executor.verify_next = True
        self.executors[signature] = executor
        self.profiled[signature] = chain
        self.last = executor
        return executor

    def _chain(self, signature: Signature, batch: Any, predict: bool = True) -> Chain:
        """A predicted chain when the profiled shapes allow it (solvers.predict) and
        ``predict``, else a profiled one."""
        predicted = predicted_chain(self.profiled, signature) if predict else None
        if predicted is not None:
            self.cache.predicted += 1
            self.unprofiled.add(signature)
            return predicted
        chain = self.profile_call(batch)
        self.profiled[signature] = chain
        trim(self.profiled, _shape_solving.KEPT_SIGNATURES)
        return chain

    def profile_call(self, batch: Any) -> Chain:
        """Profile the model on ``batch``, outside the caller's ``parametrize.cached()``."""
        with parametrize_cache_suspended():
            return self.profile(batch)

    def _learn(self, signature: Signature, batch: Any, predict: bool) -> tuple[Signature, Chain]:
        """:meth:`_chain`, and what a profile says of numbers that alone differ from a
        profiled call's (offremat._numbers); the key of ``signature`` after it."""
        found = sibling(self, signature, batch)
        chain = self._chain(signature, batch, predict)
        if found is not None and self.profiled.get(signature) is chain:
            signature = learn(self, signature, batch, found, chain)
        return signature, chain

    def executor(self, batch: Any) -> PlanExecutor:
        """The executor for ``batch``'s signature, planned now if it is new."""
        self.call_measured = None
        self.state_change = None
        self.numbers.checks.next_step()
        self.call_stand_ins.settle(self.numbers.checks)
        state = stage_state(self.watched)
        if state != (self.module_state, self.modes):
            self._switch(state)
        # A step kept in another state of the stages waits for its state to come back (the
        # state's plans were set aside with its executor: eval() between, a review).
        step = self.sized_step
        if step is not None and step.state == (self.module_state, self.modes):
            self.sized_step = None
            kept = step.batch()  # else, changed in place since, a later batch of its key's
            if kept is not None:
                profiled_on_step(self, step.signature, step.executor, kept, self.executors)
        called = input_signature(batch)
        signature = self.numbers.key(called)
        executor = self.executors.get(signature)
        if executor is not None and executor.profile_due:
            # Its step's batch is gone (the module was copied or pickled since, or the batch
            # refilled in place): this call's.
            profiled = profiled_on_step(self, signature, executor, batch, self.executors, False)
            executor = profiled or executor
        over = executor is not None and executor.over_budget
        if over and executor.over_within_gradients and signature not in self.unprofiled:
            # A profiled plan, over by no more than the gradients its steps made (CUDA cannot
            # tell them apart): taken for those, which the budget leaves out, and said.
            executor.over_budget = executor.over_within_gradients = over = False
            warn_unsure(executor, describe(signature))
        # A plan not profiled at its shape is profiled anew rather (below).
        checked = signature is not called or (
            signature not in self.unprofiled and self.numbers.checks.measured(signature)
        )
        if over and checked and not executor.over_within_gradients:
            # Measured over its budget on values its key leaves out: the call's numbers, or
            # the blocks' own (offremat._shape_variants).
            executor.over_budget = False
            others = self.numbers.over_budget(signature, called, batch)
            if others:
                self.block_values_size(signature, others)
            signature = self.numbers.key(called)
            executor = self.executors.get(signature)
        if executor is not None and executor.over_budget and signature in self.unprofiled:
            logger.warning(
                "input %s: its plan, made on a chain given to optimize, read from cache_dir "
                "or predicted from other shapes, measured over its budget in its first step%s: "
                "profiling that shape and planning it again",
                describe(signature),
                " and, by no more than the parameters' gradients it made, in the next"
                if executor.over_within_gradients
                else "",
            )
            del self.executors[signature]
            self.numbers.checks.not_settled(signature)
            executor = None
        stood_in = False
        if executor is None:
            executor = self.call_stand_ins.for_call(
                signature, self.numbers, self.executors, self.unprofiled, self._executor_for
            )
            stood_in = executor is not None
        if executor is not None:
            self.cache.hits += 1
            if not stood_in:
                self.executors[signature] = self.executors.pop(signature)  # the latest used
                if signature in self.provisional:
                    executor = self._improve(signature, executor.chain)
                if executor.outgrown is not None:
                    executor = replanned(self, signature, signature, executor, self.executors)
                if not executor.verify_next:  # the step measured last on it ended, within budget
                    self.numbers.within_budget(signature)
                elif not executor.verify_again:  # it never ended: its backward did not run
                    self.numbers.checks.not_settled(signature)
                measured_until_reached(executor)
            if self.numbers.verifies(called, signature):
                # for_chain_input moves it where the step runs on a variant.
                self.call_measured = (executor, executor.verify_next)
                executor.verify_next = True
            if not stood_in:
                checked_now_and_then(executor)
        else:
            self.cache.misses += 1
            began = time.perf_counter()
            disk = self._disk()
            again = signature in self.unprofiled
            self.unprofiled.discard(signature)
            cached = None if disk is None or again else disk.load(repr(signature), self._like)
            if cached is not None:
                chain, plan = cached
                self.cache.from_disk += 1
                self.unprofiled.add(signature)
            else:
                signature, chain = self._learn(signature, batch, predict=not again)
                plan = self._plan(signature, chain)
                # The disk keeps the final solver's plans only.
                if disk is not None and signature not in self.provisional:
                    disk.store(repr(signature), chain, plan)
            executor = self._install(signature, chain, plan, began, "planned")
        measured = executor.verify_next and (executor.sizes_grown or executor.sampling)
        if measured or executor.measure_memory:  # profiled where it passes its budget
            state = (self.module_state, self.modes)
            self.sized_step = SizedStep.of(signature, executor, batch, state)
        self.last = executor
        return executor

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "sized_step": None}  # the caller's batch is not the model's

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(sized_step=None)  # pickled by a version before it was kept
        self.__dict__.update(state)

    def _like(self, chain: Chain, plan: Plan) -> None:
        """Refuse a cached entry (an edited file) whose stages or budget are not those of the
        plans made here: every shape runs these stages, at one budget in bytes."""
        made = self.last
        if made is not None and (made.chain.length, made.plan.budget_bytes) != (
            chain.length,
            plan.budget_bytes,
        ):
            raise ValueError(
                f"it has {chain.length} stages at a budget of {plan.budget_bytes} B, where this "
                f"model's plans have {made.chain.length} at {made.plan.budget_bytes} B"
            )

    def _switch(self, state: StageState) -> None:
        """Put the plans of the stages' state so far aside, and take up those of ``state``.

        model.to(dtype or device) changes every activation size, a wider or another module
        what a stage computes, a layer unfrozen what it saves, a dropout switched off or a
        batch norm frozen what a stage computes and saves: each state of the stages has plans
        of its own. The last few are kept, since some alternate at every step (a GAN freezes
        its discriminator for the generator's step, train() and eval() may alternate every
        epoch); a new one is said aloud, as each of its shapes is planned again. What the
        steps measured within budget is the plans' own, so each state keeps its checks: a
        count checked on a frozen state's plan ran on the trainable state's plan of the same
        key at 1.34 times the budget, unmeasured, in a review.
        """
        current = StatePlans(
            self.executors,
            self.profiled,
            self.provisional,
            self.variants,
            self.unprofiled,
            self.numbers.checks,
        )
        before = (self.module_state, self.modes)
        change = "" if state in self.by_state else describe_change(before, state)
        if change:  # planned anew: a refusal says what changed
            self.state_change = f"the stages changed ({change})"
        kept = swapped(self.by_state, before, current, state, change)
        self.executors, self.profiled = kept.executors, kept.profiled
        self.provisional, self.variants = kept.provisional, kept.variants
        self.unprofiled, self.numbers.checks = kept.unprofiled, kept.checks
        self.refused, self.stand_ins = {}, StandIns(KEPT_VARIANTS)
        self.call_stand_ins = StandIns(KEPT_VARIANTS)
        self.module_state, self.modes = state

    def check_output(self, batch: Any, output: Any) -> None:
        """After a step on ``batch``: see :meth:`offremat._numbers.NumberPlaces.check_output`."""
        if self.numbers.neutral:
            self.numbers.check_output(input_signature(batch), output, batch)

    def runs_plainly(self, batch: Any) -> bool:
        """Whether ``batch``'s plan is made already, for the stages as they are now, and is
        plain autograd's schedule: nothing to plan, hold or recompute."""
        if stage_state(self.watched) != (self.module_state, self.modes):
            return False
        executor = self.executors.get(self.numbers.key(input_signature(batch)))
        return executor is not None and executor.plain and not executor.measure_memory
