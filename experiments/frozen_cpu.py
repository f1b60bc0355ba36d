"""Fine-tuning with frozen first blocks on a CPU: offremat against plain autograd.

A residual MLP of 6 blocks (width 256, 4× expansion) and a linear head, its first 4 blocks
frozen, the input needing no gradient: the case of a frozen backbone. Methods: plain autograd,
and offremat's dp at 100%, 90% and 82% of the chain's keep-all peak (the frozen forwards alone
need 81.5%). In one process with one torch thread, the methods alternate in rotating order
over ``--rounds`` rounds of ``--steps`` timed steps each (after a warm-up step); the table
gives each method's median step time over all its steps divided by plain autograd's (a second
copy of the model under plain autograd shows the comparison's own noise), and the peak of one
untimed step measured by :class:`offremat.measure.StepMemory` (the dispatch-mode tracker),
against plain autograd's and the budget.

    python experiments/frozen_cpu.py --out experiments/results/frozen_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import platform
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

import offremat
from offremat.measure import StepMemory

WIDTH, ROWS, BLOCKS, FROZEN = 256, 2048, 6, 4
FRACTIONS = (1.0, 0.9, 0.82)  # the frozen forwards alone need 0.815 of keep-all


class Block(nn.Module):
    """x + W2 tanh(W1 x): a transformer's MLP half."""

    def __init__(self) -> None:
        super().__init__()
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(x)))


def fine_tuned() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[Block() for _ in range(BLOCKS)], nn.Linear(WIDTH, 1))
    for block in list(model)[:FROZEN]:
        block.requires_grad_(False)
    for parameter in model.parameters():
        if parameter.requires_grad:
            parameter.grad = torch.zeros_like(parameter)
    return model


def step(forward: Any, x: torch.Tensor) -> float:
    began = time.perf_counter()
    forward(x).pow(2).mean().backward()
    return time.perf_counter() - began


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--out", default="experiments/results/frozen_cpu.md")
    args = parser.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(ROWS, WIDTH, generator=torch.Generator().manual_seed(1))
    # A second copy under plain autograd measures the noise of the comparison itself.
    methods: dict[str, Any] = {
        "plain autograd": fine_tuned(),
        "plain autograd, 2nd copy": fine_tuned(),
    }
    budgets: dict[str, int | None] = {name: None for name in methods}
    decisions: dict[str, str] = {name: "" for name in methods}
    for fraction in FRACTIONS:
        om = offremat.optimize(fine_tuned(), x, budget=fraction)
        name = f"offremat dp {fraction:.0%}"
        methods[name], budgets[name] = om, om.plan.budget_bytes
        counts: dict[str, int] = {}
        for decision in om.plan.decisions.values():
            counts[decision] = counts.get(decision, 0) + 1
        decisions[name] = ", ".join(f"{n} {d}" for d, n in sorted(counts.items()))
        frozen = om.chain.frozen_stages
    peaks = {}
    for name, forward in methods.items():
        step(forward, x)
        with StepMemory("cpu", x) as memory:
            forward(x).pow(2).mean().backward()
        peaks[name] = memory.peak_bytes
    times: dict[str, list[float]] = {name: [] for name in methods}
    names = list(methods)
    for round_number in range(args.rounds):
        order = names[round_number % len(names) :] + names[: round_number % len(names)]
        for name in order:
            step(methods[name], x)
            times[name] += [step(methods[name], x) for _ in range(args.steps)]
    base = statistics.median(times["plain autograd"])
    lines = [
        "# Fine-tuning with frozen first blocks (CPU)",
        "",
        f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`; git "
        f"{_git_head()}; {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- torch {torch.__version__}, {platform.machine()}, 1 torch thread",
        f"- residual MLP, {BLOCKS} blocks of width {WIDTH} (4x expansion) and a linear head, "
        f"first {FROZEN} blocks frozen ({frozen} frozen stages found), batch {ROWS}",
        f"- {args.rounds} rounds of {args.steps} timed steps per method, rotating order",
        "",
        "| method | plan | step ÷ plain | measured peak | ÷ plain's | ÷ budget |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for name in methods:
        budget = budgets[name]
        lines.append(
            f"| {name} | {decisions[name]} | {statistics.median(times[name]) / base:.3f} "
            f"| {peaks[name] / 2**20:.2f} MiB | {peaks[name] / peaks['plain autograd']:.3f} "
            f"| {'—' if budget is None else f'{peaks[name] / budget:.3f}'} |"
        )
    text = "\n".join(lines) + "\n"
    Path(args.out).write_text(text)
    print(text)


def _git_head() -> str:
    done = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    return done.stdout.strip() or "unknown"


if __name__ == "__main__":
    main()
