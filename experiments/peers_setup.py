"""What every part of ``peers_cpu.py`` shares: the models, the budgets and the settings."""

from __future__ import annotations

from typing import Any

import torch

FRACTIONS = (0.3, 0.5, 0.7)
COMPILE_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
MMAP_THRESHOLD = "65536"  # MALLOC_MMAP_THRESHOLD_ for every worker process
BANDWIDTH = 1.2e10
MILP_TIME_LIMIT_S = 20
SEED = 0
WARMUP_STEPS = 1
TIMED_STEPS = 4
HEAPS = ("glibc", "kept")  # glibc's default settings; freed memory kept in the heap
KEPT_HEAP_BYTES = 1 << 30
SUFFIX = {"glibc": "", "kept": "_kept"}  # of the row fields timed under each heap


def build(name: str) -> tuple[torch.nn.Sequential, Any]:
    """The model and its batch, the same in every process."""
    from offremat.models import (
        GPTConfig,
        ResNetConfig,
        build_gpt,
        build_resnet,
        gpt_batch,
        resnet_batch,
    )

    if name == "gpt":
        config = GPTConfig(layers=8, hidden=256, heads=4, seq=128, vocab=1024, dropout=0.0)
        return build_gpt(config, seed=SEED), gpt_batch(config, 8, seed=SEED)
    config = ResNetConfig(blocks=(2, 2, 2), width=16, image=32)
    return build_resnet(config, seed=SEED), resnet_batch(config, 32, seed=SEED)


MODEL_DESCRIPTIONS = {
    "gpt": "GPTConfig(layers=8, hidden=256, heads=4, seq=128, vocab=1024, dropout=0.0), batch 8",
    "resnet": "ResNetConfig(blocks=(2, 2, 2), width=16, image=32), batch 32",
}
