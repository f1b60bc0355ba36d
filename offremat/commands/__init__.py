"""The ``offremat`` subcommands, one module each, plus what they share.

A subcommand module exposes ``add_parser(subparsers) -> argparse.ArgumentParser``, which adds
its parser to the ``subparsers`` of :mod:`offremat.cli` and returns it, and
``run(args) -> int``, the exit status. :mod:`offremat.cli` lists the modules in one tuple.
Exit statuses: 0 done, 2 usage error (raise :class:`UsageError`), 3 no plan fits the budget.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console

from offremat import examples
from solvers.budget import parse_bandwidth, parse_budget
from solvers.chain import Chain, Link
from solvers.chain_limits import ChainFormatError
from solvers.plan import Plan
from solvers.registry import keep_all_peak

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2
EXIT_INFEASIBLE = 3

BUDGET_HELP = (
    "GPU memory budget: a fraction in (0, 1] of the keep-all peak (0.3; 1 and 1.0 both mean "
    "the whole peak), a size with a unit (6GiB, 512MB, 12B) or a whole number of bytes of at "
    "least 16 (6442450944); anything else is refused"
)


PIPED_WIDTH = 1000
"""Columns a report has in a file or a pipe: more than any line of prose."""


def report_console(stderr: bool = False) -> Console:
    """A console for a subcommand's report: prose wraps at a terminal's width, and stays one
    line per sentence in a file or a pipe, where rich would break it mid-phrase at 80
    columns (tables keep their own width)."""
    out = Console(stderr=stderr, highlight=False)
    if not out.is_terminal:
        out.width = PIPED_WIDTH
    return out


def json_text(value: Any) -> str:
    """``value`` as JSON text; a non-finite number becomes null, since JSON has no Infinity."""
    return json.dumps(_finite(value), indent=2, allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: _finite(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(item) for item in value]
    return value


BANDWIDTH_HELP = (
    "host link for both directions: 25GB/s, 12GiB/s or bytes per second (2.5e10; a bare "
    "number below 1e6 is refused as a unit left out)"
)


def add_bandwidth_option(parser: argparse.ArgumentParser, purpose: str) -> None:
    """``--bandwidth RATE``, with ``purpose`` said in its help."""
    parser.add_argument(
        "--bandwidth", type=bandwidth_rate, metavar="RATE", help=f"{BANDWIDTH_HELP}, {purpose}"
    )


def with_bandwidth(chain: Chain, rate: float | None) -> Chain:
    """``chain`` with a link of ``rate`` both ways in place of its own, if a rate is given."""
    return chain if rate is None else chain.with_link(Link(rate, rate))


def bandwidth_rate(text: str) -> float:
    """An argparse ``type``: a link rate in bytes per second, parsed as the API parses it."""
    try:
        return parse_bandwidth(text).d2h_bytes_per_s
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


class UsageError(Exception):
    """A mistake in what the user asked for; the CLI prints the message and exits 2."""


PROFILE_THREADS = (
    "default: torch's own; a profile's times are those of this many threads, so give the "
    "count you train with, and 1 on a machine shared with other work for steadier times"
)


def add_threads_option(parser: argparse.ArgumentParser, default: int | None, why: str) -> None:
    """``--threads N``: torch's CPU threads while the command profiles or runs a model."""
    parser.add_argument(
        "--threads",
        type=integer_at_least(1),
        default=default,
        metavar="N",
        help=f"torch CPU threads ({why})",
    )


def integer_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse ``type``: a whole number no smaller than ``minimum``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    return parse


def positive_number(text: str) -> float:
    """An argparse ``type``: a finite number above 0 (seconds, bytes per second)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError(f"must be a positive number, got {text}")
    return value


def chain_help() -> str:
    """The help text of a CHAIN argument, listing the shipped examples."""
    return (
        f"a chain JSON file (offremat.chain/1) or a shipped example: {', '.join(examples.names())}"
    )


def load_chain(spec: str) -> Chain:
    """The chain in file ``spec``, or the shipped example of that name if no such file exists."""
    candidate = Path(spec)
    if not candidate.exists() and spec in examples.names():
        candidate = examples.path(spec)
    if not candidate.exists():
        raise UsageError(
            f"no chain file {spec!r}: give a path to an offremat.chain/1 JSON file or one of "
            f"the shipped examples ({', '.join(examples.names())})"
        )
    try:
        return Chain.load(candidate)
    except ChainFormatError as error:
        raise UsageError(f"{candidate}: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read chain file {candidate}: {error}") from None


def check_plot_path(path: str) -> None:
    """Refuse a plot path that is no PNG file path in an existing folder."""
    if Path(path).suffix.lower() != ".png":
        raise UsageError(f"the plot goes to a PNG file: give a path ending in .png, not {path!r}")
    if Path(path).is_dir():
        raise UsageError(f"{path} is a folder: give a PNG file path such as {path}/plan.png")
    if not Path(path).parent.is_dir():
        raise UsageError(f"{path}: no folder {Path(path).parent}; give a path in one that exists")


def draw_plan(chain: Chain, plan: Plan, path: str, budget_bytes: int | None = None) -> None:
    """Write the plan's timeline and memory curve to the PNG ``path`` (see offremat.plots).

    The path is written as given, or refused: matplotlib would add ``.png`` to a name without
    one, or pick another format from another suffix.
    """
    check_plot_path(path)
    # matplotlib loads only when a plot is asked for, so the other subcommands start fast.
    try:
        from offremat.plots import plot_plan
    except ImportError as error:
        raise UsageError(f"plotting needs matplotlib ({error}); pip install matplotlib") from None
    try:
        plot_plan(chain, plan, path, budget_bytes=budget_bytes)
    except OSError as error:
        raise UsageError(
            f"cannot write the plot to {path}: {error}; give a path in a writable folder"
        ) from None


def resolve_budget(text: str, chain: Chain) -> int:
    """Bytes from a budget as the user wrote it; a fraction is of the chain's keep-all peak."""
    try:
        return parse_budget(text, keep_all_peak(chain))
    except ValueError as error:
        raise UsageError(str(error)) from None
