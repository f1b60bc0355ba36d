"""Tokens routed by their values: is every step over the budget said, and do later ones fit?

A routed block runs the tokens whose first feature is positive through a wide MLP, so what it
saves grows with how many tokens are chosen, at the same input shapes; a dense block (a
residual MLP of the same output size) saves as much whatever the values. Each model is a
pattern of six blocks ("R" routed, "D" dense): "RRRRRR"; "DDDRRR", whose routed blocks a plan
with checkpoints among the dense ones keeps to their backward; "RDRDRD" with wide dense
blocks, where a step said over while within its budget is a false alarm. Each run optimizes on
a batch where 8 of 64 tokens per sequence are chosen, then steps on batches where more are
(``--counts``). Every step is measured from outside by :class:`offremat.measure.StepMemory`
(the dispatch-mode tracker) and compared with the budget; a step is *said* where the library
logged a warning during it. The table counts, per model, solver and budget, the steps over the
budget, those of them unsaid, the warnings on steps within it (false alarms), and the last
step's peak; dp's plans follow measured times, so each row is several runs. A budget of 1.0
is keep-all's peak: the plan runs as plain autograd.

    python experiments/routed_growth.py --out experiments/results/routed_growth.md
"""

from __future__ import annotations

import argparse
import datetime
import logging
import platform
import shlex
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

import offremat
from offremat.measure import StepMemory
from offremat.models import RoutedNet

# (blocks, dense blocks' hidden width, solver, budget as a fraction of keep-all's peak)
RUNS = (
    ("RRRRRR", 0, "dp", 0.7),
    ("RRRRRR", 0, "dp", 0.9),
    ("RRRRRR", 0, "chen", 0.9),
    ("RRRRRR", 0, "checkpoint-every-stage", 0.9),
    ("RRRRRR", 0, "dp", 1.0),
    ("DDDRRR", 128, "chen", 0.8),
    ("DDDRRR", 128, "dp", 0.6),
    ("RDRDRD", 512, "chen", 0.95),
)


def routed_model(pattern: str, width: int) -> nn.Module:
    torch.manual_seed(0)
    model = RoutedNet(pattern, width)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)  # the budget leaves gradients out
    return model


def batch(chosen: int) -> torch.Tensor:
    """8 sequences of 64 tokens, the first ``chosen`` of each routed."""
    tokens = torch.rand(8, 64, 64, generator=torch.Generator().manual_seed(0))
    tokens[:, chosen:, 0] *= -1
    return tokens


class _Said(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        self.count += 1


def run(
    pattern: str, width: int, solver: str, fraction: float, counts: list[int]
) -> dict[str, object]:
    model = routed_model(pattern, width)
    om = offremat.optimize(model, batch(8), budget=fraction, solver=solver)
    said = _Said()
    logging.getLogger("offremat").addHandler(said)
    over = false_alarms = 0
    unsaid: list[str] = []
    peaks = []
    try:
        for count in counts:
            said.count = 0
            tokens = batch(count)  # made before the measurement, which counts it once
            with StepMemory("cpu", tokens) as memory:
                om(tokens).backward()
            peak = memory.peak_bytes / om.plan.budget_bytes
            peaks.append(peak)
            over += peak > 1
            if peak > 1 and not said.count:
                unsaid.append(f"{count}: {peak:.3f}")
            false_alarms += peak <= 1 and bool(said.count)
    finally:
        logging.getLogger("offremat").removeHandler(said)
    return {
        "blocks": pattern + (f" (dense width {width})" if width else ""),
        "solver": solver,
        "budget": fraction,
        "steps": len(counts),
        "over": over,
        "over, unsaid": len(unsaid),
        "unsaid (chosen: peak)": ", ".join(unsaid),
        "said, within": false_alarms,
        "worst peak": max(peaks),
        "last peak": peaks[-1],
    }


def _joined(values: list[object]) -> str:
    """One value where the runs agree, else each run's, joined by " / "."""
    shown = [f"{v:.3f}" if isinstance(v, float) else str(v) for v in values]
    return shown[0] if len(set(shown)) == 1 else " / ".join(shown)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", default="8,12,12,16,16,24,24,40,40,12")
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.getLogger("offremat").propagate = False  # counted, not printed
    counts = [int(c) for c in args.counts.split(",")]
    rows = []
    for pattern, width, solver, fraction in RUNS:
        # dp's plans follow measured times, so they differ from run to run: each row is
        # --repeats runs side by side, their figures joined by " / ".
        runs = [run(pattern, width, solver, fraction, counts) for _ in range(args.repeats)]
        rows.append({key: _joined([r[key] for r in runs]) for key in runs[0]})
    columns = list(rows[0])
    lines = [
        "# Routed tokens: steps over the budget said",
        "",
        f"Command: `python {shlex.join(sys.argv)}`  ",
        f"Date: {datetime.date.today()}; commit "
        + subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        ).stdout.strip()
        + f"; torch {torch.__version__}; {platform.processor() or platform.machine()}, CPU, "
        "1 thread  ",
        f"Counts of chosen tokens per step: {args.counts} (the example: 8); {args.repeats} "
        "runs per row, each optimized anew (figures that differ between runs are given per "
        "run, joined by ' / '). Peaks are StepMemory's over the whole step, the batch made "
        "before it, divided by the budget; a step is said where offremat logged a warning "
        "during it.",
        "",
        "| " + " | ".join(columns) + " |",
        "|" + "---|" * len(columns),
    ]
    for row in rows:
        lines.append("| " + " | ".join(row.values()) + " |")
    text = "\n".join(lines) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)


if __name__ == "__main__":
    main()
