"""The table of operation semantics, and the readers that must agree with it op by op.

Each reader (validate, simulate, the MILP's codec) is checked against a walk of the plan
that uses nothing but :func:`solvers.semantics.effect` and the chain's sizes.
"""

from __future__ import annotations

import random

import pytest
from test_milp import random_chain

from solvers import semantics
from solvers.baselines import BASELINES
from solvers.dp import memory_need, solve_dp
from solvers.milp_codec import NotInFamilyError, decode, encode
from solvers.plan import ACTIVATION, BACKWARD, SAVED, Op, Plan, validate
from solvers.registry import keep_all_peak
from solvers.simulator import simulate


def plans(seed: int, count: int) -> list[tuple[object, Plan]]:
    """Valid plans of every recompute-only kind on random chains."""
    rng = random.Random(seed)
    out = []
    for _ in range(count):
        chain = random_chain(rng, rng.randint(2, 8), link=False)
        least, most = memory_need(chain), keep_all_peak(chain)
        for budget in {least, (least + most) // 2, most}:
            out.append((chain, solve_dp(chain, budget, slots=budget)))
        out += [(chain, BASELINES[name](chain)) for name in BASELINES if name != "offload-all"]
    return out


def table_walk(plan: Plan, chain) -> tuple[float, int, list[set[tuple[str, int]]]]:
    """Makespan, peak and the residency before each op, from the table alone.

    Compute ops run one after another (every stage here takes time): each allocates its
    output and temporary at its start and releases the temporary and what the table says at
    its end; B(L)'s end also allocates what the caller holds.
    """
    resident = semantics.initial_residency(chain.length)
    level = sum(semantics.tensor_bytes(t, chain) for t in resident)
    peak, time, before = level, 0.0, []
    refilled = semantics.refills(plan.ops)
    for position, op in enumerate(plan.ops):
        before.append(set(resident))
        gone = semantics.released(op, resident)
        if op.is_compute:
            made = semantics.effect(op).allocates
            level += semantics.tensor_bytes(made, chain)
            peak = max(peak, level + semantics.temporary_bytes(op, chain))
            time += semantics.duration_s(op, chain, position in refilled)
            if op.kind == BACKWARD and op.index == chain.length:
                level += chain.held_bytes
        level -= sum(semantics.tensor_bytes(t, chain) for t in gone)
        peak = max(peak, level)
        semantics.apply(resident, op)
    return time, peak, before


@pytest.mark.parametrize("seed", range(3))
def test_the_simulator_follows_the_table(seed: int) -> None:
    for chain, plan in plans(seed, 15):
        time, peak, _ = table_walk(plan, chain)
        simulation = simulate(plan, chain)
        assert simulation.makespan_s == pytest.approx(time)
        assert simulation.peak_bytes == peak, [str(op) for op in plan.ops]


@pytest.mark.parametrize("seed", range(3))
def test_validate_reports_exactly_what_the_table_forbids(seed: int) -> None:
    """Deleting any one op of a valid plan is reported at the first op whose needs it breaks."""
    rng = random.Random(seed)
    for chain, plan in plans(seed, 8):
        assert validate(plan, chain) == []
        n = rng.randrange(len(plan.ops))
        ops = plan.ops[:n] + plan.ops[n + 1 :]
        first = _first_broken(ops, chain)
        problems = validate(list(ops), chain)
        if first is None:
            assert problems == [] or all(p.startswith("backward B(") for p in problems)
        else:
            assert problems and problems[0].startswith(f"op {first} ")


def _first_broken(ops: tuple[Op, ...], chain) -> int | None:
    resident = semantics.initial_residency(chain.length)
    done: set[int] = set()
    for n, op in enumerate(ops):
        change = semantics.effect(op)
        missing_input = change.reads_input and semantics.stage_input(op.index, resident) is None
        missing = any(t not in resident for t in change.reads)
        again = op.is_compute and (
            op.index in done or (op.kind != BACKWARD and change.allocates in resident)
        )
        if missing_input or missing or again:
            return n
        if op.kind == BACKWARD:
            done.add(op.index)
        semantics.apply(resident, op)
    return None


@pytest.mark.parametrize("seed", range(3))
def test_the_milp_codec_follows_the_table(seed: int) -> None:
    """What the codec reads as resident at each backward step's start is the table's."""
    checked = 0
    for chain, plan in plans(seed, 10):
        try:
            schedule = encode(plan.ops, chain.length)
        except NotInFamilyError:
            continue
        _, _, before = table_walk(plan, chain)
        backwards = [n for n, op in enumerate(plan.ops) if op.kind == BACKWARD]
        for k in range(chain.length, 0, -1):
            # Step L starts at B(L); step k < L at the first compute op after B(k + 1).
            start = backwards[0]
            if k < chain.length:
                after = backwards[chain.length - k - 1]
                start = next(n for n in range(after + 1, len(plan.ops)) if plan.ops[n].is_compute)
            tensors = [(ACTIVATION, j) for j in range(1, k)] + [(SAVED, i) for i in range(1, k + 1)]
            assert {t for t in tensors if schedule.is_resident(k, t)} == {
                t for t in tensors if t in before[start]
            }
        assert validate(decode(schedule), chain) == []
        checked += 1
    assert checked >= 10


def test_undisturbed_forwards_are_those_whose_input_and_saved_set_stay_put() -> None:
    """An F_all(i) is undisturbed exactly when nothing moves, frees or recomputes a_{i-1},
    x̄_{i-1}, a_i or x̄_i before B(i)."""
    from solvers.ops import (
        backward,
        forward_all,
        forward_checkpoint,
        forward_none,
        offload,
        prefetch,
    )

    keep_all = [forward_all(1), forward_all(2), forward_all(3), backward(3), backward(2)]
    keep_all.append(backward(1))
    assert semantics.undisturbed_forwards(keep_all) == {0, 1, 2}
    # x̄_1 holds a_1, the input of F_all(2): offloading it before B(2) disturbs F_all(2), and
    # offloading x̄_1 disturbs F_all(1) itself.
    moved = [forward_all(1), forward_all(2), offload(SAVED, 1), forward_all(3), backward(3)]
    moved += [prefetch(SAVED, 1), backward(2), backward(1)]
    assert semantics.undisturbed_forwards(moved) == {3}
    # After a recomputation every F_all is undisturbed; one whose stage is forwarded again
    # before its backward is not.
    recompute = [forward_checkpoint(1), forward_none(2), forward_all(3), backward(3)]
    recompute += [forward_all(1), forward_all(2), backward(2), backward(1)]
    assert semantics.undisturbed_forwards(recompute) == {2, 4, 5}
    again = [forward_all(1), forward_all(2), forward_none(2), forward_all(3), backward(3)]
    assert 1 not in semantics.undisturbed_forwards(again)
