"""Budgets and link rates: parsing the ways a user writes them, and the error for a budget that
is too small. One parser each, for every command and the API."""

from __future__ import annotations

import math
import numbers
import re
from fractions import Fraction
from typing import Any

from solvers.chain import Link
from solvers.chain_limits import (
    FASTEST_LINK_BYTES_PER_S,
    LARGEST_BYTES,
    SLOWEST_LINK_BYTES_PER_S,
    shown_number,
)


class InfeasibleBudgetError(ValueError):
    """No plan fits in the budget; ``min_budget_bytes`` is the least budget that has one, or
    with ``exact`` False (a greedy solver, not monotone in the budget) one that has one."""

    def __init__(
        self,
        budget_bytes: int,
        min_budget_bytes: int,
        solver: str,
        shape: str | None = None,
        exact: bool = True,
        cause: str | None = None,
    ):
        self.budget_bytes = budget_bytes
        self.min_budget_bytes = min_budget_bytes
        self.solver = solver
        self.shape = shape
        self.exact = exact
        self.cause = cause
        where = "" if shape is None else f" for input {shape}"
        if cause is not None:
            where += f" now that {cause}"
        named = _both(min_budget_bytes, round_up=True)
        advice = (
            f"the least feasible budget is {named}: raise the budget to at least that"
            if exact
            else f"it has a plan at {named}, and its greedy choices are not monotone in the "
            "budget (a smaller one may have a plan too, a larger one not): use that budget"
        )
        super().__init__(f"no {solver} plan fits in {_both(budget_bytes)}{where}; " + advice)

    def __reduce__(self) -> tuple[Any, ...]:
        # Rebuilt from its fields, which args (the message alone) does not hold.
        fields = (
            self.budget_bytes,
            self.min_budget_bytes,
            self.solver,
            self.shape,
            self.exact,
            self.cause,
        )
        return type(self), fields


class BitsUnitError(ValueError):
    """A size or rate written in bits (``25Gb/s``), where offremat counts bytes."""

    def __init__(self, written: str, unit: str, what: str = ""):
        self.unit = unit
        super().__init__(
            f"{what}{written!r} reads as bits ({unit}, a lower-case b after a prefix): "
            f"offremat counts bytes, so write {unit[:-1]}B for bytes, or divide by 8"
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
# "25Gb/s", "512Mb": an upper-case prefix then a lower-case b is how bits are written.
_BITS = re.compile(r"^[KMGT]i?b$")


SMALLEST_BYTE_COUNT = 16
"""A bare number from here up is bytes; 1 or less is a fraction; anything between is refused."""

SMALLEST_ROUNDED_BYTES = 2**10
"""From here up, a size in a unit above bytes that is not whole bytes (3.11GiB, as a least
feasible budget is shown) is rounded down to whole bytes, which lets in the same plans, since
a peak is whole bytes; below it the fraction is a large part of the size, and is refused."""


def parse_budget(value: int | float | str, keep_all_peak_bytes: int | None = None) -> int:
    """Bytes from a byte count, a size string (``6GiB``, ``512MB``), or a fraction in (0, 1].

    The rule a person can predict: a number in (0, 1] (``1``, ``1.0``, ``0.3``) is a fraction
    of ``keep_all_peak_bytes``, the peak of plain autograd; a byte count is a whole number of
    at least :data:`SMALLEST_BYTE_COUNT` or takes a unit (``12B``). Part of a byte is refused
    (``1.5B``), unless it comes from a larger unit (:data:`SMALLEST_ROUNDED_BYTES`). Anything
    else is refused.
    """
    if isinstance(value, bool) or not isinstance(value, (numbers.Real, str)):
        raise ValueError(
            f"budget {value!r} is not a size: give bytes (6442450944), a size with a unit "
            "(6GiB) or a fraction of the keep-all peak in (0, 1] (0.25)"
        )
    written = value
    whole = True  # a written number with more digits than a float keeps, 16.000000000000001
    if isinstance(value, numbers.Integral):  # numpy's integers too
        value = int(value)
    elif isinstance(value, numbers.Real):
        value = float(value)
    if isinstance(value, str):
        match = _SIZE.match(value)
        if not match or match.group(2).lower() not in _UNITS:
            raise ValueError(
                f"budget {value!r} is not a size: write bytes (6442450944), a size with a unit "
                "(6GiB, 512MB) or a fraction of the keep-all peak in (0, 1] (0.25)"
            )
        written_unit = match.group(2)
        if _BITS.match(written_unit):
            raise BitsUnitError(value, written_unit)
        text, unit = match.group(1), written_unit.lower()
        if unit:
            return _positive(_size_bytes(text, unit, written), written)
        value = int(text) if text.isdigit() else float(text)
        if isinstance(value, float) and 1 < value <= LARGEST_BYTES:
            whole = Fraction(text).denominator == 1
    value = _finite(value, written)
    if value <= 0:
        raise ValueError(
            f"budget {written!r} is outside (0, 1] and a budget must be positive: give a "
            "fraction of the keep-all peak above 0, or a size"
        )
    if value <= 1:
        if keep_all_peak_bytes is None:
            raise ValueError(
                f"budget {written!r} is a fraction of the keep-all peak, which is not known "
                "here: give a size in bytes instead"
            )
        return _positive(int(value * keep_all_peak_bytes), written)
    if value < SMALLEST_BYTE_COUNT or value != int(value) or not whole:
        raise ValueError(
            f"budget {written!r} is neither a fraction of the keep-all peak in (0, 1] nor a byte "
            f"count (a whole number of at least {SMALLEST_BYTE_COUNT}): write 0.5 for half the "
            f"keep-all peak, or a size with a unit such as 12B or 6GiB"
        )
    return _positive(int(value), written)


def _size_bytes(text: str, unit: str, written: str) -> int:
    """The bytes of ``text`` in ``unit`` (a size with a unit), refusing part of a byte that
    is written (1.5B) or most of a small size (1e-9GiB is 1.07 B)."""
    scale = _UNITS[unit]
    approx = _finite(float(text) * scale, written)
    if approx < 1:
        raise ValueError(
            f"budget {written!r} is less than one byte; a budget must be positive: give "
            "whole bytes (12B) or a size such as 6GiB"
        )
    if approx > LARGEST_BYTES:
        return int(approx)  # refused by _positive, which names the limit
    # Exact only now: Fraction expands the exponent of 1e-999999999 to all its digits.
    exact = Fraction(text) * scale
    if exact.denominator != 1 and (unit == "b" or exact < SMALLEST_ROUNDED_BYTES):
        low = math.floor(exact)
        raise ValueError(
            f"budget {written!r} is {float(exact):g} bytes, not a whole number of bytes: "
            f"write {low}B or {low + 1}B"
        )
    return math.floor(exact)


def _finite(value: int | float, written: int | float | str) -> int | float:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"budget {written!r} is not a finite size")
    return value


def _positive(budget_bytes: int, written: int | float | str) -> int:
    if budget_bytes <= 0:
        raise ValueError(f"budget {written!r} is {budget_bytes} bytes; a budget must be positive")
    if budget_bytes > LARGEST_BYTES:
        raise ValueError(
            f"budget {shown_number(budget_bytes)} bytes is more than any device holds (at "
            f"most {LARGEST_BYTES}): give the budget in bytes, as a size (6GiB) or a fraction"
        )
    return budget_bytes


def byte_unit(count: float) -> tuple[int, str]:
    """The largest binary unit not above ``count``, as (bytes per unit, name): (2**30, "GiB")."""
    for unit, scale in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(count) >= scale:
            return scale, unit
    return 1, "B"


def _both(count: int, round_up: bool = False) -> str:
    """A size in binary units and in bytes (``2.00 KiB (2048 B)``), once where they agree."""
    shown = format_bytes(count, round_up)
    return shown if shown == f"{count} B" else f"{shown} ({count} B)"


def format_bytes(count: float, round_up: bool = False) -> str:
    """A size in binary units, for people: 1.50 GiB; ``round_up`` for a least size, so that the
    figure shown, typed back, is at least it."""
    scale, unit = byte_unit(count)
    if scale == 1:
        return f"{math.ceil(count) if round_up else int(count)} B"
    shown = math.ceil(count / scale * 100) / 100 if round_up else count / scale
    return f"{shown:.2f} {unit}"


# A number without a unit below this many bytes per second is a unit left out (25 for
# 25GB/s); with a unit written, any rate a solver can count is taken as meant.
SLOWEST_BARE_RATE = 1e6


def parse_bandwidth(value: Any) -> Link:
    """A link from bytes per second: a number, ``"25GB/s"``, a (d2h, h2d) pair or a Link."""
    if isinstance(value, Link):
        return value
    if isinstance(value, (tuple, list)):
        if len(value) != 2:
            raise ValueError(f"bandwidth pair {value!r} must be (device-to-host, host-to-device)")
        return Link(_bytes_per_second(value[0]), _bytes_per_second(value[1]))
    rate = _bytes_per_second(value)
    return Link(rate, rate)


def _bytes_per_second(value: Any) -> float:
    unit_written = False
    if isinstance(value, str):
        text = re.sub(r"\s*/\s*s(ec)?\s*$", "", value.strip(), flags=re.IGNORECASE)
        try:
            rate = float(text)
        except ValueError:
            unit_written = True
            rate = _rate_with_unit(text, value)
    elif isinstance(value, (int, float)) and not isinstance(value, bool):
        rate = float(value)
    else:
        raise ValueError(f"bandwidth {value!r} is not a rate in bytes per second")
    if rate <= 0:
        raise ValueError(
            f"bandwidth {value!r} must be positive: give bytes per second (2.5e10) or a size "
            "per second (25GB/s)"
        )
    if not SLOWEST_LINK_BYTES_PER_S <= rate <= FASTEST_LINK_BYTES_PER_S:  # NaN too
        raise ValueError(
            f"bandwidth {value!r} is not a usable rate: give a number of bytes per second "
            f"from {SLOWEST_LINK_BYTES_PER_S:g} to {FASTEST_LINK_BYTES_PER_S:g} (25GB/s, 2.5e10)"
        )
    if not unit_written and rate < SLOWEST_BARE_RATE:
        # The unit that puts the number among real links' rates, 1e9 to 1e12 bytes a second.
        unit = "GB/s" if rate <= 1000 else "MB/s"
        raise ValueError(
            f"bandwidth {value!r} reads as {rate:g} bytes per second, slower than any link "
            f"between a device and its host: write the unit ({rate:g}{unit}) or the bytes "
            "per second (2.5e10)"
        )
    return rate


def _rate_with_unit(text: str, value: str) -> float:
    """Bytes per second from a size per second without its ``/s`` (``25GB``), where a rate
    need not be whole bytes."""
    match = _SIZE.match(text)
    if match is None or match.group(2).lower() not in _UNITS:
        raise ValueError(
            f"bandwidth {value!r} is not a rate: write bytes per second (2.5e10) or a "
            "size per second (25GB/s, 12GiB/s)"
        )
    if _BITS.match(match.group(2)):
        raise BitsUnitError(value, match.group(2), "bandwidth ")
    return float(match.group(1)) * _UNITS[match.group(2).lower()]
