"""Baselines and the registry: valid plans whose simulated figures match hand computation."""

from __future__ import annotations

import itertools
import math
import sys
import types
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from offremat import examples
from solvers.baselines import (
    BASELINES,
    checkpoint_every_stage,
    checkpoint_sequential_plan,
    chen,
    chen_segments,
    keep_all,
    offload_all,
    sequential_segments,
)
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Link, Stage
from solvers.plan import OFFLOAD, PREFETCH, SAVED, Plan, validate
from solvers.registry import (
    SOLVERS,
    keep_all_peak,
    lower_bound_s,
    min_feasible_budget,
    solve,
)
from solvers.simulator import score, simulate

# Four unequal stages: (f, b, x, x̄, ftmp, btmp); input x_0 = 8.
SPECS = [(1.0, 2.0, 10, 40, 3, 5), (2.0, 3.0, 20, 60, 4, 6), (1.0, 1.0, 10, 30, 2, 2)]
SPECS.append((3.0, 4.0, 5, 25, 1, 7))


def tiny(link: Link | None = None) -> Chain:
    stages = tuple(Stage(f"s{n}", *spec) for n, spec in enumerate(SPECS, start=1))
    return Chain("tiny", 8, stages, link)


# Hand-side notation, 1-based like the papers.
F = [0.0] + [s[0] for s in SPECS]
B = [0.0] + [s[1] for s in SPECS]
X = [8] + [s[2] for s in SPECS]
XBAR = [0] + [s[3] for s in SPECS]
FTMP = [0] + [s[4] for s in SPECS]
BTMP = [0] + [s[5] for s in SPECS]
L = 4
COMPUTE = sum(F) + sum(B)


def test_keep_all_peak_and_time_by_hand() -> None:
    # Forward k: a_0, δ_L, x̄_1..x̄_k and F_all(k)'s temporary. Backward i: a_0, x̄_1..x̄_i,
    # δ_i, and the δ_{i-1} plus temporary that B(i) allocates.
    forward = [X[0] + X[L] + sum(XBAR[1 : k + 1]) + FTMP[k] for k in range(1, L + 1)]
    backward = [X[0] + sum(XBAR[1 : i + 1]) + X[i] + X[i - 1] + BTMP[i] for i in range(1, L + 1)]
    plan = keep_all(tiny())
    assert validate(plan, tiny()) == []
    result = simulate(plan, tiny())
    assert result.makespan_s == COMPUTE
    assert result.peak_bytes == max(forward + backward) == 8 + 155 + 5 + 10 + 7
    assert keep_all_peak(tiny()) == result.peak_bytes
    assert set(plan.decisions.values()) == {"keep"}


def test_chen_segments_split_like_checkpoint_sequential() -> None:
    # checkpoint_sequential(k segments): L // k stages each, the last takes the remainder.
    assert chen_segments(1) == [(1, 1)]
    assert chen_segments(4) == [(1, 2), (3, 4)]
    assert chen_segments(10) == [(1, 3), (4, 6), (7, 10)]
    assert chen_segments(16) == [(1, 4), (5, 8), (9, 12), (13, 16)]
    for length in range(1, 60):
        segments = chen_segments(length)
        assert len(segments) == max(1, round(math.sqrt(length)))
        assert segments[0][0] == 1 and segments[-1][1] == length
        assert all(a[1] + 1 == b[0] for a, b in itertools.pairwise(segments))


def test_checkpoint_sequential_plan_matches_torch_segmenting() -> None:
    chain = Chain("c", 4, tuple(Stage(f"s{i}", 1.0, 2.0, 4, 8) for i in range(10)))
    # √10 rounds to 3 segments, as the chen baseline cuts them.
    assert checkpoint_sequential_plan(chain, 3).ops == chen(chain).ops
    single = checkpoint_sequential_plan(chain, 1)
    assert [op.kind for op in single.ops] == ["F_all"] * 10 + ["B"] * 10
    assert single.info["segments"] == 1
    every = checkpoint_sequential_plan(chain, 99)  # clamped to one segment per stage
    assert every.ops == checkpoint_every_stage(chain).ops
    assert every.solver == "checkpoint_sequential(10)"
    with pytest.raises(ValueError, match=r"pick 1\.\.10"):
        sequential_segments(10, 11)


def test_chen_on_four_stages_by_hand() -> None:
    # Segments (1,2), (3,4): F_ck(1) F_none(2) F_all(3) F_all(4) B(4) B(3) F_all(1) F_all(2)
    # B(2) B(1). Resident bytes as each op runs:
    levels = [
        X[0] + X[4] + X[1] + FTMP[1],  # F_ck(1)
        X[0] + X[4] + X[1] + X[2] + FTMP[2],  # F_none(2), a_1 released at its end
        X[0] + X[4] + X[2] + XBAR[3] + FTMP[3],
        X[0] + X[4] + X[2] + XBAR[3] + XBAR[4] + FTMP[4],
        X[0] + X[4] + X[2] + XBAR[3] + XBAR[4] + X[3] + BTMP[4],  # B(4)
        X[0] + X[2] + XBAR[3] + X[3] + X[2] + BTMP[3],  # B(3), then a_2 is released
        X[0] + X[2] + XBAR[1] + FTMP[1],  # recompute segment 1 (δ_2 resident)
        X[0] + X[2] + XBAR[1] + XBAR[2] + FTMP[2],
        X[0] + X[2] + XBAR[1] + XBAR[2] + X[1] + BTMP[2],  # B(2)
        X[0] + XBAR[1] + X[1] + X[0] + BTMP[1],  # B(1)
    ]
    plan = chen(tiny())
    assert [str(op) for op in plan.ops] == [
        "F_ck(1)",
        "F_none(2)",
        "F_all(3)",
        "F_all(4)",
        "B(4)",
        "B(3)",
        "F_all(1)",
        "F_all(2)",
        "B(2)",
        "B(1)",
    ]
    result = simulate(plan, tiny())
    assert result.makespan_s == COMPUTE + F[1] + F[2]
    # The peak is B(2): a_0, δ_2, x̄_1, x̄_2, δ_1 and its temporary.
    assert result.peak_bytes == max(levels) == levels[8] == 8 + 20 + 40 + 60 + 10 + 6
    assert plan.decisions == {"s1": "recompute", "s2": "recompute", "s3": "keep", "s4": "keep"}


def test_checkpoint_every_stage_by_hand() -> None:
    # F_ck(1..3) keep a_0..a_3; F_all(4) B(4); then F_all(i) B(i) for i = 3, 2, 1.
    checkpoints = [X[0] + X[1] + X[2] + X[3]]
    levels = [
        X[0] + X[4] + X[1] + FTMP[1],
        X[0] + X[4] + X[1] + X[2] + FTMP[2],
        X[0] + X[4] + X[1] + X[2] + X[3] + FTMP[3],
        checkpoints[0] + X[4] + XBAR[4] + FTMP[4],
        checkpoints[0] + X[4] + XBAR[4] + X[3] + BTMP[4],
    ]
    for i in (3, 2, 1):
        # Before F_all(i): a_0..a_{i-1} and δ_i.
        base = sum(X[:i]) + X[i]
        levels += [base + XBAR[i] + FTMP[i], base + XBAR[i] + X[i - 1] + BTMP[i]]
    plan = checkpoint_every_stage(tiny())
    assert validate(plan, tiny()) == []
    result = simulate(plan, tiny())
    assert result.makespan_s == COMPUTE + F[1] + F[2] + F[3]
    assert result.peak_bytes == max(levels)
    assert plan.decisions == {f"s{i}": "recompute" for i in (1, 2, 3)} | {"s4": "keep"}


def equal_chain(copy_s: float) -> Chain:
    """Four stages f=1, b=2, x=10, x̄=100; one saved-set copy takes ``copy_s`` each way."""
    stages = tuple(Stage(f"s{i}", 1.0, 2.0, 10, 100) for i in range(1, 5))
    return Chain("equal", 10, stages, Link(100 / copy_s, 100 / copy_s))


def test_offload_all_plan_shape() -> None:
    plan = offload_all(equal_chain(0.5))
    assert [str(op) for op in plan.ops] == [
        "F_all(1)",
        "F_all(2)",
        "offload(x̄1)",
        "F_all(3)",
        "offload(x̄2)",
        "F_all(4)",
        "B(4)",
        "prefetch(x̄2)",
        "B(3)",
        "prefetch(x̄1)",
        "B(2)",
        "B(1)",
    ]
    assert plan.decisions == {"s1": "offload", "s2": "offload", "s3": "keep", "s4": "keep"}


def test_offload_all_hides_copies_on_a_fast_link() -> None:
    # x̄_1 copies during F_all(2) (t 1..1.5) and is released when F_all(2) ends at t=2;
    # prefetches run during B(4) and B(3). Peak at t=4: a_0, δ_4, x̄_3, x̄_4, δ_3 and the
    # prefetched x̄_2.
    chain = equal_chain(0.5)
    result = simulate(offload_all(chain), chain)
    assert result.makespan_s == 12.0 == chain.compute_time_s
    assert result.peak_bytes == 10 + 10 + 100 + 100 + 10 + 100
    assert keep_all_peak(chain) == 10 + 10 + 4 * 100 + 10
    copies = [i for i in result.timeline if i.lane != "compute"]
    assert [(i.label, i.start_s, i.end_s) for i in copies] == [
        ("offload(x̄1)", 1.0, 1.5),
        ("offload(x̄2)", 2.0, 2.5),
        ("prefetch(x̄2)", 4.0, 4.5),
        ("prefetch(x̄1)", 6.0, 6.5),
    ]
    total_copy = sum(i.end_s - i.start_s for i in copies)
    assert result.makespan_s < chain.compute_time_s + total_copy


def test_offload_all_waits_on_a_slow_link_by_hand() -> None:
    # Copies of 3 s: offload x̄1 [1,4], x̄2 [4,7]; prefetch x̄2 can start only at 7, so B(3)
    # runs [10,12]; prefetch x̄1 is issued when B(3) starts, [10,13]; B(2) [13,15]; B(1) ends 17.
    chain = equal_chain(3.0)
    result = simulate(offload_all(chain), chain)
    assert result.makespan_s == 17.0
    assert result.wait_s == 5.0


def test_offload_all_on_short_chains_is_keep_all() -> None:
    for length in (1, 2):
        stages = tuple(Stage(f"s{i}", 1.0, 1.0, 1, 2) for i in range(length))
        chain = Chain("short", 1, stages, Link(1.0, 1.0))
        assert offload_all(chain).ops == keep_all(chain).ops


def test_offload_all_needs_a_link() -> None:
    with pytest.raises(ValueError, match="no link"):
        offload_all(tiny())
    with pytest.raises(ValueError, match="no link"):
        solve(tiny(), 10**6, "offload-all")


def test_solve_scores_baselines_within_budget() -> None:
    chain = tiny(Link(100.0, 100.0))
    budget = keep_all_peak(chain)
    for name in BASELINES:
        plan = solve(chain, budget, name)
        assert plan.solver == name
        assert plan.budget_bytes == budget
        assert plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= budget
        assert plan.predicted_time_s is not None and plan.predicted_time_s >= COMPUTE
        assert plan.chain_name == "tiny"


def test_baseline_too_big_names_its_own_peak() -> None:
    chain = tiny()
    peak = simulate(chen(chain), chain).peak_bytes
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(chain, peak - 1, "chen")
    assert caught.value.min_budget_bytes == peak
    assert caught.value.solver == "chen"
    assert solve(chain, peak, "chen").predicted_peak_bytes == peak
    assert min_feasible_budget(chain, "keep-all") == keep_all_peak(chain)


def test_offload_all_least_budget_is_tight() -> None:
    # Admission waits let offload-all fit below its unconstrained peak; the least budget is
    # found by bisection and is exact: one byte less does not fit.
    chain = equal_chain(3.0)
    unconstrained = simulate(offload_all(chain), chain).peak_bytes
    least = min_feasible_budget(chain, "offload-all")
    assert least < unconstrained
    plan = solve(chain, least, "offload-all")
    assert plan.predicted_peak_bytes is not None and plan.predicted_peak_bytes <= least
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(chain, least - 1, "offload-all")
    assert caught.value.min_budget_bytes == least


def test_registry_rejects_unknown_solvers_and_options() -> None:
    assert SOLVERS == (
        "keep-all",
        "chen",
        "checkpoint-every-stage",
        "offload-all",
        "min-peak",
        "dtr",
        "dp",
        "checkmate",
        "milp",
    )
    with pytest.raises(ValueError, match="unknown solver"):
        solve(tiny(), 1000, "greedy")
    with pytest.raises(ValueError, match="does not take option"):
        solve(tiny(), 1000, "chen", slots=10)
    with pytest.raises(ValueError, match="positive integer"):
        solve(tiny(), 0, "chen")
    # None means "not given", so callers can pass options uniformly.
    assert solve(tiny(), 1000, "chen", slots=None).solver == "chen"


def test_registry_runs_the_dp() -> None:
    chain = tiny()
    plan = solve(chain, keep_all_peak(chain), "dp", slots=2000)
    assert plan.solver == "dp"
    assert plan.predicted_peak_bytes is not None
    assert plan.predicted_peak_bytes <= keep_all_peak(chain)
    with pytest.raises(InfeasibleBudgetError) as caught:
        solve(chain, 20, "dp")
    assert caught.value.min_budget_bytes == min_feasible_budget(chain, "dp")


def test_registry_passes_milp_options(monkeypatch: pytest.MonkeyPatch) -> None:
    received: dict[str, Any] = {}

    def fake_solve_milp(chain: Chain, budget_bytes: int, **options: Any) -> Plan:
        received.update(options, budget=budget_bytes)
        return score(keep_all(chain), chain, budget_bytes)

    fake = types.ModuleType("solvers.milp")
    fake.solve_milp = fake_solve_milp  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "solvers.milp", fake)
    solve(tiny(), 999, "milp", offload=False, time_limit_s=5.0, gap=0.01, backend="cbc", slots=9)
    assert received == {
        "budget": 999,
        "offload": False,
        "time_limit_s": 5.0,
        "gap": 0.01,
        "backend": "cbc",
        "slots": 9,
    }


def test_missing_optimizer_module_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "solvers.milp", None)  # makes the import fail
    with pytest.raises(ValueError, match="solver 'milp' is not available") as caught:
        solve(tiny(), 1000, "milp")
    assert "solvers.milp is missing" in str(caught.value) and "dp" in str(caught.value)


def test_lower_bound_without_pressure_is_the_compute_time() -> None:
    chain = tiny()
    assert lower_bound_s(chain, None) == COMPUTE
    assert lower_bound_s(chain, keep_all_peak(chain)) == COMPUTE


def test_lower_bound_by_hand_without_a_link() -> None:
    # Room for kept saved sets at B(4): budget - (x_0 + x_4 + x̄_4 + x_3 + btmp_4) = 150 - 8 -
    # 47 = 95 of Σ_{i<4} x̄_i = 130, so 35 bytes must be recomputed; the cheapest per byte is
    # s1 (1 s for 40 B, against 2/60 and 1/30 for s2 and s3).
    budget = 150
    assert lower_bound_s(tiny(), budget) == pytest.approx(COMPUTE + 35 * (1.0 / 40))
    # With a link, offloading may replace the recomputation: 35 bytes at 35 B/s take 1 s on
    # each channel, well within Σf = 7 and Σb = 10, so nothing is forced.
    assert lower_bound_s(tiny(Link(35.0, 35.0)), budget) == COMPUTE
    # Too small to even run B(4) beside the input: no plan.
    assert lower_bound_s(tiny(), 54) == math.inf
    assert lower_bound_s(tiny(), 55) < math.inf


def test_lower_bound_with_a_slow_link_by_hand() -> None:
    # Budget 117 leaves room for 62 of the 130 bytes of x̄_1..x̄_3 (the input takes 8): 68
    # bytes must leave. On a 4 B/s link, moving m bytes takes m/4 s on each channel;
    # recomputing the rest costs 1/40 s per byte for the first 40 (s1) and 1/30 after.
    # Offloading up to m = 28 hides behind Σf = 7; beyond that each byte costs 1/4 s of
    # forward to save 1/40 s of recompute. So the best is m = 28: 7 + 10 + 40/40.
    chain = tiny(Link(4.0, 4.0))
    assert lower_bound_s(chain, 117) == pytest.approx(7 + 10 + 40 / 40)

    def step(moved: float) -> float:
        left = 68 - moved
        recompute = min(left, 40) / 40 + max(0.0, left - 40) / 30
        return max(7.0, moved / 4) + max(10.0 + recompute, moved / 4)

    # The exact minimum of the relaxation, checked on a fine grid.
    assert lower_bound_s(chain, 117) <= min(step(k / 100) for k in range(6801)) + 1e-12


def _budgets(chain: Chain) -> list[int]:
    top = keep_all_peak(chain)
    return [int(top * k / 8) for k in range(1, 9)]


@pytest.mark.parametrize("name", ["transformer", "cnn", "llama7b"])
def test_lower_bound_is_below_every_plan_on_the_examples(name: str) -> None:
    chain = examples.load(name)
    solvers_here = [s for s in SOLVERS if s not in ("milp", "checkmate")]
    for budget in _budgets(chain):
        bound = lower_bound_s(chain, budget)
        for solver in solvers_here:
            try:
                plan = solve(chain, budget, solver)
            except InfeasibleBudgetError:
                continue
            assert plan.predicted_time_s is not None
            assert bound <= plan.predicted_time_s * (1 + 1e-12), (solver, budget)


@st.composite
def random_chains(draw: st.DrawFn) -> Chain:
    length = draw(st.integers(1, 7))
    stages = []
    for n in range(length):
        out = draw(st.integers(1, 50))
        stages.append(
            Stage(
                f"s{n}",
                draw(st.floats(0.1, 5.0)),
                draw(st.floats(0.1, 5.0)),
                out,
                out + draw(st.integers(0, 200)),
                draw(st.integers(0, 20)),
                draw(st.integers(0, 20)),
            )
        )
    bandwidth = draw(st.floats(5.0, 500.0))
    return Chain("random", draw(st.integers(1, 50)), tuple(stages), Link(bandwidth, bandwidth))


@settings(max_examples=60, deadline=None)
@given(chain=random_chains(), fraction=st.floats(0.05, 1.0))
def test_baselines_are_valid_and_fit_or_name_a_budget_that_fits(
    chain: Chain, fraction: float
) -> None:
    budget = max(1, int(keep_all_peak(chain) * fraction))
    bound = lower_bound_s(chain, budget)
    for name, build in BASELINES.items():
        plan = build(chain)
        assert validate(plan, chain) == []
        kinds = {op.kind for op in plan.ops}
        copies = name == "offload-all" and chain.length > 2
        assert (OFFLOAD in kinds) == copies
        assert (PREFETCH in kinds) == copies
        try:
            scored = solve(chain, budget, name)
        except InfeasibleBudgetError as error:
            assert error.min_budget_bytes > budget
            refit = solve(chain, error.min_budget_bytes, name)
            assert refit.predicted_peak_bytes is not None
            assert refit.predicted_peak_bytes <= error.min_budget_bytes
            continue
        assert scored.predicted_peak_bytes is not None and scored.predicted_time_s is not None
        assert scored.predicted_peak_bytes <= budget
        assert scored.predicted_time_s >= chain.compute_time_s - 1e-9
        assert bound <= scored.predicted_time_s * (1 + 1e-12)


def test_offload_all_moves_only_saved_sets() -> None:
    plan = offload_all(equal_chain(1.0))
    assert {op.target for op in plan.ops if not op.is_compute} == {SAVED}


@pytest.mark.parametrize(
    ("options", "named"),
    [
        ({"offload": "no"}, "offload"),
        ({"offload": 0}, "offload"),
        ({"time_limit_s": float("nan")}, "time_limit_s"),
        ({"time_limit_s": "1"}, "time_limit_s"),
        ({"gap": "0.1"}, "gap"),
        ({"backend": 3}, "backend"),
        ({"progress": 5}, "progress"),
    ],
)
def test_options_of_the_wrong_type_are_refused_by_name(options: dict, named: str) -> None:
    """``offload="no"`` read as true and offloaded; the others failed deep in the solver."""
    with pytest.raises(ValueError, match=named):
        solve(tiny(Link(1e9, 1e9)), keep_all_peak(tiny()), "milp", **options)
