"""The optimal recompute-only schedule: rotor's persistent dynamic program.

Herrmann, Beaumont, Eyraud-Dubois, Hermenier, Pacheco, "Optimal checkpointing for heterogeneous
chains: how to train deep neural networks with limited memory" (2019). Write opt(m, s, t) for
the least time to run the backward of stages s..t given a_{s-1} and δ_t resident, with m bytes
available besides a_{s-1}. It is the better of

- F_all(s), then opt(m - x̄_s, s+1, t), then B(s);
- F_ck(s), F_none(s+1..j-1), then opt(m - x_{j-1}, j, t), then opt(m, s, j-1), for s < j <= t.

Design note, two feasibility conditions: the recurrence as rotor states it never checks the
memory of the F_all(s) and B(s) that bracket the first option. F_all(s) runs with δ_t resident
and needs x_t + x̄_s + ftmp_s; B(s) runs after the sub-problem has left δ_s and needs
x_{s-1} + x_s + x̄_s + btmp_s. Where neither condition binds (for example on chains with equal
activation sizes and no temporaries) the optimum is rotor's; where one binds, rotor's plan
exceeds its budget on rotor's own memory model (``tests/test_dp.py`` shows such a chain), so we
check both.

Design note, what the caller holds: from B(L) to the end of the step the caller keeps its
output and the gradient it seeded (the chain's ``held_bytes``), so every sub-problem
opt(., s, t) with t < L, which runs after B(L), needs those bytes too.

Design note, two forward temporaries: a forward with autograd (F_all) and one without (F_ck,
F_none) have different transient peaks (the chain's ``fwd_tmp_bytes`` and
``nograd_fwd_tmp_bytes``). The room for the forwards without autograd of a split at j,
x_t + max(x_s + ntmp_s, x_{k-1} + x_k + ntmp_k for s < k < j), therefore bounds the second
option only (rotor takes k up to t - 1 for every split, more than a split runs): the first option
runs F_all(s), whose need x_t + x̄_s + ftmp_s is checked above, and its sub-problem checks its
own forwards. With one temporary for both, as design.md has it, the two readings agree.

Sizes are rounded up to multiples of budget/slots, as rotor does; the plan is therefore
feasible in exact bytes as well. Rounding can hide that plain autograd fits: when it does in
exact bytes, its time is the floor Σf + Σb, so :func:`solve_dp` returns it directly. It can
hide faster plans too, all of them at rotor's exact least memory: where quick, the same
recurrence in exact bytes (:mod:`solvers.dp_exact`) answers instead, and the answer is never
slower than a fixed plan of the family that fits (:mod:`solvers.dp_family`).
"""

from __future__ import annotations

import logging

import numpy as np

from solvers.baselines import keep_all
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.dp_exact import ExactTable
from solvers.dp_family import fastest_fitting
from solvers.dp_table import FORWARD_ALL, Sizes, Table, operations, single_stage_times
from solvers.frozen import (
    least_budget,
    lift,
    lift_merged,
    merged,
    trained_part,
    with_frozen_prefix,
)
from solvers.plan import Plan
from solvers.simulator import score, simulate

logger = logging.getLogger(__name__)

DEFAULT_SLOTS = 500


TABLE_BYTES_LIMIT = 8 * 2**30
"""The most memory the DP's tables may take; more is refused up front with what to do."""

SECONDS_PER_CELL = 8e-10
"""DP time per stage per table cell, measured on a 2-core machine (200, 400 and 800 stages at
500 slots took 4, 27 and 192 s: 1.0e-9, 8.4e-10 and 7.5e-10 s per stage and cell)."""

WARN_SECONDS = 30.0
"""A DP expected to take longer says so before it starts."""

LIMIT_SECONDS = 600.0
"""A DP expected to take longer is refused up front with what to do."""


def table_bytes(length: int, slots: int) -> int:
    """The memory of the DP's tables: opt (float64) and the choice (int32) per (s, t, m)."""
    return (length + 2) * (length + 1) * (slots + 1) * (8 + 4)


def estimated_seconds(length: int, slots: int) -> float:
    """About how long the DP takes: each of the L^2 sub-chains scans up to L splits per slot."""
    return SECONDS_PER_CELL * length**3 * (slots + 1)


def check_table_size(chain: Chain, slots: int) -> None:
    """Refuse a DP whose tables would not fit in memory or that would run for too long, naming
    its estimated memory and time and what to do; warn about one that takes a while."""
    need = table_bytes(chain.length, slots)
    seconds = estimated_seconds(chain.length, slots)
    cost = (
        f"the dp for {chain.length} stages at {slots} slots needs about "
        f"{need / 2**30:.1f} GiB of tables and {seconds:.0f} s"
    )
    if need > TABLE_BYTES_LIMIT or seconds > LIMIT_SECONDS:
        most = min(
            TABLE_BYTES_LIMIT // table_bytes(chain.length, 0) - 1,
            int(LIMIT_SECONDS / estimated_seconds(chain.length, 0)) - 1,
        )
        fewer = f"use at most {most} slots, or " if most >= 1 else ""
        raise ValueError(
            f"{cost} (limits {TABLE_BYTES_LIMIT / 2**30:.0f} GiB, {LIMIT_SECONDS:.0f} s): "
            f"{fewer}group blocks into fewer stages (--stages, or stages= in optimize)"
        )
    if seconds > WARN_SECONDS:
        logger.warning("%s; group blocks into fewer stages (--stages) for a faster answer", cost)


def solve_dp(
    chain: Chain,
    budget_bytes: int,
    slots: int = DEFAULT_SLOTS,
    tolerance: float = 0.0,
    exact: bool = True,
) -> Plan:
    """The fastest recompute-only plan within ``budget_bytes`` (rotor's persistent DP).

    The DP in exact bytes answers where it takes at most :data:`EXACT_SECONDS` (``info``
    has ``exact``); else sizes are rounded up to ``budget_bytes / slots``, and where that
    rounding alone leaves no plan, above rotor's exact least memory, a finer DP or the
    least-memory plan answers (:func:`_near_least_memory`), so every budget from
    :func:`memory_need` up has a plan. A fixed plan of the family that fits and is faster
    (:func:`solvers.dp_family.fastest_fitting`) then replaces the DP's, ``info`` naming it.
    With a ``tolerance`` above 0, the plan that needs the least memory among those at most
    that fraction slower than the fastest, both at ``slots``: the table holds the optimum for
    every smaller budget, so this costs nothing more (the exact DP answers only where the
    table has no plan). With ``exact`` False the exact DP runs only where the table has no
    plan (the MILP's warm starts, which solve many budgets in a time limit). When plain
    autograd fits, it is the answer whatever the tolerance. Raises
    :class:`InfeasibleBudgetError`, naming the least feasible budget, when none fits.
    """
    if slots < 1:
        raise ValueError(f"slots must be positive, got {slots}")
    if isinstance(tolerance, bool) or not isinstance(tolerance, (int, float)):
        raise ValueError(f"tolerance must be a number in [0, 1), got {tolerance!r}")
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    plan = _solve(chain, budget_bytes, slots, tolerance, exact)
    if tolerance:  # the plan is the least memory within the tolerance, a baseline is not
        return score(plan, chain, budget_bytes)
    return fastest_fitting(plan, chain, budget_bytes)


def _solve(chain: Chain, budget_bytes: int, slots: int, tolerance: float, first: bool) -> Plan:
    """:func:`solve_dp`'s plan before the baselines are compared (unscored)."""
    if chain.frozen_stages:
        return with_frozen_prefix(
            chain, budget_bytes, lambda part, room: _solve(part, room, slots, tolerance, first)
        )
    check_table_size(chain, slots)
    plain = keep_all(chain)
    if simulate(plain, chain, budget_bytes).feasible:
        return Plan(plain.ops, chain.stage_names, "dp", info={"slots": slots, "keep_all": True})
    # With a tolerance the table's optimum at every smaller budget is needed, which the DP in
    # exact bytes does not give.
    exact = first and budget_bytes > 0 and not tolerance
    plan = _exact_plan(chain, budget_bytes) if exact else None
    if plan is None and budget_bytes > 0:
        plan = _table_plan(chain, budget_bytes, slots, tolerance)
    if plan is None:
        least = memory_need(chain)
        if budget_bytes < least:
            raise InfeasibleBudgetError(budget_bytes, least, "dp")
        plan = _near_least_memory(chain, budget_bytes, slots, exact_tried=exact)
    return plan


EXACT_SECONDS = 0.5
"""The most time the DP in exact bytes may take (then the rounded table answers instead):
enough for every budget of the shipped chains (llama7b's worst took 0.26 s)."""

LEAST_MEMORY_SECONDS_PER_CELL = 2e-7
"""The time of :func:`_least_memory` per stage cubed, measured on a 2-core machine (50, 100
and 200 stages took 0.033, 0.19 and 1.45 s: 2.6e-7, 1.9e-7 and 1.8e-7 s)."""

EXACT_SECONDS_PER_CELL = 4e-7
"""The exact DP's time per state and stage (its splits), measured on a 2-core machine
(llama7b, 23,080 states: 3.3e-7 s; random chains of 50 and 200 stages: 3.6e-7 and 4.1e-7)."""


def _exact_plan(chain: Chain, budget_bytes: int) -> Plan | None:
    """The DP's plan in exact bytes (:mod:`solvers.dp_exact`) where it takes at most about
    :data:`EXACT_SECONDS`; None where it would take longer or nothing fits."""
    length = chain.length
    left = EXACT_SECONDS - LEAST_MEMORY_SECONDS_PER_CELL * length**3
    limit = int(left / (EXACT_SECONDS_PER_CELL * length))
    if limit < 1:
        return None
    sizes, need, _ = _least_memory(chain)
    table = ExactTable(chain, sizes, need)
    room = budget_bytes - int(sizes.activation[0])
    optimum = table.solve(1, length, room, limit)
    if optimum is None or not np.isfinite(optimum):
        return None
    info = {"exact": True, "states": len(table.best), "dp_time_s": float(optimum)}
    return Plan(tuple(table.ops(1, length, room)), chain.stage_names, "dp", info=info)


def _table_plan(chain: Chain, budget_bytes: int, slots: int, tolerance: float) -> Plan | None:
    """The DP's plan with sizes rounded up to ``budget_bytes / slots``; None if none fits."""
    unit = budget_bytes / slots
    sizes = Sizes.of(chain, unit)
    capacity = slots - int(sizes.activation[0])
    if capacity < 0:
        return None
    table = Table(chain, sizes, capacity)
    if not np.isfinite(table.time[1, chain.length, capacity]):
        return None
    fastest = table.time[1, chain.length]
    room = capacity
    if tolerance:
        # The least memory whose optimum is within the tolerance (the first such m).
        room = int(np.argmax(fastest <= fastest[capacity] * (1.0 + tolerance)))
    ops = table.ops(1, chain.length, room)
    info = {"slots": slots, "dp_time_s": float(fastest[room])}
    if tolerance:
        info |= {"tolerance": tolerance, "fastest_s": float(fastest[capacity])}
    return Plan(ops=tuple(ops), stage_names=chain.stage_names, solver="dp", info=info)


FINER_SLOTS = (10, 100)
"""How many times more slots the DP tries when rounding alone leaves it without a plan."""

FINER_SECONDS = 0.5
"""A finer DP runs where it takes at most this long, or twice the asked one's time."""

FINER_TABLE_BYTES = 2**28
"""The most memory a finer DP's tables may take (a fallback should not cost more)."""


def _near_least_memory(chain: Chain, budget_bytes: int, slots: int, exact_tried: bool) -> Plan:
    """A plan for a budget between rotor's exact least memory, where some plan always fits,
    and the least the DP at ``slots`` finds one at (sizes rounded up cost it those plans):
    the DP in exact bytes (unless ``exact_tried``), else with finer slots, where that is
    quick; else the least-memory plan."""
    exact = None if exact_tried else _exact_plan(chain, budget_bytes)
    if exact is not None:
        return exact
    quick = max(FINER_SECONDS, 2 * estimated_seconds(chain.length, slots))
    for factor in FINER_SLOTS:
        count = slots * factor
        if (
            estimated_seconds(chain.length, count) > quick
            or table_bytes(chain.length, count) > FINER_TABLE_BYTES
        ):
            break
        plan = _table_plan(chain, budget_bytes, count, 0.0)
        if plan is not None:
            return plan
    least = least_memory_plan(chain)
    return Plan(least.ops, chain.stage_names, "dp", info={"slots": slots, "least_memory": True})


def _least_memory(chain: Chain, unit: float = 1.0) -> tuple[Sizes, np.ndarray, np.ndarray]:
    """need(s, t), the least memory of sub-problem (s, t) besides a_{s-1}, and the choice that
    reaches it: the DP's recurrence with min in place of the time. Among the choices that need
    the least, the one whose sub-plans take the least time wins."""
    sizes = Sizes.of(chain, unit)
    length = chain.length
    forward = [0.0] + [stage.fwd_s for stage in chain.stages]
    backward_s = [0.0] + [stage.bwd_s for stage in chain.stages]
    single = single_stage_times(chain)
    need = np.zeros((length + 2, length + 1), dtype=np.int64)
    spent = np.zeros((length + 2, length + 1))
    choice = np.full((length + 2, length + 1), FORWARD_ALL, dtype=np.int64)
    for t in range(1, length + 1):
        need[t, t] = sizes.single_stage_need(t)
        spent[t, t] = single[t]
        for s in range(t - 1, 0, -1):
            first = max(int(sizes.saved[s]) + need[s + 1, t], sizes.forward_all_need(s, t))
            options = [(first, forward[s] + backward_s[s] + spent[s + 1, t], FORWARD_ALL)]
            forwards = 0.0
            for j in range(s + 1, t + 1):
                forwards += forward[j - 1]
                room = sizes.split_room(s, j, t)
                split = max(room, int(sizes.activation[j - 1]) + need[j, t], need[s, j - 1])
                options.append((split, forwards + spent[j, t] + spent[s, j - 1], j))
            need[s, t], spent[s, t], choice[s, t] = min(options)
    return sizes, need, choice


def memory_need(chain: Chain, unit: float = 1.0) -> int:
    """The least memory, in ``unit``s (sizes rounded up), that a plan of rotor's persistent
    family (recomputation only, each checkpoint kept until its backward) needs.

    It counts a_0, and follows the same recurrence as the DP with min in place of the time.
    A plan outside the family, which frees a checkpoint before its backward and recomputes
    it (DTR's plans can), may fit in less.
    """
    if chain.frozen_stages:
        if unit != 1.0:
            raise ValueError("memory_need in units takes a chain without frozen stages")
        return least_budget(chain, memory_need)
    sizes, need, _ = _least_memory(chain, unit)
    return int(sizes.activation[0] + need[1, chain.length])


def least_memory_plan(chain: Chain) -> Plan:
    """A recompute-only plan whose peak is :func:`memory_need`, exact to the byte.

    The DP rounds sizes up to its slots, so at rotor's exact least memory it may find nothing;
    this plan follows the least-memory recurrence itself and always fits there.
    """
    if chain.frozen_stages:  # memory_need's two ways: the lesser peak
        plans = (
            lift(least_memory_plan(trained_part(chain)), chain),
            lift_merged(least_memory_plan(merged(chain)), chain),
        )
        scored = [score(plan, chain, None) for plan in plans]
        return min(scored, key=lambda plan: plan.predicted_peak_bytes or 0)
    sizes, _, choice = _least_memory(chain)
    ops = operations(1, chain.length, 0, lambda s, t, m: int(choice[s, t]), sizes)
    plan = Plan(tuple(ops), chain.stage_names, "least-memory", chain_name=chain.name)
    return score(plan, chain, None)
