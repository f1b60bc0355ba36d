"""Activations that a custom ``autograd.Function`` keeps as ``ctx`` attributes, which no plan
can see: the profiler refuses a stage that keeps them."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from offremat._tensors import storage_key


def refuse_tensors_on_ctx(stage: str, outputs: Sequence[torch.Tensor], excluded: set[int]) -> None:
    """Refuse a stage whose custom ``autograd.Function`` keeps activations as ``ctx``
    attributes (``ctx.x = x``, or in a tuple, list or dict there) rather than through
    ``ctx.save_for_backward``.

    Autograd's saved-tensor hooks never see such tensors: the graph holds them from the
    forward to the backward whatever the plan decides, so no chain can say what the stage
    holds, and a plan that recomputes or offloads it would pass its budget. Parameters and
    buffers on ``ctx`` (``excluded``) are no activations, nor are integer tensors such as the
    RNG state that reentrant ``torch.utils.checkpoint`` keeps there: both are allowed.
    """
    nodes = [t.grad_fn for t in outputs if t.grad_fn is not None]
    seen: set[int] = set()
    found = []
    while nodes:
        node = nodes.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, BackwardCFunction):
            kept = [
                name
                for name, value in vars(node).items()
                if any(_is_activation(tensor, excluded) for tensor in _one_level(value))
            ]
            if kept:
                function = getattr(type(node), "_forward_cls", type(node)).__name__
                found.append(f"{function} (ctx.{', ctx.'.join(sorted(kept))})")
        nodes += [following for following, _ in node.next_functions]
    if found:
        raise ValueError(
            f"stage {stage!r} keeps activations as ctx attributes of custom autograd "
            f"Functions: {'; '.join(sorted(set(found)))}. Autograd holds them until the "
            "backward whatever the plan decides, so no plan could keep its budget: store them "
            "with ctx.save_for_backward"
        )


def refuse_hidden_saved(stage: str, nbytes: int) -> None:
    """Refuse a stage whose forward leaves ``nbytes`` to its backward that autograd holds
    past the executor's saved-tensor hooks: ``saved_tensors_hooks`` or ``save_on_cpu`` inside
    the block, a tensor a hook's closure holds, a stash a custom Function empties in its
    backward.

    No plan can drop or move what they hold, and a recomputation, which runs the forward with
    autograd again, holds a second copy beside the first forward's: counted as resident,
    plans that recomputed such a stage measured 1.7 times their budget (a review).
    """
    if nbytes:
        raise ValueError(
            f"stage {stage!r} leaves {nbytes} bytes from its forward to its backward that "
            "autograd holds past offremat's saved-tensor hooks: saved_tensors_hooks or "
            "save_on_cpu inside the block, a tensor a hook's closure holds, or one a custom "
            "Function keeps outside ctx.save_for_backward. No plan could drop or offload "
            "them, and recomputing the stage would hold them twice: take such hooks out of "
            "the block (the plan offloads where you give optimize a bandwidth), keep tensors "
            "with ctx.save_for_backward, or leave the block out of the chain (blocks=)"
        )


def _one_level(value: Any) -> list[Any]:
    """``value``, or the items of a tuple, list or dict (``ctx.tensors = (x, w)``)."""
    if isinstance(value, (tuple, list)):
        return list(value)
    if isinstance(value, dict):
        return list(value.values())
    return [value]


def _is_activation(value: Any, excluded: set[int]) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and (value.is_floating_point() or value.is_complex())
        and storage_key(value) not in excluded
    )
