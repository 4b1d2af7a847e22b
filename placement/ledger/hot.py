"""The fast path's request leases: a call for a HOT replica, pinned in one round trip.

`pick` leases the least busy HOT replica of a model (`pick.lua`): a client's routing
function and the router's consumer send the call on themselves. `forward` is `pick` and
the broker's move in one script (`forward.lua`), for a router whose broker is the same
Redis: the call's message, taken into the router's in-flight list, goes onto the leased
replica's queue with the lease in its headers, in the same step.

Both are made from the model's replica list, cached here: which replicas it has and the
worker (and queue) each had. The scripts check the list against the ledger and say
when it is stale; it is read again then, and after a miss (a later placement may add
replicas).

A lease's id names the worker run (`Store.taker`) and the process that took it
(`new_lease_id`), so the leases of a process that died before it sent their calls can be
found and ended (`Registry.end_leases_of`) instead of pinning replicas until their
deadlines.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

from placement.ledger.store import Store
from placement.ledger.tenancy.tenants import DEFAULT, worker_queue, worker_suffix
from placement.rules.prefixes import MAX_ENTRIES, SPILL

#: How long a request lease pins its replica unless the call ends it first.
DEFAULT_REQUEST_LEASE_MS = 300_000
#: How `pick` counts the call it leases for: see `HotPath.pick`.
PICK_PATHS = ("fast", "router", "")
#: `forward`'s answer for a message that is no longer in flight: a sweep gave it back.
GONE: Literal["gone"] = "gone"
#: Tries against a stale replica list before giving up (a miss: the router places).
_TRIES = 4


def new_lease_id(taker: str = "") -> str:
    """A fresh lease id: with a `taker` (a worker run's token), "<taker>.<pid>.<own part>",
    this process's pid in the middle; without one (a client), its own part alone."""
    if "." in taker:
        raise ValueError(f"a lease taker may not contain '.': {taker!r}")
    own = uuid.uuid4().hex
    return f"{taker}.{os.getpid()}.{own}" if taker else own


def taker_of(lease_id: str) -> tuple[str, int] | None:
    """The taker and pid a `new_lease_id` put in `lease_id`, or None if it names none."""
    taker, _, rest = lease_id.partition(".")
    pid, _, own = rest.partition(".")
    return (taker, int(pid)) if taker and pid.isascii() and pid.isdigit() and own else None


@dataclass(frozen=True)
class Lease:
    """A routed request's pin on a replica, until `finish` or `deadline_ms`."""

    id: str
    model: str
    replica: str
    queue: str
    worker: str
    gpus: dict[str, int]
    deadline_ms: int
    epoch: int = 0  # the placement it pins (a call checks its copy is of this epoch)


@dataclass(frozen=True)
class Handover:
    """A call's message as a router's consumer took it, ready for `forward`: the
    in-flight list it was taken into and the message as taken; the message to push, in
    three parts around the two values only the script knows (the lease header's value,
    a JSON object, and the queue's name, a JSON string); and what names a queue's list
    for the message's priority (`queue + suffix`). `watched`: the lists the consumer
    takes from, which the move looks at once it is done (`Forwarded.drained`). `tenant`:
    whose call it is; it goes to that tenant's queue of the worker
    (`placement.ledger.tenancy.tenants.worker_queue`) when calls wait at the worker, else
    to the worker's own queue (`forward.lua`); `tenants`: every tenant whose queue of a
    worker may hold calls; `priorities`: what follows a queue's name in its list of each
    priority."""

    inflight: str
    taken: bytes
    parts: tuple[str, str, str]
    suffix: str
    watched: tuple[str, ...] = ()
    tenant: str = DEFAULT
    tenants: tuple[str, ...] = ()
    priorities: tuple[str, ...] = ("",)  # what names each priority's list of a queue


@dataclass(frozen=True)
class Forwarded:
    """A message `forward` moved: the lease it carries, and whether every list of its
    `Handover.watched` was empty just after. A consumer told so blocks for its next
    message at once, rather than make a round trip to find nothing (the router's
    consumer, between a plain client's calls)."""

    lease: Lease
    drained: bool


@dataclass(frozen=True)
class _Replicas:
    """A model's replicas as last read: ids (sorted), and each one's worker and queue."""

    ids: list[str]
    workers: list[str]
    queues: list[str]


class HotPath:
    """The fast-path leases of one registry (see the module)."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self._cache: dict[str, _Replicas] = {}

    def pick(
        self,
        model: str,
        ttl_ms: int = DEFAULT_REQUEST_LEASE_MS,
        path: str = "",
        prefix: Sequence[str] = (),
    ) -> Lease | None:
        """Lease the least busy HOT replica of `model` (ties to the first by id, so a surplus
        replica idles out and can be scaled in), or None when none is ready. With a
        `prefix` chain (`placement.rules.prefixes.chain`), the replica its longest prefix
        was last sent to, unless it is `SPILL` leases busier than the least busy one.

        `path` says how a lease counts the call in the model's stats, in the same step:
        "fast" (a hit and a `fast` call: the client routes it), "router" (a hit and a
        `routed` call: the router routes a call not counted yet) or "" (nothing: a call
        counted already). A miss counts nothing: the router then counts the outcome of
        the call's placement (`Registry.count`). docs/metrics.md has the rule.
        """
        lease = self._lease(model, ttl_ms, path, None, prefix)
        return lease if isinstance(lease, Lease) else None

    def forward(
        self,
        model: str,
        handover: Handover,
        ttl_ms: int = DEFAULT_REQUEST_LEASE_MS,
        path: str = "",
        prefix: Sequence[str] = (),
    ) -> Forwarded | Literal["gone"] | None:
        """`pick`, and in the same step move `handover`'s message onto the leased replica's
        queue (out of its in-flight list), the lease in its headers; None when no replica
        is ready (nothing changed), `GONE` when the message is no longer in flight.
        Only for a broker that is the registry's Redis (`forward.lua`)."""
        found = self._lease(model, ttl_ms, path, handover, prefix)
        assert not isinstance(found, Lease)  # with a handover, a lease comes as `Forwarded`
        return found

    def _lease(
        self, model: str, ttl_ms: int, path: str, handover: Handover | None, prefix: Sequence[str]
    ) -> Lease | Forwarded | Literal["gone"] | None:
        """`pick.lua`, or `forward.lua` with a `handover`, against the cached replica list,
        read again while the script says it is stale."""
        _check_path(path)
        lease_id = new_lease_id(self._store.taker)
        for _ in range(_TRIES):
            known = self._known(model)
            keys = self._keys(model, known)
            args: list[Any] = [lease_id, ttl_ms, path]
            if handover is not None:
                queues = [worker_queue(q, handover.tenant) for q in known.queues]
                keys += [handover.inflight, *(q + handover.suffix for q in queues)]
                waiting = _waiting_lists(known.queues, handover)
                if waiting:  # a tenant's call: where the worker's calls may wait
                    keys += [q + handover.suffix for q in known.queues]
                    keys += [name for lists in waiting for name in lists]
                keys += handover.watched
                args += [handover.taken, *handover.parts, worker_suffix(handover.tenant)]
                args.append(len(waiting[0]) if waiting else 0)
            args += [len(prefix), SPILL, MAX_ENTRIES, *prefix, *known.ids, *known.workers]
            if handover is not None:
                args += known.queues
            result = self._store._run("pick" if handover is None else "forward", keys, args)
            if result[0] == 1:
                lease = _lease_of(lease_id, model, result[:7])
                return lease if handover is None else Forwarded(lease, bool(result[7]))
            if result[0] == 0:
                self._cache.pop(model, None)  # a later placement may add replicas
                return None
            if result[0] == -2:
                return GONE
            self._refresh(model)
        return None

    def _known(self, model: str) -> _Replicas:
        return self._cache.get(model) or self._refresh(model)

    def _keys(self, model: str, known: _Replicas) -> list[str]:
        """pick.lua's keys for `known` (forward.lua's begin with them)."""
        k = self._store.keys
        keys = [k.model_replicas(model)]
        for r, w in zip(known.ids, known.workers, strict=True):
            keys += [k.deployment(r), k.leases(r), k.worker(w)]
        keys += [k.model_stats(model), k.prefixes(model)]
        return keys

    def _refresh(self, model: str) -> _Replicas:
        store, k = self._store, self._store.keys
        ids = sorted(store._one("smembers", k.model_replicas(model)))
        rows = store._read([("hmget", k.deployment(r), "worker", "queue") for r in ids])
        known = _Replicas(ids, [w or "" for w, _ in rows], [q or "" for _, q in rows])
        self._cache[model] = known
        return known


def _check_path(path: str) -> None:
    if path not in PICK_PATHS:
        raise ValueError(f"unknown path {path!r}; expected one of {PICK_PATHS}")


def _lease_of(lease_id: str, model: str, result: list[Any]) -> Lease:
    """The lease a script's {1, replica, queue, worker, gpus, deadline, epoch} reply names."""
    _, replica, queue, worker, gpus, deadline, epoch = result
    return Lease(
        lease_id, model, replica, queue, worker, json.loads(gpus), int(deadline), int(epoch)
    )


def _waiting_lists(queues: list[str], handover: Handover) -> list[list[str]]:
    """Per worker queue, the lists where its calls wait (its own queue's, each tenant's of
    it, at every priority), for a tenant's call (`forward.lua`, ARGV[9]); none for the
    default tenant's, nor where the tenants are not known (the call then goes to its
    tenant's queue)."""
    if handover.tenant == DEFAULT or not handover.tenants:
        return []
    names = [DEFAULT, *sorted({handover.tenant, *handover.tenants})]
    return [
        [worker_queue(q, name) + p for name in names for p in handover.priorities] for q in queues
    ]
