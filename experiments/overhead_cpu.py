"""Where offremat's step loses to torch's checkpoint_sequential on CPU: its own cost, page faults.

Three parts, each in one fresh process with one torch thread, the methods alternating in
rotating order over ``--rounds`` rounds of ``--steps`` timed steps (after a warm-up step):

- ``own-cost``: a 10-stage GPT so small that its compute is negligible (hidden 16, 8 tokens),
  so the step time is almost all Python. Plain autograd and ``checkpoint_sequential`` with 9
  segments against offremat running keep-all and the same 9-segment schedule
  (``solvers.baselines.checkpoint_sequential_plan``), 10 × ``--steps`` steps a round.
- ``faults``: the GPT of ``peers_cpu.py`` at 30% and 50% of keep-all: ``checkpoint_sequential``
  with the segment count that won ``peers_cpu.py`` there (9 and 7), offremat running that
  schedule, and offremat's dp plan, exact and with ``tolerance=0.005``, and the exact dp plan
  run by ``torch.utils.checkpoint`` (each run of stages it recomputes together under one
  checkpoint, where the plan has that shape): the control that tells the plan's cost from
  the executor's. Step
  time and minor page faults per step (``getrusage``). It runs twice: with glibc's default
  settings (any ``MALLOC_*`` variable of this environment left out), which give freed
  memory back to the system between allocations so that the next ones fault it in again,
  and with glibc told to keep it (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``),
  as the CUDA caching allocator keeps freed blocks on a GPU.
- ``resnet``: the same for the ResNet of ``peers_cpu.py`` at 70% of keep-all, the one budget
  where a plan fits it, against ``checkpoint_sequential`` with 3 segments.

    python experiments/overhead_cpu.py --out experiments/results/overhead_cpu.md
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint, checkpoint_sequential

import offremat
from offremat.models import (
    GPTConfig,
    ResNetConfig,
    build_gpt,
    build_resnet,
    gpt_batch,
    resnet_batch,
)
from solvers.baselines import checkpoint_sequential_plan, keep_all
from solvers.ops import BACKWARD, F_ALL, F_CK, F_NONE, backward, forward_all
from solvers.plan import Plan
from solvers.registry import keep_all_peak, solve
from solvers.simulator import score

SEGMENTS = 9
# Budget fraction: the segment count that won peers_cpu.py there (8ef174c at 30%, bede561 at 50%).
BUDGETS = {0.3: 9, 0.5: 7}
# The ResNet's budget fraction and segment count (peers_cpu.py at 5c3d75a).
RESNET_BUDGET = (0.7, 3)
KEEP_FREED = {"MALLOC_TRIM_THRESHOLD_": str(2**34), "MALLOC_MMAP_THRESHOLD_": str(2**25)}
TINY = GPTConfig(layers=8, hidden=16, heads=2, seq=8, vocab=32, dropout=0.0)
PEERS = GPTConfig(layers=8, hidden=256, heads=4, seq=128, vocab=1024, dropout=0.0)
RESNET = ResNetConfig(blocks=(2, 2, 2), width=16, image=32)


def methods(part: str, fraction: float) -> dict[str, Any]:
    """The callables whose ``f(batch).backward()`` is one training step, by name."""
    if part == "resnet":
        model, batch = build_resnet(RESNET, seed=0), resnet_batch(RESNET, 32, seed=0)
    else:
        config, rows = (TINY, 1) if part == "own-cost" else (PEERS, 8)
        model, batch = build_gpt(config, seed=0), gpt_batch(config, rows, seed=0)
    chain = offremat.profile_model(model, batch)
    budget = None if part == "own-cost" else int(fraction * keep_all_peak(chain))
    segments = {"own-cost": SEGMENTS, "resnet": RESNET_BUDGET[1]}.get(part)
    segments = segments or BUDGETS[fraction]
    schedule = score(checkpoint_sequential_plan(chain, segments), chain, budget)
    found = {
        "checkpoint_sequential": lambda b: checkpoint_sequential(
            model, segments, b, use_reentrant=False
        ),
        "offremat, same schedule": offremat.optimize(model, batch, chain=chain, plan=schedule),
    }
    if part == "own-cost":
        found["plain autograd"] = model
        plan = score(keep_all(chain), chain, None)
        found["offremat, keep-all"] = offremat.optimize(model, batch, chain=chain, plan=plan)
    else:
        plan = solve(chain, budget, "dp")  # the exact optimum
        found["offremat dp, exact"] = offremat.optimize(model, batch, chain=chain, plan=plan)
        runs = checkpointed_runs(plan)
        if runs is not None:
            # The control: the same plan, run by torch's checkpoint instead of offremat.
            found["dp's plan, run by torch.utils.checkpoint"] = run_checkpoint(model, runs)
        found["offremat dp, tolerance 0.005"] = offremat.optimize(
            model, batch, budget=budget, chain=chain, tolerance=0.005
        )
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    predicted = {
        name: (step.plan.predicted_time_s, step.plan.predicted_peak_bytes / budget)
        for name, step in found.items()
        if budget is not None and hasattr(step, "plan")
    }
    return {"batch": batch, "methods": found, "predicted": predicted}


def checkpointed_runs(plan: Plan) -> list[tuple[int, int]] | None:
    """The runs of stages (first, last) that ``plan`` recomputes, if ``torch.utils.checkpoint``
    runs it exactly: each run under one checkpoint (F_ck of its first stage, F_none of the
    rest, then F_all of them all right before their Bs), the other stages kept; else None (a
    plan with offloads, or recomputations nested or repeated)."""
    start = next(k for k, op in enumerate(plan.ops) if op.kind == BACKWARD)
    first_pass = plan.ops[:start]
    if [op.index for op in first_pass] != list(range(1, plan.length + 1)):
        return None
    runs: list[tuple[int, int]] = []
    for op in first_pass:
        if op.kind == F_CK:
            runs.append((op.index, op.index))
        elif op.kind == F_NONE and runs and runs[-1][1] == op.index - 1:
            runs[-1] = (runs[-1][0], op.index)
        elif op.kind != F_ALL:
            return None
    ends = {last: first for first, last in runs}
    expected = []
    i = plan.length
    while i > 0:
        first = ends.get(i, i)
        expected += [forward_all(k) for k in range(first, i + 1)] if i in ends else []
        expected += [backward(k) for k in range(i, first - 1, -1)]
        i = first - 1
    return runs if list(plan.ops[start:]) == expected else None


def run_checkpoint(model: torch.nn.Sequential, runs: list[tuple[int, int]]) -> Any:
    """The model's step with each run of stages in ``runs`` under one ``checkpoint``."""
    stages = list(model)
    firsts = {first: torch.nn.Sequential(*stages[first - 1 : last]) for first, last in runs}
    lasts = {first: last for first, last in runs}

    def step(value: Any) -> Any:
        i = 1
        while i <= len(stages):
            if i in firsts:
                value = checkpoint(firsts[i], value, use_reentrant=False)
                i = lasts[i] + 1
            else:
                value = stages[i - 1](value)
                i += 1
        return value

    return step


def measure(part: str, fraction: float, rounds: int, steps: int) -> dict[str, Any]:
    """Per method, the mean step time and minor faults per step of each round, and the
    simulator's step time and peak ÷ budget for the plans (``faults`` only)."""
    torch.set_num_threads(1)
    setup = methods(part, fraction)
    batch, found = setup["batch"], setup["methods"]
    names = list(found)
    results: dict[str, Any] = {name: {"time": [], "faults": []} for name in names}
    for round_ in range(rounds):
        order = names[round_ % len(names) :] + names[: round_ % len(names)]
        for name in order if round_ % 2 == 0 else reversed(order):
            step = found[name]
            step(batch).backward()
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
            start = time.perf_counter()
            for _ in range(steps):
                step(batch).backward()
            results[name]["time"].append((time.perf_counter() - start) / steps)
            faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
            results[name]["faults"].append(faults / steps)
    for name, (time_s, peak) in setup["predicted"].items():
        results[name]["predicted"] = (time_s, peak)
    return results


def table(results: dict[str, Any], reference: str) -> list[str]:
    base = results[reference]["time"]
    lines = [
        f"| method | step (ms) | ÷ {reference}, per round (median, range) | page faults a step "
        "| simulated step (ms) | simulated peak ÷ budget |",
        "|---|---:|---|---:|---:|---:|",
    ]
    for name, values in results.items():
        ratios = [a / b for a, b in zip(values["time"], base, strict=True)]
        simulated = values.get("predicted")
        predicted = (
            "— | —" if simulated is None else (f"{1e3 * simulated[0]:.2f} | {simulated[1]:.3f}")
        )
        lines.append(
            f"| {name} | {1e3 * statistics.median(values['time']):.2f} | "
            f"{statistics.median(ratios):.3f} ({min(ratios):.3f}-{max(ratios):.3f}) | "
            f"{statistics.median(values['faults']):.0f} | {predicted} |"
        )
    return lines


def run_part(
    part: str, rounds: int, steps: int, env: dict[str, str], fraction: float = 0.3
) -> dict[str, Any]:
    """``measure`` in a fresh interpreter with ``env`` added to this one's environment."""
    command = [sys.executable, __file__, "--part", part, "--rounds", str(rounds)]
    command += ["--fraction", str(fraction)]
    command += ["--steps", str(steps)]
    inherited = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    done = subprocess.run(
        command, env={**inherited, **env}, check=True, capture_output=True, text=True
    )
    return json.loads(done.stdout.splitlines()[-1])


def cpu_model() -> str:
    """The CPU's model name, from /proc/cpuinfo where there is one."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return platform.processor() or "unknown CPU"
    names = [line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")]
    return names[0] if names else "unknown CPU"


def fault_section(
    part: str, fraction: float, segments: int, rounds: int, steps: int, settings: str
) -> list[str]:
    """The ``faults`` or ``resnet`` part at one budget, under both glibc settings."""
    model = f"{PEERS}, batch 8" if part == "faults" else f"{RESNET}, batch 32"
    return [
        f"## Page faults: {model}, {fraction:.0%} of keep-all, "
        f"checkpoint_sequential with {segments} segments",
        "",
        "glibc's default settings:",
        "",
        *table(run_part(part, rounds, steps, {}, fraction), "checkpoint_sequential"),
        "",
        f"glibc keeping freed memory ({settings}):",
        "",
        *table(run_part(part, rounds, steps, KEEP_FREED, fraction), "checkpoint_sequential"),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--part", choices=("own-cost", "faults", "resnet"), help=argparse.SUPPRESS)
    parser.add_argument("--fraction", type=float, default=0.3, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="experiments/results/overhead_cpu.md")
    args = parser.parse_args()
    if args.part:
        print(json.dumps(measure(args.part, args.fraction, args.rounds, args.steps)))
        return
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    settings = " ".join(f"{k}={v}" for k, v in KEEP_FREED.items())
    lines = [
        "# offremat's own cost and page faults beside checkpoint_sequential (CPU)",
        "",
        f"- command: `python experiments/overhead_cpu.py --rounds {args.rounds} "
        f"--steps {args.steps}`; git {commit}; "
        f"{datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC",
        f"- torch {torch.__version__}, {cpu_model()} ({platform.machine()}), "
        f"{os.cpu_count()} cores, 1 torch thread; each part in a fresh process",
        "",
        f"## Own cost: {TINY}, batch 1 (compute negligible; {10 * args.steps} steps a round)",
        "",
        *table(run_part("own-cost", args.rounds, 10 * args.steps, {}), "checkpoint_sequential"),
        "",
        *[
            line
            for fraction, segments in BUDGETS.items()
            for line in fault_section(
                "faults", fraction, segments, args.rounds, args.steps, settings
            )
        ],
        *fault_section("resnet", *RESNET_BUDGET, args.rounds, 3 * args.steps, settings),
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
