"""TorchScript modules in a model: optimize crashed on torch's "register_forward_pre_hook is
not supported on ScriptModules", as the recording hooked every module. Outside the blocks
(or inside them) they are opaque calls; scripted blocks are refused, saying what to do."""

from __future__ import annotations

import copy

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


class _ScriptedInside(nn.Module):
    """A block whose last layer, or a norm with buffers, is TorchScript's."""

    def __init__(self, scripted: nn.Module) -> None:
        super().__init__()
        self.up = nn.Linear(16, 32)
        self.down = nn.Linear(32, 16)
        self.scripted = torch.jit.script(scripted)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.scripted(self.down(F.gelu(self.up(x))))


class _ScriptedNet(nn.Module):
    def __init__(self, scripted) -> None:
        super().__init__()
        self.inp = nn.Linear(8, 16)
        self.blocks = nn.ModuleList(_ScriptedInside(scripted()) for _ in range(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.inp(x)
        for block in self.blocks:
            h = block(h)
        return h.pow(2).mean()


def test_a_scripted_last_layer_of_a_block_recomputes_exactly() -> None:
    """TorchScript turns the exception that ends a refill early into one of its own: a stage
    holding TorchScript is refilled to its end, as a compiled one is."""
    torch.manual_seed(0)
    model = _ScriptedNet(lambda: nn.Dropout(0.2))
    reference = copy.deepcopy(model)
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(model, x, budget=0.5)
    assert "recompute" in om.plan.decisions.values()
    for step in range(2):
        torch.manual_seed(10 + step)
        om(x).backward()
        torch.manual_seed(10 + step)
        reference(x).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)


def test_a_scripted_layer_with_buffers_inside_a_block_is_refused_by_name() -> None:
    torch.manual_seed(0)
    with pytest.raises(RuntimeError, match="TorchScript module with buffers"):
        offremat.optimize(_ScriptedNet(lambda: nn.BatchNorm1d(16)), torch.randn(64, 8), budget=0.5)


def test_a_scripted_layer_with_parameters_inside_a_recomputed_block_trains_exactly() -> None:
    """A TorchScript module's parameter table hands out new key strings at every access."""
    torch.manual_seed(0)
    model = _ScriptedNet(lambda: nn.Linear(16, 16))
    torch.manual_seed(0)  # not deepcopy: a copied ScriptModule's parameters are no leaves
    reference = _ScriptedNet(lambda: nn.Linear(16, 16))
    x = torch.randn(64, 8, generator=torch.Generator().manual_seed(0))
    om = offremat.optimize(model, x, budget=0.6)
    assert "recompute" in om.plan.decisions.values()
    om(x).backward()
    reference(x).backward()
    for a, b in zip(model.parameters(), reference.parameters(), strict=True):
        assert torch.equal(a.grad, b.grad)
