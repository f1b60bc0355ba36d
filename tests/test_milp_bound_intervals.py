"""The interval bound (solvers/milp_bound_intervals.py): never above any valid plan's time,
and tighter than the whole-tensor bound where recomputations must find their input late."""

from __future__ import annotations

import random

import pytest

pytest.importorskip("highspy")

from solvers.chain import Chain, Stage
from solvers.dp import memory_need
from solvers.milp_bound import whole_tensor_bound_s
from solvers.milp_bound_intervals import interval_bound_s
from solvers.registry import keep_all_peak
from solvers.simulator import simulate
from tests.test_dp import exhaustive_optimum, random_chain
from tests.test_host import random_plan
from tests.test_milp import random_chain as random_chain_with_link


def test_an_input_that_cannot_stay_between_two_backwards_by_hand() -> None:
    # x̄ = 10 each, a = δ = 1, a_0 = 1; f = 3, 1, 1, 1 and b = 2 (Σf + Σb = 14 s). At 14 bytes
    # each backward leaves room for its input alone, so x̄1, x̄2 and x̄3 are made after B(4),
    # each just before its backward, and their inputs cannot wait between two backwards
    # either: F(1), F(2), F(3) before B(3), F(1), F(2) before B(2), F(1) before B(1): 26 s,
    # the exhaustive optimum. Asking only when B(L) starts proves 23 s.
    stages = (
        Stage("s1", 3.0, 2.0, 1, 10),
        Stage("s2", 1.0, 2.0, 1, 10),
        Stage("s3", 1.0, 2.0, 1, 10),
        Stage("s4", 1.0, 2.0, 1, 10),
    )
    chain = Chain("hand", 1, stages)
    optimum = exhaustive_optimum(chain, 14, frees=True)
    interval = interval_bound_s(chain, 14, offload=False)
    assert interval == pytest.approx(optimum, rel=1e-6)
    assert whole_tensor_bound_s(chain, 14, offload=False) < interval * (1 - 1e-6)


def test_never_above_the_optimum_recomputing_only() -> None:
    """Over every plan that recomputes, non-persistent ones (any tensor freed) included."""
    checked = tighter = 0
    for seed in range(120):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(2, 5))
        least, top = memory_need(chain), keep_all_peak(chain)
        budgets = {least, (least + top) // 2, top} | {rng.randint(least, top) for _ in range(2)}
        for budget in budgets:
            optimum = exhaustive_optimum(chain, budget, frees=True)
            bound = interval_bound_s(chain, budget, offload=False)
            assert bound <= optimum * (1 + 1e-9), (seed, budget)
            checked += 1
            tighter += bound > whole_tensor_bound_s(chain, budget, offload=False) * (1 + 1e-9)
    assert checked > 450 and tighter > 100  # 491 and 159 when written


def test_never_above_any_random_valid_plan() -> None:
    """At a plan's own peak, for random walks over every op the rules allow (copies, frees,
    non-persistent plans), the simulator as the oracle."""
    checked = 0
    for seed in range(60):
        rng = random.Random(seed)
        chain = random_chain_with_link(rng, rng.randint(2, 6))
        for _ in range(25):
            ops = random_plan(chain, rng, most=80)
            if ops is None:
                continue
            replay = simulate(ops, chain, None)
            bound = interval_bound_s(chain, replay.peak_bytes)
            assert bound <= replay.makespan_s * (1 + 1e-9), (seed, ops)
            checked += 1
    assert checked > 400


def test_whole_tensor_bound_takes_the_interval_model_when_asked() -> None:
    stages = tuple(Stage(f"s{i}", 3.0 if i == 1 else 1.0, 2.0, 1, 10) for i in range(1, 5))
    chain = Chain("hand", 1, stages)
    plain = whole_tensor_bound_s(chain, 14, offload=False)
    asked = whole_tensor_bound_s(chain, 14, offload=False, intervals=True)
    assert asked == pytest.approx(interval_bound_s(chain, 14, offload=False)) and asked > plain
