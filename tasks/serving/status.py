"""The status object: what `gpufleet status --json` prints, the `gpufleet.status` task
returns and the Prometheus metrics are built from (`tasks.operator.metrics`).

Every figure is read from the registry and the broker when it is asked for, so any process
can build it and all agree: the ledger's report (`placement.ledger.report`), request outcomes,
each model's load, what generating calls took and the KV cache they hold
(`placement.ledger.figures.generation`), the model cache's figures (`cache`:
`placement.ledger.figures.cache`), the depth of every fleet queue (each tenant's too, and per
tenant the calls waiting: `tenants`), the calls no live worker will take (`stranded`), the
calls quarantined (`tasks.broker.quarantine`), and where the broker's Redis is now
(`redis`: its primary, replicas and Sentinels).
"""

from __future__ import annotations

from typing import Any

import redis

from placement.catalog import adapters
from placement.errors import GpufleetError
from placement.ledger import endpoint
from placement.ledger.figures import cache, generation
from placement.ledger.figures.histograms import Histogram
from placement.ledger.load import placed_replicas, read_loads
from placement.ledger.registry import Registry
from placement.ledger.report import load_report, request_report, status_report
from placement.ledger.tenancy import quotas, tenants, usage
from placement.ledger.tenancy.tenants import Tenant, split_queue, tenant_of
from placement.ledger.tenancy.usage import Usage
from placement.policy.state import Snapshot
from tasks import context
from tasks.broker import presence, quarantine
from tasks.config import ROUTER_QUEUES


def full_status(
    registry: Registry, broker_url: str, *, adapter_files: bool = True
) -> dict[str, Any]:
    """The registry's status report, request outcomes, and the depth of every fleet queue;
    without `adapter_files`, adapters' files are not read for their faults (a metrics
    scrape reports none of them)."""
    snap = registry.snapshot()
    report = status_report(snap)
    report["requests"] = request_report(registry.stats(snap))
    placed = placed_replicas(snap.deployments.values(), snap.by_model)
    report["load"] = load_report(read_loads(registry, placed))
    report["generation"] = generation_report(registry, snap, adapter_files=adapter_files)
    report["cache"] = cache_report(registry, snap)
    found = tenants.records(registry)
    fleet_queues = {*ROUTER_QUEUES} | {g.queue for g in snap.gpus.values() if g.queue}
    fleet_queues |= {t.queue for t in found.values()}
    queues = set(presence.with_tenants(fleet_queues, found))
    client = endpoint.connect(broker_url)
    try:
        pipe = client.pipeline(transaction=False)
        for queue in sorted(queues):
            for name in presence.lists(queue):
                pipe.llen(name)
        depths = iter(pipe.execute())
        report["queues"] = {
            q: sum(int(next(depths)) for _ in presence.PRIORITY_STEPS) for q in sorted(queues)
        }
        report["tenants"] = tenants_report(
            found,
            report["queues"],
            quotas.held(registry, [t.name for t in found.values() if t.limited]),
            usage.read(registry, list(found)),
        )
        report["stranded"] = presence.stranded(client, queues, snap.live_queues)
        report["quarantined"] = quarantine.count(client)
        report["problems"] = (
            report["problems"]
            + presence.stranded_problems(report["stranded"])
            + quarantine.problems(report["quarantined"])
        )
    except redis.RedisError as exc:
        raise GpufleetError(f"broker unreachable: {exc}. Check GPUFLEET_BROKER_URL.") from exc
    finally:
        client.close()
    report["redis"] = endpoint.parse(broker_url).topology()
    return report


def tenants_report(
    found: dict[str, Tenant],
    depths: dict[str, int],
    held: dict[str, tuple[int, int]],
    used: dict[str, Usage],
) -> list[dict[str, Any]]:
    """Per tenant: its weight, whether it was removed (its calls still drain), its quotas,
    how many of its calls wait on its queues (its public one and its GPU workers' ones,
    and parked for a running slot), how many are let in under its quota (`held`:
    name -> (let in, parked), `placement.ledger.tenancy.quotas.held`), and what its calls used
    (`used`, `placement.ledger.tenancy.usage`)."""
    waiting: dict[str, int] = {}
    for queue, depth in depths.items():
        name = tenant_of(queue) or split_queue(queue)[1]
        waiting[name] = waiting.get(name, 0) + depth
    rows = []
    for t in found.values():
        let_in, parked = held.get(t.name, (0, 0))
        rows.append(
            {
                "name": t.name,
                "weight": t.weight,
                "removed": t.removed,
                "max_running": t.max_running,
                "max_queued": t.max_queued,
                "queued": waiting.get(t.name, 0) + parked,
                "parked": parked,
                "let_in": let_in,
                **used.get(t.name, Usage()).report(),
            }
        )
    return rows


def generation_report(
    registry: Registry, snap: Snapshot, *, adapter_files: bool = True
) -> dict[str, Any]:
    """Per generation model: its KV-cache budget (from the catalog, when this process has
    it), the tokens its running batches hold now, its replicas' KV blocks in use, cached
    and free and the share of prompt tokens read from cached blocks, and what its calls
    took."""
    figures = generation.read(registry)
    replicas = {r: d.model for r, d in snap.deployments.items()}
    held = generation.kv_held(registry, replicas)
    report: dict[str, Any] = {}
    for model in sorted({*figures, *(replicas[r] for r in held)}):
        budget = _budget(model)
        done = figures.get(model) or generation.nothing()
        mine = {r: k for r, k in held.items() if replicas[r] == model}
        kv = list(mine.values())

        def total(name: str, of: list[dict[str, float]] = kv) -> int:
            return int(sum(k.get(name, 0) for k in of))

        prompts = total("prompt_tokens")
        report[model] = {
            "kv_budget_tokens": budget.tokens if budget else None,
            "kv_budget_bytes": budget.bytes if budget else None,
            "kv_held_tokens": total("held_tokens"),
            "kv_blocks_in_use": total("blocks_in_use"),
            "kv_blocks_cached": total("blocks_cached"),
            "kv_blocks_free": total("blocks_free"),
            "prefix_hit_rate": round(total("reused_tokens") / prompts, 4) if prompts else None,
            # its LoRA adapters (`worker.adapters.room`): held by each replica, and what
            # the replicas' rooms did since they were laid out
            "adapters_by_replica": {
                r: int(k["adapters_held"]) for r, k in mine.items() if "adapters_held" in k
            },
            "adapter_hits": total("adapter_hits"),
            "adapter_loads": total("adapter_loads"),
            "adapter_evictions": total("adapter_evictions"),
            # the median load into a slot, from the worker's shelf and from disk (the
            # highest of its replicas'; 0: none yet)
            "adapter_load_p50_ms": {
                where: max((k.get(f"adapter_load_{where}_ms_p50", 0.0) for k in kv), default=0.0)
                for where in ("shelf", "disk")
            },
            "adapter_problems": _adapter_problems(model) if adapter_files else {},
            "calls": done.calls,
            "tokens": done.tokens,
            "ttft_mean_ms": _mean_ms(done.ttft),
            "inter_token_mean_ms": _mean_ms(done.itl),
            "ttft_buckets": done.ttft.buckets,
            "ttft_sum_s": done.ttft.sum,
            "itl_buckets": done.itl.buckets,
            "itl_sum_s": done.itl.sum,
        }
    return report


def cache_report(registry: Registry, snap: Snapshot) -> dict[str, Any]:
    """Per model, the model cache's figures (`placement.ledger.figures.cache`): its loads from disk
    (or a neighbour's warm copy) and restores of warm copies, its misses' waits for their
    replica, and its replicas' ages at eviction, each a histogram in seconds with its count,
    sum and mean. Every model of the catalog (when this process has it) and of the ledger
    has them, zeros before its first figure, so a dashboard finds them from the start."""
    models = {*snap.by_model, *_catalog_models()}
    report: dict[str, Any] = {}
    for model, figures in cache.read(registry, models).items():
        report[model] = {}
        for name, histogram in figures.items():
            report[model] |= {
                f"{name}_count": histogram.count,
                f"{name}_sum_s": round(histogram.sum, 6),
                f"{name}_mean_s": (
                    round(histogram.sum / histogram.count, 6) if histogram.count else None
                ),
                f"{name}_buckets": histogram.buckets,
            }
    return report


def _catalog_models() -> list[str]:
    try:
        return list(context.catalog())
    except GpufleetError:  # no catalog here: the ledger's models only
        return []


def _budget(model: str) -> Any:
    try:
        return context.catalog().get(model).kv_budget()
    except GpufleetError:  # no catalog here, or a model it does not list
        return None


def _adapter_problems(model: str) -> dict[str, str]:
    """Why each adapter of `model` that cannot be served cannot, as its files show here
    (`placement.catalog.adapters.problem`); whether one fits its base the worker says at
    its first call."""
    try:
        listed = context.catalog().adapters_of(model)
    except GpufleetError:  # no catalog here
        return {}
    if listed is None:
        return {}
    found = {name: adapters.problem(path) for name, path in listed.source.listing().items()}
    return {name: why for name, why in found.items() if why is not None}


def _mean_ms(histogram: Histogram) -> float | None:
    return round(histogram.sum / histogram.count * 1000, 3) if histogram.count else None
