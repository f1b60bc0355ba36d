"""Plans for blocks' inputs of another kind than their shape's plan was made on.

The same input shapes can carry blocks' inputs of another kind when values differ (a padding
mask where the example had none, padding removed before the blocks): those save other
tensors, so within a shape they get a plan of their own, profiled in the step that meets them
(:meth:`VariantPlanning.for_chain_input`); the numbers and strings the blocks receive that
key such plans are :mod:`offremat._block_value_keys`'s. A mixin of
:class:`offremat._shapes.ShapePlans`, which owns the state these methods read and change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from torch import nn
from torch.nn.utils import parametrize

from offremat._block_value_keys import BlockValueKeys, profiled_on
from offremat._call_checks import plain_autograd_only
from offremat._host import DeviceResources
from offremat._numbers import NumberPlaces, erased
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
from offremat._value_checks import trim
from offremat.executor import PlanExecutor
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain

logger = logging.getLogger(__name__)

KEPT_VARIANTS = 64
"""How many plans for blocks' inputs of another kind a state keeps (the latest used): as
many as a call's signatures, since a blocks' length keys them by value once blamed."""


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


class VariantPlanning(BlockValueKeys):
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
    stand_ins: StandIns
    # The plan :meth:`executor` marked for measuring this step on the call's numbers, and its
    # mark before.
    call_measured: tuple[PlanExecutor, bool] | None
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
        if by_value and (planned != kind or not profiled_on(values, by_value, executor.chain)):
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
