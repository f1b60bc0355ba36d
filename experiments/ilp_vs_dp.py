"""The joint MILP against rotor's DP on Llama-7B-shaped chains of 8 to 64 stages.

Usage:
    python experiments/ilp_vs_dp.py [--lengths 8 16 24 34 48 64] [--budgets 0.2 0.25 0.35 0.5]
        [--time-limit 30] [--out experiments/results]

Each chain is the embedding, n Llama-7B blocks and the LM head of
``offremat/examples/llama7b.json`` (so 34 stages is that chain itself: h=4096, seq 4096, bf16,
400 TFLOP/s, a 50 GB/s link). Budgets are fractions of each chain's keep-all peak; a budget
below the DP's least feasible one is skipped. For every point it records the DP's and the
MILP's simulated step time, their overheads over Σf + Σb, the share of the DP's overhead the
MILP removes, the most any plan could remove (from ``solvers.registry.lower_bound_s``), the
MILP's solve time, status and gap. Writes ``ilp_vs_dp.csv`` and ``ilp_vs_dp.png`` under
``--out``. Every point is solved in this one run, so the ratios are side by side.
"""

from __future__ import annotations

import argparse
import csv
import logging
import time
from dataclasses import replace
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from solvers.bounds import lower_bound_s
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain
from solvers.dp import solve_dp
from solvers.milp import solve_milp
from solvers.registry import keep_all_peak

EXAMPLE = Path(__file__).resolve().parent.parent / "offremat" / "examples" / "llama7b.json"
FIELDS = (
    "stages",
    "budget_fraction",
    "budget_bytes",
    "compute_s",
    "lower_bound_s",
    "dp_time_s",
    "milp_time_s",
    "dp_overhead_s",
    "milp_overhead_s",
    "overhead_removed",
    "most_removable",
    "milp_solve_time_s",
    "milp_status",
    "milp_objective_s",
    "milp_best_bound_s",
    "milp_gap",
    "milp_warm_start",
    "milp_fallback",
    "milp_binaries",
)


def llama_chain(stages: int) -> Chain:
    """The Llama-7B example with ``stages - 2`` blocks between its embedding and head."""
    full = Chain.load(EXAMPLE)
    embed, block, head = full.stages[0], full.stages[1], full.stages[-1]
    blocks = tuple(replace(block, name=f"block{n}") for n in range(stages - 2))
    return Chain(f"llama7b-{stages}", full.input_bytes, (embed, *blocks, head), full.link)


def run(lengths: list[int], fractions: list[float], time_limit_s: float) -> list[dict]:
    rows = []
    for stages in lengths:
        chain = llama_chain(stages)
        compute = chain.compute_time_s
        peak = keep_all_peak(chain)
        for fraction in fractions:
            budget = int(fraction * peak)
            try:
                dp = solve_dp(chain, budget)
            except InfeasibleBudgetError:
                logging.info(
                    "%d stages at %.0f%%: no DP plan fits, skipped", stages, fraction * 100
                )
                continue
            started = time.monotonic()
            milp = solve_milp(chain, budget, time_limit_s=time_limit_s)
            solve_time = time.monotonic() - started
            info = milp.info
            bound = lower_bound_s(chain, budget)
            dp_overhead = dp.predicted_time_s - compute
            milp_overhead = milp.predicted_time_s - compute
            row = {
                "stages": stages,
                "budget_fraction": fraction,
                "budget_bytes": budget,
                "compute_s": compute,
                "lower_bound_s": bound,
                "dp_time_s": dp.predicted_time_s,
                "milp_time_s": milp.predicted_time_s,
                "dp_overhead_s": dp_overhead,
                "milp_overhead_s": milp_overhead,
                "overhead_removed": 1 - milp_overhead / dp_overhead if dp_overhead > 0 else 0.0,
                "most_removable": 1 - (bound - compute) / dp_overhead if dp_overhead > 0 else 0.0,
                "milp_solve_time_s": solve_time,
                "milp_status": info["solver_status"],
                "milp_objective_s": info["objective"],
                "milp_best_bound_s": info["best_bound"],
                "milp_gap": info["gap"],
                "milp_warm_start": info["warm_start"],
                "milp_fallback": info["fallback"],
                "milp_binaries": info["model"]["binaries"],
            }
            logging.info(
                "%d stages at %.0f%%: dp %.1f ms over, milp %.1f ms over (%.0f%% removed, at "
                "most %.0f%%), %.1f s, %s",
                stages,
                fraction * 100,
                dp_overhead * 1e3,
                milp_overhead * 1e3,
                row["overhead_removed"] * 100,
                row["most_removable"] * 100,
                solve_time,
                info["solver_status"],
            )
            rows.append(row)
    return rows


def write_csv(rows: list[dict], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)


def plot(rows: list[dict], path: Path) -> None:
    fractions = sorted({row["budget_fraction"] for row in rows})
    figure, (overheads, removed, seconds) = plt.subplots(1, 3, figsize=(15, 4.5))
    for fraction in fractions:
        points = sorted((r for r in rows if r["budget_fraction"] == fraction), key=_stages)
        lengths = [r["stages"] for r in points]
        label = f"{fraction:.0%} of keep-all"
        line = overheads.plot(
            lengths, [r["dp_overhead_s"] * 1e3 for r in points], "--", marker="o"
        )[0]
        overheads.plot(
            lengths,
            [r["milp_overhead_s"] * 1e3 for r in points],
            "-",
            marker="s",
            color=line.get_color(),
            label=label,
        )
        removed.plot(
            lengths,
            [r["overhead_removed"] * 100 for r in points],
            "-",
            marker="s",
            color=line.get_color(),
            label=label,
        )
        removed.plot(
            lengths,
            [r["most_removable"] * 100 for r in points],
            ":",
            color=line.get_color(),
        )
        seconds.plot(
            lengths,
            [r["milp_solve_time_s"] for r in points],
            "-",
            marker="s",
            color=line.get_color(),
            label=label,
        )
    overheads.set(
        xlabel="stages", ylabel="overhead over Σf+Σb (ms)", title="DP (dashed) vs MILP (solid)"
    )
    removed.axhline(50, color="grey", linewidth=0.8)
    removed.set(
        xlabel="stages",
        ylabel="% of the DP's overhead removed",
        title="MILP (solid); most any plan could (dotted)",
    )
    seconds.set(xlabel="stages", ylabel="MILP solve time (s)", title="solve time")
    for axes in (overheads, removed, seconds):
        axes.grid(alpha=0.3)
    removed.legend(fontsize=8)
    figure.suptitle("Joint MILP vs rotor's DP on Llama-7B-shaped chains (50 GB/s link)")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def _stages(row: dict) -> int:
    return row["stages"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[8, 16, 24, 34, 48, 64])
    parser.add_argument(
        "--budgets", type=float, nargs="+", default=[0.2, 0.25, 0.35, 0.5], metavar="FRACTION"
    )
    parser.add_argument("--time-limit", type=float, default=30.0, metavar="S")
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    args.out.mkdir(parents=True, exist_ok=True)
    rows = run(args.lengths, args.budgets, args.time_limit)
    write_csv(rows, args.out / "ilp_vs_dp.csv")
    plot(rows, args.out / "ilp_vs_dp.png")
    logging.info("wrote %s and %s", args.out / "ilp_vs_dp.csv", args.out / "ilp_vs_dp.png")


if __name__ == "__main__":
    main()
