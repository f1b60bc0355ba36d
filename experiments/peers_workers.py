"""What runs inside one fresh process of ``peers_cpu.py``: a step of one method, timed,
measured by the dispatch-mode tracker, or by the resident-memory peak.

A method is a ``spec``, a picklable dict (``kind``: keep, ckpt, compile or offremat), so that
the parent can send it to a worker that builds the model afresh.
"""

from __future__ import annotations

import ctypes
import logging
import statistics
import time
from typing import Any

import torch
from peers_setup import KEPT_HEAP_BYTES, SEED, TIMED_STEPS, WARMUP_STEPS, build

logger = logging.getLogger("peers_cpu")

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt's parameters, from glibc's malloc.h


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
