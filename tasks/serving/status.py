"""The status object: what `gpufleet status --json` prints, the `gpufleet.status` task
returns and the Prometheus metrics are built from (`tasks.operator.metrics`).

Every figure is read from the registry and the broker when it is asked for, so any process
can build it and all agree: the ledger's report (`placement.ledger.report`), request outcomes,
each model's load, the depth of every fleet queue, the calls no live worker will take
(`stranded`) and the calls quarantined (`tasks.broker.quarantine`).
"""

from __future__ import annotations

from typing import Any

import redis

from placement.errors import GpufleetError
from placement.ledger.load import placed_replicas, read_loads
from placement.ledger.registry import Registry
from placement.ledger.report import load_report, request_report, status_report
from tasks.broker import presence, quarantine
from tasks.config import ROUTER_QUEUES


def full_status(registry: Registry, broker_url: str) -> dict[str, Any]:
    """The registry's status report, request outcomes, and the depth of every fleet queue."""
    snap = registry.snapshot()
    report = status_report(snap)
    report["requests"] = request_report(registry.stats(snap))
    placed = placed_replicas(snap.deployments.values(), snap.by_model)
    report["load"] = load_report(read_loads(registry, placed))
    queues = {*ROUTER_QUEUES} | {g.queue for g in snap.gpus.values() if g.queue}
    client = redis.Redis.from_url(broker_url)
    try:
        pipe = client.pipeline(transaction=False)
        for queue in sorted(queues):
            for name in presence.lists(queue):
                pipe.llen(name)
        depths = iter(pipe.execute())
        report["queues"] = {
            q: sum(int(next(depths)) for _ in presence.PRIORITY_STEPS) for q in sorted(queues)
        }
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
    return report
