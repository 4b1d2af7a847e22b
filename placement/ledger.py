"""Apply plans to a snapshot in memory, with the same effects as the registry's scripts.

The simulator's in-memory mode and multi-replica planning use it. Tests check that
it agrees with `commit.lua` and `evict.lua`, so the two cannot drift apart.
"""

from __future__ import annotations

from dataclasses import replace

from placement.state import ON_GPU, Candidate, Deployment, Host, Level, Plan, Snapshot


class _Draft:
    """Mutable copies of a snapshot's maps, changed step by step, then frozen again."""

    def __init__(self, snap: Snapshot) -> None:
        self.snap = snap
        self.gpus = dict(snap.gpus)
        self.deps = dict(snap.deployments)
        self.hosts = dict(snap.hosts)
        self.active = dict(snap.active)

    def freeze(self) -> Snapshot:
        return replace(
            self.snap, gpus=self.gpus, deployments=self.deps, hosts=self.hosts, active=self.active
        )

    def reserve(self, gpu_id: str, delta: int) -> None:
        self.gpus[gpu_id] = replace(self.gpus[gpu_id], reserved=self.gpus[gpu_id].reserved + delta)

    def warm(self, name: str, replica: str, size: int, *, add: bool) -> None:
        """Count a copy into (or out of) a host's warm cache and its index."""
        host = self.hosts.get(name, Host(name))
        held = host.warm | {replica} if add else host.warm - {replica}
        used = host.warm_used + (size if add else -size)
        self.hosts[name] = replace(host, warm_used=used, warm=held)

    def off_gpu(self, dep: Deployment, to: Level) -> None:
        """Like `move_off_gpu` in _lib.lua."""
        for gpu_id, nbytes in dep.gpus.items():
            self.reserve(gpu_id, -nbytes)
        self.active[dep.model] = self.active.get(dep.model, 0) - 1
        if to is Level.WARM:
            self.warm(dep.host, dep.replica, dep.size, add=True)
            self.deps[dep.replica] = replace(dep, level=Level.WARM, gpus={}, fraction=0.0, limit=0)
        else:
            self.deps[dep.replica] = replace(
                dep, level=Level.COLD, gpus={}, fraction=0.0, limit=0, worker="", queue="", host=""
            )

    def drop_warm(self, dep: Deployment) -> None:
        """Like `drop_warm` in _lib.lua."""
        self.warm(dep.host, dep.replica, dep.size, add=False)
        self.deps[dep.replica] = replace(dep, level=Level.COLD, worker="", queue="", host="")


def apply_plan(snap: Snapshot, plan: Plan) -> Snapshot:
    """The snapshot after `plan` commits at `snap.now_ms` (the replica starts LOADING)."""
    if plan.candidate is Candidate.DEPLOYED:
        return snap
    draft = _Draft(snap)
    for eviction in plan.evictions:
        draft.off_gpu(draft.deps[eviction.replica], eviction.to)
    for replica in plan.warm_drops:
        draft.drop_warm(draft.deps[replica])
    old = draft.deps.get(plan.replica)
    if old is not None and old.level is Level.WARM:
        draft.warm(old.host, old.replica, old.size, add=False)
    for gpu_id, nbytes in plan.gpus.items():
        draft.reserve(gpu_id, nbytes)
    draft.deps[plan.replica] = Deployment(
        replica=plan.replica,
        model=plan.model,
        level=Level.LOADING,
        gpus=dict(plan.gpus),
        limit=plan.limit,
        fraction=plan.fraction,
        dedicated=plan.dedicated,
        size=plan.size,
        last_used_ms=snap.now_ms,
        host=plan.host,
        worker=plan.worker,
        queue=plan.queue,
    )
    draft.active[plan.model] = draft.active.get(plan.model, 0) + 1
    return draft.freeze()


def evict(snap: Snapshot, replica: str, to: Level, drops: tuple[str, ...] = ()) -> Snapshot:
    """The snapshot after `replica` leaves its GPUs for `to` (WARM or COLD)."""
    draft = _Draft(snap)
    for w in drops:
        draft.drop_warm(draft.deps[w])
    dep = draft.deps[replica]
    if dep.level in ON_GPU:
        draft.off_gpu(dep, to)
    elif dep.level is Level.WARM and to is Level.COLD:
        draft.drop_warm(dep)
    return draft.freeze()


def mark(snap: Snapshot, replica: str, level: Level, now_ms: int | None = None) -> Snapshot:
    """The snapshot with `replica` at `level` (e.g. LOADING -> HOT) and used at `now_ms`."""
    dep = snap.deployments[replica]
    used = dep.last_used_ms if now_ms is None else now_ms
    deps = {**snap.deployments, replica: replace(dep, level=level, last_used_ms=used)}
    return replace(snap, deployments=deps)
