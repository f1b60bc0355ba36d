"""Side inputs that a run's blocks take in turns: which calls share which (their patterns).

Most runs of blocks take the very same side inputs at every call (one pattern). Layers that
alternate sliding-window and full attention take a mask per kind, in turns; stages called
with their feature map's size take each their own. A call's pattern is its number among the
run's different side arguments, found on the example batch, where calls of layers of
another kind count as another pattern even where their masks agree there.
"""

from __future__ import annotations

import itertools
import logging
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from torch import nn

from offremat._block_values import cache_in, shared_sides, side_inputs_of
from offremat._record import RecordedCall, capture_calls
from offremat._tensors import same_structure

if TYPE_CHECKING:
    from offremat._discover import BlockRun

logger = logging.getLogger(__name__)


def side_patterns(run: list[RecordedCall]) -> dict[int, int]:
    """Each call's number among the different side arguments of the run, by ``id``. Calls of
    layers of another kind (:func:`layer_kind`: sliding-window and full attention) differ
    even where their masks agree on the example batch (both None, a sequence no longer than
    the window), since on longer ones they do not."""
    firsts: list[RecordedCall] = []
    patterns = {}
    for record in run:
        pattern = next((k for k, f in enumerate(firsts) if _same_group(f, record)), len(firsts))
        if pattern == len(firsts):
            firsts.append(record)
        patterns[id(record)] = pattern
    return patterns


def _same_group(a: RecordedCall, b: RecordedCall) -> bool:
    """Whether two calls take the same side inputs, as layers of one kind."""
    return (
        a.side[0] == b.side[0]
        and same_structure(a.side[1], b.side[1])
        and layer_kind(a.module) == layer_kind(b.module)
    )


def layer_kind(block: nn.Module) -> Any:
    """A Hugging Face layer's kind (``config.layer_types[layer_idx]``: "sliding_attention",
    "full_attention"), read where a module of the block holds both; else None."""
    for module in block.modules():
        index = getattr(module, "layer_idx", None)
        kinds = getattr(getattr(module, "config", None), "layer_types", None)
        if isinstance(index, int) and isinstance(kinds, (list, tuple)) and index < len(kinds):
            return kinds[index]
    return None


def same_side_parts(run: list[RecordedCall]) -> list[list[RecordedCall]]:
    """``run`` cut where a call takes other side inputs than the one before."""
    parts = [run[:1]]
    for previous, record in itertools.pairwise(run):
        if other_sides(previous, record):
            parts.append([])
        parts[-1].append(record)
    return parts


def other_sides(previous: RecordedCall, record: RecordedCall) -> str | None:
    """Why ``record`` is in another group of side inputs than ``previous``, or None."""
    if _same_group(previous, record):
        return None
    return (
        f"{record.path} takes other side arguments than {previous.path} (or is a layer of "
        "another kind), and the model reads a block's output between its calls of the "
        "blocks, which a chain of blocks taking side inputs in turns runs only at the last "
        "call"
    )


# The models told of their key-value cache, by first block: each new shape's profile finds
# it again, and a new user read the same warning five times in one run (a trial).
_CACHE_SAID: weakref.WeakSet[nn.Module] = weakref.WeakSet()


def chain_input(run: BlockRun, run_model: Callable[[], Any]) -> Any:
    """The chain's first input ``(hidden, sides)`` on ``run_model()``'s call: the first
    block's hidden state, and each pattern's side arguments ``(args, kwargs)``.

    The model runs up to the first call of the run's last pattern, with gradients on as in
    training (saving nothing), and stops.
    """
    firsts = [next(c for c in run.calls if c.pattern == p) for p in range(run.patterns)]
    captured = capture_calls(run_model, [(call.module, call.nth) for call in firsts])
    cached = (cache_in(value) for args, kwargs in captured for value in (*args, *kwargs.values()))
    first = run.calls[0].module
    if first not in _CACHE_SAID and any(cached):
        _CACHE_SAID.add(first)
        logger.warning(
            "the blocks' key-value cache is not filled in training steps (as with Hugging "
            "Face's gradient checkpointing): recomputed blocks would fill it twice. Gradients "
            "equal plain autograd's with use_cache=False; against a plain run with the cache "
            "on, whose attention reads the cache's copy of the keys, they can differ by "
            "rounding: set config.use_cache=False to compare"
        )
    inputs = [
        side_inputs_of(call.path, args, kwargs)
        for call, (args, kwargs) in zip(firsts, captured, strict=True)
    ]
    return inputs[0][0], shared_sides([side for _, side in inputs])
