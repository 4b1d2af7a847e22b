"""The fleet status object: what `gpufleet status --json` prints and `gpufleet.status` returns.

Pure: built from a `Snapshot`. Keys and units are part of the user contract; bytes
are integers, times are registry milliseconds.
"""

from __future__ import annotations

from typing import Any

from placement.audit import audit
from placement.state import ON_GPU, Snapshot


def status_report(snap: Snapshot) -> dict[str, Any]:
    """GPUs, deployments, hosts' warm caches and ledger problems, as plain JSON types."""
    gpus = [
        {
            "id": g.id,
            "host": g.host,
            "index": g.index,
            "name": g.name,
            "total_bytes": g.total,
            "reserved_bytes": g.reserved,
            "free_bytes": g.free,
            "worker": g.worker,
            "queue": g.queue,
            "alive": g.alive(snap.now_ms),
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
        }
        for d in sorted(snap.deployments.values(), key=lambda d: (d.model, d.replica))
    ]
    total = sum(g.total for g in snap.gpus.values())
    reserved = sum(g.reserved for g in snap.gpus.values())
    return {
        "now_ms": snap.now_ms,
        "gpus": gpus,
        "deployments": deployments,
        "hosts": [
            {"name": h.name, "warm_budget_bytes": h.warm_budget, "warm_used_bytes": h.warm_used}
            for h in sorted(snap.hosts.values(), key=lambda h: h.name)
        ],
        "summary": {
            "gpus": len(gpus),
            "gpus_alive": sum(1 for g in gpus if g["alive"]),
            "total_bytes": total,
            "reserved_bytes": reserved,
            "utilization": reserved / total if total else 0.0,
            "replicas_on_gpu": sum(1 for d in snap.deployments.values() if d.level in ON_GPU),
        },
        "problems": audit(snap),
    }
