"""What one planning call reads of a snapshot, and the options it weighs.

`Planning` gathers, once per call, what every part of the policy asks of the snapshot:
this demand's slot on each GPU size, and how each GPU type ranks.
`Option` is one way to place the replica; `placement.policy.place` picks the best.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from placement.policy.room import RoomIndex, room_of
from placement.policy.settings import PolicySettings
from placement.policy.sizing import single_gpu_slot
from placement.policy.state import Candidate, Demand, Deployment, Level, Snapshot

# GPU types whose `type_left` are within about 1/TYPES_EVEN of each other, where it counts
# empty GPUs and is above 0, are equally free, so the host with the least room decides. A
# tuned constant: 25 and 100 in its place miss as many cells of 60 typed replays, within 1
# (docs/benchmarks.md, "Typed pods: each type asked what it will be asked")
TYPES_EVEN = 50
# Standard errors of the pinned share that a type's room must clear to be to spare
# (`room_to_spare`). One, the usual measure of an estimate's spread, not tuned: a half and
# two in its place are measured beside it (docs/benchmarks.md, "Room to spare, beyond the
# estimate's error")
SPARE_ERRORS = 1.0


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
    """How many times over GPU type `name` (GPUs of `total` bytes) can still give what it
    is expected to be asked for before the fleet is full, less one: 0 when just enough,
    below 0 when short. Requests that may run anywhere go to the type with the most
    left, so types run out together and a request pinned to a type still finds room.

    Expected (`expected_ask`): the type's part of the demand observed, times the fleet's
    free room. Its part is the share held by models only some types may serve, each
    constraint spread over the types it allows in proportion to their GPUs
    (`RoomIndex.pinned_share`), and of the rest, which any type may serve, its share of
    the fleet's GPUs: if requests keep coming as they have, that is what the type will
    be asked for. What it can give: where whole GPUs are asked for on GPUs of this size
    (by this `request` or a replica held), its empty GPUs, to 1/TYPES_EVEN: those are
    what a request pinned to the type runs out of first, however much room its shared
    GPUs keep; elsewhere its free room, exact: shares fit in any room.

    A ratio, not a difference: the first refusal comes when the first type runs out,
    and a type runs out when its room is gone at the rate it is asked, whatever its
    size; a type its pinned requests ask for more than it has is short by the same
    measure whether it has 200 GPUs or 4,000 (docs/placement.md, "Choosing a GPU").
    Where every type is pinned in proportion to its size, every type's expected ask is
    its share of the fleet, and they rank by free share as before. Where it counts empty
    GPUs, a type with some to spare is rounded to 1/TYPES_EVEN, so the host decides
    between types about as free; a short one is not rounded, so it is never tied with
    one that has some to spare."""
    if not index.pins():
        return 0.0  # no request is pinned to a type: any type serves any of them
    expected = expected_ask(index, name)
    if expected <= 0:
        return math.inf  # nothing held asks for it
    if counts_empty(index, total, request):
        left = index.type_empty[name] / expected - 1
        if left <= 0:
            return left  # short: below every type that has some to spare, rounding or not
        return round(left * TYPES_EVEN) / TYPES_EVEN
    return index.type_room[name] / expected - 1


def expected_ask(index: RoomIndex, name: str) -> float:
    """GPUs' worth that GPU type `name` is expected to be asked for before the fleet is
    full, if requests keep coming as they have (`type_left`)."""
    share = index.unpinned_share() * index.type_gpus[name] / sum(index.type_gpus.values())
    return (index.pinned_share(name) + share) * index.free_room()


def room_to_spare(index: RoomIndex, name: str) -> bool:
    """Whether GPU type `name` has free room beyond what the requests pinned to it will
    still ask for (its `RoomIndex.pinned_share` of the fleet's free room). Those requests
    take shares of GPUs in use as well as empty GPUs, so only then is room on its GPUs in
    use free for others.

    The pinned share is a proportion observed over the replicas held so far, so it is
    known to within its standard error, sqrt(p (1 - p) / n) for a sample of n
    (`RoomIndex.sample_size`); the room must pass the ask by `SPARE_ERRORS` of those, of
    the fleet's free room, to be to spare. The two ways of being wrong are not alike:
    room given away on a type that turns out short brings the first refusal forward by
    about that room over its pinned requests' share of the asks (7 times it where that
    share is 0.14), while room kept saves only what one request strands elsewhere.
    On a type whose pinned requests ask for about what it has, a decision on the bare
    estimate flips on noise: early in a fill, 2.5 GPUs' worth of T4 went to shares that
    may run anywhere, each with T4's room 1.3 to 43 GPUs' worth over the estimate, whose
    standard error was 117 to 145 (docs/benchmarks.md)."""
    share = index.pinned_share(name)
    error = SPARE_ERRORS * math.sqrt(share * (1 - share) / max(1.0, index.sample_size()))
    return index.type_room[name] > (share + error) * index.free_room()


def counts_empty(index: RoomIndex, total: int, request: int) -> bool:
    """Whether `type_left` counts a type's empty GPUs (of `total` bytes) for `request`."""
    return bool(index.pins()) and (request >= total or bool(index.slot_count(total, total)))
