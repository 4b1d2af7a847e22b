"""Registry records as Redis stores them, turned into the values of `placement.policy.state`.

One function per record kind. Redis hashes hold strings; numbers written by Lua may
come back as floats ("1.0e+09"), so they are parsed through float where they can be.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

from placement.policy.state import Deployment, Gpu, Holding, Host, Level, Report
from placement.units import accelerators

#: `gpu:<id>` hash fields of the CUDA context a worker keeps on a GPU it does not own:
#: `ctx:<worker>` its bytes, `ctx_held:<worker>` set once they count in `held` (commit.lua),
#: `ctx_wait:<worker>` the WAITING placements relying on them until then (_lib.lua);
#: `ctx_pending:<worker>` (not read here), one declared while the GPU's record was gone,
#: charged when its owner registers it again (register.lua).
CONTEXT, CONTEXT_HELD, CONTEXT_WAIT = "ctx:", "ctx_held:", "ctx_wait:"


def gpu(row: Mapping[str, str]) -> Gpu:
    """A `gpu:<id>` hash."""
    return Gpu(
        id=row.get("id", ""),
        host=row.get("host", ""),
        index=int(row.get("index", 0)),
        name=row.get("name", ""),
        total=int(row.get("total", 0)),
        reserved=int(row.get("reserved", 0)),
        worker=row.get("worker", ""),
        queue=row.get("queue", ""),
        lease_deadline_ms=int(row.get("lease_deadline", 0)),
        held=int(row.get("held", 0)),
        context=int(row.get("context", 0)),
        contexts={
            name[len(CONTEXT) :]: int(float(v))
            for name, v in row.items()
            if name.startswith(CONTEXT)
        },
        held_contexts=frozenset(
            name[len(CONTEXT_HELD) :] for name in row if name.startswith(CONTEXT_HELD)
        ),
        waiting_contexts={
            name[len(CONTEXT_WAIT) :]: int(v)
            for name, v in row.items()
            if name.startswith(CONTEXT_WAIT)
        },
        domain=row.get("domain", ""),
    )


#: The fields every `dep:<replica>` record is written with (commit.lua), whatever its level.
_IDENTITY = ("replica", "model", "level")


def whole(row: Mapping[str, str]) -> bool:
    """Whether a `dep:<replica>` hash holds a record. One missing a field of its identity
    (half a record: a Redis that lost some writes, such as a restarted Redis 7 whose
    `default` user could not replay them, placement.server.acl) reads as no record, so a
    worker lets the replica go instead of failing on every read; the audit names it
    (`missing`)."""
    return not missing(row)


def missing(row: Mapping[str, str]) -> tuple[str, ...]:
    """The identity fields a `dep:<replica>` hash lacks (all of them: no hash at all)."""
    return tuple(field for field in _IDENTITY if field not in row)


def deployment(row: Mapping[str, str], leases: int) -> Deployment:
    """A `dep:<replica>` hash, with the number of its live request leases."""
    return Deployment(
        replica=row["replica"],
        model=row["model"],
        level=Level(row["level"]),
        gpus={g: int(b) for g, b in json.loads(row.get("gpus") or "{}").items()},
        limit=int(float(row.get("limit", 0))),
        fraction=float(row.get("fraction", 0)),
        dedicated=row.get("dedicated") == "1",
        size=int(float(row.get("size", 0))),
        last_used_ms=int(float(row.get("last_used", 0))),
        host=row.get("host", ""),
        worker=row.get("worker", ""),
        queue=row.get("queue", ""),
        leases=int(leases),
        epoch=int(row.get("epoch", 0)),
        since_ms=int(float(row.get("since", 0))),
        copy_bytes=int(float(row.get("copy_bytes", 0))),
        accelerator=accelerators.load(row.get("accelerator", "")),
        copy_at=row.get("copy_at", ""),
        read_from=row.get("read_from", ""),
    )


def host(row: Mapping[str, str]) -> Host:
    """A `host:<name>` hash (its warm index is read separately)."""
    return Host(
        name=row.get("name", ""),
        warm_budget=int(row.get("warm_budget", 0)),
        warm_used=int(row.get("warm_used", 0)),
    )


def report(
    worker: str, holds: str | None, at: str | None, pinned: str | None = None
) -> Report | None:
    """The holdings a worker's heartbeat stored, or None before its first report."""
    if not holds or not at:
        return None
    held = tuple(holding(h) for h in json.loads(holds))
    return Report(worker, int(at), held, int(pinned or 0))


def holding(data: Mapping[str, Any]) -> Holding:
    """One entry of a holdings report."""
    return Holding(
        replica=str(data["replica"]),
        epoch=int(data["epoch"]),
        level=Level(data["level"]),
        gpus={str(g): int(b) for g, b in dict(data.get("gpus") or {}).items()},
        device_bytes=int(data.get("device_bytes", 0)),
    )


def holdings_json(holdings: Sequence[Holding]) -> str:
    """A holdings report as heartbeat.lua stores it."""
    return json.dumps(
        [
            {
                "replica": h.replica,
                "epoch": h.epoch,
                "level": h.level.value,
                "gpus": dict(h.gpus),
                "device_bytes": h.device_bytes,
            }
            for h in holdings
        ]
    )
