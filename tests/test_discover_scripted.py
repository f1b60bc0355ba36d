"""TorchScript modules in a model: optimize crashed on torch's "register_forward_pre_hook is
not supported on ScriptModules", as the recording hooked every module. Outside the blocks
(or inside them) they are opaque calls; scripted blocks are refused, saying what to do."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import offremat
from offremat._blocks import NotAChainError
from offremat.measure import StepMemory

WIDTH = 16
pytestmark = pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated")


class Gelu(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.gelu(x)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 2 * WIDTH)
        self.act = torch.jit.script(Gelu())
        self.down = nn.Linear(2 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(self.act(self.up(self.norm(x))))


class Head(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(WIDTH, 4)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return self.proj(h).pow(2).mean()


class Net(nn.Module):
    def __init__(self, scripted_blocks: bool = False) -> None:
        super().__init__()
        self.inp = nn.Linear(8, WIDTH)
        blocks = (Block() for _ in range(4))
        self.blocks = nn.ModuleList(torch.jit.script(b) if scripted_blocks else b for b in blocks)
        self.head = torch.jit.script(Head())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


def _model() -> Net:
    torch.manual_seed(0)
    return Net()


@pytest.mark.parametrize("blocks", [None, "blocks"])
def test_scripted_modules_outside_the_blocks_train_exactly_within_budget(blocks) -> None:
    model, plain = _model(), _model()  # (a deep copy of a ScriptModule loses its leaves)
    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(model, x, budget=0.6, blocks=blocks)
    assert "blocks.0" in om.chain.stage_names
    for m in (model, plain):
        for p in m.parameters():
            p.grad = torch.zeros_like(p)
    with StepMemory("cpu", inputs=x) as memory:
        om(x).backward()
    assert memory.peak_bytes <= om.plan.budget_bytes
    plain(x).backward()
    for (name, p), q in zip(model.named_parameters(), plain.parameters(), strict=True):
        assert torch.equal(p.grad, q.grad), name


@pytest.mark.parametrize("blocks", [None, "blocks"])
def test_scripted_blocks_are_refused_saying_what_to_do(blocks) -> None:
    torch.manual_seed(0)
    x = torch.randn(4, 16, 8)
    with pytest.raises(NotAChainError, match=r"blocks\.0, .* TorchScript modules .* Python"):
        offremat.optimize(Net(scripted_blocks=True), x, budget=0.6, blocks=blocks)


def test_scripted_modules_are_keyed_by_their_code_in_the_disk_cache(tmp_path) -> None:
    x = torch.randn(4, 16, 8, generator=torch.Generator().manual_seed(0))
    offremat.optimize(_model(), x, budget=0.6, cache_dir=tmp_path)
    again = offremat.optimize(_model(), x, budget=0.6, cache_dir=tmp_path)
    assert again.cache_info()["from_disk"] == 1
