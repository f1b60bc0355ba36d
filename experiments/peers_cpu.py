"""offremat against its peers on a CPU: step time, measured peak and gradients at three budgets.

For each model (the in-repo GPT and ResNet) and each budget (a fraction of keep-all's
predicted activation peak, ``solvers.registry.keep_all_peak``), this compares plain autograd
(keep-all), ``torch.utils.checkpoint.checkpoint_sequential`` with the fastest segment count
whose measured peak fits, ``torch.compile`` with ``activation_memory_budget`` swept, and
offremat's dp and milp plans.

Memory is measured the same way for every method: :class:`offremat.measure.StepMemory`, a
dispatch-mode tracker of the storages created during one untimed step joined with the CPU
allocator's reports of what kernels allocate inside themselves, plus the input batch, with the
parameter gradients allocated beforehand. A second, independent measurement is the
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
import logging
import multiprocessing as mp
import pickle
import statistics
import tempfile
import time
from collections import Counter
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import torch
from peers_report import write_outputs
from peers_setup import (
    BANDWIDTH,
    COMPILE_BUDGETS,
    FRACTIONS,
    HEAPS,
    MILP_TIME_LIMIT_S,
    MMAP_THRESHOLD,
    SUFFIX,
    build,
)
from peers_workers import (
    ENV_KEYS,
    calibrate_worker,
    compile_worker,
    rss_worker,
    time_worker,
    worker_environment,
)

logger = logging.getLogger("peers_cpu")


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
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
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
    ctx.set_forkserver_preload(["torch", "offremat.models", "offremat.wrapper", "peers_workers"])
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


if __name__ == "__main__":
    main()
