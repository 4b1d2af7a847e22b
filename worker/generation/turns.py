"""Rows as turns: a holder of many of an engine's rows hands one over to a holder that
waits with fewer (`worker.generation.engine.Engine` is a `RowTurns`).

Fair admission (the engine's start-time fair queue) orders the calls that wait; it cannot
help a call that waits while every row is taken, since rows come free only as sequences
end: one caller's 6 calls of 64 prompts x 500 tokens held all 64 rows of a model, and
another caller's 4-token call waited 14 to 27 s for one of them to end (issue 73). So at
each step, while a waiting sequence finds no room (every row taken, or not the KV blocks
it needs), and its holder would still hold no more rows for its weight than the holder
with the most for its weight after one of that holder's rows goes to it, that holder's
youngest row (by its place in the fair queue) is preempted and the waiting sequence goes
to the head of the line, to be admitted in the same step. A holder is a tenant (its
calls share its rows, by the tenant's weight: issue 59's weights apply to rows as they do
to calls), or a call of the default tenant (weight 1). The preempted row
waits again, ahead of everything that arrived after it, as a row preempted for blocks
does (`worker.generation.paging`): its full blocks stay cached, so when it is admitted
again its prefix is read back, not recomputed, unless the cache needed those blocks
meanwhile; it resumes with the same tokens (greedy, or its own seeded generator, which a
preemption does not advance).

Handing over only while the giver keeps at least the taker's rows for weight, `(n - 1) /
w >= (m + 1) / v`, moves rows towards shares in proportion to the weights and never back:
each hand-over lowers the sum over holders of rows squared over weight, so they end, and
a row handed over is not taken back at the next step. With equal weights, that is a
holder with two rows more than the waiting one's. No constant is involved.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Hashable

from worker.generation.paging import PagedRows
from worker.generation.sequence import Sequence_

log = logging.getLogger(__name__)


class Share:
    """Rows held, by holder (a tenant, or a call of the default tenant), and the holders'
    weights: who is owed a row, and by whom."""

    def __init__(
        self, rows: list[Sequence_], prefilling: list[Sequence_], waiting: list[Sequence_]
    ) -> None:
        self.held: Counter[Hashable] = Counter(s.holder for s in (*rows, *prefilling))
        self.weight = {s.holder: max(s.weight, 1e-9) for s in (*rows, *prefilling, *waiting)}

    def richest(self, held: Counter[Hashable]) -> Hashable | None:
        """The holder with the most rows for its weight (ties: any of them)."""
        holders = [h for h, n in held.items() if n > 0]
        return max(holders, key=lambda h: held[h] / self.weight[h], default=None)

    def gives_to(self, richest: Hashable, holder: Hashable, held: Counter[Hashable]) -> bool:
        """Whether `richest` handing one row to `holder` leaves it at least as many rows
        for its weight as `holder` then has: (n - 1) / w >= (m + 1) / v. Each such
        hand-over lowers the sum over holders of rows squared over weight, so they end."""
        after = (held[richest] - 1) / self.weight[richest]
        return richest != holder and after >= (held[holder] + 1) / self.weight[holder]

    def short(self, holder: Hashable) -> bool:
        """Whether some holder would hand `holder` a row (`gives_to`)."""
        richest = self.richest(self.held)
        return richest is not None and self.gives_to(richest, holder, self.held)


class RowTurns(PagedRows):
    """The hand-over of a paged engine's rows (see the module): the engine sets every
    attribute below."""

    max_rows: int
    handovers: int  # rows preempted to hand them over (of `preemptions`)
    handed: set[Sequence_]  # the sequences heading the line by a hand-over, until admitted

    def _hand_over(self) -> None:
        """Before a step admits (paged): hand rows over to the waiting sequences whose
        holders hold too few (see the module), which then head the line. Nothing happens
        while the line's head fits (admission takes it in its turn); a sequence no
        hand-over can make room for waits as it is, and nothing is preempted for it."""
        if self.kv is None or not self.waiting or not self.rows:
            return
        spare = self.kv.pool.available - self._next_blocks()
        taken = len(self.rows) + len(self.prefilling)
        if taken < self.max_rows and self._blocks_needed(self.waiting[0]) <= spare:
            return
        share = Share(self.rows, self.prefilling, self.waiting)
        first: list[Sequence_] = []
        for sequence in list(self.waiting):
            if not share.short(sequence.holder):
                continue  # its holder holds about its share: it waits its turn
            context = sequence.context()
            prefix = self.kv.pool.match(context, len(context) - 1, sequence.salt)
            if self._written_by_another(context, prefix):
                continue  # admission would not take it yet: it reads that prefix first
            short = self._blocks_taken(context, prefix) - spare
            victims = self._victims(share, sequence.holder, short, taken)
            if victims is None:
                continue  # it waits as it is
            for victim in victims:
                spare += self._freed_by(victim)
                self._preempt(victim, "its holder has the most rows for its weight")
                self.handovers += 1
                share.held[victim.holder] -= 1
                taken -= 1
            first.append(sequence)
            share.held[sequence.holder] += 1
            spare -= self._blocks_needed(sequence)  # its prefix may be a victim's, now cached
            taken += 1
        if first:
            # They head the line out of their fair order, which they do not move on: the
            # engine's virtual time stays with the sequences admitted in it.
            # One handed a row before and not admitted yet (its step's prompt tokens ran
            # out, say) keeps its place: only this pass's move to the head.
            self.handed.update(first)
            moved = {id(s) for s in first}
            self.waiting = first + [s for s in self.waiting if id(s) not in moved]

    def _victims(
        self, share: Share, holder: Hashable, blocks_short: int, taken: int
    ) -> list[Sequence_] | None:
        """The rows to preempt so that a sequence of `holder` fits: each the youngest of the
        holder with the most rows for its weight, while the hand-over leaves it at least
        `holder`'s share; until a row and `blocks_short` blocks are free. None when they
        never would be."""
        held = Counter(share.held)
        chosen: list[Sequence_] = []
        while taken - len(chosen) >= self.max_rows or blocks_short > 0:
            richest = share.richest(held)
            if richest is None or not share.gives_to(richest, holder, held):
                return None
            rows = [s for s in self.rows if s.holder == richest and s not in chosen]
            if not rows:
                return None
            chosen.append(max(rows, key=lambda s: s.tag))
            held[richest] -= 1
            blocks_short -= self._freed_by(chosen[-1])
        return chosen

    def _blocks_needed(self, sequence: Sequence_) -> int:
        """The blocks admitting `sequence` would take now (`PagedRows._blocks_taken`)."""
        assert self.kv is not None
        context = sequence.context()
        return self._blocks_taken(
            context, self.kv.pool.match(context, len(context) - 1, sequence.salt)
        )

    def _freed_by(self, row: Sequence_) -> int:
        """Blocks a preempted `row` gives back to what is available: those it alone holds
        (keyed ones stay cached, and cached blocks count as available)."""
        assert self.kv is not None and row.table is not None
        return self.kv.pool.sole(row.table.blocks)


__all__ = ["RowTurns"]
