"""What one planning call reads of a snapshot, and the options it weighs.

`Planning` gathers, once per call, what every part of the policy asks of the snapshot:
this demand's slot on each GPU size, the smallest slot held there (below it, room is
dead), whether a hole has better users than this request, and how each GPU type ranks.
`Option` is one way to place the replica; `placement.policy.place` picks the best.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass

from placement.policy.room import RoomIndex, room_of
from placement.policy.settings import PolicySettings
from placement.policy.sizing import single_gpu_slot
from placement.policy.state import Candidate, Demand, Deployment, Level, Snapshot
from placement.units.memory import MiB

ROUNDING = MiB  # less room than this is what rounding to whole bytes leaves: no room at all
# A hole has a better user than this request when slots that fill it without dead room are
# held at least 1/RIVALS as often as this request's size (tuned on bench/packing.py)
RIVALS = 2
# GPU types whose shares of empty GPUs left (`type_left`) are within about 1/TYPES_EVEN of
# each other are equally free, so the host with the least room decides (tuned likewise)
TYPES_EVEN = 50


@dataclass(frozen=True)
class Option:
    """One way to place the replica: GPUs with their slots and the victims they need."""

    candidate: Candidate
    slots: dict[str, tuple[int, int]]  # GPU id -> (request, limit)
    victims: tuple[Deployment, ...]
    sort_key: tuple[float, ...]
    loader: str = ""  # the GPU whose worker loads it, if not the first GPU's (a split)


class Planning:
    """What one planning call needs of a snapshot: its indexes and this model's replicas."""

    def __init__(self, snap: Snapshot, demand: Demand, settings: PolicySettings) -> None:
        self.snap = snap
        self.by_gpu = snap.by_gpu
        self.room = room_of(snap).room
        self.mine = snap.replicas(demand.model)
        self.demand, self.settings = demand, settings
        self._slots: dict[int, tuple[int, int] | None] = {}
        self._smallest: dict[int, int] = {}
        self._wanted: dict[tuple[int, int], bool] = {}
        self._ranks: dict[tuple[str, int, int], float] = {}
        live = room_of(snap).workers
        self.my_warm: dict[str, Deployment] = {}
        for d in sorted(self.mine, key=lambda d: d.last_used_ms):
            if d.level is Level.WARM and d.worker in live:  # its holder must restore it
                self.my_warm[d.host] = d  # the most recently used one wins

    def smallest(self, total: int) -> int:
        """The smallest slot on a GPU of `total` bytes, this demand's included. A dedicated
        replica that leaves less room than this beside it strands that room: no replica
        in sight could use it, and pressure never moves the dedicated one. Room beside an
        evictable replica comes back when it is evicted, so that room is not counted."""
        if total not in self._smallest:
            slot = self.slot(total)
            held = room_of(self.snap).smallest(total)
            mine = slot[0] if slot is not None else total
            self._smallest[total] = mine if held is None else min(held, mine)
        return self._smallest[total]

    def wanted(self, total: int, free: int, request: int, dead: int) -> bool:
        """Whether a hole of `free` bytes on a GPU of `total` bytes has a better user than
        a slot of `request` bytes: larger slots, held on GPUs of this size at least
        1/RIVALS as often as `request`'s, that fit it and leave no dead room (under `dead`
        bytes). Only then is leaving dead room in it worth avoiding: a hole that only
        slots like this one fit (0.19 of a GPU beside a 0.81 share, and shares of 0.11
        and 0.16) has no other use, and filling it is the best it gets."""
        key = (total, free)
        found = self._wanted.get(key)
        if found is None:
            room = room_of(self.snap)
            sizes = room.slot_sizes(total)
            users = 0
            for size in sizes[bisect_right(sizes, request) : bisect_right(sizes, free)]:
                left = free - size
                if left < ROUNDING or left >= dead:
                    users += room.slot_count(total, size)
            found = users > 0 and users * RIVALS >= room.slot_count(total, request)
            self._wanted[key] = found
        return found

    def type_rank(self, name: str, total: int, request: int) -> float:
        """Ranks GPU type `name` for a slot of `request` bytes on a GPU of `total` bytes,
        computed once. A dedicated replica goes to the type with the most left
        (`type_left`): it never moves, so what it takes stays taken, and requests pinned
        to a type find room there as long as any type has some. An evictable
        one, a cache entry whose room comes back by eviction, goes to the freest type,
        in use or empty (the simulator's hit rate: `type_left` cost azure-code 0.003)."""
        key = (name, total, request)
        found = self._ranks.get(key)
        if found is None:
            if self.demand.dedicated:
                found = self._ranks[key] = -type_left(room_of(self.snap), name, total, request)
            else:
                found = self._ranks[key] = -room_of(self.snap).type_free(name)
        return found

    def slot(self, total: int) -> tuple[int, int] | None:
        """`single_gpu_slot` of this demand on a GPU of `total` bytes, computed once."""
        if total not in self._slots:
            self._slots[total] = single_gpu_slot(self.demand, total, self.settings)
        return self._slots[total]


def candidate_level(cached: bool, evicts: bool) -> Candidate:
    """NDIF's candidate level of a place: on a host with a warm copy, and whether it evicts."""
    if evicts:
        return Candidate.CACHED_AND_FULL if cached else Candidate.FULL
    return Candidate.CACHED_AND_FREE if cached else Candidate.FREE


def type_left(index: RoomIndex, name: str, total: int, request: int) -> float:
    """How much of GPU type `name` (GPUs of `total` bytes) is left, per GPU of the type,
    once the room that requests pinned to it will still ask for is set aside. Where whole
    GPUs are asked for on GPUs of this size (by this `request` or a replica held), the
    room counted is its empty GPUs, to 1/TYPES_EVEN: those are what a request pinned to
    the type runs out of first, however much room its shared GPUs keep. Elsewhere its
    free room: shares fit in any room.

    The room set aside is the type's part of the demand observed (`RoomIndex.pinned_share`:
    of the slots held, those of models only some types may serve) times the fleet's free
    room: if requests keep arriving as they have, that is what the pinned ones will ask of
    this type before the fleet is full. So a type that its own pinned requests will need
    whole (a fifth of the calls pinned to a seventh of the fleet) is the last that other
    requests fill; where every type is pinned in proportion to its size, every type's
    share moves by the same amount and they rank as before (docs/placement.md, "Choosing
    a GPU"). The rounding to 1/TYPES_EVEN lets the host decide between types about as
    free; a type whose empty GPUs are all set aside is never one of them: near the end of
    a fill every share rounds to 0, and its last empty GPUs went to requests that may run
    anywhere."""
    gpus = index.type_gpus[name]
    reserve = index.pinned_share(name) * index.free_room()
    if request >= total or index.slot_count(total, total):
        left = (index.type_empty[name] - reserve) / gpus
        if reserve > 0 and left <= 0:
            return left  # none to spare: below every type that has some, rounding or not
        return round(left * TYPES_EVEN) / TYPES_EVEN
    return (index.type_room[name] - reserve) / gpus
