"""Every solver against the lower bound on Llama-style and ResNet-style chains of 8 to 200 stages.

Usage:
    python experiments/ilp_vs_dp.py [--lengths 8 16 24 34 48 64 100 200]
        [--resnets 50 101 152 200] [--budgets 0.2 0.25 0.3 0.35 0.5] [--time-limit 30]
        [--long-time-limit 60] [--checkmate-time-limit 10] [--bound-limit 30]
        [--out experiments/results]

Llama chains are the embedding, n Llama-7B blocks and the LM head of
``offremat/examples/llama7b.json`` (34 stages is that chain: h=4096, seq 4096, bf16,
400 TFLOP/s, a 50 GB/s link). ResNet chains are ``offremat/examples/cnn.json``'s (ResNet-50) stem,
bottleneck blocks and head with each layer's repeated block repeated to He et al.'s depths
(ResNet-50, -101, -152 and -200: 18, 35, 52 and 68 stages), on a 12 GB/s link. Budgets are
fractions of each chain's keep-all peak; a budget below the DP's least feasible one is skipped.

For every point: the simulated step time of rotor's DP, the joint MILP (``milp``; a time limit
of ``--time-limit`` s, ``--long-time-limit`` s from 150 stages), Checkmate's recompute-only
MILP, DTR and Hong et al.'s min-peak (empty where they have no plan), the lower bound
``solvers.bounds.lower_bound_s`` and the tightest bound proven for every plan (the larger of it
and the whole-tensor bound of ``solvers.milp_bound``, with its interval model on chains of up
to 40 stages, ``--bound-limit`` s), the share of the DP's overhead over
Σf + Σb that the joint plan removes, the most any plan could remove by that bound, and their
ratio, the "reached fraction of the bound". The MILP's own dual bound (or its plan's time,
when it proves it optimal) holds only for the plans of its family (``docs/milp.md``), which a
non-persistent plan can beat: it is reported beside, with the fraction reached of what the
family allows. Writes ``ilp_vs_dp.csv``,
``ilp_vs_dp.png`` and the table of ``ilp_vs_dp_table.md`` under ``--out``. Every point is
solved in this one run, one solve at a time.
"""

from __future__ import annotations

import argparse
import csv
import logging
import platform
import subprocess
import sys
import time
from dataclasses import replace
from datetime import UTC, datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

from solvers.bounds import lower_bound_s
from solvers.budget import InfeasibleBudgetError
from solvers.chain import Chain, Link
from solvers.milp_bound import whole_tensor_bound_s
from solvers.registry import keep_all_peak, solve

EXAMPLES = Path(__file__).resolve().parent.parent / "offremat" / "examples"
RESNET_BLOCKS = {50: (3, 4, 6, 3), 101: (3, 4, 23, 3), 152: (3, 8, 36, 3), 200: (3, 24, 36, 3)}
RESNET_LINK = Link(12e9, 12e9)
LONG_CHAIN = 150
OTHERS = ("checkmate", "dtr", "min-peak")
FIELDS = (
    "family",
    "stages",
    "budget_fraction",
    "budget_bytes",
    "compute_s",
    "lower_bound_s",
    "dp_time_s",
    "milp_time_s",
    "checkmate_time_s",
    "dtr_time_s",
    "min_peak_time_s",
    "overhead_removed",
    "most_removable",
    "proven_bound_s",
    "bound_reached",
    "family_bound_s",
    "family_reached",
    "milp_time_limit_s",
    "milp_solve_time_s",
    "milp_status",
    "milp_warm_start",
    "checkmate_solve_time_s",
)


def llama_chain(stages: int) -> Chain:
    """The Llama-7B example with ``stages - 2`` blocks between its embedding and head."""
    full = Chain.load(EXAMPLES / "llama7b.json")
    embed, block, head = full.stages[0], full.stages[1], full.stages[-1]
    blocks = tuple(replace(block, name=f"block{n}") for n in range(stages - 2))
    return Chain(f"llama7b-{stages}", full.input_bytes, (embed, *blocks, head), full.link)


def resnet_chain(depth: int) -> Chain:
    """ResNet-``depth`` from the ResNet-50 example: each layer's first block, then its second
    block repeated to the layer's count of blocks, on a 12 GB/s link."""
    base = Chain.load(EXAMPLES / "cnn.json")
    by_name = {stage.name: stage for stage in base.stages}
    stages = [by_name["stem"]]
    for layer, count in enumerate(RESNET_BLOCKS[depth], start=1):
        stages.append(by_name[f"layer{layer}.0"])
        repeated = by_name[f"layer{layer}.1"]
        stages += [replace(repeated, name=f"layer{layer}.{n}") for n in range(1, count)]
    stages.append(by_name["head"])
    return Chain(f"resnet{depth}", base.input_bytes, tuple(stages), RESNET_LINK)


def _time(chain: Chain, budget: int, solver: str, **options: float) -> tuple[float | None, float]:
    started = time.monotonic()
    try:
        plan = solve(chain, budget, solver, **options)
    except InfeasibleBudgetError:
        return None, time.monotonic() - started
    return plan.predicted_time_s, time.monotonic() - started


def point(family: str, chain: Chain, fraction: float, limits: argparse.Namespace) -> dict | None:
    """Every solver at one budget of one chain; None when the DP has no plan."""
    budget = int(fraction * keep_all_peak(chain))
    try:
        dp = solve(chain, budget, "dp")
    except InfeasibleBudgetError:
        logging.info("%s at %.0f%%: no DP plan fits, skipped", chain.name, fraction * 100)
        return None
    limit = limits.long_time_limit if chain.length >= LONG_CHAIN else limits.time_limit
    started = time.monotonic()
    milp = solve(chain, budget, "milp", time_limit_s=limit)
    milp_seconds = time.monotonic() - started
    times = {"checkmate": _time(chain, budget, "checkmate", time_limit_s=limits.checkmate_limit)}
    times |= {name: _time(chain, budget, name) for name in ("dtr", "min-peak")}
    compute, bound = chain.compute_time_s, lower_bound_s(chain, budget)
    # The tightest bound proven for every plan; the MILP's dual bound holds for its family.
    whole = whole_tensor_bound_s(chain, budget, time_limit_s=limits.bound_limit, intervals=True)
    proven = max(whole, bound)
    family_bound = max(proven, milp.info.get("best_bound") or proven)
    dp_overhead = dp.predicted_time_s - compute
    removed = 1 - (milp.predicted_time_s - compute) / dp_overhead if dp_overhead > 0 else 0.0
    removable = (dp.predicted_time_s - proven) / dp_overhead if dp_overhead > 0 else 0.0
    row = {
        "family": family,
        "stages": chain.length,
        "budget_fraction": fraction,
        "budget_bytes": budget,
        "compute_s": compute,
        "lower_bound_s": bound,
        "dp_time_s": dp.predicted_time_s,
        "milp_time_s": milp.predicted_time_s,
        "checkmate_time_s": times["checkmate"][0],
        "dtr_time_s": times["dtr"][0],
        "min_peak_time_s": times["min-peak"][0],
        "overhead_removed": removed,
        "most_removable": removable,
        "proven_bound_s": proven,
        "bound_reached": reached(dp.predicted_time_s, milp.predicted_time_s, proven),
        "family_bound_s": family_bound,
        "family_reached": reached(dp.predicted_time_s, milp.predicted_time_s, family_bound),
        "milp_time_limit_s": limit,
        "milp_solve_time_s": milp_seconds,
        "milp_status": milp.info["solver_status"],
        "milp_warm_start": milp.info["warm_start"],
        "checkmate_solve_time_s": times["checkmate"][1],
    }
    logging.info(
        "%s at %.0f%%: %.0f%% removed of at most %.0f%% (%.0f%% of the bound) in %.1f s",
        chain.name,
        fraction * 100,
        removed * 100,
        removable * 100,
        row["bound_reached"] * 100,
        milp_seconds,
    )
    return row


def reached(dp_s: float, plan_s: float, bound_s: float) -> float:
    """(dp − plan) ÷ (dp − bound); 1 where the plan meets the bound (to solver tolerance)."""
    if plan_s <= bound_s * (1 + 1e-6):
        return 1.0
    return (dp_s - plan_s) / (dp_s - bound_s)


def _ms(seconds: float | None) -> str:
    return "—" if seconds is None else f"{seconds * 1e3:.1f}"


def write_table(rows: list[dict], path: Path, command: str) -> None:
    """The rows as a markdown table, under the command, machine, versions and date."""
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    lines = [
        f"Command: `{command}`; git {commit or 'unknown'}; "
        f"{datetime.now(UTC):%Y-%m-%d %H:%M} UTC; {platform.machine()}, "
        f"Python {platform.python_version()}. Times in ms, simulated.",
        "",
        "| chain | stages | budget | dp | milp | checkmate | dtr | min-peak | lower_bound_s "
        "| proven bound | removed | at most | reached | family bound | reached in family "
        "| solve (s) | milp status |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['family']} | {r['stages']} | {r['budget_fraction']:.0%} | "
            f"{_ms(r['dp_time_s'])} | {_ms(r['milp_time_s'])} | {_ms(r['checkmate_time_s'])} | "
            f"{_ms(r['dtr_time_s'])} | {_ms(r['min_peak_time_s'])} | "
            f"{_ms(r['lower_bound_s'])} | {_ms(r['proven_bound_s'])} | "
            f"{r['overhead_removed']:.0%} | {r['most_removable']:.0%} | "
            f"{r['bound_reached']:.0%} | {_ms(r['family_bound_s'])} | "
            f"{r['family_reached']:.0%} | {r['milp_solve_time_s']:.1f} | {r['milp_status']} |"
        )
    path.write_text("\n".join(lines) + "\n")


def plot(rows: list[dict], path: Path) -> None:
    """The reached fraction of the bound and the solve time against the chain length."""
    figure, (reached, seconds) = plt.subplots(1, 2, figsize=(12, 4.5))
    for family, marker in (("llama", "o"), ("resnet", "s")):
        for fraction in sorted({r["budget_fraction"] for r in rows}):
            points = sorted(
                (r for r in rows if r["family"] == family and r["budget_fraction"] == fraction),
                key=lambda r: r["stages"],
            )
            if not points:
                continue
            lengths = [r["stages"] for r in points]
            label = f"{family}, {fraction:.0%} of keep-all"
            line = reached.plot(
                lengths, [100 * r["bound_reached"] for r in points], marker=marker, label=label
            )[0]
            seconds.plot(
                lengths,
                [r["milp_solve_time_s"] for r in points],
                marker=marker,
                color=line.get_color(),
            )
    reached.axhline(80, color="grey", linewidth=0.8, linestyle=":")
    reached.set(
        xlabel="stages",
        ylabel="% of the removable overhead removed",
        title="milp: (dp − plan) ÷ (dp − proven bound)",
        ylim=(0, 105),
    )
    seconds.set(xlabel="stages", ylabel="solve time (s)", title="milp solve time")
    for axes in (reached, seconds):
        axes.grid(alpha=0.3)
    reached.legend(fontsize=7, ncol=2)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="*", default=[8, 16, 24, 34, 48, 64, 100, 200])
    parser.add_argument(
        "--resnets", type=int, nargs="*", default=sorted(RESNET_BLOCKS), choices=RESNET_BLOCKS
    )
    parser.add_argument(
        "--budgets", type=float, nargs="+", default=[0.2, 0.25, 0.3, 0.35, 0.5], metavar="FRACTION"
    )
    parser.add_argument("--time-limit", type=float, default=30.0, metavar="S")
    parser.add_argument(
        "--bound-limit", type=float, default=30.0, metavar="S", help="for the lower bound"
    )
    parser.add_argument("--long-time-limit", type=float, default=60.0, metavar="S")
    parser.add_argument(
        "--checkmate-time-limit", dest="checkmate_limit", type=float, default=10.0, metavar="S"
    )
    parser.add_argument("--out", type=Path, default=Path("experiments/results"))
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for noisy in ("solvers.milp", "solvers.milp_search", "solvers.milp_warm"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    args.out.mkdir(parents=True, exist_ok=True)
    chains = [("llama", llama_chain(n)) for n in args.lengths]
    chains += [("resnet", resnet_chain(depth)) for depth in args.resnets]
    rows = [
        row
        for family, chain in chains
        for fraction in args.budgets
        if (row := point(family, chain, fraction, args)) is not None
    ]
    with (args.out / "ilp_vs_dp.csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=FIELDS)
        writer.writeheader()
        writer.writerows(rows)
    write_table(rows, args.out / "ilp_vs_dp_table.md", "python " + " ".join(sys.argv))
    plot(rows, args.out / "ilp_vs_dp.png")
    logging.info("wrote ilp_vs_dp.csv, ilp_vs_dp_table.md and ilp_vs_dp.png in %s", args.out)


if __name__ == "__main__":
    main()
