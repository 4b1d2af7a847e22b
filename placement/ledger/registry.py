"""The placement registry: per-GPU memory ledgers in Redis, changed only by Lua scripts.

Reads are plain pipelined commands; every write is one atomic script, so any
number of routers and workers may share a registry without Python-side locks.
The commit protocol is optimistic: read a `Snapshot`, plan with the pure policy,
and let `commit.lua` re-check the plan; on a refusal, plan again. Moves that need GPU
work wait for the worker that does it (docs/placement.md has the state table).
`Registry` adds placements and requests to `Membership` (the workers) and `Store` (the
Redis client, keys and scripts).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from typing import Any, Literal

import redis

from placement.errors import (
    AtFloorError,
    CantAccommodateError,
    NeverFitsError,
    PlacementError,
    PlanRejectedError,
    RegistryError,
    ScaledSinceError,
    SettlingError,
)
from placement.ledger import records
from placement.ledger.figures import cache
from placement.ledger.follow import Follower
from placement.ledger.hot import (
    DEFAULT_REQUEST_LEASE_MS,
    Forwarded,
    Handover,
    HotPath,
    Lease,
    new_lease_id,
    taker_of,
)
from placement.ledger.keys import KeyList
from placement.ledger.membership import Membership
from placement.ledger.scripts import sha
from placement.ledger.store import DEFAULT_EVENTS_MAXLEN, time_ms
from placement.policy.place import plan_offload, plan_replica
from placement.policy.settings import PolicySettings
from placement.policy.state import (
    COUNTS,
    LEAVING,
    OUTCOMES,
    Candidate,
    Demand,
    Deployment,
    Level,
    Plan,
    Snapshot,
)
from placement.units import accelerators

log = logging.getLogger(__name__)

#: How long `place` waits for a copy of the model to finish leaving its GPU before it
#: gives up with `SettlingError` (a worker settles within about one call's time).
SETTLE_WAIT_S = 2.0
SETTLE_POLL_S = 0.02
#: What a worker reports settling: see settle.lua.
OUTCOMES_OF_SETTLE = ("offloaded", "dropped", "failed", "lost")


class Registry(Membership):
    """One fleet's ledger in one Redis database: its workers, placements and requests."""

    def __init__(
        self,
        client: redis.Redis,
        fleet: str = "default",
        *,
        settings: PolicySettings | None = None,
        events_maxlen: int = DEFAULT_EVENTS_MAXLEN,
    ) -> None:
        super().__init__(client, fleet, settings=settings, events_maxlen=events_maxlen)
        self.hot = HotPath(self)  # the fast path's leases, and its replica lists
        self.follower = Follower(self)  # the miss path's view of the ledger

    def sweep(self) -> dict[str, list[str]]:
        """Housekeeping to run periodically: reap expired workers, and finish the drains
        whose last request leases lapsed (their clients were lost, so no `finish` came)."""
        reaped = self.reap_expired()
        drained = [
            d.replica
            for d in self.snapshot().deployments.values()
            if d.level is Level.DRAINING and d.leases == 0
        ]
        return {
            "reaped": reaped,
            "drained": [r for r in drained if self.evict(r) is not Level.DRAINING],
        }

    # --- reads --------------------------------------------------------------

    def snapshot(self) -> Snapshot:
        """Read the whole ledger as of one instant.

        The index sets are read first; then every record, the sets again and the clock
        are read in one MULTI/EXEC, which Redis runs atomically. If a set changed
        between the two reads the snapshot is taken again.
        """
        return self.snapshot_at()[0]

    def snapshot_at(self) -> tuple[Snapshot, str]:
        """`snapshot()`, with the id of the last event it includes ("0-0" for none): the
        point from which `placement.ledger.follow` keeps it current."""
        k = self.keys
        sets = (k.gpus, k.deployments, k.hosts, k.workers)
        ids = [sorted(m) for m in self._read([("smembers", s) for s in sets])]
        for _ in range(16):
            gpu_ids, replicas, hosts, workers = ids
            cmds: list[tuple[Any, ...]] = [("time",), ("hgetall", k.learned), ("hgetall", k.active)]
            cmds += [("xrevrange", k.events, "+", "-", 1)]
            cmds += [("smembers", s) for s in sets]
            cmds += [("hgetall", k.gpu(g)) for g in gpu_ids]
            cmds += [("hgetall", k.deployment(r)) for r in replicas]
            cmds += [("zrange", k.leases(r), 0, -1, False, True) for r in replicas]  # with scores
            cmds += [("hgetall", k.host(h)) for h in hosts]
            cmds += [("smembers", k.host_warm(h)) for h in hosts]
            cmds += [
                ("hmget", k.worker(w), "holds", "holds_at", "lease_deadline", "pinned")
                for w in workers
            ]
            rows = iter(self._read(cmds, atomic=True))
            clock = next(rows)
            learned, active = next(rows), next(rows)
            last = next(rows)
            cursor = str(last[0][0]) if last else "0-0"
            now_ids = [sorted(next(rows)) for _ in sets]
            if now_ids != ids:
                ids = now_ids
                continue  # a record appeared or went between the two reads
            now = time_ms(clock)
            gpu_rows = _take(rows, gpu_ids)
            gpus = {g: records.gpu(row) for g, row in zip(gpu_ids, gpu_rows, strict=True)}
            rows_of = _take(rows, replicas)
            leases = _take(rows, replicas)
            deployments: dict[str, Deployment] = {}
            partial: dict[str, tuple[str, ...]] = {}  # half-written records, for the audit
            for r, row, held in zip(replicas, rows_of, leases, strict=True):
                if lacks := records.missing(row):
                    partial[r] = lacks
                else:
                    deployments[r] = records.deployment(row, sum(1 for _, t in held if t > now))
            host_rows = _take(rows, hosts)
            host_map = {
                h: replace(records.host(row), warm=frozenset(warm))
                for h, row, warm in zip(hosts, host_rows, _take(rows, hosts), strict=True)
            }
            reports, deadlines = {}, {}
            for w, (holds, at, deadline, pinned) in zip(workers, _take(rows, workers), strict=True):
                deadlines[w] = int(deadline or 0)
                found = records.report(w, holds, at, pinned)
                if found is not None:
                    reports[w] = found
            snap = Snapshot(
                gpus={g: v for g, v in gpus.items() if v.total},
                deployments=deployments,
                hosts=host_map,
                now_ms=now,
                learned={m: int(v) for m, v in learned.items()},
                active={m: int(v) for m, v in active.items()},
                reports=reports,
                workers=deadlines,
                partial=partial,
            )
            return snap, cursor
        raise RegistryError("the registry changed under 16 snapshot attempts in a row")

    # --- placement ----------------------------------------------------------

    def commit(
        self,
        plan: Plan,
        snap: Snapshot,
        *,
        lease_id: str = "",
        lease_ms: int = DEFAULT_REQUEST_LEASE_MS,
        why: str = "",
        changes_seen: int | None = None,
    ) -> Plan:
        """Apply `plan`, made from `snap`, atomically; raise `PlanRejectedError` if stale.

        Returns the plan with its new epoch. `lease_id` pins the replica for the call that
        caused the placement, so pressure cannot evict it before that call runs. `why`
        goes into the placement's event (a scale-out says why it placed another replica).
        A scale-out names the model's `changes` count it was decided at (`changes_seen`):
        if a replica of the model was placed or left since, nothing is placed
        (`ScaledSinceError`), since the decision judged a fleet that is gone.
        """
        k = self.keys
        keys = KeyList()
        old = snap.deployments.get(plan.replica)
        victims = [snap.deployments[e.replica] for e in plan.evictions]
        payload: dict[str, Any] = {
            "replica": plan.replica,
            "model": plan.model,
            "reuse": plan.reuse.value if plan.reuse else "",
            "expect_worker": old.worker if old and plan.reuse else "",
            "max_active": plan.max_active,
            "changes_seen": -1 if changes_seen is None else changes_seen,
            "dep": keys.add(k.deployment(plan.replica)),
            "leases": keys.add(k.leases(plan.replica)),
            "lease": lease_id,
            "lease_ms": lease_ms,
            "active": keys.add(k.active),
            "changes": keys.add(k.changes),
            "replicas_key": keys.add(k.model_replicas(plan.model)),
            "deps_key": keys.add(k.deployments),
            "worker_deps": keys.add(k.worker_deployments(plan.worker)),
            "worker_key": keys.add(k.worker(plan.worker)),
            "control": keys.add(k.control(plan.worker)),
            # A WARM replica is restored on its own host, and leaves its old holder.
            "old_worker_deps": keys.add(k.worker_deployments(old.worker)) if old else 0,
            "host_key": keys.add(k.host(plan.host)),
            "host_warm_key": keys.add(k.host_warm(plan.host)),
            "events": keys.add(k.events),
            "limit": plan.limit,
            "fraction": plan.fraction,
            "size": plan.size,
            "dedicated": plan.dedicated,
            "accelerator": accelerators.dump(plan.accelerator),
            "host": plan.host,
            "worker": plan.worker,
            "queue": plan.queue,
            "why": why,
            "read_from": plan.read_from,
            "gpus": [
                {
                    "id": g,
                    "key": keys.add(k.gpu(g)),
                    "bytes": b,
                    "limit": plan.limit if len(plan.gpus) == 1 else b,
                    "worker": snap.gpus[g].worker,
                }
                for g, b in plan.gpus.items()
            ],
            "evictions": [
                self._victim_ref(d, keys)
                | {"to": e.to.value, "cache": keys.add(k.model_cache(d.model))}  # its age
                for e, d in zip(plan.evictions, victims, strict=True)
            ],
            "ages": cache.AGE_LABELS if plan.evictions else [],
            "drops": [self._warm_ref(snap.deployments[r], keys) for r in plan.warm_drops],
        }
        result = self._run_json("commit", keys, payload)
        if result[0] != 1:
            if result[1] == "SCALED":
                raise ScaledSinceError(f"{plan.model} stays as it is: {result[2]}")
            raise PlanRejectedError(f"{result[1]}: {result[2]}")
        return replace(plan, epoch=int(result[2]))

    def _warm_ref(self, d: Deployment, keys: KeyList) -> dict[str, Any]:
        """A replica as the scripts' `drop_warm` takes it (_lib.lua)."""
        k = self.keys
        return {
            "replica": d.replica,
            "dep": keys.add(k.deployment(d.replica)),
            "worker_deps": keys.add(k.worker_deployments(d.worker)),
            "host": keys.add(k.host(d.host)),
            "host_warm": keys.add(k.host_warm(d.host)),
            "control": keys.add(k.control(d.worker)),
            "expect_worker": d.worker,
        }

    def _victim_ref(self, d: Deployment, keys: KeyList) -> dict[str, Any]:
        """A replica as the scripts' `leave` and `to_cold` take it (_lib.lua)."""
        k = self.keys
        return self._warm_ref(d, keys) | {
            "leases": keys.add(k.leases(d.replica)),
            "active": keys.add(k.active),
            "changes": keys.add(k.changes),
            "gpus": [{"id": g, "key": keys.add(k.gpu(g))} for g in d.gpus],
        }

    def place(
        self,
        demand: Demand,
        settings: PolicySettings | None = None,
        rng: random.Random | None = None,
        attempts: int = 8,
        *,
        lease_id: str = "",
        settle_wait_s: float = SETTLE_WAIT_S,
        avoid_workers: frozenset[str] = frozenset(),
        why: str = "",
        changes_seen: int | None = None,
    ) -> Plan:
        """Snapshot, plan and commit one more replica, retrying on stale plans.

        Returns the committed plan, with its epoch (or a DEPLOYED plan when enough
        replicas are placed). Policy refusals (`CantAccommodateError`) propagate at once.
        While a copy of the model is leaving its GPU, it waits up to `settle_wait_s` for
        the move to settle (then the copy can be restored), else raises `SettlingError`.
        `lease_id` pins the placed replica for the caller's request (see `commit`).
        The replica goes to none of the GPUs of `avoid_workers`; `why` goes into its event.
        A scale-out passes `changes_seen` (see `commit`).
        """
        last: PlanRejectedError | None = None
        deadline = time.monotonic() + settle_wait_s
        tries = 0
        while tries < attempts:
            with self.follower.current() as snap:
                if demand.learned is None and demand.model in snap.learned:
                    demand = replace(demand, learned=snap.learned[demand.model])
                where = snap.without_workers(avoid_workers) if avoid_workers else snap
                try:
                    plan = plan_replica(demand, where, settings or self.settings, rng)
                    tries += 1
                    if plan.candidate is Candidate.DEPLOYED:
                        return plan
                    return self.commit(
                        plan, snap, lease_id=lease_id, why=why, changes_seen=changes_seen
                    )
                except NeverFitsError:
                    raise  # the fleet's shape: a fresher view would not change it
                except CantAccommodateError:
                    if self.follower.fresh():
                        raise
                    # The view may count request leases that ended since: read it all.
                    last, moving = None, {}
                    self.follower.invalidate()
                    continue
                except SettlingError:
                    if time.monotonic() >= deadline:
                        raise
                    moving = {
                        d.replica: d.level
                        for d in snap.replicas(demand.model)
                        if d.level in LEAVING or d.level is Level.DRAINING
                    }
                except PlanRejectedError as exc:
                    last, moving = exc, {}
                    log.debug("plan for %s rejected: %s", demand.model, exc)
            if last is not None and not moving:
                self.follower.invalidate()  # the view missed something: read it all
            self._wait_moved(moving, deadline)
        raise PlanRejectedError(
            f"{demand.model}: the fleet changed under {attempts} plans in a row ({last})"
        )

    def _wait_moved(self, moving: dict[str, Level], deadline: float) -> None:
        """Until one of the `moving` (draining or leaving) replicas changes level (its
        worker settled it, its last call ended), or `deadline`: one small read per poll."""
        while moving and time.monotonic() < deadline:
            now = self.levels(list(moving))
            if any(now.get(r) is not level for r, level in moving.items()):
                return
            time.sleep(SETTLE_POLL_S)

    def hold(
        self, replica: str, epoch: int, worker: str, ttl_ms: int = DEFAULT_REQUEST_LEASE_MS
    ) -> tuple[Lease, str] | None:
        """Lease a placed replica (WAITING, LOADING or HOT in `epoch` on live `worker`) for
        a routed call.

        Returns the lease and where the copy is coming from: "hot" (it is HOT), "warm" (a
        restore, or a read of another worker's warm copy), or "cold"; None when the replica
        moved on or its worker is dead.
        """
        lease_id = self.new_lease_id()
        k = self.keys
        keys = [k.deployment(replica), k.leases(replica), k.worker(worker)]
        result = self._run("hold", keys, [lease_id, ttl_ms, epoch, worker])
        if result[0] != 1:
            return None
        _, deadline, level, source = result
        cache = "hot" if level == Level.HOT.value else "warm" if source == "WARM" else "cold"
        return Lease(lease_id, "", replica, "", "", {}, int(deadline), epoch), cache

    def confirm(self, replica: str, worker: str, epoch: int, copy_bytes: int = 0) -> bool:
        """Mark this worker's LOADING placement of `epoch` HOT; False if it moved on.

        `copy_bytes`, the bytes the worker measured its copy at, is what the copy will
        take in the host's warm cache (0: not measured; its `size` is charged).
        """
        keys = [self.keys.deployment(replica), self.keys.events]
        args = [replica, worker, epoch, self.events_maxlen, copy_bytes]
        result = self._run("confirm", keys, args)
        return bool(result[0] == 1)

    def admit(self, dep: Deployment) -> Level | None:
        """Admit a WAITING placement to its device once its victims left it.

        Returns LOADING when admitted (or already), None while its GPUs are still full,
        or the level it moved to when the record is no longer this WAITING placement.
        """
        k = self.keys
        keys = KeyList()
        payload = {
            "replica": dep.replica,
            "worker": dep.worker,
            "epoch": dep.epoch,
            "dep": keys.add(k.deployment(dep.replica)),
            "events": keys.add(k.events),
            "gpus": [
                {
                    "id": g,
                    "key": keys.add(k.gpu(g)),
                    "bytes": b,
                    "limit": dep.limit if len(dep.gpus) == 1 else b,
                }
                for g, b in dep.gpus.items()
            ],
        }
        result = self._run_json("admit", keys, payload)
        if result[0] == 1:
            return Level.LOADING
        if result[1] == "FULL":
            return None
        level = result[2]
        return Level(level) if level in Level.__members__ else Level.COLD

    def settle(self, dep: Deployment, outcome: str, copy_at: str = "") -> Level | None:
        """Report the GPU work a pending move of `dep` needed, by the worker that did it.

        `outcome` is one of `OUTCOMES_OF_SETTLE` (see settle.lua). `copy_at`, with
        'offloaded', says where the host's other workers may read the copy
        (`worker.warm.sharing`). Returns the level the replica reached, or None when the record
        is no longer `dep`'s placement at a level that outcome settles (nothing changed).
        """
        if outcome not in OUTCOMES_OF_SETTLE:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES_OF_SETTLE}")
        keys = KeyList()
        payload = self._victim_ref(dep, keys) | {
            "worker": dep.worker,
            "epoch": dep.epoch,
            "outcome": outcome,
            "events": keys.add(self.keys.events),
            "copy_at": copy_at,
        }
        result = self._run_json("settle", keys, payload)
        return Level(result[1]) if result[0] == 1 else None

    def evict(
        self,
        replica: str,
        settings: PolicySettings | None = None,
        *,
        to: Level | None = None,
        seen: Deployment | None = None,
        floor: int | None = None,
        epoch: int = 0,
        why: str = "",
        changes_seen: int | None = None,
    ) -> Level:
        """Drain, then offload (to WARM when the host cache has room) or drop a replica.

        With `floor` it is a scale-in: only the HOT, idle replica of placement `epoch`
        leaves, and only while its model keeps `floor` others placed (`AtFloorError`;
        `PlacementError` when it moved or is busy), so scaling stays within the model's
        bounds whichever routers run it; with `changes_seen` (the model's `changes` count
        the scale-in was decided at) nothing leaves once the model's replicas changed since
        (`ScaledSinceError`). `why` goes into the eviction's event.

        Returns the replica's level afterwards: DRAINING while requests are in flight
        (call again when they finish), OFFLOADING or DROPPING while its worker moves it
        (`wait_settled` waits for that), or WARM or COLD. `to=Level.COLD` forces a drop;
        with it, `seen` (the record as the caller last saw it) saves reading the record
        first. evict.lua checks the holder and GPUs; a stale `seen` costs a read and a retry.
        """
        for _ in range(8):
            drops: tuple[str, ...] = ()
            if to is Level.COLD:  # no warm cache to plan for: the record alone will do
                record, seen = seen or self._record(replica), None
                snap = Snapshot(gpus={}, deployments={replica: record}, hosts={})
                target = Level.COLD
            else:
                snap = self._offload_view(replica)
                eviction, drops = plan_offload(replica, snap, settings or self.settings)
                target = eviction.to
            dep = snap.deployments[replica]
            k = self.keys
            keys = KeyList()
            payload = self._victim_ref(dep, keys) | {
                "events": keys.add(k.events),
                "to": target.value,
                "drops": [self._warm_ref(snap.deployments[r], keys) for r in drops],
                "floor": -1 if floor is None else floor,
                "epoch": epoch,
                "changes_seen": -1 if changes_seen is None else changes_seen,
                "why": why,
                "cache": keys.add(k.model_cache(dep.model)),  # its age, if it leaves
                "ages": cache.AGE_LABELS,
            }
            result = self._run_json("evict", keys, payload)
            if result[0] in (1, 2):
                return Level(result[1])
            if result[1] == "NOT_FOUND":
                raise RegistryError(f"no replica {replica} in the registry")
            if result[1] == "FLOOR":
                raise AtFloorError(f"{replica} stays: {result[2]}")
            if result[1] == "SCALED":
                raise ScaledSinceError(f"{replica} stays: {result[2]}")
            if result[1] in ("MOVED", "BUSY"):
                raise PlacementError(f"{replica} stays: {result[2]}")
        raise PlanRejectedError(f"replica {replica} kept moving while being evicted")

    def wait_settled(self, replica: str, timeout_s: float) -> Level:
        """The replica's level once no move of it is pending, or as it is after `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        while True:
            dep = self.deployment(replica)
            level = dep.level if dep is not None else Level.COLD
            if level not in LEAVING or time.monotonic() >= deadline:
                return level
            time.sleep(0.01)

    def _record(self, replica: str) -> Deployment:
        dep = self.deployment(replica)
        if dep is None:
            raise RegistryError(f"no replica {replica} in the registry; see `gpufleet status`")
        return dep

    def _offload_view(self, replica: str) -> Snapshot:
        """All an eviction needs to plan: the replica, its host's cache and the copies in it.

        Two small reads instead of a full snapshot; evict.lua re-checks what matters.
        """
        k = self.keys
        dep = self._record(replica)
        warm_ids = sorted(self._one("smembers", k.host_warm(dep.host))) if dep.host else []
        rows = self._read(
            [("hgetall", k.host(dep.host)), *(("hgetall", k.deployment(r)) for r in warm_ids)],
            atomic=True,
        )
        warm = [records.deployment(r, 0) for r in rows[1:] if records.whole(r)]
        return Snapshot(
            gpus={},
            deployments={d.replica: d for d in [*warm, dep]},
            hosts={dep.host: records.host(rows[0])} if rows[0] else {},
        )

    def record_measurement(self, model: str, peak_bytes: int) -> int:
        """Store a model's measured peak; returns the previous figure (0 if none)."""
        keys = [self.keys.learned, self.keys.events]
        return int(self._run("learn", keys, [model, int(peak_bytes), self.events_maxlen]))

    # --- requests -----------------------------------------------------------

    def pick(
        self,
        model: str,
        ttl_ms: int = DEFAULT_REQUEST_LEASE_MS,
        path: str = "",
        prefix: Sequence[str] = (),
    ) -> Lease | None:
        """Lease the least busy HOT replica of `model`, or the one its call's `prefix` chain
        was last sent to; None when none is ready (`HotPath.pick`)."""
        return self.hot.pick(model, ttl_ms, path, prefix)

    def forward(
        self, model: str, handover: Handover, path: str = "", prefix: Sequence[str] = ()
    ) -> Forwarded | Literal["gone"] | None:
        """`pick`, and move a router's taken message onto the leased replica's queue in the
        same step (`HotPath.forward`)."""
        return self.hot.forward(model, handover, path=path, prefix=prefix)

    def finish(self, lease: Lease) -> Level:
        """End a request's lease. A DRAINING replica left idle is evicted right away."""
        keys = [self.keys.deployment(lease.replica), self.keys.leases(lease.replica)]
        _, left, level = self._run("finish", keys, [lease.id])
        return self._finished(lease, int(left), level)

    def finish_all(self, leases: Sequence[Lease]) -> None:
        """End several leases in one round trip (a batch's calls); as `finish` otherwise."""
        commands: list[tuple[Any, ...]] = [
            ("evalsha", sha("finish"), 2, self.keys.deployment(lease.replica),
             self.keys.leases(lease.replica), lease.id)
            for lease in leases
        ]  # fmt: skip
        try:
            replies = self._read(commands)
        except redis.exceptions.NoScriptError:  # a restarted Redis: `finish` loads it
            replies = [self._run("finish", list(c[3:5]), [c[5]]) for c in commands]
        for lease, (_, left, level) in zip(leases, replies, strict=True):
            self._finished(lease, int(left), level)

    def new_lease_id(self) -> str:
        """A lease id for a call this client routes, naming its taker (`Store.taker`)."""
        return new_lease_id(self.taker)

    def end_leases_of(self, taker: str, dead: Callable[[int], bool] | None = None) -> int:
        """End the request leases that worker run `taker` took (`Store.taker`), only those
        of its processes that `dead(pid)` says died when given; return how many.

        A lease a dead process took for a call it never sent would pin its replica (keep
        pressure from evicting it, keep a drain from ending) until its deadline, minutes
        away. Ending the leases of calls it did send is safe too: such a call still runs
        on its replica if the replica is there, and is routed again if it left."""
        if not taker:
            return 0
        replicas = sorted(self._one("smembers", self.keys.deployments))
        held = self._read([("zrange", self.keys.leases(r), 0, -1) for r in replicas])
        ended = [
            Lease(lease_id, "", replica, "", "", {}, 0)
            for replica, ids in zip(replicas, held, strict=True)
            for lease_id in ids
            if (took := taker_of(lease_id)) is not None
            and took[0] == taker
            and (dead is None or dead(took[1]))
        ]
        if ended:
            self.finish_all(ended)
        return len(ended)

    def _finished(self, lease: Lease, left: int, level: str) -> Level:
        if level == Level.DRAINING.value and left == 0:
            return self.evict(lease.replica)
        return Level(level)

    # --- request outcomes ---------------------------------------------------

    def count(self, model: str, outcome: str, why: str = "") -> None:
        """Count the outcome the router's placement gave one call of `model` (`pick` counts
        hits itself): a request outcome counts the call as `routed` too, in the same step;
        `busy` counts one try, not a request, and no path. A refusal (`rejected`, `busy`)
        given a `why` is also told on the ledger's events stream, for the map's feed (the
        router tells a busy call's first try only, not each of its retries)."""
        if outcome not in OUTCOMES:
            raise ValueError(f"unknown outcome {outcome!r}; expected one of {OUTCOMES}")
        stats = self.keys.model_stats(model)
        routed = [("hincrby", stats, "routed", 1)] if outcome != "busy" else []
        told = []
        if outcome in REFUSALS and why:
            fields = {"kind": "refused", "replica": "", "model": model, "outcome": outcome,
                      "why": why[:WHY_CHARS]}  # fmt: skip
            told = [("xadd", self.keys.events, fields, "*", self.events_maxlen, True)]
        self._read(
            [("hincrby", stats, outcome, 1), *routed, ("sadd", self.keys.counted, model), *told],
            atomic=True,
        )

    def stats(self, snap: Snapshot | None = None) -> dict[str, dict[str, int]]:
        """Outcome and path counts per model since the fleet began: every model with a
        replica record (they may have hits) or a counted outcome."""
        snap = snap or self.snapshot()
        names = sorted(
            {d.model for d in snap.deployments.values()}
            | set(self._one("smembers", self.keys.counted))
        )
        rows = self._read([("hgetall", self.keys.model_stats(m)) for m in names])
        return {
            model: {o: int(row.get(o, 0)) for o in COUNTS}
            for model, row in zip(names, rows, strict=True)
        }


#: The outcomes that refuse a call for now (`count` tells them on the events stream).
REFUSALS = frozenset({"rejected", "busy"})
#: The most characters of a refusal's reason the events stream keeps.
WHY_CHARS = 300


def _take(rows: Iterator[Any], like: Sequence[str]) -> list[Any]:
    return [next(rows) for _ in like]
