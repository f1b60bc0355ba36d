"""Every solver by name, scored the same way; the lower bound overheads are read against is
:func:`solvers.bounds.lower_bound_s` (re-exported here).

The solvers are rotor's recompute DP (Herrmann, Beaumont et al. 2019), the joint keep /
offload / recompute MILP, Checkmate's recompute-only MILP (Jain et al. 2020) under its own
name, DTR's online eviction (Kirisame et al. 2021, :mod:`solvers.dtr`) and the fixed plans of
:mod:`solvers.baselines`. Whatever the solver,
the figures on the returned plan come from :func:`solvers.simulator.simulate`.
"""

from __future__ import annotations

import importlib
import logging
import math
import threading
from collections.abc import Callable
from typing import Any

from solvers.baselines import BASELINES, keep_all
from solvers.bounds import lower_bound_s as lower_bound_s
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.dp import memory_need
from solvers.dtr import dtr_least_budget
from solvers.plan import Plan
from solvers.simulator import least_fitting_budget, score, simulate

logger = logging.getLogger(__name__)

SOLVERS = (
    "keep-all",
    "chen",
    "checkpoint-every-stage",
    "offload-all",
    "min-peak",
    "dtr",
    "dp",
    "checkmate",
    "milp",
)

# The keyword options each solver takes; an option passed as None counts as not passed.
SOLVER_OPTIONS: dict[str, frozenset[str]] = {
    **{name: frozenset() for name in BASELINES},
    "dtr": frozenset(),
    "dp": frozenset({"slots", "tolerance"}),
    "checkmate": frozenset({"time_limit_s", "gap", "backend", "slots", "progress"}),
    "milp": frozenset({"offload", "time_limit_s", "gap", "backend", "slots", "progress"}),
}
# Imported on first use, so that loading the registry does not load PuLP.
_OPTIMIZERS = {
    "dtr": ("solvers.dtr", "dtr"),
    "dp": ("solvers.dp", "solve_dp"),
    "checkmate": ("solvers.milp", "solve_checkmate"),
    "milp": ("solvers.milp", "solve_milp"),
}


def check_count(name: str, value: Any) -> int:
    """``value`` if it is a positive integer (a count of slots, stages...); else a ValueError."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")
    return value


def solve(chain: Chain, budget_bytes: int, solver: str = "dp", **options: Any) -> Plan:
    """The plan ``solver`` picks for ``chain`` within ``budget_bytes``, scored by the simulator.

    ``options`` go to the solver: ``slots`` and ``tolerance`` for dp; ``offload``,
    ``time_limit_s``, ``gap``, ``backend`` and ``slots`` for milp, the same less ``offload``
    for checkmate; none for dtr and the baselines. Raises
    :class:`InfeasibleBudgetError` (with ``min_budget_bytes``) when the plan does not fit,
    ``ValueError`` for an unknown solver, a bad option or an offload baseline on a chain
    without a link, and ``RuntimeError`` if a solver returns a plan the simulator puts over
    the budget (a bug).
    """
    given = check_request(solver, options)
    if isinstance(budget_bytes, bool) or not isinstance(budget_bytes, int) or budget_bytes <= 0:
        raise ValueError(f"budget_bytes must be a positive integer, got {budget_bytes!r}")
    if solver in BASELINES:
        return _solve_baseline(chain, budget_bytes, solver)
    plan = _optimizer(solver)(chain, budget_bytes, **given)
    if plan.predicted_peak_bytes is None or plan.predicted_peak_bytes > budget_bytes:
        # Never hand on a plan the simulator puts over its budget, whatever its solver says.
        raise RuntimeError(
            f"solver {solver!r} returned a plan whose simulated peak, "
            f"{plan.predicted_peak_bytes} B, passes the budget of {budget_bytes} B: this is a "
            "bug in offremat; please report it with the chain"
        )
    return plan


def check_request(solver: str, options: dict[str, Any]) -> dict[str, Any]:
    """The options :func:`solve` passes to ``solver`` (those not None); a ValueError naming
    an unknown solver, an option it does not take or one of the wrong type."""
    if solver not in SOLVERS:
        raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    given = {name: value for name, value in options.items() if value is not None}
    _check_option_types(given)
    unknown = sorted(set(given) - SOLVER_OPTIONS[solver])
    if unknown:
        accepted = ", ".join(sorted(SOLVER_OPTIONS[solver])) or "none"
        raise ValueError(
            f"solver {solver!r} does not take option(s) {', '.join(unknown)}; it takes: {accepted}"
        )
    return given


def _check_option_types(given: dict[str, Any]) -> None:
    """Refuse an option of the wrong type by name (``offload="no"`` would read as true)."""
    if "slots" in given:
        check_count("slots", given["slots"])
    if "offload" in given and not isinstance(given["offload"], bool):
        raise ValueError(f"offload must be True or False, got {given['offload']!r}")
    for name in ("time_limit_s", "gap"):
        value = given.get(name)
        if value is not None and (
            isinstance(value, bool) or not isinstance(value, (int, float)) or math.isnan(value)
        ):
            raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(given.get("time_limit_s", 0.0)):
        raise ValueError(f"time_limit_s must be finite, got {given['time_limit_s']!r}")
    if "backend" in given and not isinstance(given["backend"], str):
        raise ValueError(f"backend must be a name, got {given['backend']!r}")
    if "progress" in given and not callable(given["progress"]):
        raise ValueError(f"progress must be callable, got {given['progress']!r}")


def _optimizer(solver: str) -> Callable[..., Plan]:
    module_name, function = _OPTIMIZERS[solver]
    try:
        module = _import_on_a_bare_stack(module_name)
    except ModuleNotFoundError as error:
        if error.name != module_name:
            raise
        raise ValueError(
            f"solver {solver!r} is not available in this installation ({module_name} is "
            f"missing); choose one of {', '.join(s for s in SOLVERS if s != solver)}"
        ) from None
    return getattr(module, function)


def _import_on_a_bare_stack(module_name: str) -> Any:
    """Import ``module_name`` from a thread of its own.

    PuLP keeps the import errors of the solvers it cannot load (``COPT_DLL.err``...) with
    their tracebacks, and a traceback's frames reach every caller's frame through ``f_back``.
    Imported from the caller's stack, the first model optimized with the MILP would stay alive
    for the rest of the process, its device memory and pinned buffers with it.
    """
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["module"] = importlib.import_module(module_name)
        except BaseException as error:
            outcome["error"] = error

    thread = threading.Thread(target=run, name=f"import {module_name}")
    thread.start()
    thread.join()
    if "error" in outcome:
        raise outcome["error"]
    return outcome["module"]


def _solve_baseline(chain: Chain, budget_bytes: int, solver: str) -> Plan:
    plan = BASELINES[solver](chain)
    scored = score(plan, chain, budget_bytes)
    if not scored.feasible:
        least = least_fitting_budget(plan, chain, above=budget_bytes)
        raise InfeasibleBudgetError(budget_bytes, least, solver)
    return scored


def min_feasible_budget(chain: Chain, solver: str, **options: Any) -> int:
    """The least budget at which ``solver`` finds a plan.

    For dp this is rotor's exact least memory, :func:`solvers.dp.memory_need`; for a
    baseline, the least budget at which its fixed plan fits; for dtr,
    :func:`solvers.dtr.dtr_least_budget`; for milp and checkmate (no offloading),
    :func:`solvers.milp.least_feasible_budget` (``offload``, ``time_limit_s`` and ``backend``
    pass through), which with offloading is the best found within the time limit.
    """
    if solver in BASELINES:
        return least_fitting_budget(BASELINES[solver](chain), chain)
    if solver == "dp":
        return memory_need(chain)
    if solver == "dtr":
        return dtr_least_budget(chain)
    if solver in ("milp", "checkmate"):
        # Imported here so that the registry loads without PuLP until the MILP is asked for.
        from solvers.milp import least_feasible_budget

        taken = ("time_limit_s", "backend", "offload")  # least_feasible_budget's options
        given = {k: v for k, v in options.items() if v is not None and k in taken}
        if solver == "checkmate":
            given["offload"] = False
        return least_feasible_budget(chain, **given)
    raise ValueError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")


def keep_all_peak(chain: Chain) -> int:
    """The simulated peak of plain autograd: what a fractional budget is a fraction of."""
    return simulate(keep_all(chain), chain).peak_bytes
