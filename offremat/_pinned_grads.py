"""Gradient storages a parameter's ``.grad`` keeps alive beyond its own bytes.

Autograd may hand a parameter a slice of a larger gradient: of ``torch.cat([prefix, x])``,
the prefix gets a view of the gradient of the whole concatenation. Where ``.grad`` is None
(after ``zero_grad(set_to_none=True)``, PyTorch's default, so at every step of most training
loops) the accumulation node keeps that view as ``.grad`` instead of copying it, and the view
keeps the whole storage, the activations' part included, alive from the stage's backward to
the next ``zero_grad``: a review measured 1.12 times the budget at every step from it. The
profiler lets each gradient go as soon as it lands (:mod:`offremat._stage_profile`), so it
records here what the storage each one viewed held beyond the gradients in it; the chain
counts those bytes as held from the backward's start (:mod:`offremat.profiler`), which they
are at most. Slices of one storage that are all parameters' gradients (a weight made by
``torch.cat`` of three) pin nothing more.
"""

from __future__ import annotations

import torch

from offremat._storage_table import StorageTable
from offremat._tensors import storage_allocated_bytes


class _Storage:
    """One gradient storage: its bytes, as allocated, and the bytes of each parameter's
    gradient in it."""

    __slots__ = ("allocated", "nbytes", "parts")

    def __init__(self, storage: torch.UntypedStorage) -> None:
        self.nbytes = storage.nbytes()
        self.allocated = storage_allocated_bytes(storage)
        self.parts: dict[int, int] = {}

    def beyond(self, parts: int) -> int:
        """What the storage holds beyond gradients of ``parts`` bytes, as allocated."""
        return self.allocated - parts if self.nbytes > parts else 0


class PinnedGradients:
    """A post-accumulate-grad hook that lets each gradient go, and what they pinned."""

    def __init__(self) -> None:
        self._live: StorageTable[_Storage] = StorageTable()
        # Per parameter, the storage its latest gradient viewed (a stage runs its backward
        # several times while profiled: the latest counts).
        self._latest: dict[int, _Storage] = {}

    def let_go(self, parameter: torch.Tensor) -> None:
        """Record the storage of ``parameter``'s gradient, and let the gradient go."""
        grad = parameter.grad
        if grad is not None and grad.layout == torch.strided:
            storage = grad.untyped_storage()
            record = self._live.get(storage)
            if record is None:
                record = _Storage(storage)
                self._live.set(storage, record)
            record.parts[id(parameter)] = grad.numel() * grad.element_size()
            self._latest[id(parameter)] = record
        parameter.grad = None

    @property
    def pinned_bytes(self) -> int:
        """The bytes of the gradients' storages that are not parameters' gradients."""
        records = {id(record): record for record in self._latest.values()}.values()
        return sum(
            record.beyond(sum(n for key, n in record.parts.items() if self._latest[key] is record))
            for record in records
        )
