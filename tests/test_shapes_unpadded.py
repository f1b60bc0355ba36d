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


def _sized(seed: int, length: int, valid: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(4, length, 16, generator=torch.Generator().manual_seed(seed))
    return x, (torch.arange(length) < valid)[None, :].expand(4, length)


def test_a_predicted_shapes_blocks_inputs_of_another_size_are_not_run_on_its_plan() -> None:
    """A predicted chain's blocks never ran: its first step's sizes stand for them, and a
    later batch of its shapes with more valid tokens is planned on its own (here: refused)."""
    torch.manual_seed(0)
    model = Unpadded()
    om = offremat.optimize(model, _sized(0, 32, 16), budget=0.9)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    om(*_sized(1, 64, 32)).backward()  # a second profiled shape, so that 48 is predicted
    om(*_sized(1, 48, 24)).backward()
    assert om.cache_info()["predicted"] == 1
    full = _sized(2, 48, 48)
    try:
        with StepMemory("cpu", inputs=full) as memory:
            om(*full).backward()
    except InfeasibleBudgetError as error:
        assert "another kind or size" in str(error)
    else:
        assert memory.peak_bytes <= om.plan.budget_bytes
