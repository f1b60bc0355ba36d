"""Pictures of a plan (its timeline on the three lanes and its memory curve against the budget)
and of a budget sweep (step time against budget, one line per method).

The figures show what :func:`solvers.simulator.simulate` predicts, in the style of the schedule
diagrams of Beaumont, Eyraud-Dubois and Shilova, "Efficient Combination of Rematerialization
and Offloading for Training DNNs" (NeurIPS 2021). They are drawn with matplotlib's Agg canvas
directly, so no display and no global pyplot state is involved.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path

from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.patches import Patch

from offremat.sweep import SweepPoint
from solvers.bounds import lower_bound_s
from solvers.budget import byte_unit, format_bytes
from solvers.chain import Chain
from solvers.plan import Plan
from solvers.simulator import COMPUTE_LANE, D2H_LANE, H2D_LANE, Simulation, simulate

LANES = (COMPUTE_LANE, D2H_LANE, H2D_LANE)
LANE_TITLES = {
    COMPUTE_LANE: "compute",
    D2H_LANE: "device→host",
    H2D_LANE: "host→device",
}
KIND_STYLE = {
    "F_all": ("#4c72b0", "forward, keeps saved set (F_all)"),
    "F_ck": ("#8fb3e0", "forward, keeps input (F_ck)"),
    "F_none": ("#c9d9ef", "forward, no grad (F_none)"),
    "B": ("#dd8452", "backward (B)"),
    "offload": ("#55a868", "offload to host"),
    "prefetch": ("#8172b3", "prefetch to GPU"),
}
_LABEL_FONT_SIZE = 7
_LABEL_MARGIN_PIXELS = 3
SWEEP_TIME_CAP = 2.0
_DPI = 120


def plot_simulation(
    simulation: Simulation, path: str | Path | None = None, title: str = ""
) -> Figure:
    """Timeline (compute, device→host, host→device) above the memory curve, sharing time.

    Each bar is labelled when it is wide enough: the full op name if it fits, else the stage
    index alone. Saves a PNG to ``path`` when given; returns the figure either way.
    """
    scale, unit = _time_unit(_horizon(simulation))
    compute_ops = sum(1 for bar in simulation.timeline if bar.lane == COMPUTE_LANE)
    width_inches = min(28.0, max(11.0, 0.14 * compute_ops))
    figure = Figure(figsize=(width_inches, 6.2), dpi=_DPI, layout="constrained")
    FigureCanvasAgg(figure)
    timeline_axes, memory_axes = figure.subplots(
        2, 1, sharex=True, gridspec_kw={"height_ratios": [1.0, 1.5]}
    )
    _draw_timeline(timeline_axes, simulation, scale)
    _draw_memory(memory_axes, simulation, scale)
    memory_axes.set_xlabel(f"time ({unit})")
    memory_axes.set_xlim(0, _horizon(simulation) * scale * 1.005)
    if title:
        figure.suptitle(title, fontsize=11)
    figure.draw_without_rendering()
    _label_bars(timeline_axes, simulation, scale)
    if path is not None:
        figure.savefig(path)
    return figure


def plot_plan(
    chain: Chain, plan: Plan, path: str | Path | None = None, budget_bytes: int | None = None
) -> Figure:
    """Simulate ``plan`` on ``chain`` and draw it (see :func:`plot_simulation`).

    The budget line is ``budget_bytes`` if given, else the plan's own budget.
    """
    budget = plan.budget_bytes if budget_bytes is None else budget_bytes
    simulation = simulate(plan, chain, budget)
    overhead = simulation.makespan_s / chain.compute_time_s - 1 if chain.compute_time_s else 0.0
    headline = (
        f"{chain.name or 'chain'} · {plan.solver} · {chain.length} stages · "
        f"time {_format_seconds(simulation.makespan_s)} "
        f"({abs(overhead) if abs(overhead) < 5e-4 else overhead:+.1%} over Σ fwd + Σ bwd) · "
        f"peak {format_bytes(simulation.peak_bytes)}"
    )
    if budget is not None:
        headline += f" of {format_bytes(budget)} budget"
    return plot_simulation(simulation, path, title=headline)


def _draw_timeline(axes, simulation: Simulation, scale: float) -> None:
    horizon = _horizon(simulation) * scale
    used_kinds = []
    for bar in simulation.timeline:
        kind = bar.label.split("(")[0]
        color, _ = KIND_STYLE[kind]
        if kind not in used_kinds:
            used_kinds.append(kind)
        row = len(LANES) - 1 - LANES.index(bar.lane)
        start, width = bar.start_s * scale, (bar.end_s - bar.start_s) * scale
        axes.broken_barh(
            [(start, width)], (row - 0.4, 0.8), facecolors=color, edgecolor="white", linewidth=0.5
        )
    for lane in (D2H_LANE, H2D_LANE):
        if not any(bar.lane == lane for bar in simulation.timeline):
            row = len(LANES) - 1 - LANES.index(lane)
            axes.text(horizon / 2, row, "no copies", ha="center", va="center", color="#999999")
    axes.set_yticks(range(len(LANES)))
    axes.set_yticklabels([LANE_TITLES[lane] for lane in reversed(LANES)])
    axes.set_ylim(-0.6, len(LANES) - 0.4)
    axes.grid(axis="x", color="#dddddd", linewidth=0.6)
    axes.set_axisbelow(True)
    order = [kind for kind in KIND_STYLE if kind in used_kinds]
    axes.legend(
        handles=[Patch(color=KIND_STYLE[kind][0], label=KIND_STYLE[kind][1]) for kind in order],
        loc="lower center",
        bbox_to_anchor=(0.5, 1.0),
        ncol=len(order),
        fontsize=8,
        frameon=False,
    )


def _draw_memory(axes, simulation: Simulation, scale: float) -> None:
    divisor, unit = byte_unit(max(simulation.peak_bytes, simulation.budget_bytes or 0))
    times = [time * scale for time, _ in simulation.memory_curve]
    levels = [level / divisor for _, level in simulation.memory_curve]
    end = _horizon(simulation) * scale
    if times[-1] < end:
        times.append(end)
        levels.append(levels[-1])
    axes.step(times, levels, where="post", color="#333333", linewidth=1.2, label="resident bytes")
    axes.fill_between(times, levels, step="post", color="#9db4d3", alpha=0.45)
    peak_index = max(range(len(levels)), key=levels.__getitem__)
    axes.plot(times[peak_index], levels[peak_index], "o", color="#333333", markersize=4)
    axes.annotate(
        f"peak {format_bytes(simulation.peak_bytes)}",
        (times[peak_index], levels[peak_index]),
        textcoords="offset points",
        xytext=(6, -12),
        fontsize=8,
        bbox={"facecolor": "white", "edgecolor": "none", "alpha": 0.8, "pad": 1.0},
    )
    top = levels[peak_index]
    if simulation.budget_bytes is not None:
        budget = simulation.budget_bytes / divisor
        axes.axhline(
            budget,
            color="#c44e52",
            linestyle="--",
            linewidth=1.3,
            label=f"budget {format_bytes(simulation.budget_bytes)}",
        )
        top = max(top, budget)
    axes.set_ylim(0, top * 1.15)
    axes.set_ylabel(f"GPU memory ({unit})")
    axes.grid(color="#e5e5e5", linewidth=0.6)
    axes.legend(loc="lower right", fontsize=8)


METHOD_STYLE = {
    "keep-all": ("#333333", "s"),
    "chen": ("#8c8c8c", "v"),
    "checkpoint-every-stage": ("#b07aa1", "^"),
    "offload-all": ("#55a868", "D"),
    "min-peak": ("#dd8452", "<"),
    "dtr": ("#937860", "X"),
    "dp": ("#4c72b0", "o"),
    "checkmate": ("#da8bc3", "P"),
    "milp": ("#c44e52", "*"),
}


def _same_points(
    first: tuple[list[float], list[float]], second: tuple[list[float], list[float]]
) -> bool:
    """Whether two lines have the same feasible points (those of no plan are NaN)."""
    points = [
        {(x, y) for x, y in zip(*line, strict=True) if not math.isnan(y)}
        for line in (first, second)
    ]
    return bool(points[0]) and points[0] == points[1]


def plot_sweep(
    points: Sequence[SweepPoint], chain: Chain, path: str | Path | None = None, title: str = ""
) -> Figure:
    """Predicted step time against budget, one line per method, over the lower bound.

    The time axis stops at :data:`SWEEP_TIME_CAP` times Σ fwd + Σ bwd so that a much slower
    method does not flatten the others; a method with points above it says so in the legend.
    """
    figure = Figure(figsize=(9, 5.4), dpi=120, layout="constrained")
    FigureCanvasAgg(figure)
    axes = figure.subplots()
    budgets = [p.budget_bytes for p in points] or [1]
    divisor, unit = byte_unit(max(budgets))
    floor = chain.compute_time_s
    scale, time_unit = (1.0, "s") if floor >= 1.0 else (1e3, "ms")
    lines: dict[str, tuple[list[float], list[float]]] = {}
    for method in [m for m in METHOD_STYLE if any(p.method == m for p in points)]:
        rows = sorted((p for p in points if p.method == method), key=lambda p: p.budget_bytes)
        xs = [p.budget_bytes / divisor for p in rows]
        ys = [math.nan if p.predicted_time_s is None else p.predicted_time_s * scale for p in rows]
        lines[method] = (xs, ys)
    methods = list(lines)
    for position, method in enumerate(methods):
        color, marker = METHOD_STYLE[method]
        xs, ys = lines[method]
        label = method
        if all(math.isnan(y) for y in ys):
            label += " (no plan fits)"
        # A line drawn later over the same points hides this one: the legend says so.
        over = [m for m in methods[position + 1 :] if _same_points(lines[m], lines[method])]
        if over:
            label += f" (under {over[-1]}: the same times)"
        above = [y for y in ys if y > SWEEP_TIME_CAP * floor * scale]
        if above:
            label += f" (off scale up to {max(above):.3g} {time_unit})"
        axes.plot(
            xs,
            ys,
            color=color,
            marker=marker,
            markersize=7 if marker == "*" else 5,
            linewidth=1.6,
            label=label,
        )
    axes.axhline(
        floor * scale,
        color="#999999",
        linestyle=":",
        linewidth=1.2,
        label=f"Σ fwd + Σ bwd = {floor * scale:.3g} {time_unit}",
    )
    grid = sorted(set(budgets))
    bounds = [lower_bound_s(chain, budget) * scale for budget in grid]
    axes.plot(
        [budget / divisor for budget in grid],
        [bound if math.isfinite(bound) else math.nan for bound in bounds],
        color="#bbbbbb",
        linestyle="--",
        linewidth=1.0,
        label="lower bound at this budget",
    )
    axes.set_xlabel(f"memory budget ({unit})")
    axes.set_ylabel(f"predicted step time ({time_unit})")
    highest = max([p.predicted_time_s or 0.0 for p in points] + [floor])
    axes.set_ylim(0, min(highest, SWEEP_TIME_CAP * floor) * scale * 1.06)
    axes.grid(color="#e5e5e5", linewidth=0.6)
    axes.legend(fontsize=9)
    figure.suptitle(
        title
        or f"{chain.name or 'chain'}: {chain.length} stages, keep-all peak "
        f"{format_bytes(max(budgets))}",
        fontsize=11,
    )
    if path is not None:
        figure.savefig(path)
    return figure


def _label_bars(axes, simulation: Simulation, scale: float) -> None:
    """Write each bar's op name inside it, or its bare index, or nothing: whatever fits.

    Runs once the layout is final, so widths are measured in real pixels.
    """
    renderer = axes.figure.canvas.get_renderer()
    for bar in simulation.timeline:
        kind = bar.label.split("(")[0]
        row = len(LANES) - 1 - LANES.index(bar.lane)
        (left, _), (right, _) = axes.transData.transform(
            [(bar.start_s * scale, row), (bar.end_s * scale, row)]
        )
        text = axes.text(
            (bar.start_s + bar.end_s) / 2 * scale,
            row,
            bar.label,
            ha="center",
            va="center",
            fontsize=_LABEL_FONT_SIZE,
            color="black" if kind in ("F_ck", "F_none") else "white",
            clip_on=True,
        )
        index = bar.label[bar.label.index("(") + 1 : -1]
        for candidate, size in (
            (bar.label, _LABEL_FONT_SIZE),
            (index, _LABEL_FONT_SIZE),
            (index, 5),
        ):
            text.set_text(candidate)
            text.set_fontsize(size)
            if text.get_window_extent(renderer).width + _LABEL_MARGIN_PIXELS <= right - left:
                break
        else:
            text.remove()


def _horizon(simulation: Simulation) -> float:
    ends = [bar.end_s for bar in simulation.timeline]
    return max([simulation.makespan_s, *ends]) or 1.0


def _time_unit(seconds: float) -> tuple[float, str]:
    if seconds >= 1.0:
        return 1.0, "s"
    if seconds >= 1e-3:
        return 1e3, "ms"
    return 1e6, "µs"


def _format_seconds(seconds: float) -> str:
    scale, unit = _time_unit(seconds)
    return f"{seconds * scale:.3g} {unit}"
