"""The joint MILP: its objective is the simulated time, it never loses to the DP, and it says why.

Chains have small integer sizes so that the DP can run with one slot per byte (``slots`` equal
to the budget): then the DP rounds nothing and both solvers see the same problem.
"""

from __future__ import annotations

import logging
import random
import sys

import pytest

from offremat import examples
from solvers import dp, milp_search, milp_warm
from solvers.bounds import necessary_budget_bytes
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Link, Stage
from solvers.dp import memory_need, solve_dp
from solvers.milp import BackendUnavailableError, least_feasible_budget, solve_milp
from solvers.milp_bound import whole_tensor_bound_s
from solvers.milp_codec import Schedule, decode, encode
from solvers.ops import ACTIVATION, SAVED
from solvers.plan import COPY_KINDS, OFFLOAD, PREFETCH, validate
from solvers.registry import keep_all_peak
from solvers.simulator import simulate


def random_chain(rng: random.Random, length: int, link: bool = True) -> Chain:
    stages = []
    for i in range(1, length + 1):
        out = rng.randint(1, 6)
        fwd_s = float(rng.randint(1, 5))
        stages.append(
            Stage(
                name=f"s{i}",
                fwd_s=fwd_s,
                bwd_s=float(rng.randint(1, 8)),
                out_bytes=out,
                saved_bytes=out + rng.randint(0, 8),
                fwd_tmp_bytes=rng.randint(0, 3),
                bwd_tmp_bytes=rng.randint(0, 4),
                nograd_fwd_tmp_bytes=(out + i) % 4,  # derived: the drawn chains stay as they were
                grad_bytes=out - i % 2,
                refill_s=fwd_s - 0.5 * (i % 2),  # derived: a refill stops early every other stage
            )
        )
    bandwidths = (1.0, 2.0, 4.0)
    return Chain(
        "random",
        rng.randint(1, 6),
        tuple(stages),
        Link(rng.choice(bandwidths), rng.choice(bandwidths)) if link else None,
        held_bytes=(stages[-1].out_bytes + length) % 3,  # derived: the drawn chains stay
    )


def instances(seed: int, count: int, max_length: int, link: bool = True):
    """Seeded random chains, each with a budget between the DP's least and keep-all."""
    rng = random.Random(seed)
    for _ in range(count):
        chain = random_chain(rng, rng.randint(2, max_length), link)
        least = memory_need(chain)
        yield chain, rng.randint(least, max(least, keep_all_peak(chain)))


def exact_dp_time(chain: Chain, budget: int) -> float:
    return solve_dp(chain, budget, slots=budget).predicted_time_s


@pytest.mark.parametrize("seed", range(4))
def test_objective_is_the_simulated_time(seed):
    """On random chains with a link the MILP's objective is what the simulator measures for the
    plan decoded from its solution (to 1%), and that plan fits its budget."""
    searched = 0
    for chain, budget in instances(seed, 12, 6):
        plan = solve_milp(chain, budget, slots=budget, time_limit_s=20)
        info = plan.info
        assert plan.predicted_peak_bytes <= budget
        assert not validate(plan, chain)
        if info["solver_status"] == "optimal (meets the lower bound)":
            # A warm start already as fast as any plan can be: nothing was searched.
            assert plan.predicted_time_s <= whole_tensor_bound_s(chain, budget) * (1 + 1e-9)
            continue
        assert info["solver_status"] == "optimal in its family"
        assert info["milp_plan_time_s"] == pytest.approx(info["objective"], rel=0.01)
        searched += 1
    assert searched >= 3


@pytest.mark.parametrize("seed", range(3))
def test_never_slower_than_the_dp(seed):
    for chain, budget in instances(100 + seed, 6, 6):
        plan = solve_milp(chain, budget, slots=budget, time_limit_s=20)
        assert plan.feasible
        assert plan.predicted_time_s <= exact_dp_time(chain, budget) * (1 + 1e-9)


def test_offloading_beats_the_dp_when_the_link_is_fast():
    """Offloading removes recomputation: strictly faster than the DP on some random chains, and
    the faster plans do copy tensors."""
    faster = 0
    for chain, budget in instances(7, 12, 6):
        plan = solve_milp(chain, budget, slots=budget, time_limit_s=20)
        if plan.predicted_time_s < exact_dp_time(chain, budget) - 1e-9:
            faster += 1
            assert any(op.kind in COPY_KINDS for op in plan.ops)
    assert faster >= 3


@pytest.mark.parametrize("seed", range(3))
def test_without_offloading_it_matches_the_dp(seed):
    """Recompute only, the MILP reaches rotor's optimum (to 1%) and is never worse; it copies
    nothing."""
    for chain, budget in instances(200 + seed, 8, 7):
        plan = solve_milp(chain, budget, offload=False, slots=budget, time_limit_s=20)
        dp = exact_dp_time(chain, budget)
        assert plan.predicted_time_s <= dp * (1 + 1e-9)
        assert plan.predicted_time_s == pytest.approx(dp, rel=0.01)
        assert not any(op.kind in COPY_KINDS for op in plan.ops)


def test_recomputing_a_checkpoint_early_beats_rotors_family():
    """The MILP may recompute a checkpoint in an earlier backward step than the one that reads
    it, which rotor's nested sweeps cannot; on this chain that is one unit faster than the DP."""
    shapes = [(3, 4, 2, 9, 2, 3), (3, 7, 3, 8, 0, 4), (4, 4, 5, 12, 1, 4), (5, 4, 4, 5, 3, 4)]
    shapes += [(4, 7, 2, 4, 3, 2), (4, 7, 1, 5, 0, 2), (2, 5, 1, 5, 0, 0)]
    stages = tuple(
        Stage(f"s{n}", float(f), float(b), out, saved, ftmp, btmp)
        for n, (f, b, out, saved, ftmp, btmp) in enumerate(shapes, start=1)
    )
    chain = Chain("early", 3, stages)
    plan = solve_milp(chain, 31, offload=False, slots=31, time_limit_s=20)
    assert exact_dp_time(chain, 31) == 77.0
    assert plan.predicted_time_s == 76.0
    assert plan.predicted_peak_bytes <= 31


def test_a_windowed_joint_search_first_solves_checkmates_problem(monkeypatch):
    """Started from a plan that only recomputes, a joint model too large to search whole
    first solves it with every copy held at none (Checkmate's problem, whose plans its family
    contains), then its windows: on this chain that finds the early recomputation above,
    which the DP's start lacks, and the joint plan is never slower than Checkmate's."""
    shapes = [(3, 4, 2, 9, 2, 3), (3, 7, 3, 8, 0, 4), (4, 4, 5, 12, 1, 4), (5, 4, 4, 5, 3, 4)]
    shapes += [(4, 7, 2, 4, 3, 2), (4, 7, 1, 5, 0, 2), (2, 5, 1, 5, 0, 0)]
    stages = tuple(
        Stage(f"s{n}", float(f), float(b), out, saved, ftmp, btmp)
        for n, (f, b, out, saved, ftmp, btmp) in enumerate(shapes, start=1)
    )
    chain = Chain("early", 3, stages, Link(1.0, 1.0))
    monkeypatch.setattr(milp_search, "_WHOLE_MODEL_BINARIES", 0)
    # A start that only recomputes: the host-split warm start offloads, and wins here.
    monkeypatch.setattr(milp_warm, "host_split_plans", lambda *args: [])
    runs = []
    run = milp_search._HighsSession.run

    def recorded(session, start, free, time_limit_s, presolve):
        runs.append((session, free.copy()))
        return run(session, start, free, time_limit_s, presolve)

    monkeypatch.setattr(milp_search._HighsSession, "run", recorded)
    plan = solve_milp(chain, 31, slots=31, time_limit_s=20)
    joint = [(session, free) for session, free in runs if session.copying.any()]
    session, free = joint[1]  # after the run that settles the warm start's times
    assert (free == ~session.copying).all()
    assert plan.predicted_time_s <= 76.0
    assert plan.predicted_peak_bytes <= 31


def test_a_wasted_recomputation_beside_a_flying_prefetch_decodes_to_a_valid_plan():
    """A MILP solution recomputed x̄1 while a1's prefetch was on its way and nothing read
    x̄1 (seen on a profiled GPT at 30%: the model charges such a forward, 0.1 ms there, but
    does not forbid it). The decoder used to list it as
    F_ck(1), producing a1 twice; it leaves such a forward out and runs the one that B(1)
    needs."""
    chain = random_chain(random.Random(0), 6)
    fates = ("offload_act", "offload_saved", "offload_saved", "offload_saved", "keep_saved")
    schedule = Schedule(
        length=6,
        fates=(*fates, "keep_saved"),
        recompute=frozenset({(3, 1, SAVED), (2, 1, SAVED)}),
        resident=frozenset(
            {(6, SAVED, 5), (6, SAVED, 6), (5, SAVED, 4), (5, SAVED, 5), (4, SAVED, 3)}
            | {(4, SAVED, 4), (3, SAVED, 2), (3, SAVED, 3), (2, ACTIVATION, 1)}
            | {(2, SAVED, 2), (1, SAVED, 1)}
        ),
        prefetches={(ACTIVATION, 1): (4, 2), (SAVED, 2): (4, 3), (SAVED, 3): (5, 4)}
        | {(SAVED, 4): (6, 5)},
    )
    ops = decode(schedule)
    assert validate(ops, chain) == []
    assert [str(op) for op in ops if op.is_compute].count("F_all(1)") == 1


def test_dp_plans_are_in_the_family():
    """Every DP plan encodes to a schedule that decodes to a plan just as fast and as small."""
    for chain, budget in instances(300, 10, 7, link=False):
        dp = solve_dp(chain, budget, slots=budget)
        ops = decode(encode(dp.ops, chain.length))
        replay = simulate(ops, chain, budget)
        assert replay.makespan_s == dp.predicted_time_s
        assert replay.peak_bytes <= budget


def test_chain_without_link_warns_once_and_recomputes(caplog):
    chain, budget = next(instances(400, 1, 6, link=False))
    with caplog.at_level(logging.WARNING, logger="solvers.milp"):
        plan = solve_milp(chain, budget, slots=budget, time_limit_s=20)
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "no link" in warnings[0].getMessage()
    assert plan.info["offload"] is False
    assert not any(op.kind in (OFFLOAD, PREFETCH) for op in plan.ops)
    assert plan.predicted_time_s == pytest.approx(exact_dp_time(chain, budget), rel=0.01)


def test_missing_highs_names_the_package(monkeypatch):
    chain, budget = next(instances(500, 1, 4))
    monkeypatch.setitem(sys.modules, "highspy", None)
    with pytest.raises(BackendUnavailableError, match="highspy"):
        solve_milp(chain, budget)


def test_missing_cbc_names_the_package(monkeypatch):
    import pulp

    chain, budget = next(instances(500, 1, 4))
    monkeypatch.setattr(pulp.PULP_CBC_CMD, "available", lambda self: False)
    with pytest.raises(BackendUnavailableError, match="pulp"):
        solve_milp(chain, budget, backend="cbc")


def test_unknown_backend_is_refused():
    chain, budget = next(instances(500, 1, 4))
    with pytest.raises(ValueError, match="highs, cbc"):
        solve_milp(chain, budget, backend="gurobi")


def test_cbc_backend_reaches_the_same_optimum():
    searched = 0
    for chain, budget in instances(600, 2, 5):
        highs = solve_milp(chain, budget, slots=budget, time_limit_s=20)
        cbc = solve_milp(chain, budget, slots=budget, time_limit_s=20, backend="cbc")
        assert cbc.info["backend"] == "cbc"
        # A warm start that meets the lower bound is returned before any backend runs.
        status = cbc.info["solver_status"]
        assert status in ("optimal in its family", "optimal (meets the lower bound)")
        searched += status == "optimal in its family"
        assert cbc.predicted_time_s == pytest.approx(highs.predicted_time_s, rel=1e-6)
        assert cbc.predicted_peak_bytes <= budget
    assert searched  # CBC itself solved one


def test_infeasible_budget_names_the_least_one():
    """Recompute only, the least budget is rotor's exact least memory: it fits, a byte less
    does not."""
    for chain, _ in instances(700, 4, 6, link=False):
        least = memory_need(chain)
        with pytest.raises(InfeasibleBudgetError) as raised:
            solve_milp(chain, least - 1, time_limit_s=20)
        assert raised.value.min_budget_bytes == least
        assert solve_milp(chain, least, time_limit_s=20).predicted_peak_bytes <= least


def test_least_budget_with_offloading_fits_and_nothing_below_does():
    """With a link the least budget comes from the MILP that minimizes the peak: between what
    every plan needs and the recompute-only least, a plan fits in it, and below the bound every
    plan needs the error names it."""
    for chain, _ in instances(800, 4, 5):
        least = least_feasible_budget(chain, time_limit_s=20)
        assert necessary_budget_bytes(chain) <= least <= memory_need(chain)
        assert solve_milp(chain, least, time_limit_s=20).predicted_peak_bytes <= least
        with pytest.raises(InfeasibleBudgetError) as raised:
            solve_milp(chain, necessary_budget_bytes(chain) - 1, time_limit_s=20)
        assert raised.value.min_budget_bytes == least


def test_offloading_a_checkpoint_lowers_the_least_budget():
    """Here the recompute-only plans need a checkpoint during B(5), the peak; sending it to the
    host and back lowers the least budget by one byte."""
    shapes = [(1, 16, 2, 0), (12, 27, 2, 0), (1, 2, 0, 1), (1, 16, 2, 1), (2, 17, 0, 0)]
    stages = tuple(
        Stage(f"s{n}", 1.0, 2.0, out, saved, ftmp, btmp)
        for n, (out, saved, ftmp, btmp) in enumerate(shapes, start=1)
    )
    chain = Chain("checkpoint", 8, stages, Link(4.0, 4.0))
    assert memory_need(chain) == 50
    plan = solve_milp(chain, 49, time_limit_s=20)
    assert plan.predicted_peak_bytes <= 49
    assert any(op.kind == OFFLOAD for op in plan.ops)
    # The least-peak search's own schedule simulates at 50 (its copies timed otherwise than
    # the model has them), and a budget is named only where the schedule found fits.
    least = least_feasible_budget(chain, time_limit_s=20)
    assert least in (49, 50)
    assert solve_milp(chain, least, time_limit_s=20).predicted_peak_bytes <= least
    with pytest.raises(InfeasibleBudgetError) as raised:
        solve_milp(chain, 48, time_limit_s=20)
    assert raised.value.min_budget_bytes == least
    with pytest.raises(InfeasibleBudgetError) as raised:
        solve_milp(chain, 49, offload=False, time_limit_s=20)
    assert raised.value.min_budget_bytes == 50


def test_time_limit_still_returns_a_plan_no_slower_than_the_dp():
    """A 30-stage chain cannot be solved in two seconds; the answer still comes back within the
    limit (plus model building) and is at least as fast as the DP's."""
    rng = random.Random(900)
    chain = random_chain(rng, 30)
    budget = (memory_need(chain) + keep_all_peak(chain)) // 3
    plan = solve_milp(chain, budget, time_limit_s=2.0, slots=budget)
    assert plan.info["solve_time_s"] < 15
    assert plan.feasible
    assert plan.predicted_time_s <= exact_dp_time(chain, budget) * (1 + 1e-9)


def test_the_dp_on_a_finer_grid_is_a_warm_start(monkeypatch):
    """ResNet-50 at 30% of keep-all: the DP on 500 slots rounds sizes up and loses 0.4% to the
    DP on 2000; a short search did not find that plan itself, so the finer DP starts it. (The
    DP in exact bytes, which finds that plan at any slots, is switched off: on a chain where
    it gives up, the finer grid is what is left.)"""
    monkeypatch.setattr(dp, "EXACT_SECONDS", 0.0)
    chain = examples.load("cnn")
    chain = Chain(chain.name, chain.input_bytes, chain.stages, Link(12e9, 12e9))
    budget = int(0.3 * keep_all_peak(chain))
    coarse, finer = solve_dp(chain, budget), solve_dp(chain, budget, slots=2000)
    assert finer.predicted_time_s < coarse.predicted_time_s * (1 - 1e-3)
    plan = solve_milp(chain, budget, time_limit_s=2.0)
    assert plan.feasible
    assert plan.predicted_time_s <= finer.predicted_time_s * (1 + 1e-9)


def test_registry_names_the_milps_least_budget() -> None:
    from solvers.registry import min_feasible_budget

    chain = Chain(
        "three",
        4,
        tuple(Stage(f"s{i}", 1.0, 2.0, 4, 12) for i in (1, 2, 3)),
        Link(1e3, 1e3),
    )
    assert min_feasible_budget(chain, "milp", offload=False) == memory_need(chain)
    with_offload = min_feasible_budget(chain, "milp", time_limit_s=10.0)
    assert with_offload <= memory_need(chain)
    assert solve_milp(chain, with_offload, time_limit_s=10.0).predicted_peak_bytes <= with_offload


def test_the_last_state_shown_is_the_plan_returned(monkeypatch):
    """Where the search ends on nothing faster (cut short by a loaded machine), the plan is
    the fastest warm start, which need not be the one the search started from: a suite run
    beside other work showed 96.5 s as the last incumbent of a plan of 95.0 s."""
    import solvers.milp

    stopped = milp_search.Search(None, None, None, "time limit")
    monkeypatch.setattr(solvers.milp, "search_highs", lambda *args, **kwargs: stopped)
    chain = random_chain(random.Random(900), 12)
    budget = (memory_need(chain) + keep_all_peak(chain)) // 3
    states = []
    plan = solve_milp(chain, budget, time_limit_s=10.0, slots=budget, progress=states.append)
    assert plan.info["fallback"]
    assert states[-1].incumbent_s == pytest.approx(plan.predicted_time_s)
    assert states[-1].gap == pytest.approx(plan.info["gap"])


def test_a_running_search_reports_its_incumbent_bound_and_gap():
    """The states a terminal's progress line shows: time moves on, the incumbent never rises,
    the bound never falls and stays below it, and the last state is the plan's own."""
    rng = random.Random(900)
    chain = random_chain(rng, 12)
    budget = (memory_need(chain) + keep_all_peak(chain)) // 3
    states = []
    plan = solve_milp(chain, budget, time_limit_s=10.0, slots=budget, progress=states.append)
    assert len(states) >= 2
    elapsed = [s.elapsed_s for s in states]
    assert elapsed == sorted(elapsed) and elapsed[-1] <= plan.info["solve_time_s"]
    incumbents = [s.incumbent_s for s in states if s.incumbent_s is not None]
    bounds = [s.bound_s for s in states if s.bound_s is not None]
    assert incumbents == sorted(incumbents, reverse=True) and bounds == sorted(bounds)
    assert all(s.bound_s <= s.incumbent_s for s in states if s.gap is not None)
    last = states[-1]
    assert last.incumbent_s == pytest.approx(plan.predicted_time_s)
    assert last.bound_s == pytest.approx(plan.info["best_bound"])
    # The gap is the plan's returned, a warm start's where the search found nothing faster.
    assert last.gap == pytest.approx(plan.info["gap"])


def test_the_named_least_budget_is_one_at_which_the_same_solve_succeeds():
    """llama7b, 3 s: too short to prove a lower peak with offloading, and at rotor's exact least
    memory the DP's rounding finds nothing; the least-memory plan still fits there."""
    from offremat.commands import load_chain
    from solvers.registry import min_feasible_budget, solve

    chain = load_chain("llama7b")
    least = min_feasible_budget(chain, "milp", time_limit_s=3)
    with pytest.raises(InfeasibleBudgetError) as raised:
        solve(chain, least - 1, "milp", time_limit_s=3)
    assert raised.value.min_budget_bytes == least
    plan = solve(chain, least, "milp", time_limit_s=3)
    assert plan.feasible and plan.predicted_peak_bytes <= least
    # The DP's plan at its own (rounded) least budget peaks lower than that budget: where it
    # fits here, the milp is never slower than it.
    rounded = solve(chain, min_feasible_budget(chain, "dp"), "dp")
    assert rounded.predicted_peak_bytes <= least
    assert plan.predicted_time_s <= rounded.predicted_time_s * (1 + 1e-9)


def test_the_least_budget_with_offloading_is_the_found_plan_s_simulated_peak():
    """On a chain whose stages take no time, the MILP's least peak, a float in its units,
    landed 4 bytes under the simulated peak of its plan: the budget it named failed."""
    from solvers.registry import min_feasible_budget, solve

    stages = (
        Stage("s0", 0.0, 0.0, 1, 4577297, fwd_tmp_bytes=1461914, bwd_tmp_bytes=-4283892),
        Stage(
            "s1",
            0.0018851006114487634,
            0.006570783620687926,
            414689,
            1852311,
            fwd_tmp_bytes=1537992,
            bwd_tmp_bytes=1087029,
            nograd_fwd_tmp_bytes=1444510,
        ),
        Stage(
            "s2",
            0.002418251717741314,
            0.0,
            1,
            1,
            fwd_tmp_bytes=1290137,
            bwd_tmp_bytes=1477006,
            nograd_fwd_tmp_bytes=802578,
        ),
    )
    link = Link(76187607369.12767, 19910888148.598835)
    chain = Chain("zero times", 605560, stages, link=link)
    least = min_feasible_budget(chain, "milp", time_limit_s=5)
    plan = solve(chain, least, "milp", time_limit_s=5)
    assert plan.feasible and plan.predicted_peak_bytes <= least
    with pytest.raises(InfeasibleBudgetError):
        solve(chain, least - 1, "milp", time_limit_s=5)


@pytest.mark.parametrize("rate", [1e9, 1.0])
def test_a_chain_computing_in_next_to_no_time_still_gets_a_plan(rate: float) -> None:
    # The shortest stage a chain may give (SHORTEST_SECONDS): over the slowest link, copies
    # would take 10¹⁵ units of Σf + Σb, which HiGHS takes for infinite.
    stages = tuple(
        Stage(f"s{i}", fwd_s=1e-12, bwd_s=1e-12, out_bytes=1000, saved_bytes=5000) for i in range(4)
    )
    chain = Chain("tiny", 1000, stages, link=Link(rate, rate))
    budget = int(0.9 * keep_all_peak(chain))
    plan = solve_milp(chain, budget, time_limit_s=5)
    assert validate(plan, chain) == []
    assert simulate(plan, chain).peak_bytes <= budget
    assert whole_tensor_bound_s(chain, budget) <= simulate(plan, chain).makespan_s


# Two chains an edge-case search found (offload and prefetch lanes, negative temporaries).
GIGABYTE_CHAIN = {
    "format": "offremat.chain/1",
    "name": "edge",
    "input_bytes": 3000000007,
    "stages": [
        {
            "name": "s1",
            "fwd_s": 1e-09,
            "bwd_s": 0.0,
            "out_bytes": 2000000001,
            "saved_bytes": 5000000001,
            "fwd_tmp_bytes": 0,
            "bwd_tmp_bytes": 2000000000,
            "grad_bytes": 4000000003,
        },
        {
            "name": "s2",
            "fwd_s": 2.0,
            "bwd_s": 1.0,
            "out_bytes": 5000000001,
            "saved_bytes": 11000000001,
            "fwd_tmp_bytes": 1000000000,
            "bwd_tmp_bytes": -11000000000,
            "nograd_fwd_tmp_bytes": 2000000000,
            "grad_bytes": 7000000003,
            "refill_s": 0.0,
        },
        {
            "name": "s3",
            "fwd_s": 3.0,
            "bwd_s": 1.0,
            "out_bytes": 1,
            "saved_bytes": 1,
            "fwd_tmp_bytes": 0,
            "bwd_tmp_bytes": 0,
            "grad_bytes": 3,
            "refill_s": 1.5,
        },
        {
            "name": "s4",
            "fwd_s": 1e-09,
            "bwd_s": 5.0,
            "out_bytes": 1,
            "saved_bytes": 3000000001,
            "fwd_tmp_bytes": 4000000000,
            "bwd_tmp_bytes": 2000000000,
            "grad_bytes": 3,
            "refill_s": 0.0,
        },
    ],
    "link": {"d2h_bytes_per_s": 2000000000.0, "h2d_bytes_per_s": 1000000000.0},
    "input_grad_bytes": 0,
    "held_bytes": 1000000000,
}
WAITING_CHAIN = {
    "format": "offremat.chain/1",
    "name": "edge",
    "input_bytes": 0,
    "stages": [
        {
            "name": "s1",
            "fwd_s": 1e-09,
            "bwd_s": 5.0,
            "out_bytes": 2,
            "saved_bytes": 2,
            "fwd_tmp_bytes": 0,
            "bwd_tmp_bytes": 0,
            "refill_s": 5e-10,
        },
        {
            "name": "s2",
            "fwd_s": 0.0,
            "bwd_s": 2.0,
            "out_bytes": 5,
            "saved_bytes": 8,
            "fwd_tmp_bytes": 4,
            "bwd_tmp_bytes": -8,
            "nograd_fwd_tmp_bytes": 0,
            "grad_bytes": 0,
        },
        {
            "name": "s3",
            "fwd_s": 3.0,
            "bwd_s": 1.0,
            "out_bytes": 0,
            "saved_bytes": 6,
            "fwd_tmp_bytes": 0,
            "bwd_tmp_bytes": -6,
            "nograd_fwd_tmp_bytes": 2,
        },
    ],
    "link": {"d2h_bytes_per_s": 2.0, "h2d_bytes_per_s": 10.0},
    "held_bytes": 1,
}


def test_one_byte_under_the_least_memory_plan_is_refused_at_any_scale() -> None:
    # At 2.4e10 bytes the least-memory model's optimum sat 4 B under its plan's peak: the
    # plan came back over its budget, as "a bug in offremat" (and a CLI traceback).
    chain = Chain.from_dict(GIGABYTE_CHAIN)
    least = memory_need(chain)
    with pytest.raises(InfeasibleBudgetError) as refused:
        solve_milp(chain, least - 1, time_limit_s=5)
    assert refused.value.min_budget_bytes == least
    assert simulate(solve_milp(chain, least, time_limit_s=5), chain, least).feasible


def test_the_least_budget_with_offloading_counts_the_copies_waits() -> None:
    # Its least-memory schedule peaks at 16 B unconstrained and fits 14 B by waiting for an
    # offload: the least budget was named as 15 B, and a plan at 14 B was found anyway.
    chain = Chain.from_dict(WAITING_CHAIN)
    assert least_feasible_budget(chain, offload=True, time_limit_s=5) == 14
    with pytest.raises(InfeasibleBudgetError, match="least feasible budget is 14 B"):
        solve_milp(chain, 13, time_limit_s=5)
    assert simulate(solve_milp(chain, 14, time_limit_s=5), chain, 14).feasible


def test_a_search_whose_plan_passes_the_budget_claims_no_optimum():
    """The MILP's model and the simulator can disagree (here by one byte): its plan is then
    no plan, a warm start is returned, and neither its status nor its bound says optimal (a
    review found "optimal in its family, gap 0" on a plan 21 times slower than another that
    fitted)."""
    stage = {"fwd_tmp_bytes": 0, "bwd_tmp_bytes": 0}
    chain = Chain(
        "r",
        453967,
        (
            Stage("s0", 0.36338456288935694, 0.7267691257787139, 3273, 3274, **stage),
            Stage("s1", 0.0, 0.0, 879493, 1752114, **stage),
            Stage("s3", 0.0, 0.0, 6653, 6653, **stage),
        ),
        link=Link(1000.0, 1000.0),
    )
    plan = solve_milp(chain, 3092120, time_limit_s=5.0)
    assert plan.info["fallback"] and plan.info["solver_status"] != "optimal in its family"
    assert plan.info["best_bound"] <= whole_tensor_bound_s(chain, 3092120, True) + 1e-12
    assert plan.info["gap"] > 0
