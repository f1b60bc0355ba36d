"""Budget sweeps: every method's predicted step time from the least feasible budget to keep-all.

This is the trade-off curve of Chen et al., "Training Deep Nets with Sublinear Memory Cost"
(2016) and of Beaumont et al. (POFO, NeurIPS 2021), drawn here for every solver in
:data:`solvers.registry.SOLVERS`. Every time and peak comes from the simulator, through
:func:`solvers.registry.solve`.
"""

from __future__ import annotations

import csv
import logging
import math
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Link
from solvers.plan import Plan
from solvers.registry import SOLVERS, keep_all_peak, min_feasible_budget, solve

logger = logging.getLogger(__name__)

METHODS = SOLVERS
CSV_COLUMNS = ("method", "budget_bytes", "predicted_time_s", "predicted_peak_bytes", "solve_time_s")
# Methods that cannot run at all on a chain without a link (milp falls back to recomputation).
NEEDS_LINK = ("offload-all",)
DEFAULT_MILP_TIME_LIMIT_S = 10.0


@dataclass(frozen=True)
class SweepPoint:
    """One method at one budget; ``predicted_time_s`` is None where no plan fits.

    ``plan`` is the solved plan (not written to the CSV).
    """

    method: str
    budget_bytes: int
    predicted_time_s: float | None
    predicted_peak_bytes: int | None
    solve_time_s: float
    plan: Plan | None = field(default=None, compare=False, repr=False)

    @property
    def feasible(self) -> bool:
        """Whether the method found a plan within the budget."""
        return self.predicted_time_s is not None


def profile_named_model(
    name: str,
    batch_size: int | None = None,
    device: str = "cpu",
    bandwidth: float | None = None,
    seed: int = 0,
) -> Chain:
    """The chain of the in-repo model ``name`` (see :data:`offremat.models.MODELS`), profiled
    here with one stage per block; ``bandwidth`` (bytes/s, both ways) replaces the link."""
    # torch loads only when a model is profiled, so sweeping a chain file starts fast.
    from offremat.models import model_spec
    from offremat.profiler import profile_model

    spec = model_spec(name)
    model = spec.build(seed).to(device)
    size = batch_size or spec.default_batch_size
    example = spec.batch(size, seed, device)
    chain = profile_model(model, example, name=name)
    if bandwidth is not None:
        chain = chain.with_link(Link(bandwidth, bandwidth))
    chain.metadata.update(model=spec.description, batch_size=size)
    return chain


def budget_range(chain: Chain, count: int = 12) -> list[int]:
    """``count`` evenly spaced budgets from the least feasible one to the keep-all peak.

    The least feasible budget is the smallest of the DP's and the baselines' least feasible
    budgets (the MILP's has no closed form), so each of them first fits within the span.
    """
    top = keep_all_peak(chain)
    floor = min_feasible_budget(chain, "dp")
    for method in ("chen", "checkpoint-every-stage", "offload-all", "min-peak"):
        if method not in NEEDS_LINK or chain.link is not None:
            floor = min(floor, min_feasible_budget(chain, method))
    if count < 2 or floor >= top:
        return [top]
    step = (top - floor) / (count - 1)
    return sorted({math.ceil(floor + n * step) for n in range(count - 1)} | {top})


def run_sweep(
    chain: Chain,
    budgets: Sequence[int],
    methods: Iterable[str] = METHODS,
    options: Mapping[str, Mapping[str, Any]] | None = None,
    on_point: Callable[[SweepPoint], None] | None = None,
) -> list[SweepPoint]:
    """Solve every method at every budget; ``options[method]`` goes to that solver.

    The time limit of milp and checkmate is :data:`DEFAULT_MILP_TIME_LIMIT_S` unless
    ``options`` sets one.
    A method that cannot plan within a budget gives an infeasible point rather than an error.
    ``on_point`` is called after each solve (for a progress bar).
    """
    options = {method: dict(given) for method, given in (options or {}).items()}
    for milp_like in ("milp", "checkmate"):
        options.setdefault(milp_like, {}).setdefault("time_limit_s", DEFAULT_MILP_TIME_LIMIT_S)
    methods = list(methods)
    unknown = set(methods) - set(METHODS)
    if unknown:
        raise ValueError(f"unknown method(s) {sorted(unknown)}; choose from {', '.join(METHODS)}")
    points: list[SweepPoint] = []
    for method in methods:
        skip = method in NEEDS_LINK and chain.link is None
        if skip:
            logger.warning(
                "%s needs a host link but chain %r has none; its points are infeasible "
                "(give the chain a 'link' or pass --bandwidth)",
                method,
                chain.name,
            )
        for budget in budgets:
            started = time.perf_counter()
            time_s: float | None = None
            peak: int | None = None
            plan: Plan | None = None
            if not skip:
                try:
                    plan = solve(chain, budget, solver=method, **options.get(method, {}))
                    time_s, peak = plan.predicted_time_s, plan.predicted_peak_bytes
                except InfeasibleBudgetError:
                    pass
            elapsed = time.perf_counter() - started
            point = SweepPoint(method, budget, time_s, peak, elapsed, plan)
            points.append(point)
            if on_point is not None:
                on_point(point)
    return points


def write_csv(points: Iterable[SweepPoint], path: str | Path) -> None:
    """``method,budget_bytes,predicted_time_s,predicted_peak_bytes,solve_time_s``; empty cells
    where a method has no plan."""
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(CSV_COLUMNS)
        for p in points:
            writer.writerow(
                [
                    p.method,
                    p.budget_bytes,
                    "" if p.predicted_time_s is None else repr(p.predicted_time_s),
                    "" if p.predicted_peak_bytes is None else p.predicted_peak_bytes,
                    f"{p.solve_time_s:.6f}",
                ]
            )


def read_csv(path: str | Path) -> list[SweepPoint]:
    """The points a :func:`write_csv` file holds."""
    with open(path, newline="") as handle:
        return [
            SweepPoint(
                method=row["method"],
                budget_bytes=int(row["budget_bytes"]),
                predicted_time_s=_optional(row["predicted_time_s"], float),
                predicted_peak_bytes=_optional(row["predicted_peak_bytes"], int),
                solve_time_s=float(row["solve_time_s"]),
            )
            for row in csv.DictReader(handle)
        ]


def _optional(cell: str, kind: Callable[[str], Any]) -> Any:
    """An empty CSV cell as None, any other as ``kind`` reads it."""
    return kind(cell) if cell else None
