"""Control under a backlog: how soon an eviction takes effect on a GPU worker that is busy.

    python -m bench.control [--backlog 30] [--repeats 5]

Prints one JSON object. It starts a fleet (`tasks.operator.launcher.Fleet`: an embedded Redis, a
router and one worker on a simulated 4 GiB GPU) serving two synthetic `forward` models:
`a` (tiny) and `b` (a BERT of 4 layers whose large calls take a few hundred ms on the CPU).
Both are made resident. Then, `--repeats` times:

1. `--backlog` large calls for `b` are queued on the GPU worker (through the fast path);
2. `gpufleet.evict("a")` is sent, and right after it a *probe*: one more call for `b`,
   queued behind the backlog like any message to that worker;
3. it records, on the registry's clock, the time from the evict's request to the `settled`
   event of `a` (its worker moved it to CPU memory and released its device bytes), and the
   probe's queue time, which is what a control message in the worker's queue would wait
   (the baseline: gpufleet's `sync` task waited exactly so before the keeper);
4. it waits for the backlog to drain and calls `a` once to make it resident again.

`evict_to_settled_ms` is the median over repeats; `one_call_ms` the median compute of a
backlog call; `queued_message_ms` the probe's median queue time. Target: an evict takes
effect within about one call's time (`settle_vs_call <= 1.5`), not after the backlog.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

log = logging.getLogger("bench.control")

LARGE = ["y" * 2000] * 2
PARAMS = {"max_length": 512}
SIM_GPUS = "1x4GiB"
TIMEOUT_S = 300.0


def settled_at(registry: Any, replica: str, after_ms: int) -> int:
    """When the worker settled `replica`'s move, on the registry's clock (waits for it)."""
    deadline = time.monotonic() + TIMEOUT_S
    while time.monotonic() < deadline:
        for e in registry.events():
            if e["kind"] == "settled" and e["replica"] == replica and int(e["at"]) >= after_ms:
                return int(e["at"])
        time.sleep(0.005)
    raise TimeoutError(f"{replica} was not settled within {TIMEOUT_S:.0f} s")


def run(backlog: int, repeats: int, directory: Path) -> dict[str, Any]:
    from bench.fleet import TWO_MODELS, bench_launcher, fleet_machine

    fleet = bench_launcher(directory, TWO_MODELS, "control", SIM_GPUS, warm_cache="2GiB")
    settle_ms: list[float] = []
    queued_ms: list[float] = []
    call_ms: list[float] = []
    drain_s: list[float] = []
    try:
        fleet.start()
        fleet.wait_ready(TIMEOUT_S)
        from placement.ledger.registry import Registry
        from tasks.app import app

        registry = Registry.from_url(fleet.redis_url, fleet.fleet)
        for model in ("a", "b"):
            app.send_task("gpufleet.infer", args=(model, "warm up")).get(timeout=TIMEOUT_S)
        for i in range(repeats):
            calls = [
                app.send_task("gpufleet.infer", args=("b", LARGE, PARAMS)) for _ in range(backlog)
            ]
            time.sleep(0.5)  # the backlog is in the worker's queue
            (a,) = [d for d in registry.snapshot().replicas("a") if d.level.value == "HOT"]
            sent_ms = registry.now_ms()
            evicted = app.send_task("gpufleet.evict", args=("a",))
            probe = app.send_task("gpufleet.infer", args=("b", "probe"))
            settle_ms.append(settled_at(registry, a.replica, sent_ms) - sent_ms)
            started = time.monotonic()
            evicted.get(timeout=TIMEOUT_S)
            results = [c.get(timeout=TIMEOUT_S) for c in calls]
            queued_ms.append(probe.get(timeout=TIMEOUT_S)["timings_ms"]["queue"])
            drain_s.append(time.monotonic() - started)
            call_ms += [r["timings_ms"]["compute"] for r in results]
            app.send_task("gpufleet.infer", args=("a", "back")).get(timeout=TIMEOUT_S)
            log.info("repeat %d: evict settled in %.0f ms", i, settle_ms[-1])
        registry.client.close()
        fleet.supervise()
    finally:
        fleet.stop()

    one_call = statistics.median(call_ms)
    settle = statistics.median(settle_ms)
    return {
        "backlog": backlog,
        "repeats": repeats,
        "evict_to_settled_ms": round(settle, 1),
        "evict_to_settled_max_ms": round(max(settle_ms), 1),
        "one_call_ms": round(one_call, 1),
        "queued_message_ms": round(statistics.median(queued_ms), 1),
        "backlog_drain_s": round(statistics.median(drain_s), 2),
        "settle_vs_call": round(settle / one_call, 3),
        "settle_vs_queued_message": round(settle / statistics.median(queued_ms), 4),
        "targets": {"settle_vs_call": "<= 1.5", "met": settle / one_call <= 1.5},
        "machine": fleet_machine(SIM_GPUS) | {"loadavg": [round(x, 2) for x in os.getloadavg()]},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--backlog", type=int, default=30, help="large calls queued first")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    if args.backlog < 1 or args.repeats < 1:
        parser.error("--backlog and --repeats must be positive")
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    with tempfile.TemporaryDirectory(prefix="gpufleet-control-") as tmp:
        result = run(args.backlog, args.repeats, Path(tmp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
