"""The GPU benchmark: a large GPT-style transformer at 70%, 50% and 30% of its keep-all
activation memory, offremat's dp, milp and offload-all against torch's checkpoint_sequential
and save_on_cpu.

Usage (needs a CUDA GPU; without one it says so and exits 2):
    python experiments/gpu_benchmark.py [--layers 24] [--hidden 1024] [--heads 16] [--seq 1024]
        [--vocab 50304] [--batch N] [--fractions 0.7 0.5 0.3] [--steps 6]
        [--milp-time-limit 60] [--out experiments/results/gpu]

The model is ``offremat.models.build_gpt`` in bfloat16. Without ``--batch`` the batch is the
largest that keeps plain autograd's activations within 80% of the GPU memory left after the
weights, estimated from a profile at batch 1 (then profiled again at that batch). Budgets are
fractions of the profiled keep-all peak. Methods at each budget:

- ``dp``, ``milp`` and ``offload-all``: offremat plans run by ``offremat.optimize`` (milp with
  the measured link, ``--milp-time-limit`` seconds);
- ``checkpoint_sequential``: the segment count whose simulated plan is fastest among those
  whose simulated peak fits the budget (the simulator picks it; every count is not measured);
- ``save_on_cpu(pin_memory=True)`` and ``keep-all``: budget-free, measured once.

Reports tokens/s (forward plus backward), the measured peak (``max_memory_allocated`` above
the step's start, plus the input), the prediction errors and the largest difference of each
step's loss from keep-all's (every method trains a fresh model from the same seed). A method
that runs out of memory gets a row saying so. Writes ``gpu_benchmark.csv`` after every row
(a run cut short keeps what it measured) and ``results.md`` (device, command, date, table,
and the targets checked) in ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import datetime
import gc
import logging
import shlex
import sys
from collections.abc import Callable
from pathlib import Path

import torch

from offremat.demo import decision_counts
from offremat.methods import (
    batch_bytes,
    best_checkpoint_sequential,
    checkpoint_sequential_forward,
    optimized_forward,
    plain_forward,
    save_on_cpu_forward,
    train,
)
from offremat.models import Batch, GPTConfig, build_gpt, gpt_batch
from offremat.profiler import profile_model
from solvers.budget import InfeasibleBudgetError, format_bytes
from solvers.chain import Chain
from solvers.registry import keep_all_peak, solve

logger = logging.getLogger("gpu_benchmark")
COLUMNS = (
    "method",
    "budget_fraction",
    "budget_bytes",
    "detail",
    "tokens_per_s",
    "throughput_vs_keep_all",
    "measured_time_s",
    "predicted_time_s",
    "time_error",
    "measured_peak_bytes",
    "predicted_peak_bytes",
    "peak_error",
    "fits_budget",
    "loss_difference",
    "error",
)
ACTIVATION_SHARE_OF_FREE_MEMORY = 0.8


def choose_batch(config: GPTConfig, device: str) -> int:
    """The largest batch whose keep-all activations fill 80% of the memory the weights leave."""
    model = build_gpt(config).to(device, torch.bfloat16)
    chain = profile_model(model, gpt_batch(config, 1, 0, device), warmup=1, repeats=1)
    per_sample = keep_all_peak(chain)
    free, _ = torch.cuda.mem_get_info(device)
    # ``free`` already leaves out the weights. Their gradients need as much again (plain SGD
    # keeps no other state), and the same once more stays free for cuBLAS workspaces and the
    # allocator's fragmentation.
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    del model
    torch.cuda.empty_cache()
    room = free - 2 * weights
    batch = max(1, int(ACTIVATION_SHARE_OF_FREE_MEMORY * room // per_sample))
    logger.info(
        "keep-all needs %s per sample; %s free after weights: batch %d",
        format_bytes(per_sample),
        format_bytes(room),
        batch,
    )
    return batch


def benchmark(
    chain: Chain,
    build: Callable[[], torch.nn.Module],
    batches: list[Batch],
    fractions: list[float],
    milp_time_limit_s: float,
    written: Callable[[list[dict]], None],
) -> list[dict]:
    """Measure every method at every budget fraction of the keep-all peak; one row each,
    handed to ``written`` as it is measured.

    save_on_cpu needs CUDA (pinned memory) and runs only there.
    """
    top = keep_all_peak(chain)
    tokens = batches[0][0].numel()
    rows: list[dict] = []
    reference: list[float] = []

    def run(method, fraction, budget, detail, plan, make_forward):
        row = dict.fromkeys(COLUMNS)
        row.update(method=method, budget_fraction=fraction, budget_bytes=budget, detail=detail)
        try:
            measured = train(build, make_forward, batches, 0)
        except (torch.cuda.OutOfMemoryError, torch.AcceleratorError) as error:
            # A pinned host buffer that cannot be had is an AcceleratorError, not an OOM.
            if "out of memory" not in str(error):
                raise
            row["error"] = f"out of memory: {str(error).splitlines()[0]}"
            measured = None
        if measured is not None:
            if not rows and not reference:  # keep-all's losses: the reference, when it ran
                reference.extend(measured.losses)
            predicted_time = plan.predicted_time_s if plan else None
            predicted_peak = plan.predicted_peak_bytes if plan else None
            row.update(
                tokens_per_s=tokens / measured.step_time_s,
                measured_time_s=measured.step_time_s,
                predicted_time_s=predicted_time,
                time_error=_error(predicted_time, measured.step_time_s),
                measured_peak_bytes=measured.peak_bytes,
                predicted_peak_bytes=predicted_peak,
                peak_error=_error(predicted_peak, measured.peak_bytes),
                fits_budget=None if budget is None else measured.peak_bytes <= budget,
                loss_difference=None
                if not reference
                else max(abs(a - b) for a, b in zip(measured.losses, reference, strict=True)),
            )
            if not rows:
                row["throughput_vs_keep_all"] = 1.0
            elif rows[0]["tokens_per_s"]:
                row["throughput_vs_keep_all"] = row["tokens_per_s"] / rows[0]["tokens_per_s"]
        rows.append(row)
        logger.info("%s", row)
        written(rows)
        _empty_caches()

    keep = solve(chain, top, "keep-all")
    run("keep-all", 1.0, top, "", keep, plain_forward)
    if batches[0][0].is_cuda:
        run("save_on_cpu", None, None, "pin_memory=True", None, save_on_cpu_forward)
    solvers = (("dp", {}), ("milp", {"time_limit_s": milp_time_limit_s}), ("offload-all", {}))
    for fraction in fractions:
        budget = int(fraction * top)
        for name, options in solvers:
            try:
                plan = solve(chain, budget, name, **options)
            except InfeasibleBudgetError as error:
                logger.warning("%s at %.0f%%: %s", name, fraction * 100, error)
                continue
            forward = optimized_forward(batches[0], chain, plan)
            run(name, fraction, budget, decision_counts(plan), plan, forward)
        plan = best_checkpoint_sequential(chain, budget)
        if plan is None:
            logger.warning("no checkpoint_sequential segment count fits %.0f%%", fraction * 100)
            continue
        segments = plan.info["segments"]
        forward = checkpoint_sequential_forward(segments)
        run("checkpoint_sequential", fraction, budget, f"{segments} segments", plan, forward)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=50304)
    parser.add_argument("--batch", type=int, help="default: fill the GPU memory (see above)")
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.7, 0.5, 0.3])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--milp-time-limit", type=float, default=60.0)
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    if not torch.cuda.is_available():
        print(
            "gpu_benchmark: no CUDA device here, so there is nothing to measure; run it on a "
            "machine with an NVIDIA GPU (it writes no result without one)",
            file=sys.stderr,
        )
        return 2
    device = "cuda"
    config = GPTConfig(
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        seq=args.seq,
        vocab=args.vocab,
        dropout=0.0,
    )
    batch_size = args.batch or choose_batch(config, device)
    batches = [gpt_batch(config, batch_size, n, device) for n in range(args.steps)]

    def build() -> torch.nn.Module:
        return build_gpt(config).to(device, torch.bfloat16)

    chain = profile_model(build(), batches[0], name=f"gpt{args.layers}-h{args.hidden}")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    input_bytes = batch_bytes(batches[0])

    def written(rows: list[dict]) -> None:
        with open(out / "gpu_benchmark.csv", "w", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            writer.writeheader()
            writer.writerows(rows)
        (out / "results.md").write_text(_report(rows, chain, config, batch_size, input_bytes, args))

    benchmark(chain, build, batches, args.fractions, args.milp_time_limit, written)
    print(f"wrote {out / 'gpu_benchmark.csv'} and {out / 'results.md'}")
    return 0


def _empty_caches() -> None:
    """Between methods: give back cached device memory and pinned host memory, so that no
    method starts with another's buffers (the executor's arena dies with its module)."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
        for name in ("_host_emptyCache", "_accelerator_emptyHostCache"):
            empty_host_cache = getattr(torch._C, name, None)
            if empty_host_cache is not None:
                empty_host_cache()
                break


def _error(predicted: float | None, measured: float) -> float | None:
    return None if not predicted else measured / predicted - 1


def _report(rows, chain, config, batch_size, input_bytes, args) -> str:
    device = torch.cuda.get_device_name(0)
    link = chain.link
    lines = [
        "# GPU benchmark",
        "",
        f"- date: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        f"- device: {device}, torch {torch.__version__}, CUDA {torch.version.cuda}",
        f"- command: `python {' '.join(shlex.quote(a) for a in sys.argv)}`",
        f"- model: GPT {config.layers} layers, hidden {config.hidden}, {config.heads} heads, "
        f"seq {config.seq}, vocab {config.vocab}, bf16, batch {batch_size} "
        f"({format_bytes(input_bytes)} input)",
        f"- keep-all peak (simulated): {format_bytes(keep_all_peak(chain))}; measured link "
        f"{link.d2h_bytes_per_s / 1e9:.1f} GB/s d2h, {link.h2d_bytes_per_s / 1e9:.1f} GB/s h2d",
        f"- {args.steps} steps per method, median of all but the first; peak by the CUDA "
        "allocator (`max_memory_allocated` above the step's start, plus the input); loss "
        "difference: the largest over the steps from keep-all's loss, same seed and batches",
        "",
        "| method | budget | detail | tokens/s | vs keep-all | time error | measured peak "
        "| peak error | fits | loss difference |",
        "|---|---|---|---:|---:|---:|---:|---:|---|---:|",
    ]
    for row in rows:
        budget = "—" if row["budget_fraction"] is None else f"{row['budget_fraction']:.0%}"
        if row["error"]:
            lines.append(f"| {row['method']} | {budget} | {row['detail']} | {row['error']} |")
            continue
        lines.append(
            f"| {row['method']} | {budget} | {row['detail']} | {row['tokens_per_s']:,.0f} "
            f"| {_share(row['throughput_vs_keep_all'])} | {_percent(row['time_error'])} "
            f"| {format_bytes(row['measured_peak_bytes'])} | {_percent(row['peak_error'])} "
            f"| {_yes_no(row['fits_budget'])} | {_number(row['loss_difference'])} |"
        )
    lines += ["", "## Targets at 30%", ""]
    measured = [r for r in rows if not r["error"]]
    ours = [
        r
        for r in measured
        if r["method"] in ("dp", "milp", "offload-all") and r["budget_fraction"] == 0.3
    ]
    best = max(ours, key=lambda r: r["tokens_per_s"], default=None)
    if best is None:
        lines.append("- no offremat plan ran at 30%: targets not measured")
    else:
        peers = [
            r
            for r in measured
            if r["method"] == "save_on_cpu"
            or (r["method"] == "checkpoint_sequential" and r["budget_fraction"] == 0.3)
        ]
        lines += [
            f"- the fastest offremat plan at 30%: {best['method']} ({best['detail']})",
            _target(
                "throughput ≥ 90% of keep-all",
                (best["throughput_vs_keep_all"] or 0.0) >= 0.9,
                _share(best["throughput_vs_keep_all"]),
            ),
            _target(
                "beats checkpoint_sequential and save_on_cpu",
                all(best["tokens_per_s"] > r["tokens_per_s"] for r in peers),
                ", ".join(f"{r['method']} {r['tokens_per_s']:,.0f} tok/s" for r in peers),
            ),
            _target(
                "step time predicted within 10%",
                abs(best["time_error"]) <= 0.10,
                _percent(best["time_error"]),
            ),
            _target(
                "fits its budget",
                bool(best["fits_budget"]),
                f"{best['measured_peak_bytes'] / best['budget_bytes']:.3f} of it",
            ),
        ]
    return "\n".join(lines) + "\n"


def _target(what: str, met: bool, value: str) -> str:
    return f"- {what}: {'met' if met else '**not met**'} ({value})"


def _yes_no(value: bool | None) -> str:
    return "—" if value is None else ("yes" if value else "no")


def _share(value: float | None) -> str:
    return "—" if value is None else f"{value:.0%}"


def _number(value: float | None) -> str:
    return "—" if value is None else f"{value:.2g}"


def _percent(value: float | None) -> str:
    return "—" if value is None else f"{value:+.1%}"


if __name__ == "__main__":
    raise SystemExit(main())
