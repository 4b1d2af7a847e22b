"""End to end: control reaches a busy worker at once, and one host has one owner.

Through a real `gpufleet up` (embedded or shared Redis, simulated GPUs) and a plain
Celery client, as users call it.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from placement.audit import audit
from placement.registry import Registry
from placement.state import Level
from tests.running import REPO, TWO_MODELS, fleet_env, fleet_up

pytestmark = pytest.mark.slow

LEASE_MS = 3000
#: How long after its worker's backlog drains a replica may still be on its way back.
BACK_HOT_S = 30.0

LARGE = ["y" * 2000] * 2  # with max_length 512: about 0.2-0.3 s of compute for b
BACKLOG = 30


def test_an_evict_under_a_backlog_settles_at_once_and_the_model_comes_back_hot(
    tmp_path: Path,
) -> None:
    """Issue 9's four steps: a backlog on B, evict A, call A at once."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(TWO_MODELS)
    env = fleet_env(GPUFLEET_WARM_CACHE="4GiB", GPUFLEET_WORKER_LEASE_MS=str(LEASE_MS))
    with fleet_up(catalog, ["--sim-gpus", "1x4GiB", "--metrics-port", "0"], env) as fleet:
        first = {m: fleet.infer(m, "x") for m in ("a", "b")}  # both HOT on the one GPU
        backlog = [
            fleet.client.send_task("gpufleet.infer", args=("b", LARGE, {"max_length": 512}))
            for _ in range(BACKLOG)
        ]
        time.sleep(1.0)  # the calls reach the worker's queue
        started = time.monotonic()
        evicted = fleet.client.send_task("gpufleet.evict", args=("a",)).get(timeout=60)
        evict_s = time.monotonic() - started
        again = fleet.client.send_task("gpufleet.infer", args=("a", "x"))
        assert [e["level"] for e in evicted["evicted"]] == ["WARM"]  # settled by its worker
        durations = [r.get(timeout=300)["timings_ms"]["compute"] for r in backlog]
        drained = time.monotonic()
        print(f"evict {evict_s:.3f} s under a backlog that drained in {drained - started:.1f} s")
        assert evict_s < (drained - started) / 2, (evict_s, drained - started)
        assert evict_s < 5 * max(durations) / 1000 + 2.0  # about one call, not the backlog
        restored = again.get(timeout=120)
        assert restored["outputs"] == first["a"]["outputs"]
        assert restored["cache"] == "warm"

        # Within the bound A is HOT where the ledger says, and calls for it are hits.
        while True:
            (record,) = [d for d in fleet.registry.snapshot().replicas("a")]
            if record.level is Level.HOT:
                break
            assert time.monotonic() - drained < BACK_HOT_S, record
            time.sleep(0.1)
        hit = fleet.infer("a", "x")
        assert hit["cache"] == "hot" and hit["gpus"] == sorted(record.gpus)
        kinds = [e["kind"] for e in fleet.registry.events() if e["replica"] == record.replica]
        assert kinds[-4:] == ["evicted", "settled", "restored", "ready"]
        time.sleep(LEASE_MS / 1000 + 1)  # a heartbeat reports the holdings after it
        assert audit(fleet.registry.snapshot(), grace_ms=LEASE_MS) == []


SHARED_ARGS = ["--sim-gpus", "1x4GiB", "--metrics-port", "0"]


def shared_redis(tmp_path: Path, redis_url: str, fleet: str) -> tuple[Path, dict[str, str]]:
    """A catalog, and the environment of a fleet on the tests' Redis with host name "same"."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(TWO_MODELS)
    env = fleet_env(GPUFLEET_REDIS_URL=redis_url, GPUFLEET_FLEET=fleet, GPUFLEET_HOST="same")
    return catalog, env


def test_a_second_fleet_with_the_same_host_name_refuses_and_the_first_keeps_serving(
    tmp_path: Path, redis_url: str, fleet: str
) -> None:
    catalog, env = shared_redis(tmp_path, redis_url, fleet)
    args = SHARED_ARGS
    with fleet_up(catalog, args, env, fleet) as first:
        assert first.infer("a", "x")["model"] == "a"
        second = subprocess.run(
            [sys.executable, "-m", "tasks.cli", "up", "--models", str(catalog), *args],
            cwd=REPO,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert second.returncode != 0
        assert "owned by live worker" in second.stderr
        assert "GPUFLEET_FLEET" in second.stderr and "GPUFLEET_HOST" in second.stderr
        assert first.infer("a", "still here")["model"] == "a"
        snap = first.registry.snapshot()
        assert [g.alive(snap.now_ms) for g in snap.gpus.values()] == [True]


def test_a_celery_worker_started_by_hand_on_owned_gpus_refuses_to_start(
    tmp_path: Path, redis_url: str, fleet: str
) -> None:
    catalog, env = shared_redis(tmp_path, redis_url, fleet)
    with fleet_up(catalog, SHARED_ARGS, env, fleet) as first:
        intruder = env | {
            "GPUFLEET_ROLE": "gpu",
            "GPUFLEET_SIM_GPUS": "1x4GiB",
            "GPUFLEET_MODELS": str(catalog),
        }
        done = subprocess.run(
            [sys.executable, "-m", "celery", "-A", "tasks.app", "worker", "-Q", "x", "-n",
             "intruder@same", "-c", "1", "--without-gossip", "--without-mingle"],
            cwd=REPO,
            env=intruder,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )  # fmt: skip
        assert done.returncode != 0
        assert "owned by live worker" in done.stderr + done.stdout
        assert first.infer("a", "x")["model"] == "a"
        owners = {g.worker for g in Registry.from_url(redis_url, fleet).snapshot().gpus.values()}
        assert all(w.startswith("sim0@same") for w in owners)
