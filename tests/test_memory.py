"""Memory sizes: parsing the catalog's strings, printing them, and bytes-to-fraction rounding."""

from __future__ import annotations

import math
from fractions import Fraction

import pytest
from hypothesis import given
from hypothesis import strategies as st

from placement.errors import ConfigError, MemorySizeError
from placement.units.memory import GiB, MiB, format_size, fraction_of, parse_size, process_fraction

# --- parse_size -------------------------------------------------------------------------------


def test_gib_is_binary_and_gb_is_decimal() -> None:
    # Helix's catalog examples: "8GiB" and "8G" are binary, "8GB" is decimal.
    assert parse_size("8GiB") == 8 * 2**30 == 8589934592
    assert parse_size("8G") == 8 * 2**30
    assert parse_size("8GB") == 8 * 10**9
    assert parse_size(8589934592) == 8589934592


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("1KiB", 2**10),
        ("1K", 2**10),
        ("1KB", 10**3),
        ("3MiB", 3 * 2**20),
        ("3M", 3 * 2**20),
        ("3MB", 3 * 10**6),
        ("2TiB", 2 * 2**40),
        ("2TB", 2 * 10**12),
        ("1PiB", 2**50),
        ("1PB", 10**15),
        ("100B", 100),
        ("100", 100),
    ],
)
def test_every_prefix_has_a_binary_and_a_decimal_form(text: str, expected: int) -> None:
    assert parse_size(text) == expected


def test_units_ignore_case_and_surrounding_space() -> None:
    assert parse_size("8gib") == parse_size("8 GiB") == parse_size("  8GIB ") == 8 * 2**30
    assert parse_size("8 gb") == 8 * 10**9
    assert parse_size("8\tg") == 8 * 2**30


def test_decimals_are_rounded_up_to_whole_bytes() -> None:
    assert parse_size("1.5GiB") == 3 * 2**29
    assert parse_size(".5KiB") == 512
    # 1.1 KB is exactly 1100 bytes; 0.0001 KiB is 0.1024 bytes, which takes a whole byte.
    assert parse_size("1.1KB") == 1100
    assert parse_size("0.0001KiB") == 1


def test_a_whole_float_is_bytes() -> None:
    assert parse_size(1e9) == 10**9
    assert parse_size(0.0) == 0


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ("", "empty"),
        ("   ", "empty"),
        ("-8GiB", "negative"),
        (-1, "negative"),
        (True, "boolean"),
        (None, "nothing"),
        (float("nan"), "whole"),
        (float("inf"), "whole"),
        (1.5, "whole"),
        ("1.5", "whole"),
        ("8XB", "unknown unit 'XB'"),
        ("8 gibibytes", "unknown unit"),
        ("lots", "not a size"),
        ("8GiB of RAM", "not a size"),
        ("1e9", "not a size"),
        ([8], "not list"),
    ],
)
def test_bad_sizes_name_the_value_and_show_valid_forms(value: object, why: str) -> None:
    with pytest.raises(MemorySizeError) as caught:
        parse_size(value)
    message = str(caught.value)
    assert repr(value) in message
    assert why in message
    assert "'8GiB'" in message and "'8GB' (decimal)" in message


def test_a_size_error_is_also_a_config_error_and_a_value_error() -> None:
    with pytest.raises(ConfigError):
        parse_size("x")
    with pytest.raises(ValueError):
        parse_size("x")


# --- format_size ------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "text"),
    [
        (8 * GiB, "8 GiB"),
        (3 * GiB // 2, "1.5 GiB"),
        (512 * MiB, "512 MiB"),
        (100, "100 B"),
        (0, "0 B"),
        (1024, "1 KiB"),
        (1023, "1023 B"),
        (GiB + GiB // 3, "1.33 GiB"),
        (-2 * GiB, "-2 GiB"),
        (3 * 2**50, "3 PiB"),
    ],
)
def test_format_size_picks_the_largest_binary_unit(n: int, text: str) -> None:
    assert format_size(n) == text


@given(st.integers(min_value=0, max_value=2**62))
def test_format_then_parse_returns_the_size_within_rounding(n: int) -> None:
    text = format_size(n)
    number, unit = text.split()
    assert len(number.partition(".")[2]) <= 2
    assert not number.endswith("0") or "." not in number
    unit_bytes = parse_size(f"1{unit}")
    # Two decimals of the unit, half-up: off by at most half a hundredth of it (plus ceiling).
    assert abs(parse_size(text) - n) <= unit_bytes / 200 + 1


# --- fraction_of ------------------------------------------------------------------------------


def test_fractions_follow_ray_rep_002() -> None:
    assert fraction_of(10 * GiB, 40 * GiB) == 0.25
    assert fraction_of(10 * GiB, 80 * GiB) == 0.125
    # 10 MB of 40 GB is 0.00025 and of 80 GB is 0.000125: both round up to the next 1e-4.
    assert fraction_of(parse_size("10MB"), parse_size("40GB")) == 0.0003
    assert fraction_of(parse_size("10MB"), parse_size("80GB")) == 0.0002


def test_one_byte_takes_the_smallest_share_and_nothing_takes_none() -> None:
    assert fraction_of(1, 80 * GiB) == 0.0001
    assert fraction_of(0, 80 * GiB) == 0.0


def test_a_size_larger_than_the_gpu_is_a_share_above_one() -> None:
    assert fraction_of(3 * GiB, 2 * GiB) == 1.5


@pytest.mark.parametrize("total", [0, -1])
def test_a_fraction_of_no_memory_is_a_config_error(total: int) -> None:
    with pytest.raises(ConfigError, match=f"positive.*{total}"):
        fraction_of(GiB, total)


def test_a_fraction_of_a_negative_size_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="negative"):
        fraction_of(-1, GiB)


# A GPU holds at least a MiB: shares then stay under 2**25, where a float still carries
# every 1e-4 step (hypothesis found 2**44 - 1 bytes of a 21-byte "GPU": 8e11, past that).
@given(st.integers(min_value=0, max_value=2**45), st.integers(min_value=2**20, max_value=2**45))
def test_a_fraction_covers_the_bytes_and_overshoots_by_less_than_one_step(
    nbytes: int, total: int
) -> None:
    # repr of the float is its shortest decimal, which is exactly the k/10000 step it encodes.
    share = Fraction(repr(fraction_of(nbytes, total)))
    exact = Fraction(nbytes, total)
    assert (share * 10_000).denominator == 1
    assert exact <= share < exact + Fraction(1, 10_000)


# --- process_fraction -------------------------------------------------------------------------


def test_a_process_cap_is_its_reserved_share_of_the_device() -> None:
    assert process_fraction(20 * GiB, 80 * GiB) == 0.25


def test_a_process_cap_is_clamped_between_one_and_ninety_nine_percent() -> None:
    assert process_fraction(1, 80 * GiB) == 0.01
    assert process_fraction(80 * GiB, 80 * GiB) == 0.99
    assert process_fraction(100 * GiB, 80 * GiB) == 0.99


def test_a_process_with_nothing_resident_goes_back_to_the_whole_device() -> None:
    assert process_fraction(0, 80 * GiB) == 1.0


def test_a_process_cap_rejects_nonsense_inputs() -> None:
    with pytest.raises(ConfigError):
        process_fraction(GiB, 0)
    with pytest.raises(ConfigError):
        process_fraction(-1, GiB)


@given(st.integers(min_value=1, max_value=2**45), st.integers(min_value=1, max_value=2**45))
def test_a_process_cap_stays_in_range_and_tracks_the_ratio_inside_it(
    reserved: int, total: int
) -> None:
    cap = process_fraction(reserved, total)
    assert 0.01 <= cap <= 0.99
    if 0.01 <= reserved / total <= 0.99:
        assert math.isclose(cap, reserved / total)
