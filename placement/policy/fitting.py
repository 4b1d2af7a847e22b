"""Where a replica fits in free room, without evicting: one GPU, or `n` whole GPUs.

The policy (`placement.policy.place`) asks here first. A dedicated replica, which pressure
never moves, is packed: the GPU type with the most left, then the place where it raises
the expected unusable room least (`placement.policy.fragmentation`), then the tightest,
then the host with the least room. An evictable one takes best fit (docs/placement.md,
"Choosing a GPU"). The search runs over `placement.policy.room` host shapes, so the
common case costs one step per shape, not per GPU.
"""

from __future__ import annotations

import math
import random
from bisect import bisect_left
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from placement.policy.fragmentation import Fragmentation
from placement.policy.planning import (
    Option,
    Planning,
    candidate_level,
    counts_empty,
    room_to_spare,
)
from placement.policy.room import Shape, empty_gpus, room_of
from placement.policy.settings import GpuChoice, PolicySettings
from placement.policy.state import Demand, Gpu

T = TypeVar("T")


def best_host(
    view: Planning,
    rng: random.Random,
    options: Callable[[Shape], Iterable[tuple[tuple[float, ...], T]]],
    floor: int = 0,
    *,
    warm_options: Callable[[Shape], Iterable[tuple[tuple[float, ...], T]]] | None = None,
    shapes: Iterable[Shape] | None = None,
) -> tuple[str, T] | None:
    """The host with the lowest-keyed option among `options(shape)` over host shapes
    (`placement.policy.room`), hosts with a warm copy of the model first (their options from
    `warm_options`, if given); ties are broken at random in proportion to how many hosts
    share a shape. Shapes with no GPU of `floor` free bytes are skipped unasked, and only
    `shapes` are asked, when given. None when nothing fits."""
    index = room_of(view.snap)
    best: tuple[tuple[float, ...], Shape, str | None, T] | None = None
    ties = 0
    warm: list[tuple[Shape, str | None]] = [
        (index.shape_of[h], h) for h in view.my_warm if h in index.shape_of
    ]
    every: Iterable[tuple[Shape, str | None]] = (
        (shape, None) for shape in (index.shapes.values() if shapes is None else shapes)
    )
    for candidates, ask in ((warm, warm_options or options), (every, options)):
        for shape, host in candidates:
            if shape.top < floor:
                continue  # full hosts, the most common shape late in a fill
            weight = 1 if host is not None else len(shape.hosts)
            for key, found in ask(shape):
                if best is None or key < best[0]:
                    best, ties = (key, shape, host, found), weight
                elif key == best[0]:
                    ties += weight
                    if rng.random() * ties < weight:  # every tied host equally likely
                        best = (key, shape, host, found)
        if best is not None:
            break  # a warm host with room beats any other host
    if best is None:
        return None
    _, shape, host, found = best
    return (host if host is not None else shape.hosts[rng.randrange(len(shape.hosts))]), found


def free_single(
    demand: Demand, view: Planning, settings: PolicySettings, rng: random.Random
) -> Option | None:
    """The best GPU that takes one replica without evicting anything, or None."""
    index = room_of(view.snap)
    allowed = index.names(demand.accelerator)
    choice = settings.gpu_choice
    slots = {t: s for t in index.totals(demand.accelerator) if (s := view.slot(t)) is not None}
    if not slots:
        return None
    if choice is GpuChoice.BEST_FIT and demand.dedicated:
        return _packed_single(view, slots, allowed, rng)

    def options(shape: Shape) -> Iterator[tuple[tuple[float, ...], tuple[str, int, int]]]:
        for name, total, frees in shape.layout:
            slot = slots.get(total)
            if name not in allowed or slot is None or frees[-1] < slot[1]:
                continue
            request, limit = slot
            if choice is GpuChoice.BEST_FIT:
                free = frees[bisect_left(frees, limit)]  # the tightest
                left = (free - request) / total  # of the GPU, as a share
                yield (
                    (
                        float(free == total),  # fill a GPU in use before an empty one
                        left if free < total else 0.0,
                        view.type_rank(name, total, request),  # then the freest type
                        shape.room - request / total,  # then the host with least room
                        left,
                    ),
                    (name, total, free),
                )
            elif choice is GpuChoice.MOST_FREE:
                yield (-float(frees[-1]),), (name, total, frees[-1])
            else:
                yield (), (name, total, -1)  # any GPU that fits

    found = best_host(view, rng, options, min(limit for _, limit in slots.values()))
    return None if found is None else _on_host(view, rng, *found)


def _packed_single(
    view: Planning, slots: dict[int, tuple[int, int]], allowed: frozenset[str], rng: random.Random
) -> Option | None:
    """The GPU for a dedicated replica, which never moves, so where it goes decides what
    fits beside it for good: GPUs of the type with the most left (`Planning.type_rank`),
    and, where that counts empty GPUs, GPUs in use of any type with room to spare
    (`planning.room_to_spare`); of those, the one whose
    host's expected unusable room, against the asks of the fleet's own demand, it raises
    least (`placement.policy.fragmentation`: for an empty GPU that depends on how many
    its host has, so places are keyed by that too), then the tightest, then the host with
    the least room (docs/placement.md, "Choosing a GPU")."""
    index = room_of(view.snap)
    kinds = []  # GPU types and sizes that take a slot, the type with the most left first
    for (name, total), levels in index.levels.items():
        slot = slots.get(total)
        if slot is not None and name in allowed:
            kinds.append((view.type_rank(name, total, slot[0]), name, total, levels))
    kinds.sort(key=lambda kind: kind[0])
    size = min(slots)  # the request's ask, on one GPU size it may take
    fragmentation = Fragmentation(index.demand, size, slots[size][0])
    keys: dict[tuple[str, int, int, int], tuple[float, ...]] = {}  # by place, empty GPUs
    top_rank: float | None = None  # the rank of the best type that fits
    for type_rank, name, total, levels in kinds:
        request, limit = slots[total]
        rank, in_use_only = type_rank, False
        if top_rank is not None and not view.my_warm and type_rank > top_rank:
            # A worse type than one that fits: none of its GPUs ranks first, but for its
            # GPUs in use where `type_left` counts empty GPUs and the type has room to
            # spare: taking room there takes nothing the type rank counts, or its pinned
            # requests need, so they rank with the best type's, by the room they strand
            if not (counts_empty(index, total, request) and room_to_spare(index, name)):
                continue
            rank, in_use_only = top_rank, True
        for free in levels:
            if free >= limit and not (in_use_only and free >= total):
                # an empty GPU's key depends on how many its host has (`Fragmentation`)
                for empty in sorted(index.empties[(name, total)]) if free == total else (0,):
                    keys[(name, total, free, empty)] = (
                        rank,
                        fragmentation.change(name, total, free, request, empty),
                        (free - request) / total,
                    )
        if keys and top_rank is None:
            top_rank = type_rank
    if not keys:
        return None
    best = min(keys.values())
    order = [place for place, key in keys.items() if key == best]  # ordered: a seed replays
    chosen = set(order)

    def places(shape: Shape) -> Iterator[tuple[tuple[str, int, int, int], tuple[str, int, int]]]:
        for name, total, frees in shape.layout:
            empty = empty_gpus(frees, total)
            for free in set(frees):
                yield (name, total, free, empty if free == total else 0), (name, total, free)

    def options(shape: Shape) -> Iterator[tuple[tuple[float, ...], tuple[str, int, int]]]:
        for place, found in places(shape):
            if place in chosen:
                yield (shape.room,), found

    def warm_options(shape: Shape) -> Iterator[tuple[tuple[float, ...], tuple[str, int, int]]]:
        for place, found in places(shape):  # a warm copy's host: any place, ranked
            key = keys.get(place)
            if key is not None:
                yield (*key, shape.room), found

    # the only shapes whose key, (room,), can be lowest
    least = index.least_room(dict.fromkeys(p[:3] for p in order), lambda s: any(options(s)))
    floor = min(limit for _, limit in slots.values())
    found = best_host(view, rng, options, floor, warm_options=warm_options, shapes=least)
    return None if found is None else _on_host(view, rng, *found)


def _on_host(view: Planning, rng: random.Random, host: str, place: tuple[str, int, int]) -> Option:
    """The option on one GPU of `host` of `place` (GPU name, size, and its free bytes, or
    -1 for any GPU that fits), the warm copy's holder's first, else one at random."""
    name, total, free = place
    slot = view.slot(total)
    assert slot is not None
    group = next(g for g in room_of(view.snap).by_host[host] if (g.name, g.total) == (name, total))
    fits = [g for g in group.gpus.values() if (g.free == free if free >= 0 else g.free >= slot[1])]
    gpu = rng.choice(sorted(holders_first(fits, view), key=lambda g: g.id))
    return Option(candidate_level(host in view.my_warm, evicts=False), {gpu.id: slot}, (), ())


def holders_first(gpus: list[Gpu], view: Planning) -> list[Gpu]:
    """Of equally good GPUs, those of the worker holding this model's warm copy on their
    host, if any (`foreign`)."""
    return [g for g in gpus if not foreign(g, view)] or gpus


def foreign(gpu: Gpu, view: Planning) -> bool:
    """Whether a warm copy on `gpu`'s host is not its own worker's: there the holder would
    open a second CUDA context to restore it, which the ledger then charges (docs/placement.md,
    "CUDA contexts"), or that GPU's worker would read the copy, leaving it beside the new
    replica ("Warm copies another worker reads"). The holder's own GPU does neither."""
    holder = view.my_warm.get(gpu.host)
    return holder is not None and gpu.worker != holder.worker


def free_whole(n: int, view: Planning, rng: random.Random) -> Option | None:
    """`n` empty GPUs of one host: for a dedicated replica of the type with the most left
    (`Planning.type_rank`), then on the host with the least room left; or None."""
    index = room_of(view.snap)
    allowed = index.names(view.demand.accelerator)
    dedicated = view.demand.dedicated  # an evictable replica takes any type's (`type_rank`)

    def options(shape: Shape) -> list[tuple[tuple[float, ...], None]]:
        empty, rank = 0, math.inf
        for name, total, frees in shape.layout:
            if name in allowed and frees[-1] == total:
                empty += empty_gpus(frees, total)
                if dedicated:
                    rank = min(rank, view.type_rank(name, total, total))
        return [((rank, shape.room), None)] if empty >= n else []

    empty = [(name, total, total) for name, total in index.levels if name in allowed]
    if dedicated and index.pins():  # types rank: any shape with an empty GPU may be best
        held = (index.holding.get(place, ()) for place in empty)
        shapes = {lay: index.shapes[lay] for entries in held for _, lay in entries}
        candidates: Iterable[Shape] = shapes.values()
    else:  # every type alike: the key is the room, and only the least can be lowest
        candidates = index.least_room(empty, lambda shape: bool(options(shape)))
    floor = min(index.totals(view.demand.accelerator))
    found = best_host(view, rng, options, floor, shapes=candidates)
    if found is None:
        return None
    host = found[0]
    by_type: dict[float, list[Gpu]] = defaultdict(list)  # a host may mix types: best first
    for group in index.by_host[host]:
        if group.name in allowed:
            rank = view.type_rank(group.name, group.total, group.total) if dedicated else 0.0
            by_type[rank].extend(g for g in group.gpus.values() if g.free == g.total)
    chosen: list[Gpu] = []
    for rank in sorted(by_type):
        ranked = sorted(by_type[rank], key=lambda g: g.id)
        chosen += rng.sample(ranked, min(n - len(chosen), len(ranked)))
        if len(chosen) == n:
            break
    slots = {g.id: (g.total, g.total) for g in chosen}
    return Option(candidate_level(host in view.my_warm, evicts=False), slots, (), ())
