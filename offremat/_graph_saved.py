"""What a stage's own autograd graph saved, read where no saved-tensor hook saw it.

A forward that the plan leaves in place until its backward (a "direct" F_all, see
:mod:`offremat.executor`) runs without hooks, so that autograd keeps its own check of
in-place changes; its graph holds the saved set x̄_i. A stage whose sizes follow its input's
values (tokens routed by their values) can hold more at one step than its chain says, and
only x̄_i tells it: the output is often of one size whatever was routed. So after such a
forward the graph is read: every node the stage made (autograd numbers nodes as it makes
them), from its outputs back to the nodes made before it and the leaves, and the tensors each
node saved (``_saved_*`` of autograd's own nodes, ``saved_tensors`` of a custom Function),
counted by storage as the profiler counts x̄_i. Without it, a kept stage was taken to grow as
seen stages of its output's size did, which missed routed blocks behind dense ones of one
width at 1.2 to 2 times the budget, and invented growth for dense blocks beside routed ones
(a review).

Each saved tensor is read as autograd holds it (``_raw_saved_*``, a ``SavedTensor``'s
``data``), not unpacked: unpacking checks its version, which would raise autograd's error
for an in-place change before the backward does, and runs the unpack hooks of a
``torch.utils.checkpoint`` inside the stage, which recompute its forward (unpacked, a block
of six such checkpoints ran at 15.8 times the budget, a review). One node keeps what it saved
where Python cannot read it: ``CopySlices``, an in-place change of a view (``y[:, :n].pow_(2)``)
wraps the op's own node. A stage with one is read without it, and the executor runs its later
forwards with saved-tensor hooks, which see it (``PlanExecutor.hooked``); a keep-all plan, run
as plain autograd, has none (such blocks, sized by their values, ran a keep-all plan at 2.6
times its budget unsaid, in a review). Reading a GPT
block's graph (about 30 nodes) takes about 0.15 ms on one CPU core: 1.36 times a tiny GPT's
keep-all step (hidden 32), within noise on hidden 128 and more (a review).

A keep-all plan runs as plain autograd (:mod:`offremat._plain`), with no hooks at all: its
stages' sizes are read the same way, from the one graph of its forward, each node going to
the stage whose forward made it (:class:`StageReading`). Unread, routed tokens ran a plan at
the keep-all budget at 1.32 times it at every step, unsaid (a review).
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Container, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from offremat._stage_sizes import StageSizes
from offremat._tensors import flatten

# Per node class, the names of its saved tensors (``_raw_saved_self``, ...).
_SAVED_NAMES: dict[type, tuple[str, ...]] = {}


def sequence_mark(anchor: torch.Tensor) -> int:
    """A sequence number below that of every autograd node made after this call (grad mode
    on; ``anchor`` requires grad): nodes are numbered as they are made, per thread. 0 where
    no node can be made (inference mode), nor will the stage make one."""
    node = anchor.view_as(anchor).grad_fn
    return 0 if node is None else node._sequence_nr()


def graph_saved_bytes(
    outputs: Sequence[torch.Tensor], marks: Sequence[int], excluded: Container[int]
) -> tuple[list[dict[int, int]], set[int]] | None:
    """Per stage k, bytes by storage key of what the nodes behind ``outputs`` made since
    ``marks[k]`` and before ``marks[k + 1]`` (:func:`sequence_mark`, one mark per stage, in
    order) saved, but for the storages ``excluded`` (parameters and buffers); and the stages
    with a node that hides what it saved (``CopySlices``). None where a saved tensor has no
    storage of its own to count (a sparse one)."""
    held: list[dict[int, int]] = [{} for _ in marks]
    hidden: set[int] = set()
    seen: set[Any] = set()
    stack = [t.grad_fn for t in outputs if t.grad_fn is not None]
    try:
        while stack:
            node = stack.pop()
            if node is None or node in seen:
                continue
            seen.add(node)
            number = node._sequence_nr()
            if number < marks[0]:
                continue  # made before the stages: their inputs' graph
            k = bisect_right(marks, number) - 1
            if type(node).__name__ == "CopySlices":
                hidden.add(k)
            for value in saved_values(node):
                _count(value, held[k], excluded)
            stack.extend(following for following, _ in node.next_functions)
    except NotImplementedError:
        return None  # a tensor without a storage of its own (sparse)
    return held, hidden


def saved_values(node: Any) -> list[Any]:
    """What ``node`` saved for its backward, as autograd holds it (``SavedTensor``s)."""
    names = _SAVED_NAMES.get(type(node))
    if names is None:
        names = tuple(name for name in dir(node) if name.startswith("_raw_saved_"))
        _SAVED_NAMES[type(node)] = names
    return [getattr(node, name) for name in names]


def _count(value: Any, held: dict[int, int], excluded: Container[int]) -> None:
    if isinstance(value, (tuple, list)):
        for item in value:
            _count(item, held, excluded)
        return
    if value is None or value.unpack_hook is not None:
        # Packed by hooks inside the stage (torch.utils.checkpoint): no tensor of it is held,
        # and unpacking it would run them (a checkpoint's recomputation, outside a backward).
        return
    tensor = value.data
    if not isinstance(tensor, torch.Tensor):
        return
    storage = tensor.untyped_storage()
    # A Python number an op took (``x / 4``) is saved as a one-element tensor of its own that
    # no saved-tensor hook sees, nor the profile counts: 8 bytes over a stage's profile said
    # every step outgrew a keep-all plan.
    if tensor.dim() == 0 and storage.nbytes() == tensor.element_size():
        return
    if storage._cdata not in excluded:
        held[storage._cdata] = storage.nbytes()


@dataclass
class StageReading:
    """The sizes of stages run one after another with autograd's own graph, read from that
    graph once the last has run: call :meth:`before` and :meth:`after` around each stage's
    forward, then :meth:`read` on the last one's output."""

    anchor: torch.Tensor
    excluded: Container[int]
    sizes: StageSizes = field(default_factory=StageSizes)
    marks: list[int] = field(default_factory=list)
    inputs: list[set[int]] = field(default_factory=list)
    outputs: list[dict[int, int]] = field(default_factory=list)

    def before(self, value: Any) -> None:
        """Stage ``len(marks) + 1`` is about to run on ``value`` (a_{i-1})."""
        self.marks.append(sequence_mark(self.anchor))
        self.inputs.append({_key(t) for t in flatten(value)[0]})

    def after(self, value: Any) -> None:
        """The stage just run made ``value`` (a_i)."""
        self.outputs.append({_key(t): t.untyped_storage().nbytes() for t in flatten(value)[0]})

    def read(self, result: Sequence[torch.Tensor]) -> StageSizes:
        """The stages' sizes, from the graph behind the last stage's tensors ``result``."""
        found = graph_saved_bytes(result, self.marks, self.excluded)
        for i, (made, given) in enumerate(zip(self.outputs, self.inputs, strict=True), 1):
            saved = {**found[0][i - 1], **made} if found is not None else made
            self.sizes.note(i, made, saved, given, seen=found is not None)
        return self.sizes


def _key(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage()._cdata
