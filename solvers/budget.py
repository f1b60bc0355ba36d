"""Budgets: parsing the ways a user writes one, and the error for one that is too small."""

from __future__ import annotations

import re


class InfeasibleBudgetError(ValueError):
    """No plan fits in the budget; ``min_budget_bytes`` is the least budget that has one."""

    def __init__(self, budget_bytes: int, min_budget_bytes: int, solver: str):
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.solver = solver
        super().__init__(
            f"no {solver} plan fits in {format_bytes(budget_bytes)} ({budget_bytes} B); "
            f"the least feasible budget is {format_bytes(min_budget_bytes)} "
            f"({min_budget_bytes} B): raise the budget to at least that"
        )


_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([a-zA-Z]*)\s*$")


def parse_budget(value: int | float | str, keep_all_peak_bytes: int | None = None) -> int:
    """Bytes from an int, a size string (``6GiB``, ``512MB``), or a fraction in (0, 1].

    A fraction is taken of ``keep_all_peak_bytes``, the peak of plain autograd.
    """
    if isinstance(value, bool):
        raise ValueError(f"budget {value!r} is not a size")
    if isinstance(value, str):
        match = _SIZE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"budget {value!r} is not a size: write bytes (6442450944), a size with a unit "
                "(6GiB, 512MB) or a fraction of the keep-all peak in (0, 1] (0.25)"
            )
        text, unit = match.group(1), match.group(2).lower()
        if unit:
            return _positive(int(float(text) * _UNITS[unit]), value)
        value = int(text) if text.isdigit() else float(text)
    if isinstance(value, float) and value <= 1:
        if value <= 0:
            raise ValueError(
                f"budget fraction {value} is outside (0, 1]: give a fraction of the keep-all "
                "peak above 0, or a size"
            )
        if keep_all_peak_bytes is None:
            raise ValueError(
                f"budget {value} is a fraction of the keep-all peak, which is not known here: "
                "give a size in bytes instead"
            )
        return _positive(int(value * keep_all_peak_bytes), value)
    return _positive(int(value), value)


def _positive(budget_bytes: int, written: int | float | str) -> int:
    if budget_bytes <= 0:
        raise ValueError(f"budget {written!r} is {budget_bytes} bytes; a budget must be positive")
    return budget_bytes


def byte_unit(count: float) -> tuple[int, str]:
    """The largest binary unit not above ``count``, as (bytes per unit, name): (2**30, "GiB")."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= scale:
            return scale, unit
    return 1, "B"


def format_bytes(count: float) -> str:
    """A size in binary units, for people: 1.50 GiB."""
    scale, unit = byte_unit(count)
    return f"{int(count)} B" if scale == 1 else f"{count / scale:.2f} {unit}"
