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
are at most, and says how many (:func:`backward_gradient_bytes`). Slices of one storage
that are all parameters' gradients (a weight made by ``torch.cat`` of three) pin nothing
more.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence

import torch

from offremat._storage_table import StorageTable
from offremat._tensors import storage_allocated_bytes
from solvers.chain import Chain


def backward_gradient_bytes(chain: Chain) -> int:
    """What ``chain``'s held bytes count of gradients its backward makes: the running sums of
    parameters several stages use (``shared_gradient_bytes``: parameter-sized) and the
    storages parameters' gradients pin (``pinned_gradient_bytes``: sized by the batch; a chain
    predicted for another size says a lower bound, :mod:`offremat._shape_prediction`, so what
    is taken away from its held bytes is never too much)."""
    metadata = chain.metadata
    return metadata.get("shared_gradient_bytes", 0) + metadata.get("pinned_gradient_bytes", 0)


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
        # The parameters whose gradient was sparse (an nn.Embedding(sparse=True)'s: see
        # offremat._shared_grads.refuse_shared_sparse_gradients).
        self.sparse: set[int] = set()

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
        elif grad is not None:
            self.sparse.add(id(parameter))
        parameter.grad = None

    def pinned(self) -> dict[int, int]:
        """By parameter id, the bytes of its gradient's storage that are not parameters'
        gradients (a storage several parameters' gradients view counts for the first)."""
        found: dict[int, int] = {}
        for record in {id(record): record for record in self._latest.values()}.values():
            parts = {key: n for key, n in record.parts.items() if self._latest[key] is record}
            beyond = record.beyond(sum(parts.values()))
            if beyond:
                found[next(iter(parts))] = beyond
        return found


def held_pinned_bytes(per_stage: Sequence[dict[int, int]], shared: Collection[int]) -> int:
    """What the gradients of each stage's parameters pin (``per_stage``, by parameter id),
    held to the end of the backward at most; of a parameter several stages use (``shared``)
    the most any one pinned: its running sum (offremat._shared_grads) is one gradient at a
    time, the last stage's part added to the earlier ones out of place."""
    total, most = 0, {}
    for pinned in per_stage:
        for key, size in pinned.items():
            if key in shared:
                most[key] = max(most.get(key, 0), size)
            else:
                total += size
    return total + sum(most.values())
