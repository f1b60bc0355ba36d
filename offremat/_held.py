"""How a step holds what it holds: one tensor (:class:`TensorRef`), rebuilt over its storage's
device copy after a move, and one storage (:class:`StorageRecord`), with its references and
copies. :class:`offremat._memory.Residency` moves them; its design notes apply."""

from __future__ import annotations

import weakref

import torch

from offremat._tensors import tensor_over, version_of


class TensorRef:
    """One tensor the step holds, rebuilt over its storage's current device copy.

    ``original`` weakly references the tensor as autograd or the stage made it (its base, if
    a view: :func:`offremat._tensors.version_owner`), so an in-place change made through it
    after an offload is still seen. The layout a rebuild needs is read only when an offload
    lets the tensor go (:meth:`release`): a step makes hundreds of references, rebuilds few.
    """

    __slots__ = (
        "dtype",
        "layout",
        "original",
        "rebuilt",
        "record",
        "size",
        "taken",
        "tensor",
        "version",
    )

    def __init__(self, tensor: torch.Tensor, original: torch.Tensor | None = None):
        owner = tensor if original is None else original
        if owner._base is not None:  # version_owner, inlined: this runs per saved tensor
            owner = owner._base
        self.tensor: torch.Tensor | None = tensor
        self.original = weakref.ref(owner)
        self.version = version_of(tensor)
        self.dtype = tensor.dtype
        self.size = tensor.shape
        self.layout: tuple[int, tuple[int, ...], bool, bool] | None = None
        self.record: StorageRecord | None = None
        self.rebuilt = False
        self.taken = False

    def release(self) -> None:
        """Let go of the tensor, keeping what rebuilding it over another storage needs."""
        tensor = self.tensor
        if tensor is not None:
            if self.layout is None:
                self.layout = (
                    tensor.storage_offset(),
                    tuple(tensor.stride()),
                    tensor.is_conj(),
                    tensor.is_neg(),
                )
            self.tensor = None

    def get(self) -> torch.Tensor:
        """The tensor, over the storage resident now."""
        if self.tensor is None:
            assert self.record is not None and self.record.storage is not None
            assert self.layout is not None, "a tensor let go without release() is not rebuilt"
            offset, stride, conj, neg = self.layout
            self.tensor = tensor_over(
                self.record.storage, self.dtype, offset, tuple(self.size), stride, conj, neg
            )
            self.rebuilt = True
        return self.tensor

    def modified_version(self) -> int | None:
        """The tensor's version now if it was changed in place since recorded, else None."""
        # The tensor first held shares its version counter with the original (a detached
        # alias does); a rebuilt one has a counter of its own.
        for tensor in (self.original(), None if self.rebuilt else self.tensor):
            if tensor is not None and version_of(tensor) != self.version:
                return version_of(tensor)
        return None


class StorageRecord:
    """One storage held by the step: its references, holders, where its bytes are, copies."""

    __slots__ = (
        "away_holders",
        "device_ready",
        "host",
        "host_ready",
        "key",
        "movable",
        "nbytes",
        "on_device",
        "refs",
        "released",
        "resident_holders",
        "storage",
    )

    def __init__(self, key: int, storage: torch.UntypedStorage, movable: bool):
        self.key = key
        self.storage: torch.UntypedStorage | None = storage
        self.nbytes = storage.nbytes()
        self.movable = movable
        self.refs: list[TensorRef] = []
        self.resident_holders = 0
        self.away_holders = 0
        self.on_device = True
        self.host: torch.Tensor | None = None
        self.host_ready: torch.cuda.Event | None = None
        self.device_ready: torch.cuda.Event | None = None
        self.released = False
