"""What generating calls took, per model, kept in the registry for status and metrics.

A GPU worker records each generating call as it ends (`record`): its tokens, its time to
first token and its mean time between tokens, as counts in the buckets of two histograms
(`placement.ledger.figures.histograms`: Prometheus's cumulative form is built when read), plus
their sums. While a replica generates, its worker also says how many KV-cache tokens its
batch holds and, for a paged cache, its blocks in use, cached and free and its prompts'
reuse (`mark_kv`, expiring like `mark_batch`'s count), so `gpufleet status` shows the
budget's use.
Every figure comes from Redis at the time it is read, so any process reports the same.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from placement.ledger.figures.histograms import Histogram, bucket, cumulative, observe
from placement.ledger.load import BATCH_TTL_MS
from placement.ledger.store import Store

#: Upper bounds (seconds) of the histogram buckets: defaults, not tuned, spanning a small
#: model on a GPU to a large one on a CPU.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


def record(store: Store, model: str, tokens: int, ttft_s: float, itl_s: float | None) -> None:
    """Count one ended generating call of `model`: its tokens and latencies."""
    key = store.keys.generation(model)
    commands: list[tuple[Any, ...]] = [
        ("hincrby", key, "calls", 1),
        ("hincrby", key, "tokens", tokens),
        ("hincrby", key, f"ttft:{bucket(ttft_s, TTFT_BUCKETS)}", 1),
        ("hincrbyfloat", key, "ttft_sum", ttft_s),
        ("sadd", store.keys.generating, model),
    ]
    if itl_s is not None:
        commands += observe(key, "itl", itl_s, ITL_BUCKETS)
    store._read(commands, atomic=True)  # a reader never sees a bucket past its count


def mark_kv(store: Store, replica: str, kv: dict[str, float]) -> None:
    """Say what `replica`'s KV cache holds now (`held_tokens`, and a paged cache's block
    counts), for `BATCH_TTL_MS`: said while its batch runs, and once as it ends (its
    cached prefixes then show for that long); a cache that holds nothing, not even cached
    prefixes, is said by no record."""
    key = store.keys.kv_held(replica)
    if kv.get("held_tokens") or kv.get("blocks_cached") or kv.get("adapters_held"):
        store._read([("psetex", key, BATCH_TTL_MS, json.dumps(kv))])
    else:
        store._read([("delete", key)])


@dataclass(frozen=True)
class Figures:
    """One model's generating calls since the fleet began."""

    calls: int
    tokens: int
    ttft: Histogram
    itl: Histogram


def nothing() -> Figures:
    """The figures of a model with no recorded call: zero in every bucket."""
    return _figures({})


def read(store: Store) -> dict[str, Figures]:
    """Every model that generated: its figures, in one round trip after the model list."""
    models = sorted(store._one("smembers", store.keys.generating))  # str: decode_responses
    rows = store._read([("hgetall", store.keys.generation(m)) for m in models])
    return {model: _figures(row) for model, row in zip(models, rows, strict=True)}


def kv_held(store: Store, replicas: Iterable[str]) -> dict[str, dict[str, float]]:
    """What each of `replicas`' KV cache holds now (`mark_kv`; absent: nothing)."""
    names = list(replicas)
    rows = store._read([("get", store.keys.kv_held(r)) for r in names])
    return {r: _kv(v) for r, v in zip(names, rows, strict=True) if v is not None}


def _kv(raw: str) -> dict[str, float]:
    """A `mark_kv` record; a bare count (a worker from before paging) is its tokens held."""
    value = json.loads(raw)
    return value if isinstance(value, dict) else {"held_tokens": float(value)}


def _figures(row: dict[str, str]) -> Figures:
    calls = int(row.get("calls", 0))
    return Figures(
        calls=calls,
        tokens=int(row.get("tokens", 0)),
        ttft=cumulative(row, "ttft", TTFT_BUCKETS, calls),
        itl=cumulative(row, "itl", ITL_BUCKETS),
    )
