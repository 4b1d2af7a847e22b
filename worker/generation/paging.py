"""The engine's paged half (`worker.generation.engine.Engine` is a `PagedRows`): what its
rows do with KV blocks (`worker.generation.kv.blocks`, `worker.generation.kv.paged`).

A sequence is admitted into blocks (its cached prefix held, blocks taken for the rest);
a prefill pass reads each row's cached prefix from its blocks and computes only the rest;
rows join with their slots right-aligned, as a left-padded batch lays them out; a decode
step takes each row's next slot (preempting the youngest row when none is left) and reads
the rows' keys by one of three ways: attention over a prefix every row shares
(`paged.cascade`), a CPU's working copy kept in place in buckets of similar length
(`worker.generation.kv.ragged`), or a gather. See docs/worker.md, "The KV cache, in blocks".
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

import torch

from worker.generation import sampling
from worker.generation.kv import blocks, paged, ragged
from worker.generation.kv.graphs import DecodeGraphs, Inputs
from worker.generation.line import FairLine
from worker.generation.sequence import Sequence_

log = logging.getLogger(__name__)


class PagedRows:
    """The paged methods of an engine: it sets every attribute below (see `Engine`)."""

    model: Any
    device: torch.device
    max_rows: int
    kv: paged.Paged | None
    rows: list[Sequence_]
    waiting: list[Sequence_]
    prefilling: list[Sequence_]
    _pending: dict[bytes, Sequence_]
    preemptions: int
    _slots: torch.Tensor | None
    _mask: torch.Tensor | None
    _seen: torch.Tensor | None
    _copy: ragged.Ragged | None
    _cascade: bool
    _shared: int
    _graphs: DecodeGraphs | None
    adapters: Any
    _columns: sampling.Columns | None
    line: FairLine
    _cache_arg: str
    _last_logits: dict[str, int]

    def _forward_prompts(
        self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache: Any = None
    ) -> Any:
        """The model's pass over left-padded prompts, keeping their cache (in `cache`, the
        paged one, when given)."""
        given = {self._cache_arg: cache} if cache is not None else {}
        return self.model(
            input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
            **given, **self._last_logits,
        )  # fmt: skip

    # --- the paged cache ----------------------------------------------------------------

    def _todo(self, sequence: Sequence_) -> int:
        """Tokens its prefill computes: its context, less what cached blocks hold."""
        held = sequence.table.length if sequence.table is not None else 0
        return len(sequence.prompt) + max(0, len(sequence.tokens) - 1) - held

    def _written_by_another(self, context: list[int], prefix: tuple[list[int], bytes]) -> bool:
        """Whether the next block `context` would compute after its cached `prefix` (a
        `match`) is one a prefill under way is writing: a burst of prompts that begin alike
        computes their common blocks once, and the others read them once they are keyed."""
        assert self.kv is not None
        pool = self.kv.pool
        start = len(prefix[0]) * pool.size
        if not pool.share or start + pool.size > len(context) - 1:
            return False
        return blocks.chain(prefix[1], context[start : start + pool.size]) in self._pending

    def _pend(self, sequence: Sequence_, context: list[int]) -> None:
        """Note the keys of the full blocks an admitted sequence's prefill will write."""
        assert self.kv is not None and sequence.table is not None
        if not self.kv.pool.share:
            return
        size, key = self.kv.pool.size, sequence.table.key
        for start in range(sequence.table.keyed * size, len(context) - size + 1, size):
            key = blocks.chain(key, context[start : start + size])
            self._pending.setdefault(key, sequence)

    def _unpend(self, sequence: Sequence_) -> None:
        """A sequence's prefill ended (done or cancelled): what it wrote is keyed, or never
        will be."""
        if any(s is sequence for s in self._pending.values()):
            self._pending = {k: s for k, s in self._pending.items() if s is not sequence}

    def _next_blocks(self) -> int:
        """Blocks the running rows need for their next token (those whose blocks are full),
        and the prompts being prefilled need for their first (those whose context fills
        its blocks)."""
        assert self.kv is not None
        size = self.kv.pool.size
        rows = sum(1 for s in self.rows if s.table is not None and s.table.length % size == 0)
        return rows + sum(1 for s in self.prefilling if len(s.context()) % size == 0)

    def _blocks_for(
        self, sequence: Sequence_, prefix: tuple[list[int], bytes], spare: int
    ) -> int | None:
        """Admit `sequence` into blocks if what it takes (its context's blocks not in its
        cached `prefix`, a `match`; those of them nobody held; and a block for its next
        token when its last is full) is within `spare`: its table then holds its prefix,
        read from the cache, and room for the rest. What it took of `spare`, or None when
        it does not fit."""
        assert self.kv is not None
        pool = self.kv.pool
        context = sequence.context()
        matched, key = prefix
        whole = blocks.blocks_for(len(context))
        taken = self._blocks_taken(context, prefix)
        if taken > spare:
            return None
        pool.hold(matched)
        reused = len(matched) * pool.size
        table = blocks.Table(list(matched), reused, len(matched), key, reused)
        table.blocks.extend(pool.take() for _ in range(whole - len(matched)))
        sequence.table = table
        if not sequence.resumed:
            pool.counted(len(sequence.prompt), reused)
        return taken

    def _blocks_taken(self, context: list[int], prefix: tuple[list[int], bytes]) -> int:
        """What admitting a sequence of `context`, whose cached prefix is `prefix` (a
        `match`), takes of the blocks available: its context's blocks not in the prefix,
        the prefix's blocks nobody held, and one for its next token when its last is full."""
        assert self.kv is not None
        pool = self.kv.pool
        matched, _ = prefix
        taken = blocks.blocks_for(len(context)) - len(matched) + pool.needs(matched)
        return taken + (1 if len(context) % pool.size == 0 else 0)

    def _forward_paged(self, chunks: list[tuple[Sequence_, int]]) -> Any:
        """The pass over the next `n` uncomputed tokens of each sequence (`chunks`), each
        row reading what it holds already (a cached prefix, its chunks before) from its
        blocks: `[past | new]` columns, each part right-aligned."""
        assert self.kv is not None
        kv = self.kv
        contexts = [s.context() for s, _ in chunks]
        tables = [s.table for s, _ in chunks]
        assert all(t is not None for t in tables)
        past = max(t.length for t in tables if t is not None)
        new = max(n for _, n in chunks)
        rows = len(chunks)
        ids = torch.zeros((rows, new), dtype=torch.long)
        mask = torch.zeros((rows, past + new), dtype=torch.long)
        positions = torch.zeros((rows, new), dtype=torch.long)
        index = torch.zeros((rows, past + new), dtype=torch.long)
        written, slots = [], []
        for row, (context, (_, todo)) in enumerate(zip(contexts, chunks, strict=True)):
            table = tables[row]
            assert table is not None
            held = table.length
            mine = kv.slots(table, 0, held + todo)
            index[row, past - held : past] = mine[:held]
            index[row, past + new - todo :] = mine[held:]
            mask[row, past - held : past] = 1
            mask[row, past + new - todo :] = 1
            ids[row, new - todo :] = torch.tensor(context[held : held + todo])
            positions[row, new - todo :] = torch.arange(held, held + todo)
            written.append(torch.arange(row * new + new - todo, (row + 1) * new))
            slots.append(mine[held:])
        every = torch.cat(written)
        forward = paged.Pass(
            index.to(self.device), past,
            None if every.numel() == rows * new else every.to(self.device),
            torch.cat(slots).to(self.device),
        )  # fmt: skip
        kv.ready()
        if self._copy is not None and not self._copy_fits(0):
            self._copy = None  # the store grew into its room
        with kv.cache.running(forward) as cache:
            out = self._forward_prompts(
                ids.to(self.device), mask.to(self.device), positions.to(self.device), cache
            )
        for (sequence, todo), context in zip(chunks, contexts, strict=True):
            assert sequence.table is not None
            sequence.table.length += todo  # written: a pass that raised wrote nothing
            kv.pool.key_full_blocks(sequence.table, context)
        return out

    def _join_paged(self, sequences: list[Sequence_], seen: torch.Tensor) -> None:
        """Add prefilled rows: each row's slots right-aligned, the narrower side padded on
        the left (padding reads the null block, and the mask hides it)."""
        assert self.kv is not None
        lengths = [s.table.length for s in sequences if s.table is not None]
        width = max(lengths)
        index = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros((len(sequences), width), dtype=torch.long)
        for row, sequence in enumerate(sequences):
            assert sequence.table is not None
            length = sequence.table.length
            index[row, width - length :] = self.kv.slots(sequence.table, 0, length)
            mask[row, width - length :] = 1
        index, mask = index.to(self.device), mask.to(self.device)
        if self._copy is not None:
            if self._copy_fits(self._copy.tokens_with(lengths)):
                self._copy.join(
                    sequences, index, lengths, self.kv.cache.gather, ahead=_ahead(sequences),
                    coming=self._coming(),
                )  # fmt: skip
            else:
                self._copy = None
        if self._slots is None or self._mask is None or self._seen is None:
            self._slots, self._mask, self._seen = index, mask, seen
        else:
            have = self._mask.shape[1]
            if width < have:
                index = torch.nn.functional.pad(index, (have - width, 0))
                mask = torch.nn.functional.pad(mask, (have - width, 0))
            elif have < width:
                self._slots = torch.nn.functional.pad(self._slots, (width - have, 0))
                self._mask = torch.nn.functional.pad(self._mask, (width - have, 0))
            self._slots = torch.cat([self._slots, index], dim=0)
            self._mask = torch.cat([self._mask, mask], dim=0)
            self._seen = torch.cat([self._seen, seen], dim=0)
        self.rows.extend(sequences)
        self._columns = None

    def _grow_rows(self) -> list[Sequence_]:
        """A slot for every row's next token, each a new block when its last is full. When
        no block is left, the youngest row (by its place in the fair queue) of the call
        holding the most rows is preempted (so a row just handed over to a call holding
        few, `worker.generation.turns`, is not the one taken back): its blocks are given
        back (the full ones stay cached) and it waits again, ahead of every sequence that
        arrived after it, to be prefilled with the tokens it made. Returns the rows that
        stay, in order."""
        assert self.kv is not None
        pool = self.kv.pool
        for sequence in list(self.rows):
            table = sequence.table
            if table is None:  # preempted for an older row in this loop
                continue
            while sequence in self.rows and table.length == len(table.blocks) * pool.size:
                try:
                    table.blocks.append(pool.take())
                except blocks.OutOfBlocks:
                    victim = self._youngest_of_richest()
                    self._preempt(victim, "the KV budget's blocks are all in use")
        return self.rows

    def _youngest_of_richest(self) -> Sequence_:
        """The youngest running row of the holder (a tenant, or a call) holding the most
        rows for its weight (counting prompts being prefilled), ties between holders going
        to the youngest row of any of them."""
        held = Counter(s.holder for s in (*self.rows, *self.prefilling))
        most = max(held[s.holder] / s.weight for s in self.rows)
        richest = [s for s in self.rows if held[s.holder] / s.weight >= most]
        return max(richest, key=lambda s: s.tag)

    def _preempt(self, sequence: Sequence_, why: str) -> None:
        """Take a running row out of the batch and queue it again (`_grow_rows`, and
        `worker.generation.turns`), saying `why`."""
        assert self.kv is not None and sequence.table is not None
        log.info("preempted a sequence of %d tokens: %s", sequence.table.length, why)
        self.kv.pool.release(sequence.table.blocks)
        self.preemptions += 1
        sequence.table = None
        sequence.resumed = True
        self._keep_rows([i for i, s in enumerate(self.rows) if s is not sequence])
        self.line.requeue(self.waiting, sequence)

    def _keep_rows(self, keep: list[int]) -> None:
        """Keep the rows `keep` names, in order, and cut the columns of padding only."""
        self._columns = None
        self.rows = [self.rows[i] for i in keep]
        if not keep:
            self._slots = self._mask = self._seen = self._copy = None
            self._shared = 0
            return
        assert self._slots is not None and self._mask is not None and self._seen is not None
        index = torch.tensor(keep, dtype=torch.long, device=self.device)
        mask = self._mask.index_select(0, index)
        cut = int(mask.any(dim=0).nonzero()[0])
        self._mask = mask[:, cut:]
        self._slots = self._slots.index_select(0, index)[:, cut:]
        self._seen = self._seen.index_select(0, index)
        if self._copy is not None:
            self._copy.keep(self.rows)

    def _decode_paged(self, ids: torch.Tensor) -> torch.Tensor:
        """One decode step over the blocks: each row's new token (`ids`) written to its
        next slot; the rows' logits. When every row begins with the same blocks (a shared
        system prompt), attention reads them once for all rows (`paged.cascade`) and
        gathers only what follows them; else in fixed shapes, from a CUDA graph, where the
        engine keeps them (`worker.generation.kv.graphs`)."""
        assert self.kv is not None and self._slots is not None and self._mask is not None
        kv = self.kv
        rows = self.rows
        size = kv.pool.size
        next_slots = []
        for sequence in rows:
            table = sequence.table
            assert table is not None
            next_slots.append(table.blocks[table.length // size] * size + table.length % size)
        new = torch.tensor(next_slots, dtype=torch.long, device=self.device)
        positions = self._mask.sum(dim=1, keepdim=True)
        index = torch.cat([self._slots, new[:, None]], dim=1)
        mask = torch.nn.functional.pad(self._mask, (0, 1), value=1)
        shared = self._shared = self._shared_blocks() if self._cascade else 0
        logits = None if shared else self._decode_graphed(ids, positions, index, mask, new)
        if logits is not None:
            self._slots, self._mask = index, mask
            self._written(rows)
            return logits
        if shared:
            prefix = kv.slots(rows[0].table, 0, shared * size).to(self.device)  # type: ignore[arg-type]
            own = positions[:, 0] - shared * size  # each row's tokens after the prefix
            width = int(own.max())
            columns = torch.arange(width, device=self.device)
            after = (columns[None, :] >= (width - own)[:, None]).long()
            ones = torch.ones((len(rows), 1), dtype=torch.long, device=self.device)
            step_mask = torch.cat([ones.expand(-1, shared * size), after, ones], dim=1)
            step_index = index[:, index.shape[1] - width - 1 :]
            forward = paged.Pass(step_index, shared * size + width, None, new, prefix)
            self._copy = None  # attention reads the prefix once: nothing to gather twice
        else:
            step_mask, forward = mask, paged.Pass(index, self._slots.shape[1], None, new)
        kv.ready()
        copy = None
        if not shared and self._working_copy(positions):
            assert self._copy is not None
            self._copy.plan(rows)
            forward.ragged, copy = self._copy, self._copy.cache
        else:
            self._copy = None
        with kv.cache.running(forward, copy) as cache:
            out = self.model(
                input_ids=ids, attention_mask=step_mask, position_ids=positions,
                use_cache=True, **{self._cache_arg: cache},
            )  # fmt: skip
        self._slots, self._mask = index, mask
        self._written(rows)
        return out.logits[:, -1, :]  # type: ignore[no-any-return]

    def _written(self, rows: list[Sequence_]) -> None:
        """A decode step wrote each row's token: its table grows, a full block is keyed."""
        assert self.kv is not None
        size = self.kv.pool.size
        for sequence in rows:
            table = sequence.table
            assert table is not None
            table.length += 1
            if table.length % size == 0:
                self.kv.pool.key_full_blocks(table, sequence.prompt + sequence.tokens)

    def _decode_graphed(
        self, ids: torch.Tensor, positions: torch.Tensor, index: torch.Tensor,
        mask: torch.Tensor, new: torch.Tensor,
    ) -> torch.Tensor | None:  # fmt: skip
        """The step's logits from its shape's graph (`worker.generation.kv.graphs`), or None where
        this engine keeps none (or a row's adapter changes its pass: a graph records the
        base's, whose adapter hooks add nothing; or the shape's recording failed or ran out
        of memory); `index` and `mask` as the step reads them, `new` the rows' next slots."""
        kept = self._graphs
        if kept is None or any(s.adapter for s in self.rows):
            return None
        assert self.kv is not None
        self.kv.ready()
        addresses = self.kv.store.grow_now()
        if addresses is None:
            return None
        self._copy = None  # the shape's step reads the blocks
        logits = kept.run(ids, positions, index, mask, new, addresses)
        if kept.failed:
            self._graphs = None
        return logits

    def _kept_graphs(self, kv: paged.Paged, rows: int) -> DecodeGraphs | None:
        """The replica's decode graphs (kept with its blocks, on whose store and weights
        they were recorded), made for this engine's steps (made again for an engine of more
        `rows` than they hold: their logits buffer is that size); None once recording
        failed, and for a model split over several devices (a graph records one device's
        stream)."""
        kept = kv.graphs
        if kept is None or kept.device != self.device or (not kept.failed and rows > kept.rows):
            if any(p.device != self.device for p in self.model.parameters()):
                return None
            record = self.device.type == "cuda"
            kept = kv.graphs = DecodeGraphs(self.device, kv.pool.size, rows, record=record)
        kept.use(self._graph_step)  # the shapes still to come are this engine's steps
        return None if kept.failed else kept

    def _graph_step(self, inputs: Inputs) -> torch.Tensor:
        """The model's decode step over a shape's inputs (`worker.generation.kv.graphs`):
        every column read from the store, the 4D mask as given."""
        assert self.kv is not None
        width = inputs.index.shape[1]
        forward = paged.Pass(inputs.index, width - 1, None, inputs.slots)
        with self.kv.cache.running(forward) as cache:
            out = self.model(
                input_ids=inputs.ids, attention_mask=inputs.mask,
                position_ids=inputs.positions, use_cache=True, **{self._cache_arg: cache},
            )  # fmt: skip
        return out.logits[:, -1, :]  # type: ignore[no-any-return]

    def _working_copy(self, positions: torch.Tensor) -> bool:
        """Whether this decode step reads the working copy: the one kept since earlier
        steps, or one gathered now (for the steps to come) from the rows' slots and their
        lengths (`positions`), when either fits its room."""
        assert self.kv is not None and self._slots is not None
        if self._copy is not None:
            return self._copy_fits(0)
        if self.device.type != "cpu":
            return False
        lengths = [int(n) for n in positions[:, 0].tolist()]
        kv = self.kv
        copy = ragged.Ragged(
            kv.store.layers, self._copy_room(), split=self._cascade,
            write=kv.store.write, current=kv.cache.current,
        )  # fmt: skip
        if not self._copy_fits(copy.tokens_with(lengths)):
            return False
        copy.join(
            self.rows, self._slots, lengths, kv.cache.gather, ahead=_ahead(self.rows),
            coming=self._coming(),
        )  # fmt: skip
        self._copy = copy
        return True

    def _hold_back(self) -> None:
        """On a CPU, have the pool hold back from the store's growth, while a cached block
        can be reused instead (`blocks.BlockPool.take`), the room a working copy of the
        batch being built (the rows, the prompts being prefilled, and those first in line
        for the rows left) takes at their reach, or the copy's own room where that is
        more. Else a long-running replica's prefix cache fills the budget and takes the
        copy's room for good (the store never shrinks), and every later step gathers its
        rows' keys. Rows come before prefixes a later call may ask for. Held back too while
        the copy cannot fit (rows whose blocks take over half the budget): room the store
        takes is taken for good, and the next rows' copy needs it. Nothing is held back
        where no copy is kept: on a GPU, and while the rows read a shared prefix once
        (`paged.cascade`). Set once a step, as it admits: every block a step takes comes
        after (admission's, then the rows' next ones)."""
        assert self.kv is not None
        pool = self.kv.pool
        if self.device.type != "cpu" or self._shared:
            pool.held_back = 0
            return
        live = (*self.rows, *self.prefilling)
        line = self.waiting[: max(0, self.max_rows - len(live))]
        reach = sum(s.reach for s in (*live, *line))
        held = self._copy.capacity() if self._copy is not None else 0
        pool.held_back = blocks.blocks_for(max(reach, held), pool.size)

    def _coming(self) -> list[tuple[int, int]]:
        """The sequences waiting or being prefilled: each its context's length, and the
        tokens of it the store has yet to take."""
        return [(len(s.context()), self._todo(s)) for s in (*self.prefilling, *self.waiting)]

    def _copy_room(self) -> int:
        """Tokens of the budget the store has not taken (nor will by its next growth)."""
        assert self.kv is not None
        return (self.kv.pool.budget - self.kv.store.blocks) * self.kv.pool.size

    def _copy_fits(self, tokens: int) -> bool:
        """Whether a working copy fits the budget beside the store (the store's truth kept
        in place as well, `worker.generation.kv.ragged`): `tokens`, what it would hold (after a
        join, or a new copy), and the room its buffers hold already. Only on a CPU, where
        a decode step's gather is a copy the CPU pays for; a GPU gathers at its memory's
        speed. Its buffers may grow only within that room."""
        if self.kv is None or self.device.type != "cpu":
            return False
        room = self._copy_room()
        if tokens > room:
            return False
        if self._copy is not None:
            self._copy.limit(room)
            if self._copy.capacity() > room:
                return False
        return True

    def _shared_blocks(self) -> int:
        """How many whole blocks every running row begins with (the same blocks); none for
        a lone row, which gains nothing from reading its blocks once."""
        assert self.kv is not None
        tables = [s.table for s in self.rows if s.table is not None]
        if len(tables) < 2:
            return 0
        full = min(t.length for t in tables) // self.kv.pool.size  # written in every row
        count = 0
        for column in zip(*(t.blocks[:full] for t in tables), strict=False):
            if any(block != column[0] for block in column):
                break
            count += 1
        return count


def _ahead(sequences: list[Sequence_]) -> list[int]:
    """The tokens each of `sequences` may still make."""
    return [s.options.max_new_tokens - len(s.tokens) for s in sequences]


__all__ = ["PagedRows"]
