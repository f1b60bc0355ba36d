"""The seed systems as solvers: Hong et al.'s min-peak, DTR and Checkmate.

Each is checked against a case computed by hand, and min-peak's optimality against every
segmentation of small chains, each scored by the simulator (an oracle it does not use).
"""

from __future__ import annotations

import dataclasses
import itertools
import random

import pytest

from solvers.baselines import keep_all, min_peak, segmented_ops
from solvers.bounds import lower_bound_s
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Link, Stage
from solvers.dp import least_memory_plan, memory_need
from solvers.frozen import lift, trained_part
from solvers.plan import F_ALL, F_CK, F_NONE, FREE, OFFLOAD, Plan, validate
from solvers.registry import keep_all_peak, min_feasible_budget, solve
from solvers.simulator import simulate
from tests.test_dp import random_chain


def uniform(length: int, saved: int = 1) -> Chain:
    """Every a_i, δ_i and a_0 one byte, every x̄_i ``saved`` bytes, f = 1, b = 2."""
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 1, saved) for i in range(1, length + 1))
    return Chain(f"uniform{length}", 1, stages)


def segmentations(length: int):
    """Every way to cut stages 1..length into consecutive segments."""
    for cuts in itertools.product((False, True), repeat=length - 1):
        firsts = [1] + [i + 2 for i, cut in enumerate(cuts) if cut]
        lasts = [first - 1 for first in firsts[1:]] + [length]
        yield list(zip(firsts, lasts, strict=True))


def test_min_peak_by_hand() -> None:
    # Three stages, every tensor one byte. Keep-all peaks at B(3): a_0, x̄_1..3, δ_3, δ_2 = 6.
    # Segments (1,2),(3,3): forward holds δ_3, a_0 and at most a_1, a_2 (4); B(3) holds a_0,
    # a_2, x̄_3, δ_3, δ_2 (5); recomputing (1,2) holds a_0, δ_2, x̄_1, x̄_2 (4) and B(2) adds
    # δ_1 (5). Every other cut peaks at 6.
    chain = uniform(3)
    plan = solve(chain, 5, "min-peak")
    assert plan.info["segments"] == [[1, 2], [3, 3]]
    assert plan.predicted_peak_bytes == 5 == plan.info["least_peak_bytes"]
    assert [str(op) for op in plan.ops] == [
        "F_ck(1)", "F_none(2)", "F_all(3)", "B(3)", "F_all(1)", "F_all(2)", "B(2)", "B(1)",
    ]  # fmt: skip
    assert keep_all_peak(chain) == 6
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(chain, 4, "min-peak")
    assert caught.value.min_budget_bytes == 5


def test_min_peak_is_the_least_peak_of_every_segmentation() -> None:
    for seed in range(150):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(1, 7), tmp=seed % 3 != 0)
        plan = min_peak(chain)
        peak = simulate(plan, chain).peak_bytes
        assert peak == plan.info["least_peak_bytes"], seed
        every = [
            simulate(Plan(tuple(segmented_ops(s)), chain.stage_names, "cut"), chain).peak_bytes
            for s in segmentations(chain.length)
        ]
        assert peak == min(every), seed


def test_min_peak_counts_negative_temporaries_the_caller_s_bytes_and_frozen_stages() -> None:
    # A backward temporary below zero hid the bytes B(i) holds as it starts (claimed 16 B,
    # simulated 17 B, and not the least segmentation), a one-stage chain's end state was
    # missed, and on a frozen chain the claim was the trained part's.
    for seed in range(150):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(1, 6))
        stages = [
            dataclasses.replace(s, bwd_tmp_bytes=-rng.randint(0, s.saved_bytes))
            for s in chain.stages
        ]
        frozen = rng.randint(0, chain.length - 1) if seed % 2 else 0
        chain = dataclasses.replace(
            chain, stages=tuple(stages), held_bytes=rng.randint(0, 6), frozen_stages=frozen
        )
        plan = min_peak(chain)
        peak = simulate(plan, chain).peak_bytes
        assert peak == plan.info["least_peak_bytes"], seed
        assert plan.info["segments"][-1][-1] == chain.length, seed
        part = trained_part(chain)
        every = [
            simulate(
                lift(Plan(tuple(segmented_ops(s)), part.stage_names, "cut"), chain), chain
            ).peak_bytes
            for s in segmentations(part.length)
        ]
        assert peak == min(every), seed


def test_min_peak_is_never_below_rotors_least_memory_and_why() -> None:
    # rotor's family contains every segmentation, so its least memory is never larger ...
    strictly_lower = 0
    for seed in range(100):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(1, 8))
        least = memory_need(chain)
        assert least <= min_peak(chain).info["least_peak_bytes"], seed
        strictly_lower += least < min_peak(chain).info["least_peak_bytes"]
    assert strictly_lower > 0
    # ... and it is smaller where recomputing a segment from checkpoints of its own, several
    # levels deep, saves memory: on 16 equal stages min-peak needs 9 bytes and rotor 5, by
    # running a forward up to 15 times.
    chain = uniform(16)
    assert min_peak(chain).info["least_peak_bytes"] == 9
    assert memory_need(chain) == 5
    rotor = least_memory_plan(chain)
    forwards = [op.index for op in rotor.ops if op.kind in (F_ALL, F_CK, F_NONE)]
    assert max(forwards.count(i) for i in range(1, 17)) == 15
    # The registry's least budget for min-peak is its peak.
    assert min_feasible_budget(chain, "min-peak") == 9


def test_dtr_by_hand() -> None:
    # a_0, every a_i and δ_i one byte, every x̄_i two: keep-all peaks at 9 in B(3). At 8, the
    # forward fits (a_0, δ_3, x̄_1..3 = 8); B(3) needs one more byte for δ_2 while it reads
    # x̄_3, δ_3 and x̄_2, so DTR evicts the only other candidate, x̄_1. B(2) then needs a_1:
    # recomputed by F_ck(1) from a_0. B(1) needs x̄_1: F_all(1).
    chain = uniform(3, saved=2)
    assert keep_all_peak(chain) == 9
    plan = solve(chain, 8, "dtr")
    assert [str(op) for op in plan.ops] == [
        "F_all(1)", "F_all(2)", "F_all(3)", "free(x̄1)", "B(3)", "F_ck(1)", "B(2)", "F_all(1)",
        "B(1)",
    ]  # fmt: skip
    assert plan.predicted_peak_bytes == 8
    assert plan.predicted_time_s == 3 * 2.0 + 5 * 1.0
    assert plan.info["evictions"] == 1
    assert solve(chain, 9, "dtr").ops == keep_all(chain).ops


def test_dtr_keeps_a_stale_tensor_that_is_dear_to_recompute() -> None:
    # Before B(4), x̄_1 was last read 2 s ago and x̄_2 1 s ago (F_all(2) ends at 51, F_all(3)
    # at 52, F_all(4) at 53), both 4 bytes; x̄_3 holds B(4)'s input. x̄_1 costs 50 s to bring
    # back, x̄_2 1 s: h = 50 / (4 × 2) against 1 / (4 × 1), so DTR frees x̄_2, where least
    # recently used (or lowest index) would free x̄_1.
    stages = (
        Stage("dear", 50.0, 1.0, 1, 4),
        Stage("cheap", 1.0, 1.0, 1, 4),
        Stage("s3", 1.0, 1.0, 1, 4),
        Stage("s4", 1.0, 1.0, 1, 4),
    )
    chain = Chain("stale-but-dear", 1, stages)
    plan = solve(chain, keep_all_peak(chain) - 1, "dtr")
    assert next(str(op) for op in plan.ops if op.kind == FREE) == "free(x̄2)"


def test_dtr_evicts_the_least_cost_per_byte_and_staleness() -> None:
    # Stage 1 is cheap to recompute and stage 2 dear; both saved sets are the same size and
    # stage 1's is staler: DTR evicts x̄_1 first however the budget is cut.
    stages = (
        Stage("cheap", 1.0, 1.0, 1, 4),
        Stage("dear", 50.0, 1.0, 1, 4),
        Stage("s3", 1.0, 1.0, 1, 4),
        Stage("s4", 1.0, 1.0, 1, 4),
    )
    chain = Chain("costs", 1, stages)
    plan = solve(chain, keep_all_peak(chain) - 1, "dtr")
    frees = [str(op) for op in plan.ops if op.kind == FREE]
    assert frees[0] == "free(x̄1)"


def test_dtr_fits_its_budget_or_names_one_at_which_it_does() -> None:
    for seed in range(120):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(1, 10), tmp=seed % 2 == 0)
        top = keep_all_peak(chain)
        for budget in (memory_need(chain), (memory_need(chain) + top) // 2, top):
            try:
                plan = solve(chain, budget, "dtr")
            except InfeasibleBudgetError as error:
                assert error.min_budget_bytes > budget
                # Greedy: a budget with a plan, not the least one, and the message says so.
                assert not error.exact and "least" not in str(error)
                refit = solve(chain, error.min_budget_bytes, "dtr")
                assert refit.predicted_peak_bytes <= error.min_budget_bytes
                continue
            assert validate(plan, chain) == []
            assert plan.predicted_peak_bytes <= budget, seed
            assert plan.predicted_time_s >= lower_bound_s(chain, budget) * (1 - 1e-12)
        least = min_feasible_budget(chain, "dtr")
        assert memory_need(chain) <= least
        assert solve(chain, least, "dtr").predicted_peak_bytes <= least


def test_checkmate_is_the_milp_without_offloading() -> None:
    pytest.importorskip("highspy")
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 10, 60) for i in range(1, 7))
    chain = Chain("six", 10, stages, Link(200.0, 200.0))
    budget = int(0.45 * keep_all_peak(chain))
    plan = solve(chain, budget, "checkmate", time_limit_s=20)
    assert plan.solver == "checkmate"
    assert not any(op.kind == OFFLOAD for op in plan.ops)
    assert plan.predicted_peak_bytes <= budget
    # rotor's DP is exact for recomputation on a chain (up to its rounding), so the two agree.
    dp = solve(chain, budget, "dp", slots=2000)
    assert plan.predicted_time_s == pytest.approx(dp.predicted_time_s)
    assert plan.info["solver_status"].startswith("optimal")
    assert min_feasible_budget(chain, "checkmate") == memory_need(chain)
    with pytest.raises(InfeasibleBudgetError, match="no checkmate plan") as caught:
        solve(chain, memory_need(chain) - 1, "checkmate", time_limit_s=5)
    assert caught.value.min_budget_bytes == memory_need(chain)


def test_optimal_in_its_family_is_not_optimal_over_every_plan() -> None:
    """The MILP's family (docs/milp.md) is persistent: DTR frees x̄_1 after F_all(2) and
    recomputes a_1 for B(2) from a_0 at no cost (f_1 = 0), a plan outside it that meets
    Σf + Σb. So the MILP says "in its family", and only lower_bound_s bounds every plan."""
    pytest.importorskip("highspy")
    chain = Chain(
        "outside the family",
        1,
        (
            Stage("s1", 0.0, 7.0, 30, 70, 0, 5),
            Stage("s2", 5.0, 7.0, 8, 8, 0, 0, grad_bytes=4),
            Stage("s3", 0.0, 1.0, 30, 30, 0, -30, grad_bytes=0),
            Stage("s4", 5.0, 0.0, 2, 2, 0, 5),
            Stage("s5", 0.5, 2.0, 8, 11, 20, 5, nograd_fwd_tmp_bytes=2),
        ),
    )
    budget = 107
    dtr = solve(chain, budget, "dtr")
    assert validate(dtr, chain) == [] and dtr.predicted_peak_bytes <= budget
    assert dtr.predicted_time_s == pytest.approx(chain.compute_time_s)
    assert lower_bound_s(chain, budget) <= dtr.predicted_time_s
    for solver in ("milp", "checkmate"):
        plan = solve(chain, budget, solver, time_limit_s=10)
        assert plan.info["solver_status"] == "optimal in its family"
        assert plan.info["best_bound"] > dtr.predicted_time_s * 1.1


HELD_AFTER_THE_STEP = Chain(
    "held", 1000, (Stage("s0", 0.001, 0.002, 1000, 5000),), held_bytes=50000
)
ZERO_TIME_OPS = Chain(
    "zero-time",
    72103,
    (
        Stage("s0", 0.0073, 0.0, 0, 923208, grad_bytes=0),
        Stage("s1", 0.0, 0.0149, 107119, 445598, 4438, -97678, grad_bytes=0),
    ),
    input_grad_bytes=0,
    held_bytes=24446,
)


@pytest.mark.parametrize("chain", [HELD_AFTER_THE_STEP, ZERO_TIME_OPS], ids=lambda c: c.name)
@pytest.mark.parametrize("solver", ["dp", "dtr", "milp", "checkmate", "min-peak", "chen"])
def test_every_solver_fits_or_names_a_budget_at_which_it_does(chain: Chain, solver: str) -> None:
    """Chains at the edges of the memory model: a one-stage chain whose caller keeps more after
    B(1) than the step held before (dp, dtr and milp returned plans at twice their budget), and
    zero-length operations (dtr named peak + 1 B, then peak + 2 B, ... without end)."""
    options = {"time_limit_s": 2.0} if solver in ("milp", "checkmate") else {}
    for budget in (keep_all_peak(chain) // 2, keep_all_peak(chain)):
        try:
            plan = solve(chain, budget, solver, **options)
        except InfeasibleBudgetError as error:
            assert error.min_budget_bytes > budget
            plan = solve(chain, error.min_budget_bytes, solver, **options)
            budget = error.min_budget_bytes
        assert plan.predicted_peak_bytes <= budget
        assert simulate(plan, chain, budget).peak_bytes == plan.predicted_peak_bytes
