"""Whose call runs next when tenants compete: start-time fair queueing, by calls.

Each tenant has a weight. A call arriving from tenant t, of cost c, gets a start tag

    S = max(V, F_t),   and then   F_t = S + c / w_t

where F_t is the finish tag of t's previous call and V (the virtual time) is the start tag
of the call served last. Waiting calls are served in order of start tag, ties in order of
arrival (Goyal, Vin and Cheng, "Start-time Fair Queuing", SIGCOMM '96). So:

- a tenant alone gets every call in arrival order (its tags only grow): a fleet without
  tenants serves exactly as before;
- tenants that all have calls waiting are served in proportion to their weights;
- a tenant that had nothing waiting starts at V: it banks no credit while idle, and its
  call waits behind at most one call of each other tenant's backlog, not the backlog.

A call's cost is the rows it takes in a pass, its inputs (`placement.rules.batching.
input_rows`): weights share rows, so a tenant's calls of 64 strings each wait their turn
against another's calls of one as 64 calls would. A generation is then served a step at a
time, beside the others (`worker.generation`). Pure: the GPU worker's batcher keeps the
order (`tasks.serving.batching`); a consumer's turns between queues count messages
(`FairTurns`: it has not read them yet).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

__all__ = ["FairOrder", "FairTurns"]


class FairOrder:
    """The start tags of one worker's waiting calls (see the module)."""

    def __init__(self) -> None:
        self._finish: dict[str, float] = {}
        self._now = 0.0

    @property
    def now(self) -> float:
        """V: the start tag of the call served last."""
        return self._now

    def peek(self, tenant: str) -> float:
        """The start tag a call of `tenant` would get now (`arrive` without arriving)."""
        return max(self._now, self._finish.get(tenant, 0.0))

    def arrive(self, tenant: str, weight: float, cost: float = 1.0) -> float:
        """The start tag of a call of `tenant` (weight > 0) arriving now, costing `cost`."""
        if not weight > 0:
            raise ValueError(f"a tenant's weight must be above 0, got {weight!r}")
        start = max(self._now, self._finish.get(tenant, 0.0))
        self._finish[tenant] = start + cost / weight
        return start

    def serve(self, tag: float) -> None:
        """A call with start tag `tag` runs now."""
        self._now = max(self._now, tag)


class FairTurns:
    """Which of its queues a consumer takes its next message from, by the same tags: each
    message taken is one call of the tenant whose queue it is (`tenant_of`), and a
    tenant's queues share its turns, in the consumer's own order (kombu's queue cycle:
    `update`, `consume`, `rotate`). The first non-empty queue in `consume`'s order is taken
    from, so the tenant served has the least start tag of those with messages, as in
    `FairOrder`. Queues of one tenant take turns as kombu's round-robin cycle has them
    (the queue just taken from goes last): a consumer without tenants takes as it always
    did, and a backlog on one queue does not hold back another of the same tenant (a
    router's internal queue behind a backlog of calls)."""

    def __init__(self, tenant_of: Callable[[str], str], weight_of: Callable[[str], float]) -> None:
        self.items: list[str] = []
        self._tenant_of = tenant_of
        self._weight_of = weight_of
        self._order = FairOrder()

    def update(self, items: Iterable[str]) -> None:
        self.items[:] = items

    def consume(self, n: int) -> list[str]:
        """The first `n` queues, in the order to take from them."""
        return sorted(self.items, key=lambda q: self._order.peek(self._tenant_of(q)))[:n]

    def rotate(self, last_used: str) -> None:
        """A message was taken from `last_used`: it goes after its tenant's other queues."""
        if last_used in self.items:
            self.items.remove(last_used)
            self.items.append(last_used)
        tenant = self._tenant_of(last_used)
        self._order.serve(self._order.arrive(tenant, self._weight_of(tenant)))

    def shared(self) -> bool:
        """Whether its queues are of more than one tenant."""
        return len({self._tenant_of(q) for q in self.items}) > 1
