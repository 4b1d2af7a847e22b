"""Rows as turns: a call holding many of an engine's rows hands one over to a call that
waits with fewer (`worker.generation.engine.Engine` is a `RowTurns`).

Fair admission (the engine's start-time fair queue) orders the calls that wait; it cannot
help a call that waits while every row is taken, since rows come free only as sequences
end: one caller's 6 calls of 64 prompts x 500 tokens held all 64 rows of a model, and
another caller's 4-token call waited 14 to 27 s for one of them to end (issue 73). So at
each step, while a waiting sequence finds no room (every row taken, or not the KV blocks
it needs), and its call holds at least two rows fewer than the call holding the most,
that call's youngest row (by its place in the fair queue) is preempted and the waiting
sequence goes to the head of the line, to be admitted in the same step. The preempted row
waits again, ahead of everything that arrived after it, as a row preempted for blocks
does (`worker.generation.paging`): its full blocks stay cached, so when it is admitted
again its prefix is read back, not recomputed, unless the cache needed those blocks
meanwhile; it resumes with the same tokens (greedy, or its own seeded generator, which a
preemption does not advance).

Handing over only from a call that holds at least two more rows than the waiting one's
moves rows towards equal shares and never back: each hand-over lowers the sum of the
squares of the calls' row counts, so they end, and a row handed over is not taken back
at the next step. No constant is involved. A call is the unit, as in fair admission:
rows are shared between calls, not weighted by tenant (a tenant's weight orders its
calls before they reach the engine, `placement.rules.fairness`).
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable

from worker.generation import blocks
from worker.generation.paging import PagedRows
from worker.generation.sequence import Sequence_

log = logging.getLogger(__name__)


class RowTurns(PagedRows):
    """The hand-over of a paged engine's rows (see the module): the engine sets every
    attribute below."""

    max_rows: int
    handovers: int  # rows preempted to hand them over (of `preemptions`)
    handed: set[int]  # ids of the sequences heading the line by a hand-over, until admitted

    def _hand_over(self) -> None:
        """Before a step admits (paged): hand rows over to the waiting sequences whose
        calls hold too few (see the module), which then head the line. Nothing happens
        while the line's head fits (admission takes it in its turn); a sequence no
        hand-over can make room for waits as it is, and nothing is preempted for it."""
        if self.kv is None or not self.waiting or not self.rows:
            return
        spare = self.kv.pool.available - self._next_blocks()
        taken = len(self.rows) + len(self.prefilling)
        if taken < self.max_rows and self._blocks_needed(self.waiting[0]) <= spare:
            return
        held = Counter(s.flow for s in (*self.rows, *self.prefilling))
        most = max(held.values())
        first: list[Sequence_] = []
        for sequence in list(self.waiting):
            if held[sequence.flow] + 2 > most:
                continue  # its call holds about as many as any: it waits its turn
            context = sequence.context()
            if self._written_by_another(context, self.kv.pool.match(context, len(context) - 1)):
                continue  # admission would not take it yet: it reads that prefix first
            victims = self._victims(
                held, sequence.flow, self._blocks_needed(sequence) - spare, taken
            )
            if victims is None:
                continue  # it waits as it is
            for victim in victims:
                spare += self._freed_by(victim)
                self._preempt(victim, "its call holds the most rows while another waits")
                self.handovers += 1
                held[victim.flow] -= 1
                taken -= 1
            first.append(sequence)
            held[sequence.flow] += 1
            spare -= self._blocks_needed(sequence)  # its prefix may be a victim's, now cached
            taken += 1
            most = max(held.values())
        if first:
            # They head the line out of their fair order, which they do not move on: the
            # engine's virtual time stays with the sequences admitted in it.
            self.handed |= {id(s) for s in first}
            self.waiting = first + [s for s in self.waiting if id(s) not in self.handed]

    def _victims(
        self, held: Counter[Hashable], flow: Hashable, blocks_short: int, taken: int
    ) -> list[Sequence_] | None:
        """The rows to preempt so that a sequence of call `flow` fits: each the youngest of
        the call holding the most, while it holds at least two more than `flow` does;
        until a row and `blocks_short` blocks are free. None when they never would be."""
        counts = Counter(held)
        chosen: list[Sequence_] = []
        while taken - len(chosen) >= self.max_rows or blocks_short > 0:
            victim = self._youngest_of_most(counts, flow, chosen)
            if victim is None:
                return None
            chosen.append(victim)
            counts[victim.flow] -= 1
            blocks_short -= self._freed_by(victim)
        return chosen

    def _youngest_of_most(
        self, held: Counter[Hashable], flow: Hashable, chosen: list[Sequence_]
    ) -> Sequence_ | None:
        """The youngest running row (not `chosen` already) of the call holding the most
        rows, if that call holds at least two more than `flow`; else None."""
        most = max(held.values(), default=0)
        if most < held[flow] + 2:
            return None
        richest = {f for f, n in held.items() if n == most}
        rows = [s for s in self.rows if s.flow in richest and s not in chosen]
        return max(rows, key=lambda s: s.tag) if rows else None

    def _blocks_needed(self, sequence: Sequence_) -> int:
        """The blocks admitting `sequence` would take now (`PagedRows._blocks_for`)."""
        assert self.kv is not None
        pool = self.kv.pool
        context = sequence.context()
        matched, _ = pool.match(context, len(context) - 1)
        need = blocks.blocks_for(len(context)) - len(matched) + pool.needs(matched)
        return need + (1 if len(context) % pool.size == 0 else 0)

    def _freed_by(self, row: Sequence_) -> int:
        """Blocks a preempted `row` gives back to what is available: those it alone holds
        (keyed ones stay cached, and cached blocks count as available)."""
        assert self.kv is not None and row.table is not None
        return self.kv.pool.sole(row.table.blocks)


__all__ = ["RowTurns"]
