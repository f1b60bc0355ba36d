"""Blocks whose attributes hold themselves (``self.cache = []; self.cache.append(self.cache)``,
a dict holding itself): the after-loop scan of the blocks' attributes and the between-call
check of a block's state recursed into them until RecursionError. Now such an attribute is
walked once, and compared as the infinite value it stands for."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offremat
from offremat._blocks import NotAChainError
from offremat.measure import StepMemory

WIDTH = 16


def cyclic(kind: str, head: object = None) -> object:
    """A list or dict that holds itself (beside ``head`` where given)."""
    if kind == "list":
        value: list = [] if head is None else [head]
        value.append(value)
        return value
    mapping: dict = {} if head is None else {"head": head}
    mapping["self"] = mapping
    return mapping


class Block(nn.Module):
    def __init__(self, kind: str, keeps_map: bool) -> None:
        super().__init__()
        self.kind, self.keeps_map = kind, keeps_map
        self.cache = cyclic(kind)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        attention = torch.softmax(x @ x.transpose(1, 2) / 4, -1)
        if self.keeps_map:  # read by the loss, inside a container that holds itself
            self.maps = cyclic(self.kind, attention)
        return x + self.down(torch.tanh(self.up(attention @ x)))


class Model(nn.Module):
    """``rebuild``: a new cycle before each block call (``"same"``: equal to the last one;
    ``"counted"``: beside the step's count, which the chain's run could not have seen)."""

    def __init__(self, kind: str, rebuild: str | None = None, keeps_map: bool = False) -> None:
        super().__init__()
        self.kind, self.rebuild, self.keeps_map = kind, rebuild, keeps_map
        self.steps = 0
        self.inp = nn.Linear(8, WIDTH)
        self.blocks = nn.ModuleList(Block(kind, keeps_map) for _ in range(4))
        self.out = nn.Linear(WIDTH, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.steps += 1
        h = self.inp(x)
        for block in self.blocks:
            if self.rebuild is not None:
                block.cache = cyclic(self.kind, self.steps if self.rebuild == "counted" else None)
            h = block(h)
        loss = self.out(h).pow(2).mean()
        if self.keeps_map:
            maps = [b.maps[0] if self.kind == "list" else b.maps["head"] for b in self.blocks]
            loss = loss + 0.01 * sum(m.square().mean() for m in maps)
        return loss


def _grads_equal_and_within_budget(model: nn.Module, x: torch.Tensor, budget: float) -> None:
    plain = copy.deepcopy(model)
    om = offremat.optimize(model, x, budget=budget)
    for p in (*model.parameters(), *plain.parameters()):
        p.grad = torch.zeros_like(p)  # step 0's gradients are not activations
    for _ in range(2):
        with StepMemory("cpu", inputs=x) as memory:
            om(x).backward()
        assert memory.peak_bytes <= om.plan.budget_bytes
        plain(x).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", ["list", "dict"])
@pytest.mark.parametrize("rebuild", [None, "same"])
def test_a_block_attribute_that_holds_itself_trains(kind, rebuild) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 12, 8, generator=torch.Generator().manual_seed(0))
    _grads_equal_and_within_budget(Model(kind, rebuild), x, 0.7)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_tensor_the_loss_reads_inside_a_cycle_is_measured(kind) -> None:
    # The after-loop scan finds the attention map inside the cycle and cuts it from its
    # block's graph in a copy that keeps the cycle. A tensor that reaches the loss past the
    # stage's output is refused where a stage is recomputed: the keep-all plan runs.
    torch.manual_seed(0)
    x = torch.randn(4, 12, 8, generator=torch.Generator().manual_seed(0))
    _grads_equal_and_within_budget(Model(kind, keeps_map=True), x, 1.0)


@pytest.mark.filterwarnings("ignore")
@pytest.mark.parametrize("kind", ["list", "dict"])
def test_a_cycle_beside_a_changed_value_is_refused_not_recursed(kind) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 12, 8)
    with pytest.raises(NotAChainError, match="cache"):
        om = offremat.optimize(Model(kind, "counted"), x, budget=0.7)
        om(x).backward()
