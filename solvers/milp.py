"""Solve the joint keep / offload / recompute MILP and return its plan, scored by the simulator.

The formulation (:mod:`solvers.milp_model`, ``docs/milp.md``) follows Checkmate (Jain et al.
2020) on rotor's persistent model (Herrmann, Beaumont et al. 2019) with POFO's copy channels
(Beaumont, Eyraud-Dubois, Shilova 2021). The search warm-starts from the best of rotor's DP,
the baselines and a quick offloaded-prefix plan, and never returns a plan slower than that
warm start: on a chain too long to solve whole within the time limit, it improves the warm
start window by window (a large neighbourhood search whose every step is the same MILP with
the decisions outside the window fixed), widening the windows up to the whole model.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from typing import Any

from solvers.baselines import BASELINES
from solvers.bounds import lower_bound_s, necessary_budget_bytes
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.dp import DEFAULT_SLOTS, least_memory_plan, memory_need, solve_dp
from solvers.dp import min_feasible_budget as dp_min_feasible_budget
from solvers.frozen import least_budget, with_frozen_prefix
from solvers.milp_codec import NotInFamilyError, Schedule, decode, encode
from solvers.milp_model import JointModel
from solvers.milp_progress import ProgressCallback, ProgressReport
from solvers.milp_search import (
    BACKENDS,
    require_backend,
    search_cbc,
    search_highs,
)

# Raised by solve_milp: importable from here.
from solvers.milp_search import BackendUnavailableError as BackendUnavailableError
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
from solvers.simulator import score

logger = logging.getLogger(__name__)

# The offloaded-prefix warm start: a coarse DP grid, reserves in units of the largest saved
# set, and how many backwards ahead a prefetch is issued.
_PREFIX_SLOTS = 200
_PREFIX_SHARE = 0.2
_PREFIX_RESERVES = 5
_PREFIX_LEADS = (1, 2, 3)
# How much finer than asked the DP's memory grid gets when the budget is just above rotor's
# least memory.
_FINER_SLOTS = (10, 100)


def solve_milp(
    chain: Chain,
    budget_bytes: int,
    *,
    offload: bool = True,
    time_limit_s: float = 30.0,
    gap: float | None = None,
    backend: str = "highs",
    slots: int = DEFAULT_SLOTS,
    progress: ProgressCallback | None = None,
) -> Plan:
    """The joint plan of the time-indexed MILP, never slower than rotor's DP at this budget.

    ``time_limit_s`` bounds the search, model building included: where building alone would
    take longer (:func:`estimated_build_s`), the best warm start is returned with status
    "time limit (model not built)". The warm starts (rotor's DP) come first and are not cut
    short, so the call may exceed the limit by their time. ``gap`` is the relative
    MIP gap at which to stop, ``slots`` the DP's discretization for the warm start. The plan's
    ``info`` reports ``solver_status``, ``objective``, ``best_bound``, ``gap``,
    ``solve_time_s``, ``backend``, ``warm_start`` and ``fallback``. ``progress``, if given, is
    called with a :class:`~solvers.milp_progress.SearchProgress` a few times a second while the
    search runs. Raises
    :class:`InfeasibleBudgetError` when nothing fits and :class:`BackendUnavailableError` when
    the backend is not installed.
    """
    started = time.monotonic()
    deadline = started + time_limit_s
    report = ProgressReport(progress, started)
    if backend not in BACKENDS:
        raise ValueError(f"unknown MILP backend {backend!r}; choose one of {', '.join(BACKENDS)}")
    if time_limit_s <= 0:
        raise ValueError(f"time_limit_s must be positive, got {time_limit_s}")
    if gap is not None and not 0 <= gap < 1:
        raise ValueError(f"gap must be in [0, 1), got {gap}")
    require_backend(backend)
    if chain.frozen_stages:
        plan = with_frozen_prefix(
            chain,
            budget_bytes,
            lambda part, room: solve_milp(
                part,
                room,
                offload=offload,
                time_limit_s=max(deadline - time.monotonic(), 0.1),
                gap=gap,
                backend=backend,
                slots=slots,
                progress=progress,
            ),
        )
        return score(plan, chain, budget_bytes)
    if offload and chain.link is None:
        logger.warning(
            "chain %r has no link, so nothing can be offloaded: solving with recomputation "
            "only (give a link: --bandwidth 25GB/s, or bandwidth= in the API)",
            chain.name,
        )
        offload = False

    candidates = _warm_start_candidates(chain, budget_bytes, slots, offload, deadline)
    if not candidates:
        candidates = _tight_budget_candidates(
            chain, budget_bytes, slots, offload, backend, deadline
        )
    fallback_name, fallback_plan = candidates[0] if candidates else (None, None)
    if candidates and time.monotonic() + estimated_build_s(chain.length) > deadline:
        # Building the model alone would overrun the limit: the best warm start is the answer.
        name, best = candidates[0]
        logger.warning(
            "the milp model for %d stages takes about %.0f s to build, past the %.0f s time "
            "limit: returning the best warm start (%s); raise time_limit_s for the milp",
            chain.length,
            estimated_build_s(chain.length),
            time_limit_s,
            name,
        )
        info = {
            "solver_status": "time limit (model not built)",
            "objective": None,
            "best_bound": None,
            "gap": None,
            "solve_time_s": time.monotonic() - started,
            "backend": backend,
            "warm_start": name,
            "fallback": True,
            "fallback_plan": name,
            "offload": offload,
            "model": None,
        }
        result = score(
            Plan(best.ops, best.stage_names, "milp", chain_name=chain.name, info=info),
            chain,
            budget_bytes,
        )
        report(result.predicted_time_s, None, force=True)
        return result
    warm_schedule, warm_name, warm_time = _first_in_family(candidates, chain.length)
    cap = None if warm_time is None else warm_time * (1 + 1e-6)
    model = JointModel(chain, budget_bytes, offload, time_cap_s=cap)
    # A bound valid for every plan (solvers.bounds.lower_bound_s) tightens the relaxation.
    floor = lower_bound_s(chain, budget_bytes)
    report(warm_time, floor, force=True)
    if math.isfinite(floor):
        model.problem += model.makespan >= floor / model.time_unit * (1 - 1e-9), "lower_bound"
    if backend == "highs":
        search = search_highs(model, warm_schedule, gap, deadline, report)
    else:
        search = search_cbc(model, warm_schedule, gap, deadline)
    report(search.objective_s, search.bound_s, force=True)

    plan, fallback, own_time = fallback_plan, True, None
    if search.schedule is not None:
        own = _plan(decode(search.schedule), chain, budget_bytes)
        own_time = own.predicted_time_s
        if own.feasible and (
            fallback_plan is None
            or own.predicted_time_s < fallback_plan.predicted_time_s * (1 - 1e-9)
        ):
            plan, fallback = own, False
    if plan is None:
        # Rotor's exact least memory is below the budget, yet neither the DP with finer slots
        # nor the MILP within its time found a plan: name the budget the finer DP needs.
        finer = dp_min_feasible_budget(chain, slots * _FINER_SLOTS[-1])
        raise InfeasibleBudgetError(budget_bytes, finer, "milp")
    objective = search.objective_s
    bound = max(search.bound_s if search.bound_s is not None else -math.inf, floor)
    if objective is not None and bound is not None and math.isfinite(bound):
        relative_gap = max(0.0, (objective - bound) / objective) if objective > 0 else 0.0
    else:
        relative_gap = None
    size = model.size
    info: dict[str, Any] = {
        "solver_status": search.status,
        "objective": objective,
        "milp_plan_time_s": own_time,
        "best_bound": bound if bound is not None and math.isfinite(bound) else None,
        "gap": relative_gap,
        "solve_time_s": time.monotonic() - started,
        "backend": backend,
        "warm_start": warm_name,
        "fallback": fallback,
        "fallback_plan": fallback_name,
        "offload": offload,
        "model": {
            "binaries": size.binaries,
            "continuous": size.continuous,
            "constraints": size.constraints,
            "nonzeros": size.nonzeros,
        },
    }
    result = Plan(
        ops=plan.ops,
        stage_names=plan.stage_names,
        solver="milp",
        chain_name=chain.name,
        info=info,
    )
    return score(result, chain, budget_bytes)


BUILD_S_PER_STAGE_SQUARED = 2e-3
"""Model building and loading time per squared stage count, measured on a 2-core machine
(200 stages: 51 s to build, 21 s to load into HiGHS); a conservative estimate elsewhere."""


def estimated_build_s(length: int) -> float:
    """About how long building the MILP for ``length`` stages and loading it takes."""
    return BUILD_S_PER_STAGE_SQUARED * length**2


def least_feasible_budget(
    chain: Chain, *, offload: bool = True, time_limit_s: float = 30.0, backend: str = "highs"
) -> int:
    """The least budget at which :func:`solve_milp` finds a plan.

    Without offloading it is rotor's exact least memory (:func:`solvers.dp.memory_need`, no
    rounding). With offloading it is the optimum of the MILP with the budget as the objective,
    or the best value found within ``time_limit_s`` (never above the recompute-only one).
    """
    require_backend(backend)
    if chain.frozen_stages:
        return least_budget(
            chain,
            lambda part: least_feasible_budget(
                part, offload=offload, time_limit_s=time_limit_s, backend=backend
            ),
        )
    if not offload or chain.link is None:
        return memory_need(chain)
    least, _ = _least_budget(chain, backend, time.monotonic() + time_limit_s)
    return least


# ---------------------------------------------------------------------- warm starts
def _warm_start_candidates(
    chain: Chain, budget_bytes: int, slots: int, offload: bool, deadline: float
) -> list[tuple[str, Plan]]:
    """Rotor's DP, every baseline and the offloaded-prefix plans that fit, fastest first."""
    found: list[tuple[str, Plan]] = []
    with contextlib.suppress(InfeasibleBudgetError):
        found.append(("dp", solve_dp(chain, budget_bytes, slots)))
    for name, build in BASELINES.items():
        if name == "offload-all" and not offload:
            continue
        scored = score(build(chain), chain, budget_bytes)
        if scored.feasible:
            found.append((name, scored))
    if offload:
        prefix = _offloaded_prefix_plan(chain, budget_bytes, slots, deadline)
        if prefix is not None:
            found.append(("offloaded prefix + dp", prefix))
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
                    rest = solve_dp(suffix, budget_bytes - reserve * largest, coarse)
                except InfeasibleBudgetError:
                    continue
                for lead in _PREFIX_LEADS:
                    plan = _plan(_prefix_ops(split, rest, lead, length), chain, budget_bytes)
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


def _first_in_family(
    candidates: list[tuple[str, Plan]], length: int
) -> tuple[Schedule | None, str | None, float | None]:
    """The fastest candidate the MILP can express, to be its starting solution, with its time
    (or, when none can be expressed, the fastest candidate's time)."""
    for name, plan in candidates:
        try:
            return encode(plan.ops, length), name, plan.predicted_time_s
        except NotInFamilyError as error:
            logger.debug("warm start %s is outside the MILP's family: %s", name, error)
    return None, None, candidates[0][1].predicted_time_s if candidates else None


def _tight_budget_candidates(
    chain: Chain, budget_bytes: int, slots: int, offload: bool, backend: str, deadline: float
) -> list[tuple[str, Plan]]:
    """A plan for a budget below what the DP finds at ``slots`` and the baselines need.

    Between rotor's exact least memory and the DP's rounded one, the DP with finer slots
    usually finds a plan, and the least-memory plan always does; below it only offloading can,
    and the least-memory MILP says whether it does. Raises :class:`InfeasibleBudgetError`
    when nothing fits.
    """
    recompute_least = memory_need(chain)
    if budget_bytes >= recompute_least:
        for factor in _FINER_SLOTS:
            try:
                finer = slots * factor
                return [(f"dp ({finer} slots)", solve_dp(chain, budget_bytes, finer))]
            except InfeasibleBudgetError:
                continue
        return [("least-memory plan", _plan(least_memory_plan(chain).ops, chain, budget_bytes))]
    least, schedule = recompute_least, None
    if offload:
        least, schedule = _least_budget(chain, backend, deadline, wanted=budget_bytes)
    if schedule is None or least > budget_bytes:
        raise InfeasibleBudgetError(budget_bytes, least, "milp")
    return [("least-memory milp", _plan(decode(schedule), chain, budget_bytes))]


def _plan(ops: list, chain: Chain, budget_bytes: int) -> Plan:
    plan = Plan(
        ops=tuple(ops),
        stage_names=tuple(s.name for s in chain.stages),
        solver="milp",
        chain_name=chain.name,
    )
    return score(plan, chain, budget_bytes)


def _least_budget(
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
