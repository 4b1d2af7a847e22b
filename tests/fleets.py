"""Builders of in-memory fleets for policy tests."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import replace

from placement.policy.state import ON_DEVICE, RESERVING, Deployment, Gpu, Host, Level, Snapshot
from placement.units.accelerators import Accelerator

GiB = 2**30
GB = 10**9
NOW = 1_000_000


def gpu(gpu_id: str, total: int, *, host: str = "h0", name: str = "Sim", index: int = 0) -> Gpu:
    """A live GPU whose worker is named after it."""
    return Gpu(
        id=gpu_id,
        host=host,
        index=index,
        name=name,
        total=total,
        worker=f"w-{gpu_id}",
        queue=f"q-{gpu_id}",
        lease_deadline_ms=NOW + 60_000,
    )


def hot(
    replica: str,
    model: str,
    on: dict[str, int],
    *,
    host: str = "h0",
    used: int = 0,
    dedicated: bool = False,
    leases: int = 0,
    size: int | None = None,
    level: Level = Level.HOT,
    accelerator: Accelerator = None,
) -> Deployment:
    first = next(iter(on))
    return Deployment(
        replica=replica,
        model=model,
        level=level,
        gpus=dict(on),
        limit=max(on.values()),
        dedicated=dedicated,
        size=max(on.values()) if size is None else size,
        last_used_ms=used,
        host=host,
        worker=f"w-{first}",
        queue=f"q-{first}",
        leases=leases,
        accelerator=accelerator,
    )


def warm(
    replica: str,
    model: str,
    size: int,
    *,
    host: str = "h0",
    used: int = 0,
    worker: str = "w-warm",
    copy_at: str = "",
) -> Deployment:
    """A WARM copy held by `worker` (the worker of GPU g is `w-g`; the default holds no GPU),
    published to the host's other workers at `copy_at` ('' not)."""
    return Deployment(
        replica=replica,
        model=model,
        level=Level.WARM,
        size=size,
        last_used_ms=used,
        host=host,
        worker=worker,
        queue=f"q-{worker}",
        copy_at=copy_at,
    )


def fleet(
    gpus: Iterable[Gpu],
    deployments: Iterable[Deployment] = (),
    hosts: Iterable[Host] = (),
) -> Snapshot:
    """A consistent snapshot: GPU reservations and warm usage follow the deployments."""
    deps = {d.replica: d for d in deployments}
    by_gpu = {g.id: g for g in gpus}
    for d in deps.values():
        for gpu_id, nbytes in d.gpus.items():
            g = by_gpu[gpu_id]
            by_gpu[gpu_id] = replace(
                g,
                reserved=g.reserved + nbytes * (d.level in RESERVING),
                held=g.held + nbytes * (d.level in ON_DEVICE),
            )
    host_map = {h.name: h for h in hosts}
    for d in deps.values():
        if d.level is Level.WARM:
            h = host_map.get(d.host, Host(d.host))
            host_map[d.host] = Host(
                h.name, h.warm_budget, h.warm_used + d.cached, h.warm | {d.replica}
            )
    active: dict[str, int] = {}
    for d in deps.values():
        if d.level in RESERVING:
            active[d.model] = active.get(d.model, 0) + 1
    return Snapshot(gpus=by_gpu, deployments=deps, hosts=host_map, now_ms=NOW, active=active)
