"""Whole-block stochastic depth drawn inside the block (``if self.training and torch.rand(())
< p: return x``): every block is called at every step, so the run looked fixed, and a profile
that saw a block skip planned too little for the steps where it computes (1.24-1.51x the
budget). A block seen to return its input unchanged, when recorded or profiled, is refused."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offremat
from offremat._blocks import NotAChainError
from offremat.measure import StepMemory

WIDTH = 32


class Block(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)
        self.p = p

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.training and torch.rand(()) < self.p:
            return x  # the whole residual branch dropped
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Net(nn.Module):
    def __init__(self, p: float) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(Block(p) for _ in range(4))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.out(h).pow(2).mean()

    def skip(self, p: float) -> None:
        for block in self.blocks:
            block.p = p


def _x(batch: int = 8) -> torch.Tensor:
    return torch.randn(batch, 32, 16, generator=torch.Generator().manual_seed(0))


@pytest.mark.parametrize("p", [0.4, 1.0])
def test_blocks_that_skip_themselves_are_refused_when_optimized(p: float) -> None:
    torch.manual_seed(0)
    with pytest.raises(NotAChainError, match="returned its input unchanged"):
        offremat.optimize(Net(p), _x(), budget=0.5)


def test_a_block_seen_skipping_in_a_new_shapes_profile_is_refused() -> None:
    torch.manual_seed(0)
    model = Net(0.0)
    om = offremat.optimize(model, _x(), budget=0.5)
    model.skip(1.0)  # a plain attribute: no new plan for it, but a new shape is profiled
    with pytest.raises(NotAChainError, match=r"blocks\.0 returned its input unchanged"):
        om(_x(5))


def test_skips_after_a_profile_that_saw_none_stay_within_budget_and_exact() -> None:
    torch.manual_seed(0)
    model = Net(0.0)
    om = offremat.optimize(model, _x(), budget=0.5)
    plain = copy.deepcopy(model)
    model.skip(0.4), plain.skip(0.4)
    for m in (model, plain):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    for step in range(2):
        torch.manual_seed(step)
        with StepMemory("cpu", inputs=_x()) as memory:
            loss = om(_x())
            loss.backward()
        assert memory.peak_bytes <= om.plan.budget_bytes
        torch.manual_seed(step)
        expected = plain(_x())
        expected.backward()
        assert torch.equal(loss, expected)
        for a, b in zip(model.parameters(), plain.parameters(), strict=True):
            assert torch.equal(a.grad, b.grad)
