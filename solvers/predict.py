"""A chain for an input size nobody profiled, fitted from chains profiled at other sizes.

Mimose (Liao et al. 2022) predicts each layer's memory from the input size with a small
regression, fitted online from the sizes already seen. Here every per-stage figure of the
cost model (times, and the bytes of outputs, saved sets, gradients and temporaries) and the
chain-wide ones are fitted as a polynomial of degree at most two in one size ``n`` (a batch
size or a sequence length): activation bytes are exactly such a polynomial (linear layers
scale with n, attention scores with n²), and times nearly so. A prediction is made only
between the smallest and the largest profiled size, from three profiled sizes or more;
anything else is left to a real profile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from solvers.chain import STAGE_BYTE_FIELDS, Chain, Stage

MIN_POINTS = 3
"""Profiled sizes needed before predicting: three points determine a quadratic."""

_CHAIN_BYTES = ("input_bytes", "input_grad_bytes", "held_bytes")


def predict_chain(profiled: Sequence[tuple[float, Chain]], size: float) -> Chain | None:
    """The chain at ``size`` fitted from ``(size, chain)`` pairs, or None when unsure.

    Unsure: fewer than :data:`MIN_POINTS` distinct sizes, ``size`` outside their range, or
    chains whose stages differ.
    """
    sizes = sorted({float(n) for n, _ in profiled})
    if len(sizes) < MIN_POINTS or not sizes[0] <= size <= sizes[-1]:
        return None
    chains = [chain for _, chain in profiled]
    names = chains[0].stage_names
    if any(chain.stage_names != names for chain in chains):
        return None
    xs = np.array([float(n) for n, _ in profiled])

    def fitted(values: Sequence[float]) -> float:
        degree = min(2, len(set(xs.tolist())) - 1)
        coefficients = np.polyfit(xs, np.array(values, dtype=float), degree)
        return float(np.polyval(coefficients, size))

    stages = []
    for k, name in enumerate(names):
        column = [chain.stages[k] for chain in chains]
        figures: dict[str, float | int] = {
            field: max(fitted([getattr(s, field) for s in column]), 1e-9)
            for field in ("fwd_s", "bwd_s")
        }
        for field in STAGE_BYTE_FIELDS:
            values = [getattr(s, field) for s in column]
            if all(v is None for v in values):
                continue
            figures[field] = _bytes(fitted([v or 0 for v in values]))
        figures["saved_bytes"] = max(figures["saved_bytes"], figures["out_bytes"])
        stages.append(Stage(name=name, **figures))  # type: ignore[arg-type]
    chain_figures = {
        field: _bytes(fitted([getattr(chain, field) for chain in chains])) for field in _CHAIN_BYTES
    }
    metadata = {**chains[0].metadata, "predicted_from": sizes, "size": size}
    return dataclasses.replace(chains[0], stages=tuple(stages), metadata=metadata, **chain_figures)


def _bytes(value: float) -> int:
    """Bytes rounded up (a fit of exact sizes is off by rounding only), never negative."""
    return max(math.ceil(value - 1e-6), 0)
