"""``offremat demo``: plan an in-repo GPT for a budget keep-all does not fit, train it with every
method, and compare predicted against measured step time and peak."""

from __future__ import annotations

import argparse
import dataclasses
import os
from typing import Any

from offremat.commands import (
    BANDWIDTH_HELP,
    EXIT_OK,
    UsageError,
    add_threads_option,
    bandwidth_rate,
    integer_at_least,
    positive_number,
    report_console,
)

EXIT_LOSSES_DIFFER = 1


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``offremat demo``."""
    parser = subparsers.add_parser(
        "demo",
        help="plan, train and compare: keep-all, checkpoint_sequential, save_on_cpu, dp, milp",
        description="Build the in-repo GPT, profile it, pick a budget that keep-all does not "
        "fit, solve it with dp and milp, train a few steps with each method from the same seed "
        "and print predicted against measured step time and peak. Exits 1 if the losses are "
        "not identical across methods (on CUDA without --deterministic, steps after the first "
        "within 1e-4 of keep-all's). Runs on CUDA when present, else on CPU.",
    )
    parser.add_argument(
        "--steps",
        type=integer_at_least(2),
        default=6,
        help="training steps per method, at least 2: a warm-up and a timed one (6)",
    )
    parser.add_argument(
        "--budget",
        type=float,
        default=0.5,
        metavar="FRACTION",
        help="budget as a fraction of the keep-all peak, below 1 (default 0.5)",
    )
    parser.add_argument(
        "--milp-time-limit",
        type=positive_number,
        default=10.0,
        metavar="S",
        help="MILP time limit (10 s)",
    )
    parser.add_argument(
        "--bandwidth",
        type=bandwidth_rate,
        metavar="RATE",
        help=f"{BANDWIDTH_HELP}, for planning (default: measured on CUDA, a 12 GB/s stand-in "
        "on CPU)",
    )
    parser.add_argument("--device", help="cuda or cpu (default: cuda when available)")
    parser.add_argument("--seed", type=int, default=0, help="weights, batches and dropout seed")
    parser.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True) (with CUBLAS_WORKSPACE_CONFIG=:4096:8), "
        "so that losses compare bit for bit on CUDA too",
    )
    add_threads_option(
        parser,
        1,
        "default 1: the demo model is small, and one thread keeps the profile and the measured "
        "steps comparable when other work shares the cores",
    )
    size = parser.add_argument_group("model size (default: the demo GPT)")
    size.add_argument("--layers", type=int)
    size.add_argument("--hidden", type=int)
    size.add_argument("--heads", type=int)
    size.add_argument("--seq", type=int)
    size.add_argument("--batch", type=integer_at_least(1), help="batch size (default 8)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Run the demo and print its tables; exit 1 when the methods' losses differ."""
    import torch

    from offremat.demo import DEMO_BATCH_SIZE, DEMO_GPT, render, run_demo

    if not 0 < args.budget < 1:
        raise UsageError(
            f"--budget is a fraction of the keep-all peak in (0, 1), got {args.budget}"
        )
    if args.device:
        try:
            torch.device(args.device)
        except RuntimeError:
            raise UsageError(
                f"--device {args.device!r} is not a device: use cpu, cuda or cuda:N"
            ) from None
    if args.device and args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("--device cuda: no CUDA device is available here; use --device cpu")
    sizes = {
        name: getattr(args, name)
        for name in ("layers", "hidden", "heads", "seq")
        if getattr(args, name) is not None
    }
    try:
        config = dataclasses.replace(DEMO_GPT, **sizes)
    except ValueError as error:
        raise UsageError(str(error)) from None
    torch.set_num_threads(args.threads)
    if args.deterministic:
        # cuBLAS reads this when it creates its first handle, which has not happened yet.
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    console = report_console()
    report = run_demo(
        config=config,
        batch_size=args.batch or DEMO_BATCH_SIZE,
        steps=args.steps,
        budget_fraction=args.budget,
        milp_time_limit_s=args.milp_time_limit,
        bandwidth=args.bandwidth,
        device=args.device,
        seed=args.seed,
        progress=lambda line: console.print(f"[dim]· {line}[/]"),
    )
    render(report, console)
    return EXIT_OK if report.losses_agree else EXIT_LOSSES_DIFFER
