"""The CUDA executor checked on a GPU: gradients and peaks of every plan against plain
autograd and the allocator, a stage that only doubles its input, a memory snapshot of an
offload-all step, the copies' overlap with compute on a profiler timeline, and the link probe
against plain 1 GiB copies.

Usage (needs a CUDA GPU; without one it says so and exits 2):
    python experiments/gpu_check.py [--out experiments/results/gpu] [--only CHECK ...]

Each check runs in its own process, since a device fault ends the CUDA context; the equality
check runs twice, under ``torch.use_deterministic_algorithms(True)`` (with
``CUBLAS_WORKSPACE_CONFIG=:4096:8``) and without. Writes ``gpu_check.json`` and
``gpu_check.md`` (device, versions, command, date and one table per check), the timeline
``overlap_timeline.png`` and the snapshot ``offload_all_snapshot.pickle`` in ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import torch

CHECKS = ("equality-deterministic", "equality-default", "double", "snapshot", "overlap", "link")
CHECK_TIMEOUT_S = 300


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(Path(__file__).parent / "results" / "gpu"))
    parser.add_argument("--only", nargs="+", choices=CHECKS, default=list(CHECKS))
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA device here, so there is nothing to check; run it on a machine "
            "with an NVIDIA GPU (it writes no result without one)",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.child:
        from gpu_check_parts import run_check

        (name,) = args.only
        result = run_check(name, out)
        (out / f"part-{name}.json").write_text(json.dumps(result, indent=1, default=str))
        return 0
    results = {}
    for name in args.only:
        results[name] = _run_child(name, out)
    report = {
        "date": f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M UTC}",
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "command": f"python {' '.join(shlex.quote(a) for a in sys.argv)}",
        "checks": results,
    }
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1, default=str))
    from gpu_check_parts import render

    (out / "gpu_check.md").write_text(render(report))
    print((out / "gpu_check.md").read_text())
    return 0


def _run_child(name: str, out: Path) -> dict:
    """Run one check in a fresh process; its result, or how it failed."""
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if name == "equality-deterministic":
        env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(__file__).parent), str(Path(__file__).parent.parent), env.get("PYTHONPATH", "")]
    )
    command = [sys.executable, __file__, "--child", "--only", name, "--out", str(out)]
    started = time.perf_counter()
    try:
        done = subprocess.run(
            command, env=env, timeout=CHECK_TIMEOUT_S, text=True, capture_output=True
        )
    except subprocess.TimeoutExpired:
        return {"status": f"timed out after {CHECK_TIMEOUT_S} s"}
    print(f"== {name}: exit {done.returncode} in {time.perf_counter() - started:.0f} s")
    print(done.stdout[-4000:], done.stderr[-4000:], sep="\n")
    part = out / f"part-{name}.json"
    if done.returncode != 0 or not part.exists():
        return {"status": f"exit {done.returncode}", "stderr": done.stderr[-3000:]}
    result = json.loads(part.read_text())
    part.unlink()
    return {"status": "ok", **result}


if __name__ == "__main__":
    raise SystemExit(main())
