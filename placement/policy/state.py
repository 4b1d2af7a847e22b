"""The fleet as the placement policy sees it: GPUs, deployments, hosts and plans.

These are plain frozen values. The registry reads them out of Redis, the policy
turns them into a `Plan`, and the simulator builds them in memory. Nothing here
does I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any

from placement.units.accelerators import Accelerator


class Level(str, enum.Enum):
    """Where a replica's weights are, and which move of them is under way.

    The four pending levels wait for the worker that holds (or will hold) the copy to
    confirm its GPU work; docs/placement.md has the whole state table.
    """

    WAITING = "WAITING"  # placed: its bytes are reserved, its victims still leave the device
    LOADING = "LOADING"  # admitted to the device: the worker loads or restores it
    HOT = "HOT"  # on GPU, serving
    DRAINING = "DRAINING"  # on GPU, takes no new requests, leaves when idle
    OFFLOADING = "OFFLOADING"  # evicted: its worker moves it to CPU memory
    DROPPING = "DROPPING"  # evicted: its worker frees it
    WARM = "WARM"  # in the host's CPU memory
    COLD = "COLD"  # not loaded anywhere


#: Levels whose bytes a GPU's `reserved` counts: the placements the policy plans around.
RESERVING = frozenset({Level.WAITING, Level.LOADING, Level.HOT, Level.DRAINING})
#: Levels whose copy may be on the device now: a GPU's `held` counts them.
ON_DEVICE = frozenset({Level.LOADING, Level.HOT, Level.DRAINING, Level.OFFLOADING, Level.DROPPING})
#: Levels that wait for a worker's confirmation.
PENDING = frozenset({Level.WAITING, Level.LOADING, Level.OFFLOADING, Level.DROPPING})
#: Levels that are leaving the device.
LEAVING = frozenset({Level.OFFLOADING, Level.DROPPING})

# What became of one request for a model, as the registry counts it:
# hit (a HOT replica took it), queued (its replica was still loading), warm (it started a
# restore from a host's CPU cache), cold (it started a load from disk), rejected (it can
# never fit), busy (every replica was busy or dedicated: retried, counted per try).
OUTCOMES = ("hit", "queued", "warm", "cold", "rejected", "busy")
# Which way a call reached its replica, counted with its outcome, once per call: fast (the
# client leased a HOT replica and sent it straight to its GPU worker), routed (the router
# took it). So fast + routed = requests (docs/metrics.md).
PATHS = ("fast", "routed")
# How prefix routing chose a generating call's replica (placement/rules/prefixes.py), once
# per counted call that had a prefix chain: the replica that served its longest prefix
# (prefix_hit), the least busy one because that one was too busy (prefix_spill), or the
# least busy one because none had served its prefix (prefix_new).
PREFIX_ROUTES = ("prefix_hit", "prefix_spill", "prefix_new")
COUNTS = (*OUTCOMES, *PATHS, *PREFIX_ROUTES)  # every per-model counter of the stats hash


class Candidate(enum.IntEnum):
    """How good a place is for a replica, best first (NDIF's candidate levels)."""

    DEPLOYED = 0  # already resident: nothing to do
    CACHED_AND_FREE = 1  # a warm copy on this host, and room without eviction
    FREE = 2  # room without eviction
    CACHED_AND_FULL = 3  # a warm copy on this host, after evictions
    FULL = 4  # room only after evictions
    CANT_ACCOMMODATE = 5  # no room, even after every allowed eviction


@dataclass(frozen=True)
class Gpu:
    """One GPU's ledger entry."""

    id: str
    host: str
    index: int
    name: str
    total: int
    reserved: int = 0  # bytes of the replicas placed here (RESERVING levels)
    worker: str = ""
    queue: str = ""
    lease_deadline_ms: int = 0
    held: int = 0  # bytes of the copies that may be on the device now (ON_DEVICE levels)
    context: int = 0  # bytes one more process's CUDA context takes here (0 when simulated)
    # worker id -> bytes charged for the CUDA context that worker, not the owner, keeps
    # here, counted in `reserved` (docs/placement.md, "CUDA contexts")
    contexts: Mapping[str, int] = field(default_factory=dict)
    # the workers of `contexts` whose context `held` counts: one of their placements here
    # has been LOADING (a context opens with the first load)
    held_contexts: frozenset[str] = frozenset()
    # worker id -> its WAITING placements here relying on a charge no load opened yet: the
    # last of them to go COLD unloaded gives the charge back
    waiting_contexts: Mapping[str, int] = field(default_factory=dict)
    # where its worker's processes run: workers of one domain may read each other's warm
    # copies (docs/placement.md, "Warm copies another worker reads"); '' unknown
    domain: str = ""

    @property
    def free(self) -> int:
        return self.total - self.reserved

    def charge_for(self, worker: str) -> int:
        """Bytes a placement loaded by `worker` adds here for that worker's CUDA context:
        none for the owner (its context is kept out of `total`) or a worker charged
        already, since a process keeps a context until it exits."""
        return 0 if worker == self.worker or worker in self.contexts else self.context

    def alive(self, now_ms: int) -> bool:
        return bool(self.worker) and self.lease_deadline_ms > now_ms


@dataclass(frozen=True)
class Deployment:
    """One replica of one model, wherever it is."""

    replica: str
    model: str
    level: Level
    gpus: Mapping[str, int] = field(default_factory=dict)  # GPU id -> reserved bytes
    limit: int = 0  # admission limit on each GPU it uses
    fraction: float = 0.0  # the largest share of one of its GPUs, rounded up to 1e-4
    dedicated: bool = False
    size: int = 0  # bytes its placement was sized by (the warm charge until it is measured)
    last_used_ms: int = 0
    host: str = ""
    worker: str = ""
    queue: str = ""
    leases: int = 0  # live request leases
    epoch: int = 0  # which placement of the replica this is; every commit starts a new one
    since_ms: int = 0  # when it reached its level (the registry's clock)
    copy_bytes: int = 0  # its copy's bytes, measured by its worker at its last load; 0: not yet
    accelerator: Accelerator = None  # the GPU types its model may use (its demand's)
    copy_at: str = ""  # WARM: where the host's other workers may read its copy ('' nowhere)
    read_from: str = ""  # LOADING: another replica's `copy_at` its load reads weights from

    @property
    def cached(self) -> int:
        """Bytes its copy takes in a host's warm cache: measured when known, else `size`."""
        return self.copy_bytes or self.size

    @property
    def idle(self) -> bool:
        return self.leases == 0

    @property
    def evictable(self) -> bool:
        """True when memory pressure may move it off its GPUs."""
        return self.level is Level.HOT and self.idle and not self.dedicated


@dataclass(frozen=True)
class Host:
    """A machine's CPU warm cache."""

    name: str
    warm_budget: int = 0
    warm_used: int = 0
    warm: frozenset[str] = frozenset()  # the WARM replicas it holds, as the registry indexes them

    @property
    def warm_free(self) -> int:
        return self.warm_budget - self.warm_used


@dataclass(frozen=True)
class Holding:
    """One copy a worker process reports holding (its heartbeat carries them)."""

    replica: str
    epoch: int
    level: Level  # HOT (on its GPUs) or WARM (in CPU memory)
    gpus: Mapping[str, int] = field(default_factory=dict)  # GPU id -> reserved bytes
    device_bytes: int = 0  # bytes of weights really on a GPU (0 on simulated GPUs)


@dataclass(frozen=True)
class Report:
    """What a worker last said it holds, and when (the registry's clock)."""

    worker: str
    at_ms: int
    holdings: tuple[Holding, ...] = ()
    pinned: int = 0  # host memory the worker keeps pinned (its warm-copy arena), bytes


@dataclass(frozen=True)
class Snapshot:
    """A read of the whole registry at one moment (`now_ms` is the registry's clock)."""

    gpus: Mapping[str, Gpu]
    deployments: Mapping[str, Deployment]
    hosts: Mapping[str, Host]
    now_ms: int = 0
    learned: Mapping[str, int] = field(default_factory=dict)
    active: Mapping[str, int] = field(default_factory=dict)  # stored RESERVING-replica counters
    reports: Mapping[str, Report] = field(default_factory=dict)  # worker id -> its last report
    workers: Mapping[str, int] = field(default_factory=dict)  # worker id -> lease deadline (ms)
    #: Replicas the ledger lists whose records lack identity fields (half written): not in
    #: `deployments`, named by the audit.
    partial: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    #: Indexes that modules built on these types keep once per snapshot (`room.room_of`).
    memo: dict[str, Any] = field(default_factory=dict, init=False, repr=False, compare=False)

    # Indexes, built once per snapshot on first use (a snapshot never changes).

    @cached_property
    def by_gpu(self) -> Mapping[str, list[Deployment]]:
        """GPU id -> deployments whose bytes it reserves."""
        index: dict[str, list[Deployment]] = {}
        for d in self.deployments.values():
            if d.level in RESERVING:
                for gpu_id in d.gpus:
                    index.setdefault(gpu_id, []).append(d)
        return index

    @cached_property
    def by_model(self) -> Mapping[str, list[Deployment]]:
        index: dict[str, list[Deployment]] = {}
        for d in self.deployments.values():
            index.setdefault(d.model, []).append(d)
        return index

    @cached_property
    def warm_by_host(self) -> Mapping[str, list[Deployment]]:
        index: dict[str, list[Deployment]] = {}
        for d in self.deployments.values():
            if d.level is Level.WARM:
                index.setdefault(d.host, []).append(d)
        return index

    @cached_property
    def live_queues(self) -> frozenset[str]:
        """The queues of GPU workers whose lease holds."""
        return frozenset(g.queue for g in self.gpus.values() if g.queue and g.alive(self.now_ms))

    def without_workers(self, workers: frozenset[str]) -> Snapshot:
        """This snapshot with the GPUs of `workers` left out: a plan on it goes elsewhere
        (a second replica on the worker that runs the first would share its one call at a
        time). Its indexes are built afresh, so use it for rare plans only."""
        gpus = {g: gpu for g, gpu in self.gpus.items() if gpu.worker not in workers}
        return replace(self, gpus=gpus)

    def on_gpu(self, gpu_id: str) -> list[Deployment]:
        """Deployments whose bytes `gpu_id` reserves."""
        return list(self.by_gpu.get(gpu_id, ()))

    def replicas(self, model: str) -> list[Deployment]:
        return list(self.by_model.get(model, ()))


@dataclass(frozen=True)
class Demand:
    """What one replica of a model asks of the fleet.

    One of three forms sizes the GPU slot: `size` (bytes, scaled by the factor),
    `request`/`limit` (an explicit envelope), or `gpus` (a static GPU count, or a
    fraction of one GPU below 1.0). With `gpus`, `size` only sizes the warm copy.
    """

    model: str
    size: int = 0
    request: int | None = None
    limit: int | None = None
    gpus: float | None = None
    accelerator: Accelerator = None  # a GPU type or alternatives (placement.units.accelerators)
    dedicated: bool = False
    replicas: int = 1
    factor: float | None = None
    fractional_threshold: float | None = None
    min_free_fraction: float | None = None
    learned: int | None = None  # measured peak bytes; preferred over the factor
    kv_cache: int = 0  # a generation model's KV-cache budget, beside its weights (in `learned`)
    adapters: int = 0  # the room its replicas keep for LoRA adapters, beside too (in `learned`)
    protect: frozenset[str] = frozenset()  # models whose replicas this one may not evict

    @property
    def beside(self) -> int:
        """Bytes a replica keeps beside its weights: its KV cache and its adapters' room."""
        return self.kv_cache + self.adapters


@dataclass(frozen=True)
class Eviction:
    """A replica moved off its GPUs to make room: to WARM, or dropped to COLD."""

    replica: str
    to: Level
    queue: str = ""  # the queue of the worker that holds it, told to offload or drop


@dataclass(frozen=True)
class Plan:
    """What the policy wants the registry to do for one replica.

    `reuse` is the level of an existing replica record being brought back (WARM or
    COLD), or None for a new replica id. `warm_drops` are WARM replicas dropped to
    COLD so evicted ones fit in their host's warm cache.
    """

    model: str
    replica: str
    candidate: Candidate
    gpus: Mapping[str, int]
    limit: int = 0
    fraction: float = 0.0
    host: str = ""
    worker: str = ""
    queue: str = ""
    reuse: Level | None = None
    evictions: tuple[Eviction, ...] = ()
    warm_drops: tuple[str, ...] = ()
    dedicated: bool = False
    size: int = 0
    max_active: int = 1
    reason: str = ""  # why this place was chosen, for events and logs
    epoch: int = 0  # the placement's epoch, once committed (0 before)
    accelerator: Accelerator = None  # the GPU types the model may use (its demand's)
    read_from: str = ""  # a neighbour's warm copy the load reads weights from (`copy_at`)
