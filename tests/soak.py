"""A multi-process soak of the placement registry: the workload and the checks.

`tests/test_concurrency.py` starts `run_child` in several OS processes (the "spawn"
context). Each child owns one simulated worker with one or two GPUs and, until its
deadline, issues random registry operations: deploy (place + confirm, some confirms
late), explicit evict (some forced COLD), route (pick; some clients "lost": they never
finish and their short lease must lapse by itself), finish, heartbeat, `reap_expired`
and a deliberate expiry: the child stops heartbeating until its lease lapses, then
heartbeats late (which must be refused), and registers again under a new worker id
on the same GPU ids.

A share of deploys and evicts plan on a snapshot read up to a second before
(`SlowRegistry`): a client that stalled between its read and its script. After an
expiry the child replays the snapshot it read just before its lease lapsed, aimed at
its own GPUs, which changed owner since. Every race the Lua scripts must detect thus
happens often, not once in a blue moon.

Every child writes what it did to a JSON file: counts per outcome, its request leases,
its workers' lease deadlines. The checks are pure functions over what the registry
recorded (snapshots and the event stream) and what the children logged, so a failure
names the rule it broke:

- `audit` (placement.ledger.audit) and `replica_count_problems` on every snapshot;
- `ownership_problems`: what `audit` cannot see, the worker <-> replica <-> GPU links;
- `replay_problems`: the event stream, replayed as a state machine, makes only legal
  moves and ends where the registry is;
- `lease_problems`: no replica left its GPU (by pressure or explicit evict) while a
  request lease on it was live; no dedicated replica was evicted by pressure;
- `pick_problems` and `liveness_problems`: leases were taken only on HOT replicas of
  live workers, and replicas placed only on live workers;
- `shutdown_leaks`: once every worker is reaped, no byte, lease or owner is left.

Each child also plays its worker's keeper (`keep`): it admits its WAITING placements,
confirms its LOADING ones and settles its OFFLOADING and DROPPING ones, some at once and
some after a pause, and now and then fails a load or loses a HOT copy.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing
import os
import random
import threading
import time
import traceback
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from multiprocessing.synchronize import Barrier
from pathlib import Path

from placement.errors import (
    CantAccommodateError,
    GpuOwnedError,
    LeaseLostError,
    PlanRejectedError,
    RegistryError,
    SettlingError,
)
from placement.ledger.audit import audit
from placement.ledger.hot import Lease
from placement.ledger.registry import Registry
from placement.policy.settings import PolicySettings
from placement.policy.state import RESERVING, Candidate, Demand, Deployment, Gpu, Level, Snapshot

GiB = 2**30

#: Every registry of the soak keeps the whole event stream: the checks replay it.
EVENTS_MAXLEN = 10_000_000

#: The policy of the soak. The default factor (3.0) makes the larger models take
#: whole GPUs, so the fleet is always short of memory: plenty of pressure evictions.
SETTINGS = PolicySettings()

#: The models. Sizes are bytes of weights; slots are `size x factor` or whole GPUs.
CATALOG: tuple[Demand, ...] = (
    Demand("tiny", size=GiB // 2),
    Demand("small", size=1 * GiB),
    Demand("small-b", size=3 * GiB // 2),
    Demand("medium", size=2 * GiB),
    Demand("medium-b", size=5 * GiB // 2),
    Demand("large", size=3 * GiB),
    Demand("large-b", size=4 * GiB),
    Demand("xl", size=5 * GiB),
    Demand("xxl", size=6 * GiB),
    Demand("mid-c", size=3 * GiB // 2),
    Demand("mid-d", size=2 * GiB),
    Demand("mid-e", size=3 * GiB),
    Demand("mid-f", size=4 * GiB),
    Demand("pinned", size=1 * GiB, dedicated=True),
    Demand("pinned-b", size=3 * GiB // 2, dedicated=True),
    Demand("pair", size=1 * GiB, replicas=2),
    Demand("enveloped", request=2 * GiB, limit=4 * GiB),
    Demand("huge", size=18 * GiB),  # larger than any GPU: split over two of one host
)
DEDICATED = frozenset(d.model for d in CATALOG if d.dedicated)
REPLICAS = {d.model: d.replicas for d in CATALOG}
MODELS = tuple(d.model for d in CATALOG)

HOSTS = 3
WARM_BUDGET = 8 * GiB  # per host; every worker of a host registers the same figure
#: GPU sizes of child i's worker: GPU_TOTALS[i % 8] (104 GiB for eight children).
GPU_TOTALS: tuple[tuple[int, ...], ...] = (
    (16 * GiB, 16 * GiB),
    (8 * GiB,),
    (12 * GiB,),
    (6 * GiB,),
    (12 * GiB, 12 * GiB),
    (12 * GiB,),
    (8 * GiB,),
    (6 * GiB,),
)
WORKER_LEASE_MS = 1500
HEARTBEAT_EVERY_S = 0.25
#: The share of deploys and evicts that plan on a snapshot up to STALE_FOR_S old.
STALE_SHARE = 0.3
STALE_FOR_S = 1.0

#: Relative weights of the operations a child picks from.
WEIGHTS: Mapping[str, int] = {
    "deploy": 30,
    "route": 30,
    "finish": 22,
    "evict": 5,
    "heartbeat": 4,
    "reap_expired": 3,
    "snapshot": 3,
}


@dataclass(frozen=True)
class ChildConfig:
    """What one child process needs; plain data, so it pickles under "spawn"."""

    url: str
    fleet: str
    index: int
    processes: int
    seed: str
    seconds: float
    out_dir: str


@dataclass
class LeaseRecord:
    """One request lease as its holder saw it (all times are registry milliseconds).

    `acquired` is the registry clock inside pick.lua (deadline - ttl). `released` is
    read just before `finish` was called (the lease certainly pinned until then), or
    None for a lost client that never finished.
    """

    lease: str
    replica: str
    model: str
    worker: str
    acquired: int
    deadline: int
    released: int | None = None
    lost: bool = False


@dataclass
class ChildReport:
    index: int
    seed: str
    host: str
    gpus: list[str]
    workers: list[str] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    leases: list[LeaseRecord] = field(default_factory=list)
    #: (worker, lease deadline) of every registration and heartbeat, in order; the
    #: registry ran each at `deadline - WORKER_LEASE_MS`.
    beats: list[tuple[str, int]] = field(default_factory=list)
    #: Contract breaches the child saw in replies (e.g. a late heartbeat accepted).
    violations: list[str] = field(default_factory=list)
    ops: int = 0
    elapsed_s: float = 0.0
    error: str | None = None


# --- the simulated fleet --------------------------------------------------------


def layout(processes: int) -> list[tuple[str, list[Gpu]]]:
    """(host, GPUs) of each child: three hosts, one or two GPUs per worker.

    Host h2's two 12 GiB GPUs belong to two workers, so a model split over them
    spans workers.
    """
    per_host: Counter[str] = Counter()
    out: list[tuple[str, list[Gpu]]] = []
    for i in range(processes):
        host = f"h{i % HOSTS}"
        gpus = []
        for total in GPU_TOTALS[i % len(GPU_TOTALS)]:
            index = per_host[host]
            per_host[host] += 1
            name = f"Sim p{i}x"  # `accelerator="p{i}x"` picks child i's GPUs
            gpus.append(Gpu(id=f"{host}:{index}", host=host, index=index, name=name, total=total))
        out.append((host, gpus))
    return out


def report_path(out_dir: str | Path, index: int) -> Path:
    return Path(out_dir) / f"child-{index}.json"


def load_report(out_dir: Path, index: int, exitcode: int | None) -> ChildReport:
    path = report_path(out_dir, index)
    if not path.exists():
        return ChildReport(index, "?", "?", [], error=f"no report; exit code {exitcode}")
    raw = json.loads(path.read_text())
    raw["leases"] = [LeaseRecord(**x) for x in raw["leases"]]
    raw["beats"] = [tuple(x) for x in raw["beats"]]
    return ChildReport(**raw)


# --- a child process ------------------------------------------------------------


class SlowRegistry(Registry):
    """A registry client that may stall between reading the ledger and writing it.

    Set `stale` to a snapshot read earlier: the next `snapshot()` returns it (once), so
    the operation plans on a ledger that other processes have moved since, and its Lua
    script must notice. This widens the window between an operation's read and its
    script from a millisecond to up to `STALE_FOR_S`.
    """

    stale: Snapshot | None = None

    def snapshot(self) -> Snapshot:
        stale, self.stale = self.stale, None
        return stale if stale is not None else super().snapshot()


class _Child:
    """One simulated worker process and the client traffic it issues."""

    def __init__(self, cfg: ChildConfig) -> None:
        self.cfg = cfg
        self.rng = random.Random(cfg.seed)
        reg = SlowRegistry.from_url(cfg.url, cfg.fleet, events_maxlen=EVENTS_MAXLEN)
        assert isinstance(reg, SlowRegistry)
        self.reg = reg
        self.old: tuple[float, Snapshot] | None = None
        self.before_expiry: Snapshot | None = None  # read just before our lease lapsed
        self.haunted_until = 0.0  # till then, stale operations often use before_expiry
        self.host, self.gpus = layout(cfg.processes)[cfg.index]
        self.gpu_ids = [g.id for g in self.gpus]
        self.tag = f"p{cfg.index}x"  # an accelerator name that matches only our GPUs
        self.report = ChildReport(cfg.index, cfg.seed, self.host, self.gpu_ids)
        self.counts: Counter[str] = Counter()
        self.generation = 0
        self.worker = ""
        self.alive = False  # we believe our worker holds a live lease
        self.last_beat = 0.0
        self.expiring_until = 0.0  # monotonic time after which our lapsed lease is reaped
        self.next_expiry = 0.0
        self.held: list[tuple[Lease, LeaseRecord]] = []
        self.due: dict[tuple[str, int, Level], float] = {}  # a pending move -> when we do it

    # worker lifecycle

    def register(self) -> bool:
        self.generation += 1
        worker = f"p{self.cfg.index}-g{self.generation}-{self.rng.getrandbits(24):06x}"
        try:
            deadline = self.reg.register_worker(
                worker,
                self.host,
                f"q-{worker}",
                self.gpus,
                warm_budget=WARM_BUDGET,
                lease_ms=WORKER_LEASE_MS,
            )
        except GpuOwnedError:
            self.counts["register:owned"] += 1
            return False
        except RegistryError:
            self.counts["register:contended"] += 1
            return False
        self.counts["register:ok"] += 1
        self.report.beats.append((worker, deadline))
        self.worker = worker
        self.report.workers.append(worker)
        self.alive = True
        self.last_beat = time.monotonic()
        self.next_expiry = self.last_beat + self.rng.uniform(3.0, 7.0)
        return True

    def beat(self) -> None:
        try:
            deadline = self.reg.heartbeat(self.worker, self.gpu_ids, WORKER_LEASE_MS)
        except LeaseLostError:
            self.counts["heartbeat:lost"] += 1  # we were too slow: start again
            self.alive = False
            self.expiring_until = 0.0
            return
        self.counts["heartbeat:ok"] += 1
        self.report.beats.append((self.worker, deadline))
        self.last_beat = time.monotonic()

    def tend_worker(self) -> None:
        """Heartbeat when due; run the deliberate expiry; register again after one."""
        now = time.monotonic()
        if self.alive:
            if now >= self.next_expiry:
                # Stop heartbeating: the lease lapses WORKER_LEASE_MS after the last beat.
                self.alive = False
                self.expiring_until = self.last_beat + WORKER_LEASE_MS / 1000 + 0.05
                self.counts["expiry:start"] += 1
                # Read the ledger while our lease is still live...
                self.before_expiry = self.reg.snapshot()
            elif now - self.last_beat >= HEARTBEAT_EVERY_S:
                self.beat()
            return
        if now < self.expiring_until:
            return
        if self.worker:
            # Back from the pause, a worker heartbeats first; it must be told it is late.
            try:
                late = self.reg.heartbeat(self.worker, self.gpu_ids, WORKER_LEASE_MS)
            except LeaseLostError:
                self.counts["heartbeat:late_refused"] += 1
            else:
                self.report.violations.append(
                    f"worker {self.worker}'s heartbeat after its lease lapsed was accepted "
                    f"(new deadline {late}); it should raise LeaseLostError"
                )
        if self.before_expiry is not None and self.worker:
            # ...and act on it once the lease lapsed, as a worker back from a long pause
            # would: our GPUs are dead (or already reaped), their replicas released.
            self.deploy(self.before_expiry, own_gpus=True)
        if self.worker and self.rng.random() < 0.5:
            self.reap_expired()  # somebody (here: us) reaps it; register_worker would too
        if self.register():
            # For a while, stale operations replay that read: our GPUs changed owner.
            self.haunted_until = time.monotonic() + STALE_FOR_S

    # operations

    def stalled(self) -> Snapshot | None:
        """Now and then, a snapshot read up to STALE_FOR_S ago; else None."""
        now = time.monotonic()
        if now < self.haunted_until and self.before_expiry and self.rng.random() < 0.6:
            self.counts["stale:before_expiry"] += 1
            return self.before_expiry
        if self.rng.random() >= STALE_SHARE:
            return None
        if self.old is None or now - self.old[0] > STALE_FOR_S:
            self.old = (now, self.reg.snapshot())
        self.counts["stale:used"] += 1
        return self.old[1]

    def deploy(self, snap: Snapshot | None = None, *, own_gpus: bool = False) -> None:
        """Place a random model; on `snap` (or a stalled read), maybe on our GPUs only."""
        snap = snap or self.stalled()
        own_gpus = own_gpus or (snap is not None and snap is self.before_expiry)
        if snap is not None and own_gpus and self.rng.random() < 0.7:
            # A model that snapshot lacks, on our GPUs: the plan reaches the commit.
            absent = [d for d in CATALOG if snap.active.get(d.model, 0) < d.replicas]
            demand = replace(self.rng.choice(absent or CATALOG), accelerator=self.tag)
            self.counts["deploy:own_gpus"] += 1
        else:
            demand = self.rng.choice(CATALOG)
        self.reg.stale = snap
        try:
            plan = self.reg.place(demand, SETTINGS, self.rng, settle_wait_s=0.2)
        except SettlingError:
            self.counts["deploy:settling"] += 1
            return
        except CantAccommodateError:
            self.counts["deploy:cant"] += 1
            return
        except PlanRejectedError:
            self.counts["deploy:rejected"] += 1
            return
        if plan.candidate is Candidate.DEPLOYED:
            self.counts["deploy:resident"] += 1
            return
        self.counts[f"deploy:{plan.candidate.name}"] += 1
        if plan.evictions:
            self.counts["deploy:with_evictions"] += 1
        self.keep()

    def keep(self) -> None:
        """Do our worker's part, as its keeper would: admit what waits for the device,
        confirm loads, settle offloads and drops. Most moves happen at once, some after a
        while; now and then a load fails or a HOT copy turns out lost. A worker that
        stopped heartbeating (a deliberate expiry) is paused and does nothing."""
        if not self.alive or not self.worker:
            return
        now = time.monotonic()
        seen: set[tuple[str, int, Level]] = set()
        for replica in self.reg.replicas_of(self.worker):
            dep = self.reg.deployment(replica)
            if dep is None or dep.worker != self.worker:
                continue
            key = (replica, dep.epoch, dep.level)
            seen.add(key)
            if key not in self.due:
                later = self.rng.random() >= 0.7
                self.due[key] = now + (self.rng.uniform(0.02, 0.3) if later else 0.0)
            if self.due[key] > now:
                continue
            self.move(dep)
        self.due = {k: t for k, t in self.due.items() if k in seen}

    def move(self, dep: Deployment) -> None:
        """The GPU work one pending move of our worker needs, then its confirmation."""
        if dep.level is Level.WAITING:
            admitted = self.reg.admit(dep)
            self.counts["admit:ok" if admitted is Level.LOADING else "admit:full"] += 1
        elif dep.level is Level.LOADING:
            if self.rng.random() < 0.02:
                self.settle(dep, "failed")
                return
            # The copy's measured bytes, different from load to load, so a warm charge
            # made before a reload must be given back as it was made (copy_bytes).
            copy = self.rng.choice((0, dep.size // 4, dep.size // 2, dep.size))
            ok = self.reg.confirm(dep.replica, self.worker, dep.epoch, copy)
            self.counts["confirm:ok" if ok else "confirm:gone"] += 1
        elif dep.level is Level.OFFLOADING:
            self.settle(dep, "dropped" if self.rng.random() < 0.1 else "offloaded")
        elif dep.level is Level.DROPPING:
            self.settle(dep, "dropped")
        elif dep.level is Level.HOT and self.rng.random() < 0.002:
            self.settle(dep, "lost")

    def settle(self, dep: Deployment, outcome: str) -> None:
        level = self.reg.settle(dep, outcome)
        self.counts[f"settle:{outcome}->{level.value if level else 'refused'}"] += 1

    def route(self) -> None:
        model = self.rng.choice(MODELS)
        lost = self.rng.random() < 0.08
        ttl = self.rng.randint(150, 600) if lost else self.rng.randint(800, 3000)
        lease = self.reg.pick(model, ttl_ms=ttl)
        if lease is None:
            self.counts["route:none"] += 1
            return
        self.counts["route:lost" if lost else "route:ok"] += 1
        record = LeaseRecord(
            lease=lease.id,
            replica=lease.replica,
            model=model,
            worker=lease.worker,
            acquired=lease.deadline_ms - ttl,
            deadline=lease.deadline_ms,
            lost=lost,
        )
        self.report.leases.append(record)
        if not lost:
            self.held.append((lease, record))
        if len(self.held) > 2:
            self.finish(0)

    def finish(self, which: int | None = None) -> None:
        if not self.held:
            self.route()
            return
        i = self.rng.randrange(len(self.held)) if which is None else which
        lease, record = self.held.pop(i)
        record.released = self.reg.now_ms()
        try:
            level = self.reg.finish(lease)
        except PlanRejectedError:
            self.counts["finish:evict_contended"] += 1
            return
        self.counts[f"finish:{level.value}"] += 1

    def evict(self) -> None:
        snap = self.stalled() or self.reg.snapshot()
        self.reg.stale = snap
        deps = list(snap.deployments.values())
        if snap is self.before_expiry and self.rng.random() < 0.7:
            # The replicas we held then: released since, maybe placed again elsewhere.
            deps = [d for d in deps if d.host == self.host] or deps
        on_gpu = [d for d in deps if d.level in RESERVING]
        warm = [d for d in deps if d.level is Level.WARM]
        pool = warm if warm and (not on_gpu or self.rng.random() < 0.15) else on_gpu
        if not pool:
            self.counts["evict:nothing"] += 1
            return
        dep = self.rng.choice(sorted(pool, key=lambda d: d.replica))
        to = Level.COLD if self.rng.random() < 0.2 else None
        try:
            level = self.reg.evict(dep.replica, SETTINGS, to=to)
        except PlanRejectedError:
            self.counts["evict:contended"] += 1
            return
        self.counts[f"evict:{dep.level.value}->{level.value}"] += 1

    def reap_expired(self) -> None:
        try:
            swept = self.reg.sweep()  # reaps expired workers and settles lapsed drains
        except (RegistryError, PlanRejectedError):
            self.counts["reap_expired:contended"] += 1
            return
        self.counts["reap_expired:calls"] += 1
        self.counts["reap_expired:reaped"] += len(swept["reaped"])
        self.counts["reap_expired:drained"] += len(swept["drained"])

    def snapshot(self) -> None:
        self.counts["snapshot:ok"] += 1
        self.reg.snapshot()

    # the loop

    def run(self, barrier: Barrier) -> None:
        ops = list(WEIGHTS)
        weights = list(WEIGHTS.values())
        self.reg.now_ms()  # connected and scripts loaded before the clock starts
        barrier.wait(timeout=120)  # every child starts the load at the same moment
        while not self.register():
            time.sleep(0.01)
        began = time.monotonic()
        end = began + self.cfg.seconds
        while time.monotonic() < end:
            self.tend_worker()
            self.keep()
            op = self.rng.choices(ops, weights)[0]
            if op == "heartbeat":
                if self.alive:
                    self.beat()
            else:
                getattr(self, op)()
            self.report.ops += 1
        # Graceful clients finish; lost ones (and a few unlucky held ones) do not.
        for lease, record in self.held:
            if self.rng.random() < 0.9:
                record.released = self.reg.now_ms()
                try:
                    self.reg.finish(lease)
                except PlanRejectedError:
                    self.counts["finish:evict_contended"] += 1
        self.held.clear()
        self.report.elapsed_s = time.monotonic() - began


def run_child(cfg: ChildConfig, barrier: Barrier) -> None:
    """Entry point of one soak process; writes its `ChildReport` as JSON."""
    child = _Child(cfg)
    try:
        child.run(barrier)
    except BaseException:
        child.report.error = traceback.format_exc()
        raise
    finally:
        child.report.counts = dict(child.counts)
        path = report_path(cfg.out_dir, cfg.index)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(child.report)))
        os.replace(tmp, path)
        child.reg.client.close()


# --- checks ---------------------------------------------------------------------


@dataclass
class SoakResult:
    """Everything a soak run saw, for the test's assertions and its failure message."""

    seed: str
    seconds: float
    processes: int
    reports: list[ChildReport]
    exitcodes: list[int | None]
    audits: int
    audit_failures: list[str]
    ownership_failures: list[str]
    replay_failures: list[str]
    lease_failures: list[str]
    lease_reach: dict[str, int]
    leaks: list[str]
    events: dict[str, int]
    levels_seen: dict[str, int]
    wall_s: float

    @property
    def counts(self) -> Counter[str]:
        total: Counter[str] = Counter()
        for r in self.reports:
            total.update(r.counts)
        return total

    def summary(self) -> str:
        ops = sum(r.ops for r in self.reports)
        counts = self.counts
        by_kind: Counter[str] = Counter()
        for name, n in counts.items():
            by_kind[name.split(":", 1)[0]] += n
        lines = [
            f"soak seed {self.seed}: {self.processes} processes for {self.seconds:g} s "
            f"(wall {self.wall_s:.1f} s); replay with GPUFLEET_SOAK_SEED={self.seed}",
            f"ops {ops} ({ops / self.seconds:.0f}/s); audits {self.audits}; "
            f"lease check reach {self.lease_reach}",
            "per kind /s: "
            + ", ".join(f"{k} {n / self.seconds:.1f}" for k, n in sorted(by_kind.items())),
            "outcomes: " + ", ".join(f"{k}={n}" for k, n in sorted(counts.items())),
            "events: " + ", ".join(f"{k}={n}" for k, n in sorted(self.events.items())),
            "max replicas per level in one audit: "
            + ", ".join(f"{k}={n}" for k, n in sorted(self.levels_seen.items())),
        ]
        for r in self.reports:
            for v in r.violations:
                lines.append(f"child {r.index} (seed {r.seed}): {v}")
            if r.error:
                lines.append(f"child {r.index} (seed {r.seed}) crashed:\n{r.error}")
        return "\n".join(lines)


def event_counts(events: Iterable[Mapping[str, str]], owners: Mapping[str, int]) -> dict[str, int]:
    """Events per kind, evictions per cause, and multi-GPU placements (`owners`: GPU
    id -> the child that owns it; a split over two children's GPUs spans workers)."""
    counts: Counter[str] = Counter()
    for e in events:
        kind = e["kind"]
        counts[kind] += 1
        if kind == "evicted":
            counts[f"evicted:{e.get('cause')}->{e.get('to')}"] += 1
        elif kind == "reaped":
            counts[f"reaped:{e.get('cause')}"] += 1
        elif kind in ("placed", "restored"):
            gpus = json.loads(e.get("gpus") or "{}")
            if len(gpus) > 1:
                counts["placed:multi-gpu"] += 1
            if len({owners.get(g) for g in gpus}) > 1:
                counts["placed:across-workers"] += 1
    return dict(counts)


def run_soak(
    url: str,
    fleet: str,
    out_dir: Path,
    *,
    seed: str,
    processes: int = 8,
    seconds: float = 20.0,
    audit_pause_s: float = 0.05,
) -> SoakResult:
    """Run `processes` children for `seconds` while auditing; then check and shut down."""
    from tests.soak_checks import (  # the checks import this module's workload
        lease_problems,
        liveness_problems,
        ownership_problems,
        pick_problems,
        replay_problems,
        replica_count_problems,
        shutdown_leaks,
    )

    ctx = multiprocessing.get_context("spawn")
    barrier = ctx.Barrier(processes + 1)
    children = [
        ctx.Process(
            target=run_child,
            args=(
                ChildConfig(url, fleet, i, processes, f"{seed}/{i}", seconds, str(out_dir)),
                barrier,
            ),
            name=f"soak-{i}",
            daemon=True,
        )
        for i in range(processes)
    ]
    began = time.monotonic()
    for c in children:
        c.start()
    reg = Registry.from_url(url, fleet, events_maxlen=EVENTS_MAXLEN)
    audits = 0
    seen: dict[str, int] = {}  # each distinct problem -> the first audit that saw it
    levels_seen: Counter[str] = Counter()
    try:
        with contextlib.suppress(threading.BrokenBarrierError):  # a child died: see its report
            barrier.wait(timeout=120)
        give_up = time.monotonic() + seconds + 60  # a child that hangs is killed below
        while any(c.is_alive() for c in children) and time.monotonic() < give_up:
            snap = reg.snapshot()
            audits += 1
            for problem in audit(snap) + replica_count_problems(snap):
                seen.setdefault(f"audit: {problem}", audits)
            for problem in ownership_problems(reg):
                seen.setdefault(f"ownership: {problem}", audits)
            per_level = Counter(d.level.value for d in snap.deployments.values())
            per_level["DRAINING-idle"] = sum(
                1 for d in snap.deployments.values() if d.level is Level.DRAINING and d.idle
            )
            for level, n in per_level.items():
                levels_seen[level] = max(levels_seen[level], n)
            time.sleep(audit_pause_s)
        for c in children:
            c.join(timeout=max(1.0, give_up - time.monotonic()))
            if c.is_alive():
                c.kill()
                c.join(timeout=5)
        exitcodes = [c.exitcode for c in children]
        reports = [load_report(out_dir, i, code) for i, code in enumerate(exitcodes)]

        # The run is over: nothing moves any more. Check the stream against the ledger.
        snap = reg.snapshot()
        events = reg.events()
        replay, timeline = replay_problems(events, snap)
        leases = [lease for r in reports for lease in r.leases]
        lease_failures, reach = lease_problems(events, leases)
        lease_failures += pick_problems(timeline, leases)
        beats = [b for r in reports for b in r.beats]
        lease_failures += liveness_problems(events, beats, leases)
        for problem in audit(snap) + replica_count_problems(snap):
            seen.setdefault(f"audit: {problem}", -1)
        for problem in ownership_problems(reg):
            seen.setdefault(f"ownership: {problem}", -1)
        audit_failures = [
            f"audit {n if n > 0 else 'after the run'}: {p.split(': ', 1)[1]}"
            for p, n in seen.items()
            if p.startswith("audit: ")
        ]
        ownership_failures = [
            f"audit {n if n > 0 else 'after the run'}: {p.split(': ', 1)[1]}"
            for p, n in seen.items()
            if p.startswith("ownership: ")
        ]

        # Shut every worker down, then nothing may be left.
        for worker in sorted(reg.client.smembers(reg.keys.workers)):
            reg.reap(worker, force=True)
        leaks = shutdown_leaks(reg)
        events = reg.events()
        after, _ = replay_problems(events, reg.snapshot())
        replay += [f"after shutdown: {p}" for p in after if p not in replay]
    finally:
        for c in children:
            if c.is_alive():
                c.kill()
                c.join(timeout=5)
        reg.client.close()
    return SoakResult(
        seed=seed,
        seconds=seconds,
        processes=processes,
        reports=reports,
        exitcodes=exitcodes,
        audits=audits,
        audit_failures=audit_failures,
        ownership_failures=ownership_failures,
        replay_failures=replay,
        lease_failures=lease_failures,
        lease_reach=dict(reach),
        leaks=leaks,
        events=event_counts(
            events, {g.id: i for i, (_, gpus) in enumerate(layout(processes)) for g in gpus}
        ),
        levels_seen=dict(levels_seen),
        wall_s=time.monotonic() - began,
    )
