"""The order an engine's waiting sequences are admitted in: start-time fair queueing
(Goyal et al., SIGCOMM 1996) over tenants, and over calls within each tenant.

Each tenant is a flow of the top level, weighed by its weight; calls of no tenant are
the default tenant's, of weight 1, as at the worker's take (`placement.rules.fairness`). A
sequence's cost is its reach (the KV positions it may hold) over its tenant's weight: a
tenant's next sequence starts at the engine's virtual time (the start tag of the last
sequence admitted in its turn) or at the tenant's last finish, whichever is later.
Waiting sequences are admitted in the order of their start tags (ties: the first added).

Within a tenant, its calls are flows of their own (equal weights), ordered by a second
fair queue with the tenant's own virtual time, by the same rule. The tenant's top-level
start tags go to its sequences in that order: its next admission is its turn among
tenants, and which of its sequences takes it is its calls' turn among themselves. So a
call of 64 prompts gets its share of rows, not all of them ahead of a call of the same
tenant that arrives after it; and a tenant's burst of 400 one-prompt calls is one flow,
so another tenant's call starts at the next admission. (With a flow per call and none per
tenant, the burst's calls were 400 flows all starting at the virtual time, and that call
waited behind every one of them already in the line: 210 ms of a 2.7 s burst, issue 73.)
Without tenants there is one flow at the top, and the calls are ordered by the second
level alone: each call's first sequence at the virtual time, FIFO among one-prompt calls.

A sequence preempted (`requeue`) keeps its tags, its cost having been counted when it was
admitted: it goes ahead of every sequence that arrived after it. Sequences handed a row
(`RowTurns.handed`) head the line out of this order, in the order they were handed, and
do not move the virtual time on. Tenants are remembered (a fleet has few); a call is
forgotten once none of it waits, and starts at its tenant's virtual time when it comes
back, banking nothing.
"""

from __future__ import annotations

import bisect
import itertools
from collections.abc import Hashable
from dataclasses import dataclass, field

from worker.generation.sequence import Sequence_

#: The top-level flow of calls of no tenant.
DEFAULT_TENANT: Hashable = ("default tenant",)


@dataclass
class _Tenant:
    """A tenant's flow: its waiting sequences in its calls' fair order, that order's virtual
    time and its calls' last finishes (while any of a call waits), and the tenant's own
    last finish at the top level."""

    line: list[Sequence_] = field(default_factory=list)
    virtual: float = 0.0
    finishes: dict[Hashable, tuple[float, int]] = field(default_factory=dict)
    finish: float = 0.0


class FairLine:
    """The tags of an engine's waiting sequences (see the module). The engine keeps the
    line itself (`Engine.waiting`) and tells this what joins and leaves it; `settle`
    puts it in order before each step admits."""

    def __init__(self) -> None:
        self.virtual = 0.0  # the start tag of the last sequence admitted in its turn
        self._tenants: dict[Hashable, _Tenant] = {}
        self._order = itertools.count()
        self._stale: set[Hashable] = set()  # tenants whose top-level tags are to be set
        self._kept: set[Sequence_] = set()  # preempted: their tags stand

    @property
    def empty(self) -> bool:
        """Whether no call has a sequence counted as waiting."""
        return not any(t.finishes for t in self._tenants.values())

    def add(self, waiting: list[Sequence_], sequence: Sequence_) -> None:
        """Tag a sequence among its tenant's calls and put it in the line `waiting` (in its
        place at the next `settle`)."""
        tenant = self._tenant(sequence)
        last, queued = tenant.finishes.get(sequence.flow, (0.0, 0))
        start = max(tenant.virtual, last)
        tenant.finishes[sequence.flow] = (start + sequence.reach, queued + 1)
        sequence.inner = (start, next(self._order))
        self._into(tenant, waiting, sequence)

    def requeue(self, waiting: list[Sequence_], sequence: Sequence_) -> None:
        """Put a preempted sequence back in the line, with its tags."""
        tenant = self._tenant(sequence)
        last, queued = tenant.finishes.get(sequence.flow, (0.0, 0))
        tenant.finishes[sequence.flow] = (max(last, sequence.inner[0] + sequence.reach), queued + 1)
        self._kept.add(sequence)
        self._into(tenant, waiting, sequence)

    def leave(self, sequence: Sequence_, *, in_turn: bool) -> None:
        """A sequence left the line for the batch: `in_turn`, in its fair order, or out of
        it (handed a row: the virtual time stays, and its tenant's too unless it was its
        tenant's first)."""
        tenant = self._tenant(sequence)
        first = bool(tenant.line) and tenant.line[0] is sequence
        if in_turn:
            self.virtual = max(self.virtual, sequence.tag[0])
        if in_turn or first:
            tenant.virtual = max(tenant.virtual, sequence.inner[0])
        cost = sequence.reach / sequence.weight
        kept = sequence in self._kept
        if kept:
            pass  # counted when it was first admitted
        elif in_turn or first:
            tenant.finish = max(tenant.finish, sequence.tag[0] + cost)
        else:  # a turn taken ahead of its tenant's own first: its cost, not theirs
            tenant.finish = max(self.virtual, tenant.finish) + cost
        # The head of the line leaving in its turn leaves the others' tags as they are (the
        # next starts where it finishes): nothing to settle, the common case of a step.
        self.drop(sequence, restale=not (in_turn and (first or kept)))

    def drop(self, sequence: Sequence_, *, restale: bool = True) -> None:
        """A sequence left the line (cancelled, or `leave`): its call's entry goes once none
        of it waits, and its tenant's tags are set again at the next `settle` (unless not
        `restale`)."""
        tenant = self._tenant(sequence)
        last, queued = tenant.finishes[sequence.flow]
        if queued > 1:
            tenant.finishes[sequence.flow] = (last, queued - 1)
        else:
            del tenant.finishes[sequence.flow]
        if tenant.line and tenant.line[0] is sequence:  # admitted: its tenant's first
            del tenant.line[0]
        else:
            tenant.line = [s for s in tenant.line if s is not sequence]
        self._kept.discard(sequence)
        if restale:
            self._stale.add(_tenant_of(sequence))

    def settle(self, waiting: list[Sequence_], handed: set[Sequence_]) -> None:
        """Give each tenant whose line changed its top-level start tags, in its calls'
        order, from the engine's virtual time or its last finish (a preempted sequence
        keeps its own), and sort `waiting` by them, behind those `handed` a row (kept in
        their order)."""
        if not self._stale:
            return
        for key in self._stale:
            tenant = self._tenants[key]
            start = max(self.virtual, tenant.finish)
            for sequence in tenant.line:
                if sequence in self._kept:
                    continue
                sequence.tag = (start, sequence.inner[1])
                start += sequence.reach / sequence.weight
        self._stale.clear()
        ahead = [s for s in waiting if s in handed]
        waiting[:] = ahead + sorted((s for s in waiting if s not in handed), key=lambda s: s.tag)

    def _tenant(self, sequence: Sequence_) -> _Tenant:
        return self._tenants.setdefault(_tenant_of(sequence), _Tenant())

    def _into(self, tenant: _Tenant, waiting: list[Sequence_], sequence: Sequence_) -> None:
        bisect.insort(tenant.line, sequence, key=lambda s: s.inner)
        self._stale.add(_tenant_of(sequence))
        waiting.append(sequence)


def _tenant_of(sequence: Sequence_) -> Hashable:
    return sequence.owner if sequence.owner is not None else DEFAULT_TENANT


__all__ = ["DEFAULT_TENANT", "FairLine"]
