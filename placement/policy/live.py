"""A view of the fleet kept current in place: plan, commit, plan again without re-reading.

A `Snapshot` never changes, so each new one rebuilds its indexes in time proportional
to the fleet. A `LiveView` owns one snapshot and changes it and its indexes in time
proportional to the change: `apply` commits a plan in memory, with the effects of
`placement.policy.mirror.commit` (and so of commit.lua), as the packing benchmark does;
`update` replaces records read again from Redis, as `placement.ledger.follow` does for the
router.

The view's snapshot changes under whoever holds it; pass `view.snap` to the policy and
keep no other reference to it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from placement.policy.mirror import Draft, commit
from placement.policy.room import room_of, whole_gpus
from placement.policy.state import (
    RESERVING,
    Candidate,
    Deployment,
    Gpu,
    Host,
    Level,
    Plan,
    Snapshot,
)


class LiveView:
    """One snapshot, with its indexes, kept current as plans commit."""

    def __init__(self, snap: Snapshot) -> None:
        self._draft = Draft(snap)
        self.snap = self._draft.freeze()  # shares the draft's maps, which change in place
        for index in ("by_gpu", "by_model", "warm_by_host"):
            getattr(self.snap, index)  # built now, kept current from here on
        room_of(self.snap)

    def apply(self, plan: Plan) -> None:
        """Commit `plan` at the snapshot's clock, as commit.lua would."""
        if plan.candidate is Candidate.DEPLOYED:
            return
        touched = [plan.replica, *(e.replica for e in plan.evictions), *plan.warm_drops]
        before = [self._draft.deps.get(r) for r in touched]
        commit(self._draft, plan, self.snap.now_ms)
        after = [self._draft.deps[r] for r in touched]
        self._reindex([d for d in before if d is not None], after)

    def update(
        self,
        deployments: Mapping[str, Deployment | None],
        gpus: Mapping[str, Gpu] | None = None,
        hosts: Mapping[str, Host] | None = None,
    ) -> None:
        """Replace records read again from the registry (None: the record is gone)."""
        draft = self._draft
        gpus, hosts = gpus or {}, hosts or {}
        before = [d for r in deployments if (d := draft.deps.get(r)) is not None]
        for replica, dep in deployments.items():
            if dep is None:
                draft.deps.pop(replica, None)
            else:
                draft.deps[replica] = dep
        draft.gpus.update({g: gpu for g, gpu in gpus.items() if g in draft.gpus})
        draft.hosts.update(hosts)
        self._reindex(before, [d for d in deployments.values() if d is not None], gpus)

    def _reindex(
        self, before: list[Deployment], after: list[Deployment], gpus: Iterable[str] = ()
    ) -> None:
        snap = self.snap
        by_gpu: dict[str, list[Deployment]] = snap.by_gpu  # type: ignore[assignment]
        by_model: dict[str, list[Deployment]] = snap.by_model  # type: ignore[assignment]
        warm: dict[str, list[Deployment]] = snap.warm_by_host  # type: ignore[assignment]
        for d in before:
            _discard(by_model.get(d.model), d.replica)
            _discard(warm.get(d.host), d.replica)
            for gpu_id in d.gpus:
                _discard(by_gpu.get(gpu_id), d.replica)
            self._hold(d, -1)
        for d in after:
            by_model.setdefault(d.model, []).append(d)
            if d.level is Level.WARM:
                warm.setdefault(d.host, []).append(d)
            if d.level in RESERVING:
                for gpu_id in d.gpus:
                    by_gpu.setdefault(gpu_id, []).append(d)
            self._hold(d, +1)
        touched = {g for d in (*before, *after) for g in d.gpus} | set(gpus)
        for gpu_id in touched:
            gpu = snap.gpus.get(gpu_id)
            if gpu is None:
                continue
            if gpu.alive(snap.now_ms):
                idle = sum(d.gpus[gpu_id] for d in by_gpu.get(gpu_id, ()) if d.evictable)
                room_of(snap).put(gpu, idle)

    def _hold(self, d: Deployment, change: int) -> None:
        """Keep the room index's slot counts in step with `by_gpu`."""
        if d.level not in RESERVING:
            return
        whole = whole_gpus(d, self.snap.gpus)
        for gpu_id, nbytes in d.gpus.items():
            gpu = self.snap.gpus.get(gpu_id)
            if gpu is not None:
                room_of(self.snap).hold(gpu.total, nbytes, change, d.accelerator, whole)


def _discard(entries: Iterable[Deployment] | None, replica: str) -> None:
    if isinstance(entries, list):
        entries[:] = [d for d in entries if d.replica != replica]
