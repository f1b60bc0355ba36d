"""The chain inside a model that is not an ``nn.Sequential``: its run of repeated blocks.

A transformer or a ResNet is a few layers of set-up code, a run of blocks that each take the
previous block's output, and a few layers at the end. offremat plans the run (the chain of
Herrmann, Beaumont et al. 2019) and leaves the code around it to plain autograd.

Design notes.

- Found by watching, not by tracing. The model is run once, eagerly, with forward hooks that
  record every module call: its first tensor argument (the hidden state), its other
  arguments, and its output. A run is a sequence of calls of modules of one type where each
  call takes the previous call's output as its hidden state and the very same other arguments
  (the side inputs: attention masks, rotary embeddings, position ids). Nothing depends on the
  model's source, so a new release of a library changes nothing as long as its blocks are
  still called one after the other.
- Which run. The longest, preferring Hugging Face's ``GradientCheckpointingLayer`` (its mark
  on decoder and encoder layers), then the run holding the most parameters. ResNet's
  ``BasicBlock`` calls form one run across ``layer1``...``layer4``: a ``Sequential`` hands its
  input to its first child unchanged. ``blocks="model.layers"`` names the container instead.
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
from typing import Any

import torch
from torch import nn

from offremat._blocks import NotAChainError
from offremat._tensors import Structure, flatten, unflatten

logger = logging.getLogger(__name__)

_PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.device)


@dataclass(frozen=True)
class BlockCall:
    """One call of the chain: the module, its path, and how it takes and returns the state.

    ``hidden_keyword`` is the keyword the hidden state was passed under (None: the first
    positional argument); ``output`` is the structure of what the module returns, with the
    hidden state as its one tensor; ``side`` says whether it takes the run's side inputs.
    """

    path: str
    module: nn.Module
    hidden_keyword: str | None
    output: Structure
    side: bool


@dataclass(frozen=True)
class BlockRun:
    """The calls that form the chain, in order, and the chain blocks they make (``units``).

    A unit is one call, or a call with the in-place calls after it (``ReLU(inplace=True)``),
    which must share its block: a block never changes its input in place.
    """

    calls: tuple[BlockCall, ...]
    units: tuple[tuple[int, ...], ...]

    @property
    def paths(self) -> list[str]:
        """The module path of each call, in order."""
        return [call.path for call in self.calls]


@dataclass
class _Recorded:
    path: str
    module: nn.Module
    depth: int
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    output: Any = None


def call_model(model: nn.Module, batch: Any) -> Any:
    """Call ``model`` with ``batch``: a dict as keywords, a tuple as arguments, else one input."""
    if isinstance(batch, dict):
        return model(**batch)
    if isinstance(batch, tuple):
        return model(*batch)
    return model(batch)


def find_block_run(
    model: nn.Module, run_model: Callable[[], Any], blocks: str | None = None
) -> tuple[BlockRun, Any]:
    """The run of repeated blocks that ``run_model()`` calls, and the chain's first input.

    The first input is ``(hidden, args, kwargs)``: what the run's first block received, with
    side values made safe to recompute (see the design notes).
    """
    records = _record_calls(model, run_model)
    if blocks is not None:
        container = _container(model, blocks)
        children = {id(child) for child in container.children()}
        candidates = [_chained([r for r in records if id(r.module) in children], blocks)]
    else:
        by_type: dict[type, list[_Recorded]] = {}
        for record in records:
            by_type.setdefault(type(record.module), []).append(record)
        candidates = [run for group in by_type.values() for run in _runs(group)]
        candidates = [run for run in candidates if len(run) >= 2]
        if not candidates:
            raise NotAChainError(_no_run_message(model))
    best = max(candidates, key=_preference)
    first = best[0]
    if any(_cache_in(value) for value in (*first.args, *first.kwargs.values())):
        logger.warning(
            "the blocks' key-value cache is not filled in training steps (as with Hugging "
            "Face's gradient checkpointing): recomputed blocks would fill it twice"
        )
    side = _side_inputs(first)
    prefix: list[_Recorded] = []
    suffix: list[_Recorded] = []
    if blocks is None and not side[0] and not side[1]:
        # Blocks that take nothing but the state: the stem before them and the pooling after
        # them are chain blocks too (a ResNet's stem holds much of its activation memory).
        prefix, suffix = _stem(records, first), _tail(records, best[-1])
    members = [*prefix, *best, *suffix]
    added = {id(r) for r in (*prefix, *suffix)}
    calls = tuple(
        BlockCall(
            r.path,
            r.module,
            None if _hidden_position(r) == 0 else "hidden_states",
            _hidden_output(flatten(r.output)[1]),
            id(r) not in added,
        )
        for r in members
    )
    units: list[list[int]] = []
    for index, record in enumerate(members):
        if units and _in_place(record):
            units[-1].append(index)
        else:
            units.append([index])
    logger.info(
        "chain: %d calls, %s .. %s (%d of %s)",
        len(members),
        members[0].path,
        members[-1].path,
        len(best),
        type(first.module).__name__,
    )
    run = BlockRun(calls, tuple(tuple(unit) for unit in units))
    return run, (_hidden(members[0]), *side)


def _in_place(record: _Recorded) -> bool:
    """Whether the call returned its own input (changed in place, as ``ReLU(inplace=True)``)."""
    outputs = flatten(record.output)[0]
    return _hidden_position(record) is not None and bool(outputs) and outputs[0] is _hidden(record)


def _state_only(record: _Recorded) -> bool:
    """Whether the call takes the state alone and returns one tensor."""
    tensors, _ = flatten(record.output)
    return (
        len(record.args) == 1
        and isinstance(record.args[0], torch.Tensor)
        and not record.kwargs
        and len(tensors) == 1
    )


def _stem(records: list[_Recorded], first: _Recorded) -> list[_Recorded]:
    """The calls before ``first`` that make its input, outermost first, each from the last."""
    chosen: list[_Recorded] = []
    target = _hidden(first)
    end = _index(records, first)
    while True:
        producers = [
            (-r.depth, k)
            for k, r in enumerate(records[:end])
            if _state_only(r) and flatten(r.output)[0][0] is target
        ]
        if not producers:
            break
        # The outermost call, and of those the last: an in-place call returns its input.
        producer = records[max(producers)[1]]
        chosen.insert(0, producer)
        end = _index(records, producer)
        target = producer.args[0]
    while chosen and _in_place(chosen[0]):  # a chain input is never changed in place
        chosen.pop(0)
    return chosen


def _tail(records: list[_Recorded], last: _Recorded) -> list[_Recorded]:
    """The calls after ``last`` that take its output, each the previous one's."""
    chosen: list[_Recorded] = []
    target = flatten(last.output)[0][0]
    start = _after(records, last)
    while True:
        taker = next((r for r in records[start:] if _state_only(r) and r.args[0] is target), None)
        if taker is None:
            return chosen
        chosen.append(taker)
        target = flatten(taker.output)[0][0]
        start = _after(records, taker)


def _index(records: list[_Recorded], record: _Recorded) -> int:
    return next(k for k, r in enumerate(records) if r is record)


def _after(records: list[_Recorded], record: _Recorded) -> int:
    """The index just past ``record`` and the calls made inside it."""
    k = _index(records, record) + 1
    while k < len(records) and records[k].depth > record.depth:
        k += 1
    return k


def side_inputs_of(
    call: BlockCall, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, Any]:
    """The hidden state a call of ``call`` received, and its side inputs made safe."""
    record = _Recorded(call.path, call.module, 0, args, kwargs)
    return _hidden(record), _side_inputs(record)


def hidden_of(output: Any, path: str) -> torch.Tensor:
    """The hidden state a block returned; refuse other tensors, which the chain cannot carry."""
    tensors, _ = flatten(output)
    if not tensors or not isinstance(tensors[0], torch.Tensor):
        raise NotAChainError(f"block {path} returned no tensor: a block must return its output")
    if len(tensors) > 1:
        raise NotAChainError(
            f"block {path} returned {len(tensors)} tensors (attention weights or a cache, say); "
            "offremat chains blocks that return their hidden state alone: call the model "
            "without output_attentions and with use_cache=False"
        )
    return tensors[0]


def block_output(call: BlockCall, hidden: torch.Tensor) -> Any:
    """What ``call``'s module returns, with ``hidden`` as its hidden state."""
    return unflatten([hidden], call.output)


def _record_calls(model: nn.Module, run_model: Callable[[], Any]) -> list[_Recorded]:
    records: list[_Recorded] = []
    open_calls: list[_Recorded] = []

    def before(path: str, module: nn.Module, args: Any, kwargs: Any) -> None:
        record = _Recorded(path, module, len(open_calls), tuple(args), dict(kwargs))
        records.append(record)
        open_calls.append(record)

    def after(module: nn.Module, args: Any, kwargs: Any, output: Any) -> None:
        open_calls.pop().output = output

    handles = []
    for path, module in model.named_modules(remove_duplicate=False):
        if module is model:
            continue
        handles.append(module.register_forward_pre_hook(_bound(before, path), with_kwargs=True))
        handles.append(module.register_forward_hook(after, with_kwargs=True))
    # With gradients on, as in training, so that the recorded inputs say which of them carry
    # a gradient; saved tensors are dropped at once, so memory is that of a forward without.
    try:
        with torch.enable_grad(), torch.autograd.graph.saved_tensors_hooks(_drop, _drop):
            run_model()
    finally:
        for handle in handles:
            handle.remove()
    # A module listed under two paths is called once per call, not once per path.
    seen: set[int] = set()
    unique = []
    for record in records:
        if id(record) not in seen:
            seen.add(id(record))
            unique.append(record)
    return unique


def _drop(_: Any) -> None:
    return None


def _bound(function: Callable[..., None], path: str) -> Callable[..., None]:
    """``function`` with its first argument fixed (a hook that knows its module's path)."""

    def hook(module: nn.Module, args: Any, kwargs: Any) -> None:
        function(path, module, args, kwargs)

    return hook


def _container(model: nn.Module, path: str) -> nn.Module:
    try:
        container = model.get_submodule(path.removeprefix("model."))
    except AttributeError:
        raise NotAChainError(
            f"blocks={path!r}: {type(model).__name__} has no submodule {path!r}; name a "
            f"ModuleList or Sequential such as {_containers(model)[:3]}"
        ) from None
    if not isinstance(container, (nn.ModuleList, nn.Sequential)):
        raise NotAChainError(
            f"blocks={path!r} is a {type(container).__name__}; name a ModuleList or Sequential "
            f"whose children are the blocks, such as {_containers(model)[:3]}"
        )
    return container


def _chained(records: list[_Recorded], where: str) -> list[_Recorded]:
    """``records`` if each takes the previous one's output and the same side inputs."""
    if len(records) < 2:
        raise NotAChainError(
            f"blocks={where!r}: the model called {len(records)} of its blocks; a chain needs two "
            "or more blocks called one after the other"
        )
    for previous, record in itertools.pairwise(records):
        if not _follows(previous, record):
            raise NotAChainError(
                f"blocks={where!r}: {record.path} does not take {previous.path}'s output and the "
                "same other arguments, so the blocks are not a chain"
            )
    return records


def _runs(group: list[_Recorded]) -> list[list[_Recorded]]:
    """Maximal runs of consecutive calls of one type that form a chain."""
    runs: list[list[_Recorded]] = []
    for record in group:
        if runs and _follows(runs[-1][-1], record):
            runs[-1].append(record)
        else:
            runs.append([record])
    return runs


def _follows(previous: _Recorded, record: _Recorded) -> bool:
    if previous.depth != record.depth or _hidden_position(record) is None:
        return False
    try:
        out = hidden_of(previous.output, previous.path)
    except NotAChainError:
        return False
    if _hidden(record) is not out:
        return False
    return _same_side(_side_inputs(previous, strict=False), _side_inputs(record, strict=False))


def _same_side(a: Any, b: Any) -> bool:
    tensors_a, structure_a = flatten(a)
    tensors_b, structure_b = flatten(b)
    return (
        len(tensors_a) == len(tensors_b)
        and all(x is y for x, y in zip(tensors_a, tensors_b, strict=True))
        and _same_structure(structure_a, structure_b)
    )


def _same_structure(a: Structure, b: Structure) -> bool:
    if a.kind != b.kind or len(a.children) != len(b.children):
        return False
    if a.kind == "value" and a.value is not b.value and a.value != b.value:
        return False
    return all(_same_structure(x, y) for x, y in zip(a.children, b.children, strict=True))


def _hidden_position(record: _Recorded) -> int | None:
    if record.args and isinstance(record.args[0], torch.Tensor):
        return 0
    if isinstance(record.kwargs.get("hidden_states"), torch.Tensor):
        return -1
    return None


def _hidden(record: _Recorded) -> torch.Tensor:
    if _hidden_position(record) == 0:
        return record.args[0]
    return record.kwargs["hidden_states"]


def _side_inputs(record: _Recorded, strict: bool = True) -> tuple[tuple[Any, ...], dict[str, Any]]:
    if _hidden_position(record) == 0:
        args, kwargs = record.args[1:], dict(record.kwargs)
    else:
        args = record.args
        kwargs = {k: v for k, v in record.kwargs.items() if k != "hidden_states"}
    if not strict:
        return args, kwargs
    args = tuple(_safe_value(value, f"argument {k + 1}", record) for k, value in enumerate(args))
    kwargs = {key: _safe_value(value, f"argument {key!r}", record) for key, value in kwargs.items()}
    if kwargs.get("use_cache") is True:
        kwargs["use_cache"] = False
    return args, kwargs


def _safe_value(value: Any, name: str, record: _Recorded) -> Any:
    if isinstance(value, (torch.Tensor, *_PLAIN_VALUES)):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_safe_value(item, name, record) for item in value)
    if isinstance(value, dict):
        return {key: _safe_value(item, name, record) for key, item in value.items()}
    if _is_kv_cache(value):
        return None
    raise NotAChainError(
        f"{record.path} takes {name} of type {type(value).__name__}, which offremat cannot "
        "recompute safely (a block could change it); pass tensors and plain values to the "
        "blocks, or name other blocks with blocks="
    )


def _cache_in(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(_cache_in(item) for item in value)
    if isinstance(value, dict):
        return any(_cache_in(item) for item in value.values())
    return _is_kv_cache(value)


def _is_kv_cache(value: Any) -> bool:
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
        for cls in type(value).__mro__
    )


def _hidden_output(output: Structure) -> Structure:
    """A block's output structure, checked to hold the hidden state as its only tensor."""
    count = _tensor_count(output)
    if count != 1:
        raise NotAChainError(
            f"the blocks return {count} tensors; offremat chains blocks that return their "
            "hidden state alone: call the model without output_attentions and with "
            "use_cache=False"
        )
    return output


def _tensor_count(structure: Structure) -> int:
    if structure.kind == "tensor":
        return 1
    return sum(_tensor_count(child) for child in structure.children)


def _preference(run: list[_Recorded]) -> tuple[bool, int, int]:
    marked = any(
        cls.__name__ == "GradientCheckpointingLayer" for cls in type(run[0].module).__mro__
    )
    parameters = sum(p.numel() for r in run for p in r.module.parameters())
    return marked, len(run), parameters


def _containers(model: nn.Module) -> list[str]:
    return [
        path
        for path, module in model.named_modules()
        if isinstance(module, (nn.ModuleList, nn.Sequential)) and len(module) >= 2
    ]


def _no_run_message(model: nn.Module) -> str:
    containers = _containers(model)
    hint = (
        f"offremat.optimize(model, batch, blocks={containers[0]!r}, ...)"
        if containers
        else "blocks='path.to.container' (a ModuleList or Sequential of two or more blocks), or "
        "pass offremat.optimize(nn.Sequential(block0, block1, ...), x, ...)"
    )
    return (
        f"found no run of repeated blocks in {type(model).__name__}: no two calls of one module "
        f"type take each other's output. Name the blocks with {hint}"
    )
