"""The fixed plans of rotor's persistent family that the DP's answer must not lose to.

``torch.utils.checkpoint.checkpoint_sequential`` at every segment count (Chen, Xu, Zhang,
Guestrin 2016's √L segments and one segment per stage among them) and the least-peak segments
of Hong et al. (JPDC 2025) are recompute-only plans that keep each checkpoint until its
backward: plans of the family of Herrmann, Beaumont et al. (2019), so the exact DP is never
slower than one that fits. The DP on sizes rounded up to slots can be, where the rounding hides
a baseline that fits to the byte, and so can the least-memory plan.
"""

from __future__ import annotations

from solvers.baselines import checkpoint_sequential_plan, min_peak
from solvers.chain import Chain
from solvers.plan import Plan
from solvers.semantics import duration_s, refills
from solvers.simulator import score

MARGIN = 1e-9
"""A baseline replaces the DP's plan only when faster by more than this fraction: summing the
same durations in another order differs in the last bits."""


def family_baselines(chain: Chain) -> list[Plan]:
    """min-peak's plan and ``checkpoint_sequential``'s at every segment count (unscored)."""
    trained = chain.length - chain.frozen_stages
    counts = range(1, trained + 1)
    return [min_peak(chain)] + [checkpoint_sequential_plan(chain, count) for count in counts]


def compute_time_s(plan: Plan, chain: Chain) -> float:
    """The time of a recompute-only plan: one compute stream that never waits, so the sum of
    its operations' durations (what the simulator replays, without its bookkeeping)."""
    refilled = refills(plan.ops)
    return sum(duration_s(op, chain, n in refilled) for n, op in enumerate(plan.ops))


def fastest_fitting(plan: Plan, chain: Chain, budget_bytes: int) -> Plan:
    """``plan`` (scored), or the fastest of :func:`family_baselines` that fits ``budget_bytes``
    where one is faster, as a dp plan whose ``info`` names it and the DP's own time."""
    plan = score(plan, chain, budget_bytes)
    own = plan.predicted_time_s
    assert own is not None
    # Only a baseline faster than the DP's plan needs the simulator, fastest first.
    timed = [(compute_time_s(candidate, chain), candidate) for candidate in family_baselines(chain)]
    faster = sorted(
        (item for item in timed if item[0] < own * (1 - MARGIN)), key=lambda item: item[0]
    )
    for _, candidate in faster:
        scored = score(candidate, chain, budget_bytes)
        if scored.feasible and scored.predicted_time_s < own * (1 - MARGIN):
            info = {**candidate.info, "baseline": candidate.solver, "dp_plan_time_s": own}
            chosen = Plan(candidate.ops, chain.stage_names, "dp", chain_name=chain.name, info=info)
            return score(chosen, chain, budget_bytes)
    return plan
