"""The operator numbers as Prometheus metrics, built from the status object (`tasks.serving.status`)
at each scrape.

Every figure comes from the registry and the broker when it is asked for, so any process
can serve them and all agree: `gpufleet status`, the `gpufleet.status` task, `gpufleet
metrics` (a standalone exporter), and a router started with GPUFLEET_METRICS_PORT (or, under
`gpufleet up`, GPUFLEET_METRICS_FD: a socket the launcher bound and passed down). The
figures are fleet-wide: with several routers exporting, scrape one or aggregate with
`max without (instance)`.
"""

from __future__ import annotations

import logging
import socket
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

from celery.signals import worker_init
from prometheus_client import CollectorRegistry, MetricsHandler, start_http_server
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from placement.errors import GpufleetError
from placement.ledger.registry import Registry
from placement.policy.state import OUTCOMES, PATHS, PREFIX_ROUTES
from tasks import context
from tasks.serving.status import full_status

log = logging.getLogger(__name__)


class FleetCollector(Collector):
    """Prometheus metrics built from `full_status` at each scrape."""

    def __init__(self, registry: Registry, broker_url: str) -> None:
        self.registry = registry
        self.broker_url = broker_url

    def collect(self) -> Iterator[Metric]:
        up = GaugeMetricFamily("gpufleet_up", "1 when the registry and broker answered")
        try:
            report = full_status(self.registry, self.broker_url, adapter_files=False)
        except GpufleetError as exc:
            log.warning("metrics scrape failed: %s", exc)
            up.add_metric([], 0)
            yield up
            return
        up.add_metric([], 1)
        yield up
        yield from _requests(report["requests"])
        yield from _memory(report)
        yield from _replicas(report)
        yield from _load(report["load"])
        yield from _generation(report["generation"])
        yield from _cache(report["cache"], report["gpus"])
        yield from _tenants(report["tenants"])
        depth = GaugeMetricFamily(
            "gpufleet_queue_depth", "Messages waiting in a fleet queue", labels=["queue"]
        )
        for queue, waiting in report["queues"].items():
            depth.add_metric([queue], waiting)
        yield depth
        stranded = GaugeMetricFamily(
            "gpufleet_stranded_calls",
            "Calls on a queue that no live worker takes, or held by a dead worker (0)",
            labels=["queue"],
        )
        for queue, entry in report["stranded"].items():
            stranded.add_metric([queue], entry["calls"])
        yield stranded
        problems = GaugeMetricFamily(
            "gpufleet_ledger_problems",
            "Status problems: ledger audit findings, stranded and quarantined calls (0)",
        )
        problems.add_metric([], len(report["problems"]))
        yield problems


def _requests(requests: dict[str, Any]) -> Iterator[Metric]:
    outcomes = CounterMetricFamily(
        "gpufleet_requests",
        "Requests by outcome: hit, queued (replica loading), warm or cold load, rejected, "
        "busy (retried)",
        labels=["model", "outcome"],
    )
    reloads = CounterMetricFamily(
        "gpufleet_reloads", "Loads of a model after its first", labels=["model"]
    )
    paths = CounterMetricFamily(
        "gpufleet_calls",
        "Calls by the way they came: fast (client straight to a GPU worker) or routed",
        labels=["model", "path"],
    )
    prefix = CounterMetricFamily(
        "gpufleet_prefix_routes",
        "Generating calls by how prefix routing chose their replica: hit (the one that served"
        " their prompt's prefix), spill (it was too busy), new (none had served it)",
        labels=["model", "route"],
    )
    for model, figures in requests["models"].items():
        for outcome in OUTCOMES:
            outcomes.add_metric([model, outcome], figures[outcome])
        reloads.add_metric([model], figures["reloads"])
        for path in PATHS:
            paths.add_metric([model, path], figures[path])
        for route in PREFIX_ROUTES:
            prefix.add_metric([model, route.removeprefix("prefix_")], figures[route])
    yield outcomes
    yield reloads
    yield paths
    yield prefix
    fleet = requests["fleet"]
    for name, key, target in (
        ("gpufleet_cache_hit_ratio", "hit_rate", "above 0.8"),
        ("gpufleet_reload_ratio", "reload_rate", "below 0.2"),
    ):
        if fleet[key] is not None:
            gauge = GaugeMetricFamily(name, f"Since the fleet began (target {target})")
            gauge.add_metric([], fleet[key])
            yield gauge


def _tenants(rows: list[dict[str, Any]]) -> Iterator[Metric]:
    """Per tenant (docs/metrics.md, "Tenants"): its calls, GPU time, tokens and waiting
    (counters), and its calls waiting and let in under its quota now (gauges)."""
    label = ["tenant"]
    calls = CounterMetricFamily(
        "gpufleet_tenant_calls", "A tenant's calls answered, by outcome", labels=[*label, "outcome"]
    )
    gpu = CounterMetricFamily(
        "gpufleet_tenant_gpu_seconds", "A tenant's share of the forward passes' time", labels=label
    )
    tokens = CounterMetricFamily(
        "gpufleet_tenant_tokens", "A tenant's tokens, in (prompts, inputs) and out (generated)",
        labels=[*label, "direction"],
    )  # fmt: skip
    wait = CounterMetricFamily(
        "gpufleet_tenant_wait_seconds", "A tenant's calls' time from router to pass", labels=label
    )
    queued = GaugeMetricFamily(
        "gpufleet_tenant_queued", "A tenant's calls waiting now (queues, parked)", labels=label
    )
    let_in = GaugeMetricFamily(
        "gpufleet_tenant_let_in", "A tenant's calls holding a running slot now", labels=label
    )
    for row in rows:
        name = [row["name"]]
        calls.add_metric([*name, "ok"], row["calls"] - row["failed"])
        calls.add_metric([*name, "failed"], row["failed"])
        gpu.add_metric(name, row["gpu_seconds"])
        tokens.add_metric([*name, "in"], row["tokens_in"])
        tokens.add_metric([*name, "out"], row["tokens_out"])
        wait.add_metric(name, (row["mean_wait_s"] or 0.0) * row["calls"])
        queued.add_metric(name, row["queued"])
        let_in.add_metric(name, row["let_in"])
    yield from (calls, gpu, tokens, wait, queued, let_in)


def _generation(models: dict[str, Any]) -> Iterator[Metric]:
    """Generating calls: tokens (a counter: tokens/s is its rate), time to first token and
    between tokens (histograms), and the KV cache held against its budget."""
    tokens = CounterMetricFamily(
        "gpufleet_generated_tokens",
        "Tokens generated (rate(): tokens per second)",
        labels=["model"],
    )
    ttft = HistogramMetricFamily(
        "gpufleet_time_to_first_token_seconds",
        "From a generating call reaching its replica's batch to its first token",
        labels=["model"],
    )
    itl = HistogramMetricFamily(
        "gpufleet_inter_token_seconds",
        "Mean time between a generating call's tokens after its first, per call",
        labels=["model"],
    )
    held = GaugeMetricFamily(
        "gpufleet_kv_cache_tokens", "KV-cache tokens running batches hold now", labels=["model"]
    )
    budget = GaugeMetricFamily(
        "gpufleet_kv_cache_budget_tokens", "A replica's KV-cache budget", labels=["model"]
    )
    blocks = GaugeMetricFamily(
        "gpufleet_kv_cache_blocks", "Paged KV-cache blocks by state (in_use, cached, free)",
        labels=["model", "state"],
    )  # fmt: skip
    hits = GaugeMetricFamily(
        "gpufleet_kv_prefix_hit_ratio",
        "Prompt tokens read from cached KV blocks, over prompt tokens admitted",
        labels=["model"],
    )
    adapters = GaugeMetricFamily(
        "gpufleet_adapters_held",
        "LoRA adapters in a replica's slots now",
        labels=["model", "replica"],
    )
    adapter_events = GaugeMetricFamily(
        "gpufleet_adapter_events",
        "What the live replicas' adapter rooms did since laid out (hit, load, eviction)",
        labels=["model", "event"],
    )
    for model, figures in models.items():
        for replica, count in figures["adapters_by_replica"].items():
            adapters.add_metric([model, replica], count)
        for event in ("hit", "load", "eviction"):
            adapter_events.add_metric([model, event], figures[f"adapter_{event}s"])
        tokens.add_metric([model], figures["tokens"])
        ttft.add_metric([model], figures["ttft_buckets"], figures["ttft_sum_s"])
        itl.add_metric([model], figures["itl_buckets"], figures["itl_sum_s"])
        held.add_metric([model], figures["kv_held_tokens"])
        if figures["kv_budget_tokens"] is not None:
            budget.add_metric([model], figures["kv_budget_tokens"])
        for state in ("in_use", "cached", "free"):
            blocks.add_metric([model, state], figures[f"kv_blocks_{state}"])
        if figures["prefix_hit_rate"] is not None:
            hits.add_metric([model], figures["prefix_hit_rate"])
    yield from (tokens, ttft, itl, held, budget, blocks, hits, adapters, adapter_events)


#: The model cache's histograms (`placement.ledger.figures.cache`): metric name and help, by the
#: status object's name for each.
CACHE_HISTOGRAMS = {
    "load": (
        "gpufleet_load_duration_seconds",
        "How long each load of a replica onto its GPUs (from disk, or a neighbour's warm "
        "copy) took, until HOT",
    ),
    "restore": (
        "gpufleet_restore_duration_seconds",
        "How long each restore of a worker's warm (CPU) copy onto GPUs took, until HOT",
    ),
    "miss": (
        "gpufleet_miss_latency_seconds",
        "Per call that found no HOT replica (warm, cold or queued), how long it waited at "
        "its GPU worker for its replica to become ready",
    ),
    "eviction_age": (
        "gpufleet_eviction_age_seconds",
        "A replica's age when evicted (any cause), from its placement on its GPUs",
    ),
}


def _cache(models: dict[str, Any], gpus: list[dict[str, Any]]) -> Iterator[Metric]:
    """The model cache's figures: per model, its loads', restores', misses' and evictions'
    histograms (every model of the catalog and the ledger, zeros at first: declared from
    the first scrape); per GPU, the age of its LRU end (absent while it holds none)."""
    families = {
        name: HistogramMetricFamily(metric, help_text, labels=["model"])
        for name, (metric, help_text) in CACHE_HISTOGRAMS.items()
    }
    for model, figures in models.items():
        for name, family in families.items():
            family.add_metric([model], figures[f"{name}_buckets"], figures[f"{name}_sum_s"])
    yield from families.values()
    lru = GaugeMetricFamily(
        "gpufleet_lru_age_seconds",
        "Now minus the last use of the least recently used replica an eviction may take "
        "from a GPU (HOT, idle, not dedicated)",
        labels=["gpu"],
    )
    for gpu in gpus:
        if gpu["lru_age_ms"] is not None:
            lru.add_metric([gpu["id"]], gpu["lru_age_ms"] / 1000)
    yield lru


def _memory(report: dict[str, Any]) -> Iterator[Metric]:
    labels = ["gpu", "host", "name"]
    total = GaugeMetricFamily("gpufleet_gpu_memory_bytes", "GPU memory", labels=labels)
    reserved = GaugeMetricFamily(
        "gpufleet_gpu_reserved_bytes", "GPU memory the ledger reserves", labels=labels
    )
    alive = GaugeMetricFamily(
        "gpufleet_gpu_alive", "1 while its worker's lease holds", labels=labels
    )
    for gpu in report["gpus"]:
        key = [gpu["id"], gpu["host"], gpu["name"]]
        total.add_metric(key, gpu["total_bytes"])
        reserved.add_metric(key, gpu["reserved_bytes"])
        alive.add_metric(key, 1 if gpu["alive"] else 0)
    yield from (total, reserved, alive)
    utilization = GaugeMetricFamily(
        "gpufleet_memory_utilization", "Reserved / total GPU memory (target 0.7-0.85)"
    )
    utilization.add_metric([], report["summary"]["utilization"])
    yield utilization
    warm = GaugeMetricFamily(
        "gpufleet_warm_cache_bytes", "A host's CPU warm cache", labels=["host", "kind"]
    )
    for host in report["hosts"]:
        warm.add_metric([host["name"], "used"], host["warm_used_bytes"])
        warm.add_metric([host["name"], "budget"], host["warm_budget_bytes"])
        warm.add_metric([host["name"], "pinned"], host["pinned_bytes"])
    yield warm


def _replicas(report: dict[str, Any]) -> Iterator[Metric]:
    replicas = GaugeMetricFamily(
        "gpufleet_replicas", "Replicas by residency level", labels=["model", "level"]
    )
    inflight = GaugeMetricFamily(
        "gpufleet_inflight_requests", "Live request leases", labels=["model"]
    )
    levels: dict[tuple[str, str], int] = {}
    leases: dict[str, int] = {}
    for dep in report["deployments"]:
        key = (dep["model"], dep["level"])
        levels[key] = levels.get(key, 0) + 1
        leases[dep["model"]] = leases.get(dep["model"], 0) + dep["inflight"]
    for (model, level), count in sorted(levels.items()):
        replicas.add_metric([model, level], count)
    for model, count in sorted(leases.items()):
        inflight.add_metric([model], count)
    yield replicas
    yield inflight


def _load(load: dict[str, Any]) -> Iterator[Metric]:
    calls = GaugeMetricFamily(
        "gpufleet_calls_now",  # not `gpufleet_calls`: OpenMetrics names the path counter so
        "Calls of a model now: running, or waiting (queued behind a running call at a "
        "replica, or held by the router); scaling compares waiting per ready replica",
        labels=["model", "state"],
    )
    ready = GaugeMetricFamily("gpufleet_replicas_ready", "HOT replicas", labels=["model"])
    per_replica = GaugeMetricFamily(
        "gpufleet_replica_calls_in_flight",
        "Calls sent to a replica, queued or running",
        labels=["model", "replica"],
    )
    for model, figures in load.items():
        calls.add_metric([model, "running"], figures["running"])
        calls.add_metric([model, "waiting"], figures["waiting"])
        ready.add_metric([model], figures["ready"])
        for replica, one in figures["replicas"].items():
            per_replica.add_metric([model, replica], one["in_flight"])
    yield from (calls, ready, per_replica)


def serve(port: int, addr: str, registry: Registry, broker_url: str) -> None:
    """Serve /metrics on `addr:port` from a background thread."""
    start_http_server(port, addr=addr, registry=_collectors(registry, broker_url))


def serve_on(sock: socket.socket, registry: Registry, broker_url: str) -> ThreadingHTTPServer:
    """Serve /metrics from a background thread on `sock`, a socket already bound and
    listening: `gpufleet up` binds it before it starts the router and passes it down, so
    the port it prints is the one served, and no other process can take it in between."""
    handler = MetricsHandler.factory(_collectors(registry, broker_url))
    server = ThreadingHTTPServer(sock.getsockname()[:2], handler, bind_and_activate=False)
    server.socket.close()  # the unbound one the constructor made
    server.socket = sock
    threading.Thread(target=server.serve_forever, name="metrics", daemon=True).start()
    return server


def _collectors(registry: Registry, broker_url: str) -> CollectorRegistry:
    collectors = CollectorRegistry()
    collectors.register(FleetCollector(registry, broker_url))
    return collectors


@worker_init.connect
def _serve_from_router(**_: Any) -> None:
    """A router with GPUFLEET_METRICS_FD (the socket `gpufleet up` bound) or
    GPUFLEET_METRICS_PORT exports the metrics (from its parent process)."""
    if context.role() != "router":
        return
    settings = context.settings()
    if settings.metrics_fd is not None:
        try:
            sock = socket.socket(fileno=settings.metrics_fd)
            addr, port = sock.getsockname()[:2]
            serve_on(sock, context.registry(), settings.broker_url)
            log.info("metrics on http://%s:%d/metrics", addr, port)
        except OSError as exc:  # not a socket: the router serves its calls all the same
            log.error("not exporting metrics on fd %d: %s", settings.metrics_fd, exc)
        return
    if settings.metrics_port is None:
        return
    try:
        serve(settings.metrics_port, settings.metrics_addr, context.registry(), settings.broker_url)
        log.info("metrics on http://%s:%d/metrics", settings.metrics_addr, settings.metrics_port)
    except OSError as exc:  # a busy port must not stop the router
        log.error("not exporting metrics on port %d: %s", settings.metrics_port, exc)
