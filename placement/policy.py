"""The placement policy: where one more replica of a model goes, and what moves out.

Pure and deterministic for a given `random.Random`: it reads a `Snapshot` and
returns a `Plan`, or raises `CantAccommodateError` saying why. The router, the
benchmarks and the simulator all call it; the registry's commit script re-checks
the plan atomically, so a stale snapshot costs a retry, never a double booking.

Sizing a replica on one GPU (NDIF, seed 000):
- `required = size x factor` (or the learned peak x headroom, or the catalog's
  explicit request/limit);
- below `fractional_threshold x GPU memory` it gets a fractional slot of
  `required` bytes; otherwise, if `size` fits the GPU, it gets the whole GPU;
- otherwise it is split over the GPUs of one host (Helix, seed 004):
  `size x multi_gpu_overhead / n` on each of the fewest GPUs `n` that fit.
A GPU admits a slot when `limit + sum(requests already there) <= memory` (seed 003).
"""

from __future__ import annotations

import functools
import random
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from fractions import Fraction

from placement.errors import CantAccommodateError, NeverFitsError, PlacementError, SettlingError
from placement.memory import format_size, fraction_of
from placement.settings import GpuChoice, PolicySettings, VictimOrder
from placement.state import (
    LEAVING,
    RESERVING,
    Candidate,
    Demand,
    Deployment,
    Eviction,
    Gpu,
    Level,
    Plan,
    Snapshot,
)


@dataclass(frozen=True)
class _Option:
    """One way to place the replica: GPUs with their slots and the victims they need."""

    candidate: Candidate
    slots: dict[str, tuple[int, int]]  # GPU id -> (request, limit)
    victims: tuple[Deployment, ...]
    sort_key: tuple[float, ...]


class _View:
    """What one planning call needs of a snapshot: its indexes and this model's replicas."""

    def __init__(self, snap: Snapshot, demand: Demand) -> None:
        self.snap = snap
        self.by_gpu = snap.by_gpu
        self.mine = snap.replicas(demand.model)
        live = {g.worker for g in snap.gpus.values() if g.alive(snap.now_ms)}
        self.my_warm: dict[str, Deployment] = {}
        for d in sorted(self.mine, key=lambda d: d.last_used_ms):
            if d.level is Level.WARM and d.worker in live:  # its holder must restore it
                self.my_warm[d.host] = d  # the most recently used one wins


def accelerator_matches(gpu: Gpu, accelerator: str | None) -> bool:
    """True when every word of `accelerator` (e.g. "A100", "A100-80GB") is in the GPU's name.

    Case, spaces and punctuation are ignored: "a100 80gb" matches
    "NVIDIA A100-SXM4-80GB"; "H100" does not.
    """
    if not accelerator:
        return True
    name = "".join(c for c in gpu.name.lower() if c.isalnum())
    words = "".join(c if c.isalnum() else " " for c in accelerator.lower()).split()
    return all(w in name for w in words)


def new_replica_id(rng: random.Random) -> str:
    """An opaque uuid4 hex drawn from `rng`, so simulations replay exactly."""
    return uuid.UUID(int=rng.getrandbits(128), version=4).hex


def plan_replica(
    demand: Demand,
    snap: Snapshot,
    settings: PolicySettings | None = None,
    rng: random.Random | None = None,
) -> Plan:
    """Plan one more replica of `demand.model`, or return DEPLOYED when enough exist.

    Raises `NeverFitsError` when no GPU set of the fleet could hold the model even
    empty, and `CantAccommodateError` when it fits only after evicting replicas the
    policy may not touch (dedicated, busy, loading or draining).
    """
    settings = settings or PolicySettings()
    rng = rng or random.Random()
    view = _View(snap, demand)

    active = [d for d in view.mine if d.level in RESERVING]
    if len(active) < demand.replicas:
        # A copy on its way to the host's CPU cache (or out): restoring it then beats
        # loading another copy from disk now. A worker settles within about one call.
        settling = [d for d in view.mine if d.level in LEAVING]
    else:
        # Enough are placed, but if all of them drain, none takes this call: wait until
        # one has left, then place the model again.
        settling = active if all(d.level is Level.DRAINING for d in active) else []
    if settling:
        raise SettlingError(
            f"{demand.model}: replica {settling[0].replica} is {settling[0].level.value} on "
            f"worker {settling[0].worker}; it is placed again once that move settles"
        )
    if len(active) >= demand.replicas:
        best = min(active, key=lambda d: (d.level is not Level.HOT, d.leases, d.replica))
        return Plan(
            model=demand.model,
            replica=best.replica,
            candidate=Candidate.DEPLOYED,
            gpus=dict(best.gpus),
            limit=best.limit,
            fraction=best.fraction,
            host=best.host,
            worker=best.worker,
            queue=best.queue,
            dedicated=best.dedicated,
            size=best.size,
            max_active=demand.replicas,
            reason="already resident",
            epoch=best.epoch,
        )

    if demand.gpus is not None and demand.request is not None:
        raise PlacementError(
            f"model {demand.model!r} asks for both a GPU count and bytes: keep one of them"
        )
    if not (demand.size or demand.request or demand.gpus or demand.learned):
        raise PlacementError(
            f"model {demand.model!r} has no memory figure: set `memory` or `gpus` in the catalog"
        )
    eligible = [
        g
        for g in snap.gpus.values()
        if g.alive(snap.now_ms) and accelerator_matches(g, demand.accelerator)
    ]
    rng.shuffle(eligible)  # ties never favour low indices
    if not eligible:
        what = f" of type {demand.accelerator!r}" if demand.accelerator else ""
        raise CantAccommodateError(
            f"{demand.model} cannot be placed: no live GPU{what} in the fleet "
            f"({len(snap.gpus)} registered). Start a GPU worker, or check its heartbeat."
        )

    options = _single_gpu_options(demand, eligible, view, settings)
    if not options and _splittable(demand):
        options = _multi_gpu_options(demand, eligible, view, settings)
    if not options:
        raise _why_not(demand, eligible, view, settings)

    best_option = min(options, key=lambda o: o.sort_key)
    return _to_plan(demand, best_option, view, settings, rng)


def plan_offload(
    replica: str,
    snap: Snapshot,
    settings: PolicySettings | None = None,
) -> tuple[Eviction, tuple[str, ...]]:
    """Where an explicitly evicted replica goes: WARM (with warm copies to drop) or COLD."""
    settings = settings or PolicySettings()
    dep = snap.deployments[replica]
    already_warm = replica if dep.level is Level.WARM else None  # its bytes are counted already
    evictions, drops = _destinations([dep], snap, settings.warm_drop_order, restoring=already_warm)
    return evictions[0], drops


# --- sizing -----------------------------------------------------------------


def _knobs(demand: Demand, settings: PolicySettings) -> tuple[float, float, float]:
    factor = demand.factor if demand.factor is not None else settings.factor
    threshold = (
        demand.fractional_threshold
        if demand.fractional_threshold is not None
        else settings.fractional_threshold
    )
    min_free = (
        demand.min_free_fraction
        if demand.min_free_fraction is not None
        else settings.min_free_fraction
    )
    return factor, threshold, min_free


def scale(nbytes: int, factor: float, divisor: int = 1) -> int:
    """`nbytes x factor / divisor` rounded up to whole bytes, without float noise."""
    num, den = _exact(factor)
    return -(-nbytes * num // (den * divisor))  # integer ceiling division


@functools.lru_cache(maxsize=1024)
def _exact(factor: float) -> tuple[int, int]:
    """The decimal a setting was written as (1.1 -> 11/10), not its binary float."""
    exact = Fraction(str(factor))
    return exact.numerator, exact.denominator


def _splittable(demand: Demand) -> bool:
    """Size-based demands may go multi-GPU; so may a static count of 2+ GPUs."""
    if demand.gpus is not None:
        return demand.gpus >= 2
    return demand.request is None


def single_gpu_slot(demand: Demand, gpu: Gpu, settings: PolicySettings) -> tuple[int, int] | None:
    """(request, limit) bytes of one replica on `gpu` alone, or None if it cannot fit one GPU."""
    factor, threshold, _ = _knobs(demand, settings)
    if demand.gpus is not None:
        if demand.gpus < 1:
            share = scale(gpu.total, demand.gpus)
            return share, share
        return (gpu.total, gpu.total) if demand.gpus == 1 else None
    if demand.request is not None:
        request, limit = demand.request, demand.limit or demand.request
        base = limit
    elif demand.learned:
        request = limit = scale(demand.learned, settings.learned_headroom)
        base = demand.learned
    else:
        request = limit = scale(demand.size, factor)
        base = demand.size
    if base > gpu.total:
        return None
    if limit < threshold * gpu.total:
        return request, limit
    return gpu.total, gpu.total


def _victims(
    gpu: Gpu, limit: int, view: _View, order: VictimOrder
) -> tuple[Deployment, ...] | None:
    """The idle replicas to evict from `gpu` so that `limit` more bytes are admitted."""
    deficit = gpu.reserved + limit - gpu.total
    if deficit <= 0:
        return ()
    pool = [d for d in view.by_gpu.get(gpu.id, []) if d.evictable]
    if order is VictimOrder.LRU:
        pool.sort(key=lambda d: (d.last_used_ms, d.replica))
    else:
        pool.sort(key=lambda d: (d.gpus[gpu.id], d.last_used_ms, d.replica))
    taken: list[Deployment] = []
    for d in pool:
        if deficit <= 0:
            break
        taken.append(d)
        deficit -= d.gpus[gpu.id]
    return tuple(taken) if deficit <= 0 else None


def _fit_key(gpu: Gpu, request: int, freed: int, choice: GpuChoice) -> float:
    left = gpu.total - (gpu.reserved - freed + request)
    if choice is GpuChoice.BEST_FIT:
        return float(left)
    if choice is GpuChoice.MOST_FREE:
        return float(-(gpu.free + freed))
    return 0.0


def _level(cached: bool, evicts: bool) -> Candidate:
    if evicts:
        return Candidate.CACHED_AND_FULL if cached else Candidate.FULL
    return Candidate.CACHED_AND_FREE if cached else Candidate.FREE


def _recency(victims: Iterable[Deployment], settings: PolicySettings) -> float:
    """Under LRU, prefer evicting replicas that were used longest ago."""
    if settings.victim_order is not VictimOrder.LRU:
        return 0.0
    return float(max((v.last_used_ms for v in victims), default=0))


def _single_gpu_options(
    demand: Demand, eligible: Sequence[Gpu], view: _View, settings: PolicySettings
) -> list[_Option]:
    options = []
    for position, gpu in enumerate(eligible):
        slot = single_gpu_slot(demand, gpu, settings)
        if slot is None:
            continue
        request, limit = slot
        victims = _victims(gpu, limit, view, settings.victim_order)
        if victims is None:
            continue
        freed = sum(v.gpus[gpu.id] for v in victims)
        level = _level(gpu.host in view.my_warm, bool(victims))
        key = (
            float(level),
            float(len(victims)),
            _recency(victims, settings),
            _fit_key(gpu, request, freed, settings.gpu_choice),
            float(position),
        )
        options.append(_Option(level, {gpu.id: slot}, victims, key))
    return options


def _shard(demand: Demand, gpu: Gpu, n: int, settings: PolicySettings) -> tuple[int, int]:
    """(request, admission need) of one of `n` shards on `gpu`."""
    if demand.gpus is not None:
        return gpu.total, gpu.total
    _, _, min_free = _knobs(demand, settings)
    base = demand.learned or demand.size
    share = scale(base, settings.multi_gpu_overhead, n)
    return share, max(share, scale(gpu.total, min_free))


def _multi_gpu_options(
    demand: Demand, eligible: Sequence[Gpu], view: _View, settings: PolicySettings
) -> list[_Option]:
    by_host: dict[str, list[Gpu]] = defaultdict(list)
    for gpu in eligible:
        by_host[gpu.host].append(gpu)
    options = []
    for host, gpus in by_host.items():
        counts = [int(demand.gpus)] if demand.gpus is not None else range(2, len(gpus) + 1)
        for n in counts:
            scored: list[tuple[tuple[float, ...], Gpu, int, int, tuple[Deployment, ...]]] = []
            for position, gpu in enumerate(gpus):
                request, need = _shard(demand, gpu, n, settings)
                if need > gpu.total:
                    continue
                victims = _victims(gpu, need, view, settings.victim_order)
                if victims is None:
                    continue
                freed = sum(v.gpus[gpu.id] for v in victims)
                key = (
                    float(len(victims)),
                    _recency(victims, settings),
                    _fit_key(gpu, request, freed, settings.gpu_choice),
                    float(position),
                )
                scored.append((key, gpu, request, need, victims))
            if len(scored) < n:
                continue
            scored.sort(key=lambda s: s[0])
            chosen = scored[:n]
            victims_all = tuple({v.replica: v for s in chosen for v in s[4]}.values())
            level = _level(host in view.my_warm, bool(victims_all))
            option_key = (
                float(level),
                float(n),
                float(len(victims_all)),
                _recency(victims_all, settings),
                float(sum(s[0][2] for s in chosen)),
                min(s[0][3] for s in chosen),
            )
            slots = {s[1].id: (s[2], s[3]) for s in chosen}
            options.append(_Option(level, slots, victims_all, option_key))
            break  # the fewest GPUs that fit on this host
    return options


# --- plans and refusals -------------------------------------------------------


def _to_plan(
    demand: Demand, option: _Option, view: _View, settings: PolicySettings, rng: random.Random
) -> Plan:
    snap = view.snap
    gpus = [snap.gpus[g] for g in option.slots]
    primary = min(gpus, key=lambda g: g.index)
    warm = view.my_warm.get(primary.host)
    cold = sorted(d.replica for d in view.mine if d.level is Level.COLD)
    if warm is not None:
        replica, reuse = warm.replica, Level.WARM
    elif cold:
        replica, reuse = cold[0], Level.COLD
    else:
        replica, reuse = new_replica_id(rng), None
    evictions, drops = _destinations(
        option.victims, snap, settings.warm_drop_order, restoring=replica if warm else None
    )
    size = demand.size or demand.request or demand.learned or 0
    # The process that holds a warm copy restores it (onto any GPU of its host);
    # otherwise the worker of the first planned GPU loads the replica.
    loader = (warm.worker, warm.queue) if warm is not None else (primary.worker, primary.queue)
    return Plan(
        model=demand.model,
        replica=replica,
        candidate=option.candidate,
        gpus={g: slot[0] for g, slot in option.slots.items()},
        limit=_plan_limit(option),
        fraction=max(fraction_of(option.slots[g.id][0], g.total) for g in gpus),
        host=primary.host,
        worker=loader[0],
        queue=loader[1],
        reuse=reuse,
        evictions=evictions,
        warm_drops=drops,
        dedicated=demand.dedicated,
        size=size,
        max_active=demand.replicas,
        reason=option.candidate.name,
    )


def _plan_limit(option: _Option) -> int:
    """The admission limit of a one-GPU slot; a multi-GPU shard's limit is its bytes."""
    if len(option.slots) == 1:
        return next(iter(option.slots.values()))[1]
    return max(request for request, _ in option.slots.values())


def _destinations(
    victims: Sequence[Deployment],
    snap: Snapshot,
    drop_order: VictimOrder,
    restoring: str | None,
) -> tuple[tuple[Eviction, ...], tuple[str, ...]]:
    """Send each victim to its host's warm cache when it fits, else drop it to COLD.

    Warm copies are dropped to make room by `drop_order`; under LRU only copies
    used longer ago than the victim are dropped, so a cold victim never displaces
    a warmer copy.
    """
    if not victims:
        return (), ()
    free = {h.name: h.warm_free for h in snap.hosts.values()}
    warm: dict[str, list[Deployment]] = defaultdict(list)
    for host in {v.host for v in victims}:
        for d in snap.warm_by_host.get(host, ()):
            if d.replica == restoring:
                free[host] = free.get(host, 0) + d.size
            else:
                warm[host].append(d)
    for entries in warm.values():
        if drop_order is VictimOrder.LRU:
            entries.sort(key=lambda d: (d.last_used_ms, d.replica))
        else:
            entries.sort(key=lambda d: (d.size, d.last_used_ms, d.replica))
    evictions: list[Eviction] = []
    drops: list[str] = []
    for v in victims:
        room = free.get(v.host, 0)
        chosen: list[Deployment] = []
        for w in warm[v.host]:
            if room >= v.size:
                break
            if drop_order is VictimOrder.LRU and w.last_used_ms >= v.last_used_ms:
                break
            chosen.append(w)
            room += w.size
        if room >= v.size and v.size > 0:
            for w in chosen:
                warm[v.host].remove(w)
                drops.append(w.replica)
            free[v.host] = room - v.size
            evictions.append(Eviction(v.replica, Level.WARM, v.queue))
        else:
            evictions.append(Eviction(v.replica, Level.COLD, v.queue))
    return tuple(evictions), tuple(drops)


def _why_not(
    demand: Demand, eligible: Sequence[Gpu], view: _View, settings: PolicySettings
) -> CantAccommodateError:
    """Explain a refusal: never fits (even on an empty fleet) or blocked by pinned replicas."""
    empty = [Gpu(g.id, g.host, g.index, g.name, g.total) for g in eligible]
    largest = max(g.total for g in eligible)
    single = [single_gpu_slot(demand, g, settings) for g in empty]
    fits_single = any(s is not None for s in single)
    if not fits_single and not _splittable(demand):
        need = demand.limit or demand.request or demand.size
        if demand.gpus is not None:
            return NeverFitsError(
                f"{demand.model} needs {demand.gpus:g} GPUs on one host; "
                f"no host has that many live GPUs. Lower `gpus` or add GPUs."
            )
        return NeverFitsError(
            f"{demand.model} needs {format_size(need)} on one GPU; the largest GPU has "
            f"{format_size(largest)}. Lower its memory in the catalog or add a larger GPU."
        )
    if not fits_single:
        blank = _View(Snapshot(gpus={g.id: g for g in empty}, deployments={}, hosts={}), demand)
        if not _multi_gpu_options(demand, empty, blank, settings):
            per_host: dict[str, int] = defaultdict(int)
            for g in empty:
                per_host[g.host] += g.total
            need = scale(demand.learned or demand.size, settings.multi_gpu_overhead)
            return NeverFitsError(
                f"{demand.model} needs {format_size(need)} across the GPUs of one host; the "
                f"largest host has {format_size(max(per_host.values()))}. "
                f"Lower its memory in the catalog or add GPUs to one host."
            )
    pinned = {d.replica for ds in view.by_gpu.values() for d in ds if not d.evictable}
    dedicated = sum(1 for r in pinned if view.snap.deployments[r].dedicated)
    return CantAccommodateError(
        f"{demand.model} fits the fleet but no GPU can free enough memory now: "
        f"{len(pinned)} replicas may not be evicted ({dedicated} dedicated, the rest busy, "
        f"loading or draining). Retry when requests finish, or evict a dedicated model."
    )
