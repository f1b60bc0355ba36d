"""The whole-tensor lower bound: never above an optimal plan's time, tighter than the
fractional one where a saved set cannot be split or must be absent before B(L)."""

from __future__ import annotations

import math
import random

import pytest

pytest.importorskip("highspy")

from solvers.baselines import offload_ops
from solvers.bounds import lower_bound_s
from solvers.chain import Chain, Link, Stage
from solvers.dp import memory_need
from solvers.milp import solve_milp
from solvers.milp_bound import whole_tensor_bound_s
from solvers.ops import (
    SAVED,
    backward,
    forward_all,
    forward_checkpoint,
    offload,
    prefetch,
)
from solvers.plan import validate
from solvers.registry import keep_all_peak
from solvers.simulator import simulate
from tests.test_dp import exhaustive_optimum, random_chain
from tests.test_host import random_plan
from tests.test_milp import random_chain as random_chain_with_link


def test_a_saved_set_is_absent_whole_by_hand() -> None:
    # Three stages, x̄ = 10 each, a = δ = 1, a_0 = 1, f = 1, b = 2, no link. B(3)'s working
    # set is δ3 + x̄3 + δ2 = 12 and a_0 stays, so a budget of 29 leaves 16 for x̄1 + x̄2 = 20:
    # 4 bytes must be absent when B(3) starts. The fractional bound recomputes 4/10 of a
    # stage (0.4 s more than Σf + Σb = 9 s); with whole tensors, a whole stage (1 s more).
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 1, 10) for i in range(1, 4))
    chain = Chain("hand", 1, stages)
    assert lower_bound_s(chain, 29) == pytest.approx(9.4)
    assert whole_tensor_bound_s(chain, 29) == pytest.approx(10.0)
    assert whole_tensor_bound_s(chain, 40) == lower_bound_s(chain, 40) == 9.0
    assert whole_tensor_bound_s(chain, 11) == math.inf


def test_every_backward_start_counts_by_hand() -> None:
    # x̄ = 10, 20, 2 with a = δ = 1; f = 3, 1, 1 and b = 2. At a budget of 30, B(3) leaves
    # 26 for x̄1 + x̄2 = 30: recomputing x̄2 (1 s) would do. But B(2)'s working set is
    # δ2 + x̄2 + δ1 = 22, which leaves 8, less than x̄1: x̄1 is absent then, and recomputing
    # it costs 3 s. Σf + Σb = 11, so the bound is 14 s, the exhaustive optimum; checking only
    # when B(3) starts gives 12 s.
    stages = (
        Stage("s1", 3.0, 2.0, 1, 10),
        Stage("s2", 1.0, 2.0, 1, 20),
        Stage("s3", 1.0, 2.0, 1, 2),
    )
    chain = Chain("hand", 1, stages)
    assert whole_tensor_bound_s(chain, 30) == pytest.approx(14.0)
    assert exhaustive_optimum(chain, 30) == pytest.approx(14.0)


def test_a_recomputation_needs_its_input_by_hand() -> None:
    # x̄ = 10 each, a = δ = 1, a_0 = 1; f = 3, 1, 1 and b = 2. At a budget of 14, B(3)'s
    # working set (12) and a_0 leave 1 byte: x̄1 and x̄2 are absent (Σf + Σb + f1 + f2 = 15 s)
    # and that byte is B(3)'s input a_2, so a_1, which x̄2's refill reads, cannot stay:
    # F(1) runs again before it (B(2) leaves no room for x̄1 refilled early), 18 s in all.
    stages = (
        Stage("s1", 3.0, 2.0, 1, 10),
        Stage("s2", 1.0, 2.0, 1, 10),
        Stage("s3", 1.0, 2.0, 1, 10),
    )
    chain = Chain("hand", 1, stages)
    assert whole_tensor_bound_s(chain, 14) == pytest.approx(18.0)
    assert exhaustive_optimum(chain, 14) == pytest.approx(18.0)


def test_never_above_the_optimum_recomputing_only() -> None:
    """Over every plan that recomputes, non-persistent ones (any tensor freed at any point)
    included."""
    tighter = freer = 0
    for seed in range(60):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(1, 5))
        least, top = memory_need(chain), keep_all_peak(chain)
        for budget in {least, (least + top) // 2, top}:
            optimum = exhaustive_optimum(chain, budget, frees=True)
            persistent = exhaustive_optimum(chain, budget)
            assert optimum <= persistent * (1 + 1e-9)
            freer += optimum < persistent * (1 - 1e-9)
            bound = whole_tensor_bound_s(chain, budget)
            assert lower_bound_s(chain, budget) <= bound <= optimum * (1 + 1e-9), seed
            tighter += bound > lower_bound_s(chain, budget) * (1 + 1e-9)
    assert tighter > 0
    assert freer > 0  # freeing reaches faster plans on some of them (30 of 149)


def test_never_above_the_milps_proven_optimum_with_offloading() -> None:
    for seed in range(12):
        rng = random.Random(seed)
        stages = tuple(
            Stage(f"s{i}", rng.uniform(0.5, 2), rng.uniform(1, 4), 4, rng.randint(8, 40))
            for i in range(1, rng.randint(3, 6))
        )
        chain = Chain("offload", 4, stages, Link(rng.uniform(5, 40), rng.uniform(5, 40)))
        budget = int(keep_all_peak(chain) * rng.uniform(0.5, 0.9))
        plan = solve_milp(chain, max(budget, memory_need(chain)), time_limit_s=20)
        bound = whole_tensor_bound_s(chain, max(budget, memory_need(chain)))
        assert bound <= plan.predicted_time_s * (1 + 1e-9), seed


def test_a_copy_still_under_way_when_the_last_backward_starts() -> None:
    # x̄1 (10 bytes, 10 s on the link) leaves after F(2) and is still copying when B(4)
    # starts; it is gone by B(3), whose 10-byte temporary leaves no room for it, and comes
    # back for B(2). No recomputation, no copy done before B(4): 19.1 s at a budget of 17.
    stages = (
        Stage("s1", 5.0, 1.0, 1, 10),
        Stage("s2", 1.0, 1.0, 1, 4),
        Stage("s3", 1.0, 1.0, 1, 1, bwd_tmp_bytes=10),
        Stage("s4", 1.0, 7.0, 1, 1),
    )
    chain = Chain("late copy", 1, stages, Link(1.0, 100.0))
    ops = [forward_all(1), forward_checkpoint(2), offload(SAVED, 1), forward_all(3)]
    ops += [forward_all(4), backward(4), backward(3), prefetch(SAVED, 1), forward_all(2)]
    ops += [backward(2), backward(1)]
    assert validate(ops, chain) == []
    replay = simulate(ops, chain, 17)
    assert replay.feasible and replay.makespan_s == pytest.approx(19.1)
    assert whole_tensor_bound_s(chain, 17) <= replay.makespan_s


@pytest.mark.parametrize("seed", range(3))
def test_never_above_a_plan_that_offloads_its_saved_sets_late(seed: int) -> None:
    """Keep every saved set, copy some out right after the next forward (the copies may
    overlap the backward) and back in time for the backward that reads them: the bound at
    the plan's own peak is never above its time."""
    rng = random.Random(seed)
    for _ in range(40):
        length = rng.randint(2, 7)
        chain = random_chain(rng, length).with_link(Link(1.0, rng.uniform(1, 8)))
        moved = {i for i in range(1, length - 1) if rng.random() < 0.5}
        ops = offload_ops(length, moved)
        assert validate(ops, chain) == []
        replay = simulate(ops, chain, None)
        bound = whole_tensor_bound_s(chain, replay.peak_bytes)
        assert bound <= replay.makespan_s * (1 + 1e-9), (seed, moved)


def test_never_above_any_random_valid_plan() -> None:
    """Both bounds at a plan's own peak are never above its time, for random walks over every
    op the rules allow (non-persistent plans, late copies, frees), held bytes and the input
    included: the simulator is the oracle, which the bounds do not read."""
    checked = tighter = 0
    for seed in range(60):
        rng = random.Random(seed)
        chain = random_chain_with_link(rng, rng.randint(2, 5))
        for _ in range(25):
            ops = random_plan(chain, rng)
            if ops is None:
                continue
            replay = simulate(ops, chain, None)
            fractional = lower_bound_s(chain, replay.peak_bytes)
            whole = whole_tensor_bound_s(chain, replay.peak_bytes)
            assert fractional <= whole <= replay.makespan_s * (1 + 1e-9), (seed, ops)
            checked += 1
            tighter += whole > chain.compute_time_s * (1 + 1e-9)
    assert checked > 500 and tighter > 40  # 28 before the input and a_{k-1} were counted
