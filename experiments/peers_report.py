"""The tables and findings that ``peers_cpu.py`` writes from its measurements."""

from __future__ import annotations

import argparse
import csv
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

import torch
from peers_setup import (
    BANDWIDTH,
    COMPILE_BUDGETS,
    HEAPS,
    KEPT_HEAP_BYTES,
    MILP_TIME_LIMIT_S,
    MMAP_THRESHOLD,
    MODEL_DESCRIPTIONS,
    SUFFIX,
    TIMED_STEPS,
    WARMUP_STEPS,
)

COLUMNS = (
    "model",
    "budget fraction",
    "budget bytes",
    "method",
    "step time ÷ keep-all (glibc heap)",
    "step time ÷ keep-all (kept heap)",
    "tracker peak ÷ budget",
    "RSS peak ÷ budget",
    "fits (tracker)",
    "gradients equal",
)


def table_cells(row: dict[str, Any]) -> list[str]:
    cells = [row["model"], f"{row['fraction']:.1f}", str(row["budget_bytes"]), row["method"]]
    if "key" not in row:
        return [*cells, row["note"], "—", "—", "—", "—", "—"]
    if row["key"].startswith("compile"):
        tracker, fits = "— (not visible to the tracker)", f"— (by RSS: {row['rss_fits']})"
    else:
        tracker, fits = f"{row['peak_ratio']:.3f}", row["fits"]
    return [
        *cells,
        f"{row['time_ratio']:.3f}",
        f"{row['time_ratio_kept']:.3f}",
        tracker,
        f"{row['rss_ratio']:.3f}",
        fits,
        row["grads"],
    ]


def write_outputs(
    rows: list[dict[str, Any]],
    stem: Path,
    args: argparse.Namespace,
    runtime: float,
    environments: set[tuple[Any, ...]],
    compile_sweeps: dict[str, dict[float, dict[str, Any]]],
) -> None:
    from rich.console import Console
    from rich.table import Table

    stem.parent.mkdir(parents=True, exist_ok=True)
    fields = [
        "model",
        "fraction",
        "budget_bytes",
        "method",
        "median_s",
        "keep_median_s",
        "time_ratio",
        "median_s_kept",
        "keep_median_s_kept",
        "time_ratio_kept",
        "peak",
        "peak_ratio",
        "fits",
        "rss",
        "rss_ratio",
        "rss_fits",
        "grads",
        "predicted_peak",
        "compile_cold_s",
        "compile_s",
        "note",
    ]
    with stem.with_suffix(".csv").open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=fields, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    table = Table(title=f"offremat vs peers on CPU (median of {args.rounds} rounds)")
    for column in COLUMNS:
        table.add_column(column)
    for row in rows:
        table.add_row(*table_cells(row))
    Console(width=220).print(table)
    text = markdown(rows, args, runtime, environments, compile_sweeps)
    stem.with_suffix(".md").write_text(text)


LSCPU_MODEL = "lscpu | sed -n 's/^Model name: *//p'"


def _shell(command: str) -> str:
    return subprocess.run(command, shell=True, capture_output=True, text=True).stdout.strip()


def code_version() -> str:
    """Where offremat was imported from, its git commit, and whether the tree was dirty."""
    import offremat

    root = Path(offremat.__file__).resolve().parent.parent
    head = _shell(f"git -C {root} rev-parse HEAD")
    dirty = _shell(f"git -C {root} status --porcelain --untracked-files=no")
    return f"imported from {root}, git {head}" + (
        " with uncommitted changes" if dirty else " (clean tree)"
    )


def findings(rows: list[dict[str, Any]]) -> list[str]:
    """Plain statements: does every offremat plan fit, and is dp slower than checkpointing."""
    out = []
    timed = [row for row in rows if "key" in row]
    plans = [row for row in timed if row["method"].startswith("offremat")]
    over = [row for row in plans if row["fits"] == "no"]
    if over:
        for row in over:
            out.append(
                f"- **{row['model']} at {row['fraction']:.1f}: {row['method']} exceeds its "
                f"budget** by the tracker: {row['peak']} B vs {row['budget_bytes']} B "
                f"({row['peak_ratio']:.3f}x)."
            )
    else:
        out.append(
            f"- Every offremat plan that was produced ({len(plans)}) fits its budget by the "
            "tracker column (the library's definition); largest tracker peak ÷ budget "
            f"{max(row['peak_ratio'] for row in plans):.3f}."
        )
    infeasible = [r for r in rows if "infeasible" in r.get("note", "")]
    for row in infeasible:
        out.append(
            f"- {row['model']} at {row['fraction']:.1f}: {row['method']} reports the budget "
            f"infeasible ({row['note']}), so there is no plan to measure."
        )
    rss_over = [row for row in plans if row["rss_fits"] == "no"]
    if rss_over:
        out.append(
            "- By the RSS column, these offremat plans read above their budget: "
            + "; ".join(
                f"{r['model']} {r['fraction']:.1f} {r['method']} {r['rss_ratio']:.3f}"
                for r in rss_over
            )
            + " (offloaded host copies live in the same RAM on CPU, outside the budget as "
            "pinned memory is on a GPU; RSS also counts allocator slack)."
        )
    for heap in HEAPS:
        out += dp_against_checkpointing(timed, heap)
    for row in timed:
        if row["method"].startswith("torch.compile"):
            verdict = "fits" if row["rss_fits"] == "yes" else "does not fit"
            out.append(
                f"- {row['model']} at {row['fraction']:.1f}: {row['method']}, chosen because "
                f"its sweep process's RSS peak fit, {verdict} by the memory workers' RSS "
                f"({row['rss_ratio']:.3f} of the budget), at {row['time_ratio']:.3f} of keep-all."
            )
    for row in rows:
        if row["method"] == "torch.compile" and "note" in row:
            out.append(f"- {row['model']} at {row['fraction']:.1f}: torch.compile: {row['note']}.")
    for row in timed:
        if row["grads"] != "yes":
            out.append(f"- {row['model']} {row['method']}: gradients differ: {row['grads']}.")
    return out


def dp_against_checkpointing(timed: list[dict[str, Any]], heap: str) -> list[str]:
    """Where dp is slower than the best fitting checkpoint_sequential under ``heap``."""
    suffix = SUFFIX[heap]
    slower, not_slower = [], []
    for row in timed:
        if not row["method"].startswith("offremat dp"):
            continue
        ckpt = [
            r
            for r in timed
            if r["model"] == row["model"]
            and r["fraction"] == row["fraction"]
            and r["method"].startswith("checkpoint_sequential")
        ]
        if not ckpt:
            continue
        rounds = zip(row["per_round" + suffix], ckpt[0]["per_round" + suffix], strict=True)
        paired = [a / b for a, b in rounds]
        ratio = statistics.median(paired)
        text = (
            f"{row['model']} at {row['fraction']:.1f}: dp {row['time_ratio' + suffix]:.3f} vs "
            f"{ckpt[0]['method']} {ckpt[0]['time_ratio' + suffix]:.3f} of keep-all "
            f"({row['median_s' + suffix]:.4f} s vs {ckpt[0]['median_s' + suffix]:.4f} s; "
            f"dp ÷ checkpoint_sequential in the same round: median {ratio:.3f}, range "
            f"{min(paired):.3f}-{max(paired):.3f}, dp slower in {sum(p > 1 for p in paired)} "
            f"of {len(paired)} rounds)"
        )
        (slower if ratio > 1 else not_slower).append(text)
    out = []
    if slower:
        out.append(
            f"- {heap} heap: **offremat dp is slower than the best fitting "
            "checkpoint_sequential** (median of the per-round ratios above 1) at: "
            + "; ".join(slower)
            + "."
        )
    else:
        out.append(
            f"- {heap} heap: offremat dp is nowhere slower than the best fitting "
            "checkpoint_sequential."
        )
    if not_slower:
        out.append(f"- {heap} heap: dp is not slower at: " + "; ".join(not_slower) + ".")
    return out


def compile_sweep_lines(sweeps: dict[str, dict[float, dict[str, Any]]]) -> list[str]:
    lines = []
    for name, results in sweeps.items():
        if not results:
            continue
        lines += [
            "",
            f"### torch.compile sweep, {name} (one fresh process per setting)",
            "",
            "| activation_memory_budget | RSS peak (B) | quick step (s) | compile incl. first "
            "step (s) | gradients equal | error |",
            "|---|---|---|---|---|---|",
        ]
        for budget, r in results.items():
            if r["error"]:
                lines.append(f"| {budget} | — | — | — | — | {r['error']} |")
            else:
                lines.append(
                    f"| {budget} | {r['rss']} | {r['quick_s']:.4f} | {r['compile_s']:.1f} | "
                    f"{r['grads']} | — |"
                )
    return lines


def markdown(
    rows: list[dict[str, Any]],
    args: argparse.Namespace,
    runtime: float,
    environments: set[tuple[Any, ...]],
    compile_sweeps: dict[str, dict[float, dict[str, Any]]],
) -> str:
    rounds = args.rounds
    compiled = [name for name, results in compile_sweeps.items() if results]
    compile_times = [
        f"{r['model']} {r['fraction']:.1f}: {r['compile_s']:.1f} s"
        for r in rows
        if "compile_s" in r
    ]
    lines = [
        "# offremat vs peers on CPU",
        "",
        f"- Machine: {_shell('nproc')}-core CPU (`nproc`), `lscpu` model name: "
        f"{_shell(LSCPU_MODEL)}",
        f"- torch {torch.__version__}; offremat {code_version()}",
        f"- Date: {_shell('date -u')}; total runtime {runtime:.0f} s",
        f"- Command: `{' '.join(sys.argv)}` (run with `PYTHONPATH` set to a snapshot of the "
        "repository at the commit above, because the working tree was being edited)",
        "- Worker environments seen (offremat file, MALLOC_MMAP_THRESHOLD_; None in the timing "
        f"workers, {MMAP_THRESHOLD} in the memory workers): {sorted(environments, key=str)}",
        "- Models: " + "; ".join(f"{k}: {v}" for k, v in MODEL_DESCRIPTIONS.items()),
        "- Budgets: 30%, 50%, 70% of `solvers.registry.keep_all_peak(chain)` (keep-all's "
        "predicted activation peak) for the chain from one `offremat.profile_model` call; the "
        "same byte budget is given to every method.",
        "- Memory, tracker column: `offremat.measure.StepMemory('cpu', batch)`, a dispatch-mode "
        "tracker of the live storages created during one untimed training step, joined with "
        "the CPU allocator's reports of what kernels allocate inside themselves (oneDNN's "
        "scratch; `offremat/_cpu_allocator.py`), plus the input batch; parameter gradients "
        "are pre-allocated (`p.grad = torch.zeros_like(p)`) so they are not counted. This is "
        "the library's definition of the peak; fits (tracker) means tracker peak <= budget "
        "bytes. It cannot see compiled code: dynamo skips frames under a TorchDispatchMode, so "
        "it is not given for torch.compile.",
        "- Memory, RSS column (independent): measured in memory workers, separate from the "
        "timing workers, each a fresh interpreter (spawn) started with "
        f"`MALLOC_MMAP_THRESHOLD_={MMAP_THRESHOLD}` in its environment, so each allocation of "
        "64 KiB or more is its own mmap and goes back to the OS when freed. After "
        f"{WARMUP_STEPS + 1} untimed steps, for one step (gradients pre-allocated as above): "
        "write `5` to `/proc/self/clear_refs` "
        "(resets VmHWM), read VmRSS from `/proc/self/status`, run the step, read VmHWM; "
        "RSS peak = VmHWM - VmRSS at the start + the input batch's bytes. The column is the "
        f"median over {args.rss_rounds} such processes. On CPU, offloaded host copies live in the "
        "same RAM, so RSS includes them (offload rows read higher under RSS than under the "
        "tracker); RSS also sees allocator slack, whole pages and small allocations below the "
        "threshold, and leaves out pages allocated but never touched.",
        f"- Time: each configuration runs in its own fresh process (forkserver, torch "
        f"preloaded, `torch.set_num_threads(1)`; the mmap threshold of the memory workers makes "
        "every large allocation page-fault afresh, which is not how anyone trains, so timing "
        f"and RSS are taken in separate processes), {WARMUP_STEPS} warm-up step then the median "
        f"of {TIMED_STEPS} steps, under two heaps: glibc's default settings (glibc heap), which "
        "give large freed blocks back to the OS (mmapped blocks, a trimmed heap top) so that the "
        "next allocation page-faults them in again, and a kept heap (`mallopt(M_TRIM_THRESHOLD"
        f", {KEPT_HEAP_BYTES})` and `mallopt(M_MMAP_THRESHOLD, {KEPT_HEAP_BYTES})` in the "
        "worker before the model is built), where a step reuses the pages of the step before, "
        "as with jemalloc or tcmalloc. Configurations and heaps alternate in rotating order "
        f"(reversed every other round) over {rounds} rounds; the table gives the median over "
        "rounds divided by keep-all's median over the same rounds under the same heap.",
        "- checkpoint_sequential: every segment count 1..len(model) was measured (tracker peak "
        "and a quick time: median of 2 steps after 1 warm-up, in one process); the fastest "
        "whose tracker peak fits is shown. Counts with close quick times can swap between runs.",
        "- offremat: `offremat.optimize(model, batch, budget=bytes, chain=chain, solver='dp')` "
        f"and `solver='milp', bandwidth={BANDWIDTH:g}, time_limit_s={MILP_TIME_LIMIT_S}`.",
        "- torch.compile (`torch.compile(model)`, default inductor backend): for "
        f"{', '.join(compiled) or 'no model'}, "
        "`torch._functorch.config.activation_memory_budget` was swept over "
        f"{COMPILE_BUDGETS}, one fresh process per setting (compile, 1 warm-up, quick time of "
        "2 steps, one RSS-measured step; inductor's on-disk cache was not cleared and was "
        "warm from earlier runs, so these compile times are not cold); per budget the fastest "
        "setting whose RSS peak fits is timed like the other methods, with the compiling "
        "first call excluded from the timed and warm-up steps and reported separately. Its "
        "fits column is by RSS, the only measurement that sees it.",
        "- Compile time (first call, compile plus one step): in the sweep, see the sweep "
        "table; in the timing processes (median over rounds, inductor's on-disk cache "
        "warm): " + ("; ".join(compile_times) or "none timed") + ".",
        "- Gradients: parameter gradients after one step (same seed) compared with plain "
        "autograd's with `torch.equal`.",
        "",
        "## Findings",
        "",
        *findings(rows),
        "",
        "## Results",
        "",
        "| " + " | ".join(COLUMNS) + " |",
        "|" + "---|" * len(COLUMNS),
    ]
    lines += ["| " + " | ".join(table_cells(row)) + " |" for row in rows]
    lines += compile_sweep_lines(compile_sweeps)
    return "\n".join(lines) + "\n"
