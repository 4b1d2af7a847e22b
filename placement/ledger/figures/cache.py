"""The model cache's own figures, kept in the registry for status and metrics.

What a model cache's operators ask of it (KServe ModelMesh exports the same), per model:
how long its replicas' loads from disk and restores of warm copies took, how long a call
that found no HOT replica waited for its replica to become ready (a miss's load wait), and
how old its replicas were when evicted; and per GPU, the age of its LRU end (`lru_ages_ms`,
from a snapshot). Each per-model figure is a histogram in the model's `cache` hash
(`placement.ledger.figures.histograms`), counted where it happens:

- `load`, `restore`: by the GPU worker that did the work, once the replica is HOT
  (`worker.keeper`);
- `miss`: by the GPU worker that ran the call, as it answers it (`tasks.serving.gpu`);
- `eviction_age`: by the script that evicts (commit.lua for pressure, evict.lua for an
  explicit eviction or a scale-in), which has the record's `placed_at` and the clock.

Every figure is read from Redis when asked for, so any process reports the same.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from placement.ledger.figures.histograms import Histogram, cumulative, labels, observe
from placement.ledger.store import Store
from placement.policy.state import Snapshot

# Bucket bounds (seconds). Defaults, not tuned: each spans what a fleet may see, from a
# small model on a fast path to a large one on a slow one.
#: A load from disk or a neighbour's warm copy, until HOT: a small model from the page
#: cache in a tenth of a second, to tens of GB from a network disk in minutes.
LOAD_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: A restore of this worker's own warm copy: pinned memory copies at several GB/s, so
#: milliseconds for a small model to a minute for a large one over a slow bus.
RESTORE_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
#: A miss's wait for its replica: none (ready when the call came) up to a whole load.
MISS_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
#: A replica's age when evicted: seconds (thrashing) to a week (a cold corner of the fleet).
EVICTION_AGE_BUCKETS = (
    1.0, 10.0, 60.0, 300.0, 900.0, 3600.0, 3 * 3600.0, 6 * 3600.0, 12 * 3600.0,
    86400.0, 3 * 86400.0, 7 * 86400.0,
)  # fmt: skip

#: Every histogram of a model's cache hash, by name, with its bounds.
HISTOGRAMS: Mapping[str, Sequence[float]] = {
    "load": LOAD_BUCKETS,
    "restore": RESTORE_BUCKETS,
    "miss": MISS_BUCKETS,
    "eviction_age": EVICTION_AGE_BUCKETS,
}
#: The eviction-age buckets' labels, which the evicting scripts count in (commit.lua,
#: evict.lua: `count_eviction` in _lib.lua).
AGE_LABELS = labels(EVICTION_AGE_BUCKETS)


def record(store: Store, observations: Iterable[tuple[str, str, float]]) -> None:
    """Count each (model, histogram name, seconds) of `observations` in one round trip:
    `load` or `restore` (a worker's, `worker.keeper`), or `miss` (`tasks.serving.gpu`)."""
    commands: list[tuple[Any, ...]] = []
    for model, name, seconds in observations:
        if name not in HISTOGRAMS:
            raise ValueError(f"unknown cache figure {name!r}; expected one of {list(HISTOGRAMS)}")
        commands += observe(store.keys.model_cache(model), name, seconds, HISTOGRAMS[name])
    if commands:
        store._read(commands, atomic=True)  # a reader never sees a bucket past its count


def read(store: Store, models: Iterable[str]) -> dict[str, dict[str, Histogram]]:
    """Each of `models`: its histograms by name, in one round trip (a model with none
    counted has zeros in every bucket, so its series exist from the first scrape)."""
    names = sorted(set(models))
    rows = store._read([("hgetall", store.keys.model_cache(m)) for m in names])
    return {
        model: {name: cumulative(row, name, bounds) for name, bounds in HISTOGRAMS.items()}
        for model, row in zip(names, rows, strict=True)
    }


def lru_ages_ms(snap: Snapshot) -> dict[str, int]:
    """Each registered GPU's LRU age: now minus the last use of the least recently used
    replica on it that an eviction may take (`Deployment.evictable`: HOT, idle and not
    dedicated; the one LRU eviction takes first). A GPU without one is left out."""
    ages: dict[str, int] = {}
    for gpu_id, deps in snap.by_gpu.items():
        used = [d.last_used_ms for d in deps if d.evictable]
        if used and gpu_id in snap.gpus:
            ages[gpu_id] = max(0, snap.now_ms - min(used))
    return ages
