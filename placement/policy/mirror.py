"""Apply ledger changes to a snapshot in memory, with the same effects as the registry's scripts.

The simulator's in-memory mode uses it. A test checks that it agrees with commit.lua,
admit.lua and settle.lua, step by step, so the two cannot drift apart. Each function
mirrors one script; `settle_all` plays every worker at once.
"""

from __future__ import annotations

from dataclasses import replace

from placement.policy.state import (
    LEAVING,
    ON_DEVICE,
    RESERVING,
    Candidate,
    Deployment,
    Host,
    Level,
    Plan,
    Snapshot,
)


class Draft:
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

    def count(self, dep: Deployment, sign: int, *, reserved: bool, held: bool) -> None:
        """Add (or take back) a replica's bytes to its GPUs' `reserved` and `held`."""
        for gpu_id, nbytes in dep.gpus.items():
            g = self.gpus[gpu_id]
            self.gpus[gpu_id] = replace(
                g,
                reserved=g.reserved + sign * nbytes * reserved,
                held=g.held + sign * nbytes * held,
            )

    def warm(self, name: str, nbytes: int, replica: str | None = None, *, add: bool) -> None:
        """Charge (or give back) a host's warm cache; index or unindex `replica` there."""
        host = self.hosts.get(name, Host(name))
        held = host.warm
        if replica is not None:
            held = held | {replica} if add else held - {replica}
        used = host.warm_used + (nbytes if add else -nbytes)
        self.hosts[name] = replace(host, warm_used=used, warm=held)

    def leave(self, dep: Deployment, to: Level, now: int) -> None:
        """Like `leave` in _lib.lua: OFFLOADING (to WARM) or DROPPING, out of `reserved`."""
        self.count(dep, -1, reserved=True, held=False)
        self.active[dep.model] = self.active.get(dep.model, 0) - 1
        if to is Level.WARM:
            self.warm(dep.host, dep.cached, add=True)
            self.deps[dep.replica] = replace(dep, level=Level.OFFLOADING, since_ms=now)
        else:
            self.deps[dep.replica] = replace(dep, level=Level.DROPPING, since_ms=now)

    def to_cold(self, dep: Deployment, now: int) -> None:
        """Like `to_cold` in _lib.lua: every counter of its level given back."""
        if dep.level in RESERVING:
            self.count(dep, -1, reserved=True, held=False)
            self.active[dep.model] = self.active.get(dep.model, 0) - 1
        if dep.level is Level.WAITING:
            for gpu_id in dep.gpus:
                self.forget_context(gpu_id, dep.worker)
        if dep.level in ON_DEVICE:
            self.count(dep, -1, reserved=False, held=True)
        if dep.level in (Level.OFFLOADING, Level.WARM):
            self.warm(dep.host, dep.cached, dep.replica, add=False)
        self.deps[dep.replica] = replace(
            dep,
            level=Level.COLD,
            gpus={},
            fraction=0.0,
            limit=0,
            worker="",
            queue="",
            host="",
            since_ms=now,
            leases=0,  # its request leases end with it
        )

    def drop_warm(self, dep: Deployment, now: int) -> None:
        """Like `drop_warm` in _lib.lua."""
        self.warm(dep.host, dep.cached, dep.replica, add=False)
        self.deps[dep.replica] = replace(
            dep, level=Level.COLD, worker="", queue="", host="", since_ms=now
        )

    def fits_device(self, gpus: dict[str, int], limit: int, worker: str) -> bool:
        """Like `fits_device` in _lib.lua, with `worker`'s CUDA contexts not held yet."""
        need = {g: (max(limit, b) if len(gpus) == 1 else b) for g, b in gpus.items()}
        return all(
            self.gpus[g].held + n + self.unheld_context(g, worker) <= self.gpus[g].total
            for g, n in need.items()
        )

    def charge_context(self, gpu_id: str, worker: str) -> None:
        """Charge `worker`'s CUDA context on `gpu_id` to `reserved` if it is new (commit.lua)."""
        g = self.gpus[gpu_id]
        charge = g.charge_for(worker)
        if charge:
            contexts = {**g.contexts, worker: charge}
            self.gpus[gpu_id] = replace(g, reserved=g.reserved + charge, contexts=contexts)

    def unheld_context(self, gpu_id: str, worker: str) -> int:
        """Like `unheld_context` in _lib.lua: `worker`'s context bytes not in `held` yet."""
        g = self.gpus[gpu_id]
        return 0 if worker in g.held_contexts else g.contexts.get(worker, 0)

    def hold_context(self, gpu_id: str, worker: str) -> None:
        """Like `hold_context` in _lib.lua."""
        bytes_ = self.unheld_context(gpu_id, worker)
        if bytes_:
            g = self.gpus[gpu_id]
            waiting = {w: n for w, n in g.waiting_contexts.items() if w != worker}
            self.gpus[gpu_id] = replace(
                g,
                held=g.held + bytes_,
                held_contexts=g.held_contexts | {worker},
                waiting_contexts=waiting,
            )

    def wait_context(self, gpu_id: str, worker: str) -> None:
        """Like `wait_context` in _lib.lua."""
        g = self.gpus[gpu_id]
        waiting = {**g.waiting_contexts, worker: g.waiting_contexts.get(worker, 0) + 1}
        self.gpus[gpu_id] = replace(g, waiting_contexts=waiting)

    def forget_context(self, gpu_id: str, worker: str) -> None:
        """Like `forget_context` in _lib.lua."""
        g = self.gpus[gpu_id]
        waiting = g.waiting_contexts.get(worker, 0)
        if worker not in g.contexts or worker in g.held_contexts or not waiting:
            return
        if waiting > 1:
            self.gpus[gpu_id] = replace(
                g, waiting_contexts={**g.waiting_contexts, worker: waiting - 1}
            )
            return
        self.gpus[gpu_id] = replace(
            g,
            reserved=g.reserved - g.contexts[worker],
            contexts={w: b for w, b in g.contexts.items() if w != worker},
            waiting_contexts={w: n for w, n in g.waiting_contexts.items() if w != worker},
        )


def apply_plan(snap: Snapshot, plan: Plan) -> Snapshot:
    """The snapshot after `plan` commits at `snap.now_ms` (commit.lua)."""
    if plan.candidate is Candidate.DEPLOYED:
        return snap
    draft = Draft(snap)
    commit(draft, plan, snap.now_ms)
    return draft.freeze()


def commit(draft: Draft, plan: Plan, now: int) -> None:
    """Apply a plan that is not DEPLOYED to `draft`, as commit.lua does."""
    for eviction in plan.evictions:
        draft.leave(draft.deps[eviction.replica], eviction.to, now)
    for replica in plan.warm_drops:
        draft.drop_warm(draft.deps[replica], now)
    old = draft.deps.get(plan.replica)
    if old is not None and old.level is Level.WARM:
        draft.warm(old.host, old.cached, old.replica, add=False)
    for gpu_id in plan.gpus:
        draft.charge_context(gpu_id, plan.worker)
    fits = draft.fits_device(dict(plan.gpus), plan.limit, plan.worker)
    level = Level.LOADING if fits else Level.WAITING
    new = Deployment(
        replica=plan.replica,
        model=plan.model,
        level=level,
        gpus=dict(plan.gpus),
        limit=plan.limit,
        fraction=plan.fraction,
        dedicated=plan.dedicated,
        size=plan.size,
        last_used_ms=now,
        host=plan.host,
        worker=plan.worker,
        queue=plan.queue,
        epoch=(old.epoch if old is not None else 0) + 1,
        since_ms=now,
        copy_bytes=old.copy_bytes if old is not None else 0,
        accelerator=plan.accelerator,
        read_from=plan.read_from,
    )
    draft.count(new, 1, reserved=True, held=level is Level.LOADING)
    for gpu_id in plan.gpus:
        if level is Level.LOADING:
            draft.hold_context(gpu_id, plan.worker)
        elif draft.unheld_context(gpu_id, plan.worker):
            draft.wait_context(gpu_id, plan.worker)
    draft.deps[plan.replica] = new
    draft.active[plan.model] = draft.active.get(plan.model, 0) + 1


def admit(snap: Snapshot, replica: str) -> Snapshot:
    """WAITING -> LOADING when its GPUs have room on the device (admit.lua); else unchanged."""
    dep = snap.deployments[replica]
    draft = Draft(snap)
    if dep.level is not Level.WAITING or not draft.fits_device(
        dict(dep.gpus), dep.limit, dep.worker
    ):
        return snap
    draft.count(dep, 1, reserved=False, held=True)
    for gpu_id in dep.gpus:
        draft.hold_context(gpu_id, dep.worker)
    draft.deps[replica] = replace(dep, level=Level.LOADING, since_ms=snap.now_ms)
    return draft.freeze()


def settle(snap: Snapshot, replica: str, outcome: str) -> Snapshot:
    """A worker settles a pending move (settle.lua): 'offloaded', 'dropped', 'failed', 'lost'."""
    dep = snap.deployments[replica]
    draft = Draft(snap)
    if outcome == "offloaded":
        if dep.level is not Level.OFFLOADING:
            return snap
        draft.count(dep, -1, reserved=False, held=True)
        draft.warm(dep.host, 0, replica, add=True)  # charged when it started leaving
        draft.deps[replica] = replace(
            dep, level=Level.WARM, gpus={}, fraction=0.0, limit=0, since_ms=snap.now_ms, copy_at=""
        )
    else:
        draft.to_cold(dep, snap.now_ms)
    return draft.freeze()


def settle_all(snap: Snapshot) -> Snapshot:
    """Every pending move done at once, as if every worker were instant: leaving copies
    settle, then waiting placements are admitted (LOADING stays for `mark`)."""
    for d in list(snap.deployments.values()):
        if d.level in LEAVING:
            outcome = "offloaded" if d.level is Level.OFFLOADING else "dropped"
            snap = settle(snap, d.replica, outcome)
    for d in list(snap.deployments.values()):
        if d.level is Level.WAITING:
            snap = admit(snap, d.replica)
    return snap


def evict(snap: Snapshot, replica: str, to: Level) -> Snapshot:
    """An idle placed replica starts leaving for `to` (WARM or COLD), as evict.lua does; a
    WAITING one, with nothing on the device yet, goes COLD at once."""
    draft = Draft(snap)
    dep = draft.deps[replica]
    if dep.level is Level.WAITING:
        draft.to_cold(dep, snap.now_ms)
    else:
        draft.leave(dep, to, snap.now_ms)
    return draft.freeze()


def mark(snap: Snapshot, replica: str, level: Level, now_ms: int | None = None) -> Snapshot:
    """The snapshot with `replica` at `level` (e.g. LOADING -> HOT) and used at `now_ms`."""
    dep = snap.deployments[replica]
    used = dep.last_used_ms if now_ms is None else now_ms
    deps = {**snap.deployments, replica: replace(dep, level=level, last_used_ms=used)}
    return replace(snap, deployments=deps)


__all__ = ["admit", "apply_plan", "evict", "mark", "settle", "settle_all"]
