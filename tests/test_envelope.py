"""The envelope of chains: a plan's simulated peak on it bounds its peak on each chain, so a
plan within budget on the envelope is within budget on every one (offremat's stand-in plans
for values that pick which blocks save a branch rely on it)."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import pytest

from solvers.baselines import checkpoint_every_stage, checkpoint_sequential_plan, chen, keep_all
from solvers.budget import InfeasibleBudgetError
from solvers.dp import solve_dp
from solvers.envelope import envelope
from solvers.registry import keep_all_peak
from solvers.simulator import simulate
from tests.test_dp import random_chain


def _resized(chain, rng: random.Random):
    """``chain`` with other sizes, as another value of the blocks' inputs would give."""
    other = random_chain(rng, chain.length)
    stages = tuple(
        dataclasses.replace(theirs, name=ours.name)
        for ours, theirs in zip(chain.stages, other.stages, strict=True)
    )
    return dataclasses.replace(other, stages=stages)


@pytest.mark.parametrize("seed", range(60))
def test_every_plan_peaks_at_least_as_high_on_the_envelope(seed) -> None:
    rng = random.Random(seed)
    first = random_chain(rng, rng.randint(2, 7))
    chains = [first, *(_resized(first, rng) for _ in range(rng.randint(1, 3)))]
    bound = envelope(chains)
    budget = keep_all_peak(bound) * 2 // 3
    plans = [keep_all(first), chen(first), checkpoint_every_stage(first)]
    plans += [checkpoint_sequential_plan(first, k) for k in range(1, first.length + 1)]
    for chain in chains:
        with contextlib.suppress(InfeasibleBudgetError):  # no plan fits that chain
            plans.append(solve_dp(chain, budget))
    for plan in plans:
        on_bound = simulate(plan, bound).peak_bytes
        assert all(simulate(plan, chain).peak_bytes <= on_bound for chain in chains)
    assert keep_all_peak(bound) >= max(keep_all_peak(chain) for chain in chains)
    assert bound.stages[0].fwd_s == first.stages[0].fwd_s  # times are the first chain's


def test_the_envelope_of_one_chain_is_that_chain() -> None:
    chain = random_chain(random.Random(0), 5)
    assert envelope([chain]) == chain


def test_chains_of_other_stages_have_no_envelope() -> None:
    rng = random.Random(1)
    with pytest.raises(ValueError, match="other stages"):
        envelope([random_chain(rng, 4), random_chain(rng, 5)])
    first = random_chain(rng, 4)
    renamed = dataclasses.replace(
        first, stages=(dataclasses.replace(first.stages[0], name="other"), *first.stages[1:])
    )
    with pytest.raises(ValueError, match="other stages"):
        envelope([first, renamed])
    with pytest.raises(ValueError, match="at least one"):
        envelope([])
