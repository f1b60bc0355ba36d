"""The dispatch-mode tracker of live storages, on which :class:`offremat.measure.StepMemory`
reads a CPU step (see the notes of :mod:`offremat.measure`)."""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from offremat._cpu_allocator import CpuAllocatorRecord
from offremat._eager import EagerDispatchMode
from offremat._storage_table import StorageTable
from offremat._tensors import sparse_parts


class LiveStorageTracker(EagerDispatchMode):
    """Live bytes of the storages created while active, after each op, and their peak.

    A storage is created by an op when it is among the op's outputs and none of the op's
    inputs has it (in-place ops, ``out=`` variants and views return an input's storage).
    Storages are held by weak reference; PyTorch keeps a storage's Python object exactly as
    long as the storage, so a dead reference means freed memory.
    """

    def __init__(self) -> None:
        super().__init__()
        self._live: StorageTable[None] = StorageTable()
        # Recorded storages, and how many of their bytes stop counting in
        # ``peak_less_left_out_bytes`` (see leave_out).
        self._left_out: StorageTable[int] = StorageTable()
        self.peak_bytes = 0
        self.peak_less_left_out_bytes = 0
        self.ops = 0
        # Marked before and after each op, to be read with the tracker's bytes.
        self.allocator: CpuAllocatorRecord | None = None

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if self.allocator is not None:
            self.allocator.mark(self.live_bytes)
        result = func(*args, **kwargs)
        found: list[Any] = []
        storage_leaves(args, found)
        storage_leaves(kwargs, found)
        inputs = {_key(leaf) for leaf in found}
        created: list[Any] = []
        storage_leaves(result, created)
        for leaf in created:
            if not isinstance(leaf, torch.Tensor) or leaf.device.type == "meta":
                continue
            storage = leaf.untyped_storage()
            if storage._cdata not in inputs and storage not in self._live:
                self._live.set(storage, None)
        self.ops += 1
        live = self.note_peak()
        if self.allocator is not None:
            self.allocator.mark(live)
        return result

    def note_peak(self) -> int:
        """Raise the peaks to what is alive now; returns it."""
        live = self.live_bytes
        self.peak_bytes = max(self.peak_bytes, live)
        left_out = self.left_out_bytes if self._left_out else 0
        self.peak_less_left_out_bytes = max(self.peak_less_left_out_bytes, live - left_out)
        return live

    def record(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage`` from now on, as one created while active."""
        self._live.set(storage, None)

    def leave_out(self, storage: torch.UntypedStorage, nbytes: int) -> None:
        """From now on, count ``nbytes`` of the recorded ``storage`` (at most all of it) in
        ``peak_bytes`` only."""
        if storage in self._live:
            self._left_out.set(storage, nbytes)

    @property
    def left_out_bytes(self) -> int:
        """Bytes of the left-out storages alive now."""
        return sum(min(nbytes, s.nbytes()) for _, s, nbytes in self._left_out.items())

    @property
    def live_bytes(self) -> int:
        """Bytes of the recorded storages alive now (it runs after every op)."""
        return sum(storage.nbytes() for _, storage, _ in self._live.items())

    def live_storages(self) -> dict[int, torch.UntypedStorage]:
        """The recorded storages alive now, by key."""
        return {key: storage for key, storage, _ in self._live.items()}


class WithinNode(TorchDispatchMode):
    """A tracker's recording inside one autograd node (:meth:`StepMemory.record_within_node`).

    Not the tracker itself, which runs compiled code eagerly (:mod:`offremat._eager`) by the
    compiler's stance, a process-wide setting that a node which raises would leave set: this
    mode leaves compiled code compiled (``ignore_compile_internals``: a frame that a node
    runs, a checkpoint recomputing a compiled block, compiled under another mode is skipped by
    the compiler for good), and records its artifact's operations, its allocations among them.
    """

    def __init__(self, tracker: LiveStorageTracker):
        super().__init__()
        self.tracker = tracker

    @classmethod
    def ignore_compile_internals(cls) -> bool:
        return True

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        return self.tracker.__torch_dispatch__(func, types, args, kwargs)


def storage_leaves(value: Any, found: list[Any]) -> None:
    """Append the tensors and storages inside an op's arguments or result to ``found``.

    An op's arguments and results nest tensors only in tuples, lists and dicts; this walk is
    ``tree_leaves`` for them at a fraction of its cost, which is paid on every op a tracked
    step runs (profiling a new input shape runs each stage tracked).
    """
    if isinstance(value, torch.Tensor) and value.layout != torch.strided:
        # A sparse tensor (an nn.Embedding(sparse=True)'s gradient) has no storage of its
        # own: its memory is that of its parts.
        for part in sparse_parts(value):
            storage_leaves(part, found)
    elif isinstance(value, (torch.Tensor, torch.UntypedStorage)):
        found.append(value)
    elif isinstance(value, (tuple, list)):
        for item in value:
            storage_leaves(item, found)
    elif isinstance(value, dict):
        for item in value.values():
            storage_leaves(item, found)


def _key(leaf: torch.Tensor | torch.UntypedStorage) -> int:
    storage = leaf if isinstance(leaf, torch.UntypedStorage) else leaf.untyped_storage()
    return storage._cdata
