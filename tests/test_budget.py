"""Budgets as users write them, and sizes as people read them."""

from __future__ import annotations

import re

import numpy as np
import pytest

from solvers.budget import (
    InfeasibleBudgetError,
    byte_unit,
    format_bytes,
    parse_bandwidth,
    parse_budget,
)


@pytest.mark.parametrize(
    ("written", "expected"),
    [
        (6442450944, 6442450944),
        ("6442450944", 6442450944),
        ("6GiB", 6 * 2**30),
        ("512MB", 512 * 10**6),
        (" 1.5 kib ", 1536),
        ("2e3", 2000),
        (0.25, 250),
        ("0.25", 250),
        (1.0, 1000),
        (np.int64(6442450944), 6442450944),  # numpy's numbers are numbers
        (np.float64(0.25), 250),
    ],
)
def test_parse_budget_reads_bytes_sizes_and_fractions(written: object, expected: int) -> None:
    assert parse_budget(written, keep_all_peak_bytes=1000) == expected  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("lots", "is not a size"),
        ("6 parsecs", "is not a size"),
        (True, "is not a size"),
        (0, "must be positive"),
        ("0GiB", "must be positive"),
        ("0.1B", "must be positive"),
        (1e-9, "must be positive"),
        (-0.5, "outside (0, 1]"),
        ("6Gb", "reads as bits"),
        ("512Mb", "write MB for bytes"),
    ],
)
def test_parse_budget_refuses_what_is_not_a_positive_budget(written: object, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_budget(written, keep_all_peak_bytes=1000)  # type: ignore[arg-type]


def test_a_fraction_needs_the_keep_all_peak() -> None:
    with pytest.raises(ValueError, match="give a size in bytes"):
        parse_budget(0.5)


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("1.5B", "is 1.5 bytes, not a whole number of bytes: write 1B or 2B"),
        ("16.9B", "is 16.9 bytes, not a whole number of bytes: write 16B or 17B"),
        ("1000.5B", "write 1000B or 1001B"),
        ("1e-9GiB", "is 1.07374 bytes, not a whole number of bytes: write 1B or 2B"),
        ("0.33KiB", "is 337.92 bytes, not a whole number of bytes: write 337B or 338B"),
        ("0.9B", "less than one byte; a budget must be positive"),
        ("16.000000000000001", "nor a byte count (a whole number of at least 16)"),
    ],
)
def test_part_of_a_byte_is_refused_not_rounded_down(written: str, message: str) -> None:
    """1.5B was read as 1 B and 1e-9GiB as 1 B, where a bare 1.5 is refused."""
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_budget(written, keep_all_peak_bytes=1000)


def test_a_larger_unit_that_is_not_whole_bytes_is_rounded_down() -> None:
    """As least feasible budgets are shown (3.11 GiB): a peak is whole bytes, so rounding the
    budget down lets in the same plans."""
    assert parse_budget("3.11GiB") == 3339337072  # 3339337072.64 B
    assert parse_budget("0.3GiB") == 322122547
    assert parse_budget("1.5KiB") == 1536


def test_format_bytes_picks_the_largest_binary_unit() -> None:
    assert format_bytes(512) == "512 B"
    assert format_bytes(1536) == "1.50 KiB"
    assert format_bytes(3 * 2**30) == "3.00 GiB"
    assert format_bytes(2**41) == "2.00 TiB"
    assert byte_unit(1023) == (1, "B")
    assert byte_unit(5 * 2**20) == (2**20, "MiB")


def test_infeasible_budget_error_says_what_to_raise_it_to() -> None:
    error = InfeasibleBudgetError(1000, 2048, "dp")
    assert (error.budget_bytes, error.min_budget_bytes, error.solver) == (1000, 2048, "dp")
    assert "2.00 KiB (2048 B)" in str(error) and "raise the budget" in str(error)


def test_the_least_budget_named_typed_back_fits() -> None:
    """3331457032 B is 3.1026 GiB: shown as 3.10 GiB, typed back it was refused again."""
    error = InfeasibleBudgetError(3331457031, 3331457032, "dp")
    assert "the least feasible budget is 3.11 GiB (3331457032 B)" in str(error)
    assert parse_budget("3.11GiB") >= 3331457032
    assert format_bytes(3331457031) == "3.10 GiB"


def test_a_link_in_bits_is_refused_not_read_as_bytes() -> None:
    """PCIe and networks are quoted in bits: 25Gb/s read as 25 GB/s was 8x too fast."""
    with pytest.raises(ValueError, match=re.escape("reads as bits")):
        parse_bandwidth("25Gb/s")
    assert parse_bandwidth("25GB/s").d2h_bytes_per_s == 25e9


@pytest.mark.parametrize("written", ["1e300", 1e300, "nan"])
def test_a_link_faster_than_any_is_refused(written: object) -> None:
    """A chain took 1e300 B/s, and milp died in PuLP dividing by the infinite rate."""
    with pytest.raises(ValueError, match=re.escape("bytes per second from 1 to 1e+15")):
        parse_bandwidth(written)


@pytest.mark.parametrize(
    ("written", "message"),
    [
        ("999999", "write the unit (999999MB/s)"),  # was 999999GB/s, a petabyte a second
        ("25", "write the unit (25GB/s)"),
        ("0GB/s", "bandwidth '0GB/s' must be positive"),  # was "not a rate"
        ("0", "bandwidth '0' must be positive"),
    ],
)
def test_a_link_rate_refused_says_what_to_write(written: str, message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_bandwidth(written)


@pytest.mark.parametrize(
    ("written", "rate"),
    [("10GB/S", 1e10), ("10gb/s", 1e10), ("10GB/Sec", 1e10), ("1KB/s", 1e3), ("1.5B/s", 1.5)],
)
def test_a_link_rate_is_read_whatever_the_case_of_its_per_second(written: str, rate: float) -> None:
    """10GB/S was refused where 10gb/s was read; 1.5B/s was rounded down to 1 B/s."""
    assert parse_bandwidth(written).d2h_bytes_per_s == rate
