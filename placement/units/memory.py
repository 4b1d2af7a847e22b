"""Memory sizes: parse what people write, print what people read, convert bytes to GPU shares.

A model asks for bytes, not a fraction of a GPU (Ray REP 002). The catalog writes those bytes
as human strings ("8GiB", "8GB", "8G"), the placement ledger keeps plain integers, and a
scheduler that speaks in GPU fractions gets `fraction_of`, rounded up so that a share never
covers fewer bytes than were asked for. Pure stdlib: this module is safe to import anywhere.
"""

from __future__ import annotations

import math
import re
from decimal import ROUND_HALF_UP, Decimal
from fractions import Fraction

from placement.errors import ConfigError, MemorySizeError

KiB = 2**10
MiB = 2**20
GiB = 2**30
TiB = 2**40
PiB = 2**50

# Binary prefixes for bare letters and *iB, decimal for *B, as Helix writes them.
_UNITS: dict[str, int] = {"": 1, "b": 1}
for _power, _letter in enumerate("kmgtp", start=1):
    _UNITS[_letter] = _UNITS[_letter + "ib"] = 1024**_power
    _UNITS[_letter + "b"] = 1000**_power

_SIZE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?|\.[0-9]+)\s*(?P<unit>[a-z]*)", re.I | re.A)
_EXAMPLES = "'8GiB' or '8G' (binary), '8GB' (decimal), '1.5GiB', '512MiB', or bytes as 8589934592"
_FORMAT_UNITS = (("PiB", PiB), ("TiB", TiB), ("GiB", GiB), ("MiB", MiB), ("KiB", KiB))
_FRACTION_STEP = 10_000  # fractions are rounded up to 1e-4


def _bad(value: object, why: str) -> MemorySizeError:
    return MemorySizeError(f"invalid memory size {value!r}: {why}; write it like {_EXAMPLES}")


def parse_size(value: object) -> int:
    """Return the number of bytes in `value`.

    Accepted forms:
      * an int, or a string of digits: bytes (8589934592);
      * a number with a unit, case-insensitive, optional space: "8GiB" and "8G" are binary
        (8 * 2**30), "8GB" is decimal (8 * 10**9); likewise K, M, T and P, and "B" for bytes;
      * a decimal number with a unit ("1.5GiB"): rounded up to whole bytes;
      * a float that holds a whole number (1e9, as YAML may produce): bytes.

    A bare number must be whole bytes: "1.5" or 1.5 without a unit is rejected, because it is
    almost always a forgotten unit. Negative, empty, bool, NaN/inf, None and unknown units raise
    `MemorySizeError` naming the value and showing valid forms.
    """
    if isinstance(value, bool) or value is None:
        raise _bad(value, "expected a size, not a boolean or nothing")
    if isinstance(value, int):
        if value < 0:
            raise _bad(value, "a size cannot be negative")
        return value
    if isinstance(value, float):
        if not math.isfinite(value) or value < 0 or not value.is_integer():
            raise _bad(value, "a number without a unit must be a whole, non-negative byte count")
        return int(value)
    if not isinstance(value, str):
        raise _bad(value, f"expected a string or an integer, not {type(value).__name__}")
    text = value.strip()
    match = _SIZE.fullmatch(text)
    if match is None:
        why = "a size cannot be negative" if text.startswith("-") else "not a size"
        raise _bad(value, why if text else "empty")
    unit = match["unit"].lower()
    if unit not in _UNITS:
        raise _bad(value, f"unknown unit {match['unit']!r}")
    amount = Fraction(match["number"])
    if not unit and amount.denominator != 1:
        raise _bad(value, "a number without a unit must be a whole byte count")
    return math.ceil(amount * _UNITS[unit])


def format_size(n: int) -> str:
    """Render `n` bytes in the largest binary unit that keeps the number >= 1.

    At most two decimals, trailing zeros trimmed: "8 GiB", "1.5 GiB", "512 MiB", "100 B".
    `parse_size` reads the result back to within the rounding of the last decimal.
    """
    sign, n = ("-", -n) if n < 0 else ("", n)
    for name, unit in _FORMAT_UNITS:
        if n >= unit:
            amount = (Decimal(n) / unit).quantize(Decimal("0.01"), rounding=ROUND_HALF_UP)
            text = f"{amount:f}".rstrip("0").rstrip(".")
            return f"{sign}{text} {name}"
    return f"{sign}{n} B"


def fraction_of(nbytes: int, total: int) -> float:
    """Return the share of a `total`-byte GPU that holds `nbytes`, rounded up to 1e-4.

    The rounding is exact integer arithmetic (REP 002's `roundup(bytes / gpu_memory, 0.0001)`):
    10 GiB of a 40 GiB GPU is 0.25, 10 MB of a 40 GB GPU is 0.0003. The result exceeds 1.0 when
    `nbytes` does not fit on the GPU.
    """
    if total <= 0:
        raise ConfigError(f"GPU memory must be positive to take a fraction of it, got {total!r}")
    if nbytes < 0:
        raise ConfigError(f"cannot take a fraction for a negative size, got {nbytes!r}")
    steps = -(-nbytes * _FRACTION_STEP // total)  # ceiling division, no float involved
    return steps / _FRACTION_STEP


def process_fraction(reserved: int, total: int) -> float:
    """Return the CUDA memory cap for a process holding `reserved` bytes of a `total`-byte GPU.

    This is the value for `torch.cuda.set_per_process_memory_fraction`: `reserved / total`
    clamped to [0.01, 0.99] (never zero, which would forbid any allocation, and never the whole
    device, which leaves no room for the CUDA context), and exactly 1.0 when nothing is
    resident, so an idle process is not held to a stale cap.
    """
    if total <= 0:
        raise ConfigError(f"GPU memory must be positive to cap a process, got {total!r}")
    if reserved < 0:
        raise ConfigError(f"reserved bytes cannot be negative, got {reserved!r}")
    if reserved == 0:
        return 1.0
    return min(0.99, max(0.01, reserved / total))
