"""The two ledgers a replay can drive: in memory (`ledger.apply_plan`) or the real Lua registry.

The engine talks to either through the same five calls, named after the registry's:

| call | in memory | Redis (`Registry`) | like |
| --- | --- | --- | --- |
| `snapshot(now)` | the current `Snapshot` | `snapshot()` | the router's read |
| `commit(plan, snap)` | `apply_plan` + `settle_all` | `commit`, `settle`, `admit` | a placement |
| `touch(model, replica, now)` | `last_used = now` | `pick` + `finish` | a fast-path hit |
| `ready(replica, worker, now)` | `ledger.mark(HOT)` | `confirm` (confirm.lua) | a load done |
| `learn(model, peak)` | `Snapshot.learned` | `record_measurement` | a measured peak |

In memory, time is the simulated clock in **microseconds** (carried in the
`*_ms` fields): the policy only compares recencies, and the finer tick keeps hits
that land in the same millisecond in their true order. In Redis mode the registry's
own clock (`TIME`, in ms) stamps every change; `tick_s` spaces the writes so no two
land in the same millisecond and LRU order is the replay's order there too.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import replace
from typing import Protocol

from placement.errors import GpufleetError
from placement.ledger.registry import Registry
from placement.policy.mirror import apply_plan, evict, settle, settle_all
from placement.policy.place import plan_offload
from placement.policy.settings import PolicySettings
from placement.policy.state import LEAVING, Level, Plan, Snapshot
from placement.simulator.fleet import Fleet

#: Worker leases in Redis mode: long enough for any simulation.
SIM_WORKER_LEASE_MS = 24 * 3600 * 1000


class SimulationError(GpufleetError):
    """The replay and its ledger disagree (a bug in the simulator or the ledger)."""


class Ledger(Protocol):
    """What the replay needs from a ledger (see the module docstring)."""

    def snapshot(self, now: int) -> Snapshot: ...

    def commit(self, plan: Plan, snap: Snapshot) -> None: ...

    def touch(self, model: str, replica: str, now: int) -> None: ...

    def ready(self, replica: str, worker: str, now: int) -> None: ...

    def learn(self, model: str, peak: int) -> None: ...

    def close(self) -> None: ...


class MemoryLedger:
    """The ledger as an in-memory `Snapshot`, changed by `placement.policy.mirror` only.

    Hits must stay O(1), so recency updates (`touch`) and LOADING -> HOT marks
    (`ready`) are buffered and folded into the snapshot in one pass when the next
    snapshot is taken; the fold is the same change as calling `ledger.mark` for each
    buffered replica (a test checks that), just without copying the whole map per call.
    """

    def __init__(self, snap: Snapshot) -> None:
        self._snap = snap
        self._used: dict[str, int] = {}
        self._hot: set[str] = set()

    def snapshot(self, now: int) -> Snapshot:
        """The ledger at `now` with every buffered mark applied."""
        deps = self._snap.deployments
        if self._used or self._hot:
            folded = dict(deps)
            for replica in self._hot | self._used.keys():
                d = folded[replica]
                level = Level.HOT if replica in self._hot else d.level
                folded[replica] = replace(
                    d, level=level, last_used_ms=self._used.get(replica, d.last_used_ms)
                )
            self._used.clear()
            self._hot.clear()
            deps = folded
        self._snap = replace(self._snap, deployments=deps, now_ms=now)
        return self._snap

    def commit(self, plan: Plan, snap: Snapshot) -> None:
        """Apply `plan`, made from the latest `snapshot()`, with `ledger.apply_plan`; the
        simulated workers settle its victims and admit it at once."""
        if snap is not self._snap or self._used or self._hot:
            raise SimulationError("a plan must be committed on the latest snapshot")
        self._snap = settle_all(apply_plan(snap, plan))

    def touch(self, model: str, replica: str, now: int) -> None:
        """A hit: the replica was used at `now` (pick.lua sets `last_used`)."""
        self._used[replica] = now

    def ready(self, replica: str, worker: str, now: int) -> None:
        """The worker finished loading: LOADING -> HOT, used at `now` (confirm.lua)."""
        self._hot.add(replica)
        self._used[replica] = now

    def evict(
        self, replica: str, now: int, settings: PolicySettings
    ) -> tuple[Level, tuple[str, ...]]:
        """Offload an idle replica to its host's warm cache when it fits, else drop it
        (`plan_offload`, as `Registry.evict` does); the worker settles the move at once.
        Returns where it went and the warm copies dropped to make room."""
        snap = self.snapshot(now)
        eviction, drops = plan_offload(replica, snap, settings)
        for copy in drops:
            snap = settle(evict(snap, copy, Level.COLD), copy, "dropped")
        self._snap = settle_all(evict(snap, replica, eviction.to))
        return eviction.to, drops

    def learn(self, model: str, peak: int) -> None:
        """Record a measured peak, as the `learned` hash does."""
        if self._snap.learned.get(model) == peak:
            return
        self._snap = replace(self._snap, learned={**self._snap.learned, model: peak})

    def close(self) -> None:
        """Nothing to release."""


class RedisLedger:
    """The real registry: every change runs the Lua scripts on a Redis server.

    One worker per GPU is registered (as gpufleet runs one GPU worker process per
    GPU) under a fresh fleet name, whose keys `close` deletes.
    """

    def __init__(
        self, url: str, fleet: Fleet, *, name: str | None = None, tick_s: float = 0.002
    ) -> None:
        self.name = name or f"sim-{uuid.uuid4().hex[:12]}"
        self.registry = Registry.from_url(url, self.name)
        self.tick_s = tick_s
        self._epochs: dict[str, int] = {}
        empty = fleet.snapshot()
        budgets = {h.name: h.warm_budget for h in fleet.hosts}
        for gpu in empty.gpus.values():
            self.registry.register_worker(
                gpu.worker,
                gpu.host,
                gpu.queue,
                [gpu],
                warm_budget=budgets[gpu.host],
                lease_ms=SIM_WORKER_LEASE_MS,
            )

    def _tick(self) -> None:
        time.sleep(self.tick_s)

    def snapshot(self, now: int) -> Snapshot:
        """`Registry.snapshot()`; the registry keeps its own clock."""
        return self.registry.snapshot()

    def commit(self, plan: Plan, snap: Snapshot) -> None:
        """`Registry.commit` (commit.lua re-checks the plan atomically); then, playing the
        workers, settle its victims' moves and admit it (settle.lua, admit.lua)."""
        committed = self.registry.commit(plan, snap)
        self._epochs[plan.replica] = committed.epoch
        for eviction in plan.evictions:
            victim = self.registry.deployment(eviction.replica)
            if victim is None or victim.level not in LEAVING:
                raise SimulationError(f"victim {eviction.replica} is not leaving after commit")
            outcome = "offloaded" if victim.level is Level.OFFLOADING else "dropped"
            self.registry.settle(victim, outcome)
        placed = self.registry.deployment(plan.replica)
        if placed is None:
            raise SimulationError(f"{plan.replica} has no record after its commit")
        if placed.level is Level.WAITING and self.registry.admit(placed) is not Level.LOADING:
            raise SimulationError(f"{plan.replica} is not admitted once its victims left")
        self._tick()

    def touch(self, model: str, replica: str, now: int) -> None:
        """The fast path: `pick` leases the HOT replica, `finish` ends the request."""
        lease = self.registry.pick(model, path="fast")
        if lease is None or lease.replica != replica:
            got = lease.replica if lease else "nothing"
            raise SimulationError(f"pick({model}) returned {got}; the replay expected {replica}")
        self.registry.finish(lease)
        self._tick()

    def ready(self, replica: str, worker: str, now: int) -> None:
        """`Registry.confirm`: LOADING -> HOT."""
        if not self.registry.confirm(replica, worker, self._epochs.get(replica, 0)):
            raise SimulationError(f"confirm({replica}) refused: it is no longer LOADING")
        self._tick()

    def learn(self, model: str, peak: int) -> None:
        """`Registry.record_measurement`."""
        self.registry.record_measurement(model, peak)

    def close(self) -> None:
        """Delete this fleet's keys (SCAN, never KEYS) and close the connection."""
        client = self.registry.client
        try:
            batch: list[str] = []
            for key in client.scan_iter(match=f"{self.registry.keys.prefix}:*", count=500):
                batch.append(key)
                if len(batch) >= 500:
                    client.unlink(*batch)
                    batch.clear()
            if batch:
                client.unlink(*batch)
        finally:
            client.close()
