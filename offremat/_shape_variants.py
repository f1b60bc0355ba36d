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
from offremat._numbers import NumberPlaces
from offremat._signatures import (
    Signature,
    chain_input_kind,
    chain_input_shapes,
    describe,
    handed_strings,
    input_signature,
)
from offremat._step import StepsInFlight
from offremat.executor import PlanExecutor
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain

logger = logging.getLogger(__name__)

VariantKey = tuple[Signature, str]
"""A call's signature and the kind of its blocks' inputs (:func:`chain_input_kind`)."""

KEPT_VARIANTS = 8
"""How many plans for blocks' inputs of another kind a state keeps (the latest made)."""


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
    resources: DeviceResources

    def for_chain_input(self, batch: Any, executor: PlanExecutor, value: Any) -> PlanExecutor:
        """The executor for the blocks' input ``value`` in a step on ``batch`` that
        :meth:`executor` gave ``executor``: itself, unless its chain was profiled on block
        inputs of another kind (:func:`chain_input_kind`), which the same shapes can carry
        when values differ (a padded batch where the example had none): they save other
        tensors, so they get a plan of their own, profiled on ``value`` in the step, with the
        costs around the blocks taken from ``executor``'s chain. Kept in memory only."""
        kind = chain_input_kind(value, handed_strings(batch))
        shapes = chain_input_shapes(value)
        planned = executor.chain.metadata.get("chain_input")
        # The sizes too: padding removed before the blocks sizes them by the batch's values.
        # A predicted chain's blocks never ran: its first step (measured) stands for them.
        executor.first_chain_input_shapes = executor.first_chain_input_shapes or shapes
        planned_shapes = executor.chain.metadata.get(
            "chain_input_shapes", executor.first_chain_input_shapes
        )
        if planned == kind and planned_shapes != shapes:
            kind = f"{kind} of shapes {shapes}"
        if planned is None or planned == kind or self.profile_blocks is None:
            return executor
        key = (self.numbers.key(input_signature(batch)), kind)
        if key in self.refused:
            # A fresh error: a stored one would keep each refused step's frames alive.
            raise InfeasibleBudgetError(*self.refused[key])
        variant = self.variants.get(key)
        if variant is None:
            variant = self._plan_variant(key, executor.chain, value)
        if not variant.plain:
            # The call's own plan may have run plainly where this one does not.
            reason = plain_autograd_only(self.stages, batch)
            if reason is not None:
                raise RuntimeError(reason)
        self.last = variant
        return variant

    def _plan_variant(self, key: VariantKey, chain: Chain, value: Any) -> PlanExecutor:
        """Profile the blocks on ``value`` and plan them; the last few variants are kept, and
        a refusal is remembered (it comes after the code before the blocks has run)."""
        self.cache.variants += 1
        began = time.perf_counter()
        logger.warning(
            "the blocks' inputs on this batch are not of the kind or size its shape's plan was "
            "made for (a padding mask where the example batch had none, padding removed "
            "before the blocks?): planning them too, for input %s",
            describe(key[0]),
        )
        with parametrize_cache_suspended():
            variant_chain = self.profile_blocks(chain, value)
        try:
            plan = self._plan(key[0], variant_chain, variant=True)
        except InfeasibleBudgetError as error:
            self.refused[key] = (
                error.budget_bytes,
                error.min_budget_bytes,
                error.solver,
                error.shape,
                error.exact,
            )
            while len(self.refused) > KEPT_VARIANTS:
                self.refused.pop(next(iter(self.refused)))
            raise
        variant = PlanExecutor(
            self.stages, plan, variant_chain, self.measure_memory, self.in_flight, self.resources
        )
        self.variants[key] = variant
        while len(self.variants) > KEPT_VARIANTS:
            self.variants.pop(next(iter(self.variants)))
        self.cache.planning_s += time.perf_counter() - began
        return variant
