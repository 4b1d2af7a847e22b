"""The router's view of the ledger: read once, then kept current from the events stream.

A full snapshot reads every record (half a second to a second at 1,000 GPUs and 10,000
replicas). Every script that moves a replica writes an event naming it, so a router
reads the snapshot once and afterwards only the events since, then the records those
events name: their replicas, the GPUs and hosts they left or took, and the GPUs a
placement's event names (a CUDA context charged there outlives the replica). A refresh costs in
proportion to what changed, not to the fleet.

What the events do not carry makes the view stale, never wrong where it matters:
`commit.lua` re-checks every plan against the live records, and a refused plan makes
the next refresh a full read. Stale are request leases taken or ended since (a replica
may look idle while busy, or busy while idle), a worker's lease renewals (GPUs are
live as of the last full read) and recency. So a policy refusal made on a view older
than `FRESH_S` is planned again on a full read before it stands. A full read also
happens when workers join or leave, when more than `FULL_AFTER` events piled up, and at
least every `MAX_AGE_S`.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

from placement.ledger import records
from placement.ledger.keys import Keys
from placement.ledger.store import time_ms
from placement.policy.live import LiveView
from placement.policy.state import Deployment, Gpu, Host, Snapshot

#: Events that change the set of workers and GPUs: only a full read takes them in.
MEMBERSHIP = frozenset({"registered", "reaped"})
FULL_AFTER = 1000
MAX_AGE_S = 30.0
FRESH_S = 1.0


class Ledger(Protocol):
    """What a follower reads: a registry (`placement.ledger.registry.Registry`, which holds one)."""

    keys: Keys

    def snapshot_at(self) -> tuple[Snapshot, str]: ...

    def _read(self, commands: list[tuple[Any, ...]], *, atomic: bool = False) -> list[Any]: ...


class Follower:
    """One process's current view of one registry; safe to share between threads."""

    def __init__(self, registry: Ledger) -> None:
        self._registry = registry
        self._lock = threading.Lock()
        self._view: LiveView | None = None
        self._cursor = "0-0"
        self._read_at = 0.0
        self.full_reads = 0  # how many times the whole ledger was read, for benchmarks

    @contextmanager
    def current(self) -> Iterator[Snapshot]:
        """The ledger as of now, give or take what the events do not carry. It does not
        change while the block runs (other threads wait): plan and commit inside it."""
        with self._lock:
            old = self._view is None or time.monotonic() - self._read_at > MAX_AGE_S
            if old or not self._catch_up():
                self._full()
            assert self._view is not None
            yield self._view.snap

    def fresh(self) -> bool:
        """True when the view was read in full within the last `FRESH_S`: a refusal made
        on it stands (a staler view may count request leases that have ended)."""
        return self._view is not None and time.monotonic() - self._read_at < FRESH_S

    def invalidate(self) -> None:
        """Read the whole ledger next time (a plan made on the view was refused)."""
        self._view = None  # an assignment: atomic, no lock needed

    def _full(self) -> None:
        snap, self._cursor = self._registry.snapshot_at()
        self._view = LiveView(snap)
        self._read_at = time.monotonic()
        self.full_reads += 1

    def _catch_up(self) -> bool:
        """Read the events since the cursor and the records they name; False when only a
        full read will do."""
        k = self._registry.keys
        events, still_there = self._registry._read(
            [
                ("xrange", k.events, f"({self._cursor}", "+", FULL_AFTER + 1),
                ("xrange", k.events, self._cursor, self._cursor),  # gone: events were trimmed
            ]
        )
        if not events:
            return True
        if len(events) > FULL_AFTER or not still_there:
            return False  # too many to follow, or some were trimmed before they were read
        replicas: set[str] = set()
        models: set[str] = set()
        gpus: set[str] = set()
        for _, fields in events:
            if fields.get("kind") in MEMBERSHIP:
                return False
            if fields.get("replica"):
                replicas.add(fields["replica"])
            elif fields.get("kind") == "measured":
                models.add(fields.get("model", ""))
            if fields.get("gpus"):  # a placement: its GPUs may keep a CUDA context charge
                gpus.update(json.loads(fields["gpus"]))
        self._reread(sorted(replicas), sorted(models), gpus)
        self._cursor = events[-1][0]
        return True

    def _reread(self, replicas: list[str], models: list[str], placed: set[str]) -> None:
        assert self._view is not None
        reg, k, snap = self._registry, self._registry.keys, self._view.snap
        rows = iter(
            reg._read(
                [("time",)]
                + [("hgetall", k.deployment(r)) for r in replicas]
                + [("zrange", k.leases(r), 0, -1, False, True) for r in replicas]
                + [("hget", k.learned, m) for m in models],
                atomic=True,
            )
        )
        now = time_ms(next(rows))
        found = [next(rows) for _ in replicas]
        leases = [next(rows) for _ in replicas]
        deps: dict[str, Deployment | None] = {}
        for replica, row, held in zip(replicas, found, leases, strict=True):
            deps[replica] = (
                records.deployment(row, sum(1 for _, t in held if t > now))
                if records.whole(row)
                else None
            )
        for model in models:
            value = next(rows)
            if value is not None:
                snap.learned[model] = int(value)  # type: ignore[index]
        gpu_ids = sorted(
            {g for d in deps.values() if d for g in d.gpus}
            | {g for r in replicas if (d := snap.deployments.get(r)) for g in d.gpus}
            | placed
        )
        hosts = sorted(
            {d.host for d in deps.values() if d and d.host}
            | {d.host for r in replicas if (d := snap.deployments.get(r)) and d.host}
        )
        more = iter(
            reg._read(
                [("hgetall", k.gpu(g)) for g in gpu_ids]
                + [("hgetall", k.host(h)) for h in hosts]
                + [("smembers", k.host_warm(h)) for h in hosts],
                atomic=True,
            )
        )
        gpus: dict[str, Gpu] = {}
        for gpu_id in gpu_ids:
            gpu_row: Any = next(more)
            if gpu_row:
                gpus[gpu_id] = records.gpu(gpu_row)
        host_rows = [next(more) for _ in hosts]
        warm = [next(more) for _ in hosts]
        host_map: dict[str, Host] = {}
        for name, host_row, held in zip(hosts, host_rows, warm, strict=True):
            if host_row:
                host = records.host(host_row)
                host_map[name] = Host(host.name, host.warm_budget, host.warm_used, frozenset(held))
        self._view.update(deps, gpus, host_map)
