"""Where offremat's step loses to torch's checkpoint_sequential on CPU: its own cost, page faults.

Two parts, each in one fresh process with one torch thread, the methods alternating in
rotating order over ``--rounds`` rounds of ``--steps`` timed steps (after a warm-up step):

- ``own-cost``: a 10-stage GPT so small that its compute is negligible (hidden 16, 8 tokens),
  so the step time is almost all Python. Plain autograd and ``checkpoint_sequential`` with 9
  segments against offremat running keep-all and the same 9-segment schedule
  (``solvers.baselines.checkpoint_sequential_plan``), 10 × ``--steps`` steps a round.
- ``faults``: the GPT of ``peers_cpu.py`` at 30% and 50% of keep-all: ``checkpoint_sequential``
  with the segment count that won ``peers_cpu.py`` there (9 and 7), offremat running that
  schedule, and offremat's dp plan, exact and with ``tolerance=0.005``, and the exact dp plan
  run by ``torch.utils.checkpoint`` (each stage it recomputes checkpointed alone, where the
  plan has that shape): the control that tells the plan's cost from the executor's. Step
  time and minor page faults per step (``getrusage``). It runs twice: with glibc's default
  settings (any ``MALLOC_*`` variable of this environment left out), which give freed
  memory back to the system between allocations so that the next ones fault it in again,
  and with glibc told to keep it (``MALLOC_TRIM_THRESHOLD_``, ``MALLOC_MMAP_THRESHOLD_``),
  as the CUDA caching allocator keeps freed blocks on a GPU.

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
from offremat.models import GPTConfig, build_gpt, gpt_batch
from solvers.baselines import checkpoint_sequential_plan, keep_all
from solvers.ops import BACKWARD, F_ALL, F_CK, backward, forward_all
from solvers.plan import Plan
from solvers.registry import keep_all_peak, solve
from solvers.simulator import score

SEGMENTS = 9
# Budget fraction: the segment count that won peers_cpu.py there (8ef174c at 30%, bede561 at 50%).
BUDGETS = {0.3: 9, 0.5: 7}
KEEP_FREED = {"MALLOC_TRIM_THRESHOLD_": str(2**34), "MALLOC_MMAP_THRESHOLD_": str(2**25)}
TINY = GPTConfig(layers=8, hidden=16, heads=2, seq=8, vocab=32, dropout=0.0)
PEERS = GPTConfig(layers=8, hidden=256, heads=4, seq=128, vocab=1024, dropout=0.0)


def methods(part: str, fraction: float) -> dict[str, Any]:
    """The callables whose ``f(batch).backward()`` is one training step, by name."""
    config, rows = (TINY, 1) if part == "own-cost" else (PEERS, 8)
    model, batch = build_gpt(config, seed=0), gpt_batch(config, rows, seed=0)
    chain = offremat.profile_model(model, batch)
    budget = int(fraction * keep_all_peak(chain)) if part == "faults" else None
    segments = BUDGETS[fraction] if part == "faults" else SEGMENTS
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
        alone = checkpointed_alone(plan)
        if alone is not None:
            # The control: the same plan, run by torch's checkpoint instead of offremat.
            found["dp's plan, run by torch.utils.checkpoint"] = per_stage_checkpoint(model, alone)
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


def checkpointed_alone(plan: Plan) -> set[int] | None:
    """The stages ``plan`` recomputes, if ``torch.utils.checkpoint`` runs it exactly: each of
    them checkpointed alone (F_ck, then one F_all right before its B), the rest kept; else
    None (a plan with F_none, offloads or repeated recomputations)."""
    start = next(k for k, op in enumerate(plan.ops) if op.kind == BACKWARD)
    first_pass = plan.ops[:start]
    if [op.index for op in first_pass] != list(range(1, plan.length + 1)):
        return None
    if any(op.kind not in (F_CK, F_ALL) for op in first_pass):
        return None
    alone = {op.index for op in first_pass if op.kind == F_CK}
    expected = []
    for i in range(plan.length, 0, -1):
        expected += [forward_all(i), backward(i)] if i in alone else [backward(i)]
    return alone if list(plan.ops[start:]) == expected else None


def per_stage_checkpoint(model: torch.nn.Sequential, alone: set[int]) -> Any:
    """The model's step with the stages in ``alone`` each under ``checkpoint``."""
    stages = list(model)

    def step(value: Any) -> Any:
        for i, stage in enumerate(stages, 1):
            value = checkpoint(stage, value, use_reentrant=False) if i in alone else stage(value)
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
    fraction: float, segments: int, rounds: int, steps: int, settings: str
) -> list[str]:
    """The ``faults`` part at one budget, under both glibc settings."""
    return [
        f"## Page faults: {PEERS}, batch 8, {fraction:.0%} of keep-all, "
        f"checkpoint_sequential with {segments} segments",
        "",
        "glibc's default settings:",
        "",
        *table(run_part("faults", rounds, steps, {}, fraction), "checkpoint_sequential"),
        "",
        f"glibc keeping freed memory ({settings}):",
        "",
        *table(run_part("faults", rounds, steps, KEEP_FREED, fraction), "checkpoint_sequential"),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=9)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--part", choices=("own-cost", "faults"), help=argparse.SUPPRESS)
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
            for line in fault_section(fraction, segments, args.rounds, args.steps, settings)
        ],
    ]
    Path(args.out).write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
