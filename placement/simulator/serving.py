"""Replays with service time: a replica serves one call at a time, and replicas follow load.

`engine.Replay` lets a replica serve any number of calls at once: it measures placement
(hits, loads, memory). Here a replica runs one call at a time, first come first served,
as a GPU worker does, so a popular model's calls queue behind each other; and the
routers' scaling rule (`placement.rules.scaling.Scaler`, the very object the routers run) may
add replicas. Calls go to the ready replica that frees up first (the least loaded); a
model with none ready waits for the first to load. With `scaler=None` each model keeps
one replica on GPU at most: the fixed single replicas to compare with.

- Every `LOOK_S` of simulated time the rule looks at each model's replicas: calls in
  flight are those sent to a replica and not finished yet, idle time runs from its last
  call's end. A scale-out plans with the router's `plan_replica` on a view without the
  workers that hold the model, protecting models under pressure, as `tasks/serving/scaling.py`
  does; a scale-in offloads the replica (`plan_offload`), down to the model's floor.
- A replica with calls in flight is never evicted: the planning view carries them as
  request leases, as the registry does. A miss that finds no room waits (parked) and
  tries again at the next look or load completion.
- Memory ledger only; policies that plan on a Belady view are not supported.
"""

from __future__ import annotations

import heapq
import random
import time
from collections import defaultdict, deque
from dataclasses import dataclass, field, replace

from placement.errors import CantAccommodateError, ConfigError, NeverFitsError
from placement.policy.place import plan_replica
from placement.policy.state import Candidate, Demand, Level, Plan, Snapshot
from placement.rules.scaling import Autoscale, ModelLoad, ReplicaLoad, ScaleIn, ScaleOut, Scaler
from placement.simulator.backends import MemoryLedger
from placement.simulator.engine import TimeModel
from placement.simulator.fleet import Fleet
from placement.simulator.policies import SimPolicy, with_learned
from placement.simulator.report import Recorder, RunResult
from placement.simulator.workloads import Trace

LOOK_S = 0.5  # as often as a router looks (tasks/serving/scaling.py)
CEILING = 4  # replicas a model may scale out to in the simulator


@dataclass
class _Replica:
    model: str
    worker: str
    ready_at: float  # when it is HOT
    free_at: float  # when the last call sent to it ends
    ends: deque[float] = field(default_factory=deque)  # calls not finished, by end time

    def in_flight(self, now: float) -> int:
        while self.ends and self.ends[0] <= now:
            self.ends.popleft()
        return len(self.ends)


def _us(t: float) -> int:
    return round(t * 1e6)


class ServingReplay:
    """Replays `trace` on `fleet` with `policy`, each replica serving one call at a time,
    replicas following load when a `scaler` is given. Call `run` once."""

    def __init__(
        self,
        trace: Trace,
        fleet: Fleet,
        policy: SimPolicy,
        *,
        scaler: Scaler | None = None,
        ceiling: int = CEILING,
        time_model: TimeModel | None = None,
        seed: int = 0,
        buckets: int = 100,
    ) -> None:
        if policy.belady:
            raise ConfigError(f"policy {policy.name} plans on the future: not with service time")
        self.trace, self.fleet, self.policy = trace, fleet, policy
        self.ledger = MemoryLedger(fleet.snapshot())
        self.tm = time_model or TimeModel()
        self.rng = random.Random(seed)
        self.scaler = scaler
        self.rules = {m.name: Autoscale(1, ceiling) for m in fleet.models} if scaler else {}
        self.names = [m.name for m in fleet.models]
        self.by_name = {m.name: m for m in fleet.models}
        self.demands = policy.demands(fleet)
        self.rec = Recorder(trace.times[0], trace.times[-1], fleet.gpu_bytes, buckets)
        self.replicas: dict[str, _Replica] = {}
        self.of_model: dict[str, list[str]] = defaultdict(list)
        self.loads: list[tuple[float, int, str]] = []  # (ready, seq, replica)
        self.parked: deque[tuple[float, str]] = deque()  # (arrival, model)
        self.loaded: set[str] = set()
        self._seq = 0

    # --- the loop -----------------------------------------------------------------

    def run(self) -> RunResult:
        began = time.perf_counter()
        times, models = self.trace.times, self.trace.models
        look = times[0] + LOOK_S
        for i in range(len(times)):
            t = times[i]
            look = self._until(t, look)
            self._call(t, self.names[models[i]], t)
        self._until(float("inf"), look, drain=True)
        self.rec.rejected += len(self.parked)
        result = self.rec.result(self.policy.name, time.perf_counter() - began, len(times))
        return result

    def _until(self, t: float, look: float, drain: bool = False) -> float:
        """Finish the loads and looks due by `t`, in time order; the next look's time."""
        while True:
            load = self.loads[0][0] if self.loads else float("inf")
            if drain and load == float("inf") and not (self.parked and self._busy(look)):
                return look  # nothing loads, and no call still runs to make room
            if min(load, look) > t:
                return look
            if load <= look:
                self._loaded(heapq.heappop(self.loads))
            else:
                self._look(look)
                look += LOOK_S

    # --- calls ----------------------------------------------------------------------

    def _call(self, now: float, name: str, arrived: float) -> None:
        """A call of `name` that arrived at `arrived` is sent on at `now`."""
        mine = self.of_model[name]
        if not mine:
            self._place(now, name, arrived)
            return
        ready = [r for r in mine if self.replicas[r].ready_at <= now]
        chosen = min(  # the first free, ties by id as pick.lua: a surplus replica idles out
            ready or mine,
            key=lambda r: (max(now, self.replicas[r].free_at, self.replicas[r].ready_at), r),
        )
        rep = self.replicas[chosen]
        start = max(now, rep.ready_at, rep.free_at)
        self._send(rep, start)
        if ready and arrived == now:
            self.ledger.touch(name, chosen, _us(now))
            self.rec.hit(arrived, self.tm.compute_s, start - arrived)
        else:
            self.rec.queued += 1
            self.rec.waited(arrived, start - arrived, self.tm.compute_s)

    def _send(self, rep: _Replica, start: float) -> None:
        end = start + self.tm.compute_s
        rep.free_at = end
        rep.ends.append(end)

    def _place(self, now: float, name: str, arrived: float) -> None:
        """A miss: plan one replica with the router's policy and send the call to it."""
        demand = self.demands[name]
        planned = self._plan(now, demand, frozenset())
        if isinstance(planned, CantAccommodateError):
            if isinstance(planned, NeverFitsError):
                self.rec.rejected += 1
            else:
                self.parked.append((arrived, name))
            return
        rep = self._start(now, *planned)
        start = max(rep.ready_at, rep.free_at)
        self._send(rep, start)
        self.rec.waited(arrived, start - arrived, self.tm.compute_s)

    def _plan(
        self, now: float, demand: Demand, avoid: frozenset[str]
    ) -> tuple[Plan, Snapshot] | CantAccommodateError:
        """A plan committed on the ledger (made on a view where busy replicas carry their
        calls as leases) with the snapshot it was made on, or the refusal."""
        snap = self.ledger.snapshot(_us(now))
        if self.policy.learns:
            demand = with_learned(demand, snap.learned)
        view = self._view(snap, now)
        if avoid:
            view = view.without_workers(avoid)
        began = time.perf_counter()
        try:
            plan = plan_replica(demand, view, self.policy.settings, self.rng)
        except CantAccommodateError as exc:
            return exc
        finally:
            self.rec.plans += 1
            self.rec.plan_s += time.perf_counter() - began
        if plan.candidate is Candidate.DEPLOYED:
            raise ConfigError(f"{demand.model} is placed in the ledger but not in the replay")
        self.ledger.commit(plan, snap)
        return plan, snap

    def _view(self, snap: Snapshot, now: float) -> Snapshot:
        busy = {r: n for r, rep in self.replicas.items() if (n := rep.in_flight(now))}
        if not busy:
            return snap
        deps = dict(snap.deployments)
        for replica, calls in busy.items():
            deps[replica] = replace(deps[replica], leases=calls)
        return replace(snap, deployments=deps)

    def _start(self, now: float, plan: Plan, snap: Snapshot) -> _Replica:
        """Account a plan committed on `snap`: its victims leave, its replica loads."""
        freed = peak = 0
        for eviction in plan.evictions:
            victim = self.replicas.pop(eviction.replica)
            self.of_model[victim.model].remove(eviction.replica)
            freed += sum(snap.deployments[eviction.replica].gpus.values())
            peak -= self.by_name[victim.model].peak
            if eviction.to is Level.WARM:
                self.rec.evictions_to_warm += 1
            else:
                self.rec.evictions_to_cold += 1
        self.rec.warm_drops += len(plan.warm_drops)
        name = plan.model
        self.rec.reserve(now, sum(plan.gpus.values()) - freed, peak + self.by_name[name].peak)
        warm = plan.reuse is Level.WARM
        if warm:
            self.rec.warm_restores += 1
        else:
            self.rec.cold_loads += 1
        if name not in self.loaded:
            self.rec.first_loads += 1
            self.loaded.add(name)
        ready = now + self.tm.load_s(plan.size, warm)
        rep = self.replicas[plan.replica] = _Replica(name, plan.worker, ready, ready)
        self.of_model[name].append(plan.replica)
        self._seq += 1
        heapq.heappush(self.loads, (ready, self._seq, plan.replica))
        return rep

    def _loaded(self, event: tuple[float, int, str]) -> None:
        ready, _, replica = event
        rep = self.replicas.get(replica)
        if rep is None or rep.ready_at != ready:
            return  # evicted while loading, or placed again since
        self.ledger.ready(replica, rep.worker, _us(ready))
        if self.policy.learns:
            self.ledger.learn(rep.model, self.by_name[rep.model].peak)
        self._retry(ready)

    def _busy(self, now: float) -> bool:
        return any(rep.in_flight(now) for rep in self.replicas.values())

    def _retry(self, now: float) -> None:
        parked, self.parked = self.parked, deque()
        for arrived, name in parked:
            self._call(now, name, arrived)

    # --- scaling ------------------------------------------------------------------

    def _look(self, now: float) -> None:
        """Parked misses try again; the scaling rule, when on, looks at every model."""
        if self.parked:
            self._retry(now)
        if self.scaler is None:
            return
        loads = [self._load(name, mine, now) for name, mine in self.of_model.items() if mine]
        pressed = frozenset(m.model for m in loads if m.pressure >= self.scaler.threshold)
        for decision in self.scaler.decide(round(now * 1000), loads, self.rules):
            if isinstance(decision, ScaleOut):
                self._scale_out(now, decision, pressed)
            elif isinstance(decision, ScaleIn):
                self._scale_in(now, decision)

    def _load(self, name: str, mine: list[str], now: float) -> ModelLoad:
        seen = []
        for replica in mine:
            rep = self.replicas[replica]
            calls = rep.in_flight(now)
            level = Level.HOT if rep.ready_at <= now else Level.LOADING
            idle = 0 if calls else round((now - max(rep.free_at, rep.ready_at)) * 1000)
            seen.append(ReplicaLoad(replica, level, calls, max(0, idle), rep.worker))
        return ModelLoad(name, seen)

    def _scale_out(self, now: float, decision: ScaleOut, pressed: frozenset[str]) -> None:
        mine = self.of_model[decision.model]
        demand = replace(self.demands[decision.model], replicas=decision.target, protect=pressed)
        avoid = frozenset(self.replicas[r].worker for r in mine)
        planned = self._plan(now, demand, avoid)
        if isinstance(planned, CantAccommodateError):
            return
        self._start(now, *planned)
        self.rec.scale_outs += 1

    def _scale_in(self, now: float, decision: ScaleIn) -> None:
        rep = self.replicas.pop(decision.replica)
        self.of_model[decision.model].remove(decision.replica)
        held = self.ledger.snapshot(_us(now)).deployments[decision.replica].gpus
        _, drops = self.ledger.evict(decision.replica, _us(now), self.policy.settings)
        self.rec.warm_drops += len(drops)
        freed = sum(held.values())
        self.rec.reserve(now, -freed, -self.by_name[rep.model].peak)
        self.rec.scale_ins += 1
