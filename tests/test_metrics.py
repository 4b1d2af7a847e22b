"""Operator numbers: request outcomes in the registry, the status object, and /metrics."""

from __future__ import annotations

import json
import random
import socket
import time
import urllib.request
from collections.abc import Iterator

import pytest
import redis
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.openmetrics.exposition import generate_latest as openmetrics_latest
from prometheus_client.openmetrics.parser import (
    text_string_to_metric_families as openmetrics_families,
)
from prometheus_client.parser import text_string_to_metric_families
from typer.testing import CliRunner

from placement.ledger.load import hold_routing
from placement.ledger.registry import Registry
from placement.ledger.report import request_report
from placement.policy.state import COUNTS, OUTCOMES, Demand, Gpu
from placement.server.redis_server import RedisServer
from tasks.config import ROUTER_QUEUE
from tasks.operator.cli import app as cli
from tasks.operator.metrics import FleetCollector, serve, serve_on
from tasks.serving.status import full_status
from tests.fleets import GiB
from tests.ports import free_port


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    """Two 8 GiB GPUs with one HOT replica of a 1 GiB model "m"."""
    registry = Registry.from_url(redis_url, fleet)
    for i in range(2):
        gpu = Gpu(id=f"h0:{i}", host="h0", index=i, name="Sim 8GiB", total=8 * GiB)
        registry.register_worker(f"w{i}", "h0", f"{fleet}.q{i}", [gpu], warm_budget=2 * GiB)
    plan = registry.place(Demand("m", size=GiB), rng=random.Random(0))
    assert registry.confirm(plan.replica, plan.worker, plan.epoch)
    yield registry
    registry.client.close()


def scrape(
    registry: Registry, broker_url: str
) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    collectors = CollectorRegistry()
    collectors.register(FleetCollector(registry, broker_url))
    text = generate_latest(collectors).decode()
    # Prometheus asks for OpenMetrics first: the same page must parse in it too (two
    # families of one name, say a counter and a gauge, fail the whole scrape there)
    open_text = openmetrics_latest(collectors).decode()
    assert list(openmetrics_families(open_text))
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def test_picks_count_hits_and_the_router_counts_every_other_outcome(reg: Registry) -> None:
    for _ in range(3):
        lease = reg.pick("m", path="router")
        assert lease is not None
        reg.finish(lease)
    reg.count("m", "cold")
    reg.count("never", "rejected")
    stats = reg.stats()
    none = dict.fromkeys(COUNTS, 0)
    assert stats["m"] == {**none, "hit": 3, "cold": 1, "routed": 4}
    assert stats["never"] == {**none, "rejected": 1, "routed": 1}
    with pytest.raises(ValueError, match="unknown outcome"):
        reg.count("m", "lucky")


def test_a_call_counts_fast_with_its_lease_and_routed_with_the_routers_outcome(
    reg: Registry,
) -> None:
    for path in ("fast", "fast", "router", ""):  # "": a call counted already
        lease = reg.pick("m", path=path)
        assert lease is not None
        reg.finish(lease)
    assert reg.pick("absent", path="fast") is None  # a miss is not a fast call
    assert reg.pick("absent", path="router") is None  # the router counts its placement
    reg.count("absent", "cold")
    stats = reg.stats()
    assert (stats["m"]["hit"], stats["m"]["fast"], stats["m"]["routed"]) == (3, 2, 1)
    assert (stats["absent"]["fast"], stats["absent"]["routed"]) == (0, 1)
    fleet = request_report(stats)["fleet"]
    assert (fleet["fast"], fleet["routed"], fleet["requests"]) == (2, 2, 4)


def test_rates_follow_the_simulators_definitions() -> None:
    counts = {
        "a": {"hit": 8, "queued": 0, "warm": 1, "cold": 1, "rejected": 0, "busy": 5},
        "b": {"hit": 0, "queued": 1, "warm": 0, "cold": 3, "rejected": 1, "busy": 0},
        "idle": dict.fromkeys(OUTCOMES, 0),
    }
    report = request_report(counts)
    a, b = report["models"]["a"], report["models"]["b"]
    assert (a["requests"], a["reloads"]) == (10, 1)  # busy retries are not requests
    assert (b["requests"], b["reloads"]) == (5, 2)  # the first load is compulsory
    assert report["models"]["idle"]["hit_rate"] is None
    fleet = report["fleet"]
    assert fleet["requests"] == 15
    assert fleet["hit_rate"] == pytest.approx(8 / 15)
    assert fleet["reload_rate"] == pytest.approx(3 / 15)


def test_the_metrics_show_outcomes_memory_replicas_and_queue_depth(
    reg: Registry, redis_url: str, fleet: str
) -> None:
    lease = reg.pick("m", path="fast")
    assert lease is not None
    reg.count("m", "cold")
    broker = redis.Redis.from_url(redis_url)
    queue = f"{fleet}.q0"
    broker.rpush(queue, "m1", "m2", "m3")  # three messages waiting for worker w0
    try:
        samples = scrape(reg, redis_url)
    finally:
        broker.delete(queue)
        broker.close()
    snap = reg.snapshot()
    assert samples[("gpufleet_up", ())] == 1
    assert samples[("gpufleet_requests_total", (("model", "m"), ("outcome", "hit")))] == 1
    assert samples[("gpufleet_requests_total", (("model", "m"), ("outcome", "cold")))] == 1
    assert samples[("gpufleet_cache_hit_ratio", ())] == 0.5
    reserved = sum(g.reserved for g in snap.gpus.values())
    assert reserved > 0
    assert samples[("gpufleet_memory_utilization", ())] == pytest.approx(reserved / (16 * GiB))
    for gpu in snap.gpus.values():
        labels = (("gpu", gpu.id), ("host", "h0"), ("name", "Sim 8GiB"))
        assert samples[("gpufleet_gpu_reserved_bytes", labels)] == gpu.reserved
    assert samples[("gpufleet_replicas", (("level", "HOT"), ("model", "m")))] == 1
    assert samples[("gpufleet_inflight_requests", (("model", "m"),))] == 1
    assert samples[("gpufleet_queue_depth", (("queue", queue),))] == 3
    assert samples[("gpufleet_ledger_problems", ())] == 0


def test_calls_waiting_where_no_live_worker_takes_them_are_a_problem_and_a_series(
    reg: Registry,
) -> None:
    with RedisServer() as broker_server:  # its own broker: the router queue is global
        broker = redis.Redis.from_url(broker_server.url)
        broker.lpush(ROUTER_QUEUE, "call 1", "call 2")  # and no router has ever run
        samples = scrape(reg, broker_server.url)
        report = full_status(reg, broker_server.url)
        broker.close()
    assert samples[("gpufleet_stranded_calls", (("queue", ROUTER_QUEUE),))] == 2
    assert samples[("gpufleet_ledger_problems", ())] == 1
    assert report["stranded"] == {ROUTER_QUEUE: {"calls": 2, "last_worker": None}}
    assert report["problems"][0].startswith(f"2 call(s) wait on {ROUTER_QUEUE}")


def test_status_and_metrics_show_calls_waiting_and_running_per_model_and_replica(
    reg: Registry, redis_url: str
) -> None:
    leases = [reg.pick("m") for _ in range(3)]  # three calls sent to the one replica
    (replica,) = {lease.replica for lease in leases if lease is not None}
    hold_routing(reg, "m", "a-call-the-router-holds", True)
    samples = scrape(reg, redis_url)
    assert samples[("gpufleet_calls_now", (("model", "m"), ("state", "running")))] == 1
    assert samples[("gpufleet_calls_now", (("model", "m"), ("state", "waiting")))] == 2 + 1
    assert samples[("gpufleet_replicas_ready", (("model", "m"),))] == 1
    key = ("gpufleet_replica_calls_in_flight", (("model", "m"), ("replica", replica)))
    assert samples[key] == 3
    report = full_status(reg, redis_url)["load"]["m"]
    assert (report["waiting"], report["running"], report["routing"]) == (3, 1, 1)
    assert report["replicas"][replica] == {
        "level": "HOT", "in_flight": 3, "waiting": 2, "idle_ms": 0,
    }  # fmt: skip
    out = CliRunner().invoke(cli, ["status", "--redis-url", redis_url, "--fleet", reg.keys.fleet])
    assert "m 3 waiting, 1 running on 1 ready of 1 placed replicas (1 held by the router)" in (
        " ".join(out.output.split())
    ), out.output


def test_an_unreachable_registry_reports_down_instead_of_failing_the_scrape(
    redis_url: str, fleet: str
) -> None:
    dead = f"redis://127.0.0.1:{free_port()}/0"
    samples = scrape(Registry.from_url(dead, fleet), dead)
    assert samples == {("gpufleet_up", ()): 0}


def test_metrics_are_served_over_http(reg: Registry, redis_url: str) -> None:
    port = free_port()
    serve(port, "127.0.0.1", reg, redis_url)
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        body = response.read().decode()
    assert "gpufleet_up 1.0" in body
    assert 'gpufleet_replicas{level="HOT",model="m"} 1.0' in body


def test_metrics_are_served_on_a_socket_bound_before(reg: Registry, redis_url: str) -> None:
    """As a router under `gpufleet up` serves them: on the socket the launcher bound."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    port = sock.getsockname()[1]
    server = serve_on(sock, reg, redis_url)
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
            body = response.read().decode()
    finally:
        server.shutdown()
        server.server_close()
    assert 'gpufleet_replicas{level="HOT",model="m"} 1.0' in body


def test_status_prints_the_rates_against_their_targets(
    reg: Registry, redis_url: str, fleet: str
) -> None:
    for path in ("fast", "fast", "fast", "router"):
        lease = reg.pick("m", path=path)
        assert lease is not None
        reg.finish(lease)
    reg.count("m", "cold")
    result = CliRunner().invoke(cli, ["status", "--redis-url", redis_url, "--fleet", fleet])
    assert result.exit_code == 0, result.output
    assert "requests 5: hit rate 80.0% (target > 80%), reload rate 0.0%" in result.output
    assert "paths 3 fast (client to GPU worker), 2 through the router" in result.output


def test_status_names_the_worker_that_owns_each_gpu_and_whether_it_lives(
    reg: Registry, redis_url: str, fleet: str
) -> None:
    gone = Gpu(id="h1:0", host="h1", index=0, name="Sim 8GiB", total=8 * GiB)
    reg.register_worker("w-gone", "h1", f"{fleet}.q-gone", [gone], lease_ms=30)
    time.sleep(0.1)  # its lease lapses: the ledger still names it, as no live owner
    args = ["status", "--redis-url", redis_url, "--fleet", fleet]
    out = CliRunner().invoke(cli, [*args, "--json"])
    assert out.exit_code == 0, out.output
    report = json.loads(out.output)
    snap = reg.snapshot()
    shown = {g["id"]: (g["worker"], g["alive"]) for g in report["gpus"]}
    assert shown == {
        "h0:0": ("w0", True),
        "h0:1": ("w1", True),
        "h1:0": ("w-gone", False),
    }
    for gpu_id, (worker, alive) in shown.items():
        assert worker == snap.gpus[gpu_id].worker  # the ledger's owner
        owner = reg.owner(gpu_id)
        assert (owner[0] if owner else None) == (worker if alive else None)
    (dep,) = report["deployments"]
    assert dep["worker"] == snap.deployments[dep["replica"]].worker
    assert dep["worker"] == shown[next(iter(dep["gpus"]))][0]
    table = CliRunner().invoke(cli, args, terminal_width=100)
    assert table.exit_code == 0, table.output
    rows = {
        gpu_id: next(line for line in table.output.splitlines() if gpu_id in line)
        for gpu_id in shown
    }
    assert "w0" in rows["h0:0"] and "w1" in rows["h0:1"]
    assert "w-gone" in rows["h1:0"] and "dead" in rows["h1:0"]
    cells = [line.split("│")[5].strip() for line in table.output.splitlines() if "│" in line]
    assert cells.count("alive") == 2 and cells.count("lease expired") == 1


def test_each_tenant_s_usage_and_quota_counts_are_series_labelled_by_tenant(
    reg: Registry, redis_url: str
) -> None:
    from placement.ledger.tenancy import tenants, usage
    from placement.ledger.tenancy.usage import Usage
    from tasks.serving.tenants.accounting import used_by

    tenants.add(reg, "team-a", 1, "pw", max_running=2)
    tenants.add(reg, "team-b", 1, "pw")
    generated = {
        "outputs": {"tokens": [[1, 2, 3], [4]], "prompt_tokens": [5, 6]},
        "timings_ms": {"queue": 12.0, "compute": 80.0, "batch_calls": 4},
    }
    embedded = {"outputs": {"tokens": 9}, "timings_ms": {"queue": 3.0, "compute": 10.0}}
    for used in (used_by(generated), used_by(embedded), Usage(calls=1, failed=1)):
        usage.record(reg, "team-a", used)
    reg.client.zadd(reg.keys.tenant_running("team-a"), {"call-1": 1})  # one let in now
    samples = scrape(reg, redis_url)

    def of(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"tenant": "team-a", **labels}.items())))]

    assert of("gpufleet_tenant_calls_total", outcome="ok") == 2
    assert of("gpufleet_tenant_calls_total", outcome="failed") == 1
    assert of("gpufleet_tenant_gpu_seconds_total") == pytest.approx((80 / 4 + 10) / 1000)
    assert of("gpufleet_tenant_tokens_total", direction="in") == 5 + 6 + 9
    assert of("gpufleet_tenant_tokens_total", direction="out") == 3 + 1
    assert of("gpufleet_tenant_wait_seconds_total") == pytest.approx(0.015)
    assert of("gpufleet_tenant_let_in") == 1
    idle = (("outcome", "ok"), ("tenant", "team-b"))
    assert samples[("gpufleet_tenant_calls_total", idle)] == 0  # listed before its first call
