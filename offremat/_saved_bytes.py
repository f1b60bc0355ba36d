"""The bytes of the activations autograd saves in each module call, counted as a model is
watched for its chain (:mod:`offremat._record`): of two runs of blocks, the chain is the one
whose blocks save the most (:mod:`offremat._block_runs`)."""

from __future__ import annotations

import torch
from torch import nn

from offremat._storage_table import StorageTable


class Saved:
    """The bytes of the storages one call saved, each once. The hook keeps nothing, so a
    saved storage may be freed at once and its address given to the next: by address alone,
    two were one, and the count depended on the allocator (a T5's chain was its encoder in
    one process, its decoder in the next)."""

    def __init__(self) -> None:
        self.bytes = 0
        self._counted: StorageTable[None] = StorageTable()

    def add(self, storage: torch.UntypedStorage) -> None:
        """Count ``storage``, unless it is one already counted and still alive."""
        if storage not in self._counted:
            self._counted.set(storage, None)
            self.bytes += storage.nbytes()


class SavedBytes:
    """A pack hook that keeps nothing, counting the bytes of the activations autograd saves
    for each call running (by storage, parameters left out). The graph holds it, so it holds
    numbers only, not the recorder and its modules."""

    def __init__(self) -> None:
        self.open: list[Saved] = []

    def __call__(self, tensor: torch.Tensor) -> None:
        if isinstance(tensor, nn.Parameter) or tensor.layout != torch.strided:
            return
        storage = tensor.untyped_storage()
        for saved in self.open:
            saved.add(storage)
