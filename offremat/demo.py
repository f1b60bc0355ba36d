"""``offremat demo``: plan an in-repo GPT for a budget keep-all does not fit, then train it with
every method and compare predicted against measured step time and peak.

The methods are plain autograd (keep-all), ``torch.utils.checkpoint.checkpoint_sequential``
with Chen et al.'s √L segments ("Training Deep Nets with Sublinear Memory Cost", 2016),
``torch.autograd.graph.save_on_cpu(pin_memory=True)`` (CUDA only), and offremat's dp
(Herrmann, Beaumont et al. 2019) and milp plans run by :func:`offremat.optimize`.

Measurement, the same for every method: each trains the same freshly seeded model on the same
batches with the same RNG seed, so a method that changes only *where* activations live must
give the same losses bit for bit. Step time is the median forward plus backward time after a
first warm-up step. Peak activation memory is measured independently of offremat, the same
way for every method (:class:`offremat.measure.StepMemory`): on CUDA, ``max_memory_allocated``
during the step above what was allocated before it (parameters, their gradients and the
optimizer state are allocated by then), on CPU the peak of live storages created during the
step, seen by a dispatch-mode tracker, with what kernels allocate inside themselves from the
CPU allocator's reports; both plus the input batch, which the budget counts.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from rich import box
from rich.table import Table
from torch import nn

from offremat.methods import (
    Measurement,
    best_checkpoint_sequential,
    checkpoint_sequential_forward,
    optimized_forward,
    plain_forward,
    save_on_cpu_forward,
    train,
)
from offremat.models import GPTConfig, build_gpt, gpt_batch
from offremat.profiler import profile_model
from solvers.baselines import checkpoint_sequential_plan, chen_segments, keep_all
from solvers.budget import byte_unit, format_bytes
from solvers.chain import Chain, Link
from solvers.plan import Plan
from solvers.registry import keep_all_peak, min_feasible_budget, solve
from solvers.simulator import score

logger = logging.getLogger(__name__)

DEMO_GPT = GPTConfig(layers=6, hidden=128, heads=4, seq=128, vocab=512, dropout=0.1)
DEMO_BATCH_SIZE = 8
# On CPU there is no host link to measure; this stands in for a PCIe 3.0 x16 link so that the
# milp can plan offloads, which the CPU executor then runs as synchronous copies.
CPU_STAND_IN_BANDWIDTH = 1.2e10
CUDA_LOSS_TOLERANCE = 1e-4
"""Relative loss difference allowed after the first step on CUDA without deterministic mode."""


@dataclass(frozen=True)
class MethodResult:
    """One row of the comparison: a method's predicted and measured time and peak."""

    method: str
    status: str
    predicted_time_s: float | None = None
    predicted_peak_bytes: int | None = None
    measured: Measurement | None = None
    note: str = ""

    @property
    def ran(self) -> bool:
        """Whether the method trained (it is not skipped)."""
        return self.measured is not None


@dataclass(frozen=True)
class DemoReport:
    """Everything ``offremat demo`` found, for printing or for tests."""

    device: str
    model: str
    chain: Chain
    budget_bytes: int
    keep_all_peak_bytes: int
    link_note: str
    results: tuple[MethodResult, ...]
    elapsed_s: float
    info: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def losses_identical(self) -> bool:
        """Whether every method that trained saw exactly the same losses."""
        curves = {r.measured.losses for r in self.results if r.measured is not None}
        return len(curves) == 1

    @property
    def largest_loss_difference(self) -> float:
        """The largest relative difference of any method's loss from keep-all's, any step."""
        reference = self.result("keep-all").measured
        assert reference is not None
        return max(
            (
                abs(loss - expected) / max(abs(expected), 1e-12)
                for row in self.results
                if row.measured is not None
                for loss, expected in zip(row.measured.losses, reference.losses, strict=True)
            ),
            default=0.0,
        )

    @property
    def losses_agree(self) -> bool:
        """What a plan that only moves activations must give: the same training.

        Bit for bit on CPU and under ``torch.use_deterministic_algorithms(True)``. Otherwise
        CUDA kernels that accumulate with atomics (memory-efficient attention's backward)
        differ from run to run: the first step's loss must be identical (the forward is
        deterministic) and later ones within :data:`CUDA_LOSS_TOLERANCE` of keep-all's.
        """
        if self.losses_identical:
            return True
        if self.device.startswith("cpu") or self.info.get("deterministic", False):
            return False
        firsts = {r.measured.losses[0] for r in self.results if r.measured is not None}
        return len(firsts) == 1 and self.largest_loss_difference <= CUDA_LOSS_TOLERANCE

    def result(self, method: str) -> MethodResult:
        """The row of ``method``."""
        return next(r for r in self.results if r.method == method)


def run_demo(
    config: GPTConfig = DEMO_GPT,
    batch_size: int = DEMO_BATCH_SIZE,
    steps: int = 6,
    budget_fraction: float = 0.5,
    milp_time_limit_s: float = 10.0,
    bandwidth: float | None = None,
    device: str | None = None,
    seed: int = 0,
    progress: Callable[[str], None] | None = None,
) -> DemoReport:
    """Profile the GPT, choose a budget keep-all does not fit, solve, train with every method.

    ``bandwidth`` (bytes/s) replaces the host link; on CPU, where there is none, it defaults
    to :data:`CPU_STAND_IN_BANDWIDTH` so that the milp can offload. ``progress`` receives one
    line per phase.
    """
    started = time.perf_counter()
    say = progress or (lambda line: logger.info("%s", line))
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cuda = torch.device(device).type == "cuda"
    model_name = (
        f"GPT {config.layers} layers, hidden {config.hidden}, {config.heads} heads, "
        f"seq {config.seq}, batch {batch_size}"
    )

    def build() -> nn.Module:
        return build_gpt(config, seed).to(device)

    batches = [gpt_batch(config, batch_size, seed + n, device) for n in range(steps)]
    say(f"profiling the {model_name} on {device}")
    chain = profile_model(build(), batches[0], name="demo-gpt")
    if bandwidth is not None:
        chain = chain.with_link(Link(bandwidth, bandwidth))
        link_note = f"host link set to {format_bytes(bandwidth)}/s by --bandwidth"
    elif chain.link is None:
        chain = chain.with_link(Link(CPU_STAND_IN_BANDWIDTH, CPU_STAND_IN_BANDWIDTH))
        link_note = (
            f"no GPU: the milp plans with a stand-in {CPU_STAND_IN_BANDWIDTH / 1e9:.0f} GB/s host "
            "link (--bandwidth sets another), and the CPU executor runs its offloads as "
            "synchronous copies into host memory that is the same RAM (left out of the peak, "
            "as a GPU's pinned memory is)"
        )
    else:
        link_note = (
            f"measured host link: {chain.link.d2h_bytes_per_s / 1e9:.1f} GB/s device→host, "
            f"{chain.link.h2d_bytes_per_s / 1e9:.1f} GB/s host→device"
        )
    keep_peak = keep_all_peak(chain)
    least = min_feasible_budget(chain, "dp")
    asked = int(budget_fraction * keep_peak)
    budget = max(asked, math.ceil(least * 1.02))
    raised = (
        f": the {budget_fraction:.0%} asked is below the least feasible "
        f"{format_bytes(least, round_up=True)}"
        if budget > asked
        else ""
    )
    say(
        f"keep-all needs {format_bytes(keep_peak)}; budget {format_bytes(budget)} "
        f"({budget / keep_peak:.0%}{raised}); solving dp and milp"
    )
    plans = {
        "dp": solve(chain, budget, "dp"),
        "milp": solve(chain, budget, "milp", time_limit_s=milp_time_limit_s),
    }
    # The segment count a user would pick for this budget; Chen's √L if none fits.
    sequential = best_checkpoint_sequential(chain, budget) or score(
        checkpoint_sequential_plan(chain, len(chen_segments(chain.length))), chain, budget
    )
    segments = sequential.info["segments"]
    keep = score(keep_all(chain), chain, budget)

    results = []
    say(f"training {steps} steps with keep-all")
    keep_status = "fits the budget" if keep.feasible else "over budget"
    results.append(_row("keep-all", keep_status, keep, train(build, plain_forward, batches, seed)))
    say(f"training {steps} steps with checkpoint_sequential({segments})")
    results.append(
        _row(
            "checkpoint_sequential",
            f"{segments} segments, "
            + ("the fastest count that fits" if sequential.feasible else "over budget"),
            sequential,
            train(build, checkpoint_sequential_forward(segments), batches, seed),
        )
    )
    if cuda:
        say(f"training {steps} steps with save_on_cpu")
        results.append(
            MethodResult(
                "save_on_cpu",
                "pin_memory=True, no budget",
                measured=train(build, save_on_cpu_forward, batches, seed),
                note="synchronous copies; the simulator does not model it",
            )
        )
    else:
        results.append(MethodResult("save_on_cpu", "skipped", note="pin_memory=True needs CUDA"))
    for name, plan in plans.items():
        say(f"training {steps} steps with the offremat {name} plan")
        forward = optimized_forward(batches[0], chain, plan)
        measured = train(build, forward, batches, seed)
        results.append(_row(f"offremat {name}", f"plan {decision_counts(plan)}", plan, measured))
    return DemoReport(
        device=_device_name(device),
        model=model_name,
        chain=chain,
        budget_bytes=budget,
        keep_all_peak_bytes=keep_peak,
        link_note=link_note,
        results=tuple(results),
        elapsed_s=time.perf_counter() - started,
        info={
            "milp": {k: plans["milp"].info.get(k) for k in ("solver_status", "gap")},
            "deterministic": torch.are_deterministic_algorithms_enabled(),
        },
    )


def _row(method: str, status: str, plan: Plan, measured: Measurement) -> MethodResult:
    return MethodResult(
        method,
        status,
        predicted_time_s=plan.predicted_time_s,
        predicted_peak_bytes=plan.predicted_peak_bytes,
        measured=measured,
    )


def decision_counts(plan: Plan) -> str:
    """How many stages the plan keeps, recomputes and offloads: ``4 keep, 2 recompute``."""
    decisions = list(plan.decisions.values())
    counts = {kind: decisions.count(kind) for kind in ("keep", "recompute", "offload")}
    return ", ".join(f"{n} {kind}" for kind, n in counts.items() if n)


def _device_name(device: str) -> str:
    if torch.device(device).type == "cuda":
        return f"{device} ({torch.cuda.get_device_name(torch.device(device))})"
    threads = torch.get_num_threads()
    return f"cpu ({threads} thread{'s' if threads > 1 else ''})"


def render(report: DemoReport, console: Any) -> None:
    """Print the comparison table and the loss curves with rich."""
    console.print(
        f"[bold]{report.model}[/] on {report.device}: {report.chain.length} stages, "
        f"keep-all needs {format_bytes(report.keep_all_peak_bytes)}, budget "
        f"[bold]{format_bytes(report.budget_bytes)}[/] "
        f"({report.budget_bytes / report.keep_all_peak_bytes:.0%} of keep-all)"
    )
    console.print(report.link_note)
    table = _method_table("predicted (simulator) against measured, per training step")
    for column in (
        "time\npred.",
        "time\nmeas.",
        "\nerror",
        "peak\npred.",
        "peak\nmeas.",
        "\nerror",
    ):
        table.add_column(column, justify="right", no_wrap=True)
    for row in report.results:
        measured = row.measured
        table.add_row(
            row.method,
            _seconds(row.predicted_time_s),
            _seconds(measured.step_time_s if measured else None),
            _error(row.predicted_time_s, measured.step_time_s if measured else None),
            _bytes(row.predicted_peak_bytes),
            _bytes(measured.peak_bytes if measured else None, report.budget_bytes),
            _error(row.predicted_peak_bytes, measured.peak_bytes if measured else None),
        )
    console.print(table)
    for row in report.results:
        status = row.status.replace("over budget", "[red]over budget[/]")
        console.print(f"  {row.method}: {status}" + (f" ({row.note})" if row.note else ""))
    if report.device.startswith("cuda"):
        peak_note = "max_memory_allocated during the step above its start, plus the input"
    else:
        peak_note = (
            "live storages created during the step, plus the input, seen by the same "
            "dispatch-mode tracker for every method, with what kernels allocate inside "
            "themselves (the CPU allocator's reports)"
        )
    console.print(
        f"[dim]time: median forward + backward after a warm-up step; measured peak: {peak_note}[/]"
    )
    ran = [r for r in report.results if r.measured is not None]
    losses = _method_table("loss per step (same seed, same batches)")
    steps = len(ran[0].measured.losses) if ran else 0
    for n in range(steps):
        losses.add_column(f"step {n + 1}", justify="right", no_wrap=True, min_width=7)
    for row in ran:
        losses.add_row(row.method, *(f"{loss:.5f}" for loss in row.measured.losses))
    console.print(losses)
    if report.losses_identical:
        console.print(f"[green]losses identical bit for bit across {len(ran)} methods[/]")
    elif report.losses_agree:
        console.print(
            f"[green]step 1 identical across {len(ran)} methods; later steps within "
            f"{report.largest_loss_difference:.1e} (relative) of keep-all's: CUDA's "
            f"non-deterministic kernels (--deterministic compares bit for bit)[/]"
        )
    else:
        console.print("[red bold]losses differ between methods[/]")
    console.print(f"demo took {report.elapsed_s:.1f} s")


def _method_table(title: str) -> Table:
    """A narrow rich table with a first column of method names (the demo fits 80 columns)."""
    table = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, collapse_padding=True)
    table.add_column("method", no_wrap=True)
    return table


def _seconds(value: float | None) -> str:
    if value is None:
        return "—"
    return f"{value * 1e3:.3g} ms" if value < 1 else f"{value:.3g} s"


def _bytes(value: int | None, budget: int | None = None) -> str:
    if value is None:
        return "—"
    size, unit = byte_unit(value)
    text = f"{value / size:.3g} {unit}"
    return f"[red]{text}[/]" if budget is not None and value > budget else text


def _error(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None or predicted == 0:
        return "—"
    error = round(measured / predicted - 1, 2)
    return f"{error + 0.0:+.0%}"  # + 0.0: a rounded -0.0 prints as +0%, not -0%
