"""Buffers that a stage's forward may change, replayed for its recomputations.

Design note. A module may change one of its buffers in its forward: a step counter, an
exponential moving average, spectral norm's power-iteration vectors. Plain autograd runs the
forward once, so the change happens once, and the forward computes its output from the buffer
as it was then. A recomputation runs the forward again: it must see the buffer as the first
forward saw it (an EMA or spectral norm computes the output from it) and must not change it a
second time. BatchNorm's running statistics, which a training-mode forward does not read, keep
their own treatment (throw-away copies, :func:`offremat._stage.frozen_running_stats`).

So before the first forward of a stage that the plan recomputes, the step copies every other
buffer of the stage, and runs each recomputation against fresh copies of those values, leaving
the module's buffers as the first forward left them. A change cannot be told from its absence
in advance (a buffer may start changing at any step, and a write through ``.data`` moves no
version counter), so every buffer is copied at every step; but right after that forward, the
copies of the buffers it left as they were (the same tensor, version and bits) go: a
recomputation reads those buffers themselves, and is refused if one has been changed in place
since (a write through ``.data`` between the forward and the backward goes unseen). A buffer
that another stage also holds keeps its copy, since that stage's forward may change it first.
So a large buffer that never changes (a causal mask) costs its copy only during that forward,
which the profile counts among every stage's forward temporaries (:func:`buffer_copy_bytes`;
an overcount for stages no plan recomputes). The copies of buffers that do change, and of
those another stage holds, live until the step ends: the profile counts them as resident for
the whole step, beside what modules keep (an overcount where the plan does not recompute the
stage, or before its forward), and so is a buffer's new tensor when a forward replaces it
(the graph may hold the old one). The fresh copies each recomputation runs against are saved
like activations where autograd saves them, so that a kept graph without its saved tensors
lets them go.
A parameter changed in place by a forward (an embedding's ``max_norm``) cannot be
replayed so, since its gradient must reach the parameter itself: its version counter is
checked, and a recomputed stage that changes one is refused. So is a parameter changed in
place between a stage's forward and its recomputation (an optimizer step before the
backward): plain autograd computes the gradient from the values the forward saw, which a
recomputation no longer has.

A forward may also read and assign the modules' plain attributes (a call counter that ends a
warm-up, ``self.saved = h`` as activation-logging code does). A recomputation must see them as
the first forward did, so their values from before it are kept (by reference, in
:class:`FirstForward`) and given back for each recomputation. A refill
(:mod:`offremat._deferred`) reruns a forward only to fill the saved tensors of a graph an
earlier forward kept, and that earlier graph is the one the backward runs: afterwards each
module is given back the attributes the earlier forward left, whose tensors are in that graph
(and so get their ``retain_grad`` gradients), as under plain autograd. After a recomputation
whose own graph the backward runs, the tensors it assigned stay, and every other attribute
goes back to what it was before it (a block used twice keeps the count of its later use).
Only assignments are replayed and undone: a tensor appended to a list or written into a dict
attribute stays.

A forward run inside ``torch.func.functional_call`` computes with the tensors the call
registered in place of the module's own, and the call puts the module's own back before the
backward: a recomputation reinstates the parameters and buffers its stage's first forward
found registered (:func:`reinstated`), before anything else reads them.
"""

from __future__ import annotations

import operator
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from offremat._fsdp import sharded_parameter_tables
from offremat._tensors import bitwise_equal, storage_key

# A buffer: the module that holds it and its name there.
BufferSlot = tuple[nn.Module, str]


class FirstForward:
    """Copies of a stage's buffers from before its first forward (kept of those it changes),
    its modules' plain attributes then, and a watch on the version counters of its parameters
    and of the buffers it left. ``modules`` are the stage's modules (``stage.modules()``)."""

    def __init__(
        self,
        modules: Sequence[nn.Module],
        slots: Sequence[BufferSlot],
        parameters: Sequence[torch.Tensor] = (),
        shared: frozenset[int] = frozenset(),
    ):
        self.parameters = [(p, p._version) for p in parameters]
        self.requires_grad = [(p, p.requires_grad) for p in parameters]
        self.attributes = attribute_values(modules)
        self.registered = registered_tensors(modules)
        # Buffers other stages also hold (by storage key) keep their copies: a later stage's
        # forward may change them before this one is recomputed, through .data unseen.
        self.before = {
            slot: _state(slot)
            for slot in slots
            if storage_key(slot[0]._buffers[slot[1]]) not in shared
        }
        self.copies = {slot: slot[0]._buffers[slot[1]].clone() for slot in slots}
        # The buffers the forward left as they were: a recomputation reads them themselves.
        self.unchanged: dict[BufferSlot, tuple[torch.Tensor | None, int]] = {}

    def _changed(self) -> bool:
        return any(p._version != version for p, version in self.parameters)

    def finish(self, stage: str) -> None:
        """Refuse a forward that changed one of the stage's parameters in place."""
        if self._changed():
            raise RuntimeError(
                f"stage {stage!r} changes one of its parameters in place in its forward: "
                "plain autograd does that once a step, and the plan recomputes this stage, "
                "which would do it again. Use a plan that keeps or offloads this stage (a "
                "larger budget, or solver='offload-all' with a link), or make the change "
                "outside the forward"
            )
        for slot, state in self.before.items():
            copy = self.copies[slot]
            if _same(slot, state) and state[0] is not None and bitwise_equal(copy, state[0]):
                del self.copies[slot]
                self.unchanged[slot] = state
        self.before = {}

    def check_recomputable(self, stage: str) -> None:
        """Refuse to recompute the stage from parameters, or buffers it has no copy of,
        changed in place since its forward, or with parameters frozen or unfrozen since."""
        if any(p.requires_grad != wanted for p, wanted in self.requires_grad):
            raise RuntimeError(
                f"a parameter of stage {stage!r} started or stopped requiring grad between "
                "the forward and the backward: plain autograd's graph is the forward's, and "
                "the plan recomputes this stage with the new setting. Freeze or unfreeze "
                "parameters between steps"
            )
        moved = not all(_same(slot, state) for slot, state in self.unchanged.items())
        if self._changed() or moved:
            raise RuntimeError(
                f"a parameter or buffer of stage {stage!r} was changed in place after the "
                "forward and before the backward (an optimizer step or a weight update in "
                "between, or a later stage's forward?): plain autograd computes the gradient "
                "from the values the forward saw, and the plan recomputes this stage from the "
                "new ones. Change parameters after backward, or use a plan that keeps or "
                "offloads this stage"
            )


def _state(slot: BufferSlot) -> tuple[torch.Tensor | None, int]:
    """A buffer's tensor and its version counter."""
    tensor = slot[0]._buffers.get(slot[1])
    return tensor, -1 if tensor is None else tensor._version


def _same(slot: BufferSlot, state: tuple[torch.Tensor | None, int]) -> bool:
    """Whether the buffer is still the tensor ``state`` holds, at its version there."""
    tensor, version = _state(slot)
    return tensor is not None and tensor is state[0] and version == state[1]


def shared_buffer_keys(stages: Sequence[Sequence[BufferSlot]]) -> frozenset[int]:
    """The storage keys of buffers that more than one stage holds (one tensor in two modules,
    a module used twice): :class:`FirstForward` keeps their copies."""
    holders = Counter(
        key
        for slots in stages
        for key in {storage_key(module._buffers[name]) for module, name in slots}
    )
    return frozenset(key for key, count in holders.items() if count > 1)


def buffer_copy_bytes(slots: Sequence[BufferSlot]) -> int:
    """The bytes of the copies :class:`FirstForward` makes of these buffers."""
    return sum(
        tensor.numel() * tensor.element_size()
        for tensor in (module._buffers[name] for module, name in slots)
        if tensor is not None
    )


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


# Each module's attribute dictionary and a shallow copy of its entries at one moment.
AttributeValues = list[tuple[dict, dict]]


def attribute_values(modules: Iterable[nn.Module]) -> AttributeValues:
    """The plain attributes of ``modules`` now (objects by reference)."""
    return [(module.__dict__, dict(module.__dict__)) for module in modules]


def assign_attributes(values: AttributeValues) -> None:
    """Give each module back the attributes of ``values`` (from :func:`attribute_values`)."""
    for attributes, kept in values:
        for name in attributes.keys() - kept.keys():
            del attributes[name]
        attributes.update(kept)  # the unchanged ones get their own objects back: no change


def registered_tensors(modules: Sequence[nn.Module]) -> AttributeValues:
    """Each module's parameter and buffer dictionaries, with their entries now; not the
    parameter tables FSDP2 fills: its pre-hook registers the gathered parameters there at
    each forward, a recomputation's too, unless they are still registered from the forward
    (``reshard_after_forward=False``), and then the sharded ones put back would be used."""
    sharded = sharded_parameter_tables(modules)
    return [
        (registered, dict(registered))
        for module in modules
        for registered in (module._parameters, module._buffers)
        if id(registered) not in sharded
    ]


@contextmanager
def reinstated(seen: AttributeValues) -> Iterator[None]:
    """Run with the parameters and buffers of ``seen`` (from :func:`registered_tensors`)
    registered, then give back those of now."""
    if all(_same_entries(registered, kept) for registered, kept in seen):
        yield
        return
    now = [(registered, dict(registered)) for registered, _ in seen]
    assign_attributes(seen)
    try:
        yield
    finally:
        assign_attributes(now)


def _same_entries(current: dict, kept: dict) -> bool:
    # Values by identity (== on tensors compares their elements), entry by entry in order: a
    # copy of a dictionary lists its entries as the dictionary does. A reordered one compares
    # as changed, and is assigned back whole. Keys by value: a TorchScript module's tables
    # hand out new key strings at every access.
    return (
        len(current) == len(kept)
        and all(map(operator.eq, current.keys(), kept.keys()))
        and all(map(operator.is_, current.values(), kept.values()))
    )


@contextmanager
def replayed_attributes(seen: AttributeValues, refill: bool) -> Iterator[None]:
    """Run a recomputation with the attributes its stage's first forward saw (``seen``), then
    give each module back the attributes it had before: all of them after a refill, whose
    backward runs the earlier graph; after a recomputation whose own graph the backward runs,
    all but the tensors it assigned (an activation kept for its ``retain_grad`` gradient)."""
    if all(_same_entries(attributes, kept) for attributes, kept in seen):
        now = seen  # as the first forward found them: nothing to replay, these to give back
    else:
        now = [(attributes, dict(attributes)) for attributes, _ in seen]
        assign_attributes(seen)
    try:
        yield
    finally:
        if not refill:
            # New dictionaries: ``now`` may be ``seen``, which later recomputations replay.
            now = [(attributes, before | _tensors_in(attributes)) for attributes, before in now]
        assign_attributes(now)


def _tensors_in(attributes: dict) -> dict:
    return {name: value for name, value in attributes.items() if isinstance(value, torch.Tensor)}
