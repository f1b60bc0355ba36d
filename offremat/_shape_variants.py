"""Plans for blocks' inputs of another kind than their shape's plan was made on.

The same input shapes can carry blocks' inputs of another kind when values differ (a padding
mask where the example had none, padding removed before the blocks): those save other
tensors, so within a shape they get a plan of their own, profiled in the step that meets them
(:meth:`VariantPlanning.for_chain_input`). A mixin of :class:`offremat._shapes.ShapePlans`,
which owns the state these methods read and change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from offremat._call_checks import plain_autograd_only
from offremat._host import DeviceResources
from offremat._numbers import NumberPlaces, erased, same_sizes
from offremat._outgrown import (
    checked_now_and_then,
    measured_until_reached,
    profiled_variant,
    replanned,
)
from offremat._signatures import (
    BlockValue,
    Signature,
    VariantKey,
    block_values,
    chain_input_kind,
    chain_input_shapes,
    describe,
    handed_values,
    input_signature,
)
from offremat._stand_ins import StandIns
from offremat._step import StepsInFlight
from offremat._value_checks import KEPT_STRUCTURES, Place, same_value, trim
from offremat.executor import PlanExecutor
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain

logger = logging.getLogger(__name__)

_BLOCK_VALUES = "the blocks' own inputs"  # a structure of places (offremat._value_checks)

MODE_VALUES = 4
"""How many of the values a string the model computes for its blocks takes key a plan of
their own each (a mode's): the first seen; the later ones (a caption made lower case, new
at every step) are keyed by type, and checked."""

KEPT_VARIANTS = 64
"""How many plans for blocks' inputs of another kind a state keeps (the latest used): as
many as a call's signatures, since a blocks' length keys them by value once blamed."""


def _profiled_on(values: list[Any], by_value: frozenset[int], chain: Chain) -> bool:
    """Whether ``chain`` was profiled on ``values`` at the positions ``by_value``."""
    if not by_value:
        return True
    profiled = chain.metadata.get("chain_input_values")
    if profiled is None or len(profiled) != len(values):
        return False
    return all(same_value(values[at], profiled[at]) for at in by_value)


def _keyed(values: list[BlockValue], by_value: frozenset[int]) -> dict[int, BlockValue]:
    """The blocks' ``values`` at the positions ``by_value`` that key plans, in order."""
    return {at: values[at] for at in sorted(by_value) if at < len(values)}


@contextmanager
def parametrize_cache_suspended() -> Iterator[None]:
    """Profile outside the caller's ``parametrize.cached()``: the profile's backwards would
    free the graph of a weight the cache keeps for the step's own backward."""
    enabled, cache = parametrize._cache_enabled, parametrize._cache
    parametrize._cache_enabled, parametrize._cache = 0, {}
    try:
        yield
    finally:
        parametrize._cache_enabled, parametrize._cache = enabled, cache


class VariantPlanning:
    """:meth:`for_chain_input` for :class:`offremat._shapes.ShapePlans`."""

    stages: list[nn.Module]
    profile_blocks: Callable[[Chain, Any], Chain] | None
    measure_memory: bool
    numbers: NumberPlaces
    variants: dict[VariantKey, PlanExecutor]
    # The fields of the error each refused kind raises (see for_chain_input).
    refused: dict[VariantKey, tuple[Any, ...]]
    last: PlanExecutor | None
    in_flight: StepsInFlight
    # Per plan key, the positions among the blocks' numbers and strings that key by value;
    # per plan key and position, the values a string the model computes took (see _modes).
    sizing_values: dict[Signature, frozenset[int]]
    # How many measured steps over their budget blamed each of those positions.
    value_blames: dict[tuple[Signature, int], int]
    stand_ins: StandIns
    # The plan :meth:`executor` marked for measuring this step on the call's numbers, and its
    # mark before.
    call_measured: tuple[PlanExecutor, bool] | None
    mode_values: dict[tuple[Signature, int], dict[str, None]]
    resources: DeviceResources

    def for_chain_input(self, batch: Any, executor: PlanExecutor, value: Any) -> PlanExecutor:
        """The executor for the blocks' input ``value`` in a step on ``batch`` that
        :meth:`executor` gave ``executor``: itself, unless its chain was profiled on block
        inputs of another kind (:func:`chain_input_kind`), which the same shapes can carry
        when values differ (a padded batch where the example had none): they save other
        tensors, so they get a plan of their own, profiled on ``value`` in the step, with the
        costs around the blocks taken from ``executor``'s chain. Kept in memory only."""
        called = input_signature(batch)
        signature = self.numbers.key(called)
        values = block_values(value)
        handed = handed_values(batch)
        self.stand_ins.settle(self.numbers.checks)
        kind, by_value = self._kind(signature, executor, value, values, handed)
        variant = None if kind is None else self.variants.get((signature, kind))
        if variant is not None and variant.profile_due:  # a measured step on it passed

            def profile() -> Chain:
                with parametrize_cache_suspended():
                    return self.profile_blocks(executor.chain, value)

            key = (signature, kind)
            variant = profiled_variant(self, key, variant, profile, self.variants) or variant
        over = variant is not None and self._over_on_values((signature, kind), variant, batch)
        if over:
            kind, by_value = self._kind(signature, executor, value, values, handed)
            variant = None if kind is None else self.variants.get((signature, kind))
        # The call's numbers that its checks measure: not the ones its key holds by value (a
        # cap on a loop count equal to it hid the count).
        checked = self.numbers.left_out(called)
        if kind is None:
            self._check_block_values(signature, signature, executor, values, by_value, checked)
            return executor
        key = (signature, kind)
        if key in self.refused:
            # A fresh error: a stored one would keep each refused step's frames alive.
            raise InfeasibleBudgetError(*self.refused[key])
        if variant is not None:
            self.variants[key] = self.variants.pop(key)  # the latest used
            if variant.outgrown is not None:
                variant = replanned(self, signature, key, variant, self.variants)
            if not variant.verify_next:  # the step measured last on it ended, within budget
                self.numbers.checks.within_budget(key)
            elif not variant.verify_again:  # it never ended: its backward did not run
                self.numbers.checks.not_settled(key)
            measured_until_reached(variant)
            checked_now_and_then(variant)
        else:
            variant = self._stand_in(key, value, values, by_value)
            if variant is None:
                variant = self._plan_variant(key, executor.chain, value)
        measured, self.call_measured = self.call_measured, None
        if measured is not None and measured[0] is executor:
            # The call's numbers chose this step for measuring: it runs on this plan.
            executor.verify_next = measured[1]
            variant.verify_next = True
            self.numbers.checks.move(signature, key)
        # A call's number blamed here keys plans from the next step: this one is measured.
        variant.verify_next |= over and signature != self.numbers.key(called)
        self._check_block_values(key, signature, variant, values, by_value, checked)
        if not variant.plain:
            # The call's own plan may have run plainly where this one does not.
            reason = plain_autograd_only(self.stages, batch)
            if reason is not None:
                raise RuntimeError(reason)
        self.last = variant
        return variant

    def _kind(
        self,
        signature: Signature,
        executor: PlanExecutor,
        value: Any,
        values: list[BlockValue],
        handed: frozenset[Any],
    ) -> tuple[str | None, frozenset[int]]:
        """The kind of the blocks' input ``value`` (None where ``executor``, the plan of its
        call's shape, serves it), and the positions among its ``values`` that key by value."""
        by_value = self.sizing_values.get(signature, frozenset()) | self._modes(
            signature, values, handed
        )
        kind = chain_input_kind(value)
        shapes = chain_input_shapes(value)
        planned = executor.chain.metadata.get("chain_input")
        if by_value and (planned != kind or not _profiled_on(values, by_value, executor.chain)):
            # A plan of their own for these values (read once: a GPU waits for a tensor's).
            kind = chain_input_kind(value, tuple(_keyed(values, by_value).items()))
        # The sizes too: padding removed before the blocks sizes them by the batch's values.
        # A predicted chain's blocks never ran: its first step (measured) stands for them.
        executor.first_chain_input_shapes = executor.first_chain_input_shapes or shapes
        planned_shapes = executor.chain.metadata.get(
            "chain_input_shapes", executor.first_chain_input_shapes
        )
        if planned_shapes != shapes:
            kind = f"{kind} of shapes {shapes}"
        if planned is None or planned == kind or self.profile_blocks is None:
            return None, by_value
        return kind, by_value

    def _stand_in(
        self, key: VariantKey, value: Any, values: list[BlockValue], by_value: frozenset[int]
    ) -> PlanExecutor | None:
        """A plan of other values to run ``key``'s step on, where its blocks' values or the
        call's floats are keyed for good (:mod:`offremat._stand_ins`); None else.

        A float the call passes stands in on the variants of its other values with blocks'
        inputs of the same kind: with a padded batch, a temperature new at every step was a
        profile of the blocks at every step (38 in 40, a review)."""
        signature, kind = key
        keyed = _keyed(values, by_value)
        floats = self.numbers.keyed_floats(signature)
        for_good = any(self.value_blames.get((signature, at), 0) > 1 for at in keyed)
        if not for_good and not floats:
            return None
        places = frozenset(floats)
        call = erased(signature, places)
        if for_good:
            # The blocks' values key by value: any of them, on inputs of this kind and sizes.
            kind = (chain_input_kind(value), chain_input_shapes(value))
        candidates = [
            variant
            for (known, known_kind), variant in self.variants.items()
            if erased(known, places) == call
            and (
                (
                    variant.chain.metadata.get("chain_input"),
                    variant.chain.metadata.get("chain_input_shapes"),
                )
                if for_good
                else known_kind
            )
            == kind
        ]
        both = {("blocks", at): found for at, found in keyed.items()}
        both.update((("call", at), number) for at, number in floats.items())
        return self.stand_ins.choose(key, (call, kind), both, candidates, self._executor_for)

    def _executor_for(self, signature: Signature, chain: Chain) -> PlanExecutor:
        """An executor of a plan for ``chain``, one of ``signature``'s variants (see
        :meth:`_plan`); the planning time is counted."""
        began = time.perf_counter()
        plan = self._plan(signature, chain, variant=True)
        executor = PlanExecutor(
            self.stages, plan, chain, self.measure_memory, self.in_flight, self.resources
        )
        self.cache.planning_s += time.perf_counter() - began
        return executor

    def _over_on_values(self, key: VariantKey, variant: PlanExecutor, batch: Any) -> bool:
        """Whether the step measured last on the plan ``variant`` passed its budget on values
        its key ``key`` leaves out (the blocks', the call's); if so, they are blamed and key
        plans from now on, as on the shape's own plan (:meth:`executor`)."""
        if not variant.over_budget or variant.over_within_gradients:
            return False
        if not self.numbers.checks.measured(key):
            return False
        variant.over_budget = False
        others = self.numbers.over_budget(key, input_signature(batch), batch)
        self.block_values_size(key[0], others)
        return True

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
        if _profiled_on(values, frozenset(range(len(values))), executor.chain):
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

    def _plan_variant(self, key: VariantKey, chain: Chain, value: Any) -> PlanExecutor:
        """Profile the blocks on ``value`` and plan them; the last few variants are kept, and
        a refusal is remembered (it comes after the code before the blocks has run)."""
        self.cache.variants += 1
        began = time.perf_counter()
        logger.warning(
            "the blocks' inputs on this batch are not of the kind or size that its shape's "
            "plan was made for, so this step profiles and plans them too, for input %s (a "
            "padding mask where the example batch had none, padding removed before the "
            "blocks, or a number or a string that decides what the blocks save, makes such "
            "inputs)",
            describe(key[0]),
        )
        with parametrize_cache_suspended():
            variant_chain = self.profile_blocks(chain, value)
        self.cache.planning_s += time.perf_counter() - began
        try:
            variant = self._executor_for(key[0], variant_chain)
        except InfeasibleBudgetError as error:
            self.refused[key] = (
                error.budget_bytes,
                error.min_budget_bytes,
                error.solver,
                error.shape,
                error.exact,
            )
            trim(self.refused, KEPT_VARIANTS)
            raise
        self._learn_neutral_values(key[0], variant_chain)
        self.variants[key] = variant
        self.numbers.checks.replaced(key)
        trim(self.variants, KEPT_VARIANTS)
        return variant
