"""A chain for an input size nobody profiled, fitted from chains profiled at other sizes.

Mimose (Liao et al. 2022) predicts each layer's memory from the input size with a small
regression, fitted online from the sizes already seen. Here every per-stage figure of the
cost model (times, and the bytes of outputs, saved sets, gradients and temporaries) and the
chain-wide ones are predicted from their values at other values of one size ``n`` (a batch
size or a sequence length). Activation bytes are most often a polynomial of degree at most two
(linear layers scale with n, attention scores with n²), but not always, and times nearly so,
``c + a·n + b·n²`` with fixed per-operation costs ``c``, linear work ``a·n`` and quadratic
work ``b·n²``, none negative.

Bytes are held to a stricter rule than times: a time predicted too low makes a plan slower
than predicted, a byte figure predicted too low breaks the budget. Between two profiled sizes
a byte figure is the chord of its two nearest profiled values: exact for a figure linear in
n, and above the curve for any convex one (a polynomial of any degree with no negative
coefficient: attention scores grow as n², triangle attention's as n³), so bytes are never
underestimated there. A figure that bends down (attention materialised over a sliding window
of w positions saves n·min(n, w): its growth slows at w) lies above its chord near the bend.
Where the profiled sizes show such a bend no shape is predicted; sizes that straddle none
cannot show it, and a shape between two sizes on either side of the bend is underestimated
(by 10% at 64 from 48 and 80 for w = 64). A quadratic fit is exact for bytes only when they
are a quadratic, which three sizes cannot tell from a cubic (through three points of n³ a
quadratic comes out 24% low between them), so the quadratic is used for bytes only where four
sizes or more show it: its fit reproduces every profiled figure. Outside the profiled sizes
no chord bounds a figure, and a shape there is predicted only on that evidence.

Times: from two profiled sizes, used only between them, the chord over-estimates
``c + a·n + b·n²`` by ``b·(n - n1)(n2 - n)`` (4-11% at length 192 from 64 and 256 on the
in-repo GPT), and two points leave one of its three coefficients free, so a time is the lower
of two fits that each bound it from above there: the chord (``b ≥ 0``) and ``a·n + b·n²``
through the origin (``c ≥ 0``, over by ``c·(n - n1)(n2 - n) / (n1·n2)``). The lower is at
most :data:`TIME_ERROR` above the truth for every such time, or the shape is profiled
instead: sizes far apart, where the curvature can hide. From three sizes or more a time is a
quadratic, used between them and up to :data:`REACH` of their span beyond them on either side
(where the bytes allow it): its constant term is the fixed per-operation cost that dominates
small sizes, and three exact points of a quadratic fix it everywhere. Anything else is left to
a real profile.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import numpy as np

from solvers.chain import Chain, Stage
from solvers.chain_limits import STAGE_BYTE_FIELDS

MIN_POINTS = 2
"""Profiled sizes needed before predicting between them: two points determine a line."""

QUADRATIC_EVIDENCE = 4
"""Profiled sizes needed before byte figures are taken for quadratics: one more than a
quadratic's coefficients, so that the fit can be wrong."""

REACH = 0.25
"""How far beyond the profiled sizes, below the smallest or above the largest, a quadratic fit
(of times, and of bytes that :data:`QUADRATIC_EVIDENCE` sizes show quadratics) predicts, as a
fraction of their span: a quadratic through three exact
points of a quadratic is exact everywhere, but a figure that changes regime (another kernel
chosen above or below some size) is not one, so the prediction stays near what was
measured."""

TIME_ERROR = 0.1
"""The most a two-point time prediction may be above the truth, as a fraction of it: for every
``c + a·n + b·n²`` with no negative coefficient, the lower of the chord and the origin fit is
at most ``(n - n1)(n2 - n) / (n1·n2 + n²)`` above it (attained where ``a = 0`` and
``b·n1·n2 = c``), which depends on the sizes only, so whether a shape is predicted never
depends on timing noise. 10% is the accuracy the predictor is held to; length 128 from 96
and 256 is at it exactly, 192 from 64 and 256 at 15%."""

_TIME_FIELDS = ("fwd_s", "bwd_s", "refill_s")
_CHAIN_BYTES = ("input_bytes", "input_grad_bytes", "held_bytes")


def predict_chain(profiled: Sequence[tuple[float, Chain]], size: float) -> Chain | None:
    """The chain at ``size`` fitted from ``(size, chain)`` pairs, or None when unsure.

    Unsure: fewer than :data:`MIN_POINTS` distinct sizes; ``size`` outside them, unless
    :data:`QUADRATIC_EVIDENCE` sizes show the bytes quadratics, and then more than :data:`REACH`
    of their span beyond them; two sizes too far apart for :data:`TIME_ERROR` at ``size``; or
    chains whose stages differ.
    """
    sizes = sorted({float(n) for n, _ in profiled})
    if len(sizes) < MIN_POINTS:
        return None
    reach = REACH * (sizes[-1] - sizes[0]) if len(sizes) > MIN_POINTS else 0.0
    if not sizes[0] - reach <= size <= sizes[-1] + reach:
        return None
    if len(sizes) == MIN_POINTS and _two_point_error(*sizes, size) > TIME_ERROR:
        return None
    chains = [chain for _, chain in profiled]
    names = chains[0].stage_names
    if any(chain.stage_names != names for chain in chains):
        return None
    xs = np.array([float(n) for n, _ in profiled])
    times = np.array(
        [[getattr(s, field) for s in chain.stages for field in _TIME_FIELDS] for chain in chains]
    )
    if len(sizes) == MIN_POINTS:
        # Each at most the chord and at most a·n + b·n² through the origin (module notes).
        time_values = np.minimum(_fit(xs, times, size, (0, 1)), _fit(xs, times, size, (1, 2)))
    else:
        time_values = _fit(xs, times, size, (0, 1, 2))
    # All byte figures in one least-squares solve: a new shape is planned inside a step.
    columns = [
        [getattr(s, field) or 0 for s in chain.stages for field in STAGE_BYTE_FIELDS]
        + [getattr(chain, field) for field in _CHAIN_BYTES]
        for chain in chains
    ]
    measured = np.array(columns, dtype=float)
    if _quadratic(xs, measured):
        byte_values = _fit(xs, measured, size, range(3))
        if not _not_below_neighbours(xs, measured, size, byte_values):
            return None
    elif sizes[0] <= size <= sizes[-1] and not _bent_down(xs, measured):
        byte_values = _chord(xs, measured, size)
    else:
        return None
    stages = []
    for k, name in enumerate(names):
        figures: dict[str, float | int] = {
            field: max(float(time_values[len(_TIME_FIELDS) * k + j]), 1e-9)
            for j, field in enumerate(_TIME_FIELDS)
        }
        # Fitted apart, a refill could come out slower than the whole forward it is part of.
        figures["refill_s"] = min(figures["refill_s"], figures["fwd_s"])
        for j, field in enumerate(STAGE_BYTE_FIELDS):
            if all(getattr(chain.stages[k], field) is None for chain in chains):
                continue
            value = byte_values[k * len(STAGE_BYTE_FIELDS) + j]
            # A backward's temporaries alone can be negative (solvers.chain.Stage).
            figures[field] = math.ceil(value - 1e-6) if field == "bwd_tmp_bytes" else _bytes(value)
        figures["saved_bytes"] = max(figures["saved_bytes"], figures["out_bytes"])
        figures["bwd_tmp_bytes"] = max(figures["bwd_tmp_bytes"], -figures["saved_bytes"])
        stages.append(Stage(name=name, **figures))  # type: ignore[arg-type]
    chain_figures = {
        field: _bytes(byte_values[len(names) * len(STAGE_BYTE_FIELDS) + j])
        for j, field in enumerate(_CHAIN_BYTES)
    }
    metadata = {**chains[0].metadata, "predicted_from": sizes, "size": size}
    return dataclasses.replace(chains[0], stages=tuple(stages), metadata=metadata, **chain_figures)


def _fit(xs: np.ndarray, values: np.ndarray, size: float, powers: Sequence[int]) -> np.ndarray:
    """Each column of ``values`` (one row per size in ``xs``) fitted by least squares as a sum
    of the given powers of the size, at ``size``."""
    scale = float(xs.max())  # sizes near 1: a well-conditioned basis
    basis = np.stack([(xs / scale) ** p for p in powers], axis=1)
    coefficients = np.linalg.lstsq(basis, values, rcond=None)[0]
    return np.array([(size / scale) ** p for p in powers]) @ coefficients


def _quadratic(xs: np.ndarray, measured: np.ndarray) -> bool:
    """Whether :data:`QUADRATIC_EVIDENCE` sizes or more show every byte figure a quadratic in
    the size: the least-squares quadratic through them gives back each profiled value (to a
    byte, or a millionth of the figure's largest value)."""
    if len(set(xs.tolist())) < QUADRATIC_EVIDENCE:
        return False
    fitted = np.stack([_fit(xs, measured, float(x), range(3)) for x in xs])
    tolerance = 1.0 + 1e-6 * np.abs(measured).max(axis=0)
    return bool(np.all(np.abs(fitted - measured) <= tolerance))


def _chord(xs: np.ndarray, measured: np.ndarray, size: float) -> np.ndarray:
    """Each column of ``measured`` on the line between its values at the profiled sizes
    nearest ``size`` on either side (the larger value where a size was profiled twice)."""
    sizes, highest = _highest_per_size(xs, measured)
    upper = min(int(np.searchsorted(sizes, size)), len(sizes) - 1)
    lower = max(upper - 1, 0)
    if sizes[upper] == size or upper == lower:
        return highest[upper]
    weight = (size - sizes[lower]) / (sizes[upper] - sizes[lower])
    return (1 - weight) * highest[lower] + weight * highest[upper]


BEND_BYTES = 16 * 512
"""How far above its neighbours' chord a figure may lie, beside :data:`BEND_FRACTION`, and
not be taken for bent: on a GPU every tensor's bytes are rounded up to the allocator's 512,
and a sum of rounded sizes linear in n lies up to 512 bytes a tensor above its chords."""

BEND_FRACTION = 0.01
"""The relative part of that allowance (a sliding window's bend lies 5-10% above)."""


def _highest_per_size(xs: np.ndarray, measured: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The distinct profiled sizes, in order, and each figure's largest value at each (a size
    profiled twice keeps the larger)."""
    sizes = np.unique(xs)
    return sizes, np.stack([measured[xs == x].max(axis=0) for x in sizes])


def _bent_down(xs: np.ndarray, measured: np.ndarray) -> bool:
    """Whether some byte figure lies above the chord of its neighbours at a profiled size:
    a figure that grows more slowly past some size (attention over a sliding window, whose
    band stops widening at the window) is concave there, and its chord lies below it. Then
    no chord is trusted for that model and every new shape is profiled. Two sizes, or more
    that straddle no such bend, cannot show one (see the module notes)."""
    sizes, highest = _highest_per_size(xs, measured)
    for k in range(1, len(sizes) - 1):
        weight = (sizes[k] - sizes[k - 1]) / (sizes[k + 1] - sizes[k - 1])
        chord = (1 - weight) * highest[k - 1] + weight * highest[k + 1]
        if np.any(highest[k] > chord + BEND_BYTES + BEND_FRACTION * np.abs(chord)):
            return True
    return False


def _not_below_neighbours(
    xs: np.ndarray, measured: np.ndarray, size: float, predicted: np.ndarray
) -> bool:
    """Whether no predicted byte figure that grows with the size across the profiled ones
    falls below its value at the nearest profiled size under ``size``, as no
    ``c + a·n + b·n²`` with non-negative coefficients does. A fit that dips there is of a
    figure growing faster than the quadratic (an image's area squared) and would undercount:
    the shape is profiled instead."""
    order = np.argsort(xs)
    growing = np.all(np.diff(measured[order], axis=0) >= 0, axis=0)
    below = xs <= size
    if not below.any():
        return True
    low = measured[below][np.argmax(xs[below])]
    return not np.any(growing & (predicted < low - 1.0))  # 1 byte: a fit of exact sizes rounds


def _two_point_error(low: float, high: float, size: float) -> float:
    """The most a two-point time prediction at ``size`` can be above the truth, as a fraction
    of it (:data:`TIME_ERROR`)."""
    return (size - low) * (high - size) / (low * high + size * size)


def _bytes(value: float) -> int:
    """Bytes rounded up (a fit of exact sizes is off by rounding only), never negative."""
    return max(math.ceil(value - 1e-6), 0)
