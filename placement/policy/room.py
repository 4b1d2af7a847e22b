"""Free room by host and GPU type: how the policy finds candidates without visiting every GPU.

A group is the live GPUs of one host that share a name and a size. It keeps its GPUs'
free bytes sorted, so the tightest GPU that takes a slot is one bisection away, and how
much each could offer after evicting its idle replicas (its reach), so groups that
cannot help an eviction are skipped at once. A shape is every host whose groups are
alike (same types, sizes and free bytes): the policy looks for free room shape by shape,
and a fleet of 6,200 GPUs on 1,200 hosts has a few hundred shapes, most hosts being
empty or full; each room a GPU may have free points at the shapes with such a GPU, by
their room. Each GPU type keeps its free share and how many of its GPUs are empty, so
load can be spread over types, and the demand the replicas held put on it
(`placement.policy.fragmentation`), so the policy can tell room no request could use.

A host's room is the sum of its live GPUs' free shares (free / total): rooms compare
across GPU sizes. Shares are floats and only rank candidates; admission is decided in
whole bytes.
"""

from __future__ import annotations

import math
from bisect import bisect_left, insort
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from placement.policy.fragmentation import ROUNDING, Ask, Demand
from placement.policy.state import Deployment, Gpu, Snapshot
from placement.units import accelerators
from placement.units.accelerators import Accelerator

K = TypeVar("K")


@dataclass
class Group:
    """The live GPUs of one host that share a name and a size."""

    host: str
    name: str
    total: int
    gpus: dict[str, Gpu] = field(default_factory=dict)
    frees: list[int] = field(default_factory=list)  # each GPU's free bytes, ascending
    reaches: dict[str, int] = field(default_factory=dict)  # free + idle evictable bytes
    max_reach: int = 0
    idle: set[str] = field(default_factory=set)  # GPUs with idle replicas to evict

    def put(self, gpu: Gpu, reach: int) -> None:
        old = self.gpus.get(gpu.id)
        if old is not None:
            del self.frees[bisect_left(self.frees, old.free)]
        self.gpus[gpu.id] = gpu
        insort(self.frees, gpu.free)
        self.reaches[gpu.id] = reach
        self.max_reach = max(self.reaches.values())
        if reach > gpu.free:
            self.idle.add(gpu.id)
        else:
            self.idle.discard(gpu.id)

    @property
    def empty(self) -> int:
        """How many of its GPUs are empty."""
        return empty_gpus(self.frees, self.total)


def empty_gpus(frees: Sequence[int], total: int) -> int:
    """How many of GPUs of `total` bytes with `frees` free bytes (ascending) are empty."""
    return len(frees) - bisect_left(frees, total)


Layout = tuple[tuple[str, int, tuple[int, ...]], ...]  # per group: name, total, frees


@dataclass
class Shape:
    """Hosts alike in every live GPU's type, size and free bytes: one candidate of the
    search, however many hosts share it (a large fleet has far fewer shapes than hosts)."""

    layout: Layout
    room: float
    top: int = 0  # the most free bytes of any of its GPUs: no slot above this fits
    hosts: list[str] = field(default_factory=list)
    _at: dict[str, int] = field(default_factory=dict)

    def add(self, host: str) -> None:
        self._at[host] = len(self.hosts)
        self.hosts.append(host)

    def remove(self, host: str) -> None:
        i = self._at.pop(host)
        last = self.hosts.pop()
        if last != host:
            self.hosts[i], self._at[last] = last, i


class RoomIndex:
    """The groups of one snapshot's live GPUs, with each host's room and shape."""

    def __init__(
        self, gpus: Iterable[Gpu], by_gpu: Mapping[str, Sequence[Deployment]], now_ms: int
    ) -> None:
        self.groups: dict[tuple[str, str, int], Group] = {}
        self.by_host: dict[str, list[Group]] = {}
        self.room: dict[str, float] = {}
        self.type_room: dict[str, float] = {}  # GPU name -> summed free shares of its GPUs
        self.type_gpus: dict[str, int] = {}
        self.type_empty: dict[str, int] = {}  # GPU name -> how many of its GPUs are empty
        # (GPU name, size) -> free bytes -> live GPUs with that much free
        self.levels: dict[tuple[str, int], dict[int, int]] = {}
        # (GPU name, size) -> empty GPUs of one host's group -> groups with that many
        self.empties: dict[tuple[str, int], dict[int, int]] = {}
        self.workers: set[str] = set()
        self.shapes: dict[Layout, Shape] = {}
        self.shape_of: dict[str, Shape] = {}
        # (GPU name, size, free bytes) -> the shapes with such a GPU, by room (ascending),
        # so that a search for one free room finds the hosts with the least room at once
        self.holding: dict[tuple[str, int, int], list[tuple[float, Layout]]] = {}
        self._matching: dict[Accelerator, list[Group]] = {}
        self._idle: dict[tuple[str, str, int], Group] = {}  # groups with idle replicas
        self._widest: dict[frozenset[str], int] = {}  # GPU names -> most GPUs of one host
        self._kinds: dict[Accelerator, tuple[frozenset[str], frozenset[int]]] = {}
        self._slots: dict[int, dict[int, int]] = {}  # GPU size -> slot bytes -> replicas
        # The demand observed (`pinned_share`), in whole bytes so that it never drifts: slot
        # bytes held on GPUs of each size, and of those the bytes of models that a GPU-type
        # constraint (its patterns) allows.
        self._held: dict[int, int] = {}
        # and each replica's GPUs' worth squared, as bytes squared by GPU size (a replica of
        # n whole GPUs adds n x its slot squared on each): `sample_size`
        self._squares: dict[int, int] = {}
        self._pinned: dict[tuple[tuple[str, ...], int], int] = {}
        # Replicas held by what they ask (`placement.policy.fragmentation`), and the same
        # as each GPU type sees them, kept for the types asked about (`demand`)
        self._asks: dict[Ask, int] = {}
        # `pinned_share` of each type, `pins` and `unpinned_share`; None: computed again
        # when next asked
        self._pinning: tuple[dict[str, float], bool, float] | None = None
        self._demand: dict[str, Demand] = {}
        known = {gpu.id: gpu for gpu in gpus}
        whole: dict[str, int] = {}  # replica -> `whole_gpus`, decided once per replica
        for gpu in known.values():
            for d in by_gpu.get(gpu.id, ()):
                if d.replica not in whole:
                    whole[d.replica] = whole_gpus(d, known)
                self.hold(gpu.total, d.gpus[gpu.id], +1, d.accelerator, whole[d.replica])
            if gpu.alive(now_ms):
                self.workers.add(gpu.worker)
                self.put(gpu, _evictable(gpu, by_gpu.get(gpu.id, ())))

    def put(self, gpu: Gpu, evictable: int) -> None:
        """Add or update one live GPU, with the bytes its idle replicas could free."""
        key = (gpu.host, gpu.name, gpu.total)
        group = self.groups.get(key)
        if group is None:
            group = self.groups[key] = Group(gpu.host, gpu.name, gpu.total)
            self.by_host.setdefault(gpu.host, []).append(group)
            self._matching.clear()
            self._kinds.clear()
            self._demand.clear()
            self._widest.clear()
        old = group.gpus.get(gpu.id)
        before = old.free / old.total if old is not None else 0.0
        if old is None:
            self.type_gpus[gpu.name] = self.type_gpus.get(gpu.name, 0) + 1
            self._widest.clear()  # a host has one more GPU
            self._pinning = None
        emptied = int(gpu.free == gpu.total) - int(old is not None and old.free == old.total)
        self.type_empty[gpu.name] = self.type_empty.get(gpu.name, 0) + emptied
        self.type_room[gpu.name] = self.type_room.get(gpu.name, 0.0) - before + gpu.free / gpu.total
        kind = (gpu.name, gpu.total)
        levels = self.levels.setdefault(kind, {})
        if old is not None:
            _add(levels, old.free, -1)
        _add(levels, gpu.free, +1)
        empties = self.empties.setdefault(kind, {})
        if group.empty:
            _add(empties, group.empty, -1)
        group.put(gpu, gpu.free + evictable)
        if group.empty:
            _add(empties, group.empty, +1)
        if group.idle:
            self._idle[key] = group
        else:
            self._idle.pop(key, None)
        self._reshape(gpu.host)

    def _reshape(self, host: str) -> None:
        groups = self.by_host[host]
        layout = tuple(sorted((g.name, g.total, tuple(g.frees)) for g in groups))
        old = self.shape_of.get(host)
        if old is not None:
            if old.layout == layout:
                return
            old.remove(host)
            if not old.hosts:
                del self.shapes[old.layout]
                for name, total, frees in old.layout:
                    for free in set(frees):
                        entries = self.holding[(name, total, free)]
                        del entries[bisect_left(entries, (old.room, old.layout))]
        shape = self.shapes.get(layout)
        if shape is None:
            # summed from the layout, so equal hosts have equal rooms however they got there
            room = sum(f / total for _, total, frees in layout for f in frees)
            top = max((frees[-1] for _, _, frees in layout if frees), default=0)
            shape = self.shapes[layout] = Shape(layout, room, top)
            for name, total, frees in layout:
                for free in set(frees):
                    insort(self.holding.setdefault((name, total, free), []), (room, layout))
        shape.add(host)
        self.shape_of[host] = shape
        self.room[host] = shape.room

    def hold(
        self, total: int, slot: int, change: int, pin: Accelerator = None, whole: int = 0
    ) -> None:
        """Count (`change` +1) or uncount (-1) one replica's `slot` bytes on a GPU of
        `total` bytes, held by a model `pin` allows (None: any GPU). `whole`: the replica
        holds that many whole GPUs (`whole_gpus`), and asks them whatever `slot` is left
        of this one; 0: it asks `slot`."""
        _add(self._held, total, slot * change)
        _add(self._squares, total, (whole or 1) * slot * slot * change)
        self._pinning = None
        patterns = accelerators.alternatives(pin)
        ask = (patterns, total, total, whole) if whole else (patterns, total, slot, 1)
        _add(self._asks, ask, change)
        if self._demand:
            allowed = self.names(pin)
            for name, demand in self._demand.items():
                if name in allowed:
                    demand.count(ask, change)
        if pin is not None:
            _add(self._pinned, (accelerators.alternatives(pin), total), slot * change)
        counts = self._slots.setdefault(total, {})
        _add(counts, slot, change)

    def sample_size(self) -> float:
        """How many draws the demand observed (`pinned_share`) rests on: Kish's effective
        sample size for draws weighted by the GPUs' worth each replica holds, (sum of
        weights)^2 / sum of weights^2. A replica of n GPUs is one draw of weight n, so it
        counts for less than n replicas of one GPU would; 0 when nothing is held."""
        weights = sum(nbytes / total for total, nbytes in self._held.items())
        squares = sum(nbytes / (total * total) for total, nbytes in self._squares.items())
        return weights * weights / squares if squares > 0 else 0.0

    def slot_count(self, total: int, size: int) -> int:
        """How many replicas hold a slot of `size` bytes on GPUs of `total` bytes."""
        return self._slots.get(total, {}).get(size, 0)

    def type_free(self, name: str) -> float:
        """The share of GPU type `name`'s capacity that is free, 0 to 1."""
        return self.type_room[name] / self.type_gpus[name]

    def free_room(self) -> float:
        """GPUs' worth of free room in the fleet (free shares summed)."""
        return sum(self.type_room.values())

    def pinned_share(self, name: str) -> float:
        """The share of the demand observed (slots held, as GPUs' worth) that only some GPU
        types may serve, type `name` among them: each constraint's part spread over the
        fleet's types it allows in proportion to their GPUs. A constraint that allows every
        type in the fleet pins nothing."""
        return self._pinned_view()[0].get(name, 0.0)

    def pins(self) -> bool:
        """Whether any replica held may run on some of the fleet's GPU types only."""
        return self._pinned_view()[1]

    def unpinned_share(self) -> float:
        """The share of the demand observed whose models any GPU type of the fleet may
        serve: what no type's `pinned_share` counts, from whole bytes, so exactly 0 when
        every replica held is pinned."""
        return self._pinned_view()[2]

    def _pinned_view(self) -> tuple[dict[str, float], bool, float]:
        """Every type's `pinned_share`, `pins` and `unpinned_share`, in one pass, kept
        until a slot or a GPU is counted again."""
        if self._pinning is None:
            parts: dict[str, float] = {}
            pins = False
            held = sum(nbytes / total for total, nbytes in self._held.items())
            unpinned = dict(self._held)  # bytes by GPU size
            every = self.names(None)
            for (patterns, total), nbytes in self._pinned.items():
                names = self.names(patterns)
                if names == every:
                    continue
                pins = True
                unpinned[total] -= nbytes
                gpus = sum(self.type_gpus.get(n, 0) for n in names)
                for n in names if held > 0 else ():
                    parts[n] = parts.get(n, 0.0) + nbytes / total * self.type_gpus[n] / gpus
            rest = sum(nbytes / total for total, nbytes in unpinned.items())
            self._pinning = (
                {n: part / held for n, part in parts.items()},
                pins,
                rest / held if held > 0 else 1.0,
            )
        return self._pinning

    def idle(self, accelerator: Accelerator) -> list[Group]:
        """The groups whose GPU type `accelerator` allows that hold idle replicas."""
        names = self.names(accelerator)
        return [group for group in self._idle.values() if group.name in names]

    def widest(self, accelerator: Accelerator) -> int:
        """The most live GPUs of the types `accelerator` allows that one host has."""
        names = self.names(accelerator)
        found = self._widest.get(names)
        if found is None:
            found = self._widest[names] = max(
                (sum(len(g.gpus) for g in groups if g.name in names)
                 for groups in self.by_host.values()),
                default=0,
            )  # fmt: skip
        return found

    def least_room(
        self, places: Iterable[tuple[str, int, int]], fits: Callable[[Shape], bool] | None = None
    ) -> list[Shape]:
        """Of the shapes with a GPU at any of `places` (GPU name, size, free bytes), and
        that `fits` accepts if given, those with the least room."""
        found: dict[Layout, Shape] = {}
        least = math.inf
        for place in places:
            for room, layout in self.holding.get(place, ()):
                if room > least:
                    break
                shape = self.shapes[layout]
                if fits is not None and not fits(shape):
                    continue
                if room < least:
                    found, least = {}, room
                found[layout] = shape
        return list(found.values())

    def demand(self, name: str) -> Demand:
        """The replicas held that GPU type `name` could serve, by what they ask."""
        found = self._demand.get(name)
        if found is None:
            found = self._demand[name] = Demand()
            for ask, n in self._asks.items():
                if name in self.names(ask[0] or None):
                    found.count(ask, n)
        return found

    def names(self, accelerator: Accelerator) -> frozenset[str]:
        """The GPU names in the fleet that `accelerator` allows."""
        return self._kinds_of(accelerator)[0]

    def totals(self, accelerator: Accelerator) -> frozenset[int]:
        """The GPU sizes in the fleet among the types `accelerator` allows."""
        return self._kinds_of(accelerator)[1]

    def _kinds_of(self, accelerator: Accelerator) -> tuple[frozenset[str], frozenset[int]]:
        found = self._kinds.get(accelerator)
        if found is None:
            groups = self.matching(accelerator)
            found = frozenset(g.name for g in groups), frozenset(g.total for g in groups)
            self._kinds[accelerator] = found
        return found

    def matching(self, accelerator: Accelerator) -> list[Group]:
        """The groups whose GPU type `accelerator` allows."""
        found = self._matching.get(accelerator)
        if found is None:
            found = [g for g in self.groups.values() if accelerators.matches(g.name, accelerator)]
            self._matching[accelerator] = found
        return found


def _add(totals: dict[K, int], key: K, change: int) -> None:
    """Add `change` to `totals[key]`, dropping the key at 0."""
    left = totals.get(key, 0) + change
    if left:
        totals[key] = left
    else:
        del totals[key]


def whole_gpus(d: Deployment, gpus: Mapping[str, Gpu]) -> int:
    """How many whole GPUs of the snapshot's `gpus` replica `d` holds, as one ask of that
    many; 0 when it holds shares. A whole GPU's slot is the GPU less at most the CUDA context
    of a worker that does not own it (`placement.policy.place`, which charges it there)."""
    held = [(gpus[g], slot) for g, slot in d.gpus.items() if g in gpus]
    if held and all(slot > gpu.total - gpu.context - ROUNDING for gpu, slot in held):
        return len(held)
    return 0


def _evictable(gpu: Gpu, replicas: Iterable[Deployment]) -> int:
    return sum(d.gpus[gpu.id] for d in replicas if d.evictable)


def room_of(snap: Snapshot) -> RoomIndex:
    """`snap`'s free room by host and GPU type, built once per snapshot (a snapshot never
    changes, but a `placement.policy.live.LiveView` changes its own room in place with it)."""
    found: RoomIndex | None = snap.memo.get("room")
    if found is None:
        found = snap.memo["room"] = RoomIndex(snap.gpus.values(), snap.by_gpu, snap.now_ms)
    return found
