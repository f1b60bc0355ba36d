"""The numbers and strings the blocks receive that key their plans, for
:class:`offremat._shape_variants.VariantPlanning`.

A count, a length or a mode the model computes from the batch reaches the blocks as a value,
not a shape, and may decide what they save. Such values are checked as the call's numbers are
(:mod:`offremat._value_checks`); those a step over its budget blamed, and the strings the
model computes on their first :data:`MODE_VALUES` values, key plans of their own; two plans
that differ in such a value alone and agree in every byte show it sizes nothing, and it keys
plans no more. A mixin: :class:`offremat._shapes.ShapePlans` owns the state it reads.
"""

from __future__ import annotations

import logging
from typing import Any

from offremat._numbers import NumberPlaces, same_sizes
from offremat._signatures import BlockValue, Signature, VariantKey, describe
from offremat._value_checks import KEPT_STRUCTURES, Place, same_value, trim
from offremat.executor import PlanExecutor
from solvers.chain import Chain

logger = logging.getLogger(__name__)

_BLOCK_VALUES = "the blocks' own inputs"  # a structure of places (offremat._value_checks)

MODE_VALUES = 4
"""How many of the values a string the model computes for its blocks takes key a plan of
their own each (a mode's): the first seen; the later ones (a caption made lower case, new
at every step) are keyed by type, and checked."""


def profiled_on(values: list[Any], by_value: frozenset[int], chain: Chain) -> bool:
    """Whether ``chain`` was profiled on ``values`` at the positions ``by_value``."""
    if not by_value:
        return True
    profiled = chain.metadata.get("chain_input_values")
    if profiled is None or len(profiled) != len(values):
        return False
    return all(same_value(values[at], profiled[at]) for at in by_value)


class BlockValueKeys:
    """The blocks' values that key plans (see the module's notes)."""

    numbers: NumberPlaces
    variants: dict[VariantKey, PlanExecutor]
    # Per plan key, the positions among the blocks' numbers and strings that key by value;
    # per plan key and position, the values a string the model computes took (see _modes).
    sizing_values: dict[Signature, frozenset[int]]
    # How many measured steps over their budget blamed each of those positions.
    value_blames: dict[tuple[Signature, int], int]
    mode_values: dict[tuple[Signature, int], dict[str, None]]

    def _check_block_values(
        self,
        key: Signature | VariantKey,
        signature: Signature,
        executor: PlanExecutor,
        values: list[BlockValue],
        by_value: frozenset[int],
        called: frozenset[tuple[type, Any]],
    ) -> None:
        """Check the numbers and strings the blocks receive (``values``: a count, a length or
        a mode the model computes from the batch, a caption handed down) on the plan that runs
        the step, ``executor`` (of key ``key``: the call's ``signature``, or a variant's), as
        the call's numbers are (:mod:`offremat._value_checks`): a step on new values is
        measured, this one marked so. Not those at the positions ``by_value``, which key plans
        of their own: the ones a step measured over its budget blamed (one may slice what the
        blocks save, or choose what they run, as no shape shows), and the strings the model
        computes on their first :data:`MODE_VALUES` values (a mode's: a plan each, exact from
        its first step). Nor the numbers the call passes that its key leaves out (``called``:
        Hugging Face's ``num_items_in_batch`` reaches every layer), which the call's own checks
        measure."""
        if profiled_on(values, frozenset(range(len(values))), executor.chain):
            return  # the values the plan was profiled on
        checked = [
            (at, value)
            for at, value in enumerate(values)
            if at not in by_value and (isinstance(value, str) or (type(value), value) not in called)
        ]
        checks = self.numbers.checks
        call = (key, tuple(values))
        place = (_BLOCK_VALUES, signature)
        if checked and checks.verifies(call, key, place, checked, executor.verify_next):
            executor.verify_next = True

    def _modes(
        self, signature: Signature, values: list[BlockValue], handed: frozenset[Any]
    ) -> frozenset[int]:
        """The positions of the strings among ``values`` that the call does not pass
        (``handed``), where they hold one of the first :data:`MODE_VALUES` values seen there."""
        modes = set()
        for at, value in enumerate(values):
            if isinstance(value, str) and (type(value), value) not in handed:
                seen = self.mode_values.pop((signature, at), {})
                if len(seen) < MODE_VALUES:
                    seen[value] = None
                self.mode_values[(signature, at)] = seen
                if value in seen:
                    modes.add(at)
        trim(self.mode_values, KEPT_STRUCTURES)
        return frozenset(modes)

    def block_values_size(self, signature: Signature, blamed: frozenset[Place]) -> None:
        """A step measured over its budget on ``signature``'s plan blamed numbers or strings
        the blocks received, at the ``blamed`` places: from now on their values key the
        blocks' plans."""
        positions = frozenset(at for where, at in blamed if where == (_BLOCK_VALUES, signature))
        if not positions:
            return
        self.sizing_values[signature] = self.sizing_values.pop(signature, frozenset()) | positions
        trim(self.sizing_values, KEPT_STRUCTURES)
        for at in positions:
            self.value_blames[(signature, at)] = self.value_blames.pop((signature, at), 0) + 1
        trim(self.value_blames, KEPT_STRUCTURES)
        logger.warning(
            "a step measured over its plan's budget where the blocks received numbers or "
            "strings at values that plan was not profiled on (a count, a length or a mode the "
            "model computes from the batch, a Python number or a 0-d tensor?): they "
            "decide what the blocks save, so from now on each of their values gets a plan of "
            "its own, for input %s",
            describe(signature),
        )

    def _learn_neutral_values(self, signature: Signature, chain: Chain) -> None:
        """Where ``chain``, just profiled, and another of ``signature``'s plans differ in the
        values at positions that key plans (blamed beside another: a scale new at every step
        beside the length that sized; two such, each new at every step, were a profile at
        every step when one alone had to differ) and agree in every byte, those positions key
        them no more: their values size nothing, or none between those two (a float picking
        a branch past a threshold, two values on one side), so their next new values are
        measured as a new place's are, and blamed a second time they key plans for good (a
        float new at every step picking a branch ran half its steps at 1.46 times the budget,
        unmeasured, blamed and found neutral again in turn)."""
        values = chain.metadata.get("chain_input_values")
        positions = self.sizing_values.get(signature, frozenset())
        if values is None or not positions:
            return
        for (known, _), other in reversed(self.variants.items()):
            seen = other.chain.metadata.get("chain_input_values")
            if known != signature or seen is None or len(seen) != len(values):
                continue
            differ = [
                at for at in positions if at < len(values) and not same_value(values[at], seen[at])
            ]
            if (
                differ
                and all(self.value_blames.get((signature, at), 0) < 2 for at in differ)
                and same_sizes(chain, other.chain)
            ):
                self.sizing_values[signature] = positions - set(differ)
                for at in differ:
                    self.numbers.checks.forget(((_BLOCK_VALUES, signature), at))
                logger.info(
                    "the blocks' values at positions %s changed and no size with them: their "
                    "values key plans no more",
                    sorted(differ),
                )
                return
