"""``OFFREMAT_TEST_DEVICE=cuda`` runs the CPU suite on a GPU: tensors and modules that a test
creates without naming a device land there (``torch.set_default_device``). Tests that name
the CPU, or assert CPU-only facts (the dispatch-mode tracker, bitwise CPU kernels), may then
fail for that reason alone; read such failures before counting them against the executor.

The suite runs in parallel (pytest-xdist, ``-n auto`` in pyproject.toml), one worker per
core, each with its share of the cores for torch's threads, and for the processes its tests
start (workers that each took every core would spin against each other); serially where a
GPU is present, whose tests measure the device's memory and timing, which workers would
share."""

import os

import torch


def _cores() -> int:
    """The cores this process may run on."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


_WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
if _WORKERS > 1:
    _SHARE = max(1, _cores() // _WORKERS)
    torch.set_num_threads(_SHARE)
    os.environ["OMP_NUM_THREADS"] = str(_SHARE)  # the processes that tests start, too

_DEVICE = os.environ.get("OFFREMAT_TEST_DEVICE")
if _DEVICE:
    torch.set_default_device(_DEVICE)


def pytest_xdist_auto_num_workers(config: object) -> int:
    """``-n auto``: a worker per core on CPU-only machines; none on one core or beside a GPU."""
    cores = _cores()
    return 0 if cores < 2 or torch.cuda.is_available() else cores
