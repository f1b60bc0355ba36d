"""``offremat plot``: draw a saved plan's timeline and memory curve against its budget."""

from __future__ import annotations

import argparse
import json
import logging
from typing import Any

from offremat.commands import (
    BUDGET_HELP,
    EXIT_OK,
    UsageError,
    add_bandwidth_option,
    chain_help,
    draw_plan,
    load_chain,
    resolve_budget,
    with_bandwidth,
)
from solvers.budget import format_bytes
from solvers.plan import Plan, PlanError
from solvers.simulator import simulate

logger = logging.getLogger(__name__)


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``offremat plot``."""
    parser = subparsers.add_parser(
        "plot",
        help="draw a plan: timeline on compute / device→host / host→device, memory vs budget",
        description="Simulate PLAN on CHAIN and draw a PNG: the operations on the compute and "
        "the two copy lanes, above the resident GPU memory against the budget line.",
    )
    parser.add_argument("chain", metavar="CHAIN", help=chain_help())
    parser.add_argument("plan", metavar="PLAN", help="a plan JSON file (offremat.plan/1)")
    parser.add_argument("--out", "-o", default="plan.png", help="PNG to write (default plan.png)")
    parser.add_argument(
        "--budget", "-b", metavar="B", help=f"{BUDGET_HELP}; default: the plan's own budget"
    )
    add_bandwidth_option(parser, "replacing the chain's (as given to solve --bandwidth)")
    return parser


def run(args: argparse.Namespace) -> int:
    """Load, check, simulate and draw."""
    chain = with_bandwidth(load_chain(args.chain), args.bandwidth)
    try:
        plan = Plan.load(args.plan)
    except FileNotFoundError:
        raise UsageError(
            f"no plan file {args.plan!r}; write one with: offremat solve CHAIN -b B --out PLAN"
        ) from None
    except (ValueError, json.JSONDecodeError) as error:
        raise UsageError(f"{args.plan}: {error}") from None
    except OSError as error:
        raise UsageError(f"cannot read plan file {args.plan}: {error}") from None
    budget = resolve_budget(args.budget, chain) if args.budget else None
    if plan.chain_name and plan.chain_name != chain.name:
        logger.warning(
            "the plan was made for chain %r and is drawn on %r", plan.chain_name, chain.name
        )
    try:
        draw_plan(chain, plan, args.out, budget_bytes=budget)
    except PlanError as error:
        raise UsageError(f"{args.plan} does not run on {args.chain}: {error}") from None
    except ValueError as error:
        raise UsageError(str(error)) from None
    print(f"wrote {args.out}")
    limit = budget if budget is not None else plan.budget_bytes
    # Under its budget the simulator holds prefetches back until memory allows, as drawn.
    peak = simulate(plan, chain, limit).peak_bytes
    if limit is not None and peak > limit:
        logger.warning(
            "the plan's simulated peak, %s, passes the budget of %s",
            format_bytes(peak),
            format_bytes(limit),
        )
    logger.info("drew %s (%d ops) on %s", args.plan, len(plan.ops), chain.name)
    return EXIT_OK
