"""Histograms kept in the registry as bucket counts in a hash, fleet-wide.

A histogram `name` of a hash is its fields `name:<bound>` (values counted in that bucket
alone, `<bound>` the upper bound as `str` writes it, `+Inf` past the last), and beside
them its count and sum (`name_count`, `name_sum`, unless its writer keeps a count of its
own). Writers add one value with a few HINCRBYs (`observe`; a Lua script does the same,
`observe` in _lib.lua, with the bounds' labels this module gives); readers build
Prometheus's cumulative form (`cumulative`). Every figure lives in Redis, so any process
reports the same.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Histogram:
    """Cumulative bucket counts (Prometheus's form), with the sum and count of values."""

    buckets: list[tuple[str, int]]  # (upper bound, values at or below it), "+Inf" last
    sum: float
    count: int


def labels(bounds: Sequence[float]) -> list[str]:
    """The bucket labels of `bounds` as stored: what a Lua script is given to count in."""
    return [str(bound) for bound in bounds]


def bucket(value: float, bounds: Sequence[float]) -> str:
    """The label of the bucket `value` is counted in: its first bound at or above it."""
    for bound in bounds:
        if value <= bound:
            return str(bound)
    return "+Inf"


def observe(key: str, name: str, value: float, bounds: Sequence[float]) -> list[tuple[Any, ...]]:
    """The commands that count `value` in histogram `name` of the hash `key`, with its
    count and sum; run them atomically, so a reader never sees a bucket past its count."""
    return [
        ("hincrby", key, f"{name}:{bucket(value, bounds)}", 1),
        ("hincrby", key, f"{name}_count", 1),
        ("hincrbyfloat", key, f"{name}_sum", value),
    ]


def cumulative(
    row: Mapping[str, str], name: str, bounds: Sequence[float], count: int | None = None
) -> Histogram:
    """Histogram `name` of a hash read whole (`row`); `count`, when its writer keeps its
    own, else its `name_count` field."""
    total = int(row.get(f"{name}_count", 0)) if count is None else count
    running, buckets = 0, []
    for bound in bounds:
        running += int(row.get(f"{name}:{bound}", 0))
        buckets.append((str(bound), running))
    buckets.append(("+Inf", total))
    return Histogram(buckets, float(row.get(f"{name}_sum", 0.0)), total)
