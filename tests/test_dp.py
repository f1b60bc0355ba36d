"""The DP is optimal: against exhaustive search, against the recurrence, and on its properties."""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import random
from dataclasses import replace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from solvers import dp
from solvers.baselines import keep_all as keep_all_plan
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Stage
from solvers.dp import least_memory_plan, memory_need, solve_dp
from solvers.plan import validate
from solvers.registry import solve
from solvers.simulator import simulate

INF = math.inf


def random_chain(rng: random.Random, length: int, uniform: bool = False, tmp: bool = True) -> Chain:
    """A chain with small integer sizes, so that budget = slots gives a unit of one byte."""
    size = rng.randint(1, 6)
    stages = []
    for i in range(1, length + 1):
        out = size if uniform else rng.randint(1, 6)
        stages.append(
            Stage(
                name=f"s{i}",
                fwd_s=float(rng.randint(1, 5)),
                bwd_s=float(rng.randint(1, 8)),
                out_bytes=out,
                saved_bytes=out + rng.randint(0, 8),
                fwd_tmp_bytes=rng.randint(0, 3) if tmp else 0,
                bwd_tmp_bytes=rng.randint(0, 4) if tmp else 0,
                # Derived, not drawn, so the chains of each seed stay those of earlier runs.
                nograd_fwd_tmp_bytes=(out + i) % 4 if tmp else 0,
                grad_bytes=out - i % 2 if tmp else out,  # an integer mask carries none
                refill_s=None,  # set below, derived from fwd_s
            )
        )
    # Derived, not drawn: a refill stops early in every other stage (solvers/semantics.py).
    stages = [
        replace(stage, refill_s=stage.fwd_s - 0.5 * (i % 2)) if tmp else stage
        for i, stage in enumerate(stages, start=1)
    ]
    # Derived, not drawn: the caller's loss and its seed gradient, held after B(L).
    held = (stages[-1].out_bytes + length) % 3 if tmp else 0
    return Chain("random", size if uniform else rng.randint(1, 6), tuple(stages), held_bytes=held)


def exhaustive_optimum(chain: Chain, budget: int, frees: bool = False) -> float:
    """Dijkstra over every valid sequence of F_all, F_ck, F_none and B (design.md's model);
    with ``frees``, also of ``free`` of any activation or saved set at any point (plans outside
    rotor's persistent family, which no bound may exceed).

    A state is the set of tensors resident on the GPU; each op is allowed when its transient
    peak fits. This is written from design.md alone, independently of the simulator. An F_all(i)
    right before B(i) takes ``refill_s`` when stage i ran forward before without keeping x̄_i
    (for i < L always, when x̄_i is absent at B(i)'s turn): that pair is one move here, and
    with ``frees`` it is taken at ``refill_s`` also where the executor would run the whole
    forward (x̄_i kept, then freed), which can only lower the optimum.
    """
    x = [chain.activation_bytes(i) for i in range(chain.length + 1)]
    g = [chain.grad_bytes(i) for i in range(chain.length + 1)]  # δ_i
    length = chain.length

    def resident_bytes(state: frozenset) -> int:
        # From B(L) to the end the caller holds its output and the gradient it seeded.
        total = chain.held_bytes if ("grad", length) not in state else 0
        for kind, i in state:
            if kind == "saved":
                total += chain.saved_bytes(i)
            else:
                total += x[i] if kind == "a" else g[i]
        return total

    def has_input(state: frozenset, i: int) -> bool:
        return ("a", i - 1) in state or ("saved", i - 1) in state

    start = frozenset({("a", 0), ("grad", length)})
    best = {start: 0.0}
    queue = [(0.0, 0, start)]
    counter = 0
    while queue:
        time, _, state = heapq.heappop(queue)
        if time > best.get(state, INF):
            continue
        grad = next(i for kind, i in state if kind == "grad")
        if grad == 0:
            return time
        used = resident_bytes(state)
        moves = []
        for i in range(1, grad + 1):
            stage = chain.stage(i)
            if not has_input(state, i):
                continue
            fits_saved = used + stage.saved_bytes + stage.fwd_tmp_bytes <= budget
            if ("saved", i) not in state and fits_saved:
                moves.append((stage.fwd_s, state | {("saved", i)}))
            if ("a", i) not in state and used + x[i] + stage.nograd_fwd_tmp_bytes <= budget:
                moves.append((stage.fwd_s, state | {("a", i)}))  # F_ck
                moves.append((stage.fwd_s, (state - {("a", i - 1)}) | {("a", i)}))  # F_none
        stage = chain.stage(grad)
        if (
            ("saved", grad) in state
            and has_input(state, grad)
            and used + g[grad - 1] + stage.bwd_tmp_bytes <= budget
        ):
            after = state - {("saved", grad), ("grad", grad), ("a", grad - 1)}
            moves.append((stage.bwd_s, after | {("grad", grad - 1)}))
        if (
            grad < length
            and ("saved", grad) not in state
            and has_input(state, grad)
            and used + stage.saved_bytes + stage.fwd_tmp_bytes <= budget
            and used + stage.saved_bytes + g[grad - 1] + stage.bwd_tmp_bytes <= budget
        ):
            after = state - {("grad", grad), ("a", grad - 1)}
            moves.append((stage.refill_s + stage.bwd_s, after | {("grad", grad - 1)}))
        if frees:
            moves += [(0.0, state - {t}) for t in state if t[0] != "grad" and t != ("a", 0)]
        for cost, successor in moves:
            if time + cost < best.get(successor, INF):
                best[successor] = time + cost
                counter += 1
                heapq.heappush(queue, (time + cost, counter, successor))
    return INF


def recurrence(chain: Chain, budget: int, rotor_literal: bool = False) -> float:
    """opt(budget - x_0, 1, L) written straight from design.md, memoized, unit = one byte.

    With ``rotor_literal`` the two feasibility conditions of F_all(s) and B(s) that rotor omits
    are left out, which is rotor's recurrence exactly.
    """
    x = [chain.activation_bytes(i) for i in range(chain.length + 1)]
    g = [chain.grad_bytes(i) for i in range(chain.length + 1)]  # δ_i

    def held(t: int) -> int:  # what the caller holds after B(L)
        return chain.held_bytes if t < chain.length else 0

    def saved(i: int) -> int:
        return chain.saved_bytes(i)

    def ftmp(i: int) -> int:
        return chain.stage(i).fwd_tmp_bytes

    def ntmp(i: int) -> int:  # a forward without autograd (F_ck, F_none)
        return chain.stage(i).nograd_fwd_tmp_bytes

    def btmp(i: int) -> int:
        return chain.stage(i).bwd_tmp_bytes

    @functools.cache
    def opt(m: int, s: int, t: int) -> float:
        if s == t:
            need = held(s) + max(g[s] + saved(s) + ftmp(s), g[s - 1] + g[s] + saved(s) + btmp(s))
            stage = chain.stage(s)
            # Before L, (s, s) follows a forward of s that kept no x̄_s: F_all(s) refills.
            forward = stage.refill_s if s < chain.length else stage.fwd_s
            return forward + stage.bwd_s if m >= need else INF

        # The room for the forwards without autograd a split at j runs, s..j-1, bounds it
        # (solvers/dp.py's design note; rotor takes s..t-1 for every split).
        def room(j: int) -> int:
            forwards = [x[s] + ntmp(s)] + [x[k - 1] + x[k] + ntmp(k) for k in range(s + 1, j)]
            return held(t) + g[t] + max(forwards)

        stage = chain.stage(s)
        first = INF
        own_need = max(
            held(t) + g[t] + saved(s) + ftmp(s),  # F_all(s), before the sub-problem
            held(s) + g[s - 1] + g[s] + saved(s) + btmp(s),  # B(s), after it
        )
        if m >= saved(s) and (rotor_literal or m >= own_need):
            first = stage.fwd_s + opt(m - saved(s), s + 1, t) + stage.bwd_s
        second = INF
        for j in range(s + 1, t + 1):
            if m >= room(j) and m >= x[j - 1]:
                forwards = sum(chain.stage(k).fwd_s for k in range(s, j))
                second = min(second, forwards + opt(m - x[j - 1], j, t) + opt(m, s, j - 1))
        return min(first, second)

    if budget < x[0]:
        return INF
    return opt(budget - x[0], 1, chain.length)


def dp_time(chain: Chain, budget: int) -> float:
    """The DP's optimum at one-byte resolution (slots = budget), or inf."""
    try:
        return solve_dp(chain, budget, slots=budget).predicted_time_s
    except InfeasibleBudgetError:
        return INF


@pytest.mark.parametrize("seed", range(12))
def test_dp_matches_exhaustive_search_on_small_chains(seed: int) -> None:
    """The search's F_none may drop any input, a checkpoint still needed later included,
    which rotor's persistent family does not (its sub-chains keep their input): on these
    chains no such plan is faster, on a few others one is (seed 1355 at 22 B: 35 s against
    the DP's 37 s), so that there the DP is only never faster
    (test_dp_is_never_faster_than_exhaustive_search)."""
    rng = random.Random(seed)
    chain = random_chain(rng, length=rng.randint(1, 5))
    need = memory_need(chain)
    keep_all = chain.input_bytes + sum(s.saved_bytes for s in chain.stages) + 20
    for budget in sorted({need - 1, need, *rng.sample(range(need, keep_all), 6), keep_all}):
        expected = exhaustive_optimum(chain, budget)
        assert dp_time(chain, budget) == pytest.approx(expected), f"budget {budget}"


def test_dp_is_never_faster_than_exhaustive_search() -> None:
    differ = 0
    for seed in range(1340, 1370):
        rng = random.Random(seed)
        chain = random_chain(rng, length=rng.randint(2, 4))
        need = memory_need(chain)
        for budget in (need, need + 2, need + 5):
            expected = exhaustive_optimum(chain, budget)
            assert dp_time(chain, budget) >= expected * (1 - 1e-9), (seed, budget)
            differ += dp_time(chain, budget) > expected * (1 + 1e-9)
    assert differ >= 1  # seed 1355: a plan outside rotor's family is faster


@pytest.mark.parametrize("seed", range(1, 9))  # seed 0 has no plan below keep-all
def test_with_a_tolerance_the_plan_holds_the_least_memory_of_those_within_it(seed: int) -> None:
    rng = random.Random(100 + seed)
    chain = random_chain(rng, length=rng.randint(3, 5))
    plain_peak = simulate(keep_all_plan(chain), chain).peak_bytes
    budget = plain_peak - 1  # plain autograd does not fit, so the tolerance has room to act
    fastest = exhaustive_optimum(chain, budget)
    assert fastest < INF
    tolerance = rng.choice((0.05, 0.1, 0.2))
    least = min(
        b
        for b in range(memory_need(chain), budget + 1)
        if exhaustive_optimum(chain, b) <= fastest * (1 + tolerance)
    )
    plan = solve_dp(chain, budget, slots=budget, tolerance=tolerance)
    assert plan.predicted_time_s <= fastest * (1 + tolerance) + 1e-9
    assert plan.predicted_peak_bytes == least
    assert validate(plan, chain) == []


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "table"])
@pytest.mark.parametrize("seed", range(10))
def test_dp_equals_the_recurrence(seed: int, exact: bool, monkeypatch) -> None:
    if not exact:  # no time for the DP in exact bytes: the table at one-byte slots answers
        monkeypatch.setattr(dp, "EXACT_SECONDS", 0.0)
    rng = random.Random(100 + seed)
    chain = random_chain(rng, length=rng.randint(2, 9))
    need = memory_need(chain)
    for budget in range(need - 2, need + 40, 3):
        assert dp_time(chain, budget) == pytest.approx(recurrence(chain, budget))


@pytest.mark.parametrize("seed", range(6))
def test_dp_reaches_rotors_optimum_where_rotors_checks_suffice(seed: int) -> None:
    # Equal activation sizes and no temporaries: the conditions rotor omits are implied.
    rng = random.Random(200 + seed)
    chain = random_chain(rng, length=rng.randint(2, 8), uniform=True, tmp=False)
    need = memory_need(chain)
    for budget in range(need - 2, need + 30, 2):
        rotor = recurrence(chain, budget, rotor_literal=True)
        assert dp_time(chain, budget) == pytest.approx(rotor)


def test_rotors_literal_recurrence_can_exceed_its_budget() -> None:
    # Stage 1 has a large backward temporary that rotor's first option never checks.
    chain = Chain(
        "counterexample",
        1,
        (
            Stage("s1", 1.0, 1.0, out_bytes=1, saved_bytes=1, bwd_tmp_bytes=100),
            Stage("s2", 1.0, 1.0, out_bytes=1, saved_bytes=1),
        ),
    )
    budget = 6
    assert recurrence(chain, budget, rotor_literal=True) == 4.0  # rotor claims a plan fits
    assert exhaustive_optimum(chain, budget) == INF  # but none does
    # a_0, δ_0, a_1 inside x̄_1, δ_1 and the temporary:
    assert memory_need(chain) == 104
    with pytest.raises(InfeasibleBudgetError) as error:
        solve_dp(chain, budget, slots=budget)
    assert error.value.min_budget_bytes >= 104
    assert dp_time(chain, 103) == INF
    assert dp_time(chain, 104) == exhaustive_optimum(chain, 104) == 4.0


@pytest.mark.parametrize("exact", [True, False], ids=["exact", "table"])
def test_infeasible_budget_names_the_least_feasible_one(exact: bool, monkeypatch) -> None:
    if not exact:
        monkeypatch.setattr(dp, "EXACT_SECONDS", 0.0)
    rng = random.Random(7)
    chain = random_chain(rng, length=6)
    need = memory_need(chain)
    with pytest.raises(InfeasibleBudgetError) as error:
        solve_dp(chain, need - 1, slots=need - 1)
    assert error.value.min_budget_bytes == need
    assert str(error.value.min_budget_bytes) in str(error.value)
    # The named budget has a plan at every resolution: the DP in exact bytes finds it, and
    # without time for that, where rounding sizes up to few slots leaves the table without
    # one, a finer DP or the least-memory plan answers.
    for slots in (3, 50, 500):
        assert solve_dp(chain, need, slots=slots).predicted_peak_bytes <= need
    for nothing in (0, -need):
        with pytest.raises(InfeasibleBudgetError) as error:
            solve_dp(chain, nothing)
        assert error.value.min_budget_bytes == need


def test_dp_plan_is_valid_and_its_simulated_time_is_the_table_value() -> None:
    rng = random.Random(11)
    chain = random_chain(rng, length=20)
    budget = int(memory_need(chain) * 1.3)
    plan = solve_dp(chain, budget)
    assert validate(plan, chain) == []
    assert plan.predicted_time_s == pytest.approx(plan.info["dp_time_s"])
    assert plan.predicted_peak_bytes <= budget
    assert set(plan.decisions.values()) <= {"keep", "recompute"}


chains = st.builds(
    lambda seed, length: random_chain(random.Random(seed), length),
    st.integers(0, 10**6),
    st.integers(1, 12),
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains, st.integers(1, 8), st.floats(0.0, 0.3))
def test_the_dp_has_a_plan_wherever_a_recomputing_baseline_fits(chain, slots, above) -> None:
    # At 500 slots a SqueezeNet's dp named 794,483 B where chen fit in 791,554 B.
    budget = int(memory_need(chain) * (1 + above))
    plan = solve_dp(chain, budget, slots=slots)
    assert simulate(plan, chain, budget).feasible
    assert validate(plan, chain) == []


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains, st.floats(1.0, 4.0))
def test_simulated_peak_is_within_budget(chain: Chain, factor: float) -> None:
    budget = int(memory_need(chain) * factor)
    plan = solve_dp(chain, budget, slots=50)
    result = simulate(plan, chain, budget)
    assert result.peak_bytes <= budget
    assert result.makespan_s == pytest.approx(plan.predicted_time_s)


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains)
def test_time_never_rises_as_budget_grows(chain: Chain) -> None:
    # At one-byte resolution rounding plays no part, so more memory can only help.
    need = memory_need(chain)
    times = [dp_time(chain, budget) for budget in range(need, need + 60, 4)]
    assert all(later <= earlier + 1e-9 for earlier, later in itertools.pairwise(times))


def test_keep_all_is_returned_whenever_it_fits_in_exact_bytes() -> None:
    rng = random.Random(5)
    chain = random_chain(rng, length=14)
    keep_all_peak = simulate(solve_dp(chain, 10**6), chain).peak_bytes
    # At 5 slots every size rounds up to a fifth of the budget, so the table alone cannot fit
    # keep-all at exactly its peak; the plan must still be keep-all.
    plan = solve_dp(chain, keep_all_peak, slots=5)
    assert plan.predicted_time_s == chain.compute_time_s
    assert plan.predicted_peak_bytes == keep_all_peak
    # A byte less, the table at 5 slots fits nothing: the DP in exact bytes answers,
    # recomputing.
    tighter = solve_dp(chain, keep_all_peak - 1, slots=5)
    assert tighter.predicted_peak_bytes < keep_all_peak
    assert tighter.predicted_time_s > chain.compute_time_s


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(chains)
def test_large_budget_costs_no_recomputation(chain: Chain) -> None:
    keep_all = chain.input_bytes + sum(s.saved_bytes for s in chain.stages)
    plan = solve_dp(chain, 10 * keep_all + 100)
    assert plan.predicted_time_s == pytest.approx(chain.compute_time_s)
    assert set(plan.decisions.values()) == {"keep"}


@pytest.mark.parametrize("seed", range(3))
def test_the_least_memory_plan_peaks_at_the_least_memory_exactly(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(40):
        chain = random_chain(rng, rng.randint(1, 8))
        plan = least_memory_plan(chain)
        assert validate(plan, chain) == []
        assert simulate(plan, chain).peak_bytes == memory_need(chain)


def test_a_split_needs_room_only_for_the_forwards_it_runs() -> None:
    """Rotor's recurrence counts, for every split of (s, t), the forwards without autograd of
    s..t-1; a split at j runs s..j-1. Here stage 2's no-grad temporary dominates, and the
    split that runs F_ck(1) alone fits where rotor's room refused it: dp named 1413257 B the
    least budget where chen's plan fits in 1405821 (a review)."""
    stage = {"fwd_tmp_bytes": 0, "bwd_tmp_bytes": 0}
    chain = Chain(
        "r",
        0,
        (
            Stage("s1", 1.0, 2.0, 664598, 672034, **stage),
            Stage("s2", 1.0, 2.0, 1, 1978, nograd_fwd_tmp_bytes=965798, **stage),
            Stage("s4", 1.0, 2.0, 369622, 369622, **stage),
        ),
    )
    chen = solve(chain, 1405821, "chen")
    assert memory_need(chain) <= chen.predicted_peak_bytes
    plan = solve_dp(chain, chen.predicted_peak_bytes)
    assert plan.predicted_time_s <= chen.predicted_time_s
    for budget in range(memory_need(chain), memory_need(chain) + 3):
        assert dp_time(chain, budget) == pytest.approx(exhaustive_optimum(chain, budget))


@pytest.mark.parametrize("seed", range(6))
def test_dp_matches_exhaustive_search_where_no_grad_temporaries_dominate(seed: int) -> None:
    """The random chains above draw no-grad temporaries of at most 3 bytes, too small for the
    room of a split's forwards to matter: here they outweigh the activations."""
    rng = random.Random(seed)
    chain = random_chain(rng, length=rng.randint(2, 4))
    chain = replace(
        chain,
        stages=tuple(
            replace(stage, nograd_fwd_tmp_bytes=rng.choice((0, 0, 12, 20)))
            for stage in chain.stages
        ),
    )
    need = memory_need(chain)
    for budget in (need - 1, need, need + 3, need + 8):
        expected = exhaustive_optimum(chain, budget)
        assert dp_time(chain, budget) >= expected * (1 - 1e-9), budget
        assert dp_time(chain, budget) == pytest.approx(recurrence(chain, budget)), budget
