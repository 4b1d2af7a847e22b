"""The paged KV cache's tensors, and the cache a model's forward pass sees over them.

`Store` keeps every layer's keys and values as `[slots, heads, head_dim]` tensors, one row
per token slot of the replica's blocks (`worker.generation.blocks`). A forward pass over
some rows is described by a `Pass`: each row's slots of the tokens before this pass (its
past) and of the tokens this pass computes, right-aligned in one `[rows, width]` index, as
a left-padded `generate` batch lays rows out, with padding pointing at the null block. The
model's attention calls `update` on each layer (`PagedLayer`): it writes the pass's new
keys and values into their slots, then gathers every row's slots into a `[rows, heads,
width, head_dim]` view for attention; the attention mask hides the padding.

The gather copies one layer's rows at a time (what a padded batch would hold of that
layer alone), and only for the pass: memory held between steps is the blocks in use. On a
CPU this costs a copy of the rows' keys and values per layer and step; no paged attention
kernel of PyTorch or transformers reads blocks in place there (docs/worker.md).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from worker.generation.blocks import BLOCK_TOKENS, BlockPool, Table

GROWTH = 2  # a full store is reallocated this many times larger, within the budget


class Store:
    """Every layer's key and value slots. Each layer's tensors take their shape and dtype
    from the first keys written to them, and grow by `GROWTH` (within the pool's budget)
    when a pass needs more blocks than they hold; slots keep their numbers."""

    def __init__(self, layers: int, size: int) -> None:
        self.size = size  # tokens a block holds
        self.layers = layers
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.blocks = 0  # blocks every layer will hold by the next pass

    def fit(self, blocks: int, budget: int) -> None:
        """Make the next pass find room for `blocks` blocks (at most `budget`)."""
        if blocks > self.blocks:
            self.blocks = min(budget, max(blocks, self.blocks * GROWTH))

    def layer(self, index: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s key and value slots, grown to `blocks` (`like`: a pass's keys,
        `[rows, heads, tokens, head_dim]`)."""
        pair = []
        for tensors in (self.keys, self.values):
            old = tensors[index]
            slots = self.blocks * self.size
            if old is None or old.shape[0] < slots:
                shape = (slots, like.shape[1], like.shape[3])
                # Not zeroed: a slot is written before any row reads it, except the null
                # block's, which padding reads.
                new = torch.empty(shape, dtype=like.dtype, device=like.device)
                if old is None:
                    new[: self.size].zero_()
                else:
                    new[: old.shape[0]] = old
                tensors[index] = new
            pair.append(tensors[index])
        return pair[0], pair[1]  # type: ignore[return-value]

    def nbytes(self) -> int:
        """Bytes the store's tensors take."""
        held = [t for t in (*self.keys, *self.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)


@dataclass
class Pass:
    """One forward pass's rows, as its cache layers read and write them.

    `index`: `[rows, past + new]` slots, right-aligned, padding at the null block's first
    slot; `past`: the columns before this pass's tokens; `written`: the positions (in the
    `[rows * new]` order of the pass's tokens) that are real tokens, or None when all are;
    `slots`: the slots they are written to, in that order."""

    index: torch.Tensor
    past: int
    written: torch.Tensor | None
    slots: torch.Tensor


class PagedLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' class
    """One layer of a pass over the store (see the module)."""

    def __init__(self, store: Store, layer: int, current: list[Pass]) -> None:
        super().__init__()  # type: ignore[no-untyped-call]
        self.is_initialized = True
        self._store, self._layer, self._current = store, layer, current

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the pass's new keys and values to their slots; every row's, gathered."""
        now = self._current[0]
        rows, heads, new, dim = key_states.shape
        keys, values = self._store.layer(self._layer, key_states)
        gathered = []
        for states, store in ((key_states, keys), (value_states, values)):
            flat = states.transpose(1, 2).reshape(rows * new, heads, dim)
            if now.written is not None:
                flat = flat.index_select(0, now.written)
            store.index_copy_(0, now.slots, flat)
            width = now.index.shape[1]
            picked = store.index_select(0, now.index.reshape(-1))
            gathered.append(picked.view(rows, width, heads, dim).transpose(1, 2))
        return gathered[0], gathered[1]

    def get_seq_length(self) -> int:
        return self._current[0].past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._current[0].past + query_length, 0


class PagedCache:
    """The cache object a forward pass gets: a `DynamicCache` whose layers read and write
    the store through the pass `set` names."""

    def __init__(self, store: Store) -> None:
        self._current: list[Pass] = []
        self.cache = DynamicCache()
        self.cache.layers = [PagedLayer(store, i, self._current) for i in range(store.layers)]
        self.cache.layer_class_to_replicate = None

    def set(self, forward: Pass) -> DynamicCache:
        """The cache for `forward`."""
        self._current[:] = [forward]
        return self.cache


class Paged:
    """A replica's KV blocks and their store: kept while the replica is resident, so that
    cached prefixes outlive the engine that made them (`worker.residency`)."""

    def __init__(self, budget_tokens: int, layers: int, size: int = BLOCK_TOKENS) -> None:
        # The budget's whole blocks, the null block among them (at least one besides it).
        self.pool = BlockPool(max(1, budget_tokens // size - 1), size)
        self.store = Store(layers, size)
        self.cache = PagedCache(self.store)

    @classmethod
    def for_model(cls, model: Any, budget_tokens: int) -> Paged:
        """Blocks for `model`'s layers within `budget_tokens` tokens."""
        layers = len(DynamicCache(config=model.config).layers)
        return cls(budget_tokens, layers)

    def slots(self, table: Table, start: int, end: int) -> torch.Tensor:
        """The slots of `table`'s tokens `[start, end)`."""
        size = self.pool.size
        positions = torch.arange(start, end)
        owners = torch.tensor(table.blocks, dtype=torch.long)[positions // size]
        return owners * size + positions % size

    def ready(self) -> None:
        """Make the store hold every block the pool has handed out, before a pass."""
        self.store.fit(self.pool.allocated, self.pool.budget)

    def stats(self) -> dict[str, float]:
        """The pool's counts and hit rate, and the bytes the store holds."""
        return {**self.pool.stats(), "kv_bytes": self.store.nbytes()}


__all__ = ["Paged", "GROWTH", "Pass", "PagedCache", "PagedLayer", "Store"]
