"""A CPU's working copy of the running rows' keys and values, in buckets of similar length.

On a CPU a decode step that gathered every row's keys from the blocks
(`worker.generation.kv.paged`) would copy them all at every step, so the running rows are kept
in place as well, each new token written beside its slot in the store (which stays the
truth). Kept as one left-padded batch, one long row makes every row as wide as itself: a
burst of 1,000-token prompts joining 32 short streams made each step's attention read
about thirty times the keys the short rows hold, and every join that widened the batch
copied all of it (docs/benchmarks.md, issue 72).

So rows are kept in **buckets**: each a left-padded batch of its own (`slots.SlotLayer`
per model layer, with its own mask), holding rows whose lengths are close enough that its
padded keys are at most `SPREAD` times its rows' own. A joining row goes to the bucket it
pads least within that bound, or starts one. Every row of a bucket grows by one column a
step, so a bucket's padding changes only when rows join or leave, and leaving only cuts
it. A decode step's attention runs once per bucket (`attend`, through the attention the
engine installs, `paged.use_cascade`), each bucket over its own width; one bucket is the
left-padded batch the model's own attention reads, the mask being the engine's.

Only the engine's thread uses it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from worker.generation.kv.slots import SlotLayer

#: A bucket's padded keys are at most this many times its rows' own (a decode step's
#: attention reads at most twice what the rows hold). Chosen as a bound, not tuned.
SPREAD = 2.0

#: Gathers one model layer's keys and values of the slots `index` names (`[rows, width]`).
Gather = Callable[[int, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


class Bucket:
    """Rows of similar length: their order, their mask (`[rows, width]`, True where a row
    has a token, right-aligned) and one `SlotLayer` per model layer laid out the same."""

    def __init__(self, members: list[Any], mask: torch.Tensor, layers: list[SlotLayer]) -> None:
        self.members = members
        self.mask = mask
        self.layers = layers
        self.index: torch.Tensor | None = None  # rows of the engine's batch, this step
        self.latest: list[tuple[torch.Tensor, torch.Tensor]] = []  # this step's, per layer

    @property
    def width(self) -> int:
        return int(self.mask.shape[1])


class Ragged:
    """The working copy (see the module). `split`: False keeps one bucket, for a model
    whose attention is its own (the engine's attention cannot run it per bucket).
    `cache` is what a decode step's model gets."""

    def __init__(
        self, layers: int, budget: int, *, split: bool, write: Callable[..., Any],
        current: list[Any],
    ) -> None:  # fmt: skip
        self.layers = layers
        self.budget = budget  # tokens (rows x columns, over buckets) its buffers may hold
        self.split = split
        self.buckets: list[Bucket] = []
        # What a decode step's model gets: `write` is the store's (the truth), `current`
        # the pass under way (`paged.PagedCache.current`).
        self.cache = DynamicCache()
        self.cache.layers = [RaggedLayer(self, i, write, current) for i in range(layers)]
        self.cache.layer_class_to_replicate = None

    # --- rows coming and going -----------------------------------------------------------

    def join(
        self, members: Sequence[Any], index: torch.Tensor, lengths: Sequence[int],
        gather: Gather, *, ahead: Sequence[int] = (), coming: Sequence[tuple[int, int]] = (),
    ) -> None:  # fmt: skip
        """Add rows: `members` (the engine's sequences, in the batch's order), `index` their
        slots right-aligned (`[rows, width]`), `lengths` their tokens, `ahead` the tokens
        each may still make. `coming`: the sequences waiting to join, each its context's
        length and the tokens of it the store has yet to take. A bucket made now holds
        columns for the tokens its rows may still make and rows for the coming sequences
        whose length it would take (a burst of long prompts then joins its bucket without
        regrowing it; a growth copied 7 to 22 ms of a step), within the budget less what
        the store will take for them all: the store growing into room the copy holds drops
        the copy, and gathering it again cost 25 to 65 ms."""
        chosen: dict[int, list[int]] = {}  # bucket number -> rows of `members`
        for row, number in enumerate(_place(lengths, self._shapes(), split=self.split)):
            chosen.setdefault(number, []).append(row)
        for number, rows in sorted(chosen.items()):
            width = max(lengths[r] for r in rows)
            part = index[torch.tensor(rows, device=index.device)][:, index.shape[1] - width :]
            mask = torch.zeros((len(rows), width), dtype=torch.bool, device=index.device)
            for j, r in enumerate(rows):
                mask[j, width - lengths[r] :] = True
            pairs = [gather(layer, part) for layer in range(self.layers)]
            who = [members[r] for r in rows]
            if number < len(self.buckets):
                self._widen(self.buckets[number], who, mask, pairs)
            else:
                most = max((ahead[r] for r in rows), default=0) if ahead else width
                room = self._room_for(len(rows), width, most, coming)
                layers = [SlotLayer(k, v, self.budget, room) for k, v in pairs]
                self.buckets.append(Bucket(who, mask, layers))
        self.limit(self.budget)

    def _room_for(
        self, rows: int, width: int, ahead: int, coming: Sequence[tuple[int, int]]
    ) -> tuple[int, int]:
        """Rows and columns a new bucket of `rows` x `width` holds, its rows making up to
        `ahead` more tokens (see `join`)."""
        spare = max(rows * width, self.budget - self.capacity() - sum(t for _, t in coming))
        expected = sum(1 for n, _ in coming if max(n, width) <= SPREAD * min(n, width))
        columns = width + ahead if rows * (width + ahead) <= spare else width
        return max(rows, min(rows + expected, spare // columns)), columns

    def tokens_with(self, lengths: Sequence[int]) -> int:
        """Tokens (rows x columns, over buckets) it would hold were rows of `lengths` to
        join it."""
        shapes = self._shapes()
        _place(lengths, shapes, split=self.split)
        return sum(rows * width for rows, width, _ in shapes)

    def _shapes(self) -> list[tuple[int, int, int]]:
        """Each bucket's rows, width and real tokens."""
        return [(len(b.members), b.width, int(b.mask.sum())) for b in self.buckets]

    def _widen(
        self, bucket: Bucket, who: list[Any], mask: torch.Tensor,
        pairs: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> None:  # fmt: skip
        for layer, (keys, values) in zip(bucket.layers, pairs, strict=True):
            layer.join(keys, values)
        have, length = bucket.width, mask.shape[1]
        if length < have:
            mask = torch.nn.functional.pad(mask, (have - length, 0))
        elif have < length:
            bucket.mask = torch.nn.functional.pad(bucket.mask, (length - have, 0))
        bucket.mask = torch.cat([bucket.mask, mask], dim=0)
        bucket.members = bucket.members + who

    def keep(self, members: Sequence[Any]) -> None:
        """Keep only the rows of `members` (the batch's sequences that stay), cutting each
        bucket's columns of padding only."""
        staying = {id(m) for m in members}
        kept = []
        for bucket in self.buckets:
            order = [j for j, m in enumerate(bucket.members) if id(m) in staying]
            if not order:
                continue
            if len(order) < len(bucket.members):
                mask = bucket.mask[torch.tensor(order, device=bucket.mask.device)]
                cut = int(mask.any(dim=0).nonzero()[0])
                for layer in bucket.layers:
                    layer.keep(order, cut)
                bucket.mask = mask[:, cut:]
                bucket.members = [bucket.members[j] for j in order]
            kept.append(bucket)
        self.buckets = kept

    # --- a decode step ---------------------------------------------------------------------

    def plan(self, rows: Sequence[Any]) -> None:
        """Before a decode step over `rows` (the batch's sequences, in order): where each
        bucket's rows are in it, and a column for the step's token in each mask."""
        where = {id(s): i for i, s in enumerate(rows)}
        for bucket in self.buckets:
            positions = [where[id(m)] for m in bucket.members]
            device = bucket.mask.device
            bucket.index = torch.tensor(positions, dtype=torch.long, device=device)
            bucket.mask = torch.nn.functional.pad(bucket.mask, (0, 1), value=True)
            bucket.latest = []

    @property
    def splits(self) -> bool:
        """Whether a step's attention runs per bucket (more than one)."""
        return len(self.buckets) > 1

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step's new column for every row (`[rows, heads, 1, dim]`, the batch's
        order) into each bucket; with one bucket, its padded rows (the model's attention
        reads them with the engine's mask), else the new column (`attend` reads the
        buckets)."""
        for bucket in self.buckets:
            assert bucket.index is not None
            if layer == 0:  # a column more may grow it: within what the others leave
                self._bound(bucket)
            if self.splits:
                mine = keys.index_select(0, bucket.index), values.index_select(0, bucket.index)
            else:
                mine = keys, values
            bucket.latest.append(bucket.layers[layer].update(*mine))
        if self.splits:
            return keys, values
        return self.buckets[0].latest[layer]

    def attend(
        self, module: Any, query: torch.Tensor, fallback: Any, kwargs: dict[str, Any]
    ) -> torch.Tensor:
        """One decode step's attention for layer `module.layer_idx`, bucket by bucket, each
        over its own width (`fallback`: the model's attention over a padded batch).
        Returns `[rows, 1, heads, dim]`, the batch's order."""
        layer = module.layer_idx
        out: torch.Tensor | None = None
        for bucket in self.buckets:
            assert bucket.index is not None
            keys, values = bucket.latest[layer]
            mask = bucket.mask[:, None, None, :]
            part, _ = fallback(
                module, query.index_select(0, bucket.index), keys, values, mask, **kwargs
            )
            if out is None:
                out = part.new_empty((query.shape[0], *part.shape[1:]))
            out.index_copy_(0, bucket.index, part)
        assert out is not None
        return out

    # --- what it holds ------------------------------------------------------------------

    def capacity(self) -> int:
        """Tokens (rows x columns) its buffers hold room for, over buckets."""
        return sum(b.layers[0].capacity() for b in self.buckets)

    def limit(self, budget: int) -> None:
        """Let its buffers grow only within `budget` tokens from now on, over buckets."""
        self.budget = budget
        for bucket in self.buckets:
            self._bound(bucket)

    def _bound(self, bucket: Bucket) -> None:
        """Let `bucket` grow only within the budget the other buckets leave."""
        others = self.capacity() - bucket.layers[0].capacity()
        for layer in bucket.layers:
            layer.budget = max(0, self.budget - others)


def _place(lengths: Sequence[int], shapes: list[tuple[int, int, int]], *, split: bool) -> list[int]:
    """The bucket each row of `lengths` joins, in order: the one it adds least padding to
    within `SPREAD` (any, when not `split`), else a new one. `shapes` (each bucket's rows,
    width and real tokens) is updated as rows are placed; new buckets are appended."""
    placed = []
    for length in lengths:
        best, least = None, 0
        for number, (rows, width, real) in enumerate(shapes):
            padded = (rows + 1) * max(width, length)
            added = padded - rows * width - length
            if (not split or padded <= SPREAD * (real + length)) and (
                best is None or added < least
            ):
                best, least = number, added
        if best is None:
            shapes.append((1, length, length))
            placed.append(len(shapes) - 1)
            continue
        rows, width, real = shapes[best]
        shapes[best] = (rows + 1, max(width, length), real + length)
        placed.append(best)
    return placed


class RaggedLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' class
    """One model layer of a decode step over the working copy: each new token written to
    its slot in the store (the truth) and into its bucket (see the module)."""

    def __init__(
        self, ragged: Ragged, layer: int, write: Callable[..., Any], current: list[Any]
    ) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.is_initialized = True
        self._ragged, self._layer, self._write, self._current = ragged, layer, write, current

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._write(self._layer, key_states, value_states, self._current[0])
        return self._ragged.update(self._layer, key_states, value_states)

    def get_seq_length(self) -> int:
        return int(self._current[0].past)

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return int(self._current[0].past) + query_length, 0


__all__ = ["SPREAD", "Bucket", "Ragged", "RaggedLayer"]
