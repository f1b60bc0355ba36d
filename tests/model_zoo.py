"""Models nobody in this project wrote the chain of: Hugging Face, a torchvision-style ResNet,
a user's module looping over an ``nn.ModuleList``. Small configurations, no download.

torchvision is not installed: the only wheel for this torch is a CUDA build that fails to
import beside the CPU torch. :class:`ResNet` is written the torchvision way instead, with its
``ReLU(inplace=True)``, in-place residual adds, BatchNorm and ``layer1``..``layer4``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn import functional as F


def gpt2() -> nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=8,
        n_embd=64,
        n_head=4,
        vocab_size=96,
        n_positions=64,
        bos_token_id=0,
        eos_token_id=0,
    )
    return GPT2LMHeadModel(config)


# Llama and Qwen2 at the same small size: two decoder families, one configuration.
_DECODER = {
    "num_hidden_layers": 8,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 96,
    "bos_token_id": 0,
    "eos_token_id": 0,
    "pad_token_id": 0,
}


def llama(**settings: Any) -> nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(**{**_DECODER, **settings}))


def qwen2() -> nn.Module:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    return Qwen2ForCausalLM(Qwen2Config(**_DECODER))


# Decoders whose layers return their attention weights beside the hidden state, asked for or
# not, and the model drops them (older Hugging Face families).
def gpt_neo() -> nn.Module:
    from transformers import GPTNeoConfig, GPTNeoForCausalLM

    config = GPTNeoConfig(
        num_layers=4,
        hidden_size=64,
        num_heads=4,
        vocab_size=96,
        attention_types=[[["global", "local"], 2]],
        max_position_embeddings=64,
        bos_token_id=0,
        eos_token_id=0,
        use_cache=False,
    )
    return GPTNeoForCausalLM(config)


def bloom() -> nn.Module:
    from transformers import BloomConfig, BloomForCausalLM

    return BloomForCausalLM(BloomConfig(n_layer=4, hidden_size=64, n_head=4, vocab_size=96))


def mpt() -> nn.Module:
    from transformers import MptConfig, MptForCausalLM

    return MptForCausalLM(MptConfig(n_layers=4, d_model=64, n_heads=4, vocab_size=96))


def t5() -> nn.Module:
    """T5: the first block of each stack computes the position bias the others take and hand
    back; dropout on."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(
        num_layers=2,
        num_decoder_layers=5,
        d_model=32,
        d_kv=8,
        d_ff=64,
        num_heads=4,
        vocab_size=96,
        decoder_start_token_id=0,
        use_cache=False,
        dropout_rate=0.1,
    )
    return T5ForConditionalGeneration(config)


def bart(**settings: Any) -> nn.Module:
    """BART: an encoder and a decoder of 3 layers each, every layer Hugging Face's
    ``GradientCheckpointingLayer`` (``settings`` override the config's)."""
    from transformers import BartConfig, BartForConditionalGeneration

    torch.manual_seed(0)
    config = BartConfig(
        vocab_size=96,
        d_model=32,
        encoder_layers=3,
        decoder_layers=3,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=64,
        decoder_ffn_dim=64,
        max_position_embeddings=64,
        use_cache=False,
        pad_token_id=1,
        bos_token_id=0,
        eos_token_id=2,
        decoder_start_token_id=2,
    )
    for name, value in settings.items():
        setattr(config, name, value)
    return BartForConditionalGeneration(config).train()


def llava() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """LLaVA (a CLIP vision tower and a Llama) and a batch of 16 image tokens among 24: its
    forward asks the tower for its hidden states, which Hugging Face records with hooks it
    installs on the first call, marking the tower with an attribute."""
    from transformers import (
        CLIPVisionConfig,
        LlamaConfig,
        LlavaConfig,
        LlavaForConditionalGeneration,
    )

    torch.manual_seed(0)
    vision = CLIPVisionConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=4,
        image_size=16,
        patch_size=4,
    )
    config = LlavaConfig(
        vision_config=vision,
        text_config=LlamaConfig(**_DECODER),
        image_token_index=95,
        vision_feature_layer=-1,
        projector_hidden_act="gelu",
    )
    ids = torch.randint(3, 95, (2, 24), generator=torch.Generator().manual_seed(0))
    ids[:, 1:17] = 95  # (16 / 4)² patches, the class token dropped
    batch = {"input_ids": ids, "pixel_values": torch.randn(2, 3, 16, 16), "labels": ids}
    return LlavaForConditionalGeneration(config).train(), batch


def albert() -> nn.Module:
    """ALBERT: one layer module called as each of 4 layers, its parameters every stage's."""
    from transformers import AlbertConfig, AlbertForSequenceClassification

    torch.manual_seed(0)
    config = AlbertConfig(
        num_hidden_layers=4,
        hidden_size=32,
        intermediate_size=128,
        num_attention_heads=4,
        vocab_size=96,
        max_position_embeddings=64,
        embedding_size=16,
        num_labels=3,
    )
    return AlbertForSequenceClassification(config).train()


def wav2vec2(layerdrop: float, **settings: Any) -> nn.Module:
    """An audio encoder whose config sets LayerDrop for its transformer layers."""
    from transformers import Wav2Vec2Config, Wav2Vec2ForSequenceClassification

    torch.manual_seed(0)
    config = Wav2Vec2Config(
        hidden_size=32,
        num_hidden_layers=6,
        num_attention_heads=4,
        intermediate_size=64,
        conv_dim=(16, 16),
        conv_stride=(5, 4),
        conv_kernel=(10, 4),
        num_conv_pos_embeddings=8,
        num_conv_pos_embedding_groups=4,
        num_labels=4,
        layerdrop=layerdrop,
        mask_time_prob=0.0,
        **settings,
    )
    return Wav2Vec2ForSequenceClassification(config).train()


def vit() -> nn.Module:
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(
        num_hidden_layers=8,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        image_size=32,
        patch_size=4,
        num_labels=10,
        hidden_dropout_prob=0.1,
    )
    return ViTForImageClassification(config)


class BasicBlock(nn.Module):
    """torchvision's ResNet block: in-place ReLU and an in-place residual add."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(
                nn.Conv2d(inplanes, planes, 1, stride, bias=False), nn.BatchNorm2d(planes)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        identity = x
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        if self.downsample is not None:
            identity = self.downsample(x)
        out += identity
        return self.relu(out)


class ResNet(nn.Module):
    """torchvision's ResNet-18 layout at a small width."""

    def __init__(
        self,
        widths: tuple[int, ...] = (8, 16, 32, 64),
        depths: tuple[int, ...] = (2, 2, 2, 2),
        classes: int = 10,
    ):
        super().__init__()
        self.conv1 = nn.Conv2d(3, widths[0], 7, 2, 3, bias=False)
        self.bn1 = nn.BatchNorm2d(widths[0])
        self.relu = nn.ReLU(inplace=True)
        self.maxpool = nn.MaxPool2d(3, 2, 1)
        inplanes = widths[0]
        for index, (planes, depth) in enumerate(zip(widths, depths, strict=True), start=1):
            stride = 1 if index == 1 else 2
            rest = [BasicBlock(planes, planes) for _ in range(depth - 1)]
            layer = nn.Sequential(BasicBlock(inplanes, planes, stride), *rest)
            self.add_module(f"layer{index}", layer)
            inplanes = planes
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(inplanes, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.maxpool(self.relu(self.bn1(self.conv1(x))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class ResidualBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)
        self.drop = nn.Dropout(0.1)

    def forward(self, h: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return h + self.drop(self.down(F.gelu(self.up(self.norm(h))))) * scale


class ResidualNet(nn.Module):
    """A user's own model: a loop over an ``nn.ModuleList``, a learned side input."""

    def __init__(self, width: int = 64, depth: int = 6):
        super().__init__()
        self.embed = nn.Linear(16, width)
        self.scale = nn.Parameter(torch.ones(width))
        self.blocks = nn.ModuleList(ResidualBlock(width) for _ in range(depth))
        self.head = nn.Linear(width, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        scale = self.scale * 0.5
        for block in self.blocks:
            h = block(h, scale)
        return self.head(h)


class Residual(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.body = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, width), nn.GELU())

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return h + self.body(h)


class StateOnlyNet(nn.Module):
    """Blocks that take nothing but the state, between a ``Sequential`` stem and head."""

    def __init__(self, width: int = 32, depth: int = 6):
        super().__init__()
        self.stem = nn.Sequential(nn.Linear(16, width), nn.Tanh())
        self.blocks = nn.ModuleList(Residual(width) for _ in range(depth))
        self.head = nn.Sequential(nn.Flatten(), nn.Linear(width * 16, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.stem(x)
        for block in self.blocks:
            h = block(h)
        return self.head(h)


class KeepsAnIntermediate(ResidualNet):
    """Keeps block 2's output for the loss: an output a chain does not hand out."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.embed(x)
        scale = self.scale * 0.5
        for index, block in enumerate(self.blocks):
            h = block(h, scale)
            if index == 2:
                self.middle = h
        return self.head(h)
