"""``offremat profile``: measure a model on this machine and write its chain JSON."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import inspect
import logging
import sys
from pathlib import Path
from typing import Any

from rich.table import Table
from rich.text import Text

from offremat.commands import (
    EXIT_OK,
    PROFILE_THREADS,
    UsageError,
    add_bandwidth_option,
    add_threads_option,
    integer_at_least,
    report_console,
)
from solvers.budget import format_bytes
from solvers.chain import Chain

logger = logging.getLogger(__name__)

_CONVENTION = """\
MODEL is either the name of an in-repo model (gpt-tiny, gpt-small, gpt-medium, resnet-tiny,
resnet-small) or MODULE:CALLABLE, where MODULE is an importable module or a path to a .py
file. CALLABLE is called with no argument, or with batch_size=N when --batch N is given, and
returns (model, example_input). The model is any nn.Module, whose run of repeated blocks
(decoder layers, residual blocks) is the chain, or an nn.Sequential or a list of blocks, each
taking the previous block's output. example_input is what the model is called with: a
tensor, a tuple of positional arguments or a dict of keyword arguments (for an nn.Sequential,
the one input of its first block). For example, my_models.py holding

    def gpt(batch_size=8):
        model = build_my_gpt()
        return model, (tokens, targets)

is profiled with: offremat profile my_models.py:gpt --batch 16 --out gpt.json"""


def add_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``offremat profile``."""
    parser = subparsers.add_parser(
        "profile",
        help="measure a model's stages on this machine and write its chain JSON",
        description="Run a model's blocks on an example input and measure, per stage, the "
        "forward and backward times and the bytes the solvers plan with; write them as an "
        "offremat.chain/1 file for `offremat solve`. The blocks run in training mode, as a "
        "training step runs them (dropout saves its masks), as offremat.optimize profiles: a "
        "model built in eval mode is profiled in training mode.",
        epilog=_CONVENTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("model", metavar="MODEL", help="an in-repo model name or MODULE:CALLABLE")
    parser.add_argument("--out", "-o", required=True, metavar="CHAIN.json", help="where to write")
    parser.add_argument(
        "--stages",
        type=integer_at_least(1),
        metavar="N",
        help="group consecutive blocks into N stages",
    )
    parser.add_argument(
        "--batch",
        type=integer_at_least(1),
        metavar="N",
        help="batch size passed to the callable (batch_size=N)",
    )
    parser.add_argument(
        "--device", metavar="DEV", help="cpu, cuda or cuda:K (default: cuda when available)"
    )
    add_bandwidth_option(parser, "instead of measuring it (a CPU has no link otherwise)")
    parser.add_argument(
        "--warmup", type=integer_at_least(0), default=2, metavar="N", help="warm-up runs (2)"
    )
    parser.add_argument(
        "--repeats", type=integer_at_least(1), default=5, metavar="N", help="timed runs (5)"
    )
    parser.add_argument(
        "--blocks",
        metavar="PATH",
        help="the ModuleList or Sequential whose children are the chain (default: the model's "
        "longest run of repeated blocks)",
    )
    parser.add_argument("--name", metavar="NAME", help="the chain's name (default: MODEL)")
    add_threads_option(parser, None, PROFILE_THREADS)
    return parser


def run(args: argparse.Namespace) -> int:
    """Build the model, profile it, write the chain and print its stages."""
    import torch

    if args.threads is not None:
        torch.set_num_threads(args.threads)

    from offremat._blocks import NotAChainError
    from offremat._planning import in_training_mode
    from offremat._tensors import flatten, unflatten

    try:
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise UsageError(f"--device {args.device!r}: {error}") from None
    if device.type not in ("cpu", "cuda"):
        # Elsewhere nothing is timed as it runs (a meta tensor computes nothing at all).
        raise UsageError(f"--device {args.device!r}: offremat profiles on cpu or cuda")
    if device.type == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda asked for, but this machine has no CUDA device")
    bandwidth = args.bandwidth
    out = Path(args.out)
    if out.is_dir() or not out.parent.is_dir():  # say so before minutes of profiling
        raise UsageError(f"--out {args.out}: give a file path in an existing folder")
    model, example = _build(args.model, args.batch, getattr(args, "verbose", False))
    blocks = model if isinstance(model, (list, tuple)) else [model]
    if not all(isinstance(block, torch.nn.Module) for block in blocks):
        raise UsageError(
            f"{args.model} gave {type(model).__name__}, not a torch.nn.Module (or a list of "
            "them): return (model, example batch)"
        )
    tensors, structure = flatten(example)
    example = unflatten([t.to(device) for t in tensors], structure)
    if isinstance(model, (list, tuple)):
        model = [block.to(device) for block in model]
    else:
        model = model.to(device)
    options = {
        "stages": args.stages,
        "bandwidth": bandwidth,
        "warmup": args.warmup,
        "repeats": args.repeats,
        "name": args.name or args.model,
    }
    try:
        # A training step is what gets planned: a model built in eval mode (as from_pretrained
        # returns it) is profiled in training mode, where dropout saves its masks, as
        # offremat.optimize profiles it (in eval mode its stages measured 2/3 of the bytes).
        with in_training_mode(model):
            chain = _profile(model, example, args.blocks, options)
    except (NotAChainError, ValueError, TypeError) as error:
        raise UsageError(str(error)) from None
    except RuntimeError as error:  # the model's own forward or backward on its example
        if getattr(args, "verbose", False):
            raise
        raise UsageError(
            f"profiling {args.model} raised RuntimeError: {error} (run with -v for the traceback)"
        ) from None
    try:
        chain.save(args.out)
    except OSError as error:
        raise UsageError(f"cannot write the chain to {args.out}: {error}") from None
    _print_chain(chain, args.out)
    return EXIT_OK


def _profile(model: Any, example: Any, blocks: str | None, options: dict[str, Any]) -> Chain:
    """The chain of ``model`` (a model, an ``nn.Sequential`` or a list of blocks)."""
    import torch

    from offremat._discover import call_of
    from offremat._model_chain import (
        ModelChain,
        check_model_chain_output,
        model_chain_stages,
        profile_model_chain,
    )
    from offremat.profiler import profile_model

    listed = isinstance(model, (list, tuple, torch.nn.ModuleList))
    if listed or (isinstance(model, torch.nn.Sequential) and blocks is None):
        if blocks is not None:
            raise UsageError("--blocks names blocks inside a model; this one is a list")
        return profile_model(model, example, **options)
    call = call_of(model, example)
    found = ModelChain.find(model, call, blocks)
    chain = profile_model_chain(model, call, found, **options)
    check_model_chain_output(model, call, found, model_chain_stages(found, chain))
    return chain


def _build(spec: str, batch: int | None, verbose: bool = False) -> tuple[Any, Any]:
    """The (model, example_input) that MODEL names; see the convention in the help.

    A user's file is run with its folder on the import path, as ``python FILE`` would, so it
    can import its siblings; an error in it is reported in one line (``-v``: the traceback).
    """
    if ":" not in spec:
        from offremat.models import model_spec

        try:
            named = model_spec(spec)
        except ValueError as error:
            raise UsageError(f"{error}, or give MODULE:CALLABLE") from None
        return named.build(0), named.batch(batch or named.default_batch_size, 0, "cpu")
    module_name, _, attribute = spec.rpartition(":")
    # A file's folder, as ``python FILE`` would; for a module, the working directory, as
    # ``python -m`` would (a console script has neither on its path).
    folder = str(Path(module_name).resolve().parent) if module_name.endswith(".py") else None
    folder = folder or str(Path.cwd())
    sys.path.insert(0, folder)
    try:
        module = _run_user_code(lambda: _import(module_name), module_name, verbose)
        factory = getattr(module, attribute, None)
        if not callable(factory):
            raise UsageError(f"{module_name} has no callable {attribute!r}")
        kwargs = {} if batch is None else {"batch_size": batch}
        if kwargs and "batch_size" not in inspect.signature(factory).parameters:
            raise UsageError(f"--batch given but {attribute}() takes no batch_size argument")
        built = _run_user_code(lambda: factory(**kwargs), spec, verbose)
    finally:
        sys.path.remove(folder)
    if not isinstance(built, tuple) or len(built) != 2:
        raise UsageError(
            f"{spec} returned {type(built).__name__}; it must return (model, example_input)"
        )
    return built


def _run_user_code(work: Any, what: str, verbose: bool) -> Any:
    """Run the user's code; its error becomes one line (the traceback with -v)."""
    try:
        return work()
    except UsageError:
        raise
    except Exception as error:
        if verbose:
            raise
        raise UsageError(
            f"{what} raised {type(error).__name__}: {error} (run with -v for the traceback)"
        ) from None


def _import(name: str) -> Any:
    if name.endswith(".py"):
        path = Path(name)
        if not path.is_file():
            raise UsageError(f"no file {name}")
        # A name of its own: registering the file as its stem could shadow a module of that
        # name (a user's torch.py, say) for the rest of the run.
        loaded = importlib.util.spec_from_file_location(f"offremat_user_{path.stem}", path)
        assert loaded is not None and loaded.loader is not None
        module = importlib.util.module_from_spec(loaded)
        sys.modules[loaded.name] = module
        loaded.loader.exec_module(module)
        return module
    try:
        return importlib.import_module(name)
    except ImportError as error:
        hint = ""
        if error.name is not None and (name == error.name or name.startswith(error.name + ".")):
            # The module itself was not found, not a package it imports.
            path = name.replace(".", "/") + ".py"
            hint = f" (give a file's path, such as {path}:NAME, or run from its folder)"
        raise UsageError(f"cannot import {name!r}: {error}{hint}") from None


def _print_chain(chain: Chain, path: str) -> None:
    console = report_console()
    grouping = chain.metadata.get("grouping", {})
    device = chain.metadata.get("device")
    table = Table(title=Text(f"{chain.name}: {chain.length} stages on {device}"))
    for column, justify in (
        ("#", "right"),
        ("stage", "left"),
        ("blocks", "right"),
        ("fwd", "right"),
        ("bwd", "right"),
        ("out x", "right"),
        ("saved x̄", "right"),
    ):
        table.add_column(column, justify=justify)
    for index, stage in enumerate(chain.stages, start=1):
        table.add_row(
            str(index),
            Text(stage.name),
            str(len(grouping.get(stage.name, [stage.name]))),
            f"{stage.fwd_s * 1e3:.3f} ms",
            f"{stage.bwd_s * 1e3:.3f} ms",
            format_bytes(stage.out_bytes),
            format_bytes(stage.saved_bytes),
        )
    console.print(table)
    if chain.link is None:
        console.print("link: none (give --bandwidth to plan offloading)")
    else:
        console.print(
            f"link: device-to-host {format_bytes(chain.link.d2h_bytes_per_s)}/s, "
            f"host-to-device {format_bytes(chain.link.h2d_bytes_per_s)}/s"
        )
    console.print(f"input {format_bytes(chain.input_bytes)}; wrote {path}")
