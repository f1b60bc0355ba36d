"""Plans that stand in for blocks' values keyed for good, which are new at every step.

A value of the blocks' inputs that measured steps blamed twice keys plans by value for good
(:mod:`offremat._shape_variants`); where it is new at every step (a float the model computes
that picks a branch), each step was a profile (a review: 76 in 80 steps). Instead, a new value
runs on the plan of another value whose chain holds the most (the greatest keep-all peak),
for the same call and blocks' input kind. The step is measured where the value lies beyond
the range that plan's measured steps within budget spanned standing in, or is no number, and
one step in :data:`offremat._value_checks.MEASURED_EVERY` else (each measured, steps were 1.4
times slower on CPU, in a review). A measured step over the budget is said at its end; its
value is profiled at its next step, and the next values too, until one's chain holds more
than that plan's (past a threshold no plan has seen).
"""

from __future__ import annotations

from typing import Any

from offremat._signatures import Signature, VariantKey, chain_input_kind, chain_input_shapes
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
from solvers.registry import keep_all_peak


class StandIns:
    """The plans standing in for keyed values, per state of the stages."""

    def __init__(self, kept: int) -> None:
        self.kept = kept  # how many keys and plans' spans are remembered
        self.keys: dict[VariantKey, None] = {}  # the keys a stand-in serves
        # Per call key, the keep-all peak of the chain whose plan, standing in, last passed
        # the budget.
        self.outgrown: dict[Signature, int] = {}
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
    ) -> PlanExecutor | None:
        """The plan to stand in for ``key`` (the blocks' input ``value``, its values keyed
        for good ``keyed`` by position), registered in ``variants``; None where none can."""
        signature = key[0]
        kind = (chain_input_kind(value), chain_input_shapes(value))
        others = [
            variant
            for (known, _), variant in variants.items()
            if known == signature
            and (
                variant.chain.metadata.get("chain_input"),
                variant.chain.metadata.get("chain_input_shapes"),
            )
            == kind
        ]
        chosen = max(others, key=lambda other: keep_all_peak(other.chain), default=None)
        if chosen is None or keep_all_peak(chosen.chain) <= self.outgrown.get(signature, -1):
            return None
        variants[key], self.keys[key] = chosen, None
        trim(variants, self.kept)
        trim(self.keys, self.kept)
        spans = self.spans.get(chosen, {})
        self.count += 1
        spanned = all(within_span(spans.get(at), v) for at, v in keyed.items())
        if not spanned or self.count % MEASURED_EVERY == 0:
            chosen.verify_next = True
            self.standing = (key, chosen, keyed)
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
        self.spans.pop(variant, None)
        if variants.get(key) is variant:
            del variants[key]
        self.keys.pop(key, None)
        checks.not_settled(key)
        self.outgrown[key[0]] = keep_all_peak(variant.chain)
        trim(self.outgrown, KEPT_STRUCTURES)
