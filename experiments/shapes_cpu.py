"""Varying sequence lengths at a fixed byte budget: one static plan against a plan per shape.

A training run of the in-repo GPT over ``--steps`` batches whose sequence lengths are drawn
from a long-tailed distribution (log-normal, bucketed up to multiples of 32, between 32 and
the model's longest), at a fixed byte budget (``--fraction`` of keep-all at the longest
length). Three methods run side by side, batch after batch in rotating order, in one process:

- static: the dp plan made for the longest shape, applied to every batch (what a cautious
  user does without per-shape plans), through ``offremat.executor.PlanExecutor``;
- per shape: ``offremat.optimize`` as shipped: a plan per input shape, profiled, predicted or
  reused from its cache, planning time counted inside the steps that plan;
- ``checkpoint_sequential`` with the fastest segment count whose measured peak fits at the
  longest shape.

Memory is measured with :class:`offremat.measure.StepMemory` (a dispatch-mode tracker of the
storages a step creates, plus its batch), once per method and shape on an untimed step,
because the tracker slows the step it watches.

    python experiments/shapes_cpu.py --out experiments/results/shapes_cpu
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.checkpoint import checkpoint_sequential

import offremat
from offremat.executor import PlanExecutor
from offremat.measure import StepMemory
from offremat.models import GPTConfig, build_gpt, gpt_batch
from solvers.registry import keep_all_peak, solve
from solvers.simulator import simulate

CONFIG = GPTConfig(layers=6, hidden=128, heads=4, seq=256, vocab=512, dropout=0.0)
BATCH = 8


def lengths(steps: int, seed: int) -> list[int]:
    """Long-tailed sequence lengths, bucketed up to multiples of 32, in [32, CONFIG.seq]."""
    rng = np.random.default_rng(seed)
    raw = 32 * np.exp(rng.normal(0.9, 0.6, steps))
    return [int(min(max(32 * np.ceil(x / 32), 32), CONFIG.seq)) for x in raw]


def batch_of(length: int, seed: int) -> Any:
    return gpt_batch(GPTConfig(**{**CONFIG.__dict__, "seq": length}), BATCH, seed)


def step(forward: Any, batch: Any) -> float:
    start = time.perf_counter()
    forward(batch).backward()
    return time.perf_counter() - start


def measured_peak(forward: Any, batch: Any) -> int:
    with StepMemory("cpu", batch) as memory:
        forward(batch).backward()
    return memory.peak_bytes


def best_segments(model: torch.nn.Module, batch: Any, budget: int) -> int:
    """The fastest segment count whose measured peak fits ``budget`` at ``batch``."""
    best = None
    for segments in range(1, len(model) + 1):

        def forward(b: Any, s: int = segments) -> torch.Tensor:
            return checkpoint_sequential(model, s, b, use_reentrant=False)

        if measured_peak(forward, batch) > budget:
            continue
        step(forward, batch)
        seconds = min(step(forward, batch) for _ in range(2))
        if best is None or seconds < best[0]:
            best = (seconds, segments)
    if best is None:
        raise SystemExit("no checkpoint_sequential segment count fits; raise --fraction")
    return best[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--fraction", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="experiments/results/shapes_cpu")
    args = parser.parse_args()
    torch.set_num_threads(1)
    began = time.perf_counter()
    model = build_gpt(CONFIG, seed=0)
    for parameter in model.parameters():
        parameter.grad = torch.zeros_like(parameter)
    longest = batch_of(CONFIG.seq, seed=0)
    chain = offremat.profile_model(model, longest)
    budget = int(args.fraction * keep_all_peak(chain))
    static_plan = solve(chain, budget, "dp")
    static = PlanExecutor(list(model), static_plan, chain)
    per_shape = offremat.optimize(model, longest, budget=budget)
    segments = best_segments(model, longest, budget)

    methods = {
        "static plan (longest shape)": static,
        "plan per shape": per_shape,
        f"checkpoint_sequential ({segments} segments)": lambda b: checkpoint_sequential(
            model, segments, b, use_reentrant=False
        ),
    }
    seconds = {name: 0.0 for name in methods}
    peaks = {name: 0 for name in methods}
    simulated = {"static plan (longest shape)": 0.0, "plan per shape": 0.0}
    seen: set[int] = set()
    draws = lengths(args.steps, args.seed)
    for number, length in enumerate(draws):
        batch = batch_of(length, seed=number + 1)
        names = list(methods)
        order = names[number % len(names) :] + names[: number % len(names)]
        for name in order:
            seconds[name] += step(methods[name], batch)
        # Both plans scored on this shape's chain (profiled or predicted by the per-shape run).
        static_time = simulate(static_plan, per_shape.chain, None).makespan_s
        simulated["static plan (longest shape)"] += static_time
        simulated["plan per shape"] += per_shape.plan.predicted_time_s
        if length not in seen:  # one untimed, measured step per method and new shape
            seen.add(length)
            for name, forward in methods.items():
                peaks[name] = max(peaks[name], measured_peak(forward, batch))
    info = per_shape.cache_info()
    info["hits"] -= len(seen)  # the untimed measuring steps found their plans too
    result = {
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": f"{platform.machine()}, {torch.get_num_threads()} torch thread",
        "torch": torch.__version__,
        "git": subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=False
        ).stdout.strip(),
        "command": f"python experiments/shapes_cpu.py --steps {args.steps} --fraction "
        f"{args.fraction} --seed {args.seed}",
        "model": repr(CONFIG),
        "batch": BATCH,
        "budget_bytes": budget,
        "lengths": {str(k): draws.count(k) for k in sorted(set(draws))},
        "measured_s": seconds,
        "simulated_s": simulated,
        "highest_peak_over_budget": {name: peaks[name] / budget for name in methods},
        "cache": info,
        "planning_share": info["planning_s"] / seconds["plan per shape"],
        "hit_rate": info["hits"] / max(info["hits"] + info["misses"], 1),
        "runtime_s": time.perf_counter() - began,
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    base = seconds["static plan (longest shape)"]
    lines = [
        "# Varying sequence lengths at a fixed byte budget (CPU)",
        "",
        f"- Command: `{result['command']}`; git {result['git']}; {result['date']}",
        f"- torch {result['torch']}, {result['machine']}; model {result['model']}, batch {BATCH}",
        f"- Budget {budget} B ({args.fraction:.0%} of keep-all at seq {CONFIG.seq}); "
        f"{args.steps} batches, lengths (count): {result['lengths']}",
        "- Time: every batch runs once per method, methods in rotating order, wall clock of "
        "forward + backward; planning happens inside the steps that plan. Peak: "
        "`StepMemory`, one untimed step per method and new length.",
        "",
        "| method | measured s | ÷ static | simulated s | highest peak ÷ budget |",
        "|---|---|---|---|---|",
    ]
    for name in methods:
        sim = simulated.get(name)
        lines.append(
            f"| {name} | {seconds[name]:.2f} | {seconds[name] / base:.3f} | "
            f"{'—' if sim is None else f'{sim:.2f}'} | {peaks[name] / budget:.3f} |"
        )
    lines += [
        "",
        f"Plan per shape: {info['plans']} plans, {info['misses']} planned "
        f"({info['predicted']} on a predicted chain), {info['hits']} hits (hit rate "
        f"{result['hit_rate']:.1%}); planning {info['planning_s']:.2f} s, "
        f"{result['planning_share']:.1%} of its measured time.",
    ]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
