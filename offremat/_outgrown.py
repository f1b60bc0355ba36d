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
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from offremat._signatures import Signature, describe
from offremat._tensors import Structure, flatten, unflatten
from offremat.executor import PlanExecutor
from solvers.budget import InfeasibleBudgetError, format_bytes
from solvers.chain import Chain

logger = logging.getLogger(__name__)


class _Planning(Protocol):
    numbers: Any

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


def measured_until_reached(executor: PlanExecutor) -> None:
    """Measure the next step on ``executor`` where its plan was made for grown sizes that no
    measured step has held yet: measured within its budget on a smaller batch, such a plan
    was trusted, and steps of the sizes it was made for ran over it unsaid, 1.07 to 2.1
    times the budget (a review)."""
    if executor.unreached_sizes is not None:
        executor.verify_next = True


@dataclass(frozen=True)
class SizedStep:
    """The call whose step checks a plan made for grown sizes, kept until the next call in
    its state of the stages, so that where that step passes its budget its batch can be
    profiled. A caller may refill its buffers in place (profiled, that was the next step's
    data, a review): a tensor on a device is copied to the host when the step starts; one on
    the host is kept with its version, which a refill changes (copied, it was bytes of the
    step's own, 128 KiB at 0.997 of the budget on routed tokens, a review)."""

    signature: Signature
    executor: PlanExecutor
    state: Any  # the stages' state whose plans hold ``executor``
    tensors: tuple[torch.Tensor, ...]  # the batch's, on the host
    versions: tuple[int | None, ...]  # each caller's own tensor's version; None: a copy
    devices: tuple[torch.device, ...]
    structure: Structure

    @classmethod
    def of(cls, signature: Signature, executor: PlanExecutor, batch: Any, state: Any) -> SizedStep:
        """The step about to run ``batch`` on ``executor``."""
        tensors, structure = flatten(batch)
        kept, versions = [], []
        for tensor in tensors:
            # An inference tensor has no version to tell a refill by.
            own = tensor.device.type == "cpu" and not tensor.is_inference()
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
) -> PlanExecutor | None:
    """The executor of a plan made on a profile of ``batch`` (the batch of the step that ran
    ``executor``, a plan made for grown sizes, over its budget; else of one of its key), put
    in ``plans``, its first step measured; None where that step was within, and where no plan
    fits that profile or profiling raised (said).

    A grown chain's temporaries are grown as its saved sets: tokens routed through an MLP
    grew their backward's 4.4 times from 8 to 24 tokens where the saved set grew 2.1 times,
    and the plan re-made for the grown sizes ran at 1.07 times the budget at every step,
    where a plan on a profile of the batch fits (a review). A profile measures them.
    """
    if not (executor.over_budget and plans.get(signature) is executor):
        return None
    executor.over_budget = False
    began = time.perf_counter()
    try:
        new = planning._executor_for(signature, planning.profile_call(batch))
    except InfeasibleBudgetError as error:
        logger.warning(
            "profiled on a batch after its plan for grown sizes passed the budget, input %s "
            "has no %s plan within %s (one fits in %s): steps that hold as much pass the "
            "budget on the plan they run, which is kept. Lower the batch, or raise the budget",
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
            "profiling a batch of input %s, whose plan for grown sizes passed the budget, "
            "raised %s: %s. The plan is kept, and steps that hold as much pass the budget "
            "on it. Lower the batch, or raise the budget",
            describe(signature),
            type(error).__name__,
            error,
        )
        return None
    new.verify_next = new.sized_by_step = True
    plans[signature] = new
    planning.numbers.checks.replaced(signature)
    logger.info(
        "planned input %s again on a profile of a batch, its plan for grown sizes over its "
        "budget, in %.2f s: %s plan, predicted peak %s",
        describe(signature),
        time.perf_counter() - began,
        new.plan.solver,
        format_bytes(new.plan.predicted_peak_bytes or 0),
    )
    return new
