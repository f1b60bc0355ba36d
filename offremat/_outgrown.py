"""A plan made again for the sizes a step's stages held, where they outgrew its chain.

A model whose activation sizes depend on its input's values (tokens routed by their values)
can hold more at some steps than at the batch its chain was profiled on, at the same shapes
(:mod:`offremat._stage_sizes`). A step that finds its stages grown past what the plan fits
within its budget leaves the chain grown to its sizes (``PlanExecutor.outgrown``), and the
next step on that plan's key runs on a plan made for that chain, measured: the grown chain
is an estimate (a stage's temporaries grow as its saved set), and a step over on it is said,
and the next call plans on a profile of that step's batch (:func:`profiled_on_step`). Warned
once and left as it was, routed tokens at three times the profiled count ran at 1.6 times
the budget at every later step (a review); planned again, they fit. The chain only grows: a
later step that holds less runs on the larger plan.

Some growth no unmeasured step sees: temporaries of the backward that follow the values while
no saved set does. Hugging Face's mixture-of-experts blocks with their per-expert loop
allocate, in the backward, a gradient of all experts' stacked weights per expert that
receives tokens, so a step whose tokens reach more experts than the example's did ran at 1.3
times the budget, at every step, unsaid (a new user's trial). So every
:data:`CHECKED_EVERY`-th step of a plan is measured (:func:`checked_now_and_then`), as is
every step with ``measure_memory=True``; one over its budget has its batch profiled at the
next call, and the plan made again on the envelope of its chain and that profile
(:func:`solvers.envelope.envelope`), which covers both batches.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from offremat._signatures import Signature, describe
from offremat._tensors import Structure, flatten, unflatten
from offremat.executor import PlanExecutor
from solvers.budget import InfeasibleBudgetError, format_bytes
from solvers.chain import Chain
from solvers.envelope import envelope

logger = logging.getLogger(__name__)


class _Planning(Protocol):
    numbers: Any
    quick: Any
    provisional: set[Signature]

    def _executor_for(self, signature: Signature, chain: Chain) -> PlanExecutor: ...

    def profile_call(self, batch: Any) -> Chain: ...


def replanned(
    planning: _Planning,
    signature: Signature,
    key: Any,
    executor: PlanExecutor,
    plans: dict[Any, PlanExecutor],
) -> PlanExecutor:
    """The executor of a plan for ``executor.outgrown``, put in ``plans`` under ``key`` (of
    the call's ``signature``), its first step measured; ``executor`` itself where no plan
    fits that chain within the budget (said)."""
    grown, executor.outgrown = executor.outgrown, None
    assert grown is not None
    try:
        new = planning._executor_for(signature, grown.chain)
    except InfeasibleBudgetError as error:
        logger.warning(
            "on the sizes a step held, no %s plan for input %s fits in its budget of %s (one "
            "fits in %s): steps that hold as much may pass the budget on the plan they run, "
            "which is kept. Lower the batch, or raise the budget",
            error.solver,
            describe(signature),
            format_bytes(error.budget_bytes),
            format_bytes(error.min_budget_bytes),
        )
        return executor
    new.verify_next = True
    new.sized_by_step = new.sizes_grown = True
    if not new.plain:  # a keep-all plan's measured step sees no stage's sizes
        new.unreached_sizes = grown.sizes
    plans[key] = new
    planning.numbers.checks.replaced(key)
    logger.info(
        "planned input %s again for the sizes a step held: %s plan, predicted peak %s",
        describe(signature),
        new.plan.solver,
        format_bytes(new.plan.predicted_peak_bytes or 0),
    )
    return new


CHECKED_EVERY = 128
"""Every how many steps on a plan one is measured, on CPU: a measured step costs 1.4 to 3 times
an unmeasured one there (the dispatch-mode tracker; at every 32nd step, a Mixtral's steps took
8% longer, in a review)."""

CHECKED_EVERY_CUDA = 32
"""As :data:`CHECKED_EVERY`, on CUDA, where the allocator counts at little cost (resetting its
process-wide peak statistics)."""


def checked_now_and_then(executor: PlanExecutor) -> None:
    """Measure the next step on ``executor`` where it is a multiple of the
    :data:`CHECKED_EVERY`-th on its plan (:data:`CHECKED_EVERY_CUDA`-th on CUDA); a
    keep-all plan's too, run as plain autograd and measured through its backward
    (:mod:`offremat._plain_measured`): unchecked, a mixture of experts ran its keep-all plan
    at 1.07 to 1.15 times the budget at every step, unsaid (a review)."""
    executor.steps_run += 1
    if executor.measure_memory or executor.plan.budget_bytes is None:
        return
    cuda = str(executor.chain.metadata.get("device", "cpu")).startswith("cuda")
    every = CHECKED_EVERY_CUDA if cuda else CHECKED_EVERY
    if executor.steps_run % every == 0 and not executor.verify_next:
        executor.verify_next = executor.sampling = True


def measured_until_reached(executor: PlanExecutor) -> None:
    """Measure the next step on ``executor`` where its plan was made for grown sizes that no
    measured step has held yet: measured within its budget on a smaller batch, such a plan
    was trusted, and steps of the sizes it was made for ran over it unsaid, 1.07 to 2.1
    times the budget (a review)."""
    if executor.unreached_sizes is not None:
        executor.verify_next = True


@dataclass(frozen=True)
class SizedStep:
    """A measured step whose batch is profiled where it passes its budget
    (``PlanExecutor.profile_due``), kept until the next call in its state of the stages. The
    caller's own tensors are kept, with their versions: one refilled in place holds the next
    step's data (profiled, a plan was made for other data than the step's, a review), and a
    copy was bytes of the step's own (128 KiB at 0.997 of the budget on routed tokens, a
    review). An inference tensor, which has no version, is copied to the host."""

    signature: Signature
    executor: PlanExecutor
    state: Any  # the stages' state whose plans hold ``executor``
    tensors: tuple[torch.Tensor, ...]
    versions: tuple[int | None, ...]  # each caller's own tensor's version; None: a copy
    devices: tuple[torch.device, ...]
    structure: Structure

    @classmethod
    def of(cls, signature: Signature, executor: PlanExecutor, batch: Any, state: Any) -> SizedStep:
        """The step about to run ``batch`` on ``executor``."""
        tensors, structure = flatten(batch)
        kept, versions = [], []
        for tensor in tensors:
            own = not tensor.is_inference()
            kept.append(tensor.detach() if own else tensor.detach().to("cpu", copy=True))
            versions.append(tensor._version if own else None)
        devices = tuple(t.device for t in tensors)
        return cls(signature, executor, state, tuple(kept), tuple(versions), devices, structure)

    def batch(self) -> Any | None:
        """The batch as the step had it; None where the caller has changed it in place."""
        pairs = zip(self.tensors, self.versions, strict=True)
        if any(version not in (None, t._version) for t, version in pairs):
            return None
        return unflatten(
            (t.to(device) for t, device in zip(self.tensors, self.devices, strict=True)),
            self.structure,
        )


def profiled_on_step(
    planning: _Planning,
    signature: Signature,
    executor: PlanExecutor,
    batch: Any,
    plans: dict[Any, PlanExecutor],
    kept: bool = True,
) -> PlanExecutor | None:
    """The executor of a plan made on a profile of ``batch`` (the batch of a measured step on
    ``executor`` over its budget, ``profile_due``; else, not ``kept``, of one of its key),
    put in ``plans``, its first step measured; None where no profile is due, and where no
    plan fits or profiling raised (said).

    A plan made for grown sizes is made on the profile alone: its chain's temporaries were
    grown as its saved sets, an estimate (tokens routed through an MLP grew their backward's
    4.4 times from 8 to 24 tokens where the saved set grew 2.1 times, and the plan re-made for
    the grown sizes ran at 1.07 times the budget at every step, where a plan on a profile of
    the batch fits, a review). A plan profiled already is made on the envelope of its chain
    and the profile, which holds the sizes of both batches.
    """
    return _profiled_again(
        planning, signature, signature, executor, lambda: planning.profile_call(batch), plans, kept
    )


def profiled_variant(
    planning: _Planning,
    key: Any,
    variant: PlanExecutor,
    profile: Callable[[], Chain],
    plans: dict[Any, PlanExecutor],
) -> PlanExecutor | None:
    """As :func:`profiled_on_step`, for a plan made for blocks' inputs of another kind than
    their shape's (``plans`` under ``key``, :mod:`offremat._shape_variants`): ``profile()``
    profiles the blocks on this call's input, as the over step's is made inside its call and
    not kept. Unchecked, unpadded tokens whose experts the example's one token did not reach
    ran at 1.46 times the budget at every step, unsaid (a review)."""
    return _profiled_again(planning, key[0], key, variant, profile, plans, kept=False)


def _profiled_again(
    planning: _Planning,
    signature: Signature,
    key: Any,
    executor: PlanExecutor,
    profile_now: Callable[[], Chain],
    plans: dict[Any, PlanExecutor],
    kept: bool,
) -> PlanExecutor | None:
    """:func:`profiled_on_step` for the plan ``plans[key]`` of a call's ``signature``, on the
    chain ``profile_now()`` makes."""
    if not (executor.profile_due and plans.get(key) is executor):
        return None
    executor.profile_due = executor.over_budget = False
    began = time.perf_counter()
    try:
        profile = profile_now()
        chain = profile if executor.sizes_grown else envelope([executor.chain, profile])
        if chain == executor.chain:  # the batch holds no more than the plan's chain
            if not kept:
                # Not the step's own batch (refilled in place since, or lost with a copy of
                # the module): the next step is checked instead. Left at that, a caller
                # refilling its batch ran over at every later step, unsaid (a review).
                executor.profiled_at = None
                executor.verify_next = executor.sampling = True
            return None
        new = planning._executor_for(signature, chain)
    except InfeasibleBudgetError as error:
        executor.outgrown = None  # its estimate holds no less than the profile: none fits
        logger.warning(
            "profiled on a batch after its plan passed the budget, input %s has no %s plan "
            "within %s (one fits in %s): steps that hold as much pass the budget on the plan "
            "they run, which is kept. Lower the batch, or raise the budget",
            describe(signature),
            error.solver,
            format_bytes(error.budget_bytes),
            format_bytes(error.min_budget_bytes),
        )
        return None
    except Exception as error:
        # The batch is mostly an earlier call's: what profiling it raises (out of memory on
        # a device, a model that refuses it now) is no error of this call, which raised it
        # in a review, the plan left unsaid from then on. This call's own errors its step
        # raises.
        logger.warning(
            "profiling a batch of input %s, whose plan passed the budget, raised %s: %s. The "
            "plan is kept, and steps that hold as much pass the budget on it. Lower the "
            "batch, or raise the budget",
            describe(signature),
            type(error).__name__,
            error,
        )
        return None
    new.verify_next = new.sized_by_step = True
    plans[key] = new
    planning.numbers.checks.replaced(key)
    if planning.quick is not None and key == signature:  # a variant's is not improved later
        # Planned by the quick solver, in the call: the final one's plan replaces it at the
        # next (a milp plan made again stayed dp's for good, a review).
        planning.provisional.add(signature)
    logger.info(
        "planned input %s again on a profile of a batch, its plan over its budget, in "
        "%.2f s: %s plan, predicted peak %s",
        describe(signature),
        time.perf_counter() - began,
        new.plan.solver,
        format_bytes(new.plan.predicted_peak_bytes or 0),
    )
    return new
