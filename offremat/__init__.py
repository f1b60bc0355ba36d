"""offremat: keep, offload or recompute each activation to train within a GPU memory budget.

The public API is :func:`optimize`; the names below load on first use, so that importing
``offremat`` (and its command line) does not import torch until it is needed.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "optimize": "offremat.wrapper",
    "OptimizedModule": "offremat.wrapper",
    "profile_model": "offremat.profiler",
    "parse_bandwidth": "offremat.profiler",
    "PlanExecutor": "offremat.executor",
    "StepStats": "offremat.executor",
    "NotAChainError": "offremat._blocks",
    "UnreplayableRandomnessError": "offremat._rng",
    "Chain": "solvers.chain",
    "Plan": "solvers.plan",
    "InfeasibleBudgetError": "solvers.budget",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'offremat' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
