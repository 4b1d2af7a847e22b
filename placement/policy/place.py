"""The placement policy: where one more replica of a model goes, and what moves out.

Pure and deterministic for a given `random.Random`: it reads a `Snapshot` and
returns a `Plan`, or raises `CantAccommodateError` saying why. The router, the
benchmarks and the simulator all call it; the registry's commit script re-checks
the plan atomically, so a stale snapshot costs a retry, never a double booking.

Candidates are ranked, best first (docs/placement.md, "Choosing a GPU"):
1. a warm copy on the host, then room without evicting (`placement.policy.fitting`: packing
   for a dedicated replica, best fit for an evictable one), then fewer victims, then
   victims used longer ago (NDIF's candidate levels, LRU);
2. ties at random, never by index.
Single-GPU places come before multi-GPU ones, which split a replica over the GPUs of
one host (Helix). What a call reads of the snapshot is in `placement.policy.planning`; sizes
come from `placement.policy.sizing`.
"""

from __future__ import annotations

import random
import uuid
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import replace

from placement.errors import CantAccommodateError, NeverFitsError, PlacementError, SettlingError
from placement.policy.fitting import foreign, free_single, free_whole
from placement.policy.planning import Option, Planning, candidate_level
from placement.policy.room import Group, room_of
from placement.policy.settings import GpuChoice, PolicySettings, VictimOrder
from placement.policy.sizing import shard, splittable, spread_need
from placement.policy.state import (
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
from placement.units import accelerators
from placement.units.memory import format_size, fraction_of


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
    view = Planning(snap, demand, settings)

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
            accelerator=best.accelerator,
        )

    if demand.gpus is not None and demand.request is not None:
        raise PlacementError(
            f"model {demand.model!r} asks for both a GPU count and bytes: keep one of them"
        )
    if not (demand.size or demand.request or demand.gpus or demand.learned):
        raise PlacementError(
            f"model {demand.model!r} has no memory figure: set `memory` or `gpus` in the catalog"
        )
    groups = room_of(snap).matching(demand.accelerator)
    if not groups:
        what = f" of type {accelerators.describe(demand.accelerator)}" if demand.accelerator else ""
        raise CantAccommodateError(
            f"{demand.model} cannot be placed: no live GPU{what} in the fleet "
            f"({len(snap.gpus)} registered). Start a GPU worker, or check its heartbeat."
        )
    option = free_single(demand, view, settings, rng)
    if option is None:  # evictions: only groups with idle replicas could free any room
        idle = room_of(snap).idle(demand.accelerator)
        option = _best(_evicting_single(demand, idle, view, settings, rng))
        if option is None and demand.gpus is not None and demand.gpus >= 2:
            option = free_whole(int(demand.gpus), view, rng)
        if option is None and splittable(demand):
            option = _best(_multi_gpu_options(demand, groups, idle, view, settings, rng))
    if option is None:
        raise _why_not(demand, groups, view, settings)
    return _to_plan(demand, option, view, settings, rng)


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


def _best(options: Iterable[Option]) -> Option | None:
    return min(options, key=lambda o: o.sort_key, default=None)


def _victims(
    gpu: Gpu, limit: int, view: Planning, order: VictimOrder
) -> tuple[Deployment, ...] | None:
    """The idle replicas to evict from `gpu` so that `limit` more bytes are admitted."""
    deficit = gpu.reserved + limit - gpu.total
    if deficit <= 0:
        return ()
    pool = _victim_pool(gpu, view)
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
    if deficit > 0:
        return None
    # Spare every victim the others make room without, the last taken (the most
    # recently used, or the largest) considered first: a big victim taken last can make
    # the small ones taken before it unneeded.
    for d in reversed(list(taken)):
        if deficit + d.gpus[gpu.id] <= 0:
            taken.remove(d)
            deficit += d.gpus[gpu.id]
    return tuple(taken)


def _victim_pool(gpu: Gpu, view: Planning) -> list[Deployment]:
    """The replicas on `gpu` this placement may evict: idle, not dedicated, and of no model
    it protects. A replica of the model itself is none: evicting it would leave as many."""
    keep = view.demand.protect | {view.demand.model}
    return [d for d in view.by_gpu.get(gpu.id, []) if d.evictable and d.model not in keep]


def _reach(gpu: Gpu, view: Planning) -> int:
    """What `gpu` could hold for this placement: its free bytes and its victims'."""
    return gpu.free + sum(d.gpus[gpu.id] for d in _victim_pool(gpu, view))


def _fit(
    gpu: Gpu, request: int, freed: int, view: Planning, choice: GpuChoice
) -> tuple[float, ...]:
    """How well `request` fits `gpu` once `freed` bytes leave it: lower is better."""
    if choice is GpuChoice.BEST_FIT:
        after = gpu.free + freed - request
        left = view.room[gpu.host] + (freed - request) / gpu.total
        return float(gpu.free == gpu.total), left, after / gpu.total
    if choice is GpuChoice.MOST_FREE:
        return (-float(gpu.free + freed),)
    return ()


def _recency(victims: Iterable[Deployment], settings: PolicySettings) -> float:
    """Under LRU, prefer evicting replicas that were used longest ago."""
    if settings.victim_order is not VictimOrder.LRU:
        return 0.0
    return float(max((v.last_used_ms for v in victims), default=0))


def _evicting_single(
    demand: Demand,
    groups: Sequence[Group],
    view: Planning,
    settings: PolicySettings,
    rng: random.Random,
) -> list[Option]:
    """One-GPU places that need evictions, on GPUs whose idle replicas free enough (`groups`:
    those with idle replicas; elsewhere `free_single` has seen every GPU)."""
    options = []
    for group in groups:
        slot = view.slot(group.total)
        if slot is None or group.max_reach < slot[1]:
            continue
        request, limit = slot
        for gpu in group.gpus.values():
            if group.reaches[gpu.id] < limit:
                continue
            victims = _victims(gpu, limit, view, settings.victim_order)
            if not victims:  # None: not enough; (): it was free, and free_single had it
                continue
            freed = sum(v.gpus[gpu.id] for v in victims)
            level = candidate_level(gpu.host in view.my_warm, evicts=True)
            key = (
                float(level),
                float(len(victims)),
                _recency(victims, settings),
                *_fit(gpu, request, freed, view, settings.gpu_choice),
                float(foreign(gpu, view)),  # the warm copy's holder's own GPU first
                rng.random(),
            )
            options.append(Option(level, {gpu.id: slot}, victims, key))
    return options


def _multi_gpu_options(  # noqa: PLR0917 - a planning call's parts, as `plan_replica` has them
    demand: Demand,
    groups: Sequence[Group],
    idle: Sequence[Group],
    view: Planning,
    settings: PolicySettings,
    rng: random.Random,
) -> list[Option]:
    """Places on the fewest GPUs of one host that together hold the replica (`idle`: the
    groups with replicas to evict)."""
    if demand.gpus is not None and not idle:
        return []  # whole GPUs and nothing to evict: `free_whole` has seen every host
    by_host: dict[str, list[Group]] = defaultdict(list)
    for group in groups:
        by_host[group.host].append(group)
    options = []
    for host, host_groups in by_host.items():
        if not _could_hold(demand, host_groups, settings):
            continue
        gpus = [(g, grp.reaches[g.id]) for grp in host_groups for g in grp.gpus.values()]
        counts = [int(demand.gpus)] if demand.gpus is not None else range(2, len(gpus) + 1)
        holder = view.my_warm.get(host)
        for n in counts:
            scored: list[_Shard] = []
            for gpu, reach in gpus:
                request, need = shard(demand, gpu.total, n, settings)
                if need > reach:
                    continue
                victims = _victims(gpu, need, view, settings.victim_order)
                if victims is None:
                    continue
                freed = sum(v.gpus[gpu.id] for v in victims)
                key = (
                    float(len(victims)),
                    _recency(victims, settings),
                    *_fit(gpu, request, freed, view, settings.gpu_choice)[-1:],  # this GPU's fit
                    rng.random(),
                )
                scored.append((key, gpu, request, need, freed, victims))
            if len(scored) < n:
                continue
            scored.sort(key=lambda s: s[0])
            loader = ""
            if demand.gpus is not None:  # whole GPUs: shards shrink for contexts (`_to_plan`)
                chosen = scored[:n]
            else:
                if holder is None:  # the loading GPU's worker, its GPU first
                    first = _loading_gpu(scored, dict((g.id, r) for g, r in gpus))
                    scored = [first, *(s for s in scored if s is not first)]
                    loader = first[1].id
                found = _with_contexts(
                    scored, n, holder.worker if holder else scored[0][1].worker, view
                )
                if found is None:
                    continue
                chosen = found
            victims_all = tuple({v.replica: v for s in chosen for v in s[5]}.values())
            level = candidate_level(host in view.my_warm, bool(victims_all))
            left = view.room[host] + sum((s[4] - s[2]) / s[1].total for s in chosen)
            option_key = (
                float(level),
                float(n),
                float(len(victims_all)),
                _recency(victims_all, settings),
                left if settings.gpu_choice is GpuChoice.BEST_FIT else 0.0,
                rng.random(),
            )
            slots = {s[1].id: (s[2], s[3]) for s in chosen}
            options.append(Option(level, slots, victims_all, option_key, loader))
            break  # the fewest GPUs that fit on this host
    return options


# A GPU a split may use: (sort key, GPU, request, admission need, bytes freed, victims)
_Shard = tuple[tuple[float, ...], Gpu, int, int, int, tuple[Deployment, ...]]


def _loading_gpu(scored: Sequence[_Shard], reaches: dict[str, int]) -> _Shard:
    """The GPU whose worker loads a split: the best one with no room, even after
    evictions (`reaches`), for another worker's CUDA context beside its shard, if any
    (only its own worker may use it); else the best one of the worker that would open
    the fewest new contexts on the others (`Gpu.charge_for`)."""
    for found in scored:
        _, gpu, _, need, _, _ = found
        if reaches[gpu.id] < need + gpu.context:
            return found
    return min(scored, key=lambda s: sum(1 for t in scored if t[1].charge_for(s[1].worker)))


def _with_contexts(
    scored: Sequence[_Shard], n: int, loader: str, view: Planning
) -> list[_Shard] | None:
    """The best `n` of `scored` once each also holds the CUDA context `loader` opens on
    it (`Gpu.charge_for`), evicting more where it must; None when fewer than `n` can."""
    chosen: list[_Shard] = []
    for found in scored:
        key, gpu, request, need, _, _ = found
        context = gpu.charge_for(loader)
        if context:
            victims = _victims(gpu, need + context, view, view.settings.victim_order)
            if victims is None:
                continue
            freed = sum(v.gpus[gpu.id] for v in victims)
            chosen.append((key, gpu, request, need, freed, victims))
        else:
            chosen.append(found)
        if len(chosen) == n:
            return chosen
    return None


def _could_hold(demand: Demand, groups: Sequence[Group], settings: PolicySettings) -> bool:
    """A quick necessary test: could this host's GPUs, after evictions, take the shards?"""
    if demand.gpus is not None:
        if not any(grp.idle for grp in groups):
            return False  # no evictions here: `free_whole` has seen this host
        whole = sum(1 for grp in groups for reach in grp.reaches.values() if reach == grp.total)
        return whole >= demand.gpus
    need = spread_need(demand, settings)
    return sum(reach for grp in groups for reach in grp.reaches.values()) >= need


# --- plans and refusals -------------------------------------------------------


def _to_plan(
    demand: Demand, option: Option, view: Planning, settings: PolicySettings, rng: random.Random
) -> Plan:
    snap = view.snap
    gpus = [snap.gpus[g] for g in option.slots]
    primary = snap.gpus[option.loader] if option.loader else min(gpus, key=lambda g: g.index)
    warm = view.my_warm.get(primary.host)
    whole = demand.gpus is not None and len(option.slots) > 1  # shards shrink, below
    read_from, kept = "", None
    if warm is not None and _read_instead(option, warm, view):
        # The GPU is another worker's: that worker loads the model, and reads the holder's
        # copy instead of the disk.
        read_from, kept, warm = warm.copy_at, warm.replica, None
    elif warm is not None and not whole and not _room_for_contexts(option, warm.worker, view):
        # Restoring would open a CUDA context on another worker's GPU without room for
        # it: the GPU's own worker loads the model instead.
        warm = None
        option = replace(option, candidate=candidate_level(False, evicts=bool(option.victims)))
    cold = sorted(d.replica for d in view.mine if d.level is Level.COLD)
    if warm is not None:
        replica, reuse = warm.replica, Level.WARM
    elif cold:
        replica, reuse = cold[0], Level.COLD
    else:
        replica, reuse = new_replica_id(rng), None
    evictions, drops = _destinations(
        option.victims,
        snap,
        settings.warm_drop_order,
        restoring=replica if warm else None,
        kept=kept,
    )
    size = demand.size or demand.request or demand.learned or 0
    # The process that holds a warm copy restores it (onto any GPU of its host);
    # otherwise the worker of the first planned GPU loads the replica.
    loader = (warm.worker, warm.queue) if warm is not None else (primary.worker, primary.queue)
    slots = dict(option.slots)
    if whole:
        # Whole GPUs: a shard leaves room for the loader's CUDA context on each GPU it
        # opens one on (commit.lua charges it there).
        for g in gpus:
            charge = g.charge_for(loader[0])
            slots[g.id] = (slots[g.id][0] - charge, slots[g.id][1] - charge)
    return Plan(
        model=demand.model,
        replica=replica,
        candidate=option.candidate,
        gpus={g: slot[0] for g, slot in slots.items()},
        limit=_plan_limit(slots),
        fraction=max(fraction_of(slots[g.id][0], g.total) for g in gpus),
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
        accelerator=demand.accelerator,
        read_from=read_from,
    )


def _read_instead(option: Option, warm: Deployment, view: Planning) -> bool:
    """Whether the GPU's own worker should read `warm`'s copy rather than its holder
    restore it: the copy is published (`copy_at`), the replica takes one GPU, another
    worker's, and that worker may map the holder's memory (the same `Gpu.domain`). The
    replica then lives in the process that owns its GPU, and the holder opens no CUDA
    context on a GPU it does not own (about 0.7 GB there, kept until it exits). The copy
    stays WARM, where the drop rule may take it."""
    if not warm.copy_at or len(option.slots) != 1:
        return False
    gpus = view.snap.gpus
    domain = next((g.domain for g in gpus.values() if g.worker == warm.worker), "")
    return bool(domain) and all(
        gpus[g].worker != warm.worker and gpus[g].domain == domain for g in option.slots
    )


def _plan_limit(slots: dict[str, tuple[int, int]]) -> int:
    """The admission limit of a one-GPU slot; a multi-GPU shard's limit is its bytes."""
    if len(slots) == 1:
        return next(iter(slots.values()))[1]
    return max(request for request, _ in slots.values())


def _room_for_contexts(option: Option, loader: str, view: Planning) -> bool:
    """Whether each GPU of `option` admits its slot plus the CUDA context `loader` would
    open there (`Gpu.charge_for`) once the option's victims leave, as commit.lua checks."""
    for gpu_id, (request, limit) in option.slots.items():
        gpu = view.snap.gpus[gpu_id]
        charge = gpu.charge_for(loader)
        if charge:
            freed = sum(v.gpus.get(gpu_id, 0) for v in option.victims)
            if gpu.free + freed < max(request, limit) + charge:
                return False
    return True


def _destinations(
    victims: Sequence[Deployment],
    snap: Snapshot,
    drop_order: VictimOrder,
    restoring: str | None,
    kept: str | None = None,
) -> tuple[tuple[Eviction, ...], tuple[str, ...]]:
    """Send each victim to its host's warm cache when it fits, else drop it to COLD.

    Warm copies are dropped to make room by `drop_order`; under LRU only copies
    used longer ago than the victim are dropped, so a cold victim never displaces
    a warmer copy. `restoring` leaves the cache (its bytes are room); `kept` is read
    by the placement, so it is never dropped for room.
    """
    if not victims:
        return (), ()
    free = {h.name: h.warm_free for h in snap.hosts.values()}
    warm: dict[str, list[Deployment]] = defaultdict(list)
    for host in {v.host for v in victims}:
        for d in snap.warm_by_host.get(host, ()):
            if d.replica == restoring:
                free[host] = free.get(host, 0) + d.cached
            elif d.replica != kept:
                warm[host].append(d)
    for entries in warm.values():
        if drop_order is VictimOrder.LRU:
            entries.sort(key=lambda d: (d.last_used_ms, d.replica))
        else:
            entries.sort(key=lambda d: (d.cached, d.last_used_ms, d.replica))
    evictions: list[Eviction] = []
    drops: list[str] = []
    for v in victims:
        room = free.get(v.host, 0)
        chosen: list[Deployment] = []
        for w in warm[v.host]:
            if room >= v.cached:
                break
            if drop_order is VictimOrder.LRU and w.last_used_ms >= v.last_used_ms:
                break
            chosen.append(w)
            room += w.cached
        if room >= v.cached and v.cached > 0:
            for w in chosen:
                warm[v.host].remove(w)
                drops.append(w.replica)
            free[v.host] = room - v.cached
            evictions.append(Eviction(v.replica, Level.WARM, v.queue))
        else:
            evictions.append(Eviction(v.replica, Level.COLD, v.queue))
    return tuple(evictions), tuple(drops)


def _why_not(
    demand: Demand, groups: Sequence[Group], view: Planning, settings: PolicySettings
) -> PlacementError:
    """Explain a refusal: it never fits (even on an empty fleet), or not now, and why."""
    what = f" of type {accelerators.describe(demand.accelerator)}" if demand.accelerator else ""
    index = room_of(view.snap)
    slots = [s for s in map(view.slot, index.totals(demand.accelerator)) if s]
    allowed = index.names(demand.accelerator)
    free = max(max(frees) for (name, _), frees in index.levels.items() if name in allowed and frees)
    idle = index.idle(demand.accelerator)
    reach = max([free, *(_reach(gpu, view) for g in idle for gpu in g.gpus.values())])
    most_free, most_reach = format_size(free), format_size(reach)
    if slots:
        own = (
            f", or {demand.model}'s own, which a further replica never evicts"
            if any(d.level is Level.HOT for d in view.mine)
            else ""
        )
        return CantAccommodateError(
            f"{demand.model} needs {format_size(min(limit for _, limit in slots))} on one "
            f"GPU{what}; the most any has free now is {most_free}, and {most_reach} after "
            f"evicting idle replicas: the rest is held by replicas that may not be evicted "
            f"(dedicated, busy, loading or draining{own}). Retry when calls finish, evict a "
            f"model, or add GPUs."
        )
    if demand.gpus is not None:  # whole GPUs: a host with that many would hold it, empty
        could = index.widest(demand.accelerator) >= demand.gpus
    else:
        per_host: dict[str, list[Gpu]] = defaultdict(list)
        for g in groups:
            per_host[g.host].extend(g.gpus.values())
        could = any(_fits_empty(demand, h, settings) for h in per_host.values())
    if splittable(demand) and could:
        return CantAccommodateError(
            f"{demand.model} needs several GPUs of one host{what}, and no host has them free "
            f"now, even after evicting idle replicas (the most one GPU has free is "
            f"{most_free}). Retry when calls finish, evict a model, or add GPUs."
        )
    if demand.gpus is not None:
        return NeverFitsError(
            f"{demand.model} needs {demand.gpus:g} GPUs{what} on one host; "
            f"no host has that many live GPUs. Lower `gpus` or add GPUs."
        )
    largest = max(g.total for g in groups)
    if not splittable(demand):
        need = demand.limit or demand.request or demand.size
        return NeverFitsError(
            f"{demand.model} needs {format_size(need)} on one GPU{what}; the largest GPU has "
            f"{format_size(largest)}. Lower its memory in the catalog or add a larger GPU."
        )
    need = spread_need(demand, settings)
    largest = max(sum(g.total for g in h) for h in per_host.values())
    context = max(g.context for h in per_host.values() for g in h)
    also = (
        f", and each GPU but its loader's keeps {format_size(context)} for the loader's "
        f"CUDA context"
        if context
        else ""
    )
    return NeverFitsError(
        f"{demand.model} needs {format_size(need)} across the GPUs of one host{what}; the "
        f"largest host has {format_size(largest)}{also}. "
        f"Lower its memory in the catalog or add GPUs to one host."
    )


def _fits_empty(demand: Demand, gpus: Sequence[Gpu], settings: PolicySettings) -> bool:
    """Could these GPUs of one host, empty, hold the replica's shards, one worker loading
    them all (each GPU it does not own also keeps its CUDA context, `Gpu.context`)?"""
    counts = [int(demand.gpus)] if demand.gpus is not None else range(2, len(gpus) + 1)
    for n in counts:
        needs = [(g, shard(demand, g.total, n, settings)[1]) for g in gpus]
        if demand.gpus is not None:  # whole GPUs make room for contexts by shrinking
            if sum(need <= g.total for g, need in needs) >= n:
                return True
            continue
        for loader in {g.worker for g in gpus}:
            if sum(need + g.charge_for(loader) <= g.total for g, need in needs) >= n:
                return True
    return False
