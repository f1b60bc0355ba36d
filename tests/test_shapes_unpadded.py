"""Blocks whose input size follows the batch's values, not its shapes (padding removed before
them, as BERT's unpadding does): a step of another hidden size ran on the example's plan at
1.79x its budget. It is planned on its own size, or refused."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offremat
from offremat.measure import StepMemory
from solvers.budget import InfeasibleBudgetError

WIDTH = 32


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(F.gelu(self.up(self.norm(x))))


class Unpadded(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(Block() for _ in range(4))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)[valid][None]  # (1, valid tokens, WIDTH): the padding removed
        for block in self.blocks:
            h = block(h)
        return self.out(h).pow(2).mean()


def _batch(seed: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, 64, 16, generator=torch.Generator().manual_seed(seed))
    return x, (torch.arange(64) < length)[None, :].expand(4, 64)


def test_blocks_inputs_of_another_size_get_a_plan_of_their_own() -> None:
    torch.manual_seed(0)
    om = offremat.optimize(Unpadded(), _batch(0, 32), budget=0.9)
    full = _batch(1, 64)  # the same shapes, twice the valid tokens
    for _ in range(2):
        with StepMemory("cpu", inputs=full) as memory:
            om(*full).backward()
        assert memory.peak_bytes <= om.plan.budget_bytes
    assert om.cache_info()["variants"] == 1


def test_blocks_inputs_of_another_size_no_plan_fits_are_refused() -> None:
    torch.manual_seed(0)
    om = offremat.optimize(Unpadded(), _batch(0, 32), budget=0.5)
    with pytest.raises(InfeasibleBudgetError, match="another kind or size"):
        om(*_batch(1, 64))
