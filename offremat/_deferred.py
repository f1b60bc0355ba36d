"""A stage's graph kept without its saved tensors, and refilled just before its backward.

Design note (the early stop of ``torch.utils.checkpoint``'s non-reentrant variant, applied
to rotor's operations). A forward that a plan runs without keeping its saved set (F_ck,
F_none) runs here with autograd on, and every tensor autograd saves, except parameters and
the stage's input, is packed as an empty :class:`Placeholder`: the graph's nodes stay (a few
bytes each), the tensors go as they would without autograd. When the plan later runs the
stage's F_all right before its B, the forward runs again under a :class:`Refill`, which puts
each saved tensor into the placeholder packed in the same position and stops the forward as
soon as the last one is filled. The operations after the last saved tensor (a block's final
projection and residual add, whose outputs autograd does not save) are not run again, and
B(i) runs on the kept graph.

Invariants. The refill runs the same code on the same input with the same random numbers
(the RNG replay of :mod:`offremat._stage`), so it packs the same tensors in the same order;
a refill that ends before filling every placeholder raises instead of running B on a
half-filled graph. A stop skips the operations after the last saved tensor, so an in-place
change they make to a saved tensor, which autograd refuses, would go unseen (it does under
``torch.utils.checkpoint``): :class:`MutationWatch` sees the in-place changes that those
operations make (all of the stage's first forward, then from its last saved tensor on), and a
stage that makes one is refilled to its end, where unpacking raises autograd's error. The stop
also cuts short the operation whose saving is the last pack: autograd saves an operation's
inputs before it runs, so an operation that fills a tensor it saved (RReLU's noise, made
empty and written by the kernel) would leave it unwritten. A watch armed at the last pack, in
the middle of that operation, cannot see its write; the stage's first forward, watched from
its start, does, and the step remembers such a stage (``changes_saved``): its refills run to
the end at every later step. A
tensor kept on an autograd context other than through ``save_for_backward`` stays with the
kept graph, as under ``torch.utils.checkpoint``.
"""

from __future__ import annotations

import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, nullcontext
from typing import Any

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from offremat._eager import EagerDispatchMode
from offremat._held import TensorRef
from offremat._stage import SavedTensorPacker, backward_in_forward_error, check_versions
from offremat._tensors import (
    TensorKind,
    describe_kind,
    storage_key,
    tensor_kind,
    version_of,
)


class Placeholder:
    """Where a saved tensor goes once the forward that saves it runs again, and what that
    tensor was (its dtype, shape and device) when first saved.

    It also watches the first tensor's version, as autograd would have: the model may keep
    that tensor (an attribute) and change it in place before the backward, which plain
    autograd refuses, while the refill would compute with a fresh copy.
    """

    __slots__ = ("kind", "original", "ref", "version")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.ref: TensorRef | None = None
        # tensor_kind and version_owner, inlined: this runs for every saved tensor.
        self.kind = (tensor.dtype, tensor.shape, tensor.device)
        self.original = weakref.ref(tensor if tensor._base is None else tensor._base)
        self.version = version_of(tensor)

    @property
    def dtype(self) -> torch.dtype:
        return self.kind[0]

    @property
    def size(self) -> tuple[int, ...]:
        return tuple(self.kind[1])

    def modified_version(self) -> int | None:
        """The first tensor's version now if it was changed in place since saved, else None."""
        original = self.original()
        if original is not None and version_of(original) != self.version:
            return version_of(original)
        return None


class DeferringPacker(SavedTensorPacker):
    """Packs as :class:`SavedTensorPacker`, but what it would hold becomes a placeholder."""

    def __init__(
        self,
        stage: str,
        inputs: Sequence[torch.Tensor],
        excluded: set[int] | frozenset[int],
        expected_packs: int | None = None,
        changes_saved: bool = False,
    ):
        super().__init__(stage, inputs, excluded)
        self.slots: list[Placeholder | None] = []
        # Weak references pin the keys: a saved storage freed during the forward keeps its
        # address from a later one, which the watch would take for a change to a saved tensor.
        self.saved: dict[int, StorageWeakRef] = {}
        # The bytes of each, which the step's stage sizes count (offremat._stage_sizes).
        self.saved_bytes: dict[int, int] = {}
        # Known from an earlier forward of the stage: nothing to watch, refills run to the end.
        self.changed_after_saving = changes_saved
        self.expected_packs = expected_packs
        # Watched from its start, this forward ran compiled blocks eagerly (offremat._eager).
        self.eager = expected_packs is None and not changes_saved
        self.armed: MutationWatch | None = None

    @contextmanager
    def watching(self) -> Iterator[None]:
        """Watch in-place writes to saved storages during the forward run inside.

        Only the operations after the last saved tensor are skipped by a refill, so only they
        need watching, and a Python dispatch mode slows every operation it sees: once the
        stage's packing is known (``expected_packs``, from its first forward), the watch starts
        at the last pack. A forward that packs another number of tensors computed something
        else, and is refilled to its end.
        """
        if self.changed_after_saving:
            yield
            return
        if self.expected_packs is None:
            with MutationWatch(self):
                yield
            return
        try:
            yield
        finally:
            if self.armed is not None:
                self.armed.__exit__(None, None, None)
                self.armed = None
        if len(self.slots) != self.expected_packs:
            self.changed_after_saving = True

    def pack(self, tensor: torch.Tensor) -> Any:
        packed = super().pack(tensor)
        if not isinstance(packed, Placeholder):
            self.slots.append(None)
        if len(self.slots) == self.expected_packs and not self.changed_after_saving:
            self._arm()
        return packed

    def _hold(self, tensor: torch.Tensor, storage: torch.UntypedStorage) -> Any:
        """A saved tensor the step would hold goes as a placeholder, filled by the refill."""
        if storage._cdata not in self.saved:
            self.saved[storage._cdata] = StorageWeakRef(storage)
            self.saved_bytes[storage._cdata] = storage.nbytes()
        placeholder = Placeholder(tensor)
        self.slots.append(placeholder)
        return placeholder

    def _arm(self) -> None:
        """Start the watch: the last tensor the stage saves is packed."""
        if self.armed is None:
            self.armed = MutationWatch(self)
            self.armed.__enter__()

    def unpack(self, packed: Any) -> torch.Tensor:
        self.check_backward()
        if isinstance(packed, Placeholder):
            check_versions(self.stage, [packed])
            if packed.ref is None:
                raise RuntimeError(
                    f"stage {self.stage!r}: a saved tensor was not recomputed before its "
                    "backward; this is a bug in offremat"
                )
            check_versions(self.stage, [packed.ref])
            return self._taken(packed.ref)
        return super().unpack(packed)

    @property
    def empty(self) -> bool:
        """Whether nothing needs recomputing: every saved tensor is a parameter or input."""
        return all(slot is None for slot in self.slots)


class MutationWatch(EagerDispatchMode):
    """Marks ``packer`` when an operation writes in place to a storage it saved.

    Saved storages are told apart by address, which no other storage takes while the packer
    holds a weak reference to them (:attr:`DeferringPacker.saved`).
    """

    def __init__(self, packer: DeferringPacker):
        super().__init__()
        self.packer = packer

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        packer = self.packer
        if packer.saved and not packer.changed_after_saving:
            for position, name in written_arguments(func):
                value = args[position] if position < len(args) else kwargs.get(name)
                if isinstance(value, torch.Tensor) and storage_key(value) in packer.saved:
                    packer.changed_after_saving = True
        return func(*args, **kwargs)


# Per operator, the positions and names of the arguments it writes to: read from its schema
# once, for the watch sees every operation of the watched part of each forward.
_WRITTEN: dict[Any, tuple[tuple[int, str], ...]] = {}


def written_arguments(func: Any) -> tuple[tuple[int, str], ...]:
    """The (position, name) of each argument that the operator ``func`` writes in place."""
    found = _WRITTEN.get(func)
    if found is None:
        schema = func._schema
        found = tuple(
            (position, argument.name)
            for position, argument in enumerate(schema.arguments)
            if schema.is_mutable
            and argument.alias_info is not None
            and argument.alias_info.is_write
        )
        _WRITTEN[func] = found
    return found


class StopRecomputation(Exception):
    """Raised by :class:`Refill` once the last placeholder is filled, to end the forward."""


class Refill:
    """``saved_tensors_hooks`` for a forward that fills a :class:`DeferringPacker`'s slots."""

    def __init__(self, packer: DeferringPacker):
        self.stage = packer.stage
        self.eager = packer.eager
        self.slots = packer.slots
        self.last_placeholder = max(k for k, slot in enumerate(self.slots) if slot is not None)
        # Past the end: run the whole forward, so that unpacking sees the in-place change.
        self.stop = len(self.slots) + 1 if packer.changed_after_saving else self.last_placeholder
        self.complete = False
        self.position = 0
        self.refs: list[TensorRef] = []

    @contextmanager
    def running(self) -> Iterator[None]:
        """Run the refilling forward inside: eagerly if the kept graph's forward was.

        A compiled block saves other tensors than its eager form, so a refill must run the way
        the forward that kept the graph ran.
        """
        stance = torch.compiler.set_stance("force_eager") if self.eager else nullcontext()
        with stance, self.hooks():
            yield

    def hooks(self) -> torch.autograd.graph.saved_tensors_hooks:
        """The context manager that installs the filling hooks."""
        return torch.autograd.graph.saved_tensors_hooks(self.pack, self.unpack)

    def pack(self, tensor: torch.Tensor) -> None:
        slot = self.slots[self.position] if self.position < len(self.slots) else None
        self.position += 1
        if slot is not None:
            if (tensor.dtype, tensor.shape, tensor.device) != slot.kind:  # tensor_kind
                raise self.mismatch(slot.kind, tensor)
            ref = TensorRef(tensor.detach(), original=tensor)
            slot.ref = ref
            self.refs.append(ref)
        self.complete = self.position > self.last_placeholder
        if self.position > self.stop:
            raise StopRecomputation

    def unpack(self, _: Any) -> torch.Tensor:
        """A refill's own graph is never run backward: only a backward inside the stage's
        forward reads what it saves, while the refill runs."""
        raise backward_in_forward_error(self.stage)

    def mismatch(self, kind: TensorKind, tensor: torch.Tensor) -> RuntimeError:
        """The error for a recomputation that saves another kind of tensor in a position."""
        return recomputed_otherwise(
            self.stage,
            f"saved tensor {self.position} of {len(self.slots)}",
            kind,
            tensor_kind(tensor),
        )

    def incomplete(self) -> RuntimeError:
        """The error for a refill that ran to its end without filling every placeholder."""
        return RuntimeError(
            f"stage {self.stage!r} saved {self.position} tensors when recomputed but "
            f"{len(self.slots)} in its first forward: it does not compute the same thing "
            "twice (data-dependent control flow?), so it cannot be recomputed"
        )


def recomputed_otherwise(stage: str, what: str, first: TensorKind, now: TensorKind) -> RuntimeError:
    """The error for a recomputation that made ``what`` of another kind than the stage's
    first forward did."""
    return RuntimeError(
        f"stage {stage!r} made {what} as a {describe_kind(now)} tensor when recomputed, where "
        f"its first forward made a {describe_kind(first)} one: it does not compute the same "
        "thing twice (data-dependent control flow, or a setting changed between the forward "
        "and the backward, such as the default dtype), so it cannot be recomputed. Keep such "
        "settings fixed through the step, or use a plan that keeps this stage"
    )
