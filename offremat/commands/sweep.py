"""``offremat sweep``: every method's predicted step time from the least feasible budget to
keep-all, as a CSV and a plot."""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.text import Text

from offremat.commands import (
    EXIT_OK,
    PROFILE_THREADS,
    UsageError,
    add_bandwidth_option,
    add_threads_option,
    chain_help,
    integer_at_least,
    load_chain,
    positive_number,
    report_console,
    with_bandwidth,
)
from offremat.sweep import (
    DEFAULT_MILP_TIME_LIMIT_S,
    METHODS,
    budget_range,
    profile_named_model,
    run_sweep,
    write_csv,
)
from solvers.budget import format_bytes
from solvers.chain import Chain
from solvers.registry import keep_all_peak

logger = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``offremat sweep``."""
    parser = subparsers.add_parser(
        "sweep",
        help="solve every method across budgets; write sweep.csv and sweep.png",
        description="Solve every method (keep-all, chen, checkpoint-every-stage, offload-all, "
        "min-peak, dtr, dp, checkmate and milp) at evenly spaced budgets from the least "
        "feasible one to the keep-all peak, and write DIR/sweep.csv and DIR/sweep.png "
        "(predicted time against budget).",
    )
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("chain", metavar="CHAIN", nargs="?", help=chain_help())
    source.add_argument(
        "--model",
        metavar="NAME",
        help="profile an in-repo model on this machine instead, on CUDA when present "
        "(e.g. gpt-small, resnet-small)",
    )
    parser.add_argument("--out", "-o", required=True, metavar="DIR", help="output directory")
    parser.add_argument(
        "--points",
        type=integer_at_least(2),
        default=12,
        metavar="N",
        help="budgets on the grid, from the least feasible to keep-all's (default 12)",
    )
    parser.add_argument(
        "--methods",
        default=",".join(METHODS),
        metavar="M1,M2",
        help=f"comma-separated subset of {','.join(METHODS)} (default: all)",
    )
    parser.add_argument(
        "--milp-time-limit",
        type=positive_number,
        default=DEFAULT_MILP_TIME_LIMIT_S,
        metavar="S",
        help="time limit per budget of milp and checkmate, in seconds "
        f"(default {DEFAULT_MILP_TIME_LIMIT_S:g})",
    )
    parser.add_argument(
        "--slots",
        type=integer_at_least(1),
        metavar="N",
        help="dp, checkmate and milp memory discretization",
    )
    add_bandwidth_option(
        parser,
        "replacing the chain's (needed for offloading on a chain without a link, e.g. one "
        "profiled on CPU)",
    )
    parser.add_argument(
        "--batch",
        type=integer_at_least(1),
        metavar="N",
        help="batch size for --model (default: the model's)",
    )
    add_threads_option(parser, None, "while --model is profiled; " + PROFILE_THREADS)
    return parser


def run(args: argparse.Namespace) -> int:
    """Load or profile the chain, sweep it with a progress bar, write the CSV and the plot."""
    # matplotlib loads only when a plot is drawn, so the other subcommands start fast.
    from offremat.plots import plot_sweep

    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHODS]
    if unknown or not methods:
        raise UsageError(f"--methods: unknown {unknown}; choose from {','.join(METHODS)}")
    twice = sorted({m for m in methods if methods.count(m) > 1})
    if twice:
        raise UsageError(f"--methods: {', '.join(twice)} listed twice")
    if args.model is None and args.batch is not None:
        raise UsageError("--batch sets the batch of --model; a chain file has its batch already")
    chain = _chain(args)
    chain = with_bandwidth(chain, args.bandwidth)
    out = Path(args.out)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(
            f"cannot make the output folder {out}: {error}; give --out a folder you can write"
        ) from None
    # An option given as None counts as not given, so the solvers' defaults apply.
    options = {
        "milp": {"time_limit_s": args.milp_time_limit, "slots": args.slots},
        "checkmate": {"time_limit_s": args.milp_time_limit, "slots": args.slots},
        "dp": {"slots": args.slots},
    }
    if keep_all_peak(chain) == 0:
        raise UsageError(
            f"{chain.name}: every size in the chain is 0 bytes, so there is no budget to sweep"
        )
    budgets = budget_range(chain, args.points)
    console = report_console(stderr=True)
    # One budget, the keep-all peak, shown rounded up and down read as two.
    span = (
        f"1 budget, {format_bytes(budgets[0])} ({budgets[0]} B)"
        if len(budgets) == 1
        else f"{len(budgets)} budgets from {format_bytes(budgets[0], round_up=True)} to "
        f"{format_bytes(budgets[-1])}"
    )
    console.print(
        Text(f"{chain.name}: {chain.length} stages, {span}, methods {', '.join(methods)}")
    )
    if chain.link is None:
        console.print("no host link: offload-all has no plan and milp only recomputes")
    with Progress(
        TextColumn("{task.description:<34}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
    ) as progress:
        task = progress.add_task("sweeping", total=len(methods) * len(budgets))

        def advance(point: Any) -> None:
            progress.update(
                task, advance=1, description=f"{point.method} @ {format_bytes(point.budget_bytes)}"
            )

        points = run_sweep(chain, budgets, methods, options, on_point=advance)
    write_csv(points, out / "sweep.csv")
    plot_sweep(points, chain, out / "sweep.png")
    chain.save(out / "chain.json")
    feasible = sum(p.feasible for p in points)
    print(
        f"wrote {out / 'sweep.csv'} ({len(points)} rows, {feasible} feasible), "
        f"{out / 'sweep.png'} and {out / 'chain.json'}"
    )
    return EXIT_OK


def _chain(args: argparse.Namespace) -> Chain:
    if args.model is None:
        return load_chain(args.chain)
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        return profile_named_model(args.model, batch_size=args.batch, device=device)
    except ValueError as error:
        raise UsageError(str(error)) from None
