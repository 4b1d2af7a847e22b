"""The event-driven replay: one policy, one trace, one ledger.

Two kinds of events, in time order: request arrivals (from the trace) and load
completions (a heap). For each arrival:

- **hit**: the model has a HOT replica (an O(1) look-up in the replay's own index of
  replicas on GPU, kept up to date from the plans it applies). The ledger records the
  use; the request costs `compute_s`. No planning happens.
- **queued**: the model's replica is LOADING; the request waits for it.
- **miss**: the replay takes the ledger's snapshot, builds the model's `Demand`, calls
  the router's own `plan_replica` and commits the plan to the ledger
  (`ledger.apply_plan` in memory, commit.lua in Redis). The replica loads for
  `size / h2d_bytes_per_s` when it is restored from the host's warm cache
  (`plan.reuse` is WARM), else `size / disk_bytes_per_s`.

A `CantAccommodateError` (every GPU blocked by replicas that are still loading)
parks the request; parked requests are retried, oldest first, whenever a load
completes. A `NeverFitsError` rejects it. When a load completes the worker confirms
the replica (LOADING -> HOT) and, for policies that learn, reports the model's
measured peak, which later demands carry as `Demand.learned`.

Simplifications, on purpose: a replica serves any number of concurrent requests at
`compute_s` each (no batching or compute contention), offloading a victim costs no
time (the ledger frees its bytes at commit, as the registry does), and requests hold
no leases, so any idle HOT replica is evictable between arrivals.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import deque
from dataclasses import asdict, dataclass

from placement.errors import CantAccommodateError, ConfigError, NeverFitsError
from placement.policy.place import plan_replica
from placement.policy.state import Candidate, Level
from placement.simulator.backends import Ledger, SimulationError
from placement.simulator.fleet import Fleet
from placement.simulator.policies import NEVER, SimPolicy, belady_view, with_learned
from placement.simulator.report import Recorder, RunResult
from placement.simulator.workloads import Trace


@dataclass(frozen=True)
class TimeModel:
    """What each step costs, in seconds and bytes per second.

    Defaults: 100 ms of compute per request; a warm restore over PCIe 4.0 x16 at a
    realistic 12 GB/s from pinned host memory; a cold load from local NVMe at 2 GB/s
    (a 30 GB model takes 15 s, within seed 003's "~30 s reload").
    """

    compute_s: float = 0.1
    h2d_bytes_per_s: float = 12e9
    disk_bytes_per_s: float = 2e9

    def __post_init__(self) -> None:
        if self.compute_s < 0 or self.h2d_bytes_per_s <= 0 or self.disk_bytes_per_s <= 0:
            raise ConfigError("compute time must be >= 0 and bandwidths > 0")

    def load_s(self, nbytes: int, warm: bool) -> float:
        """Seconds to bring `nbytes` of weights onto a GPU from CPU (`warm`) or disk."""
        return nbytes / (self.h2d_bytes_per_s if warm else self.disk_bytes_per_s)

    def describe(self) -> dict[str, float]:
        return asdict(self)


def _us(t: float) -> int:
    return round(t * 1e6)


class Replay:
    """Replays `trace` on `fleet` with `policy`, driving `ledger`. Call `run` once."""

    def __init__(
        self,
        trace: Trace,
        fleet: Fleet,
        policy: SimPolicy,
        ledger: Ledger,
        *,
        time_model: TimeModel | None = None,
        seed: int = 0,
        buckets: int = 100,
    ) -> None:
        if not len(trace):
            raise ConfigError("the trace is empty")
        if max(trace.models) >= len(fleet.models) or min(trace.models) < 0:
            raise ConfigError("the trace names models outside the fleet's catalog")
        self.trace = trace
        self.fleet = fleet
        self.policy = policy
        self.ledger = ledger
        self.tm = time_model or TimeModel()
        self.rng = random.Random(seed)
        self.names = [m.name for m in fleet.models]
        self.by_name = {m.name: m for m in fleet.models}
        self.demands = policy.demands(fleet)
        start, end = trace.times[0], trace.times[-1]
        self.rec = Recorder(start, end, fleet.gpu_bytes, buckets)
        self.where: dict[str, str] = {}  # model -> its replica on GPU (HOT or LOADING)
        self.loading: dict[str, float] = {}  # replica -> time it will be ready
        self.waiting_on: dict[str, int] = {}  # replica -> requests waiting for it
        self.loaded: set[str] = set()  # models loaded at least once
        self.events: list[tuple[float, int, str, str, str]] = []  # (ready, seq, rep, model, worker)
        self.parked: deque[tuple[float, str]] = deque()  # (arrival, model)
        self.next_at: dict[str, int] = {}  # oracle: model -> index of its next request
        self._seq = 0
        self._ran = False

    # --- the loop -------------------------------------------------------------

    def run(self) -> RunResult:
        """Replay every request, then let in-flight loads finish."""
        if self._ran:
            raise SimulationError("a Replay runs once; make a new one")
        self._ran = True
        began = time.perf_counter()
        times, models, names = self.trace.times, self.trace.models, self.names
        nxt = self._next_uses() if self.policy.belady else []
        where, loading, events = self.where, self.loading, self.events
        rec, compute, touch = self.rec, self.tm.compute_s, self.ledger.touch
        for i in range(len(times)):
            t = times[i]
            while events and events[0][0] <= t:
                self._complete(heapq.heappop(events))
            name = names[models[i]]
            if nxt:
                self.next_at[name] = nxt[i]
            rep = where.get(name)
            if rep is None:
                rec.enqueue()
                self._place(t, name, t)
            elif rep in loading:
                rec.enqueue()
                self._wait_for(rep, t, t)
            else:
                touch(name, rep, _us(t))
                rec.hit(t, compute)
        while events:
            self._complete(heapq.heappop(events))
        rec.rejected += len(self.parked)  # nothing is loading, so nothing will free up
        self.parked.clear()
        self.ledger.close()
        return rec.result(self.policy.name, time.perf_counter() - began, len(times))

    def _next_uses(self) -> list[int]:
        """For each request, the index of the next request for the same model."""
        models = self.trace.models
        nxt = [NEVER] * len(models)
        last: dict[int, int] = {}
        for i in range(len(models) - 1, -1, -1):
            nxt[i] = last.get(models[i], NEVER)
            last[models[i]] = i
        self.next_at = {self.names[m]: i for m, i in last.items()}  # first requests
        return nxt

    def _next_use(self, model: str) -> int:
        return self.next_at.get(model, NEVER)

    # --- events ---------------------------------------------------------------

    def _wait_for(self, rep: str, now: float, arrived: float) -> None:
        """A request that arrived at `arrived` waits (from `now`) for LOADING `rep`."""
        self.rec.queued += 1
        self.waiting_on[rep] = self.waiting_on.get(rep, 0) + 1
        self.rec.waited(arrived, self.loading[rep] - arrived, self.tm.compute_s)

    def _complete(self, event: tuple[float, int, str, str, str]) -> None:
        """A load finished: the replica is HOT, its waiters are served, parked requests retry."""
        ready, _, rep, model, worker = event
        del self.loading[rep]
        self.ledger.ready(rep, worker, _us(ready))
        if self.policy.learns:
            self.ledger.learn(model, self.by_name[model].peak)
        self.rec.depth -= self.waiting_on.pop(rep, 0)
        if self.parked:
            parked, self.parked = self.parked, deque()
            for arrived, name in parked:
                self._retry(ready, name, arrived)

    def _retry(self, now: float, name: str, arrived: float) -> None:
        """A parked request tries again at `now`."""
        rep = self.where.get(name)
        if rep is None:
            self._place(now, name, arrived)
        elif rep in self.loading:
            self._wait_for(rep, now, arrived)
        else:  # another parked request for the same model placed it and it is ready
            self.rec.queued += 1
            self.rec.depth -= 1
            self.rec.waited(arrived, now - arrived, self.tm.compute_s)

    def _place(self, now: float, name: str, arrived: float) -> None:
        """A miss at `now` (the request arrived at `arrived`): plan, commit, start the load."""
        ledger, policy, rec = self.ledger, self.policy, self.rec
        snap = ledger.snapshot(_us(now))
        demand = self.demands[name]
        if policy.learns:
            demand = with_learned(demand, snap.learned)
        view = belady_view(snap, self._next_use) if policy.belady else snap
        began = time.perf_counter()
        try:
            plan = plan_replica(demand, view, policy.settings, self.rng)
        except NeverFitsError:
            rec.rejected += 1
            rec.depth -= 1
            return
        except CantAccommodateError:
            if not self.loading:
                raise SimulationError(
                    f"{name} is blocked although nothing is loading; the ledger is stuck"
                ) from None
            self.parked.append((arrived, name))
            return
        finally:
            rec.plans += 1
            rec.plan_s += time.perf_counter() - began
        if plan.candidate is Candidate.DEPLOYED:
            raise SimulationError(f"{name} is resident in the ledger but not in the replay")
        ledger.commit(plan, snap)
        freed = peak = 0
        for eviction in plan.evictions:
            victim = snap.deployments[eviction.replica]
            del self.where[victim.model]
            freed += sum(victim.gpus.values())
            peak -= self.by_name[victim.model].peak
            if eviction.to is Level.WARM:
                rec.evictions_to_warm += 1
            else:
                rec.evictions_to_cold += 1
        rec.warm_drops += len(plan.warm_drops)
        rec.reserve(now, sum(plan.gpus.values()) - freed, peak + self.by_name[name].peak)
        warm = plan.reuse is Level.WARM
        if warm:
            rec.warm_restores += 1
        else:
            rec.cold_loads += 1
        if name not in self.loaded:
            rec.first_loads += 1
            self.loaded.add(name)
        ready = now + self.tm.load_s(plan.size, warm)
        self.where[name] = plan.replica
        self.loading[plan.replica] = ready
        self.waiting_on[plan.replica] = self.waiting_on.get(plan.replica, 0) + 1
        self._seq += 1
        heapq.heappush(self.events, (ready, self._seq, plan.replica, name, plan.worker))
        rec.waited(arrived, ready - arrived, self.tm.compute_s)
