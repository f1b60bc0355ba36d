"""The chain inside a model that is not an ``nn.Sequential``: its run of repeated blocks.

A transformer or a ResNet is a few layers of set-up code, a run of blocks that each take the
previous block's output, and a few layers at the end. offremat plans the run (the chain of
Herrmann, Beaumont et al. 2019) and leaves the code around it to plain autograd.

Design notes.

- Found by watching, not by tracing. The model is run once, eagerly, with forward hooks that
  record every module call: its first tensor argument (the hidden state), its other
  arguments, and its output. A run is a sequence of calls of modules of one type (or of one
  ``ModuleList``'s blocks) where each call takes the previous call's output as its hidden
  state. Its other arguments are the side
  inputs (attention masks, rotary embeddings, position ids): mostly the very same for every
  call, but layers that alternate kinds of attention take a mask per kind in turns, so each
  call's are numbered among the run's different ones (its ``pattern``). Nothing depends on the
  model's source, so a new release of a library changes nothing as long as its blocks are
  still called one after the other.
- Which run. The longest, preferring Hugging Face's ``GradientCheckpointingLayer`` (its mark
  on decoder and encoder layers), then the run whose blocks save the most activations
  (of an encoder and a decoder as deep, the one that reads the longer sequence, unless it is
  frozen), then the run holding the most parameters. ResNet's
  ``BasicBlock`` calls form one run across ``layer1``...``layer4``: a ``Sequential`` hands its
  input to its first child unchanged. The layers of a hybrid model, blocks of several types
  called from one ``ModuleList`` (Jamba's attention and Mamba layers), form a run too (see
  :mod:`offremat._block_runs`). ``blocks="model.layers"`` names the container instead.
- Side values other than tensors are kept as they are when they are plain data (None, numbers,
  strings, dtypes). A Hugging Face key-value cache is dropped and ``use_cache`` set to False,
  as Hugging Face's own gradient checkpointing does in training: blocks that are recomputed
  must not append to a cache twice. Any other object is refused, because a recomputation
  would see it in whatever state the blocks left it.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

from torch import nn

from offremat._block_runs import block_type, chain_break, hybrid_runs, preference, runs_of
from offremat._block_values import hidden_output
from offremat._blocks import NotAChainError
from offremat._discover_refusals import (
    cut_at_reads,
    end_of,
    is_scripted,
    no_run_message,
    position_of,
    read_elsewhere,
    refuse_callers_checkpoint,
    refuse_layer_drop,
    refuse_other_readers,
    refuse_random_runs,
    refuse_skipping_blocks,
    scripted_note,
    unread_ends,
)
from offremat._record import RecordedCall, record_calls
from offremat._side_patterns import other_sides, same_side_parts, side_patterns
from offremat._tensors import Structure

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class BlockCall:
    """One call of the chain: the module, its path, and how it takes and returns the state.

    ``hidden_keyword`` is the keyword the hidden state was passed under (None: the first
    positional argument); ``output`` is the structure of what the module returns, the hidden
    state its first tensor; ``side`` says whether it takes the run's side inputs;
    ``passed`` says, for each of its output's other tensors, which of its side arguments it
    is (("arg", position) or ("kwarg", name): a position bias handed on, as T5's blocks
    return theirs), or None: one the model drops. ``pattern`` numbers the side arguments it
    takes among the run's (layers alternating sliding-window and full attention take two
    masks in turn); ``nth`` counts the module's calls before this one.
    """

    path: str
    module: nn.Module
    hidden_keyword: str | None
    output: Structure
    side: bool
    passed: tuple[tuple[str, Any] | None, ...] = ()
    pattern: int = 0
    nth: int = 0


@dataclass(frozen=True)
class BlockRun:
    """The calls that form the chain, in order, and the chain blocks they make (``units``).

    A unit is one call, or a call with the in-place calls after it (``ReLU(inplace=True)``),
    which must share its block: a block never changes its input in place.
    """

    calls: tuple[BlockCall, ...]
    units: tuple[tuple[int, ...], ...]
    # Whether every call returned a state of its input's shape on the example batch: then
    # the chain's output has each block's shape, which the model may ask of a block's.
    keeps_shape: bool = True

    @property
    def paths(self) -> list[str]:
        """The module path of each call, in order."""
        return [call.path for call in self.calls]

    @property
    def patterns(self) -> int:
        """How many different sets of side arguments the run's blocks take."""
        return 1 + max(call.pattern for call in self.calls)


class Call(NamedTuple):
    """The arguments of one call of a model."""

    args: tuple[Any, ...]
    kwargs: dict[str, Any]


def as_call(batch: Any) -> Call:
    """``batch`` as a call: a dict as keywords, a tuple as arguments, else one input."""
    if isinstance(batch, Call):
        return batch
    if isinstance(batch, dict):
        return Call((), dict(batch))
    if isinstance(batch, tuple):
        return Call(batch, {})
    return Call((batch,), {})


def call_of(model: nn.Module, batch: Any) -> Call:
    """How ``model`` is called with ``batch``: :func:`as_call`, except that an
    ``nn.Sequential`` takes its batch as its one input (a tuple too, as it runs its chain)."""
    if isinstance(model, nn.Sequential) and not isinstance(batch, Call):
        return Call((batch,), {})
    return as_call(batch)


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` with ``batch`` (see :func:`as_call`)."""
    call = as_call(batch)
    return model(*call.args, **call.kwargs)


def find_block_run(
    model: nn.Module,
    run_model: Callable[[], Any],
    blocks: str | None = None,
    same_sides: bool = False,
) -> BlockRun:
    """The run of repeated blocks that ``run_model()`` calls (``blocks`` names its container);
    with ``same_sides``, one whose blocks all take the same side inputs (for a model that
    reads a block's output between calls, which a chain of several patterns runs later)."""
    records, returned = record_calls(model, run_model)
    # Run again, the random generators moved on: see refuse_random_runs.
    again, _ = record_calls(model, run_model)
    if blocks is not None:
        container = _container(model, blocks)
        children = {id(child) for child in container.children()}
        called = [r for r in records if id(r.module) in children]
        if (
            not called
            and children
            and all(isinstance(c, nn.ModuleList) for c in container.children())
        ):
            raise NotAChainError(
                f"blocks={blocks!r} holds ModuleLists, which the model never calls itself: "
                f"name one whose children it calls, such as blocks={blocks + '.0'!r}"
            )
        candidates = [_chained(called, blocks)]
        for reader, member in read_elsewhere(records, candidates[0]):
            raise NotAChainError(
                f"blocks={blocks!r}: {reader.path} reads {member.path}'s output, which a chain "
                "does not keep for anything but the next block; leave blocks= unset, and the "
                "blocks after the last one read can be the chain"
            )
        if same_sides and len(parts := same_side_parts(candidates[0])) > 1:
            reason = other_sides(parts[0][-1], parts[1][0])
            raise NotAChainError(f"blocks={blocks!r}: the blocks are not a chain: {reason}")
    else:
        by_type: dict[type, list[RecordedCall]] = {}
        for record in records:
            by_type.setdefault(block_type(record.module), []).append(record)
        whole = [run for group in by_type.values() for run in runs_of(group)]
        blocks_of_runs = {r.path for run in whole if len(run) >= 2 for r in run}
        # Cut where a call outside reads a block's output: the pieces after can be chains.
        candidates = [piece for run in whole for piece in cut_at_reads(records, run)]
        # A hybrid run is a candidate more: one refused must not refuse the model.
        candidates += [
            piece
            for run in hybrid_runs(model, records, blocks_of_runs)
            for piece in cut_at_reads(records, run)
            if _never_refused(model, records, again, piece)
        ]
        if same_sides:
            candidates = [part for run in candidates for part in same_side_parts(run)]
        candidates = [run for run in candidates if len(run) >= 2]
        if not candidates:
            whole = [run for run in whole if len(run) >= 2]
            if whole:  # each read apart: say what reads them
                refuse_other_readers(records, max(whole, key=preference))
            raise NotAChainError(no_run_message(model, _containers(model)))
    best = max(candidates, key=preference)
    first = best[0]
    prefix: list[RecordedCall] = []
    suffix: list[RecordedCall] = []
    if blocks is None and all(not r.side[0] and _no_values(r.side[1]) for r in best):
        # Blocks that take nothing but the state: the stem before them and the pooling after
        # them are chain blocks too (a ResNet's stem holds much of its activation memory).
        prefix, suffix = _stem(records, first), _tail(records, best[-1])
        # An output the model also returns (the features beside the logits) is no
        # intermediate state: the chain ends there, or starts after it.
        ends = [k for k, r in enumerate((best[-1], *suffix)) if r.output in returned]
        suffix = suffix[: ends[0]] if ends else suffix
        starts = [k for k, r in enumerate(prefix) if r.output in returned]
        prefix = prefix[starts[-1] + 1 :] if starts else prefix
        prefix, suffix = unread_ends(records, prefix, best, suffix)
    members = [*prefix, *best, *suffix]
    if blocks is None:
        same_depth = [r for r in by_type[block_type(first.module)] if r.depth == first.depth]
        _warn_of_a_partial_run(records, same_depth, members)
    refuse_layer_drop(model, best)
    refuse_random_runs(model, best, records, again)
    refuse_skipping_blocks(best, again)
    refuse_other_readers(records, members)
    refuse_callers_checkpoint(members)
    added = {id(r) for r in (*prefix, *suffix)}
    patterns = side_patterns(best)
    calls = tuple(
        BlockCall(
            r.path,
            r.module,
            r.hidden_keyword,
            hidden_output(r.output_structure),
            id(r) not in added,
            r.passed,
            patterns.get(id(r), 0),
            r.nth,
        )
        for r in members
    )
    units: list[list[int]] = []
    for index, record in enumerate(members):
        if units and record.in_place:
            units[-1].append(index)
        else:
            units.append([index])
    logger.info(
        "chain: %d calls, %s .. %s (%d of %s)",
        len(members),
        members[0].path,
        members[-1].path,
        len(best),
        ", ".join(sorted({block_type(r.module).__name__ for r in best})),
    )
    keeps = all(r.keeps_shape for r in members)
    return BlockRun(calls, tuple(tuple(unit) for unit in units), keeps)


def _never_refused(
    model: nn.Module,
    records: list[RecordedCall],
    again: list[RecordedCall],
    run: list[RecordedCall],
) -> bool:
    """Whether the refusals of a chosen run (other readers of a block's output, blocks
    skipped or dropped, random runs, the caller's checkpoint) all pass ``run``."""
    try:
        refuse_layer_drop(model, run)
        refuse_random_runs(model, run, records, again)
        refuse_skipping_blocks(run, again)
        refuse_other_readers(records, run)
        refuse_callers_checkpoint(run)
    except NotAChainError:
        return False
    return True


def _no_values(structure: Structure) -> bool:
    """Whether side arguments hold nothing but empty containers."""
    if structure.kind == "value":
        return False
    return all(_no_values(child) for child in structure.children)


def _stem(records: list[RecordedCall], first: RecordedCall) -> list[RecordedCall]:
    """The calls before ``first`` that make its input, outermost first, each from the last."""
    chosen: list[RecordedCall] = []
    target = first.hidden
    end = position_of(records, first)
    while target is not None:
        producers = [
            (-r.depth, k)
            for k, r in enumerate(records[:end])
            if r.state_only and r.output == target
        ]
        if not producers:
            break
        # The outermost call, and of those the last: an in-place call returns its input.
        producer = records[max(producers)[1]]
        chosen.insert(0, producer)
        end = position_of(records, producer)
        target = producer.hidden
    while chosen and chosen[0].in_place:  # a chain input is never changed in place
        chosen.pop(0)
    return chosen


def _tail(records: list[RecordedCall], last: RecordedCall) -> list[RecordedCall]:
    """The calls after ``last`` that take its output, each the previous one's: each the first
    call to read it, where that takes nothing else (a decoder layer that takes the encoder's
    output beside its own state ends the tail; the key projection inside it is no tail)."""
    chosen: list[RecordedCall] = []
    target = last.output
    start = end_of(records, last)
    while target is not None:
        reader = next(
            (r for r in records[start:] if r.hidden == target or target in r.side[0]), None
        )
        taker = reader if reader is not None and reader.state_only else None
        if taker is None:
            break
        chosen.append(taker)
        target = taker.output
        start = end_of(records, taker)
    return chosen


def _container(model: nn.Module, path: str) -> nn.Module:
    try:
        container = model.get_submodule(path)
    except AttributeError:
        raise NotAChainError(
            f"blocks={path!r}: {type(model).__name__} has no submodule {path!r}; name a "
            f"ModuleList or Sequential such as {_containers(model)[:3]}"
        ) from None
    scripted = [name for name, child in container.named_children() if is_scripted(child)]
    if is_scripted(container) or scripted:
        raise NotAChainError(
            f"blocks={path!r}: {scripted_note([f'{path}.{name}' for name in scripted] or [path])}"
        )
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise NotAChainError(
            f"blocks={path!r} is a {type(container).__name__}; name a ModuleList or Sequential "
            f"whose children are the blocks, such as {_containers(model)[:3]}"
        )
    return container


def _chained(records: list[RecordedCall], where: str) -> list[RecordedCall]:
    """``records`` if each takes the previous one's output as its hidden state."""
    if len(records) < 2:
        raise NotAChainError(
            f"blocks={where!r}: the model called {len(records)} of its blocks; a chain needs two "
            "or more blocks called one after the other"
        )
    for previous, record in itertools.pairwise(records):
        reason = chain_break(previous, record)
        if reason is not None:
            raise NotAChainError(f"blocks={where!r}: the blocks are not a chain: {reason}")
    return records


def _warn_of_a_partial_run(
    records: list[RecordedCall], group: list[RecordedCall], members: list[RecordedCall]
) -> None:
    """Say so when the chain leaves out calls of its block type at its depth (``group``):
    they run outside the chain and keep all their activations, which no budget can change."""
    inside = [k for k, record in enumerate(group) if any(record is m for m in members)]
    if not inside or len(inside) == len(group):
        return
    first, last = inside[0], inside[-1]
    # The break next to the chain: before its first block, else after its last.
    if first > 0:
        previous, record = group[first - 1], group[first]
    elif last + 1 < len(group):
        previous, record = group[last], group[last + 1]
    else:
        return
    logger.warning(
        "the chain holds %d of the model's %d calls of %s (%s .. %s): the run breaks "
        "between %s and %s, where %s. The calls outside the chain keep all their "
        "activations. Name the container of the blocks you mean with blocks= to plan those "
        "instead, where they form a chain",
        len(inside),
        len(group),
        type(record.module).__name__,
        group[first].path,
        group[last].path,
        previous.path,
        record.path,
        chain_break(previous, record)
        or other_sides(previous, record)
        or next(
            (
                f"{reader.path} reads {previous.path}'s output, which a chain keeps for the "
                "next block only"
                for reader, _ in read_elsewhere(records, [previous, record])
            ),
            "they are not called one after the other",
        ),
    )


def _containers(model: nn.Module) -> list[str]:
    return [
        path
        for path, module in model.named_modules()
        if path and isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2
    ]
