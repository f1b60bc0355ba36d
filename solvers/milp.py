"""Solve the joint keep / offload / recompute MILP and return its plan, scored by the simulator.

The formulation (:mod:`solvers.milp_model`, ``docs/milp.md``) follows Checkmate (Jain et al.
2020) on rotor's persistent model (Herrmann, Beaumont et al. 2019) with POFO's copy channels
(Beaumont, Eyraud-Dubois, Shilova 2021). The search warm-starts from the best of rotor's DP,
the baselines and a quick offloaded-prefix plan, and never returns a plan slower than that
warm start. On a long chain (40 stages or more) it first solves the MILP of a few dozen groups
of consecutive stages (:mod:`solvers.coarsen`) and expands its plan, a two-level
decomposition: the coarse MILP decides where the memory goes, and the fine model, when it can
be built in time, improves that plan window by window (a large neighbourhood search whose every
step is the same MILP with the decisions outside the window fixed), widening the windows up to
the whole model. It stops as soon as a plan meets the lower bound of
:func:`solvers.milp_bound.whole_tensor_bound_s`.
"""

from __future__ import annotations

import logging
import math
import time
from dataclasses import replace
from typing import Any

from solvers.bounds import MEETS_BOUND, lower_bound_s
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.chain_limits import ChainFormatError
from solvers.coarsen import balanced_groups, coarsen, expand
from solvers.dp import DEFAULT_SLOTS, memory_need
from solvers.frozen import least_budget, with_frozen_prefix
from solvers.milp_bound import whole_tensor_bound_s
from solvers.milp_codec import decode
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
from solvers.milp_warm import (
    first_in_family,
    fitting_budget,
    least_budget_with_offloading,
    scored_plan,
    tight_budget_candidates,
    warm_start_candidates,
)
from solvers.plan import Plan, relative_gap
from solvers.simulator import score

FAMILY_OPTIMAL = "optimal in its family"
OVER_BUDGET = "its own plan passes the budget by the simulator: a warm start returned"
"""The status where the search's plan does not fit by the simulator (a review found 4 in about
1,100 random chains: its model leaves out a temporary the simulator counts)."""
logger = logging.getLogger(__name__)


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

    Its status "optimal in its family" and its ``best_bound`` hold for the MILP's family of
    plans (``docs/milp.md``); "optimal (meets the lower bound)" holds for every plan.
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

    # A long chain's offloaded prefix is searched on its groups, in a fraction of the time.
    long_chain = chain.length >= COARSE_FROM
    candidates = warm_start_candidates(
        chain, budget_bytes, slots, offload, deadline, with_prefix=not long_chain
    )
    if not candidates:
        candidates = tight_budget_candidates(chain, budget_bytes, offload, backend, deadline)
    # A bound valid for every plan: whole-tensor lower_bound_s. A plan meeting it ends the
    # search; in the model it tightens the relaxation.
    floor = whole_tensor_bound_s(
        chain, budget_bytes, offload, time_limit_s=min(1.0, 0.05 * time_limit_s)
    )
    if long_chain and not _meets([c for c in candidates if c[1].feasible], floor):
        coarse = coarse_candidate(chain, budget_bytes, offload, backend, slots, deadline)
        if coarse is not None:
            candidates = sorted([*candidates, coarse], key=lambda item: item[1].predicted_time_s)
    fitting = [item for item in candidates if item[1].feasible]
    fallback_name, fallback_plan = fitting[0] if fitting else (None, None)
    if _meets(fitting, floor):
        # No plan is faster than the bound: searching on would only spend the time limit.
        best = fitting[0]
        met = MEETS_BOUND
        return _unsearched(chain, budget_bytes, best, met, started, backend, offload, floor)
    if candidates and time.monotonic() + estimated_build_s(chain.length) > deadline:
        # Building the model alone would overrun the limit: the best warm start is the answer.
        # Past COARSE_FROM stages this is the designed path: the plan of the groups answers.
        logger.log(
            logging.INFO if chain.length >= COARSE_FROM else logging.WARNING,
            "the milp model for %d stages takes about %.1f s to build, more than the %.1f s "
            "left of its %.1f s time limit after the warm starts: returning the best warm "
            "start (%s); raise its time limit",
            chain.length,
            estimated_build_s(chain.length),
            max(deadline - time.monotonic(), 0.0),
            time_limit_s,
            candidates[0][0],
        )
        unbuilt = "time limit (model not built)"
        result = _unsearched(
            chain, budget_bytes, candidates[0], unbuilt, started, backend, offload, floor
        )
        report(result.predicted_time_s, None, force=True)
        return result
    warm_schedule, warm_name, warm_time = first_in_family(candidates, chain.length)
    cap = None if warm_time is None else warm_time * (1 + 1e-6)
    model = JointModel(chain, budget_bytes, offload, time_cap_s=cap)
    report(warm_time, floor, force=True)
    relaxation_floor = lower_bound_s(chain, budget_bytes)
    if math.isfinite(relaxation_floor):
        model.problem += (
            model.makespan >= relaxation_floor / model.time_unit * (1 - 1e-9),
            "lower_bound",
        )
    if backend == "highs":
        search = search_highs(model, warm_schedule, gap, deadline, report, floor_s=floor)
    else:
        search = search_cbc(model, warm_schedule, gap, deadline)

    # A warm start that does not fit (the least-memory MILP's schedule, simulated) is no plan.
    usable = fallback_plan is not None and fallback_plan.feasible
    plan, fallback, own_time = (fallback_plan if usable else None), True, None
    over_budget = False  # the search's own plan, by the simulator, whose model it fails
    if search.schedule is not None:
        own = scored_plan(decode(search.schedule), chain, budget_bytes)
        own_time = own.predicted_time_s
        over_budget = not own.feasible
        if own.feasible and (
            fallback_plan is None
            or own.predicted_time_s < fallback_plan.predicted_time_s * (1 - 1e-9)
        ):
            plan, fallback = own, False
    if plan is None and budget_bytes < memory_need(chain):
        # Below rotor's least memory only the least-memory MILP's schedule was a candidate.
        least, schedule = least_budget_with_offloading(chain, backend, deadline)
        raise InfeasibleBudgetError(budget_bytes, fitting_budget(chain, least, schedule), "milp")
    # From rotor's exact least memory the DP's warm start fits (solvers.dp._near_least_memory).
    assert plan is not None
    objective = search.objective_s
    # Where the simulator puts the search's plan over the budget, the model it solved is not
    # the simulator's, and its dual bound and optimality hold for neither: the floor alone.
    searched = -math.inf if search.bound_s is None or over_budget else search.bound_s
    bound = max(searched, floor)
    # The last state shown is the plan returned: a warm start where it beat the search.
    report(plan.predicted_time_s, bound, force=True)
    # The gap of the plan returned, which the last state shown has too.
    gap_found = relative_gap(plan.predicted_time_s, bound) if math.isfinite(bound) else None
    size = model.size
    # HiGHS proves its plan optimal among the MILP's family of plans (docs/milp.md), and its
    # dual bound holds for that family: a plan outside it (a non-persistent one, as DTR's can
    # be) may be faster. lower_bound_s, the floor, holds for every plan.
    status = FAMILY_OPTIMAL if search.status == "optimal" else search.status
    if over_budget:
        status = OVER_BUDGET
    info: dict[str, Any] = {
        "solver_status": status,
        "objective": objective,
        "milp_plan_time_s": own_time,
        "best_bound": bound if bound is not None and math.isfinite(bound) else None,
        "gap": gap_found,
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


COARSE_FROM = 40
"""From this many stages on, the search starts with the MILP of groups of stages."""
COARSE_STAGES = 24
"""How many groups: a model the MILP searches well in a few seconds on two cores."""
COARSE_SHARE = 0.5
"""The share of the time left that the group MILP gets when the whole model is searched too."""


def coarse_candidate(
    chain: Chain, budget_bytes: int, offload: bool, backend: str, slots: int, deadline: float
) -> tuple[str, Plan] | None:
    """The MILP's plan of :data:`COARSE_STAGES` groups of consecutive stages
    (:mod:`solvers.coarsen`), expanded to the chain and scored; None if it does not fit.

    It takes the whole time left when building the chain's own model would take more than a
    quarter of it: on two cores, its window search then finds less in the rest than the group
    MILP in all of it (Llama-7B chains of 64 to 200 stages).
    """
    remaining = deadline - time.monotonic()
    whole = estimated_build_s(chain.length) > remaining / 4
    share = remaining if whole else COARSE_SHARE * remaining
    groups = balanced_groups(chain, COARSE_STAGES)
    try:
        coarse = coarsen(chain, groups)
    except ChainFormatError as error:
        # A group counts some bytes twice (the held output in its backward's temporaries), so
        # a chain near the size limit can pass it as groups: the other candidates stand.
        logger.info("no milp on groups: %s", error)
        return None
    try:
        plan = solve_milp(
            coarse,
            budget_bytes,
            offload=offload,
            time_limit_s=max(share, 1.0),
            backend=backend,
            slots=slots,
        )
    except InfeasibleBudgetError:
        return None
    expanded = scored_plan(list(expand(plan, chain, groups).ops), chain, budget_bytes)
    if not expanded.feasible:
        # Prefetches admitted ahead of the group's later backwards can crowd them out.
        late = expand(plan, chain, groups, prefetch_late=True)
        expanded = scored_plan(list(late.ops), chain, budget_bytes)
    logger.info(
        "milp on %d groups: %.4g s in %.1f s (%s)",
        len(groups),
        expanded.predicted_time_s,
        plan.info["solve_time_s"],
        plan.info["solver_status"],
    )
    return (f"milp on {len(groups)} groups", expanded) if expanded.feasible else None


def _meets(candidates: list[tuple[str, Plan]], floor_s: float) -> bool:
    """Whether the best candidate is as fast as the lower bound allows."""
    return bool(candidates) and candidates[0][1].predicted_time_s <= floor_s * (1 + 1e-9)


def _unsearched(
    chain: Chain,
    budget_bytes: int,
    candidate: tuple[str, Plan],
    status: str,
    started: float,
    backend: str,
    offload: bool,
    floor_s: float,
) -> Plan:
    """A warm start returned as the milp's answer without a search, with its reason."""
    name, plan = candidate
    proven = status.startswith("optimal")
    info = {
        "solver_status": status,
        "objective": plan.predicted_time_s if proven else None,
        "best_bound": floor_s if proven else None,
        "gap": 0.0 if proven else None,
        "solve_time_s": time.monotonic() - started,
        "backend": backend,
        "warm_start": name,
        "fallback": True,
        "fallback_plan": name,
        "offload": offload,
        "model": None,
    }
    result = Plan(plan.ops, plan.stage_names, "milp", chain_name=chain.name, info=info)
    return score(result, chain, budget_bytes)


BUILD_S_PER_STAGE_SQUARED = 2e-3
"""Model building and loading time per squared stage count, measured on a 2-core machine
(200 stages: 51 s to build, 21 s to load into HiGHS); a conservative estimate elsewhere."""


def solve_checkmate(chain: Chain, budget_bytes: int, **options: Any) -> Plan:
    """Checkmate's problem (Jain et al. 2020) on a chain: :func:`solve_milp` with
    recomputation only, named as the literature names it (``options`` as for it, less
    ``offload``)."""
    try:
        plan = solve_milp(chain, budget_bytes, offload=False, **options)
    except InfeasibleBudgetError as error:
        raise InfeasibleBudgetError(budget_bytes, error.min_budget_bytes, "checkmate") from None
    return replace(plan, solver="checkmate")


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
    least, schedule = least_budget_with_offloading(chain, backend, time.monotonic() + time_limit_s)
    return fitting_budget(chain, least, schedule)
