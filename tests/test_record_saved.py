"""The bytes each module call saves for the backward, as the chain's discovery counts them to
choose between two runs of blocks (an encoder's and a decoder's).

The count kept nothing and told storages apart by address: one freed at once could give its
address to the next, and two counted as one, as the allocator happened to place them (a T5's
chain was its encoder in one process and its decoder in the next). Oracle: autograd's own
saved tensors, each kept to the end so that no address is reused.
"""

from __future__ import annotations

import torch
from torch import nn

from offremat._record import record_calls


class Chained(nn.Module):
    """Saves each of its ``steps`` results, which the next step replaces."""

    def __init__(self, steps: int = 6) -> None:
        super().__init__()
        self.steps = steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for _ in range(self.steps):
            x = torch.tanh(x)
        return x


def _saved_by_autograd(module: nn.Module, x: torch.Tensor) -> int:
    kept: dict[int, torch.UntypedStorage] = {}

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        kept[tensor.untyped_storage()._cdata] = tensor.untyped_storage()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        module(x)
    return sum(storage.nbytes() for storage in kept.values())


def test_each_saved_storage_counts_though_its_address_is_reused() -> None:
    module = nn.Sequential(Chained())
    x = torch.randn(64, 1024, requires_grad=True)
    records, _ = record_calls(module, lambda: module(x))
    (chained,) = [r for r in records if isinstance(r.module, Chained)]
    expected = _saved_by_autograd(module, x)
    assert expected == 6 * x.nbytes  # tanh saves its result
    assert chained.saved_bytes == expected
