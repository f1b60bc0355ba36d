"""The fixed plans of rotor's persistent family that the DP's answer must not lose to.

``torch.utils.checkpoint.checkpoint_sequential`` at every segment count (Chen, Xu, Zhang,
Guestrin 2016's √L segments and one segment per stage among them) and the least-peak segments
of Hong et al. (JPDC 2025) are recompute-only plans that keep each checkpoint until its
backward: plans of the family of Herrmann, Beaumont et al. (2019), so the exact DP is never
slower than one that fits. The DP on sizes rounded up to slots can be, where the rounding hides
a baseline that fits to the byte, and so can the least-memory plan.
"""

from __future__ import annotations

import functools

from solvers.baselines import checkpoint_sequential_plan, chen, min_peak
from solvers.chain import Chain
from solvers.frozen import frozen_forward_count
from solvers.plan import Plan
from solvers.simulator import compute_time_s, score

MARGIN = 1e-9
"""A baseline replaces the DP's plan only when faster by more than this fraction: summing the
same durations in another order differs in the last bits."""


def family_baselines(chain: Chain) -> list[Plan]:
    """min-peak's plan, ``checkpoint_sequential``'s at every segment count and, with frozen
    stages, chen's (unscored)."""
    trained = chain.length - chain.frozen_stages
    counts = range(1, trained + 1)
    fixed = [min_peak(chain)] + [checkpoint_sequential_plan(chain, count) for count in counts]
    # chen segments the whole chain, its frozen stages too, where checkpoint_sequential's
    # plans segment the trained part: on a chain without frozen stages it is one of those.
    return [*fixed, chen(chain)] if chain.frozen_stages else fixed


def fastest_fitting(plan: Plan, chain: Chain, budget_bytes: int) -> Plan:
    """``plan`` (scored), or the fastest of :func:`family_baselines` that fits ``budget_bytes``
    where one is faster, as a dp plan whose ``info`` names it and the DP's own time. A plan of
    the DP in exact bytes is the family's fastest already, and is returned as it is, but on a
    chain with frozen stages, whose two plans of the rest (:mod:`solvers.frozen`) can lose to
    a fixed plan of the whole chain; there a baseline runs the frozen forwards no more often
    than the DP's plan, which runs them again only where it must (some cannot be)."""
    plan = score(plan, chain, budget_bytes)
    own = plan.predicted_time_s
    assert own is not None
    if plan.info.get("exact") and not chain.frozen_stages:
        return plan
    reruns = frozen_forward_count(plan, chain)
    best: tuple[float, Plan] | None = None
    for k, (least_s, candidate) in enumerate(_baselines_by_compute_time(chain)):
        # No baseline after this one can be faster than the DP's plan, or than the best so far.
        if least_s >= own * (1 - MARGIN) or (best is not None and least_s >= best[0]):
            break
        time_s, peak_bytes = _simulated(chain, k)
        if (
            time_s < own * (1 - MARGIN)
            and (best is None or time_s < best[0])
            and peak_bytes <= budget_bytes
            and frozen_forward_count(candidate, chain) <= reruns
        ):
            best = (time_s, candidate)
    if best is None:
        return plan
    candidate = best[1]
    info = {**candidate.info, "baseline": candidate.solver, "dp_plan_time_s": own}
    chosen = Plan(candidate.ops, chain.stage_names, "dp", chain_name=chain.name, info=info)
    return score(chosen, chain, budget_bytes)


@functools.lru_cache(maxsize=8)
def _baselines_by_compute_time(chain: Chain) -> tuple[tuple[float, Plan], ...]:
    """Each of :func:`family_baselines` with the sum of its compute ops' durations, the least
    first: no plan takes less time (the compute stream runs one op at a time), and a plan
    that copies nothing takes that. Simulating every baseline took 3.5 s of a 6 s solve at
    100 stages (a trial); most are slower than the DP's plan, and are not simulated."""
    timed = [(compute_time_s(candidate, chain), candidate) for candidate in family_baselines(chain)]
    return tuple(sorted(timed, key=lambda item: item[0]))


@functools.lru_cache(maxsize=256)
def _simulated(chain: Chain, k: int) -> tuple[float, int]:
    """The simulated time and peak of the ``k``-th of :func:`_baselines_by_compute_time`: they
    do not depend on the budget, and a sweep or the MILP's warm starts solve many budgets of
    one chain."""
    scored = score(_baselines_by_compute_time(chain)[k][1], chain, None)
    assert scored.predicted_time_s is not None and scored.predicted_peak_bytes is not None
    return scored.predicted_time_s, scored.predicted_peak_bytes
