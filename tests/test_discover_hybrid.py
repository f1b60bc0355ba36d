"""The chain of a hybrid model: layers of several types called from one ``ModuleList``.

Before, a run was calls of one module type, so Jamba's attention layers broke its run of
Mamba layers: the chain held 3 of its 8 layers, the other 5 kept every activation, and half
of keep-all was refused as infeasible. Oracles: the model's own layers (the chain must hold
every one), plain autograd's loss and gradients bit for bit, and the step's memory measured
independently (``step_within_budget``).
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import offremat
from tests.oracles import step_within_budget

SIZES = {
    "vocab_size": 64,
    "hidden_size": 32,
    "intermediate_size": 64,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "use_cache": False,
}


def jamba() -> nn.Module:
    """Jamba: an attention layer every 4th (from the 3rd), Mamba layers between."""
    from transformers import JambaConfig, JambaForCausalLM

    config = JambaConfig(
        **SIZES,
        attn_layer_period=4,
        attn_layer_offset=2,
        expert_layer_period=2,
        expert_layer_offset=1,
        num_experts=2,
        mamba_d_state=8,
        mamba_expand=2,
    )
    return JambaForCausalLM(config)


def zamba() -> nn.Module:
    """Zamba: hybrid layers that each call one shared attention block, and Mamba layers."""
    from transformers import ZambaConfig, ZambaForCausalLM

    config = ZambaConfig(
        **SIZES,
        attn_layer_period=3,
        attn_layer_offset=2,
        mamba_d_state=8,
        mamba_expand=2,
        mamba_dt_rank=4,
        n_mamba_heads=2,
        attention_hidden_size=64,
        attention_head_dim=16,
    )
    return ZambaForCausalLM(config)


@pytest.mark.parametrize("build", [jamba, zamba], ids=["jamba", "zamba"])
@pytest.mark.parametrize("fraction", [0.3, 0.5])
def test_hybrid_layers_form_one_chain(build, fraction: float) -> None:
    torch.manual_seed(0)
    model = build()
    reference = copy.deepcopy(model)
    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    optimized = offremat.optimize(model, batch, budget=fraction)
    assert optimized.chain.metadata["blocks"] == [f"model.layers.{k}" for k in range(8)]
    step_within_budget(optimized, model, reference, **batch)


class Attention(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attention = nn.MultiheadAttention(width, 2, batch_first=True)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        y = self.norm(x)
        return x + self.attention(y, y, y, key_padding_mask=padding, need_weights=False)[0]


class Convolution(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.conv = nn.Conv1d(width, width, 3, padding=1)
        self.mlp = nn.Sequential(
            nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)
        )

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        x = x + self.conv(x.masked_fill(padding[..., None], 0).transpose(1, 2)).transpose(1, 2)
        return x + self.mlp(x)


class RawFeedForward(nn.Module):
    """Its weights as parameters of its own, no modules."""

    def __init__(self, width: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(width, 4 * width) / width**0.5)
        self.w2 = nn.Parameter(torch.randn(4 * width, width) / (4 * width) ** 0.5)

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(x @ self.w1) @ self.w2


class Hybrid(nn.Module):
    """A user's hybrid: ``pattern`` spells its layers, "a" attention, "c" convolution and
    "r" a feed-forward layer of raw parameters, each taking the padding mask beside the
    state."""

    def __init__(self, pattern: str, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        kinds = {"a": Attention, "c": Convolution, "r": RawFeedForward}
        self.layers = nn.ModuleList(kinds[kind](width) for kind in pattern)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x[..., 0] > 1.5
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, padding)
        return self.head(x).square().mean()


@pytest.mark.parametrize("pattern", ["cacccacc", "rarrrarr"])
def test_a_users_hybrid_layers_form_one_chain(pattern: str) -> None:
    # A layer of raw parameters was no block to the hybrid run (a review): the chain held
    # the three after the last attention layer.
    torch.manual_seed(0)
    model = Hybrid(pattern)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 32, 8)
    optimized = offremat.optimize(model, x, budget=0.4)
    assert optimized.chain.metadata["blocks"] == [f"layers.{k}" for k in range(8)]
    step_within_budget(optimized, model, reference, x)


class Layer(nn.Module):
    """A block that runs a ``ModuleList`` of sublayers of two types itself."""

    def __init__(self, width: int):
        super().__init__()
        self.sublayers = nn.ModuleList([Attention(width), Convolution(width), Convolution(width)])

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        for sublayer in self.sublayers:
            x = sublayer(x, padding)
        return x


class Stack(nn.Module):
    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList(Layer(width) for _ in range(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x[..., 0] > 1.5
        for layer in self.layers:
            x = layer(x, padding)
        return x.square().mean()


def test_the_sublayers_inside_blocks_are_not_the_chain() -> None:
    """Three sublayers inside each of two blocks make a longer hybrid run than the blocks:
    the blocks are the chain, each planned whole."""
    torch.manual_seed(0)
    model = Stack()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 32, 16)
    optimized = offremat.optimize(model, x, budget=0.6)
    assert optimized.chain.metadata["blocks"] == ["layers.0", "layers.1"]
    step_within_budget(optimized, model, reference, x)


class Residual(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, channels, 3, padding=1)

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return x + torch.relu(self.conv(x)) * scale


class Level(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.blocks = nn.ModuleList([Residual(channels), Residual(channels)])

    def forward(self, x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x, scale)
        return x


class Down(nn.Module):
    def __init__(self, channels: int):
        super().__init__()
        self.conv = nn.Conv2d(channels, 2 * channels, 2, stride=2)

    def forward(self, x: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        return self.conv(x)


class Pyramid(nn.Module):
    """A feature pyramid: levels and the downsampling between them in one ``ModuleList``,
    each level's output read by a head of its own."""

    def __init__(self, downsampling_takes_the_scale: bool):
        super().__init__()
        self.alike = downsampling_takes_the_scale
        self.stem = nn.Conv2d(3, 8, 3, padding=1)
        self.levels = nn.ModuleList([Level(8), Down(8), Level(16), Down(16), Level(32)])
        self.heads = nn.ModuleList(nn.Conv2d(c, 4, 1) for c in (8, 16, 32))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        scale = x.mean()
        x = self.stem(x)
        features = []
        for level in self.levels:
            x = level(x, scale) if isinstance(level, Level) or self.alike else level(x)
            if isinstance(level, Level):
                features.append(x)
        return sum(head(f).square().mean() for head, f in zip(self.heads, features, strict=True))


@pytest.mark.parametrize("alike", [False, True], ids=["called-in-turns", "called-alike"])
def test_a_list_of_stages_whose_outputs_heads_read_is_no_hybrid_chain(alike: bool) -> None:
    """A review: the pyramid's levels and downsampling layers made a hybrid run longer than a
    level's blocks, which the heads' reads then refused, and the model with it."""
    torch.manual_seed(0)
    model = Pyramid(alike)
    reference = copy.deepcopy(model)
    x = torch.randn(2, 3, 32, 32)
    optimized = offremat.optimize(model, x, budget=1.0)
    assert optimized.chain.metadata["blocks"] == ["levels.0.blocks.0", "levels.0.blocks.1"]
    step_within_budget(optimized, model, reference, x)


class Headed(nn.Module):
    """Two blocks, then a head of torch's own layers in a ``ModuleList``, called in turn."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.layers = nn.ModuleList([Attention(width), Convolution(width)])
        parts = [nn.Linear(width, width), nn.LayerNorm(width), nn.Linear(width, 1)]
        self.head = nn.ModuleList(parts)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x[..., 0] > 1.5
        for layer in self.layers:
            x = layer(x, padding)
        for part in self.head:
            x = part(x)
        return x.square().mean()


def test_torchs_own_layers_in_a_list_are_no_hybrid_chain() -> None:
    """A run of the head's three layers, longer than the two blocks, was the chain."""
    torch.manual_seed(0)
    model = Headed()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 32, 16)
    optimized = offremat.optimize(model, x, budget=0.9)
    assert optimized.chain.metadata["blocks"] == ["layers.0", "layers.1"]
    step_within_budget(optimized, model, reference, x)


class Unmasked(Convolution):
    """A convolution layer that takes no padding mask: its model calls it with the state
    alone."""

    def forward(self, x: torch.Tensor, padding: torch.Tensor | None = None) -> torch.Tensor:
        return super().forward(x, torch.zeros(x.shape[:2], dtype=torch.bool))


class MixedCalls(nn.Module):
    """A hybrid loop that calls each kind of layer its own way, the attention layers with the
    mask, the convolution layers without; or ``GRU`` layers between attention layers."""

    def __init__(self, kinds: str, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        layer = {"a": Attention, "c": Unmasked, "g": lambda w: nn.GRU(w, w, batch_first=True)}
        self.layers = nn.ModuleList(layer[kind](width) for kind in kinds)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x[..., 0] > 1.5
        x = self.embed(x)
        for layer in self.layers:
            if isinstance(layer, Attention):
                x = layer(x, padding)
            else:
                x = layer(x)[0] if isinstance(layer, nn.GRU) else layer(x)
        return self.head(x).square().mean()


def _every_layer_chained(model: nn.Module, layers: int, budget: float) -> None:
    """The model's ``layers.0`` .. are all in its chain, and a step at ``budget`` is plain
    autograd's, within the budget."""
    reference = copy.deepcopy(model)
    x = torch.randn(4, 32, 8)
    optimized = offremat.optimize(model, x, budget=budget)
    chained = [b for b in optimized.chain.metadata["blocks"] if b.startswith("layers.")]
    assert chained == [f"layers.{k}" for k in range(layers)]
    step_within_budget(optimized, model, reference, x)


@pytest.mark.parametrize("kinds", ["cacccacc", "agagagag"])
def test_layers_called_each_their_own_way_or_torchs_own_form_one_chain(kinds: str) -> None:
    """A review: cut where the side arguments changed, the convolutions' run held 3 of the 8
    layers and half of keep-all was refused; torch's GRU layers were no blocks at all, and
    the model was refused."""
    torch.manual_seed(0)
    _every_layer_chained(MixedCalls(kinds), 8, budget=0.6)


class Adapter(nn.Module):
    """A layer of a weight of its own that, disabled, returns its input unchanged."""

    def __init__(self, width: int):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor, padding: torch.Tensor) -> torch.Tensor:
        return x


class Adapted(nn.Module):
    """Four convolution layers and a disabled adapter after them, in one ``ModuleList``."""

    def __init__(self, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList([*(Convolution(width) for _ in range(4)), Adapter(width)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x[..., 0] > 1.5
        x = self.embed(x)
        for layer in self.layers:
            x = layer(x, padding)
        return x.square().mean()


def test_a_hybrid_run_another_refusal_refuses_is_no_chain() -> None:
    """A review: the run of the layers and the adapter, longer than the layers', was chosen
    and then refused for the adapter that returns its input, and the model with it."""
    torch.manual_seed(0)
    model = Adapted()
    reference = copy.deepcopy(model)
    x = torch.randn(4, 32, 8)
    optimized = offremat.optimize(model, x, budget=0.6)
    assert optimized.chain.metadata["blocks"][:4] == [f"layers.{k}" for k in range(4)]
    step_within_budget(optimized, model, reference, x)


class Halved(nn.Module):
    """A parametrization: the weight used is half the one stored."""

    def forward(self, weight: torch.Tensor) -> torch.Tensor:
        return weight / 2


class StateOnly(RawFeedForward):
    def forward(self, x: torch.Tensor) -> torch.Tensor:  # type: ignore[override]
        return x + torch.tanh(x @ self.w1) @ self.w2


class Sequenced(nn.Module):
    """Blocks that take the state alone, in an ``nn.Sequential`` between an embedding and a
    head."""

    def __init__(self, blocks: list[nn.Module], width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.Sequential(*blocks)
        self.head = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.layers(self.embed(x))).square().mean()


def test_blocks_with_a_parametrized_weight_are_of_one_type() -> None:
    """A review: parametrize gives each block a class of its own, so six such blocks in an
    ``nn.Sequential`` were six types, no run, and the model was refused."""
    from torch.nn.utils import parametrize

    torch.manual_seed(0)
    blocks = [StateOnly(16) for _ in range(6)]
    for block in blocks:
        parametrize.register_parametrization(block, "w1", Halved())
    _every_layer_chained(Sequenced(blocks), 6, budget=0.5)


class Supervised(nn.Module):
    """Layers of ``kinds`` and an auxiliary head reading the second one's output (deep
    supervision)."""

    def __init__(self, kinds: str, width: int = 16):
        super().__init__()
        self.embed = nn.Linear(8, width)
        self.layers = nn.ModuleList(
            Attention(width) if kind == "a" else Convolution(width) for kind in kinds
        )
        self.aux = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        padding = x[..., 0] > 1.5
        x = self.embed(x)
        aux = x.new_zeros(())
        for index, layer in enumerate(self.layers):
            x = layer(x, padding)
            if index == 1:
                aux = self.aux(x).square().mean()
        return x.square().mean() + aux / 10


@pytest.mark.parametrize("kinds", ["acacacac", "cccccccc"])
def test_a_run_an_auxiliary_head_reads_is_cut_at_the_read(kinds: str, caplog) -> None:
    """A review: the run was refused whole for the head's read, blocks= too, and the model
    with them; the layers after the read form a chain."""
    torch.manual_seed(0)
    model = Supervised(kinds)
    reference = copy.deepcopy(model)
    x = torch.randn(4, 32, 8)
    with caplog.at_level("WARNING", logger="offremat"):
        optimized = offremat.optimize(model, x, budget=0.6)
    assert optimized.chain.metadata["blocks"] == [f"layers.{k}" for k in range(2, 8)]
    if kinds == "cccccccc":  # the calls of the chain's type it leaves out: said, and why
        assert "aux reads layers.1's output" in caplog.text
    step_within_budget(optimized, model, reference, x)
