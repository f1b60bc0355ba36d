"""How well the simulator predicts a plan's real step time and peak, per plan, on in-repo models.

Usage:
    python experiments/prediction_accuracy.py [--models gpt-small resnet-small]
        [--fractions 0.3 0.5 0.7] [--steps 6] [--milp-time-limit 10] [--threads N]
        [--out experiments/results]

Each model is profiled on this machine into a chain. Plans: keep-all, chen,
checkpoint-every-stage and the dp at each budget fraction of the keep-all peak; on CUDA also
offload-all and the milp, which need the measured host link (on CPU they would time CPU
memcpy, not a link, so they are left out). Every plan runs through ``offremat.optimize`` for
``--steps`` training steps; the measured step time is the median forward plus backward after a
warm-up step; the measured peak is independent of the executor (``offremat.measure``):
``max_memory_allocated`` above the step's start on CUDA, a dispatch-mode tracker of the live
storages the step creates on CPU, plus the input (see ``offremat.methods.train``). Writes
``prediction_accuracy.csv`` and ``prediction_accuracy.png`` (measured against predicted).
"""

from __future__ import annotations

import argparse
import csv
import logging
import math
import statistics
from pathlib import Path

import torch
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.ticker import FuncFormatter

from offremat.methods import optimized_forward, train
from offremat.models import model_spec
from offremat.plots import METHOD_STYLE
from offremat.sweep import profile_named_model
from solvers.budget import InfeasibleBudgetError, format_bytes
from solvers.chain import Chain
from solvers.plan import Plan
from solvers.registry import keep_all_peak, solve

logger = logging.getLogger("prediction_accuracy")
COLUMNS = (
    "model",
    "device",
    "plan",
    "budget_bytes",
    "predicted_time_s",
    "measured_time_s",
    "time_error",
    "predicted_peak_bytes",
    "measured_peak_bytes",
    "peak_error",
)
RECOMPUTE_BASELINES = ("keep-all", "chen", "checkpoint-every-stage")


def plans_for(chain: Chain, fractions: list[float], cuda: bool, milp_time_limit_s: float):
    """(label, plan) for every baseline once and every optimizer at every budget fraction."""
    top = keep_all_peak(chain)
    baselines = RECOMPUTE_BASELINES + (("offload-all",) if cuda else ())
    for name in baselines:
        yield name, solve(chain, top, name)
    optimizers = {"dp": {}}
    if cuda:
        optimizers["milp"] = {"time_limit_s": milp_time_limit_s}
    for fraction in fractions:
        budget = int(fraction * top)
        for name, options in optimizers.items():
            try:
                yield f"{name} @ {fraction:.0%}", solve(chain, budget, name, **options)
            except InfeasibleBudgetError as error:
                logger.info("%s at %.0f%%: %s", name, fraction * 100, error)


def measure_model(name: str, args: argparse.Namespace, device: str) -> list[dict]:
    """Profile ``name``, then run and measure every plan; one CSV row per plan."""
    spec = model_spec(name)
    chain = profile_named_model(name, device=device)
    batches = [spec.batch(spec.default_batch_size, n, device) for n in range(args.steps)]
    cuda = device == "cuda"
    rows = []
    for label, plan in plans_for(chain, args.fractions, cuda, args.milp_time_limit):
        measured = train(
            lambda: spec.build(0).to(device),
            optimized_forward(batches[0], chain, plan),
            batches,
            seed=0,
        )
        rows.append(_row(name, device, label, plan, measured.step_time_s, measured.peak_bytes))
        logger.info(
            "%s %-26s time %.1f ms (predicted %.1f), peak %s (predicted %s)",
            name,
            label,
            measured.step_time_s * 1e3,
            plan.predicted_time_s * 1e3,
            format_bytes(measured.peak_bytes),
            format_bytes(plan.predicted_peak_bytes),
        )
    return rows


def _row(model: str, device: str, label: str, plan: Plan, time_s: float, peak: int) -> dict:
    return {
        "model": model,
        "device": device,
        "plan": label,
        "budget_bytes": plan.budget_bytes,
        "predicted_time_s": plan.predicted_time_s,
        "measured_time_s": time_s,
        "time_error": time_s / plan.predicted_time_s - 1,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "measured_peak_bytes": peak,
        "peak_error": peak / plan.predicted_peak_bytes - 1,
    }


def plot(rows: list[dict], path: Path, device: str) -> None:
    """Measured against predicted time and peak, one marker per plan, with the y = x line."""
    figure = Figure(figsize=(12, 5.4), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    time_axes, peak_axes = figure.subplots(1, 2)
    markers = {"gpt-small": "o", "resnet-small": "s"}
    colors = {method: color for method, (color, _) in METHOD_STYLE.items()}
    for axes, key, error_key, scale, unit, what in (
        (time_axes, "time_s", "time_error", 1e3, "ms", "step time"),
        (peak_axes, "peak_bytes", "peak_error", 1 / 2**20, "MiB", "peak activation memory"),
    ):
        values = []
        for row in rows:
            method = row["plan"].split(" @ ")[0]
            x, y = row[f"predicted_{key}"] * scale, row[f"measured_{key}"] * scale
            values += [x, y]
            axes.plot(
                x,
                y,
                markers.get(row["model"], "^"),
                color=colors.get(method, "#dd8452"),
                markersize=6,
                alpha=0.85,
            )
        # Log axes: the models' times and sizes differ by factors, errors are ratios.
        low, high = min(values) / 1.3, max(values) * 1.3
        axes.plot([low, high], [low, high], color="#999999", linewidth=1)
        axes.fill_between(
            [low, high], [low * 0.9, high * 0.9], [low * 1.1, high * 1.1], color="#dddddd"
        )
        axes.set_xscale("log")
        axes.set_yscale("log")
        for axis in (axes.xaxis, axes.yaxis):
            axis.set_major_formatter(FuncFormatter(lambda value, _: f"{value:g}"))
            axis.set_minor_formatter(FuncFormatter(_two_and_five))
        axes.set_xlim(low, high)
        axes.set_ylim(low, high)
        axes.set_xlabel(f"predicted ({unit}, log scale; band: ±10%)")
        axes.set_ylabel(f"measured ({unit})")
        axes.grid(color="#eeeeee")
        errors = [abs(row[error_key]) for row in rows]
        axes.set_title(
            f"{what}: median |error| {statistics.median(errors):.0%}, max {max(errors):.0%}",
            fontsize=10,
        )
    methods = {row["plan"].split(" @ ")[0] for row in rows}
    models = {row["model"] for row in rows}
    handles = [
        Line2D([], [], marker="o", color=color, linestyle="", label=method)
        for method, color in colors.items()
        if method in methods
    ]
    handles += [
        Line2D([], [], marker=marker, color="#555555", linestyle="", label=model)
        for model, marker in markers.items()
        if model in models
    ]
    peak_axes.legend(handles=handles, fontsize=8, loc="upper left")
    figure.suptitle(f"simulator prediction against measurement, per plan, on {device}")
    figure.savefig(path)


def _two_and_five(value: float, _: int) -> str:
    """Minor log-axis labels at 2 and 5 times a power of ten only, so they never collide."""
    mantissa = value / 10 ** math.floor(math.log10(value))
    return f"{value:g}" if round(mantissa, 6) in (2.0, 5.0) else ""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", nargs="+", default=["gpt-small", "resnet-small"])
    parser.add_argument("--fractions", nargs="+", type=float, default=[0.3, 0.5, 0.7])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--milp-time-limit", type=float, default=10.0)
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
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = [row for name in args.models for row in measure_model(name, args, device)]
    with open(out / "prediction_accuracy.csv", "w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    plot(rows, out / "prediction_accuracy.png", device)
    worst = max(rows, key=lambda row: abs(row["time_error"]))
    logger.info(
        "%d plans; worst time error %+.0f%% (%s %s)",
        len(rows),
        worst["time_error"] * 100,
        worst["model"],
        worst["plan"],
    )


if __name__ == "__main__":
    main()
