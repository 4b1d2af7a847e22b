"""Checks of a soak run: ledger invariants, ownership, the event stream, leases, leaks.

Each function returns the problems it found, in words; an empty list is a pass.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from placement.ledger.audit import audit
from placement.ledger.registry import Registry
from placement.policy.state import Level, Snapshot
from tests.soak import DEDICATED, REPLICAS, WORKER_LEASE_MS, LeaseRecord


def replica_count_problems(snap: Snapshot) -> list[str]:
    """No model has more replicas on GPU than its catalog entry asks for."""
    return [
        f"model {m} has {n} replicas on GPU, the catalog asks for {REPLICAS.get(m)}"
        for m, n in snap.active.items()
        if n > REPLICAS.get(m, 0)
    ]


def ownership_problems(reg: Registry) -> list[str]:
    """The links `audit` does not check, read atomically (MULTI/EXEC).

    - a replica off COLD belongs to a registered worker and is in that worker's
      deployment set; a worker's set holds only its own replicas, none COLD;
    - a GPU's owner is a registered worker, and a worker owns the GPUs it lists.
    """
    k = reg.keys
    client = reg.client
    ids = [sorted(client.smembers(s)) for s in (k.workers, k.deployments, k.gpus)]
    for _ in range(16):
        workers, replicas, gpus = ids
        pipe = client.pipeline(transaction=True)
        for s in (k.workers, k.deployments, k.gpus):
            pipe.smembers(s)
        for w in workers:
            pipe.smembers(k.worker_deployments(w))
            pipe.hget(k.worker(w), "gpus")
        for r in replicas:
            pipe.hmget(k.deployment(r), "level", "worker")
        for g in gpus:
            pipe.hget(k.gpu(g), "worker")
        rows = iter(pipe.execute())
        now_ids = [sorted(next(rows)) for _ in range(3)]
        if now_ids != ids:
            ids = now_ids
            continue
        deps_of: dict[str, set[str]] = {}
        listed: dict[str, list[str]] = {}
        for w in workers:
            deps_of[w] = set(next(rows))
            listed[w] = json.loads(next(rows) or "[]")
        records = {r: tuple(next(rows)) for r in replicas}
        owner = {g: next(rows) or "" for g in gpus}
        problems: list[str] = []
        for w, deps in deps_of.items():
            for r in sorted(deps):
                level, holder = records.get(r, (None, None))
                if level in (None, Level.COLD.value) or holder != w:
                    problems.append(
                        f"worker {w}'s deployment set holds {r}, which is {level} "
                        f"on worker {holder!r}"
                    )
            for g in listed[w]:
                if owner.get(g) != w:
                    problems.append(f"worker {w} lists GPU {g}, owned by {owner.get(g)!r}")
        for r, (level, holder) in records.items():
            if level != Level.COLD.value and r not in deps_of.get(holder or "", set()):
                problems.append(
                    f"replica {r} is {level} on worker {holder!r}, which does not list it"
                )
        for g, w in owner.items():
            if w and w not in deps_of:
                problems.append(f"GPU {g} is owned by unregistered worker {w}")
        return problems
    return ["the registry changed under 16 ownership reads in a row"]


@dataclass
class _Replayed:
    level: Level
    worker: str = ""
    host: str = ""


#: Per replica, (registry ms, level, worker) after each event that moved it.
Timeline = dict[str, list[tuple[int, Level, str]]]


def replay_problems(
    events: Sequence[Mapping[str, str]], snap: Snapshot | None = None
) -> tuple[list[str], Timeline]:
    """Replay the event stream as a state machine; list every illegal move.

    With `snap`, the replayed level and worker of every replica must also match it.
    Returns the problems and each replica's timeline.
    """
    state: dict[str, _Replayed] = {}
    timeline: Timeline = defaultdict(list)
    workers: set[str] = set()
    problems: list[str] = []

    def bad(e: Mapping[str, str], why: str) -> None:
        problems.append(f"{why}: {dict(e)}")

    def host_of(gpus_json: str) -> str:
        hosts = {g.split(":", 1)[0] for g in json.loads(gpus_json or "{}")}
        return hosts.pop() if len(hosts) == 1 else f"<{sorted(hosts)}>"

    for e in events:
        kind, replica = e["kind"], e.get("replica", "")
        cur = state.get(replica)
        level = cur.level if cur else None
        if kind == "registered":
            workers.add(e["worker"])
        elif kind == "reaped":
            if e["worker"] not in workers:
                bad(e, "reaped a worker that is not registered")
            workers.discard(e["worker"])
        elif kind in ("placed", "restored"):
            want = (Level.WARM,) if kind == "restored" else (None, Level.COLD)
            if level not in want:
                bad(e, f"{kind} a replica that was {level}")
            if e["worker"] not in workers:
                bad(e, f"{kind} on unregistered worker")
            host = host_of(e.get("gpus", ""))
            if kind == "restored" and cur and cur.host != host:
                bad(e, f"restored on another host than its warm copy's ({cur.host})")
            state[replica] = _Replayed(Level(e["level"]), e["worker"], host)
        elif kind == "admitted":
            if level is not Level.WAITING or (cur and cur.worker != e["worker"]):
                bad(e, f"admitted a replica that was {level}")
            if cur:
                cur.level = Level.LOADING
        elif kind == "ready":
            if level is not Level.LOADING or (cur and cur.worker != e["worker"]):
                bad(e, f"ready a replica that was {level}")
            if cur:
                cur.level = Level.HOT
        elif kind == "draining":
            if level is not Level.HOT:
                bad(e, f"drained a replica that was {level}")
            if cur:
                cur.level = Level.DRAINING
        elif kind == "evicted":
            after = _evicted_to(level, e)
            if after is None:
                bad(e, f"evicted ({e.get('cause')}) a replica that was {level}")
            elif cur:
                cur.level = after
                if after is Level.COLD:
                    cur.worker = cur.host = ""
        elif kind == "settled":
            after = _settled_to(level, e.get("outcome", ""))
            if after is None or (cur and cur.worker != e["worker"]):
                bad(e, f"settled ({e.get('outcome')}) a replica that was {level}")
            elif cur:
                cur.level = after
                if after is Level.COLD:
                    cur.worker = cur.host = ""
        elif kind == "dropped":
            if level is not Level.WARM:
                bad(e, f"dropped a replica that was {level}")
            if cur:
                cur.level, cur.worker, cur.host = Level.COLD, "", ""
        elif kind == "released":
            was = e.get("was")
            if level is None or was != level.value or (cur and cur.worker != e["worker"]):
                bad(
                    e,
                    f"reap released a replica that was {level} on {cur.worker if cur else None!r}",
                )
            if was == Level.COLD.value:
                bad(e, "a COLD replica was still in its worker's deployment set")
            state[replica] = _Replayed(Level.COLD)
        elif kind not in ("measured", "refused"):  # a count, or a call refused for now
            bad(e, "unknown event kind")
        if replica in state:
            now = state[replica]
            timeline[replica].append((int(e["at"]), now.level, now.worker))
    if snap is not None:
        for r, d in snap.deployments.items():
            cur = state.get(r)
            if cur is None or cur.level is not d.level:
                problems.append(f"replica {r} is {d.level.value}; events say {cur}")
            elif d.level is not Level.COLD and cur.worker != d.worker:
                problems.append(f"replica {r} is on worker {d.worker}; events say {cur.worker}")
        for r in set(state) - set(snap.deployments):
            problems.append(f"events know replica {r}, the registry does not")
    return problems, timeline


def _evicted_to(level: Level | None, e: Mapping[str, str]) -> Level | None:
    """Where an eviction takes a replica (evict.lua, commit.lua), or None if illegal."""
    to_warm = e.get("to") == Level.WARM.value
    if e.get("cause") == "pressure":
        if level is not Level.HOT:
            return None
        return Level.OFFLOADING if to_warm else Level.DROPPING
    if level in (Level.HOT, Level.DRAINING):
        return Level.OFFLOADING if to_warm else Level.DROPPING
    if level is Level.WAITING and not to_warm:
        return Level.COLD
    if level in (Level.LOADING, Level.OFFLOADING) and not to_warm:
        return Level.DROPPING
    return None


_SETTLES: dict[str, tuple[frozenset[Level], Level]] = {
    "offloaded": (frozenset({Level.OFFLOADING}), Level.WARM),
    "dropped": (frozenset({Level.OFFLOADING, Level.DROPPING}), Level.COLD),
    "failed": (frozenset({Level.WAITING, Level.LOADING}), Level.COLD),
    "lost": (frozenset({Level.HOT, Level.DRAINING, Level.WARM}), Level.COLD),
}


def _settled_to(level: Level | None, outcome: str) -> Level | None:
    """Where a worker's settle takes a replica (settle.lua), or None if illegal."""
    if outcome not in _SETTLES or level not in _SETTLES[outcome][0]:
        return None
    return _SETTLES[outcome][1]


def liveness_problems(
    events: Sequence[Mapping[str, str]],
    beats: Iterable[tuple[str, int]],
    leases: Iterable[LeaseRecord],
) -> list[str]:
    """Nothing was placed on, restored to or routed to a worker whose lease had lapsed.

    A worker is live at `t` when some registration or heartbeat ran at or before `t`
    (at `deadline - WORKER_LEASE_MS`) and its deadline is after `t`.
    """
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for worker, deadline in beats:
        spans[worker].append((deadline - WORKER_LEASE_MS, deadline))

    def live(worker: str, t: int) -> bool:
        return any(start <= t < end for start, end in spans.get(worker, []))

    problems = [
        f"{e['kind']} on worker {e['worker']} after its lease lapsed: {dict(e)}"
        for e in events
        if e["kind"] in ("placed", "restored") and not live(e["worker"], int(e["at"]))
    ]
    problems += [
        f"lease {x.lease} on {x.replica} taken at {x.acquired} from worker {x.worker} "
        f"after its lease lapsed"
        for x in leases
        if not live(x.worker, x.acquired)
    ]
    return problems


def pick_problems(timeline: Timeline, leases: Iterable[LeaseRecord]) -> list[str]:
    """Every lease was taken on a HOT replica of the worker it names.

    pick.lua ran at `acquired`; events at that same millisecond may have run before or
    after it, so any state the replica had during that millisecond will do.
    """
    problems: list[str] = []
    for lease in leases:
        states: list[tuple[Level, str]] = [(Level.COLD, "")]
        for at, level, worker in timeline.get(lease.replica, []):
            if at < lease.acquired:
                states = [(level, worker)]
            elif at == lease.acquired:
                states.append((level, worker))
            else:
                break
        if (Level.HOT, lease.worker) not in states:
            problems.append(
                f"lease {lease.lease} on {lease.replica} ({lease.model}) taken at "
                f"{lease.acquired} from worker {lease.worker}; the replica was {states}"
            )
    return problems


def lease_problems(
    events: Sequence[Mapping[str, str]], leases: Iterable[LeaseRecord]
) -> tuple[list[str], Counter[str]]:
    """Evictions under live request leases, and pressure evictions of dedicated replicas.

    A lease pins its replica from `acquired` until the earliest of: `released`, its
    own deadline, and a reap or a worker's settle that took the replica COLD (both drop
    its leases).
    Returns the problems and the check's reach, so it cannot pass vacuously:
    `near` counts evictions between a lease's acquisition and its deadline or release
    (the ones that had to be told apart), `after_lost` evictions of a replica whose
    lost (never finished) lease had expired: expiry really unpinned it.
    """
    problems: list[str] = []
    reach: Counter[str] = Counter()
    evictions: dict[str, list[Mapping[str, str]]] = defaultdict(list)
    releases: dict[str, list[int]] = defaultdict(list)
    for e in events:
        if e["kind"] == "evicted":
            evictions[e["replica"]].append(e)
            if e.get("cause") == "pressure" and e["model"] in DEDICATED:
                problems.append(f"dedicated replica evicted by pressure: {dict(e)}")
        elif e["kind"] == "released" or (e["kind"] == "settled" and e["outcome"] != "offloaded"):
            releases[e["replica"]].append(int(e["at"]))  # it went COLD: its leases ended
    for lease in leases:
        end = lease.deadline if lease.released is None else min(lease.deadline, lease.released)
        reaped = [t for t in releases.get(lease.replica, []) if t >= lease.acquired]
        if reaped:
            end = min(end, reaped[0])
        for e in evictions.get(lease.replica, []):
            at = int(e["at"])
            if lease.acquired <= at <= max(lease.deadline, lease.released or 0):
                reach["near"] += 1
            if (
                lease.lost
                and lease.deadline <= at < lease.deadline + 2000
                and end == lease.deadline
            ):
                reach["after_lost"] += 1
            if lease.acquired < at < end:
                problems.append(
                    f"replica {lease.replica} evicted ({e.get('cause')}) at {at} while lease "
                    f"{lease.lease} pinned it [{lease.acquired}, {end}): {dict(e)}"
                )
    return problems, reach


def shutdown_leaks(reg: Registry) -> list[str]:
    """After every worker is reaped: no byte, warm byte, lease or owner is left."""
    snap = reg.snapshot()
    leaks = audit(snap)
    for g in snap.gpus.values():
        if g.reserved or g.held or g.worker:
            leaks.append(
                f"GPU {g.id} still reserves {g.reserved} and holds {g.held} bytes for {g.worker!r}"
            )
    for h in snap.hosts.values():
        if h.warm_used:
            leaks.append(f"host {h.name} still counts {h.warm_used} warm bytes")
    for d in snap.deployments.values():
        if d.level is not Level.COLD:
            leaks.append(f"replica {d.replica} is still {d.level.value}")
    for model, count in snap.active.items():
        if count:
            leaks.append(f"model {model} still counts {count} active replicas")
    now = reg.now_ms()
    for key in reg.lease_keys():
        live = reg.client.zrangebyscore(key, f"({now}", "+inf")
        if live:
            leaks.append(f"{key} still holds live leases {live}")
    workers = reg.client.smembers(reg.keys.workers)
    if workers:
        leaks.append(f"workers still registered: {sorted(workers)}")
    left = list(reg.client.scan_iter(match=f"{reg.keys.prefix}:worker:*"))
    if left:
        leaks.append(f"worker keys left: {sorted(left)}")
    return leaks


# --- the run --------------------------------------------------------------------
