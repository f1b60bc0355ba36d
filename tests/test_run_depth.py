"""A step that runs more blocks than the chain holds is refused before they run: a model
that takes its depth as a tensor ran its extra blocks outside the plan, at 2.2x the budget."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offremat
from offremat._blocks import NotAChainError

WIDTH = 16


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x)))) * scale


class Depth(nn.Module):
    """Runs ``blocks[:depth]``, the depth a 0-d tensor (a Python int is part of the plan's
    key); with ``again``, the last block and block 0 also run on another input, outside the
    run."""

    def __init__(self, shared: bool = False, again: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        self.scale = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(1 if shared else 6))
        self.out = nn.Linear(WIDTH, 2)
        self.other = nn.Linear(8, WIDTH)
        self.shared, self.again = shared, again

    def forward(self, x: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
        h, scale = self.inp(x), self.scale(x)
        blocks = [self.blocks[0]] * int(depth) if self.shared else self.blocks[: int(depth)]
        for block in blocks:
            h = block(h, scale)
        loss = self.out(h).pow(2).mean()
        if self.again:  # the model's own use of a block, on another input
            # (on tensors of its own: gradients the chain's inputs also get add up in
            # another order, equal up to rounding)
            other = self.other(x)
            loss = loss + self.blocks[-1](other, torch.ones(WIDTH)).mean()
            loss = loss + self.blocks[0](other, torch.ones(WIDTH)).mean()
        return loss


def _batch() -> torch.Tensor:
    return torch.randn(4, 8, 8, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("shared", [False, True], ids=["blocks", "one-shared-block"])
def test_a_step_running_more_blocks_than_the_chain_is_refused(shared: bool) -> None:
    torch.manual_seed(0)
    model = Depth(shared)
    x = _batch()
    om = offremat.optimize(model, (x, torch.tensor(3)), budget=0.9)
    om(x, torch.tensor(3)).backward()  # the planned depth runs
    with pytest.raises(NotAChainError, match="runs more blocks than the 3 calls"):
        om(x, torch.tensor(5))


def test_a_block_used_again_on_another_input_still_runs_exactly() -> None:
    torch.manual_seed(0)
    model = Depth(again=True)
    plain = copy.deepcopy(model)
    x, depth = _batch(), torch.tensor(4)
    om = offremat.optimize(model, (x, depth), budget=0.9)
    for _ in range(2):
        om(x, depth).backward()
    for _ in range(2):
        plain(x, depth).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        if p.grad is None:  # a block neither runs
            assert q.grad is None, name
        elif name.startswith("blocks.0."):  # used in and outside the chain: summed in turn
            torch.testing.assert_close(p.grad, q.grad)
        else:
            assert torch.equal(p.grad, q.grad), name
