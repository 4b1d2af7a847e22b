"""Fragmentation measured against the live demand: how much room a placement makes useless.

A GPU's free room is *fragmented* for a request when the request cannot use it: a share
of one GPU larger than the room; one whole GPU where the GPU is in use; n whole GPUs of
one host where the GPU is in use or its host has fewer than n empty GPUs. Weighted by how
often each ask comes, that is a host's expected unusable room, and a placement is ranked
by how much it raises it: fragmentation gradient descent (Weng et al., "Beware of
Fragmentation: Scheduling GPU-Sharing Workloads with Fragmentation Gradient Descent",
USENIX ATC'23). The paper takes the asks' frequencies from its trace; here they are the
fleet's own, kept by the room index (`RoomIndex.demand`): every replica the ledger holds
is one draw of the demand, however many GPUs it holds, and one that leaves is no longer
counted, so the distribution follows the mix as it changes, with no window or decay rate
to tune. The request being placed counts as one more draw.

Two choices, each taken from the problem, not from a replay:

* A GPU's room is weighed against the asks that may *use its type*, as a share of them.
  The paper also counts a type's room as fragmented for asks that may not run on it,
  which sends requests that may run anywhere to the types that pinned requests do not
  name, however few GPUs those have: replayed on the trace's `gpuspec25` list, that
  filled the 312 G3 GPUs by 0.15 of the fleet, and a pod only G3 may run found none
  (docs/placement.md). How types share the load is `planning.type_left`'s
  question, asked before this one.
* Asks and room are shares of a GPU (bytes / its size), so GPUs of different sizes
  compare: a share held on a 16 GiB GPU asks as large a share of a 32 GiB one. A replica
  sized in bytes, on a fleet that mixes GPU sizes, counts at its share of the GPU it holds.

Room short of an ask by under `ROUNDING` fits it: shares round down to whole bytes.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from collections.abc import Callable

from placement.units.memory import MiB

ROUNDING = MiB  # less room than this is what rounding to whole bytes leaves

#: What a replica asks, as the room index counts it: the GPU types it allows (its
#: accelerator's patterns, () for any), the size of a GPU it holds, its slot there in bytes,
#: and how many whole GPUs of one host it asks (its width; 1 for a share).
Ask = tuple[tuple[str, ...], int, int, int]


class Demand:
    """The replicas one GPU type could serve, by the share of a GPU each asks: shares kept
    sorted beside their counts, so that how many ask more than some room is a bisection
    and a sum, however the counts change."""

    def __init__(self) -> None:
        self.shares: list[float] = []  # shares of a GPU asked, ascending
        self.counts: list[int] = []  # replicas asking each
        self.single = 0  # replicas that ask one whole GPU
        self.wide: dict[int, int] = {}  # GPUs held by replicas of n >= 2 whole GPUs, by n

    def count(self, ask: Ask, change: int) -> None:
        """Count (`change` > 0) or uncount replicas of `ask`, which this type may serve.
        The room index calls this once per GPU a replica holds, so n calls for a replica
        of n whole GPUs make one draw of the demand (`whole`); a model split into shares
        of n GPUs counts as n shares."""
        _, total, slot, width = ask
        if slot > total - ROUNDING:
            if width == 1:
                self.single += change
                return
            self.wide[width] = self.wide.get(width, 0) + change
            if not self.wide[width]:
                del self.wide[width]
            return
        share = slot / total
        i = bisect_left(self.shares, share)
        if i == len(self.shares) or self.shares[i] != share:
            self.shares.insert(i, share)
            self.counts.insert(i, 0)
        self.counts[i] += change
        if not self.counts[i]:
            del self.shares[i], self.counts[i]

    def above(self, free: int, total: int) -> int:
        """How many replicas ask a larger share of a GPU of `total` bytes than `free`."""
        return sum(self.counts[bisect_right(self.shares, (free + ROUNDING) / total) :])

    @property
    def whole(self) -> float:
        """Replicas that ask whole GPUs, one GPU or more."""
        return self.single + sum(n / width for width, n in self.wide.items())

    @property
    def size(self) -> float:
        return sum(self.counts) + self.whole


class Fragmentation:
    """Each GPU type's demand (`RoomIndex.demand`) with the request counted once more, as
    a planning call weighs it: the request asks `slot` bytes of a GPU of `total` bytes,
    and is weighed only on the types it may use."""

    def __init__(self, demand: Callable[[str], Demand], total: int, slot: int) -> None:
        self._demand = demand
        self._whole = slot > total - ROUNDING  # the request asks whole GPUs
        self._share = slot / total

    def change(self, name: str, total: int, free: int, request: int, empty: int) -> float:
        """How placing `request` bytes on a GPU of type `name`, `total` bytes, `free` free,
        changes its host's expected unusable room (GPUs' worth, over the asks that may use
        the type): positive when more of them can no longer use what is left, negative
        when room none of them could use is taken. A whole-GPU ask can use only an empty
        GPU, so taking one costs what whole-GPU asks could have used.

        An ask of n GPUs of one host can use a host's empty GPUs only where it has n of
        them (`empty`: how many of this GPU's type and size its host has, this one among
        them; 0 when it is in use). Taking an empty GPU where exactly n are left makes the
        other n - 1 useless to it; where fewer than n are left, none of them was of use to
        it, so taking one makes nothing useless."""
        demand = self._demand(name)
        whole = demand.whole + self._whole
        left = free - request
        before = demand.above(free, total) + whole * (free < total)
        after = demand.above(left, total) + whole
        if not self._whole:
            before += self._share > (free + ROUNDING) / total
            after += self._share > (left + ROUNDING) / total
        change = left / total * after - free / total * before
        if demand.wide and free == total:
            for width, n in demand.wide.items():
                if width == empty:
                    change += (empty - 1) * n / width
                elif width > empty:
                    change -= n / width  # this GPU was of no use to them before either
        return change / (demand.size + 1)
