"""In-repo models for the demo, the sweeps and the tests, each an ``nn.Sequential`` of blocks.

The profiler makes one stage per child, so every child here is one block. As the chain format
has it (the last stage ends in the loss), each model takes ``(inputs, targets)`` as one tuple:
every stage but the last passes ``targets`` through untouched beside its hidden state, and the
last stage returns the scalar mean cross-entropy. A training step is therefore::

    loss = model((tokens, targets))
    loss.backward()

The GPT follows the pre-LN transformer of Radford et al., "Language Models are Unsupervised
Multitask Learners" (2019); the CNN follows the basic-block ResNet of He et al., "Deep Residual
Learning for Image Recognition" (2016).

One model is not a Sequential: :class:`RoutedNet`, whose blocks route tokens by their values
(as a mixture of experts does), so that what it saves changes at one input shape; it takes its
hidden states alone and returns a loss of its own (the experiments and tests of such sizes).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

Batch = tuple[torch.Tensor, torch.Tensor]


@dataclass(frozen=True)
class GPTConfig:
    """Size of the GPT-style transformer; the defaults train in seconds on a laptop CPU."""

    layers: int = 4
    hidden: int = 128
    heads: int = 4
    seq: int = 128
    vocab: int = 512
    dropout: float = 0.1

    def __post_init__(self) -> None:
        if self.hidden % self.heads:
            raise ValueError(
                f"hidden ({self.hidden}) must be a multiple of heads ({self.heads}); "
                "pick heads that divide hidden"
            )
        for name in ("layers", "hidden", "heads", "seq", "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"GPTConfig.{name} must be at least 1")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"GPTConfig.dropout must be in [0, 1), got {self.dropout}")


@dataclass(frozen=True)
class ResNetConfig:
    """Size of the ResNet-style CNN: residual blocks per resolution, base width, image size."""

    blocks: tuple[int, ...] = (2, 2, 2)
    width: int = 16
    image: int = 32
    channels: int = 3
    classes: int = 10

    def __post_init__(self) -> None:
        if not self.blocks or min(self.blocks) < 1:
            raise ValueError("ResNetConfig.blocks needs at least one resolution with >= 1 block")
        if self.image < 2 ** (len(self.blocks) - 1):
            raise ValueError(
                f"ResNetConfig.image ({self.image}) is too small to halve "
                f"{len(self.blocks) - 1} times; raise image or use fewer resolutions"
            )


class TokenEmbedding(nn.Module):
    """Token plus learned positional embedding, then dropout; passes the targets on."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.tokens = nn.Embedding(config.vocab, config.hidden)
        self.positions = nn.Embedding(config.seq, config.hidden)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, batch: Batch) -> Batch:
        tokens, targets = batch
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        hidden = self.tokens(tokens) + self.positions(positions)
        return self.dropout(hidden), targets


class CausalSelfAttention(nn.Module):
    """Multi-head self-attention where each position sees only itself and earlier ones."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.heads = config.heads
        self.dropout = config.dropout
        self.qkv = nn.Linear(config.hidden, 3 * config.hidden)
        self.proj = nn.Linear(config.hidden, config.hidden)
        self.proj_dropout = nn.Dropout(config.dropout)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        batch, seq, width = hidden.shape
        q, k, v = self.qkv(hidden).split(width, dim=2)
        q, k, v = (t.view(batch, seq, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        attended = F.scaled_dot_product_attention(
            q, k, v, dropout_p=self.dropout if self.training else 0.0, is_causal=True
        )
        attended = attended.transpose(1, 2).reshape(batch, seq, width)
        return self.proj_dropout(self.proj(attended))


class TransformerBlock(nn.Module):
    """Pre-LN block: x + attn(LN(x)), then x + MLP(LN(x)) with a 4x GELU MLP."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.attention_norm = nn.LayerNorm(config.hidden)
        self.attention = CausalSelfAttention(config)
        self.mlp_norm = nn.LayerNorm(config.hidden)
        self.mlp = nn.Sequential(
            nn.Linear(config.hidden, 4 * config.hidden),
            nn.GELU(),
            nn.Linear(4 * config.hidden, config.hidden),
            nn.Dropout(config.dropout),
        )

    def forward(self, batch: Batch) -> Batch:
        hidden, targets = batch
        hidden = hidden + self.attention(self.attention_norm(hidden))
        hidden = hidden + self.mlp(self.mlp_norm(hidden))
        return hidden, targets


class LanguageModelHead(nn.Module):
    """Final LayerNorm, projection to the vocabulary and mean next-token cross-entropy."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.norm = nn.LayerNorm(config.hidden)
        self.logits = nn.Linear(config.hidden, config.vocab, bias=False)

    def forward(self, batch: Batch) -> torch.Tensor:
        hidden, targets = batch
        logits = self.logits(self.norm(hidden))
        return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


class ResidualBlock(nn.Module):
    """Two 3x3 conv-BN layers with a skip connection; a strided 1x1 conv when shapes change."""

    def __init__(self, in_channels: int, out_channels: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(in_channels, out_channels, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(out_channels)
        self.conv2 = nn.Conv2d(out_channels, out_channels, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(out_channels)
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or in_channels != out_channels:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_channels, out_channels, 1, stride, bias=False),
                nn.BatchNorm2d(out_channels),
            )

    def forward(self, batch: Batch) -> Batch:
        images, targets = batch
        out = F.relu(self.bn1(self.conv1(images)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(images)), targets


class ConvStem(nn.Module):
    """3x3 conv, BatchNorm and ReLU from the image channels to the base width."""

    def __init__(self, config: ResNetConfig):
        super().__init__()
        self.conv = nn.Conv2d(config.channels, config.width, 3, 1, 1, bias=False)
        self.bn = nn.BatchNorm2d(config.width)

    def forward(self, batch: Batch) -> Batch:
        images, targets = batch
        return F.relu(self.bn(self.conv(images))), targets


class ClassifierHead(nn.Module):
    """Global average pooling, a linear classifier and mean cross-entropy."""

    def __init__(self, channels: int, classes: int):
        super().__init__()
        self.fc = nn.Linear(channels, classes)

    def forward(self, batch: Batch) -> torch.Tensor:
        features, targets = batch
        return F.cross_entropy(self.fc(features.mean(dim=(2, 3))), targets)


class RoutedBlock(nn.Module):
    """Runs only the tokens whose first feature is positive through a wide MLP."""

    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, 512), nn.Linear(512, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        chosen = h[..., 0] > 0
        out = h.clone()
        out[chosen] = h[chosen] + self.down(torch.tanh(self.up(h[chosen])))
        return out


class DenseBlock(nn.Module):
    """A residual MLP over every token, of a routed block's output size."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(64, width), nn.Linear(width, 64)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.down(torch.tanh(self.up(h)))


class RoutedNet(nn.Module):
    """Blocks by ``pattern`` ("R" routed, "D" dense of hidden ``width``) on hidden states of
    64 features, and the mean square of their output as the loss."""

    def __init__(self, pattern: str = "RRRRRR", width: int = 0) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(
            RoutedBlock() if kind == "R" else DenseBlock(width) for kind in pattern
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x.pow(2).mean()


def build_gpt(config: GPTConfig | None = None, seed: int = 0) -> nn.Sequential:
    """GPT-style transformer (Radford et al. 2019): ``embed, block0..block{N-1}, head``.

    Takes ``(tokens, targets)``, both int64 of shape (batch, seq); returns the mean loss.
    The same seed gives the same weights, and the global RNG is left as it was.
    """
    config = config or GPTConfig()
    with _seeded(seed):
        children: list[tuple[str, nn.Module]] = [("embed", TokenEmbedding(config))]
        children += [(f"block{n}", TransformerBlock(config)) for n in range(config.layers)]
        children.append(("head", LanguageModelHead(config)))
        return nn.Sequential(OrderedDict(children))


def build_resnet(config: ResNetConfig | None = None, seed: int = 0) -> nn.Sequential:
    """ResNet-style CNN (He et al. 2016): ``stem``, one stage per residual block, ``head``.

    Takes ``(images, labels)`` with images (batch, channels, image, image) and int64 labels;
    returns the mean loss. Each new resolution halves the size and doubles the width.
    """
    config = config or ResNetConfig()
    with _seeded(seed):
        children: list[tuple[str, nn.Module]] = [("stem", ConvStem(config))]
        channels = config.width
        for level, count in enumerate(config.blocks):
            width = config.width * 2**level
            for n in range(count):
                stride = 2 if level > 0 and n == 0 else 1
                children.append((f"res{level}_{n}", ResidualBlock(channels, width, stride)))
                channels = width
        children.append(("head", ClassifierHead(channels, config.classes)))
        return nn.Sequential(OrderedDict(children))


def gpt_batch(config: GPTConfig, batch: int, seed: int = 0, device: str = "cpu") -> Batch:
    """Random ``(tokens, targets)`` for :func:`build_gpt`: targets are tokens shifted by one.

    Drawn on the CPU whatever the default device, so that a seed gives the same batch anywhere.
    """
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, config.seq + 1)
    stream = torch.randint(0, config.vocab, shape, generator=generator, device="cpu")
    return stream[:, :-1].contiguous().to(device), stream[:, 1:].contiguous().to(device)


def resnet_batch(config: ResNetConfig, batch: int, seed: int = 0, device: str = "cpu") -> Batch:
    """Random ``(images, labels)`` for :func:`build_resnet`, drawn on the CPU (see gpt_batch)."""
    generator = torch.Generator().manual_seed(seed)
    shape = (batch, config.channels, config.image, config.image)
    images = torch.randn(shape, generator=generator, device="cpu")
    labels = torch.randint(0, config.classes, (batch,), generator=generator, device="cpu")
    return images.to(device), labels.to(device)


@dataclass(frozen=True)
class ModelSpec:
    """A named in-repo model with its size and a default batch, for ``--model NAME``."""

    name: str
    description: str
    build: Callable[[int], nn.Sequential]
    batch: Callable[[int, int, str], Batch]
    default_batch_size: int


def _gpt_spec(name: str, config: GPTConfig, batch_size: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        description=(
            f"GPT {config.layers} layers, hidden {config.hidden}, {config.heads} heads, "
            f"seq {config.seq}, vocab {config.vocab}"
        ),
        build=lambda seed: build_gpt(config, seed),
        batch=lambda size, seed, device: gpt_batch(config, size, seed, device),
        default_batch_size=batch_size,
    )


def _resnet_spec(name: str, config: ResNetConfig, batch_size: int) -> ModelSpec:
    return ModelSpec(
        name=name,
        description=(
            f"ResNet blocks {list(config.blocks)}, width {config.width}, "
            f"{config.image}x{config.image} images, {config.classes} classes"
        ),
        build=lambda seed: build_resnet(config, seed),
        batch=lambda size, seed, device: resnet_batch(config, size, seed, device),
        default_batch_size=batch_size,
    )


MODELS: dict[str, ModelSpec] = {
    spec.name: spec
    for spec in (
        _gpt_spec("gpt-tiny", GPTConfig(layers=2, hidden=32, heads=2, seq=16, vocab=64), 2),
        _gpt_spec("gpt-small", GPTConfig(), 8),
        _gpt_spec("gpt-medium", GPTConfig(layers=8, hidden=256, heads=8, seq=256), 8),
        _resnet_spec("resnet-tiny", ResNetConfig(blocks=(1, 1), width=8, image=8), 2),
        _resnet_spec("resnet-small", ResNetConfig(), 16),
    )
}


def model_spec(name: str) -> ModelSpec:
    """The in-repo model called ``name``; the error lists the names there are."""
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(
            f"unknown model {name!r}; choose one of: {', '.join(sorted(MODELS))}"
        ) from None


@contextmanager
def _seeded(seed: int) -> Iterator[None]:
    # Only the CPU generator: the weights are built on CPU, and a user's CUDA RNG stays untouched.
    with torch.random.fork_rng(devices=[]):
        torch.default_generator.manual_seed(seed)
        yield
