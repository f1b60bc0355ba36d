"""Group chains and the two-level MILP: replayed without a budget, an expanded plan never
holds more, nor ends later, than its group plan, as the simulator (which coarsen does not use)
measures both."""

from __future__ import annotations

import contextlib
import itertools
import random

import pytest

from solvers.baselines import BASELINES, offload_all
from solvers.bounds import lower_bound_s
from solvers.chain import Chain, Link, Stage
from solvers.coarsen import balanced_groups, coarsen, expand, group_stage
from solvers.dp import memory_need, solve_dp
from solvers.milp_codec import NotInFamilyError, encode
from solvers.plan import validate
from solvers.registry import keep_all_peak
from solvers.simulator import simulate
from tests.test_milp import random_chain


def test_groups_cover_the_chain_in_order_with_balanced_work() -> None:
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 1, 2) for i in range(1, 101))
    chain = Chain("even", 1, stages)
    groups = balanced_groups(chain, 24)
    assert len(groups) == 24 and groups[0][0] == 1 and groups[-1][1] == 100
    assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(groups))
    assert {last - first + 1 for first, last in groups} <= {4, 5}
    assert balanced_groups(chain, 500) == tuple((i, i) for i in range(1, 101))


def test_a_group_stage_by_hand() -> None:
    # Stages 2..3 of a chain: x̄ 5 and 7, a 1 and 2, δ = a, temporaries 3 and 1 (forward),
    # 4 and 0 (backward), 2 and 6 (without autograd).
    stages = (
        Stage("s1", 1.0, 1.0, 3, 3),
        Stage("s2", 1.0, 2.0, 1, 5, 3, 4, 2),
        Stage("s3", 2.0, 3.0, 2, 7, 1, 0, 6),
    )
    group = group_stage(Chain("hand", 1, stages), 2, 3)
    assert (group.fwd_s, group.bwd_s, group.out_bytes, group.saved_bytes) == (3.0, 5.0, 2, 12)
    # F_all(2), F_all(3) hold at most max(5 + 3, 5 + 7 + 1) = 13 = 12 + 1.
    assert group.fwd_tmp_bytes == 1
    # B(3) holds x̄2, x̄3, δ3, δ2 = 5 + 7 + 2 + 1 = 15; B(2): x̄2, δ2, δ1, 4 = 5 + 1 + 3 + 4
    # = 13; the group counts x̄ 12, δ3 2 and δ1 3, so 15 - 17 < 0: no temporary.
    assert group.bwd_tmp_bytes == 0
    # F_ck(2) makes a2 with 2 more; F_none(3) holds a2, a3 and 6: 1 + 2 + 6 = 9 = a3 + 7.
    assert group.nograd_fwd_tmp_bytes == 7
    assert group.grad_bytes == 2


def test_expanded_plans_hold_no_more_and_end_no_later_than_their_group_plans() -> None:
    checked = 0
    for seed in range(120):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(2, 12))
        groups = balanced_groups(chain, rng.randint(1, chain.length))
        grouped = coarsen(chain, groups)
        plans = [build(grouped) for build in BASELINES.values()]
        budget = int(keep_all_peak(grouped) * rng.uniform(0.4, 1.0))
        with contextlib.suppress(ValueError):
            plans.append(solve_dp(grouped, budget))
        for plan in plans:
            coarse = simulate(plan, grouped)
            fine_plan = expand(plan, chain, groups)
            assert validate(fine_plan, chain) == [], (seed, plan.solver)
            fine = simulate(fine_plan, chain)
            assert fine.peak_bytes <= coarse.peak_bytes, (seed, plan.solver)
            assert fine.makespan_s <= coarse.makespan_s * (1 + 1e-9), (seed, plan.solver)
            try:
                encode(plan.ops, grouped.length)
            except NotInFamilyError:
                continue
            encode(fine_plan.ops, chain.length)  # the MILP can start from it
            checked += 1
    assert checked > 100


def test_a_backward_that_frees_saved_bytes_still_holds_what_it_starts_with() -> None:
    """Negative backward temporaries (B(i) frees part of x̄_i by its peak) and bytes the
    caller holds after B(L): B(i) still starts with x̄_1..x̄_i, δ_i and those bytes."""
    chain = Chain(
        "frees",
        1,
        (
            Stage("s1", 0.5, 1.0, 0, 40, 20, -40, nograd_fwd_tmp_bytes=0),
            Stage("s2", 0.0, 2.0, 1, 11, 20, 0, grad_bytes=0),
            Stage("s3", 1.0, 0.0, 4, 44, 3, -44, grad_bytes=0, refill_s=0.3),
            Stage("s4", 0.0, 1.0, 2, 2, 3, 0),
        ),
        input_grad_bytes=3,
        held_bytes=9,
        link=Link(10.0, 10.0),
    )
    grouped = coarsen(chain, ((1, 4),))
    # B(3) starts with x̄1..x̄3 = 95, δ3 = 0 and the caller's 9: 104, with a0 105.
    assert grouped.stage(1).bwd_tmp_bytes == 104 - 97 - 2 - 3
    for build in BASELINES.values():
        plan = build(grouped)
        assert simulate(expand(plan, chain, ((1, 4),)), chain).peak_bytes <= (
            simulate(plan, grouped).peak_bytes
        )


def test_offloads_of_a_group_leave_right_after_the_next_forward() -> None:
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 1, 4) for i in range(1, 7))
    chain = Chain("six", 1, stages, Link(10.0, 10.0))
    groups = ((1, 2), (3, 4), (5, 6))
    plan = expand(offload_all(coarsen(chain, groups)), chain, groups)
    first_pass = [str(op) for op in plan.ops[: plan.ops.index(next(
        op for op in plan.ops if op.kind == "B"))]]  # fmt: skip
    assert first_pass == [
        "F_all(1)", "F_all(2)", "offload(x̄1)", "F_all(3)", "offload(x̄2)", "F_all(4)",
        "F_all(5)", "F_all(6)",
    ]  # fmt: skip


def test_a_long_chain_is_planned_through_its_groups() -> None:
    pytest.importorskip("highspy")
    from solvers.milp import COARSE_FROM, solve_milp

    stages = tuple(Stage(f"b{i}", 1.0, 2.0, 10, 60) for i in range(1, COARSE_FROM + 9))
    chain = Chain("long", 10, stages, Link(40.0, 40.0))
    budget = int(0.3 * keep_all_peak(chain))
    plan = solve_milp(chain, budget, time_limit_s=6)
    dp = solve_dp(chain, budget)
    assert plan.predicted_peak_bytes <= budget
    assert plan.predicted_time_s <= dp.predicted_time_s
    assert plan.info["warm_start"] == "milp on 24 groups"
    assert plan.predicted_time_s >= lower_bound_s(chain, budget) * (1 - 1e-12)


def test_a_plan_that_meets_the_lower_bound_ends_the_search_at_once() -> None:
    pytest.importorskip("highspy")
    from offremat import examples
    from solvers.milp import solve_milp

    chain = examples.load("llama7b")
    plan = solve_milp(chain, keep_all_peak(chain), time_limit_s=60)
    assert plan.info["solver_status"] == "optimal (meets the lower bound)"
    assert plan.info["model"] is None  # no model was built
    assert plan.info["gap"] == 0.0
    assert plan.predicted_time_s == pytest.approx(lower_bound_s(chain, keep_all_peak(chain)))


def test_groups_that_do_not_tile_the_chain_are_refused() -> None:
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 1, 2) for i in range(1, 5))
    chain = Chain("four", 1, stages)
    plan = BASELINES["keep-all"](coarsen(chain, ((1, 2), (3, 4))))
    with pytest.raises(ValueError, match="do not tile"):
        expand(plan, chain, ((1, 1), (3, 4)))


def test_under_a_budget_late_prefetches_fit_where_early_ones_crowd_out_a_backward() -> None:
    # Replayed under the budget, a group's prefetches listed after its first backward can be
    # admitted ahead of its later backwards and push them past the budget; listed after the
    # group's last backward, they fit (the fallback solve_milp uses).
    crowded = 0
    for seed in range(300):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(3, 10))
        groups = balanced_groups(chain, rng.randint(2, chain.length))
        grouped = coarsen(chain, groups)
        budget = rng.randint(
            memory_need(grouped), max(memory_need(grouped), keep_all_peak(grouped))
        )
        plan = offload_all(grouped)
        if not simulate(plan, grouped, budget).feasible:
            continue
        if simulate(expand(plan, chain, groups), chain, budget).feasible:
            continue
        crowded += 1
        late = expand(plan, chain, groups, prefetch_late=True)
        assert validate(late, chain) == []
        assert simulate(late, chain, budget).peak_bytes <= budget, seed
    assert crowded > 0
