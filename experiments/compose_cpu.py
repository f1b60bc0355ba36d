"""offremat with compiled blocks on a CPU: step time and measured peak beside eager and compiled
keep-all.

The in-repo GPT at 30%, 50% and 100% of keep-all's predicted activation peak (of the eager
model's chain; the same byte budget for every method). Methods: eager keep-all (plain
autograd), compiled keep-all (``block.compile()`` on every transformer block), offremat dp on
the eager model, and offremat dp on the model with compiled blocks (compiled before
``optimize``, so the profile times them). Each configuration runs in its own fresh process
(spawn, ``torch.set_num_threads(1)``): build, compile, optimize, one untimed step measured by
:class:`offremat.measure.StepMemory` (which runs compiled code eagerly, so for compiled blocks
it reports the eager blocks' peak), then a warm-up step and the median of ``--steps`` timed
steps. Configurations alternate in rotating order over ``--rounds`` rounds; the table gives
medians over rounds divided by eager keep-all's median from the same rounds.

    python experiments/compose_cpu.py --rounds 5 --out experiments/results/compose_cpu
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import statistics
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

FRACTIONS = (0.3, 0.5, 1.0)
SEED = 0
WARMUP_STEPS = 1


def build() -> tuple[torch.nn.Sequential, Any]:
    """The model and its batch, the same in every process."""
    from offremat.models import GPTConfig, build_gpt, gpt_batch

    config = GPTConfig(layers=8, hidden=256, heads=4, seq=128, vocab=1024, dropout=0.0)
    return build_gpt(config, seed=SEED), gpt_batch(config, 8, seed=SEED)


def compile_blocks(model: torch.nn.Sequential) -> None:
    for name, block in model.named_children():
        if name.startswith("block"):
            block.compile()


def one_step(forward: Any, batch: Any) -> None:
    torch.manual_seed(SEED)
    forward(batch).backward()


def worker(spec: dict[str, Any], steps: int) -> dict[str, Any]:
    """Median step time and measured peak of one configuration, in a fresh process."""
    import offremat
    from offremat.measure import StepMemory

    torch.set_num_threads(1)
    model, batch = build()
    if spec["compiled"]:
        compile_blocks(model)
    forward: Any = model
    if spec["budget_bytes"] is not None:
        forward = offremat.optimize(model, batch, budget=spec["budget_bytes"], solver="dp")
    for parameter in model.parameters():  # gradients exist, as after a first step
        parameter.grad = torch.zeros_like(parameter)
    started = time.perf_counter()
    one_step(forward, batch)  # compiles, for compiled blocks
    first_s = time.perf_counter() - started
    with StepMemory("cpu", batch) as memory:
        one_step(forward, batch)
    times = []
    for _ in range(WARMUP_STEPS + steps):
        began = time.perf_counter()
        one_step(forward, batch)
        times.append(time.perf_counter() - began)
    plan = getattr(forward, "plan", None)
    return {
        "seconds": statistics.median(times[WARMUP_STEPS:]),
        "peak": memory.peak_bytes,
        "first_s": first_s,
        "decisions": None if plan is None else _counts(plan.decisions),
    }


def _counts(decisions: dict[str, str]) -> str:
    kinds = sorted(set(decisions.values()))
    return ", ".join(f"{k} {list(decisions.values()).count(k)}" for k in kinds)


def budgets() -> dict[float, int]:
    import offremat
    from solvers.registry import keep_all_peak

    torch.set_num_threads(1)
    model, batch = build()
    peak = keep_all_peak(offremat.profile_model(model, batch))
    return {fraction: int(fraction * peak) for fraction in FRACTIONS}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process")
    parser.add_argument("--out", default="experiments/results/compose_cpu", help="path stem")
    args = parser.parse_args()
    started = time.perf_counter()
    pool = ProcessPoolExecutor(
        max_workers=1, mp_context=mp.get_context("spawn"), max_tasks_per_child=1
    )
    byte_budgets = pool.submit(budgets).result()
    specs = {
        "eager keep-all": {"compiled": False, "budget_bytes": None},
        "compiled keep-all": {"compiled": True, "budget_bytes": None},
    }
    for fraction, budget in byte_budgets.items():
        specs[f"offremat dp eager {fraction}"] = {"compiled": False, "budget_bytes": budget}
        specs[f"offremat dp compiled {fraction}"] = {"compiled": True, "budget_bytes": budget}
    results: dict[str, list[dict[str, Any]]] = {key: [] for key in specs}
    keys = list(specs)
    for r in range(args.rounds):
        order = keys[r % len(keys) :] + keys[: r % len(keys)]
        if r % 2:
            order.reverse()
        for key in order:
            results[key].append(pool.submit(worker, specs[key], args.steps).result())
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - started:.0f} s)")
    pool.shutdown()
    write(specs, results, byte_budgets, args, time.perf_counter() - started)


def write(
    specs: dict[str, dict[str, Any]],
    results: dict[str, list[dict[str, Any]]],
    byte_budgets: dict[float, int],
    args: argparse.Namespace,
    runtime: float,
) -> None:
    eager = statistics.median(r["seconds"] for r in results["eager keep-all"])
    compiled = statistics.median(r["seconds"] for r in results["compiled keep-all"])
    rows = []
    for key, spec in specs.items():
        runs = results[key]
        seconds = statistics.median(r["seconds"] for r in runs)
        peak = max(r["peak"] for r in runs)
        budget = spec["budget_bytes"]
        rows.append(
            f"| {key} | {budget if budget is not None else '—'} | {runs[0]['decisions'] or '—'} "
            f"| {seconds:.4f} | {seconds / eager:.3f} | {seconds / compiled:.3f} "
            f"| {peak} | {'—' if budget is None else f'{peak / budget:.3f}'} "
            f"| {statistics.median(r['first_s'] for r in runs):.1f} |"
        )
    version = subprocess.run(
        ["git", "-C", str(Path(__file__).resolve().parent), "rev-parse", "HEAD"],
        capture_output=True,
        text=True,
    ).stdout.strip()
    machine = subprocess.run(
        "nproc; lscpu | sed -n 's/^Model name: *//p'", shell=True, capture_output=True, text=True
    ).stdout.split("\n")
    lines = [
        "# offremat with compiled blocks on CPU",
        "",
        f"- Machine: {machine[0]}-core CPU, {machine[1]}; torch {torch.__version__}; git {version}",
        f"- Date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}; total runtime {runtime:.0f} s",
        f"- Command: `python {' '.join(sys.argv)}`",
        "- Model: in-repo GPT, GPTConfig(layers=8, hidden=256, heads=4, seq=128, vocab=1024, "
        "dropout=0.0), batch 8; budgets "
        + ", ".join(f"{f:.0%}: {b} B" for f, b in byte_budgets.items())
        + " of keep-all's predicted activation peak (eager chain).",
        f"- Each configuration in a fresh process (spawn, one thread): build, compile, optimize, "
        f"one untimed step measured by `StepMemory` (it runs compiled code eagerly, so compiled "
        f"rows show the eager blocks' peak), then {WARMUP_STEPS} warm-up and the median of "
        f"{args.steps} timed steps; {args.rounds} rounds in rotating, alternating order; "
        "medians over rounds. First call: compile (if any) plus one step.",
        "",
        "| method | budget bytes | plan | median step (s) | ÷ eager keep-all | ÷ compiled "
        "keep-all | measured peak (B) | peak ÷ budget | first call (s) |",
        "|---|---|---|---|---|---|---|---|---|",
        *rows,
    ]
    stem = Path(args.out)
    stem.parent.mkdir(parents=True, exist_ok=True)
    stem.with_suffix(".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
