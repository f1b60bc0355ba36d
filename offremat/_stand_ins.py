"""Plans that stand in for blocks' values keyed for good, which are new at every step.

A value of the blocks' inputs that measured steps blamed twice keys plans by value for good
(:mod:`offremat._shape_variants`); where it is new at every step (a float the model computes
that picks a branch), each step was a profile (a review: 76 in 80 steps). Instead, a new value
runs on a plan made for the envelope of the chains profiled for the same call and blocks'
input kind (:func:`solvers.envelope.envelope`: at every stage the most any of them holds), or
on the plan of the chain that holds the most where that chain is the envelope: a value that
picks which blocks add a branch holds as much on either side, in other blocks, and the plan
of one side ran the other at 1.2 times the budget, then profiled every later step (a review).
The step is measured where the value lies beyond the range that plan's measured steps within
budget spanned standing in, or is no number, and one step in
:data:`offremat._value_checks.MEASURED_EVERY` else (each measured, steps were 1.4 times slower
on CPU, in a review). A measured step over the budget is said at its end, and from then on a
value beyond that plan's span is profiled rather than run on it (the envelope then takes in
its chain, or the plan spans it): a value within the span that passed the budget passed it on
something no profile of a value sees (a mask's values), which a profile at every step, as
before, would not mend.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from offremat._numbers import same_sizes
from offremat._signatures import (
    Signature,
    VariantKey,
    chain_input_kind,
    chain_input_shapes,
    describe,
)
from offremat._value_checks import (
    KEPT_STRUCTURES,
    MEASURED_EVERY,
    Span,
    ValueChecks,
    trim,
    widened,
    within_span,
)
from offremat.executor import PlanExecutor
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.envelope import envelope
from solvers.registry import keep_all_peak

logger = logging.getLogger(__name__)


class StandIns:
    """The plans standing in for keyed values, per state of the stages."""

    def __init__(self, kept: int) -> None:
        self.kept = kept  # how many keys and plans' spans are remembered
        self.keys: dict[VariantKey, None] = {}  # the keys a stand-in serves
        # The stand-in plans that passed the budget (a value beyond their spans is profiled),
        # and per call key, the key and values of the value profiled last instead.
        self.failed: dict[PlanExecutor, None] = {}
        self.profiled: dict[Signature, tuple[VariantKey, dict[int, Any]]] = {}
        # Per call key and blocks' input kind: the plans whose chains the stand-in bounds,
        # and the stand-in.
        self.envelopes: dict[tuple[Signature, Any], tuple[list[PlanExecutor], PlanExecutor]] = {}
        # Per stand-in plan, the range each keyed position's values spanned within budget.
        self.spans: dict[PlanExecutor, dict[int, Span | None]] = {}
        # The stand-in the last step ran on, measured, and its keyed values.
        self.standing: tuple[VariantKey, PlanExecutor, dict[int, Any]] | None = None
        self.count = 0  # steps run on stand-ins

    def choose(
        self,
        key: VariantKey,
        value: Any,
        keyed: dict[int, Any],
        variants: dict[VariantKey, PlanExecutor],
        plan_for: Callable[[Signature, Chain], PlanExecutor],
    ) -> PlanExecutor | None:
        """The plan to stand in for ``key`` (the blocks' input ``value``, its values keyed
        for good ``keyed`` by position), registered in ``variants``; None where none can.
        ``plan_for`` plans a chain of the call's, an envelope."""
        signature = key[0]
        kind = (chain_input_kind(value), chain_input_shapes(value))
        chosen = self._envelope_plan((signature, kind), variants, plan_for)
        if chosen is None:
            return None
        spans = self.spans.pop(chosen, {})
        profiled = self.profiled.pop(signature, None)
        if profiled is not None and profiled[0] in variants:
            # Its chain lies within the envelope: the plan holds that value too.
            for at, v in profiled[1].items():
                spans[at] = widened(spans.get(at), v)
        self.spans[chosen] = spans
        trim(self.spans, self.kept)
        spanned = all(within_span(spans.get(at), v) for at, v in keyed.items())
        if not spanned and chosen in self.failed:
            self.profiled[signature] = (key, keyed)
            trim(self.profiled, KEPT_STRUCTURES)
            return None
        variants[key], self.keys[key] = chosen, None
        trim(variants, self.kept)
        trim(self.keys, self.kept)
        self.count += 1
        if not spanned or self.count % MEASURED_EVERY == 0:
            chosen.verify_next = True
            self.standing = (key, chosen, keyed)
        return chosen

    def _envelope_plan(
        self,
        place: tuple[Signature, Any],
        variants: dict[VariantKey, PlanExecutor],
        plan_for: Callable[[Signature, Chain], PlanExecutor],
    ) -> PlanExecutor | None:
        """The plan for the envelope of the profiled chains of the call key and blocks' input
        kind ``place`` (the one whose chain is it, if any); None where there are none."""
        signature, kind = place
        profiled = {
            id(variant): variant
            for (known, _), variant in variants.items()
            if known == signature
            and "chain_input_values" in variant.chain.metadata
            and (
                variant.chain.metadata.get("chain_input"),
                variant.chain.metadata.get("chain_input_shapes"),
            )
            == kind
        }
        if not profiled:
            return None
        known = self.envelopes.pop(place, None)
        if known is not None and {id(variant) for variant in known[0]} == profiled.keys():
            self.envelopes[place] = known
            return known[1]
        sources = sorted(profiled.values(), key=lambda v: -keep_all_peak(v.chain))
        bound = envelope([variant.chain for variant in sources])
        chosen = sources[0]
        if known is not None and same_sizes(bound, known[1].chain):
            chosen = known[1]  # the new profile holds no more
        elif not same_sizes(bound, chosen.chain):
            del bound.metadata["chain_input_values"]  # profiled on no one value
            try:
                chosen = plan_for(signature, bound)
            except InfeasibleBudgetError:
                pass  # the sides together do not fit: the largest stands in, measured
            else:
                logger.info(
                    "a plan for the most each stage held on %d profiled values stands in for "
                    "new values of the blocks, for input %s",
                    len(sources),
                    describe(signature),
                )
        self.envelopes[place] = (sources, chosen)
        trim(self.envelopes, KEPT_STRUCTURES)
        return chosen

    def settle(self, variants: dict[VariantKey, PlanExecutor], checks: ValueChecks) -> None:
        """Take in the step run last on a measured stand-in: within budget, its values widen
        what the plan spans; over, the key is profiled at its next step (module notes)."""
        standing, self.standing = self.standing, None
        if standing is None:
            return
        key, variant, keyed = standing
        if not variant.over_budget:
            spans = self.spans.pop(variant, {})
            for at, v in keyed.items():
                spans[at] = widened(spans.get(at), v)
            self.spans[variant] = spans
            trim(self.spans, self.kept)
            return
        variant.over_budget = False
        if variants.get(key) is variant:
            del variants[key]
        self.keys.pop(key, None)
        checks.not_settled(key)
        self.failed[variant] = None
        trim(self.failed, self.kept)
