"""End to end: control reaches a busy worker at once, and one host has one owner.

Through a real `gpufleet up` (embedded or shared Redis, simulated GPUs) and a plain
Celery client, as users call it.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from placement.ledger.audit import audit
from placement.policy.state import Level
from tests.running import LARGE, REPO, TWO_MODELS, fleet_env, fleet_up

pytestmark = pytest.mark.slow

LEASE_MS = 3000
#: How long after its worker's backlog drains a replica may still be on its way back.
BACK_HOT_S = 30.0

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
            fleet.client.send_task("gpufleet.infer", args=("b", *LARGE)) for _ in range(BACKLOG)
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
ONE_MODEL = "models:\n  c: {source: synthetic, task: forward, memory: 256MiB}\n"


def shared_redis(tmp_path: Path, redis_url: str, fleet: str) -> tuple[Path, dict[str, str]]:
    """A catalog, and the environment of a fleet on the tests' Redis with host name "same"."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(TWO_MODELS)
    env = fleet_env(GPUFLEET_REDIS_URL=redis_url, GPUFLEET_FLEET=fleet, GPUFLEET_HOST="same")
    return catalog, env


def refused(*args: str, env: dict[str, str]) -> str:
    """`python -m *args` from the repository, expected to refuse on its own: what it printed.
    It runs with a home of its own, removed afterwards (a worker writes its in-hand record
    there before it refuses)."""
    home = tempfile.mkdtemp(prefix="gpufleet-refused-")
    try:
        done = subprocess.run(
            [sys.executable, "-m", *args],
            cwd=REPO,
            env={"GPUFLEET_HOME": home} | env,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        shutil.rmtree(home, ignore_errors=True)
    assert done.returncode != 0, done.stdout
    return done.stderr + done.stdout


def up_refused(catalog: Path, env: dict[str, str]) -> str:
    """`gpufleet up` expected to refuse (a second fleet, GPUs owned)."""
    return refused("tasks.operator.cli", "up", "--models", str(catalog), *SHARED_ARGS, env=env)


def celery_worker_refused(env: dict[str, str]) -> str:
    """A Celery worker started by hand, expected to refuse."""
    return refused(
        "celery", "-A", "tasks.app", "worker", "-Q", "x", "-n", "intruder@same", "-c", "1",
        "--without-gossip", "--without-mingle", env=env,
    )  # fmt: skip


def test_a_second_fleet_on_the_first_fleets_redis_database_refuses_and_runs_from_one_of_its_own(
    tmp_path: Path, redis_url: str, fleet: str, fleet_elsewhere: tuple[str, str]
) -> None:
    """The same fleet and host: the GPU is owned. Another fleet: the broker database is the
    first's (their routers would take each other's calls). Both hold for `gpufleet up` and
    for Celery workers started by hand. A database of its own: the second fleet runs, and
    each fleet's calls reach only its own GPUs."""
    catalog, env = shared_redis(tmp_path, redis_url, fleet)
    with fleet_up(catalog, SHARED_ARGS, env, fleet) as first:
        assert first.infer("a", "x")["model"] == "a"
        same = up_refused(catalog, env)
        assert "owned by live worker" in same and "still runs on this machine" in same
        assert "GPUFLEET_REDIS_URL" in same and "GPUFLEET_HOST" in same

        own_db, second_name = fleet_elsewhere
        second_catalog = tmp_path / "second.yaml"
        second_catalog.write_text(ONE_MODEL)
        second_env = env | {"GPUFLEET_FLEET": second_name, "GPUFLEET_HOST": "second"}
        other = up_refused(second_catalog, second_env)
        assert f"carries the calls of fleet {fleet!r}" in other
        assert "database of its own" in other

        # Celery workers started by hand: on the owned GPU, or of the other fleet.
        intruder = env | {
            "GPUFLEET_ROLE": "gpu",
            "GPUFLEET_SIM_GPUS": "1x4GiB",
            "GPUFLEET_MODELS": str(catalog),
        }
        assert "owned by live worker" in celery_worker_refused(intruder)
        stranger = intruder | {"GPUFLEET_FLEET": second_name, "GPUFLEET_ROLE": "router"}
        assert f"carries the calls of fleet {fleet!r}" in celery_worker_refused(stranger)
        assert first.infer("a", "still here")["model"] == "a"
        snap = first.registry.snapshot()
        (gpu,) = snap.gpus.values()
        assert gpu.worker.startswith("sim0@same") and gpu.alive(snap.now_ms)  # still the first's

        second_env["GPUFLEET_REDIS_URL"] = own_db
        with fleet_up(second_catalog, SHARED_ARGS, second_env, second_name) as second:
            for i in range(4):  # each client's calls reach only its own fleet
                assert first.infer("a", f"x{i}")["worker"].startswith("sim0@same")
                assert second.infer("c", f"x{i}")["worker"].startswith("sim0@second")
            with pytest.raises(Exception, match="it serves: c"):
                second.infer("a", "not in this catalog")


def test_a_pool_child_that_refuses_after_the_worker_started_stops_it_with_a_failing_status(
    tmp_path: Path, redis_url: str, fleet: str
) -> None:
    """A GPU worker's main process checks who owns its GPUs before it forks, but a check it
    could not make (Redis busy) falls to the pool child, which then stops the worker while
    it already consumes: a supervisor must read that as a failure, not a requested stop."""
    ready = tmp_path / "consuming"
    env = fleet_env(
        REFUSING_BROKER=redis_url, REFUSING_READY=str(ready), GPUFLEET_REDIS_URL=redis_url
    )
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", "tests.refusing_app", "worker", "-c", "1",
         "-Q", f"{fleet}-refusing", "-n", f"refusing-{fleet}@here",
         "--without-gossip", "--without-mingle"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert ready.exists(), done.stderr[-2000:]  # it did start consuming first
    assert "refused for the test" in done.stderr
    assert done.returncode != 0, done.stderr[-2000:]
