"""The fleet status object: what `gpufleet status --json` prints and `gpufleet.status` returns.

Pure: built from a `Snapshot`. Keys and units are part of the user contract; bytes
are integers, times are registry milliseconds.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from placement.ledger.audit import audit
from placement.ledger.figures import cache
from placement.policy.state import COUNTS, OUTCOMES, RESERVING, Snapshot
from placement.rules.scaling import ModelLoad

# Operator targets from the brief (seed 003); `gpufleet status` and the alert rules use them.
TARGETS = {"hit_rate": "> 0.8", "reload_rate": "< 0.2", "utilization": "0.7-0.85"}
SERVED = tuple(o for o in OUTCOMES if o != "busy")  # one per request; busy is per retry


def status_report(snap: Snapshot) -> dict[str, Any]:
    """GPUs, deployments, hosts' warm caches and ledger problems, as plain JSON types."""
    lru = cache.lru_ages_ms(snap)
    gpus = [
        {
            "id": g.id,
            "host": g.host,
            "index": g.index,
            "name": g.name,
            "total_bytes": g.total,
            "reserved_bytes": g.reserved,
            "held_bytes": g.held,
            "free_bytes": g.free,
            "contexts": dict(g.contexts),  # other workers' CUDA contexts here, in reserved
            "worker": g.worker,
            "queue": g.queue,
            "alive": g.alive(snap.now_ms),
            # now minus the last use of its LRU end, the replica an eviction takes first
            # (None: it holds none)
            "lru_age_ms": lru.get(g.id),
        }
        for g in sorted(snap.gpus.values(), key=lambda g: (g.host, g.index, g.id))
    ]
    deployments = [
        {
            "model": d.model,
            "replica": d.replica,
            "level": d.level.value,
            "gpus": dict(d.gpus),
            "fraction": d.fraction,
            "dedicated": d.dedicated,
            "inflight": d.leases,
            "last_used": d.last_used_ms,
            "host": d.host,
            "worker": d.worker,
            "size_bytes": d.size,
            "cached_bytes": d.cached,
            "epoch": d.epoch,
            "since": d.since_ms,
        }
        for d in sorted(snap.deployments.values(), key=lambda d: (d.model, d.replica))
    ]
    total = sum(g.total for g in snap.gpus.values())
    reserved = sum(g.reserved for g in snap.gpus.values())
    pinned = _pinned(snap)
    return {
        "now_ms": snap.now_ms,
        "gpus": gpus,
        "deployments": deployments,
        "hosts": [
            {
                "name": h.name,
                "warm_budget_bytes": h.warm_budget,
                "warm_used_bytes": h.warm_used,
                "pinned_bytes": pinned.get(h.name, 0),
            }
            for h in sorted(snap.hosts.values(), key=lambda h: h.name)
        ],
        "workers": [
            {
                "id": w,
                "alive": deadline > snap.now_ms,
                "reported_at": r.at_ms if (r := snap.reports.get(w)) else None,
                "pinned_bytes": r.pinned if r else 0,
                "holds": [
                    {
                        "replica": h.replica,
                        "epoch": h.epoch,
                        "level": h.level.value,
                        "gpus": dict(h.gpus),
                        "device_bytes": h.device_bytes,
                    }
                    for h in (r.holdings if r else ())
                ],
            }
            for w, deadline in sorted(snap.workers.items())
        ],
        "summary": {
            "gpus": len(gpus),
            "gpus_alive": sum(1 for g in gpus if g["alive"]),
            "total_bytes": total,
            "reserved_bytes": reserved,
            "utilization": reserved / total if total else 0.0,
            "replicas_on_gpu": sum(1 for d in snap.deployments.values() if d.level in RESERVING),
        },
        "problems": audit(snap),
    }


def _pinned(snap: Snapshot) -> dict[str, int]:
    """Host memory the live workers of each host report keeping pinned (their arenas and
    PyTorch's pinned cache), beside the warm cache the ledger charges."""
    host_of = {g.worker: g.host for g in snap.gpus.values() if g.worker}
    pinned: dict[str, int] = {}
    for worker, deadline in snap.workers.items():
        report = snap.reports.get(worker)
        if report is not None and deadline > snap.now_ms and worker in host_of:
            pinned[host_of[worker]] = pinned.get(host_of[worker], 0) + report.pinned
    return pinned


def request_report(stats: Mapping[str, Mapping[str, int]]) -> dict[str, Any]:
    """Requests by outcome, hit rate and reload rate, per model and for the fleet.

    The simulator's definitions: requests = hits + queued + warm + cold + rejected; a
    model's first load (warm or cold) is compulsory and every later one is a reload;
    rates are per request, None before the first request. `fast` and `routed` count the
    calls by the way they came (`PATHS`), beside the outcomes.
    """
    models = {model: _figures(dict(counts)) for model, counts in sorted(stats.items())}
    total = {o: sum(m[o] for m in models.values()) for o in COUNTS}
    fleet = _figures(total, reloads=sum(m["reloads"] for m in models.values()))
    return {"fleet": fleet, "models": models, "targets": TARGETS}


def _figures(counts: dict[str, int], reloads: int | None = None) -> dict[str, Any]:
    requests = sum(counts.get(o, 0) for o in SERVED)
    loads = counts.get("warm", 0) + counts.get("cold", 0)
    reloads = max(0, loads - 1) if reloads is None else reloads
    return {
        **{o: counts.get(o, 0) for o in COUNTS},
        "requests": requests,
        "reloads": reloads,
        "hit_rate": counts.get("hit", 0) / requests if requests else None,
        "reload_rate": reloads / requests if requests else None,
    }


def load_report(loads: Iterable[ModelLoad]) -> dict[str, Any]:
    """Each model's calls waiting and running, and each placed replica's calls in flight.

    `waiting` counts calls queued behind the one a replica runs (a GPU worker runs one
    call at a time) plus those the router holds (`routing`: a miss being placed, a busy
    retry); what the scaling rule compares with its threshold is `waiting` per `ready`.
    """
    return {
        load.model: {
            "waiting": load.waiting,
            "running": load.running,
            "routing": load.routing,
            "ready": load.ready,
            "placed": len(load.replicas),
            "replicas": {
                r.replica: {
                    "level": r.level.value,
                    "in_flight": r.in_flight,
                    "waiting": r.waiting if r.ready else r.in_flight,
                    "idle_ms": r.idle_ms,
                }
                for r in load.replicas
            },
        }
        for load in sorted(loads, key=lambda m: m.model)
    }
