"""The ``offremat`` command line: one subcommand per module of :mod:`offremat.commands`."""

from __future__ import annotations

import argparse
import logging
import os
import sys

from offremat.commands import (
    EXIT_FAILURE,
    EXIT_OK,
    EXIT_USAGE,
    UsageError,
    demo,
    plot,
    profile,
    solve,
    sweep,
)

# Adding a subcommand: a module in offremat/commands/ and one entry here.
COMMANDS = (solve, plot, profile, sweep, demo)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser with every subcommand of :data:`COMMANDS`."""
    parser = argparse.ArgumentParser(
        prog="offremat",
        description="Keep, offload or recompute each activation so that training fits a GPU "
        "memory budget.",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log what happens")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND")
    for module in COMMANDS:
        command = module.add_parser(subparsers)
        # SUPPRESS keeps a --verbose given before the subcommand from being reset.
        command.add_argument(
            "-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log more"
        )
        command.set_defaults(handler=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run ``offremat`` with ``argv`` (default: the process arguments); returns the exit status."""
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:
        return stop.code if isinstance(stop.code, int) else EXIT_USAGE
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command is None:
        parser.print_help(sys.stderr)
        return EXIT_USAGE
    try:
        status = args.handler(args)
        # Flush here, inside the handler for a reader gone away: a flush at interpreter exit
        # would raise it where nothing catches it (exit status 120).
        sys.stdout.flush()
        return status
    except UsageError as error:
        print(f"offremat {args.command}: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (`| head`): what it did not read is not an error. Point stdout
        # at devnull so that the interpreter's final flush does not raise again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK
    except OSError as error:
        # Output that cannot be written (a full disk): said in one line; what is still
        # buffered goes nowhere, or the interpreter's final flush would fail again.
        print(f"offremat {args.command}: error: cannot write: {error}", file=sys.stderr)
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_FAILURE


if __name__ == "__main__":
    raise SystemExit(main())
