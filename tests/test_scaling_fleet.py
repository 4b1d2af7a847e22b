"""End to end: a burst on one model brings more replicas, and they go once it idles.

Through a real `gpufleet up` on simulated GPUs and a plain Celery client, as users call it.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from placement.ledger.audit import audit
from placement.policy.state import RESERVING, Level
from tests.running import LARGE, RunningFleet, fleet_env, fleet_up

pytestmark = pytest.mark.slow

CATALOG = """
models:
  b:
    source: synthetic
    task: forward
    memory: 256MiB
    replicas: {min: 1, max: 3}
    keep_alive: 3s
    config: {model_type: bert, hidden_size: 256, num_hidden_layers: 4, num_attention_heads: 4,
             intermediate_size: 1024, vocab_size: 512, max_position_embeddings: 512}
"""
CALLERS = 6  # calls in flight at once during the burst
#: A second replica is HOT within this long of the burst's start: the 1 s window, a look
#: every 0.5 s, the `gpufleet.scale` task, and a load of the small BERT on a busy CPU.
SCALE_OUT_S = 30.0
#: Back to one replica within this long of the burst's end: a replica placed as the burst
#: ended loads, then each idles for keep_alive (3 s) and goes at the next look.
SCALE_IN_S = 30.0


def placed(fleet: RunningFleet) -> list[Level]:
    """The levels of b's placed replicas (HOT, LOADING, WAITING, DRAINING)."""
    snap = fleet.registry.snapshot()
    problems = audit(snap)
    assert problems == [], problems  # the ledger is the truth throughout
    return sorted(d.level for d in snap.replicas("b") if d.level in RESERVING)


def hot(fleet: RunningFleet) -> int:
    return placed(fleet).count(Level.HOT)


def test_a_burst_scales_a_model_out_to_more_replicas_and_idling_scales_it_back_in(
    tmp_path: Path,
) -> None:
    catalog = tmp_path / "models.yaml"
    catalog.write_text(CATALOG)
    env = fleet_env(GPUFLEET_WARM_CACHE="2GiB", GPUFLEET_SCALE_WINDOW="1s")
    with fleet_up(catalog, ["--sim-gpus", "3x2GiB", "--metrics-port", "0"], env) as fleet:
        assert fleet.infer("b", "warm up")["model"] == "b"
        assert placed(fleet) == [Level.HOT]
        results: list[dict[str, Any]] = []
        failures: list[str] = []
        stop = threading.Event()

        def call() -> None:
            while not stop.is_set():
                sent = fleet.client.send_task("gpufleet.infer", args=("b", *LARGE))
                try:
                    results.append(sent.get(timeout=120))
                except Exception as exc:  # counted, and the caller goes on
                    failures.append(f"{type(exc).__name__}: {exc}")

        callers = [threading.Thread(target=call) for _ in range(CALLERS)]
        started = time.monotonic()
        for t in callers:
            t.start()
        try:
            while hot(fleet) < 2:
                assert time.monotonic() - started < SCALE_OUT_S, "no second replica in time"
                time.sleep(0.25)
            scaled_s = time.monotonic() - started
            print(f"second replica HOT {scaled_s:.1f} s after the burst began")
            time.sleep(2)  # the burst goes on over both replicas
        finally:
            stop.set()
            for t in callers:
                t.join(timeout=150)
        ended = time.monotonic()
        assert failures == []  # every call of the burst was answered
        by_replica = Counter(r["replica"] for r in results)
        print(f"calls per replica: {sorted(by_replica.values())}")
        assert len(by_replica) >= 2, by_replica  # calls ran on more than one replica
        while (now := placed(fleet)) != [Level.HOT]:  # one placed, none on its way or draining
            assert time.monotonic() - ended < SCALE_IN_S, f"not back to one replica: {now}"
            assert Level.HOT in now  # the floor holds throughout
            time.sleep(0.5)
        print(f"back to one replica {time.monotonic() - ended:.1f} s after the burst")
        assert fleet.infer("b", "after")["model"] == "b"  # the one left still serves
        events = [f for _, f in fleet.registry.client.xrange(fleet.registry.keys.events)]
        outs = [e["why"] for e in events if e["kind"] in ("placed", "restored") and e["why"]]
        ins = [e["why"] for e in events if e["kind"] == "evicted" and e["cause"] == "scale-in"]
        assert outs and outs[0].startswith("scale out b 1\u21922: "), outs
        assert ins and all(w.startswith("scale in b ") and "idle" in w for w in ins), ins
