"""Buffers that a stage's forward changes, replayed for its recomputations.

Design note. A module may change one of its buffers in its forward: a step counter, an
exponential moving average, spectral norm's power-iteration vectors. Plain autograd runs the
forward once, so the change happens once, and the forward computes its output from the buffer
as it was then. A recomputation runs the forward again: it must see the buffer as the first
forward saw it (an EMA or spectral norm computes the output from it) and must not change it a
second time. BatchNorm's running statistics, which a training-mode forward does not read, keep
their own treatment (throw-away copies, :func:`offremat._stage.frozen_running_stats`).

For every other buffer of a stage that the plan recomputes, the step keeps a copy of its value
from before the stage's first forward, and runs each recomputation against a fresh copy of that
value, leaving the module's buffer as the first forward left it. A change is an in-place write
(the buffer's version counter moves), a new tensor assigned in its place, or, for a buffer
copied beforehand, other values (a write through ``.data`` moves no version counter). Which
buffers a stage changes is learnt: on a plan's first step every such buffer of a recomputed
stage is copied, from then on only those seen to change. A buffer that changes in a later
step, having not changed before, was not copied: that step is refused, not recomputed from
another value, and from the next step on every buffer of that stage is copied. A parameter
changed in place by a forward (an embedding's ``max_norm``) cannot be replayed so, since its
gradient must reach the parameter itself: a plan that recomputes its stage is refused.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

# A buffer: the module that holds it and its name there.
BufferSlot = tuple[nn.Module, str]


def _key(slot: BufferSlot) -> tuple[int, str]:
    return id(slot[0]), slot[1]


class MissedBufferChange(RuntimeError):
    """A forward changed a buffer that the step had not copied beforehand."""


class FirstForward:
    """Copies of a stage's buffers from before its first forward, and what that forward changed."""

    def __init__(
        self,
        slots: Sequence[BufferSlot],
        known: frozenset[tuple[int, str]] | None,
        parameters: Sequence[torch.Tensor] = (),
    ):
        self.parameters = [(p, p._version) for p in parameters]
        self.before = [(slot, slot[0]._buffers[slot[1]]) for slot in slots]
        self.versions = [tensor._version for _, tensor in self.before]
        self.copies = {
            _key(slot): tensor.clone()
            for slot, tensor in self.before
            if known is None or _key(slot) in known
        }

    def finish(self, stage: str) -> tuple[dict[BufferSlot, torch.Tensor], frozenset]:
        """The pre-forward copies of the buffers it changed, and the keys of those buffers."""
        if any(p._version != version for p, version in self.parameters):
            raise RuntimeError(
                f"stage {stage!r} changes one of its parameters in place in its forward "
                "(nn.Embedding with max_norm renormalises its rows, for one): plain autograd "
                "does that once a step, and the plan recomputes this stage, which would do it "
                "again. Use a plan that keeps or offloads this stage (a larger budget, or "
                "solver='offload-all' with a link), or make the change outside the forward"
            )
        changed = [
            slot
            for (slot, tensor), version in zip(self.before, self.versions, strict=True)
            if _changed(slot, tensor, version, self.copies.get(_key(slot)))
        ]
        missed = [slot for slot in changed if _key(slot) not in self.copies]
        if missed:
            module, name = missed[0]
            raise MissedBufferChange(
                f"stage {stage!r} changed its buffer {name!r} ({type(module).__name__}) in "
                "this step's forward, which it had not done in this plan's earlier steps, so "
                "no copy of its earlier value was kept, and the plan recomputes that stage: "
                "this step cannot be recomputed exactly and stops here (the buffer has moved "
                "once). From the next step on, every buffer of this stage is copied"
            )
        copies = {slot: self.copies[_key(slot)] for slot in changed}
        return copies, frozenset(_key(slot) for slot in changed)


def _changed(
    slot: BufferSlot, tensor: torch.Tensor, version: int, copy: torch.Tensor | None
) -> bool:
    """Whether the forward changed the buffer: a new tensor in its place, an in-place write
    (its version moved), or, where a copy was kept, other values (a write through ``.data``
    moves no version counter)."""
    now = slot[0]._buffers.get(slot[1])
    if now is not tensor or tensor._version != version:
        return True
    return copy is not None and not torch.equal(copy, now)


@contextmanager
def replayed_buffers(copies: dict[BufferSlot, torch.Tensor]) -> Iterator[list[torch.Tensor]]:
    """Run with fresh copies of the buffers' pre-forward values; yields those copies."""
    current = [(slot, slot[0]._buffers[slot[1]]) for slot in copies]
    fresh = []
    for slot, before in copies.items():
        fresh.append(before.clone())
        slot[0]._buffers[slot[1]] = fresh[-1]
    try:
        yield fresh
    finally:
        for (module, name), tensor in current:
            module._buffers[name] = tensor
