"""The MILP's warm starts and its least budget with offloading.

The search starts from the best of rotor's DP (also with a finer memory grid, where that is
quick), the baselines, a quick offloaded-prefix plan and rotor's DP with a checkpoint on the
host (:mod:`solvers.host_split`), the fastest one's time being the MILP's cut-off; just above
rotor's least memory the DP with finer slots or the least-memory plan, and below it the
least-memory MILP, supply the start.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time

from solvers.baselines import BASELINES
from solvers.bounds import necessary_budget_bytes
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.dp import (
    WARN_SECONDS,
    estimated_seconds,
    memory_need,
    solve_dp,
    table_bytes,
)
from solvers.host_split import SEVERAL_HOSTED, host_split_plans
from solvers.milp_codec import NotInFamilyError, Schedule, decode, encode
from solvers.milp_model import JointModel

# Raised by solve_milp: importable from here.
from solvers.milp_search import BackendUnavailableError as BackendUnavailableError
from solvers.milp_search import (
    search_cbc,
    search_highs,
)
from solvers.plan import (
    BACKWARD,
    SAVED,
    Op,
    Plan,
    backward,
    forward_all,
    forward_checkpoint,
    offload,
    prefetch,
)
from solvers.simulator import least_fitting_budget, score

logger = logging.getLogger(__name__)

# The offloaded-prefix warm start: a coarse DP grid, reserves in units of the largest saved
# set, and how many backwards ahead a prefetch is issued.
_PREFIX_SLOTS = 200
_PREFIX_SHARE = 0.2
_PREFIX_RESERVES = 5
_PREFIX_LEADS = (1, 2, 3)
# The DP on a grid this much finer is a warm start too, where its estimated time is at most
# this share of the time left: rounding sizes up to 500 slots costs rotor's DP up to 0.9% of
# step time on the ResNet and Llama chains of experiments/ilp_vs_dp.py, which the MILP's
# search did not always win back (ResNet-152 at 20% and 25%, ResNet-200 at 20%).
FINER_WARM_FACTOR = 4
FINER_WARM_SHARE = 0.05
FINER_WARM_TABLE_BYTES = 2**30


HOST_SPLIT_SHARE = 0.25
"""The share of the time left for :func:`solvers.host_split.host_split_plans` (ResNet-50 at 30%
of keep-all: 31.99 ms in 0.9 s, against rotor's 32.32 ms, which the MILP kept for 600 s;
ResNet-101 at 30% and 35%: 59.06 and 57.88 ms with several hosted checkpoints in 4-7 s on one
core, where 10% of the time left cut it short)."""

EXACT_MARGIN = 1e-9
"""The exact DP's plan joins the warm starts only when faster by more than this fraction: the
same durations summed in another order differ in their last bits."""


def warm_start_candidates(
    chain: Chain,
    budget_bytes: int,
    slots: int,
    offload: bool,
    deadline: float,
    with_prefix: bool = True,
) -> list[tuple[str, Plan]]:
    """Rotor's DP (on a finer grid too, where quick), every baseline and (``with_prefix``) the
    offloaded-prefix and host-split plans that fit, fastest first."""
    found: list[tuple[str, Plan]] = []
    with contextlib.suppress(InfeasibleBudgetError):
        found.append(("dp", solve_dp(chain, budget_bytes, slots, exact=False)))
    finer = slots * FINER_WARM_FACTOR
    # Quick, small and below the DP's own warning, or not at all: it is only a warm start.
    seconds = min(FINER_WARM_SHARE * (deadline - time.monotonic()), WARN_SECONDS)
    quick = estimated_seconds(chain.length, finer) <= seconds
    if found and quick and table_bytes(chain.length, finer) <= FINER_WARM_TABLE_BYTES:
        with contextlib.suppress(InfeasibleBudgetError, ValueError):
            plan = solve_dp(chain, budget_bytes, finer, exact=False)
            found.append((f"dp ({finer} slots)", plan))
    # The DP in exact bytes, only where strictly faster: a tie keeps the table's plan, from
    # which the search went further (ResNet-101 at 30%: 59.74 ms, against the exact plan's
    # 60.21 ms, the same time as the table's, kept to the end).
    if found:
        exact = solve_dp(chain, budget_bytes, slots)
        best = min(plan.predicted_time_s for _, plan in found)
        if exact.predicted_time_s < best * (1 - EXACT_MARGIN):
            found.append(("dp (exact bytes)", exact))
    for name, build in BASELINES.items():
        if name == "offload-all" and not offload:
            continue
        scored = score(build(chain), chain, budget_bytes)
        if scored.feasible:
            found.append((name, scored))
    if offload and with_prefix:
        prefix = _offloaded_prefix_plan(chain, budget_bytes, slots, deadline)
        if prefix is not None:
            found.append(("offloaded prefix + dp", prefix))
        # Not on a long chain either, whose group MILP needs the time (ResNet-200 at 25%:
        # 116.1 ms with it, 115.2 ms without).
        stop = time.monotonic() + HOST_SPLIT_SHARE * (deadline - time.monotonic())
        found += host_split_plans(chain, budget_bytes, stop)
    found.sort(key=lambda item: item[1].predicted_time_s)
    return found


def _offloaded_prefix_plan(
    chain: Chain, budget_bytes: int, slots: int, deadline: float
) -> Plan | None:
    """A quick joint plan to start from: offload the saved sets of stages 1..m-1, keep a_m as
    a checkpoint, run rotor's DP on stages m+1..L with ``reserve`` bytes set aside for the
    copies in flight, and prefetch each x̄_i ``lead`` backwards before B(i+1) reads it.

    The best (m, reserve, lead) by simulated time: every few m first, then the others nearest
    the best first, until a fifth of the time left is spent; None if none fits. Early stages
    go first because the first pass starts with an empty GPU, where the device-to-host
    backlog costs least.
    """
    length = chain.length
    stop = time.monotonic() + _PREFIX_SHARE * (deadline - time.monotonic())
    largest = max(s.saved_bytes for s in chain.stages)
    coarse = min(slots, _PREFIX_SLOTS)
    splits = list(range(2, length - 1))
    stride = max(1, len(splits) // 8)
    first_round = splits[::stride]
    best: Plan | None = None
    best_split = first_round[0] if first_round else 0
    for round_splits in (first_round, None):
        if round_splits is None:
            round_splits = sorted(
                (m for m in splits if m not in first_round), key=lambda m: abs(m - best_split)
            )
        for split in round_splits:
            suffix = Chain(
                chain.name,
                chain.activation_bytes(split),
                chain.stages[split:],
                chain.link,
                input_grad_bytes=chain.grad_bytes(split),
                held_bytes=chain.held_bytes,
            )
            for reserve in range(_PREFIX_RESERVES):
                if time.monotonic() > stop:
                    return best
                try:
                    room = budget_bytes - reserve * largest
                    rest = solve_dp(suffix, room, coarse, exact=False)
                except InfeasibleBudgetError:
                    continue
                for lead in _PREFIX_LEADS:
                    plan = scored_plan(_prefix_ops(split, rest, lead, length), chain, budget_bytes)
                    if plan.feasible and (
                        best is None or plan.predicted_time_s < best.predicted_time_s
                    ):
                        best, best_split = plan, split
    return best


def _prefix_ops(split: int, rest: Plan, lead: int, length: int) -> list[Op]:
    ops: list[Op] = []
    for i in range(1, split):
        ops.append(forward_all(i))
        if i >= 2:
            ops.append(offload(SAVED, i - 1))
    ops.append(forward_checkpoint(split))
    if split >= 2:
        ops.append(offload(SAVED, split - 1))
    ops += [Op(op.kind, op.index + split, op.target) for op in rest.ops]
    ops += [forward_all(split), backward(split)]
    ops += [backward(i) for i in range(split - 1, 0, -1)]
    issue_after: dict[int, list[int]] = {}
    for i in range(1, split):
        issue_after.setdefault(min(length, i + 1 + lead), []).append(i)
    result: list[Op] = []
    for op in ops:
        result.append(op)
        if op.kind == BACKWARD:
            result += [
                prefetch(SAVED, i) for i in sorted(issue_after.get(op.index, ()), reverse=True)
            ]
    return result


def first_in_family(
    candidates: list[tuple[str, Plan]], length: int
) -> tuple[Schedule | None, str | None, float | None]:
    """The fastest candidate the MILP can express, to be its starting solution, with its time
    (or, when none can be expressed, the fastest candidate's time). A plan with several
    hosted checkpoints starts it only where no other can: it stays a candidate, but HiGHS's
    30 s search went further from the plan with one (ResNet-101 at 25% of keep-all: 60.73 ms
    from one's 61.63 ms; from several's 61.17 ms, nothing faster)."""
    starts = sorted(candidates, key=lambda item: item[0] == SEVERAL_HOSTED)
    for name, plan in starts:
        try:
            return encode(plan.ops, length), name, plan.predicted_time_s
        except NotInFamilyError as error:
            logger.debug("warm start %s is outside the MILP's family: %s", name, error)
    return None, None, candidates[0][1].predicted_time_s if candidates else None


def tight_budget_candidates(
    chain: Chain, budget_bytes: int, offload: bool, backend: str, deadline: float
) -> list[tuple[str, Plan]]:
    """A plan for a budget below rotor's least memory, where the DP has none: only
    offloading can fit there, and the least-memory MILP says whether it does. Raises
    :class:`InfeasibleBudgetError` when nothing fits."""
    least, schedule = memory_need(chain), None
    if offload:
        least, schedule = least_budget_with_offloading(
            chain, backend, deadline, wanted=budget_bytes
        )
    if schedule is None or least > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, fitting_budget(chain, least, schedule), "milp")
    plan = scored_plan(decode(schedule), chain, budget_bytes)
    if not plan.feasible:  # the model's least sat a few bytes under the plan's peak
        raise InfeasibleBudgetError(budget_bytes, fitting_budget(chain, least, schedule), "milp")
    return [("least-memory milp", plan)]


def scored_plan(ops: list, chain: Chain, budget_bytes: int | None) -> Plan:
    """``ops`` as a MILP plan of ``chain``, scored at ``budget_bytes``."""
    plan = Plan(
        ops=tuple(ops),
        stage_names=tuple(s.name for s in chain.stages),
        solver="milp",
        chain_name=chain.name,
    )
    return score(plan, chain, budget_bytes)


def least_budget_with_offloading(
    chain: Chain, backend: str, deadline: float, wanted: int | None = None
) -> tuple[int, Schedule | None]:
    """The least budget with offloading: the MILP with the budget as its objective, and the
    schedule that reaches it (None and rotor's exact least memory if it finds nothing lower).

    A least budget is named only where the same search will reach it again: proven optimal,
    or, when a plan within ``wanted`` bytes is all that is asked, any schedule within them. A
    lower peak found before the time limit cut the search short depends on how far the search
    got, so it is logged, and rotor's exact least memory (which the least-memory plan always
    reaches) is named instead.
    """
    recompute_least = memory_need(chain)
    model = JointModel(chain, None, offload=True)
    search = (search_highs if backend == "highs" else search_cbc)(model, None, None, deadline)
    least = model.least_budget_bytes() if search.schedule is not None else None
    if least is None or math.ceil(least - 1e-6) >= recompute_least:
        return recompute_least, None
    reachable = wanted is not None and math.ceil(least - 1e-6) <= wanted
    if search.status != "optimal" and not reachable:
        logger.info(
            "the least-memory milp found a plan with offloading in %d B before its time limit, "
            "without proving it least; a longer time limit may name it",
            math.ceil(least - 1e-6),
        )
        return recompute_least, None
    # Floats, not the model, can land a hair under the true peak: take the next byte up.
    return max(math.ceil(least - 1e-6), necessary_budget_bytes(chain)), search.schedule


def fitting_budget(chain: Chain, least: int, schedule: Schedule | None) -> int:
    """A budget at which a plan surely exists, given the least-memory MILP's ``least`` and
    ``schedule``: the least at which the schedule fits in the simulator, which can sit above
    the model's by HiGHS's feasibility tolerance or where the simulator times its copies
    otherwise, and never above rotor's exact least memory (the least-memory plan's)."""
    if schedule is None:
        return least
    plan = scored_plan(decode(schedule), chain, None)
    return min(least_fitting_budget(plan, chain, above=least - 1), memory_need(chain))
