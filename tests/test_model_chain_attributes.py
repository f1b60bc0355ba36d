"""Blocks that keep a tensor as an attribute which the loss reads after the loop (an
attention map for an entropy term): the code after the chain was measured with the blocks
run under no_grad, where that term saved nothing, and the keep-all plan passed its budget
(1.083x)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offremat
from offremat.measure import StepMemory

WIDTH = 32


class Block(nn.Module):
    def __init__(self, in_dict: bool = False) -> None:
        super().__init__()
        self.in_dict = in_dict
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attention = torch.softmax(x @ x.transpose(1, 2) / 8, -1)
        if self.in_dict:
            self.maps = {"attention": attention}
        else:
            self.last_attention = attention  # read by the model's loss
        return x + self.down(F.gelu(self.up(self.norm(attention @ x))))


class Entropy(nn.Module):
    def __init__(self, in_dict: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(16, WIDTH)
        self.blocks = nn.ModuleList(Block(in_dict) for _ in range(4))
        self.out = nn.Linear(WIDTH, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        maps = [
            block.maps["attention"] if block.in_dict else block.last_attention
            for block in self.blocks
        ]
        entropy = sum(-(a * (a + 1e-6).log()).sum(-1).mean() for a in maps)
        return self.out(h).pow(2).mean() + 0.01 * entropy


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("in_dict", [False, True])
def test_attributes_the_loss_reads_are_measured_with_their_graph(caplog, in_dict) -> None:
    torch.manual_seed(0)
    model = Entropy(in_dict)
    plain = copy.deepcopy(model)
    x = torch.randn(8, 32, 16, generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(model, x, budget=1.0)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # step 0's gradients are not activations
    with StepMemory("cpu", inputs=x) as memory:
        om(x).backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    for p in plain.parameters():
        p.grad = torch.zeros_like(p)
    plain(x).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name
