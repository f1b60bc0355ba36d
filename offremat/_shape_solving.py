"""Solving a shape's chain into the executor of its plan, for :class:`offremat._shapes.ShapePlans`.

A quick solver's plan first where one is given (provisional: the final solver's replaces it at
the shape's next step), the final solver's else; the error of a budget too small names the
shape. A mixin of :class:`offremat._shapes.ShapePlans`, which owns the state these methods
read and change.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from offremat._host import DeviceResources
from offremat._numbers import NumberPlaces
from offremat._plan_cache import PlanCache
from offremat._signatures import Signature, VariantKey, describe
from offremat._step import StepsInFlight
from offremat._value_checks import trim
from offremat.executor import PlanExecutor
from solvers.budget import InfeasibleBudgetError, format_bytes
from solvers.chain import Chain
from solvers.plan import Plan

logger = logging.getLogger(__name__)

KEPT_SIGNATURES = 64
"""How many input signatures a state keeps plans and profiled chains for (the latest used):
a number that sizes tensors and changes at every step must not grow them without end."""


@dataclass
class ShapeCache:
    """Plans made so far, by input signature, and how often a step found its plan ready."""

    hits: int = 0
    misses: int = 0
    from_disk: int = 0
    predicted: int = 0
    improved: int = 0
    variants: int = 0
    planning_s: float = 0.0


class ShapeSolving:
    """Plans made on chains, and the cache's figures (see the module's notes)."""

    stages: Sequence[nn.Module]
    quick: Callable[[Chain], Plan] | None
    solve: Callable[[Chain], Plan]
    measure_memory: bool
    executors: dict[Signature, PlanExecutor]
    variants: dict[VariantKey, PlanExecutor]
    profiled: dict[Signature, Chain]
    provisional: set[Signature]
    unprofiled: set[Signature]
    numbers: NumberPlaces
    cache: ShapeCache
    in_flight: StepsInFlight
    resources: DeviceResources
    disk: PlanCache | None
    disk_state: Any
    module_state: Any
    modes: Any
    state_change: str | None

    def _disk(self) -> PlanCache | None:
        """The disk cache, where it holds plans for the state the stages are in now."""
        return self.disk if (self.module_state, self.modes) == self.disk_state else None

    def _plan(self, signature: Signature, chain: Chain, variant: bool = False) -> Plan:
        """``quick``'s plan where it fits (then provisional; a ``variant`` is planned in the
        step that meets it and not improved later), else ``solve``'s; the error of a budget
        too small names the shape."""
        try:
            if self.quick is not None:
                try:
                    plan = self.quick(chain)
                except InfeasibleBudgetError:
                    pass  # the final solver may fit where the quick one does not (offloading)
                else:
                    if not variant:
                        self.provisional.add(signature)
                    return plan
            return self.solve(chain)
        except InfeasibleBudgetError as error:
            shape = describe(signature)
            if variant:
                shape += (
                    " with blocks' inputs of another kind or size (refused once the code before "
                    "the blocks had run)"
                )
            raise InfeasibleBudgetError(
                error.budget_bytes,
                error.min_budget_bytes,
                error.solver,
                shape,
                exact=error.exact,
                cause=self.state_change,
            ) from None

    def _improve(self, signature: Signature, chain: Chain) -> PlanExecutor:
        """The final solver's plan in place of the provisional one, stored on disk."""
        began = time.perf_counter()
        self.provisional.discard(signature)
        plan = self.solve(chain)
        disk = self._disk()
        if disk is not None:
            disk.store(repr(signature), chain, plan)
        self.cache.improved += 1
        return self._install(signature, chain, plan, began, "improved the plan for")

    def _install(
        self, signature: Signature, chain: Chain, plan: Plan, began: float, done: str
    ) -> PlanExecutor:
        executor = PlanExecutor(
            self.stages, plan, chain, self.measure_memory, self.in_flight, self.resources
        )
        self.executors[signature] = executor
        trim(self.executors, KEPT_SIGNATURES)
        self.numbers.checks.replaced(signature)
        self.provisional &= self.executors.keys() | self.profiled.keys()
        self.unprofiled &= self.executors.keys() | self.profiled.keys()
        # A keep-all plan runs as plain autograd, measured through its backward
        # (offremat._plain_measured).
        executor.verify_next = signature in self.unprofiled
        seconds = time.perf_counter() - began
        self.cache.planning_s += seconds
        logger.info(
            "%s input %s in %.2f s: %s plan, predicted peak %s",
            done,
            describe(signature),
            seconds,
            plan.solver,
            format_bytes(plan.predicted_peak_bytes or 0),
        )
        return executor

    def info(self) -> dict[str, Any]:
        """``hits``, ``misses`` and ``plans`` (as in ``functools.lru_cache``; hits and misses
        count steps by their call's signature), misses read from the disk cache
        (``from_disk``) or planned on a predicted chain (``predicted``), provisional plans
        replaced by the final solver's (``improved``), plans made for blocks' inputs of
        another kind than their shape's (``variants``, counted in ``plans`` too), and seconds
        spent planning."""
        return {
            "hits": self.cache.hits,
            "misses": self.cache.misses,
            "plans": len(self.executors) + len(self.variants),
            "from_disk": self.cache.from_disk,
            "predicted": self.cache.predicted,
            "improved": self.cache.improved,
            "variants": self.cache.variants,
            "planning_s": self.cache.planning_s,
        }
