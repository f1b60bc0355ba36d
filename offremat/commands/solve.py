"""``offremat solve``: the plan one solver picks for a chain and a budget, with its predicted
time and peak from the simulator."""

from __future__ import annotations

import argparse
import logging
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

from offremat.commands import (
    BUDGET_HELP,
    EXIT_INFEASIBLE,
    EXIT_OK,
    UsageError,
    add_bandwidth_option,
    chain_help,
    check_plot_path,
    draw_plan,
    integer_at_least,
    json_text,
    load_chain,
    positive_number,
    report_console,
    resolve_budget,
    with_bandwidth,
)
from solvers.bounds import MEETS_BOUND, lower_bound_s
from solvers.budget import InfeasibleBudgetError, format_bytes
from solvers.chain import Chain
from solvers.milp_progress import ProgressCallback, SearchProgress
from solvers.plan import Plan
from solvers.registry import SOLVER_OPTIONS, SOLVERS, solve

logger = logging.getLogger(__name__)

# Plan.info keys a solver may report that --json passes through (the MILP's).
SOLVER_REPORT_KEYS = ("solver_status", "objective", "best_bound", "gap")
_DECISION_STYLE = {"keep": "green", "recompute": "yellow", "offload": "cyan"}


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``offremat solve``."""
    parser = subparsers.add_parser(
        "solve",
        help="plan keep / offload / recompute for a chain within a memory budget",
        description="Pick, for every activation of CHAIN, whether to keep it on the GPU, "
        "offload it to host memory or recompute it, so that one training step fits in BUDGET; "
        "print the decisions and the simulated step time and peak.",
    )
    parser.add_argument("chain", metavar="CHAIN", help=chain_help())
    parser.add_argument("--budget", "-b", required=True, metavar="B", help=BUDGET_HELP)
    parser.add_argument(
        "--solver",
        "-s",
        default="dp",
        choices=SOLVERS,
        metavar="NAME",
        help=f"which planner: {', '.join(SOLVERS)} (default: dp)",
    )
    parser.add_argument(
        "--slots",
        type=integer_at_least(1),
        metavar="N",
        help="dp, checkmate and milp memory discretization (default 500)",
    )
    add_bandwidth_option(parser, "replacing the chain's (offloading needs one)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.add_argument("--out", metavar="PLAN.json", help="write the plan (offremat.plan/1)")
    parser.add_argument("--plot", metavar="PATH", help="draw the plan's timeline and memory (PNG)")
    milp = parser.add_argument_group("milp options")
    milp.add_argument(
        "--no-offload", action="store_true", help="recomputation only, no host copies"
    )
    milp.add_argument(
        "--time-limit",
        type=positive_number,
        metavar="S",
        help="solver time limit in seconds (default 30)",
    )
    milp.add_argument("--gap", type=float, metavar="G", help="relative optimality gap to stop at")
    milp.add_argument("--backend", choices=("highs", "cbc"), help="MILP backend (default highs)")
    return parser


# The flag that sets each registry option, as the user typed it.
FLAGS = {
    "slots": "--slots",
    "offload": "--no-offload",
    "time_limit_s": "--time-limit",
    "gap": "--gap",
    "backend": "--backend",
}


def _options(args: argparse.Namespace) -> dict[str, Any]:
    """The registry options the chosen solver takes; flags meant for another are reported."""
    given = {
        "slots": args.slots,
        "offload": False if args.no_offload else None,
        "time_limit_s": args.time_limit,
        "gap": args.gap,
        "backend": args.backend,
    }
    accepted = SOLVER_OPTIONS[args.solver]
    ignored = [
        FLAGS[name] for name, value in given.items() if value is not None and name not in accepted
    ]
    if ignored:
        logger.warning("solver %s ignores %s", args.solver, ", ".join(ignored))
    return {name: value for name, value in given.items() if value is not None and name in accepted}


def run(args: argparse.Namespace) -> int:
    """Solve, then print the plan (table or JSON) and write --out / --plot."""
    chain = load_chain(args.chain)
    chain = with_bandwidth(chain, args.bandwidth)
    budget = resolve_budget(args.budget, chain)
    # Said before a solve that can take the whole time limit.
    if args.plot:
        check_plot_path(args.plot)
    if args.out and (Path(args.out).is_dir() or not Path(args.out).parent.is_dir()):
        raise UsageError(f"--out {args.out}: give a file path in an existing folder")
    try:
        with _search_line(args.solver in ("milp", "checkmate") and sys.stderr.isatty()) as progress:
            options = _options(args) | ({"progress": progress} if progress else {})
            plan = solve(chain, budget, args.solver, **options)
    except InfeasibleBudgetError as error:
        return _report_infeasible(args, chain, error)
    except (ValueError, ImportError) as error:
        raise UsageError(str(error)) from None
    if args.out:
        try:
            plan.save(args.out)
        except OSError as error:
            raise UsageError(f"cannot write the plan to {args.out}: {error}") from None
        print(f"wrote {args.out}", file=sys.stderr)
    if args.plot:
        draw_plan(chain, plan, args.plot)
        print(f"wrote {args.plot}", file=sys.stderr)
    if args.json:
        print(json_text(plan_summary(chain, plan)))
    else:
        _print_table(chain, plan)
    return EXIT_OK


@contextmanager
def _search_line(shown: bool) -> Iterator[ProgressCallback | None]:
    """A live line on a terminal's stderr while the MILP searches (elapsed, incumbent, bound,
    gap), gone when it ends; None where nobody watches."""
    if not shown:
        yield None
        return
    columns = (SpinnerColumn(), TimeElapsedColumn(), TextColumn("{task.description}"))
    with Progress(*columns, console=Console(stderr=True), transient=True) as line:
        task = line.add_task("milp: building the model")

        def show(state: SearchProgress) -> None:
            line.update(task, description=_describe(state))

        yield show


def _describe(state: SearchProgress) -> str:
    parts = ["milp"]
    if state.incumbent_s is not None:
        parts.append(f"best plan {_format_seconds(state.incumbent_s)}")
    if state.bound_s is not None:
        parts.append(f"bound {_format_seconds(state.bound_s)}")
    if state.gap is not None:
        parts.append(f"gap {state.gap:.2%}")
    return ", ".join(parts)


def plan_summary(chain: Chain, plan: Plan) -> dict[str, Any]:
    """The JSON object of a solved plan: figures, decisions, ops and the solver's report."""
    assert plan.predicted_time_s is not None and plan.budget_bytes is not None
    bound = lower_bound_s(chain, plan.budget_bytes)
    summary: dict[str, Any] = {
        "feasible": plan.feasible,
        "solver": plan.solver,
        "chain": chain.name,
        "stages": list(chain.stage_names),
        "budget_bytes": plan.budget_bytes,
        "predicted_time_s": plan.predicted_time_s,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "compute_time_s": chain.compute_time_s,
        "overhead": _overhead(chain, plan.predicted_time_s),
        "lower_bound_s": bound if math.isfinite(bound) else None,
        "decisions": plan.decisions,
        "ops": [op.to_dict() for op in plan.ops],
    }
    for key in SOLVER_REPORT_KEYS:
        if key in plan.info:
            summary[key] = plan.info[key]
    return summary


def _overhead(chain: Chain, time_s: float) -> float:
    compute = chain.compute_time_s
    # max(): a plan as fast as the floor reads +0.0%, not -0.0% from rounding.
    return max(time_s / compute - 1, 0.0) if compute > 0 else 0.0


def _report_infeasible(args: argparse.Namespace, chain: Chain, error: InfeasibleBudgetError) -> int:
    if args.json:
        print(
            json_text(
                {
                    "feasible": False,
                    "solver": args.solver,
                    "chain": chain.name,
                    "budget_bytes": error.budget_bytes,
                    "min_budget_bytes": error.min_budget_bytes,
                    # False for a greedy solver (dtr): a budget with a plan, maybe not the least.
                    "min_budget_is_least": error.exact,
                    "message": str(error),
                }
            )
        )
    else:
        print(f"offremat solve: {error}", file=sys.stderr)
    return EXIT_INFEASIBLE


def _format_seconds(seconds: float) -> str:
    if seconds >= 1:
        return f"{seconds:.3f} s"
    if seconds >= 1e-3:
        return f"{seconds * 1e3:.2f} ms"
    return f"{seconds * 1e6:.1f} µs"


def _print_table(chain: Chain, plan: Plan) -> None:
    assert plan.predicted_time_s is not None and plan.predicted_peak_bytes is not None
    assert plan.budget_bytes is not None
    console = report_console()
    # User text (chain and stage names) goes in as Text: never parsed as markup or emoji.
    table = Table(title=Text(f"{chain.name}: {plan.solver} plan, {chain.length} stages"))
    table.add_column("#", justify="right")
    table.add_column("stage")
    table.add_column("decision")
    table.add_column("fwd", justify="right")
    table.add_column("bwd", justify="right")
    table.add_column("saved x̄", justify="right")
    decisions = plan.decisions
    for index, stage in enumerate(chain.stages, start=1):
        # A frozen stage runs no backward: nothing of its forward is kept for one.
        decision = decisions.get(stage.name, "frozen" if index <= chain.frozen_stages else "?")
        style = _DECISION_STYLE.get(decision, "")
        table.add_row(
            str(index),
            Text(stage.name),
            f"[{style}]{decision}[/]" if style else decision,
            _format_seconds(stage.fwd_s),
            _format_seconds(stage.bwd_s),
            format_bytes(stage.saved_bytes),
        )
    console.print(table)
    counts = {kind: list(decisions.values()).count(kind) for kind in _DECISION_STYLE}
    bound = lower_bound_s(chain, plan.budget_bytes)
    recomputing = ""
    if plan.info.get("solver_status") == MEETS_BOUND:
        met = max(bound, plan.info["best_bound"])  # the tighter bound the plan met
        if plan.info.get("offload") or chain.link is None:  # a bound on every plan
            bound = met
        else:  # without offloading, a bound on the plans that only recompute
            recomputing = f", {_format_seconds(met)} recomputing only"
    console.print(
        f"decisions        {counts['keep']} keep, {counts['recompute']} recompute, "
        f"{counts['offload']} offload"
    )
    console.print(
        f"predicted time   {_format_seconds(plan.predicted_time_s)}  "
        f"({_overhead(chain, plan.predicted_time_s):+.1%} over Σ fwd + Σ bwd = "
        f"{_format_seconds(chain.compute_time_s)}; lower bound at this budget "
        f"{_format_seconds(bound)}{recomputing})"
    )
    console.print(
        f"predicted peak   {format_bytes(plan.predicted_peak_bytes)} of "
        f"{format_bytes(plan.budget_bytes)} budget "
        f"({plan.predicted_peak_bytes / plan.budget_bytes:.0%})"
    )
    status = plan.info.get("solver_status")
    if status is not None:
        gap = plan.info.get("gap")
        line = f"solver           {status}, gap {'unknown' if gap is None else f'{gap:.1%}'}"
        if plan.info.get("fallback"):
            line += f"; returned its warm start ({plan.info.get('fallback_plan')})"
        console.print(Text(line))
