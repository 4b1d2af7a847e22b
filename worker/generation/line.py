"""The order an engine's waiting sequences are admitted in: start-time fair queueing
(Goyal et al., SIGCOMM 1996) over holders, and over calls within a tenant.

A sequence's holder (`Sequence_.holder`) is its tenant, or its call where it has none
(`worker.generation.turns` shares rows between the same holders). Each holder is a flow
of the top level, weighed by its weight, a sequence's cost its reach: a holder's next
sequence starts at the engine's virtual time (the start tag of the last sequence
admitted) or at its holder's last finish, whichever is later, and finishes its reach
over the holder's weight after that. Waiting sequences are admitted in the order of
their start tags (ties: the first added).

Within a tenant, its calls are flows of their own (equal weights), ordered by a second
fair queue with the tenant's own virtual time. The tenant's top-level start tags go to
its sequences in that order: its next admission is its turn among holders, and which of
its sequences takes it is its calls' turn among themselves. Without the second level, a
tenant's burst of 400 one-prompt calls were 400 flows of the top level, all starting at
the virtual time, so another tenant's call added behind them waited for every one of
them that reached the engine first (210 ms of a 2.7 s burst, issue 73); with one flow per
tenant, that call starts at the next admission. Calls of no tenant keep one flow each, as
before: a call of 64 prompts gets its share of rows, not all of them ahead of a call that
arrives after it.

Sequences handed a row (`RowTurns.handed`) head the line out of this order, which they do
not move on. The arithmetic is that of the worker's held calls (`placement.rules.
fairness`); here a flow is forgotten once none of it waits (it starts at the virtual time
when it comes back, banking nothing), since an engine sees calls come and go by the
thousand.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field

from worker.generation.sequence import Sequence_


@dataclass
class _Tenant:
    """A tenant's second level: its waiting sequences in their calls' fair order, that
    order's virtual time and its calls' last finishes, and its own last finish at the top
    level (its last admission's)."""

    line: list[Sequence_] = field(default_factory=list)
    virtual: float = 0.0
    finishes: dict[Hashable, tuple[float, int]] = field(default_factory=dict)
    finish: float = 0.0


class FairLine:
    """The tags of an engine's waiting sequences (see the module). The engine keeps the
    line itself (`Engine.waiting`) and tells this what joins and leaves it; `settle`
    puts it in order."""

    def __init__(self) -> None:
        self.virtual = 0.0  # the start tag of the last sequence admitted in its turn
        self._finishes: dict[Hashable, tuple[float, int]] = {}  # holder -> last finish, waiting
        self._tenants: dict[Hashable, _Tenant] = {}
        self._order = itertools.count()
        self._stale: set[Hashable] = set()  # tenants whose sequences' top-level tags are stale

    @property
    def empty(self) -> bool:
        """Whether no flow has a sequence counted as waiting."""
        return not self._finishes and not any(t.finishes for t in self._tenants.values())

    def add(self, waiting: list[Sequence_], sequence: Sequence_) -> None:
        """Tag a sequence and put it in the line `waiting` (a tenant's, in place at the next
        `settle`)."""
        order = next(self._order)
        if sequence.owner is None:
            start = _flow_start(self._finishes, sequence.holder, self.virtual, sequence.reach)
            sequence.tag = (start, order)
            bisect.insort(waiting, sequence, key=lambda s: s.tag)
            return
        tenant = self._tenants.setdefault(sequence.owner, _Tenant())
        start = _flow_start(tenant.finishes, sequence.flow, tenant.virtual, sequence.reach)
        sequence.inner = (start, order)
        self._in_tenant_line(tenant, sequence)
        waiting.append(sequence)

    def requeue(self, waiting: list[Sequence_], sequence: Sequence_) -> None:
        """Put a preempted sequence back in the line with its tags, ahead of every one that
        arrived after it."""
        if sequence.owner is None:
            _requeued(self._finishes, sequence.holder, sequence.tag[0] + sequence.reach)
            bisect.insort(waiting, sequence, key=lambda s: s.tag)
            return
        tenant = self._tenants.setdefault(sequence.owner, _Tenant())
        _requeued(tenant.finishes, sequence.flow, sequence.inner[0] + sequence.reach)
        self._in_tenant_line(tenant, sequence)
        waiting.append(sequence)

    def _in_tenant_line(self, tenant: _Tenant, sequence: Sequence_) -> None:
        bisect.insort(tenant.line, sequence, key=lambda s: s.inner)
        self._stale.add(sequence.owner)

    def leave(self, sequence: Sequence_, *, in_turn: bool) -> None:
        """A sequence left the line for the batch: `in_turn`, in its fair order (the engine's
        virtual time moves on to it), or out of it (handed a row)."""
        if in_turn:
            self.virtual = max(self.virtual, sequence.tag[0])
        self.drop(sequence)
        if sequence.owner is not None and sequence.owner in self._tenants:
            tenant = self._tenants[sequence.owner]
            tenant.virtual = max(tenant.virtual, sequence.inner[0])
            tenant.finish = max(tenant.finish, sequence.tag[0] + sequence.reach / sequence.weight)

    def drop(self, sequence: Sequence_) -> None:
        """A sequence left the line (cancelled, or `leave`): its flow's entry goes once
        none of it waits."""
        if sequence.owner is None:
            _dequeued(self._finishes, sequence.holder)
            return
        tenant = self._tenants.get(sequence.owner)
        if tenant is None:
            return
        _dequeued(tenant.finishes, sequence.flow)
        if tenant.line and tenant.line[0] is sequence:  # admitted: its tenant's first
            del tenant.line[0]
        else:
            tenant.line = [s for s in tenant.line if s is not sequence]
        self._stale.add(sequence.owner)

    def settle(self, waiting: list[Sequence_], first: set[Sequence_]) -> None:
        """Give each tenant whose line changed its top-level start tags again, in its calls'
        order, from the engine's virtual time or its last finish, and sort `waiting` by
        them (those of `first`, handed a row, ahead of all). A tenant with none waiting
        is forgotten, as a flow of the top level is."""
        if not self._stale:
            return
        for owner in self._stale:
            tenant = self._tenants.get(owner)
            if tenant is None:
                continue
            if not tenant.line:
                del self._tenants[owner]
                continue
            start = max(self.virtual, tenant.finish)
            for sequence in tenant.line:
                sequence.tag = (start, sequence.inner[1])
                start += sequence.reach / sequence.weight
        self._stale.clear()
        waiting.sort(key=lambda s: (s not in first, s.tag))


def _flow_start(
    finishes: dict[Hashable, tuple[float, int]], flow: Hashable, virtual: float, cost: float
) -> float:
    """The start tag of a flow's next sequence (of `cost`), counted as waiting."""
    last, queued = finishes.get(flow, (0.0, 0))
    start = max(virtual, last)
    finishes[flow] = (start + cost, queued + 1)
    return start


def _requeued(finishes: dict[Hashable, tuple[float, int]], flow: Hashable, finish: float) -> None:
    last, queued = finishes.get(flow, (0.0, 0))
    finishes[flow] = (max(last, finish), queued + 1)


def _dequeued(finishes: dict[Hashable, tuple[float, int]], flow: Hashable) -> None:
    last, queued = finishes[flow]
    if queued > 1:
        finishes[flow] = (last, queued - 1)
    else:
        del finishes[flow]


__all__ = ["FairLine"]
