"""Chains at the edges of the memory model: zero-length operations, negative backward
temporaries, bytes the caller holds after B(L). Every solver's plan must fit its budget as the
simulator counts it, no plan may peak below the bound every plan obeys, and a named least
budget must be one at which the solver succeeds. An independent review found plans at up to
twice their budget and peaks below the bound on such chains."""

from __future__ import annotations

import random

import pytest

from solvers.bounds import necessary_budget_bytes
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Stage
from solvers.registry import keep_all_peak, min_feasible_budget, solve
from solvers.simulator import simulate

SOLVERS = ("dp", "dtr", "keep-all", "chen", "checkpoint-every-stage", "min-peak")


def edge_chain(rng: random.Random) -> Chain:
    stages = []
    for n in range(rng.choice([1, 1, 2, 3])):
        out = rng.randint(1, 100)
        saved = out + rng.randint(0, 100)
        stages.append(
            Stage(
                f"s{n}",
                rng.choice([0.0, 1.0, rng.random()]),
                rng.choice([0.0, 1.0, rng.random()]),
                out,
                saved,
                rng.randint(0, 50),
                rng.randint(-saved, 50),
                grad_bytes=rng.randint(0, 100),
            )
        )
    return Chain(
        "edge",
        rng.randint(1, 100),
        tuple(stages),
        input_grad_bytes=rng.choice([0, rng.randint(1, 300)]),
        held_bytes=rng.choice([0, rng.randint(0, 300)]),
    )


@pytest.mark.parametrize("seed", range(4))
def test_plans_fit_their_budget_and_never_beat_the_bound_on_edge_chains(seed: int) -> None:
    rng = random.Random(seed)
    for _ in range(60):
        chain = edge_chain(rng)
        bound, peak = necessary_budget_bytes(chain), keep_all_peak(chain)
        for solver in SOLVERS:
            least = min_feasible_budget(chain, solver)
            for budget in {least, bound, max(1, bound - 1), peak, (bound + peak) // 2}:
                try:
                    plan = solve(chain, budget, solver)
                except InfeasibleBudgetError as error:
                    assert budget < least or solver == "dtr", (solver, budget, chain)
                    assert solve(chain, error.min_budget_bytes, solver).feasible
                    continue
                simulated = simulate(plan, chain).peak_bytes
                assert bound <= simulated <= budget, (solver, budget, chain)
