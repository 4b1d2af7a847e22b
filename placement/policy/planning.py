"""What one planning call reads of a snapshot, and the options it weighs.

`Planning` gathers, once per call, what every part of the policy asks of the snapshot:
this demand's slot on each GPU size, and how each GPU type ranks.
`Option` is one way to place the replica; `placement.policy.place` picks the best.
"""

from __future__ import annotations

from dataclasses import dataclass

from placement.policy.room import RoomIndex, room_of
from placement.policy.settings import PolicySettings
from placement.policy.sizing import single_gpu_slot
from placement.policy.state import Candidate, Demand, Deployment, Level, Snapshot

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
        self._ranks: dict[tuple[str, int, int], float] = {}
        live = room_of(snap).workers
        self.my_warm: dict[str, Deployment] = {}
        for d in sorted(self.mine, key=lambda d: d.last_used_ms):
            if d.level is Level.WARM and d.worker in live:  # its holder must restore it
                self.my_warm[d.host] = d  # the most recently used one wins

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
    if not index.pins():
        return 0.0  # no request is pinned to a type: any type serves any of them
    gpus = index.type_gpus[name]
    reserve = index.pinned_share(name) * index.free_room()
    if counts_empty(index, total, request):
        left = (index.type_empty[name] - reserve) / gpus
        if reserve > 0 and left <= 0:
            return left  # none to spare: below every type that has some, rounding or not
        return round(left * TYPES_EVEN) / TYPES_EVEN
    return (index.type_room[name] - reserve) / gpus


def counts_empty(index: RoomIndex, total: int, request: int) -> bool:
    """Whether `type_left` counts a type's empty GPUs (of `total` bytes) for `request`."""
    return bool(index.pins()) and (request >= total or bool(index.slot_count(total, total)))


def room_to_spare(index: RoomIndex, name: str) -> bool:
    """Whether GPU type `name` has free room beyond what the requests pinned to it will
    still ask for (`type_left`'s reserve). Those requests take shares of GPUs in use as
    well as empty GPUs, so only then is room on its GPUs in use free for others."""
    return index.type_room[name] > index.pinned_share(name) * index.free_room()
