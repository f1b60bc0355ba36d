"""The values a block call takes and returns: its hidden state, and side inputs made safe.

A block of the chain receives the previous block's hidden state and side inputs (masks,
position embeddings, flags): every block the same ones, or each block those of its pattern
(layers alternating sliding-window and full attention take two masks in turn). Side inputs
are passed through every stage, so they must be values a block cannot change: tensors and
plain values. Hugging Face's
KV caches are dropped (and ``use_cache`` set False), as its gradient checkpointing does.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_leaves

from offremat._blocks import NotAChainError
from offremat._record import split_hidden
from offremat._tensors import Structure, flatten, same_structure, unflatten

if TYPE_CHECKING:
    from offremat._discover import BlockRun

_PLAIN_VALUES = (type(None), bool, int, float, str, torch.dtype, torch.device)


def side_inputs_of(
    path: str, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> tuple[torch.Tensor, Any]:
    """The hidden state a call of the block at ``path`` received, and its side inputs made
    safe."""
    hidden, side_args, side_kwargs = split_hidden(args, kwargs)
    if hidden is None:
        raise NotAChainError(f"{path} was called without a tensor for its hidden state")
    safe_args = tuple(
        _safe_value(value, f"argument {k + 1}", path) for k, value in enumerate(side_args)
    )
    safe_kwargs = {
        key: _safe_value(value, f"argument {key!r}", path) for key, value in side_kwargs.items()
    }
    if safe_kwargs.get("use_cache") is True:
        safe_kwargs["use_cache"] = False
    return hidden, (safe_args, safe_kwargs)


Side = tuple[tuple[Any, ...], dict[str, Any]]
"""The side arguments of a block's call: ``(args, kwargs)``."""


@dataclass(frozen=True)
class SameAs:
    """In a pattern's side inputs, a tensor an earlier pattern's hold already: the ``index``-th
    tensor of pattern ``pattern``'s. Each tensor is then one input of the chain, so its
    gradient adds up stage by stage, in plain autograd's order; as two inputs, one per
    pattern, their sums were added at the end (a residual input ``x0`` every block takes:
    gradients apart by rounding)."""

    pattern: int
    index: int


def shared_sides(sides: Sequence[Side]) -> tuple[Side, ...]:
    """The patterns' side inputs, each tensor an earlier pattern holds as :class:`SameAs`."""
    seen: dict[int, SameAs] = {}
    shared = []
    for pattern, side in enumerate(sides):
        tensors, structure = flatten(side)
        kept: list[Any] = []
        mine: dict[int, SameAs] = {}
        count = 0  # the tensors kept: a SameAs left in their places is no tensor of the side
        for tensor in tensors:
            if id(tensor) in seen:
                kept.append(seen[id(tensor)])
            else:
                mine.setdefault(id(tensor), SameAs(pattern, count))
                kept.append(tensor)
                count += 1
        seen.update(mine)
        shared.append(unflatten(kept, structure))
    return tuple(shared)


def side_of(sides: Sequence[Side], pattern: int) -> Side:
    """Pattern ``pattern``'s side inputs, from :func:`shared_sides`'s."""
    return sides[0] if len(sides) == 1 else _resolved(sides[pattern], sides)


def _resolved(item: Any, sides: Sequence[Side]) -> Any:
    if isinstance(item, SameAs):
        return flatten(sides[item.pattern])[0][item.index]
    if isinstance(item, (tuple, list)):
        return type(item)(_resolved(child, sides) for child in item)
    if isinstance(item, dict):
        return {key: _resolved(child, sides) for key, child in item.items()}
    return item


def continues_run(
    args: tuple[Any, ...],
    kwargs: dict[str, Any],
    output: torch.Tensor | None,
    sides: Sequence[tuple[tuple[Any, ...], dict[str, Any]]],
) -> bool:
    """Whether a call of a block with ``args`` and ``kwargs`` takes the run's ``output`` as its
    hidden state and side inputs of the run (one of its ``sides``): by the rule the run was
    found with, a further block of it (a depth chosen per step), which would run outside the
    plan. A call with other inputs (a block used again elsewhere) is the model's own code."""
    if output is None or split_hidden(args, kwargs)[0] is not output:
        return False
    try:
        _, this_side = side_inputs_of("", args, kwargs)
    except NotAChainError:  # an argument no block of the run takes: not a further block
        return False
    return any(same_values(this_side, side) for side in sides)


def same_values(a: Any, b: Any) -> bool:
    """Whether two argument structures hold the very same tensors and equal other values."""
    tensors_a, structure_a = flatten(a)
    tensors_b, structure_b = flatten(b)
    return (
        len(tensors_a) == len(tensors_b)
        and all(x is y for x, y in zip(tensors_a, tensors_b, strict=True))
        and same_structure(structure_a, structure_b)
    )


def hidden_of(output: Any, path: str, expected: Structure) -> torch.Tensor:
    """The hidden state a block returned (its first tensor), the structure of its output
    checked against the one it had when the chain was found (``expected``)."""
    tensors, _ = flatten(output)
    if not tensors or not isinstance(tensors[0], torch.Tensor):
        raise NotAChainError(f"block {path} returned no tensor: a block must return its output")
    if len(tensors) != _tensor_count(expected):
        raise NotAChainError(
            f"block {path} returned {len(tensors)} tensors where it returned "
            f"{_tensor_count(expected)} when the chain was found (attention weights or a "
            "cache, say): offremat hands on a block's hidden state alone; call the model "
            "without output_attentions and with use_cache=False"
        )
    return tensors[0]


def block_output(
    output: Structure,
    hidden: torch.Tensor,
    path: str,
    passed: Sequence[tuple[str, Any] | None],
    side: tuple[tuple[Any, ...], dict[str, Any]],
) -> Any:
    """What the block at ``path``, whose output has structure ``output``, returns to the
    model: ``hidden`` in its place, and for its other tensors the side argument of this call
    (``side``) it hands back (``passed``), else a :class:`Dropped` stand-in: the chain drops
    them."""
    count = _tensor_count(output)
    others = [
        Dropped.of(path, k + 2, count) if place is None else _side_argument(side, place, path)
        for k, place in enumerate(passed)
    ]
    return unflatten([hidden, *others], output)


def _side_argument(
    side: tuple[tuple[Any, ...], dict[str, Any]], place: tuple[str, Any], path: str
) -> torch.Tensor:
    kind, key = place
    args, kwargs = side
    value = kwargs.get(key) if kind == "kwarg" else args[key] if key < len(args) else None
    if not isinstance(value, torch.Tensor):
        name = f"argument {key + 1}" if kind == "arg" else f"argument {key!r}"
        raise NotAChainError(
            f"{path} hands back its side {name}, which this call does not pass as a tensor "
            "(it did when the chain was found): call the blocks with the same arguments as "
            "the example batch did, or optimize with a batch that calls them this way"
        )
    return value


class Dropped(torch.Tensor):
    """What the model gets for a block's output other than its hidden state (the attention
    weights a layer returns whether asked for or not), which the chain does not keep: found
    unread when the chain was found, any use raises, rather than compute with a stand-in."""

    path: str
    position: int
    count: int

    @staticmethod
    def of(path: str, position: int, count: int) -> Dropped:
        dropped = torch.Tensor._make_subclass(Dropped, torch.empty(0))
        dropped.path, dropped.position, dropped.count = path, position, count
        return dropped

    @classmethod
    def __torch_function__(cls, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        dropped = stand_in(Dropped, args, kwargs)
        where = (
            "an output a block returns beside its hidden state"
            if dropped is None
            else f"output {dropped.position} of the {dropped.count} tensors {dropped.path} returns"
        )
        # Not a TypeError (NotAChainError is one): torch turns those into NotImplemented for
        # operators such as +, and the message would be lost.
        raise DroppedOutputError(
            f"the model used {where} ({getattr(func, '__name__', func)}), which offremat does "
            "not keep: the chain hands on each block's hidden state alone. A block must return "
            "its hidden state alone, or other tensors the model drops (attention weights it "
            "did not ask for); an auxiliary loss must come from the blocks' outputs"
        )


def stand_in(kind: type[Any], args: Any, kwargs: Any) -> Any:
    """The first ``kind`` among a torch function's arguments, nested ones too (the list
    ``torch.stack`` takes), else None. A ``StopIteration`` must not escape
    ``__torch_function__``: inside ``map()`` it would end the iteration quietly."""
    leaves = tree_leaves((args, kwargs or {}))
    return next((leaf for leaf in leaves if isinstance(leaf, kind)), None)


class DroppedOutputError(RuntimeError):
    """A use of a block output that the chain drops (see :class:`Dropped`)."""


def hidden_output(output: Structure) -> Structure:
    """A block's output structure, checked to hold a tensor (the first is the hidden state)."""
    if _tensor_count(output) == 0:
        raise NotAChainError("the blocks return no tensor; a block must return its output")
    return output


def _safe_value(value: Any, name: str, path: str) -> Any:
    if isinstance(value, (torch.Tensor, *_PLAIN_VALUES)):
        return value
    if isinstance(value, (tuple, list)):
        return type(value)(_safe_value(item, name, path) for item in value)
    if isinstance(value, dict):
        return {key: _safe_value(item, name, path) for key, item in value.items()}
    if _is_kv_cache(value):
        return None
    raise NotAChainError(
        f"{path} takes {name} of type {type(value).__name__}, which offremat cannot "
        "recompute safely (a block could change it); pass tensors and plain values to the "
        "blocks, or name other blocks with blocks="
    )


def cache_in(value: Any) -> bool:
    if isinstance(value, (tuple, list)):
        return any(cache_in(item) for item in value)
    if isinstance(value, dict):
        return any(cache_in(item) for item in value.values())
    return _is_kv_cache(value)


def _is_kv_cache(value: Any) -> bool:
    return any(
        cls.__name__ == "Cache" and cls.__module__.startswith("transformers")
        for cls in type(value).__mro__
    )


def _tensor_count(structure: Structure) -> int:
    if structure.kind == "tensor":
        return 1
    return sum(_tensor_count(child) for child in structure.children)


def further_block_message(path: str, run: BlockRun) -> str:
    """The refusal of a call of ``path`` that continues ``run`` past its last block."""
    return (
        f"the model called {path} on the output of the chain's last block "
        f"{run.calls[-1].path}, with other arguments a block of the chain took: it runs more "
        f"blocks than the {len(run.calls)} calls the chain was found with (a depth chosen per "
        "step?), which "
        "would run outside the plan. A run of blocks that depends on the input is no fixed "
        "chain: optimize the model with a batch that runs every block it will run"
    )
