"""How close a chain predicted from other input shapes comes to a real profile of its shape.

``offremat.optimize`` profiles a model at the shapes it meets and predicts the chain of a new
shape from them where they bound it (``solvers.predict.predict_chain``: a chord between two
sizes, a quadratic through three or more). Its bytes are checked exactly by the tests
(``tests/test_shapes.py``); its times are measurements, so they are compared here: for each
configuration (the model, the profiled sizes, the unseen one), the sizes and the unseen one
are profiled in ``--rounds`` rounds (each stage's least time over them: another process's
load only ever adds time), and the predicted step compute time (Σ fwd + Σ bwd) is divided by
the profiled one. That is done ``--attempts`` times, so the spread of the ratio shows the
machine's noise beside the prediction's own error, which repeats in every attempt.

    python experiments/shape_prediction.py --out experiments/results/shape_prediction_cpu.md
"""

from __future__ import annotations

import argparse
import dataclasses
import platform
import statistics
import subprocess
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch

from offremat import models
from offremat.profiler import profile_model
from solvers.chain import Chain
from solvers.predict import predict_chain

# (model, profiled sizes, unseen size): sequence lengths of the GPT, batch sizes of the ResNet.
CONFIGURATIONS = (
    ("gpt", (96, 256), 128),
    ("gpt", (64, 128, 256), 96),
    ("gpt", (64, 96, 128, 256), 32),
    ("resnet", (16, 32), 24),
    ("resnet", (8, 12, 16, 24), 28),
    ("resnet", (16, 20, 24, 32), 12),
)
GPT = models.GPTConfig(layers=2, hidden=64, heads=4, seq=256, vocab=128, dropout=0.0)
RESNET = models.ResNetConfig(blocks=(1, 1), width=8, image=16)


def model_and_batches(name: str) -> tuple[torch.nn.Module, Any]:
    """The model and a function from a size to its batch."""
    if name == "gpt":
        return models.build_gpt(GPT), lambda n: models.gpt_batch(dataclasses.replace(GPT, seq=n), 4)
    return models.build_resnet(RESNET), lambda n: models.resnet_batch(RESNET, n)


def least(chains: list[Chain]) -> Chain:
    """The chain with each stage's least times over ``chains`` (profiles of one shape)."""
    stages = [
        dataclasses.replace(
            column[0],
            fwd_s=min(s.fwd_s for s in column),
            bwd_s=min(s.bwd_s for s in column),
            refill_s=min(s.refill_s for s in column),
        )
        for column in zip(*(chain.stages for chain in chains), strict=True)
    ]
    return dataclasses.replace(chains[0], stages=tuple(stages))


def attempt(name: str, sizes: tuple[int, ...], unseen: int, rounds: int) -> float:
    """Predicted ÷ profiled step compute time of ``unseen``, in one attempt."""
    model, batch = model_and_batches(name)
    every = (*sizes, unseen)
    # Rounds over every size, so that a burst of load spares some round of each size.
    profiles = [
        {n: profile_model(model, batch(n), warmup=1, repeats=3) for n in every}
        for _ in range(rounds)
    ]
    chains = {n: least([p[n] for p in profiles]) for n in every}
    real = chains.pop(unseen)
    predicted = predict_chain(list(chains.items()), unseen)
    if predicted is None:
        raise RuntimeError(f"{name} {sizes} -> {unseen}: no prediction")
    return predicted.compute_time_s / real.compute_time_s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--attempts", type=int, default=3)
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name, sizes, unseen in CONFIGURATIONS:
        ratios = [attempt(name, sizes, unseen, args.rounds) for _ in range(args.attempts)]
        rows.append(
            f"| {name} | {', '.join(map(str, sizes))} | {unseen} | "
            f"{statistics.median(ratios):.3f} | {min(ratios):.3f}-{max(ratios):.3f} |"
        )
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    command = f"python experiments/shape_prediction.py --rounds {args.rounds} --attempts "
    command += f"{args.attempts}" + (f" --out {args.out}" if args.out else "")
    lines = [
        "# Predicted against profiled step compute time of an unseen shape (CPU)",
        "",
        f"- Command: `{command}`; git {commit}; {datetime.now(UTC):%Y-%m-%d %H:%M} UTC",
        f"- torch {torch.__version__}, {platform.machine()}, 1 torch thread",
        f"- Models: gpt {GPT}, batch 4, sizes are sequence lengths; resnet {RESNET}, sizes "
        "are batch sizes",
        "",
        "| model | profiled sizes | unseen | predicted ÷ profiled (median) | range over attempts |",
        "|---|---|---:|---:|---|",
        *rows,
    ]
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
