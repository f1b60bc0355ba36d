"""The leaves of a stage's graph that its forward made (tensors created with
``requires_grad=True``, an RNN cell's initial state): autograd's AccumulateGrad node holds
them, not the saved set, so the profile counts them where the graph holds them
(:mod:`offremat._stage_profile`); and the refusal of a graph that reaches another stage's.
"""

from __future__ import annotations

import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from offremat._stage import GradSlot, StageInput
from offremat._tensors import gradient_bytes, storage_allocated_bytes


@dataclass
class GraphLeaf:
    """A leaf of a stage's graph, made by its forward: its storage, held weakly, its bytes,
    and the bytes of the gradients autograd gives the leaf tensors over it."""

    storage: weakref.ref[torch.UntypedStorage]
    nbytes: int
    grad_bytes: int = 0


def graph_leaves(
    outputs: Sequence[torch.Tensor], slot: GradSlot, known: set[int], stage: str
) -> dict[int, GraphLeaf]:
    """The leaves of the graph behind ``outputs`` whose storages are not ``known`` (the
    stage's inputs, parameters and buffers), by storage key.

    Refuses a graph that reaches another stage's boundary: a tensor computed inside an
    earlier stage and read here other than through this stage's input.
    """
    leaves: dict[int, GraphLeaf] = {}
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        if isinstance(node, StageInput._backward_cls):
            if node.slot is not slot:
                raise RuntimeError(graph_run_before(stage, node.slot.stage))
            continue  # this stage's inputs, cut from the graph that made them
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            storage = variable.untyped_storage()
            key = storage._cdata
            if key not in known and storage.nbytes() > 0:
                leaf = leaves.setdefault(
                    key, GraphLeaf(weakref.ref(storage), storage_allocated_bytes(storage))
                )
                leaf.grad_bytes += gradient_bytes([variable])
            continue
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


def graph_run_before(stage: str, source: str | None) -> str:
    """The refusal of a stage whose graph reaches a tensor that another stage (``source``,
    None where unknown) or an earlier call computed: another B(i) runs that graph."""
    if source == stage:
        made = (
            "computed by an earlier call of this stage, kept on a module from an earlier "
            "step's graph (a cache filled with gradients on; a Hugging Face model's: set "
            "config.use_cache=False)"
        )
    else:
        where = f"stage {source!r}" if source is not None else "an earlier stage"
        made = (
            f"computed inside {where} and reaching it other than through its input (kept on "
            "a module, `self.last = h`, and read by this stage, or kept by a forward hook)"
        )
        if source is None:
            made += (
                ", or kept from an earlier step's graph (a cache filled with gradients on; a "
                "Hugging Face model's: set config.use_cache=False)"
            )
    return (
        f"stage {stage!r} computes with a tensor that requires grad {made}. offremat runs each "
        "stage's backward itself, from its output, so the gradient along that path would be "
        "lost. Pass the tensor from stage to stage with the hidden state (return it with the "
        "block's output), compute with it inside the stage that makes it, detach it "
        "(`self.last = h.detach()`) if no gradient should flow through it, or leave those "
        "blocks out of the chain (blocks=)"
    )
