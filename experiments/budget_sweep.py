"""Budget sweeps on the in-repo models: every method's step time from the least feasible budget
to keep-all, simulated everywhere and measured on a GPU when there is one.

Usage:
    python experiments/budget_sweep.py [--models gpt-small resnet-small] [--points 10]
        [--methods keep-all chen checkpoint-every-stage offload-all dp milp]
        [--milp-time-limit 10] [--bandwidth BYTES_PER_S] [--steps 4] [--threads N]
        [--out experiments/results]

Each model is profiled on this machine (CUDA when present, else CPU) into a chain; on CPU the
chain has no host link, so it is given ``--bandwidth`` (default 12 GB/s, a PCIe 3.0 x16
stand-in) to let offload-all and the milp plan copies. Writes, per model,
``budget_sweep_<model>.csv`` (method, budget_bytes, predicted_time_s, predicted_peak_bytes,
solve_time_s; empty time where no plan fits), ``budget_sweep_<model>.png`` and the chain
``budget_sweep_<model>.chain.json``. On CUDA it also trains every feasible plan ``--steps``
steps through ``offremat.optimize`` and writes ``budget_sweep_<model>_measured.csv`` with the
measured step time and ``max_memory_allocated`` peak beside the predictions.
"""

from __future__ import annotations

import argparse
import csv
import logging
import time
from pathlib import Path

import torch

from offremat.demo import CPU_STAND_IN_BANDWIDTH, optimized_forward, train
from offremat.models import model_spec
from offremat.plots import plot_sweep
from offremat.sweep import (
    METHODS,
    SweepPoint,
    budget_range,
    profile_named_model,
    run_sweep,
    write_csv,
)
from solvers.budget import format_bytes
from solvers.chain import Chain

logger = logging.getLogger("budget_sweep")
MEASURED_COLUMNS = (
    "method",
    "budget_bytes",
    "predicted_time_s",
    "measured_time_s",
    "predicted_peak_bytes",
    "measured_peak_bytes",
)


def sweep_model(name: str, args: argparse.Namespace, device: str) -> None:
    """Profile, sweep, write CSV, PNG and chain; on CUDA measure every feasible plan too."""
    started = time.perf_counter()
    bandwidth = args.bandwidth
    if bandwidth is None and device == "cpu":
        bandwidth = CPU_STAND_IN_BANDWIDTH
    chain = profile_named_model(name, device=device, bandwidth=bandwidth)
    out = Path(args.out)
    chain.save(out / f"budget_sweep_{name}.chain.json")
    budgets = budget_range(chain, args.points)
    options = {"milp": {"time_limit_s": args.milp_time_limit}}
    points = run_sweep(chain, budgets, args.methods, options)
    write_csv(points, out / f"budget_sweep_{name}.csv")
    link = chain.link
    link_text = f"link {link.d2h_bytes_per_s / 1e9:.0f} GB/s" if link else "no link"
    title = (
        f"{name}: {chain.metadata.get('model', '')}, batch {chain.metadata.get('batch_size')}\n"
        f"profiled on {device}, {link_text}, keep-all peak {format_bytes(budgets[-1])}"
    )
    plot_sweep(points, chain, out / f"budget_sweep_{name}.png", title=title)
    logger.info("%s: %d points in %.1f s", name, len(points), time.perf_counter() - started)
    if device == "cuda":
        measure(name, chain, points, args.steps, out / f"budget_sweep_{name}_measured.csv")


def measure(name: str, chain: Chain, points: list[SweepPoint], steps: int, path: Path) -> None:
    """Train each feasible plan and write predicted beside measured time and peak."""
    spec = model_spec(name)
    batches = [spec.batch(spec.default_batch_size, n, "cuda") for n in range(steps)]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(MEASURED_COLUMNS)
        for point in points:
            if point.plan is None:
                continue
            measured = train(
                lambda: spec.build(0).cuda(),
                optimized_forward(batches[0], chain, point.plan),
                batches,
                seed=0,
            )
            writer.writerow(
                [
                    point.method,
                    point.budget_bytes,
                    point.predicted_time_s,
                    measured.step_time_s,
                    point.predicted_peak_bytes,
                    measured.peak_bytes,
                ]
            )
            handle.flush()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-small", "resnet-small"])
    parser.add_argument("--points", type=int, default=10)
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--milp-time-limit", type=float, default=10.0)
    parser.add_argument("--bandwidth", type=float, help="host link in bytes/s (both ways)")
    parser.add_argument("--steps", type=int, default=4, help="training steps per plan on CUDA")
    parser.add_argument("--out", default=str(Path(__file__).parent / "results"))
    parser.add_argument(
        "--threads",
        type=int,
        help="torch CPU threads (default: torch's); 1 is steadier on a busy machine",
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")
    Path(args.out).mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    for name in args.models:
        sweep_model(name, args, device)


if __name__ == "__main__":
    main()
