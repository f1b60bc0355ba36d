"""The host's order of actions (``solvers/host.py``) against the plan's rules: replayed
through ``validate``, the host's issue order must itself be a valid plan, every op must be
issued once, and every offload released once, after it was issued. Oracle: the validator,
which host.py does not use; plans are random walks over every op the rules allow, most of
them stranger than any solver's."""

from __future__ import annotations

import random
from collections import Counter

from solvers import semantics
from solvers.chain import Chain, Link, Stage
from solvers.host import COMPUTE, ISSUE, RELEASE
from solvers.ops import (
    ACTIVATION,
    BACKWARD,
    F_ALL,
    F_CK,
    F_NONE,
    FREE,
    OFFLOAD,
    PREFETCH,
    SAVED,
    Op,
)
from solvers.plan import validate
from solvers.simulator import simulate
from tests.test_milp import random_chain


def random_plan(chain: Chain, rng: random.Random, most: int = 60) -> list[Op] | None:
    """A random valid plan: at each step one of the ops the rules allow, B(i) favoured."""
    resident = semantics.initial_residency(chain.length)
    on_host: set[tuple[str, int]] = set()
    ops: list[Op] = []
    nxt = chain.length  # the next backward
    while nxt > 0 and len(ops) < most:
        allowed = []
        if {(SAVED, nxt), (semantics.GRAD, nxt)} <= resident and semantics.stage_input(
            nxt, resident
        ):
            allowed += [Op(BACKWARD, nxt)] * 6
        for i in range(1, nxt + 1):
            if semantics.stage_input(i, resident) is None:
                continue
            if (SAVED, i) not in resident:
                allowed.append(Op(F_ALL, i))
            if (ACTIVATION, i) not in resident:
                allowed += [Op(F_CK, i), Op(F_NONE, i)]
        for kind, i in sorted(resident):
            # Not a_0, the caller's input, nor a_L or x̄_L, which hold the caller's output.
            if kind in (ACTIVATION, SAVED) and 0 < i < chain.length:
                allowed += [Op(FREE, i, kind), Op(OFFLOAD, i, kind)]
        allowed += [Op(PREFETCH, i, kind) for kind, i in sorted(on_host - resident)]
        op = rng.choice(allowed)
        change = semantics.effect(op)
        if change.to_host:
            on_host.add(change.to_host)
        semantics.apply(resident, op)
        ops.append(op)
        nxt -= op.kind == BACKWARD
    return ops if nxt == 0 and validate(ops, chain) == [] else None


def check_host_order(ops: list[Op], chain: Chain, budget: int | None) -> None:
    actions = simulate(ops, chain, budget).host_actions
    issued = [a.position for a in actions if a.kind in (ISSUE, COMPUTE)]
    assert sorted(issued) == list(range(len(ops)))
    assert validate([ops[n] for n in issued], chain) == []
    released = Counter(a.position for a in actions if a.kind == RELEASE)
    assert released == Counter(n for n, op in enumerate(ops) if op.kind == OFFLOAD)
    order = {a.position: k for k, a in enumerate(actions) if a.kind == ISSUE}
    assert all(order[a.position] < k for k, a in enumerate(actions) if a.kind == RELEASE)


def test_the_host_order_of_random_plans_is_a_valid_plan() -> None:
    checked = 0
    for seed in range(40):
        rng = random.Random(seed)
        chain = random_chain(rng, rng.randint(1, 5))
        for _ in range(20):
            ops = random_plan(chain, rng)
            if ops is None:
                continue
            peak = simulate(ops, chain).peak_bytes
            for budget in (None, peak - rng.randint(0, 10)):
                check_host_order(ops, chain, budget)
            checked += 1
    assert checked > 300


def slow_link_chain() -> Chain:
    """Two stages whose copies take longer than their compute: 10 s for a_1."""
    stages = (Stage("s1", 1.0, 1.0, 10, 10), Stage("s2", 1.0, 1.0, 5, 5))
    return Chain("slow link", 1, stages, link=Link(1.0, 1.0))


def test_a_free_after_a_prefetch_held_back_waits_for_it() -> None:
    """The prefetch waits for the slow offload of the same tensor: the free listed after it
    must not be issued first."""
    chain = slow_link_chain()
    ops = [
        Op(F_CK, 1),
        Op(OFFLOAD, 1, ACTIVATION),
        Op(F_ALL, 1),
        Op(PREFETCH, 1, ACTIVATION),
        Op(FREE, 1, ACTIVATION),
        Op(F_ALL, 2),
        Op(BACKWARD, 2),
        Op(BACKWARD, 1),
    ]
    check_host_order(ops, chain, None)


def test_an_offload_that_ends_after_the_last_compute_is_released() -> None:
    chain = slow_link_chain()
    ops = [
        Op(F_CK, 1),
        Op(OFFLOAD, 1, ACTIVATION),
        Op(F_ALL, 1),
        Op(F_ALL, 2),
        Op(BACKWARD, 2),
        Op(BACKWARD, 1),
    ]
    check_host_order(ops, chain, None)
