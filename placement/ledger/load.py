"""Each model's load, read from the registry: what the scaling rule and `status` look at.

A replica's calls in flight are its live request leases (taken when a call is routed to
it, ended when the call finishes), so they count calls queued at its worker and the ones
it runs; a worker running a batch says how many calls its pass holds (`mark_batch`).
Calls the router holds for a model (a miss being placed, a busy retry) are kept
in a sorted set per model by `routing.lua`, each with a deadline, so a router that dies
leaves nothing behind for long.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

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


def read_changes(store: Store, models: Iterable[str]) -> dict[str, int]:
    """How many times each of `models`' placed replicas changed (one placed, one leaving):
    read before the view a scaling decision judges, the count it names, so that the
    registry refuses the decision once the model's replicas changed since (commit.lua,
    evict.lua). A change between this read and the view only makes the decision stale."""
    names = list(models)
    if not names:
        return {}
    counts = store._read([("hmget", store.keys.changes, *names)])[0]
    return {m: int(c or 0) for m, c in zip(names, counts, strict=True)}


def read_loads(
    store: Store, placed: Placed, changes: Mapping[str, int] | None = None
) -> list[ModelLoad]:
    """The load of each model in `placed` (its placed replicas from the caller's view of
    the ledger), read in one round trip; each with its count in `changes`
    (`read_changes`), when given."""
    k = store.keys
    commands: list[tuple[object, ...]] = [("time",)]
    for model, replicas in placed.items():
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
        routing = sum(1 for _, deadline in next(rows) if deadline > now)
        seen = []
        for replica, level, worker, epoch in replicas:
            leases, last_used, batch = next(rows), next(rows), next(rows)
            in_flight = sum(1 for _, deadline in leases if deadline > now)
            idle = 0 if in_flight else max(0, now - int(last_used or now))
            running = int(batch or 0)
            seen.append(ReplicaLoad(replica, level, in_flight, idle, worker, epoch, running))
        loads.append(ModelLoad(model, seen, routing, (changes or {}).get(model)))
    return loads


def placed_replicas(deployments: Iterable[Deployment], models: Iterable[str]) -> Placed:
    """Each of `models`' placed replicas among `deployments`."""
    out: Placed = {m: [] for m in models}
    for d in deployments:
        if d.model in out and d.level in _PLACED:
            out[d.model].append((d.replica, d.level, d.worker, d.epoch))
    return out
