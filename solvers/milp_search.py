"""Searching the joint MILP with HiGHS or CBC: the backends and the window search.

HiGHS is loaded once per model and re-solved with different binaries fixed: windows of
growing width around the incumbent (a large neighbourhood search whose every step is the same
MILP with the decisions outside the window fixed), then the whole model. CBC runs once on the
whole model. Both report through :class:`Search`; a running HiGHS search also reports its
progress (:mod:`solvers.milp_progress`).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pulp

from solvers.milp_codec import Schedule
from solvers.milp_model import JointModel
from solvers.milp_progress import ProgressReport

logger = logging.getLogger(__name__)

BACKENDS = ("highs", "cbc")
_INSTALL_HINT = {
    "highs": "the Python package 'highspy' (pip install highspy), or pass backend='cbc'",
    "cbc": "PuLP's bundled CBC binary (pip install --force-reinstall pulp), or pass "
    "backend='highs'",
}
# Below this many structural binaries the whole model is searched from the start.
_WHOLE_MODEL_BINARIES = 300
_FIRST_WINDOW = 4
_WINDOW_SECONDS = 2.0
_POLISH_SECONDS = 5.0
_RECOMPUTE_SHARE = 0.25


class BackendUnavailableError(ImportError):
    """The chosen MILP backend is not installed; the message names what to install."""


@dataclass(frozen=True)
class Search:
    """What a MILP search ended with: its best structure, objective and bound (seconds)."""

    schedule: Schedule | None
    objective_s: float | None
    bound_s: float | None
    status: str


def require_backend(backend: str) -> None:
    if backend == "highs":
        try:
            importlib.import_module("highspy")
        except ImportError:
            raise BackendUnavailableError(
                f"the MILP backend 'highs' is not installed: it needs {_INSTALL_HINT['highs']}"
            ) from None
        if not pulp.HiGHS(msg=False).available():
            raise BackendUnavailableError(
                f"PuLP cannot load HiGHS: install {_INSTALL_HINT['highs']}"
            )
    elif not _bundled_cbc(msg=False).available():
        raise BackendUnavailableError(
            f"the MILP backend 'cbc' is not available: it needs {_INSTALL_HINT['cbc']}"
        )


@contextlib.contextmanager
def native_stdout_silenced() -> Iterator[None]:
    """Point file descriptor 1 at /dev/null: native code's prints would corrupt ``--json``."""
    sys.stdout.flush()
    saved = os.dup(1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 1)
        yield
    finally:
        os.dup2(saved, 1)
        os.close(saved)
        os.close(devnull)


def _bundled_cbc(**options: Any) -> Any:
    """PuLP's bundled CBC. PuLP 3 warns that it goes away in PuLP 4, whose CBC needs the 190 MB
    ``pulp[cbc]`` extra; pyproject pins PuLP below 4, where the bundled binary works, so the
    warning says nothing to act on."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return pulp.PULP_CBC_CMD(**options)


HIGHS_OPTIONS = {
    f"mip_heuristic_run_{name}": False for name in ("rins", "rens", "root_reduced_cost")
}
"""HiGHS's options for every MILP here: its sub-MIP heuristics off. They presolve their
sub-problem, and HiGHS 1.16's presolve has looped there for good (strengthenInequalities, in
RINS within RENS: a test suite hung 12 minutes in a 20 s solve); the search's own
neighbourhoods (:func:`search_highs`) take their place."""


class _HighsSession:
    """The model loaded once into HiGHS and re-solved with different binaries fixed."""

    def __init__(self, model: JointModel, gap: float | None, report: ProgressReport | None = None):
        self.model = model
        self.report = report
        self.whole = False  # whether the run under way is of the whole model
        solver = pulp.HiGHS(msg=False, gapRel=gap)
        with native_stdout_silenced():  # HiGHS prints its banner from C, before msg applies
            solver.createAndConfigureSolver(model.problem)
        solver.buildSolverModel(model.problem)
        self.highs = model.problem.solverModel
        self.highs.setOptionValue("random_seed", 0)
        for option, value in HIGHS_OPTIONS.items():
            self.highs.setOptionValue(option, value)
        self.columns = model.problem.variables()
        self.binaries = model.binaries()
        self.index = np.array([v.index for v in self.binaries], dtype=np.int32)
        decisions = {v.name for v in model.structural_variables()}
        self.decisions = np.array([v.name in decisions for v in self.binaries], dtype=bool)
        self.places = [model.place(v) for v in self.binaries]
        self.copying = np.array([model.copies(v) for v in self.binaries], dtype=bool)
        if report is not None and report.active:
            self.highs.cbMipInterrupt.subscribe(self._interrupted)

    def _interrupted(self, event: Any) -> None:
        """HiGHS's periodic call during a run: report its incumbent and, for the whole model,
        its bound (a neighbourhood's bound holds only with its binaries fixed)."""
        assert self.report is not None
        out, scale = event.data_out, self.model.time_unit
        self.report(
            out.mip_primal_bound * scale, out.mip_dual_bound * scale if self.whole else None
        )

    def run(
        self, start: np.ndarray | None, free: np.ndarray, time_limit_s: float, presolve: bool
    ) -> tuple[str, float | None, float | None, np.ndarray | None]:
        """Solve with the binaries not in ``free`` fixed to their values in ``start``.

        Presolve is left off for the whole model: HiGHS 1.15's presolve has returned
        suboptimal "optimal" answers on this formulation (CBC and HiGHS without presolve
        agree); with most binaries fixed it is only the speed of a neighbourhood at stake.
        """
        highs = self.highs
        lower = np.zeros(len(self.index))
        upper = np.ones(len(self.index))
        if start is not None:
            fixed = ~free
            values = np.round(start[self.index])
            lower[fixed] = values[fixed]
            upper[fixed] = values[fixed]
        highs.changeColsBounds(len(self.index), self.index, lower, upper)
        self.whole = bool(free.all())
        highs.setOptionValue("time_limit", max(0.1, float(time_limit_s)))
        highs.setOptionValue("presolve", "on" if presolve else "off")
        highs.clearSolver()
        if start is not None:
            highs.setSolution(len(start), np.arange(len(start), dtype=np.int32), start)
        highs.run()
        status = highs.modelStatusToString(highs.getModelStatus())
        info = highs.getInfo()
        if info.primal_solution_status < 2:
            return status, None, None, None
        values = np.array(highs.getSolution().col_value)
        bound = info.mip_dual_bound if math.isfinite(info.mip_dual_bound) else None
        return status, info.objective_function_value, bound, values

    def load(self, values: np.ndarray) -> None:
        """Put ``values`` into the PuLP variables, so the model can read its schedule."""
        for column in self.columns:
            column.varValue = float(values[column.index])

    def window(self, first: int, last: int) -> np.ndarray:
        """The decisions about stages first..last (in every step) and those of steps
        first..last about stages at most one window width lower; and the release and late
        indicators of every stage from that width lower on, since FIFO channels tie them to
        the window."""
        lowest = first - (last - first + 1)
        free = []
        for (stage, step), decision in zip(self.places, self.decisions, strict=True):
            in_steps = step is not None and first <= step <= last and stage >= lowest
            free.append(first <= stage <= last or in_steps or (not decision and stage >= lowest))
        return np.array(free, dtype=bool)


def search_highs(
    model: JointModel,
    warm: Schedule | None,
    gap: float | None,
    deadline: float,
    report: ProgressReport | None = None,
    floor_s: float | None = None,
) -> Search:
    """Windows of growing width around the incumbent, then the whole model; it stops as soon
    as the incumbent meets ``floor_s``, a lower bound on every plan's time."""
    session = _HighsSession(model, gap, report)
    incumbent: np.ndarray | None = None
    if warm is not None:
        values = model.schedule_values(warm)
        start = np.zeros(len(session.columns))
        for var in model.structural_variables():
            start[var.index] = values[var.name]
        # The warm start's times, releases and late prefetches: its decisions fixed.
        status, _, _, incumbent = session.run(
            start, ~session.decisions, _share(deadline, 0.25), presolve=True
        )
        if incumbent is None:
            logger.info("the warm start does not fit the MILP (%s); starting without it", status)
    best = _objective(model, incumbent)
    length = model.length
    decisions = int(session.decisions.sum())
    width = length if decisions <= _WHOLE_MODEL_BINARIES else _FIRST_WINDOW
    if width < length and incumbent is not None and session.copying.any():
        copies = np.round(incumbent[session.index])[session.copying]
        if not copies.any():
            # A start that only recomputes: first Checkmate's whole problem, the copies held
            # at none, whose family the windows would otherwise search piecemeal.
            _, objective, _, values = session.run(
                incumbent, ~session.copying, _share(deadline, _RECOMPUTE_SHARE), presolve=True
            )
            if values is not None and objective < best - 1e-9:
                incumbent, best = values, objective
    status, whole_bound, proven = "time limit", None, False
    floor = -math.inf if floor_s is None else floor_s / model.time_unit * (1 + 1e-9)
    while time.monotonic() < deadline:
        if best is not None and best <= floor:
            status, whole_bound, proven = "Optimal", best, True
            break
        if width >= length or incumbent is None:
            whole = np.ones(len(session.index), dtype=bool)
            status, objective, whole_bound, values = session.run(
                incumbent, whole, deadline - time.monotonic(), presolve=False
            )
            proven = status == "Optimal"
            if values is not None and (best is None or objective <= best):
                incumbent, best = values, objective
            break
        improved = False
        for last in range(width, length + width // 2, max(1, width // 2)):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            first = max(1, last - width + 1)
            window = session.window(first, min(last, length))
            window_status, objective, _, values = session.run(
                incumbent,
                window,
                min(remaining, _WINDOW_SECONDS * width / _FIRST_WINDOW),
                presolve=True,
            )
            logger.debug(
                "window %d..%d (%d binaries free): %s, %s",
                first,
                min(last, length),
                int(window.sum()),
                window_status,
                objective,
            )
            if values is not None and objective < best - 1e-9:
                incumbent, best, improved = values, objective, True
            if best <= floor:
                break
        if not improved:
            width *= 2
    scale = 1.0 if isinstance(model.budget, pulp.LpVariable) else model.time_unit
    if incumbent is None:
        return Search(None, None, None, _status_name(status))
    if not proven:
        # A neighbourhood cut short may leave the times of its decisions loose: settle them.
        _, objective, _, values = session.run(
            incumbent, ~session.decisions, _POLISH_SECONDS, presolve=True
        )
        if values is not None and objective <= best:
            incumbent, best = values, objective
    session.load(incumbent)
    return Search(
        model.read_schedule(),
        best * scale,
        None if whole_bound is None else whole_bound * scale,
        _status_name(status),
    )


def _objective(model: JointModel, values: np.ndarray | None) -> float | None:
    if values is None:
        return None
    if isinstance(model.budget, pulp.LpVariable):
        return float(values[model.budget.index])
    return float(values[model.makespan.index])


def _share(deadline: float, share: float) -> float:
    return max(0.5, (deadline - time.monotonic()) * share)


def _status_name(status: str) -> str:
    return status.strip().lower().replace(" reached", "")


def search_cbc(
    model: JointModel, warm: Schedule | None, gap: float | None, deadline: float
) -> Search:
    """One CBC run on the whole model, started from the warm start's structure."""
    if warm is not None:
        for name, value in model.schedule_values(warm).items():
            model.problem.variablesDict()[name].setInitialValue(value)
    with tempfile.TemporaryDirectory() as folder:
        log_path = Path(folder) / "cbc.log"
        solver = _bundled_cbc(
            msg=False,
            timeLimit=max(1.0, deadline - time.monotonic()),
            gapRel=gap,
            warmStart=warm is not None,
            logPath=str(log_path),
            threads=1,
        )
        status = model.problem.solve(solver)
        log = log_path.read_text() if log_path.exists() else ""
    objective = _objective_value(model)
    bound = _cbc_bound(log)
    if objective is None or pulp.LpStatus[status] not in ("Optimal", "Not Solved"):
        return Search(None, None, None, pulp.LpStatus[status].lower())
    proven = "Optimal solution found" in log
    scale = model.time_unit
    return Search(
        model.read_schedule(),
        objective,
        None if bound is None or isinstance(model.budget, pulp.LpVariable) else bound * scale,
        "optimal" if proven else "time limit",
    )


def _objective_value(model: JointModel) -> float | None:
    if isinstance(model.budget, pulp.LpVariable):
        return model.least_budget_bytes()
    return model.objective_s()


def _cbc_bound(log: str) -> float | None:
    """The best bound CBC printed last ("Lower bound:" or "best possible")."""
    matches = re.findall(r"Lower bound:\s*([-0-9.eE+]+)", log)
    if not matches:
        matches = re.findall(r"best possible\s*([-0-9.eE+]+)", log)
    return float(matches[-1]) if matches else None
