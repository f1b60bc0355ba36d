"""Plans that stand in for values keyed for good, which are new at every step.

A value of the blocks' inputs that measured steps blamed twice keys plans by value for good
(:mod:`offremat._shape_variants`), and so does a float the call passes whose profiles
disagreed (:mod:`offremat._numbers`, :meth:`StandIns.for_call`); where such a value is new at
every step (a float that picks a branch), each step was a profile (reviews: 76 in 80 steps,
60 in 60). Instead, a new value runs on a plan made for the envelope of the chains profiled
for the other values at that place (:func:`solvers.envelope.envelope`: at every stage the most
any of them holds), or on the plan of the chain that holds the most where that chain is the
envelope: a value that picks which blocks add a branch holds as much on either side, in other
blocks, and the plan of one side ran the other at 1.2 times the budget, then profiled every
later step (a review). A stand-in is an executor of its own (:meth:`PlanExecutor.standing_in`),
never the plan of a value's key: a stand-in step measured within budget cleared the over that
its own key's step had left, whose later steps then ran over the budget, unmeasured (a
review). A keep-all plan stands in too: its steps run as plain autograd, measured through
their backward, and one that passes the budget is said and taken as over
(:mod:`offremat._plain_measured`; a hot value on a cold
value's keep-all plan ran half its steps at 1.05 times the budget, unsaid, in a review, and
profiling each value instead made a short batch, whose chains all fit keep-all, 40 times
slower).

Every step on keyed values that no step measured within budget on that plan is measured:
memory need not grow with a value (a band of values between two others adding the most), and
a step measured only past the range of values measured within budget, or one in 32, ran 39
steps in 120 at 1.05 times the budget, unmeasured (a review). Measuring costs nothing on a GPU
(the allocator's statistics) and slows a step on CPU (steps 1.4 times slower, in a review). A
measured step over the budget is said at its end; its values are profiled where they come
back (a task's id), and the next new values are profiled, the envelope taking their chains
in, until it holds more than the plan that passed the budget, or :data:`PROFILES_AFTER_OVER`
profiles have found nothing more: the over came from something no profile of these values
sees (a mask's values), and that plan stands in again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from typing import Any

from offremat._numbers import NumberPlaces, erased, same_sizes
from offremat._signatures import Signature, describe
from offremat._value_checks import (
    KEPT_STRUCTURES,
    KEPT_VALUES,
    ValueChecks,
    trim,
    value_digest,
)
from offremat.executor import PlanExecutor
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.envelope import envelope
from solvers.registry import keep_all_peak

logger = logging.getLogger(__name__)

StandInPlace = tuple[Signature, Any]
"""Where plans stand in: a call key and a kind of blocks' inputs, or a call key with its
keyed numbers by type."""


PROFILES_AFTER_OVER = 4
"""How many new values are profiled after a stand-in plan passed its budget before it stands
in again where their chains hold no more."""


class StandIns:
    """The plans standing in for keyed values, per state of the stages."""

    def __init__(self, kept: int) -> None:
        self.kept = kept  # how many plans' records are remembered
        # Per place: the plans whose chains the stand-in bounds, and the stand-in.
        self.envelopes: dict[StandInPlace, tuple[list[PlanExecutor], PlanExecutor]] = {}
        # Per stand-in plan, the keyed values measured within budget on it, by digest.
        self.within: dict[PlanExecutor, dict[bytes, None]] = {}
        # Per place, the stand-in that passed its budget, and the profiles since.
        self.failed: dict[StandInPlace, tuple[PlanExecutor, int]] = {}
        # The keyed values, by place and digest, of steps over their budget on a stand-in:
        # profiled where they come back (a task's id).
        self.overs: dict[tuple[StandInPlace, bytes], None] = {}
        # The step run last on a stand-in: its key, place, plan and keyed values' digest, and
        # whether it was measured for them.
        self.standing: tuple[Any, StandInPlace, PlanExecutor, bytes, bool] | None = None

    def choose(
        self,
        key: Any,
        place: StandInPlace,
        keyed: dict[Any, Any],
        candidates: Iterable[PlanExecutor],
        plan_for: Callable[[Signature, Chain], PlanExecutor],
    ) -> PlanExecutor | None:
        """The plan to stand in for the plan key ``key`` (its values keyed for good ``keyed``,
        by place) at ``place``, whose profiled plans are among the ``candidates``; None
        where none can or the values are to be profiled. ``plan_for`` plans a chain of the
        call's, an envelope."""
        chosen = self._envelope_plan(place, candidates, plan_for)
        if chosen is None:
            return None
        digest = value_digest(sorted(keyed.items()))
        if (place, digest) in self.overs:  # these values passed the budget on it
            del self.overs[(place, digest)]
            return None
        failed = self.failed.pop(place, None)
        if failed is not None and failed[0] is chosen:
            if failed[1] < PROFILES_AFTER_OVER:
                self.failed[place] = (chosen, failed[1] + 1)
                trim(self.failed, KEPT_STRUCTURES)
                return None
            logger.warning(
                "a plan standing in for new values that key plans passed its budget, and %d "
                "profiles of the values after it held no more: what the model saves follows "
                "something no profile of these values sees (a mask's values?); lower the "
                "budget by the margin said, for input %s",
                PROFILES_AFTER_OVER,
                describe(place[0]),
            )
        measured = digest not in self.within.get(chosen, {})
        chosen.verify_next |= measured
        self.standing = (key, place, chosen, digest, measured)
        return chosen

    def for_call(
        self,
        signature: Signature,
        numbers: NumberPlaces,
        executors: dict[Signature, PlanExecutor],
        unprofiled: set[Signature],
        plan_for: Callable[[Signature, Chain], PlanExecutor],
    ) -> PlanExecutor | None:
        """:meth:`choose` for a call key whose floats key plans (``numbers``): a float the
        call passes that picks a branch, new at every step, was a profile at every step (60
        in 60). The plans of the other values, in ``executors``, are its candidates, but for
        the ``unprofiled``."""
        keyed = numbers.keyed_floats(signature)
        if not keyed:
            return None
        places = frozenset(keyed)
        place = erased(signature, places)
        candidates = [
            executor
            for known, executor in executors.items()
            if known not in unprofiled and erased(known, places) == place
        ]
        return self.choose(signature, (place, "call"), keyed, candidates, plan_for)

    def _envelope_plan(
        self,
        place: StandInPlace,
        candidates: Iterable[PlanExecutor],
        plan_for: Callable[[Signature, Chain], PlanExecutor],
    ) -> PlanExecutor | None:
        """The plan for the envelope of the profiled chains among ``candidates``, the plans
        at ``place`` (an executor of its own of the one whose chain is it, if any); None where
        there are none."""
        signature = place[0]
        # A stand-in's envelope was profiled on no one value.
        profiled = {
            id(candidate): candidate
            for candidate in candidates
            if "chain_input_values" in candidate.chain.metadata
        }
        if not profiled:
            return None
        known = self.envelopes.pop(place, None)
        if known is not None and {id(variant) for variant in known[0]} == profiled.keys():
            self.envelopes[place] = known
            return known[1]
        sources = sorted(profiled.values(), key=lambda v: -keep_all_peak(v.chain))
        bound = envelope([variant.chain for variant in sources])
        chosen = None
        if known is not None and same_sizes(bound, known[1].chain):
            chosen = known[1]  # the new profile holds no more
        elif not same_sizes(bound, sources[0].chain):
            del bound.metadata["chain_input_values"]  # profiled on no one value
            try:
                chosen = plan_for(signature, bound)
            except InfeasibleBudgetError:
                pass  # the sides together do not fit: the largest stands in, measured
            else:
                logger.info(
                    "a plan for the most each stage held on %d profiled values stands in for "
                    "new values that key plans, for input %s",
                    len(sources),
                    describe(signature),
                )
        if chosen is None:
            chosen = sources[0].standing_in()
        self.envelopes[place] = (sources, chosen)
        trim(self.envelopes, KEPT_STRUCTURES)
        return chosen

    def settle(self, checks: ValueChecks) -> None:
        """Take in the step run last on a stand-in: measured within budget, its values are
        the plan's; over it, the next values are profiled (module notes)."""
        standing, self.standing = self.standing, None
        if standing is None:
            return
        key, place, plan, digest, measured = standing
        if plan.over_budget and not plan.over_within_gradients:
            plan.over_budget = False
            checks.not_settled(key)
            self.within.pop(plan, None)
            self.failed[place] = (plan, 0)
            trim(self.failed, KEPT_STRUCTURES)
            self.overs[(place, digest)] = None
            trim(self.overs, KEPT_VALUES)
        elif not plan.verify_next and not plan.over_budget:
            # Its measurement, if any, ended within budget (a forward without its backward
            # leaves it pending): so did the other values it checked, as on a plan of their own
            # (a temperature cycling through four values had three measured at every step).
            checks.within_budget(key)
            if measured:
                within = self.within.pop(plan, {})
                within[digest] = None
                trim(within, KEPT_VALUES)
                self.within[plan] = within
                trim(self.within, self.kept)
