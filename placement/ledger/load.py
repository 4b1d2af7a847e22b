"""Each model's load, read from the registry: what the scaling rule and `status` look at.

A replica's calls in flight are its live request leases (taken when a call is routed to
it, ended when the call finishes), so they count calls queued at its worker and the ones
it runs; a worker running a batch says how many calls its pass holds (`mark_batch`).
Calls the router holds for a model (a miss being placed, a busy retry) are kept
in a sorted set per model by `routing.lua`, each with a deadline, so a router that dies
leaves nothing behind for long.
"""

from __future__ import annotations

from collections.abc import Iterable

from placement.ledger.store import Store
from placement.policy.state import Deployment, Level
from placement.rules.scaling import ModelLoad, ReplicaLoad

ROUTING_TTL_MS = 120_000  # a held call renews its entry on every attempt
BATCH_TTL_MS = 60_000  # a worker that dies mid-batch leaves its count this long at most
_PLACED = (Level.HOT, Level.LOADING, Level.WAITING, Level.DRAINING)


def hold_routing(store: Store, model: str, call: str, held: bool) -> int:
    """Count `call` as held by the router for `model` (`held`), or no longer; returns how
    many calls the routers hold for it now."""
    keys = [store.keys.model_routing(model)]
    return int(store._run("routing", keys, [call, "1" if held else "0", ROUTING_TTL_MS]))


def mark_batch(store: Store, replica: str, calls: int) -> None:
    """Say that `replica`'s worker runs a pass of `calls` calls now (0: it ended)."""
    key = store.keys.batch(replica)
    store._read([("psetex", key, BATCH_TTL_MS, calls) if calls else ("delete", key)])


Placed = dict[str, list[tuple[str, Level, str, int]]]  # model -> (replica, level, worker, epoch)


def read_loads(store: Store, placed: Placed) -> list[ModelLoad]:
    """The load of each model in `placed` (its placed replicas from the caller's view of
    the ledger), read in one round trip, with the model's `changes` count: a decision
    names it, so that it is refused once the model's replicas changed (commit.lua)."""
    k = store.keys
    commands: list[tuple[object, ...]] = [("time",)]
    for model, replicas in placed.items():
        commands.append(("hget", k.changes, model))
        commands.append(("zrange", k.model_routing(model), 0, -1, False, True))
        for replica, *_ in replicas:
            commands.append(("zrange", k.leases(replica), 0, -1, False, True))
            commands.append(("hget", k.deployment(replica), "last_used"))
            commands.append(("get", k.batch(replica)))
    rows = iter(store._read(commands))
    sec, usec = next(rows)
    now = int(sec) * 1000 + int(usec) // 1000
    loads = []
    for model, replicas in placed.items():
        changes = int(next(rows) or 0)
        routing = sum(1 for _, deadline in next(rows) if deadline > now)
        seen = []
        for replica, level, worker, epoch in replicas:
            leases, last_used, batch = next(rows), next(rows), next(rows)
            in_flight = sum(1 for _, deadline in leases if deadline > now)
            idle = 0 if in_flight else max(0, now - int(last_used or now))
            running = int(batch or 0)
            seen.append(ReplicaLoad(replica, level, in_flight, idle, worker, epoch, running))
        loads.append(ModelLoad(model, seen, routing, changes))
    return loads


def placed_replicas(deployments: Iterable[Deployment], models: Iterable[str]) -> Placed:
    """Each of `models`' placed replicas among `deployments`."""
    out: Placed = {m: [] for m in models}
    for d in deployments:
        if d.model in out and d.level in _PLACED:
            out[d.model].append((d.replica, d.level, d.worker, d.epoch))
    return out
