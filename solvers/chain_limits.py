"""The limits of the ``offremat.chain/1`` format and the checks of its fields.

Every size is a whole number of bytes up to :data:`LARGEST_BYTES`, every time a finite number
of seconds up to :data:`LONGEST_SECONDS`, every link rate within its two bounds; a value out
of them is refused with a :class:`ChainFormatError` that names its field.
"""

from __future__ import annotations

import math
from typing import Any


class ChainFormatError(ValueError):
    """A chain file or value breaks the ``offremat.chain/1`` format; the message names the field."""


SLOWEST_LINK_BYTES_PER_S = 1.0
"""Below one byte per second a copy of any activation takes longer than a solver can count."""

FASTEST_LINK_BYTES_PER_S = 1e15
"""A petabyte per second, far past any device's own memory: the MILPs' coefficients of copy
time, bytes over rate in their unit of time, overflow to infinity from 1e300 B/s."""


LARGEST_BYTES = 2**50
"""One pebibyte: no size, no chain's sizes added up and no budget is larger. So every peak and
least budget a solver finds is a budget that can be asked for, and sums of sizes stay exact
where a solver keeps them in floats (below 2**53)."""

LONGEST_SECONDS = 1e9
"""About 30 years: no stage's forward or backward takes longer, and sums of times stay far
from overflowing."""

SHORTEST_SECONDS = 1e-12
"""A compute op takes at least this long in the simulator: a chain may say 0 s (a stage too
quick to time), and ops that end when they start would share their instant with their
neighbours, whose order within it then decides the peak. At a picosecond each op has its own
instants, as the DP's and the MILP's memory models have them, and no predicted time moves
visibly. A time between 0 and this is refused: no timer measures it, and the simulator
would count the op a picosecond, far longer than the chain says."""


def check_number(value: Any, where: str) -> None:
    """Refuse a value that is not a finite, non-negative number, naming ``where``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ChainFormatError(f"{where} must be a number, got {value!r}")
    try:
        finite = math.isfinite(value)
    except OverflowError:  # an int too large for a float
        raise ChainFormatError(
            f"{where} is too large, got a {len(str(value))}-digit number"
        ) from None
    if not finite:
        raise ChainFormatError(f"{where} must be finite, got {value}")
    if value < 0:
        raise ChainFormatError(f"{where} must be non-negative, got {value}")


def check_bytes(value: Any, where: str, least: int = 0) -> int:
    """The value as an int of bytes, at least ``least``; integral floats such as 1024.0 are
    accepted."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int):
        raise ChainFormatError(f"{where} must be an integer number of bytes, got {value!r}")
    if value < least:
        bound = "non-negative" if least == 0 else f"at least {least} (minus the saved set)"
        raise ChainFormatError(f"{where} must be {bound}, got {value}")
    if value > LARGEST_BYTES:
        raise ChainFormatError(
            f"{where} is {shown_number(value)} bytes, more than any device holds (at most "
            f"{LARGEST_BYTES}): give sizes in bytes"
        )
    return value


def shown_number(value: int | float) -> str:
    """A number for a message: an integer of up to 20 digits whole, else ``1.2e+21``, or
    ``about 1e400`` past a float's range."""
    if isinstance(value, int) and abs(value) < 10**20:
        return str(value)
    try:
        return f"{value:.3g}"
    except OverflowError:
        return f"about 1e{len(str(abs(int(value)))) - 1}"


STAGE_BYTE_FIELDS = (
    "out_bytes",
    "saved_bytes",
    "fwd_tmp_bytes",
    "bwd_tmp_bytes",
    "nograd_fwd_tmp_bytes",
    "grad_bytes",
)
"""The sizes a stage gives, in bytes."""

STAGE_FIELDS = {"name", "fwd_s", "bwd_s", "refill_s", *STAGE_BYTE_FIELDS}
