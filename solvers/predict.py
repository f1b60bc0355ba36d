"""A chain for an input size nobody profiled, fitted from chains profiled at other sizes.

Mimose (Liao et al. 2022) predicts each layer's memory from the input size with a small
regression, fitted online from the sizes already seen. Here every per-stage figure of the
cost model (times, and the bytes of outputs, saved sets, gradients and temporaries) and the
chain-wide ones are fitted as a polynomial in one size ``n`` (a batch size or a sequence
length): activation bytes are such a polynomial of degree at most two (linear layers scale
with n, attention scores with n²), and times nearly so.

From two profiled sizes the fit is a line, used only between them: exact for a figure linear
in n, and for a convex quadratic (n² with a positive coefficient) the chord lies above the
curve there, so bytes are never underestimated. From three sizes or more it is a quadratic,
used between them and up to :data:`REACH` of their span above the largest (never below the
smallest: there fixed per-operation costs, which no quadratic in n captures, dominate the
time). Anything else is left to a real profile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from solvers.chain import STAGE_BYTE_FIELDS, Chain, Stage

MIN_POINTS = 2
"""Profiled sizes needed before predicting between them: two points determine a line."""

REACH = 0.25
"""How far beyond the profiled sizes a quadratic fit (three sizes or more) predicts, as a
fraction of their span: a quadratic through three exact points of a quadratic is exact
everywhere, but a figure that changes regime (another kernel chosen above some size) is not
one, so the prediction stays near what was measured."""

_CHAIN_BYTES = ("input_bytes", "input_grad_bytes", "held_bytes")


def predict_chain(profiled: Sequence[tuple[float, Chain]], size: float) -> Chain | None:
    """The chain at ``size`` fitted from ``(size, chain)`` pairs, or None when unsure.

    Unsure: fewer than :data:`MIN_POINTS` distinct sizes, ``size`` below them, above them
    (two sizes) or more than :data:`REACH` of their span above them (three or more), or
    chains whose stages differ.
    """
    sizes = sorted({float(n) for n, _ in profiled})
    if len(sizes) < MIN_POINTS:
        return None
    reach = REACH * (sizes[-1] - sizes[0]) if len(sizes) > MIN_POINTS else 0.0
    if not sizes[0] <= size <= sizes[-1] + reach:
        return None
    chains = [chain for _, chain in profiled]
    names = chains[0].stage_names
    if any(chain.stage_names != names for chain in chains):
        return None
    xs = np.array([float(n) for n, _ in profiled])
    degree = min(2, len(sizes) - 1)

    def fitted(values: Sequence[float]) -> float:
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
            value = fitted([v or 0 for v in values])
            # A backward's temporaries alone can be negative (solvers.chain.Stage).
            figures[field] = math.ceil(value - 1e-6) if field == "bwd_tmp_bytes" else _bytes(value)
        figures["saved_bytes"] = max(figures["saved_bytes"], figures["out_bytes"])
        figures["bwd_tmp_bytes"] = max(figures["bwd_tmp_bytes"], -figures["saved_bytes"])
        stages.append(Stage(name=name, **figures))  # type: ignore[arg-type]
    chain_figures = {
        field: _bytes(fitted([getattr(chain, field) for chain in chains])) for field in _CHAIN_BYTES
    }
    metadata = {**chains[0].metadata, "predicted_from": sizes, "size": size}
    return dataclasses.replace(chains[0], stages=tuple(stages), metadata=metadata, **chain_figures)


def _bytes(value: float) -> int:
    """Bytes rounded up (a fit of exact sizes is off by rounding only), never negative."""
    return max(math.ceil(value - 1e-6), 0)
