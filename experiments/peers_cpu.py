"""offremat against its peers on a CPU: step time, measured peak and gradients at three budgets.

For each model (the in-repo GPT and ResNet) and each budget (a fraction of keep-all's
predicted activation peak, ``solvers.registry.keep_all_peak``), this compares plain autograd
(keep-all), ``torch.utils.checkpoint.checkpoint_sequential`` with the fastest segment count
whose measured peak fits, ``torch.compile`` with ``activation_memory_budget`` swept, and
offremat's dp and milp plans.

Memory is measured the same way for every method: :class:`offremat.measure.StepMemory`, a
dispatch-mode tracker of the storages created during one untimed step, plus the input batch,
with the parameter gradients allocated beforehand. A second, independent measurement is the
process's resident-memory peak during one step, in separate memory workers (run with
``MALLOC_MMAP_THRESHOLD_=65536``; ``/proc/self/clear_refs`` resets VmHWM; peak = VmHWM - VmRSS
at the step start + the input batch). The tracker cannot see compiled code (dynamo skips
frames under a TorchDispatchMode), so torch.compile is chosen and judged by the
resident-memory peak alone. Gradients after one step (same seed) are compared with plain
autograd's bit for bit. Timing runs every configuration in its own fresh process (forkserver
with torch preloaded), alternating the order over ``--rounds`` rounds, and reports the median
step time divided by keep-all's median from the same rounds, and dp's time divided by
checkpoint_sequential's round by round. Each configuration is timed under two heaps: glibc's
default settings, which give large freed blocks back to the OS so that the next step
page-faults them in again, and a kept heap (``mallopt``: no trimming, no mmap below 1 GiB), as
jemalloc, tcmalloc or those settings give a CPU training job.

    cd <snapshot> && PYTHONPATH=<snapshot> python <repo>/experiments/peers_cpu.py --rounds 7 \
        --compile-models gpt resnet --out <repo>/experiments/results/peers_cpu
"""

from __future__ import annotations

import argparse
import csv
import ctypes
import logging
import multiprocessing as mp
import pickle
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger("peers_cpu")

FRACTIONS = (0.3, 0.5, 0.7)
COMPILE_BUDGETS = (1.0, 0.8, 0.6, 0.4, 0.2, 0.0)
MMAP_THRESHOLD = "65536"  # MALLOC_MMAP_THRESHOLD_ for every worker process
BANDWIDTH = 1.2e10
MILP_TIME_LIMIT_S = 20
SEED = 0
WARMUP_STEPS = 1
TIMED_STEPS = 4
HEAPS = ("glibc", "kept")  # glibc's default settings; freed memory kept in the heap
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from glibc's malloc.h
KEPT_HEAP_BYTES = 1 << 30
SUFFIX = {"glibc": "", "kept": "_kept"}  # of the row fields timed under each heap


def build(name: str) -> tuple[torch.nn.Sequential, Any]:
    """The model and its batch, the same in every process."""
    from offremat.models import (
        GPTConfig,
        ResNetConfig,
        build_gpt,
        build_resnet,
        gpt_batch,
        resnet_batch,
    )

    if name == "gpt":
        config = GPTConfig(layers=8, hidden=256, heads=4, seq=128, vocab=1024, dropout=0.0)
        return build_gpt(config, seed=SEED), gpt_batch(config, 8, seed=SEED)
    config = ResNetConfig(blocks=(2, 2, 2), width=16, image=32)
    return build_resnet(config, seed=SEED), resnet_batch(config, 32, seed=SEED)


MODEL_DESCRIPTIONS = {
    "gpt": "GPTConfig(layers=8, hidden=256, heads=4, seq=128, vocab=1024, dropout=0.0), batch 8",
    "resnet": "ResNetConfig(blocks=(2, 2, 2), width=16, image=32), batch 32",
}


def make_forward(model: torch.nn.Sequential, batch: Any, spec: dict[str, Any]) -> Any:
    """The callable whose ``fwd(batch).backward()`` is one training step of ``spec``."""
    kind = spec["kind"]
    if kind == "keep":
        return model
    if kind == "ckpt":
        from torch.utils.checkpoint import checkpoint_sequential

        segments = spec["segments"]
        return lambda b: checkpoint_sequential(model, segments, b, use_reentrant=False)
    if kind == "compile":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = spec["memory_budget"]
        return torch.compile(model)
    if kind == "offremat":
        import offremat
        from solvers.chain import Chain
        from solvers.plan import Plan

        return offremat.optimize(
            model,
            batch,
            budget=spec["budget_bytes"],
            chain=Chain.load(spec["chain"]),
            plan=Plan.load(spec["plan"]),
            bandwidth=spec.get("bandwidth"),
        )
    raise ValueError(kind)


def one_step(model: torch.nn.Module, fwd: Any, batch: Any) -> None:
    torch.manual_seed(SEED)
    loss = fwd(batch)
    loss.backward()


def zero_grads(model: torch.nn.Module) -> None:
    for p in model.parameters():
        if p.requires_grad:
            p.grad = torch.zeros_like(p)


def check_step(model: torch.nn.Module, fwd: Any, batch: Any) -> tuple[int, list[torch.Tensor]]:
    """Measured peak of one step (gradients pre-allocated), and the gradients of one step."""
    from offremat.measure import StepMemory

    zero_grads(model)
    torch.manual_seed(SEED)
    with StepMemory("cpu", batch) as memory:
        loss = fwd(batch)
        loss.backward()
    zero_grads(model)
    one_step(model, fwd, batch)
    grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
    return memory.peak_bytes, grads


def timed_steps(model: torch.nn.Module, fwd: Any, batch: Any, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        for p in model.parameters():
            p.grad = None
        start = time.perf_counter()
        one_step(model, fwd, batch)
        times.append(time.perf_counter() - start)
    return times


def compare(grads: list[torch.Tensor], reference: list[torch.Tensor]) -> str:
    if all(torch.equal(g, r) for g, r in zip(grads, reference, strict=True)):
        return "yes"
    diff = max((g - r).abs().max().item() for g, r in zip(grads, reference, strict=True))
    return f"no (max abs diff {diff:.3g})"


def calibrate_worker(name: str, specs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Untimed checks in one process: each spec's measured peak, gradients and a quick time."""
    torch.set_num_threads(1)
    model, batch = build(name)
    reference = None
    out: dict[str, dict[str, Any]] = {}
    for key, spec in specs.items():  # keep-all comes first
        fwd = make_forward(model, batch, spec)
        peak, grads = check_step(model, fwd, batch)
        if reference is None:
            reference = grads
        times = timed_steps(model, fwd, batch, WARMUP_STEPS + 2)[WARMUP_STEPS:]
        out[key] = {
            "peak": peak,
            "grads": compare(grads, reference),
            "quick_s": statistics.median(times),
        }
        logger.info("%s %s: peak %d B, quick %.4f s", name, key, peak, out[key]["quick_s"])
    return out


def _proc_status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(("VmRSS:", "VmHWM:")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


def rss_step(model: torch.nn.Module, fwd: Any, batch: Any) -> int:
    """Resident-memory peak of one step (gradients pre-allocated), plus the input batch."""
    from offremat.measure import storage_bytes, tree_leaf_tensors

    zero_grads(model)
    with open("/proc/self/clear_refs", "w") as handle:
        handle.write("5")  # VmHWM := VmRSS
    before = _proc_status()["VmRSS"]
    one_step(model, fwd, batch)
    return _proc_status()["VmHWM"] - before + storage_bytes(tree_leaf_tensors(batch))


def worker_environment() -> dict[str, Any]:
    import os

    import offremat

    return {
        "offremat": offremat.__file__,
        "MALLOC_MMAP_THRESHOLD_": os.environ.get("MALLOC_MMAP_THRESHOLD_"),
    }


def compile_worker(name: str, memory_budget: float) -> dict[str, Any]:
    """torch.compile at one activation_memory_budget: compile time, quick time, RSS peak, grads."""
    torch.set_num_threads(1)
    model, batch = build(name)
    try:
        zero_grads(model)
        one_step(model, model, batch)
        reference = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
        fwd = make_forward(model, batch, {"kind": "compile", "memory_budget": memory_budget})
        start = time.perf_counter()
        zero_grads(model)
        one_step(model, fwd, batch)  # compiles
        compile_s = time.perf_counter() - start
        grads = [p.grad.detach().clone() for p in model.parameters() if p.requires_grad]
        times = timed_steps(model, fwd, batch, WARMUP_STEPS + 2)[WARMUP_STEPS:]
        return {
            "rss": rss_step(model, fwd, batch),
            "compile_s": compile_s,
            "quick_s": statistics.median(times),
            "grads": compare(grads, reference),
            "error": None,
        }
    except Exception as error:  # recorded in the table, not raised
        return {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:160]}"}


def keep_heap() -> None:
    """Keep this process's freed memory in its heap: glibc trims nothing and mmaps no block
    below 1 GiB, so a step reuses the pages of the step before instead of faulting them in."""
    libc = ctypes.CDLL("libc.so.6")
    for parameter in (M_TRIM_THRESHOLD, M_MMAP_THRESHOLD):
        if libc.mallopt(parameter, KEPT_HEAP_BYTES) != 1:
            raise RuntimeError(f"mallopt({parameter}, {KEPT_HEAP_BYTES}) failed")


def time_worker(name: str, spec: dict[str, Any], heap: str) -> dict[str, Any]:
    """Median step time of ``spec`` in a fresh process, under ``heap`` (one of HEAPS).

    For torch.compile the first call (which compiles) is timed separately as compile time and
    is not one of the warm-up steps.
    """
    if heap == "kept":
        keep_heap()
    torch.set_num_threads(1)
    model, batch = build(name)
    fwd = make_forward(model, batch, spec)
    compile_s = None
    if spec["kind"] == "compile":
        start = time.perf_counter()
        one_step(model, fwd, batch)
        compile_s = time.perf_counter() - start
    times = timed_steps(model, fwd, batch, WARMUP_STEPS + TIMED_STEPS)[WARMUP_STEPS:]
    return {
        "seconds": statistics.median(times),
        "compile_s": compile_s,
        "heap": heap,
        **worker_environment(),
    }


def rss_worker(name: str, spec: dict[str, Any]) -> dict[str, Any]:
    """One RSS-measured step of ``spec`` after a warm-up, in a process that mmaps big blocks."""
    torch.set_num_threads(1)
    model, batch = build(name)
    fwd = make_forward(model, batch, spec)
    timed_steps(model, fwd, batch, WARMUP_STEPS + 1)
    return {"rss": rss_step(model, fwd, batch), **worker_environment()}


ENV_KEYS = ("offremat", "MALLOC_MMAP_THRESHOLD_")


def compile_row(
    base: dict[str, Any],
    results: dict[float, dict[str, Any]],
    timing: dict[tuple[str, str], dict[str, Any]],
    name: str,
) -> dict[str, Any]:
    """The fastest activation_memory_budget whose RSS peak fits, queued for timing."""
    ok = {b: r for b, r in results.items() if not r["error"]}
    if not ok:
        errors = sorted({r["error"] for r in results.values()})
        return {**base, "method": "torch.compile", "note": "compile raised: " + "; ".join(errors)}
    fitting = [b for b, r in ok.items() if r["rss"] <= base["budget_bytes"]]
    if not fitting:
        least = min(ok, key=lambda b: ok[b]["rss"])
        note = (
            f"no activation_memory_budget fits by RSS peak (least {ok[least]['rss']} B, at {least})"
        )
        return {**base, "method": "torch.compile", "note": note}
    best = min(fitting, key=lambda b: ok[b]["quick_s"])
    key = f"compile {best}"
    timing[name, key] = {"spec": {"kind": "compile", "memory_budget": best}, "results": {}}
    return {
        **base,
        "method": f"torch.compile (activation_memory_budget={best})",
        "key": key,
        "grads": ok[best]["grads"],
        "compile_cold_s": ok[best]["compile_s"],
    }


def run_in_fresh_process(pool: ProcessPoolExecutor, fn: Any, *args: Any) -> Any:
    return pool.submit(fn, *args).result()


def plan_model(name: str, workdir: Path) -> dict[str, Any]:
    """Profile once, compute the byte budgets, and solve dp and milp at each."""
    import offremat
    from offremat import InfeasibleBudgetError
    from solvers.registry import keep_all_peak

    model, batch = build(name)
    chain = offremat.profile_model(model, batch)
    chain_path = workdir / f"{name}.chain.json"
    chain.save(chain_path)
    predicted_keep = keep_all_peak(chain)
    budgets = {f: int(f * predicted_keep) for f in FRACTIONS}
    plans: dict[tuple[float, str], dict[str, Any]] = {}
    for fraction, budget_bytes in budgets.items():
        for solver, options in (
            ("dp", {}),
            ("milp", {"bandwidth": BANDWIDTH, "time_limit_s": MILP_TIME_LIMIT_S}),
        ):
            start = time.perf_counter()
            try:
                om = offremat.optimize(
                    model, batch, budget=budget_bytes, solver=solver, chain=chain, **options
                )
            except InfeasibleBudgetError as error:
                plans[fraction, solver] = {"infeasible": error.min_budget_bytes}
                logger.info("%s %s at %.0f%%: infeasible", name, solver, 100 * fraction)
                continue
            counts = Counter(str(getattr(d, "value", d)) for d in om.plan.decisions.values())
            plan_path = workdir / f"{name}.{solver}.{fraction}.plan.json"
            om.plan.save(plan_path)
            plans[fraction, solver] = {
                "spec": {
                    "kind": "offremat",
                    "chain": str(chain_path),
                    "plan": str(plan_path),
                    "budget_bytes": budget_bytes,
                    "bandwidth": options.get("bandwidth"),
                },
                "predicted_peak": om.plan.predicted_peak_bytes,
                "decisions": ", ".join(f"{k} {v}" for k, v in sorted(counts.items())),
                "solve_s": time.perf_counter() - start,
            }
            logger.info(
                "%s %s at %.0f%%: solved in %.1f s",
                name,
                solver,
                100 * fraction,
                plans[fraction, solver]["solve_s"],
            )
    return {"predicted_keep": predicted_keep, "budgets": budgets, "plans": plans, "n": len(model)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=7, help="timing rounds (at least 7)")
    parser.add_argument(
        "--rss-rounds", type=int, default=3, help="fresh processes per configuration for RSS"
    )
    parser.add_argument("--out", default="experiments/results/peers_cpu", help="path stem")
    parser.add_argument("--models", nargs="+", default=["gpt", "resnet"])
    parser.add_argument(
        "--compile-models",
        nargs="*",
        default=["gpt"],
        help="models for which torch.compile is swept and timed (compiling takes ~35 s each)",
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", datefmt="%H:%M:%S")
    torch.set_num_threads(1)
    started = time.perf_counter()
    import os

    import offremat

    # Timing workers fork from a forkserver started with glibc's default allocator settings, as
    # users run; the forkserver is started now, before the environment below is set.
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "offremat.models", "offremat.wrapper", "__main__"])
    pool = ProcessPoolExecutor(max_workers=1, mp_context=ctx, max_tasks_per_child=1)
    run_in_fresh_process(pool, worker_environment)
    # Memory workers are spawned (a fresh interpreter each) with every block of 64 KiB or more
    # its own mmap, so that freed memory leaves the resident set and VmHWM sees the true peak.
    os.environ["MALLOC_MMAP_THRESHOLD_"] = MMAP_THRESHOLD
    memory_pool = ProcessPoolExecutor(
        max_workers=1, mp_context=mp.get_context("spawn"), max_tasks_per_child=1
    )
    workdir = Path(tempfile.mkdtemp(prefix="peers_cpu_"))
    rows: list[dict[str, Any]] = []
    timing: dict[tuple[str, str], dict[str, Any]] = {}  # (model, config key) -> spec, times
    compile_sweeps: dict[str, dict[float, dict[str, Any]]] = {}

    for name in args.models:
        setup = plan_model(name, workdir)
        specs: dict[str, dict[str, Any]] = {"keep-all": {"kind": "keep"}}
        for segments in range(1, setup["n"] + 1):
            specs[f"ckpt {segments}"] = {"kind": "ckpt", "segments": segments}
        for (fraction, solver), plan in setup["plans"].items():
            if "spec" in plan:
                specs[f"offremat {solver} {fraction}"] = plan["spec"]
        checks = run_in_fresh_process(memory_pool, calibrate_worker, name, specs)

        compile_results: dict[float, dict[str, Any]] = {}
        if name in args.compile_models:
            for memory_budget in COMPILE_BUDGETS:
                result = run_in_fresh_process(memory_pool, compile_worker, name, memory_budget)
                compile_results[memory_budget] = result
                logger.info("%s compile at %.1f: %s", name, memory_budget, result)

        timing[name, "keep-all"] = {"spec": specs["keep-all"], "results": {}}
        model_rows = []
        for fraction, budget_bytes in setup["budgets"].items():
            base = {"model": name, "fraction": fraction, "budget_bytes": budget_bytes}
            model_rows.append({**base, "method": "keep-all", "key": "keep-all"})
            fitting = [
                k for k in specs if k.startswith("ckpt ") and checks[k]["peak"] <= budget_bytes
            ]
            if fitting:
                best = min(fitting, key=lambda k: checks[k]["quick_s"])
                timing[name, best] = {"spec": specs[best], "results": {}}
                segments = specs[best]["segments"]
                method = f"checkpoint_sequential (segments={segments})"
                model_rows.append({**base, "method": method, "key": best})
            else:
                least = min(checks[k]["peak"] for k in specs if k.startswith("ckpt "))
                model_rows.append(
                    {
                        **base,
                        "method": "checkpoint_sequential",
                        "note": f"no segment count fits (least measured peak {least} B)",
                    }
                )
            if name in args.compile_models:
                model_rows.append(compile_row(base, compile_results, timing, name))
            for solver in ("dp", "milp"):
                plan = setup["plans"][fraction, solver]
                if "infeasible" in plan:
                    model_rows.append(
                        {
                            **base,
                            "method": f"offremat {solver}",
                            "note": f"infeasible (least: {plan['infeasible']} B)",
                        }
                    )
                    continue
                key = f"offremat {solver} {fraction}"
                timing[name, key] = {"spec": specs[key], "results": {}}
                model_rows.append(
                    {
                        **base,
                        "method": f"offremat {solver} ({plan['decisions']})",
                        "key": key,
                        "offloads": "offload" in plan["decisions"],
                        "predicted_peak": plan["predicted_peak"],
                    }
                )
        for row in model_rows:
            if "key" in row and row["key"] in checks:
                row["peak"] = checks[row["key"]]["peak"]
                row["grads"] = checks[row["key"]]["grads"]
        compile_sweeps[name] = compile_results
        rows += model_rows

    keys = list(timing)
    runs = [(name, key, heap) for name, key in keys for heap in HEAPS]
    for r in range(args.rounds):
        order = runs[r % len(runs) :] + runs[: r % len(runs)]
        if r % 2:
            order.reverse()
        for name, key, heap in order:
            spec = timing[name, key]["spec"]
            result = run_in_fresh_process(pool, time_worker, name, spec, heap)
            results = timing[name, key]["results"].setdefault(heap, [])
            if r == 0 and not results:
                logger.info("worker environment: %s", {k: result[k] for k in ENV_KEYS})
            if result["offremat"] != offremat.__file__:  # the workers must measure the same code
                raise RuntimeError(f"worker imported {result['offremat']}, not {offremat.__file__}")
            results.append(result)
        logger.info("round %d/%d done (%.0f s so far)", r + 1, args.rounds, _since(started))
    pool.shutdown()
    for r in range(args.rss_rounds):
        for name, key in keys:
            result = run_in_fresh_process(memory_pool, rss_worker, name, timing[name, key]["spec"])
            if result["offremat"] != offremat.__file__:
                raise RuntimeError(f"worker imported {result['offremat']}, not {offremat.__file__}")
            timing[name, key].setdefault("rss", []).append(result)
        logger.info("RSS round %d/%d done (%.0f s so far)", r + 1, args.rss_rounds, _since(started))
    memory_pool.shutdown()

    environments = {
        tuple(result[k] for k in ENV_KEYS)
        for entry in timing.values()
        for result in [*entry["rss"], *(r for rs in entry["results"].values() for r in rs)]
    }
    for row in rows:
        if "key" not in row:
            continue
        for heap in HEAPS:
            results = timing[row["model"], row["key"]]["results"][heap]
            keep_results = timing[row["model"], "keep-all"]["results"][heap]
            keep = statistics.median(r["seconds"] for r in keep_results)
            median = statistics.median(r["seconds"] for r in results)
            suffix = SUFFIX[heap]
            row["median_s" + suffix] = median
            row["keep_median_s" + suffix] = keep
            row["time_ratio" + suffix] = median / keep
            row["per_round" + suffix] = [r["seconds"] for r in results]
        row["rss"] = int(
            statistics.median(r["rss"] for r in timing[row["model"], row["key"]]["rss"])
        )
        row["rss_ratio"] = row["rss"] / row["budget_bytes"]
        row["rss_fits"] = "yes" if row["rss"] <= row["budget_bytes"] else "no"
        if row["key"].startswith("compile"):
            row["compile_s"] = statistics.median(
                r["compile_s"] for r in timing[row["model"], row["key"]]["results"]["glibc"]
            )
            continue
        row["peak_ratio"] = row["peak"] / row["budget_bytes"]
        row["fits"] = "yes" if row["peak"] <= row["budget_bytes"] else "no"
    runtime = _since(started)
    with (workdir / "results.pkl").open("wb") as handle:  # to rewrite the tables if needed
        pickle.dump((rows, timing, compile_sweeps, runtime), handle)
    logger.info("raw results in %s", workdir / "results.pkl")
    write_outputs(rows, Path(args.out), args, runtime, environments, compile_sweeps)
    logger.info("total runtime %.0f s", runtime)


def _since(start: float) -> float:
    return time.perf_counter() - start


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
            + " (offloaded host copies live in the same RAM on CPU; RSS also counts allocator "
            "slack)."
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
        "tracker of the live storages created during one untimed training step, plus the input "
        "batch; parameter gradients are pre-allocated (`p.grad = torch.zeros_like(p)`) so they "
        "are not counted. This is the library's definition of the peak; fits (tracker) means "
        "tracker peak <= budget bytes. It cannot see compiled code: dynamo skips frames under "
        "a TorchDispatchMode, so it is not given for torch.compile.",
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
        "tracker), and RSS sees everything (allocator slack, whole pages, small allocations "
        "below the threshold), so it reads a bit above the tracker.",
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


if __name__ == "__main__":
    main()
