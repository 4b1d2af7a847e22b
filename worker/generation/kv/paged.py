"""The paged KV cache's tensors, and the cache a model's forward pass sees over them.

`Store` keeps every layer's keys and values as `[slots, heads, head_dim]` tensors, one row
per token slot of the replica's blocks (`worker.generation.kv.blocks`). A forward pass over
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

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from worker.generation.kv.blocks import BLOCK_TOKENS, BlockPool, Table
from worker.generation.kv.graphs import DecodeGraphs

GROWTH = 2  # a full store is reallocated this many times larger, within the budget


class Store:
    """Every layer's key and value slots. Each layer's tensors take their shape and dtype
    from the first keys written to them, and grow by `GROWTH` (within the pool's budget)
    when a pass needs more blocks than they hold; slots keep their numbers.

    On a CPU the tensors are made the budget's size at once: the OS backs a page only when
    a slot on it is first written, so memory still follows the blocks written, and growing
    never copies the store (which cost a running stream 15 to 30 ms a growth on this VM,
    issue 72). `blocks` stays the count the budget is shared by (`worker.generation.
    paging`: the rest is a CPU working copy's room), and grows only by what a pass needs:
    doubling it would take the copy's room in leaps for nothing. Where the budget's
    address space cannot be had, the store grows as on a GPU."""

    def __init__(self, layers: int, size: int) -> None:
        self.size = size  # tokens a block holds
        self.layers = layers
        self.keys: list[torch.Tensor | None] = [None] * layers
        self.values: list[torch.Tensor | None] = [None] * layers
        self.blocks = 0  # blocks every layer will hold by the next pass
        self.budget = 0  # blocks it may ever hold

    @property
    def reserved(self) -> bool:
        """Whether every tensor holds the whole budget (a CPU's, `_grown`)."""
        tensors = (*self.keys, *self.values)
        whole = self.budget * self.size
        return all(t is not None and t.shape[0] >= whole for t in tensors)

    def fit(self, blocks: int, budget: int) -> None:
        """Make the next pass find room for `blocks` blocks (at most `budget`)."""
        self.budget = budget
        if blocks > self.blocks:
            grown = blocks if self.reserved else max(blocks, self.blocks * GROWTH)
            self.blocks = min(budget, grown)

    def layer(
        self, index: int, keys_like: torch.Tensor, values_like: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s key and value slots, grown to `blocks` (`*_like`: a pass's keys
        and values, `[rows, heads, tokens, head_dim]`; a value's head may differ in size)."""
        pair = []
        for tensors, like in ((self.keys, keys_like), (self.values, values_like)):
            old = tensors[index]
            slots = self.blocks * self.size
            if old is None or old.shape[0] < slots:
                tensors[index] = self._grown(old, slots, like)
            pair.append(tensors[index])
        return pair[0], pair[1]  # type: ignore[return-value]

    def _grown(self, old: torch.Tensor | None, slots: int, like: torch.Tensor) -> torch.Tensor:
        """`old` (or nothing) in a tensor of at least `slots` slots: the budget's on a CPU."""
        shape = (slots, like.shape[1], like.shape[3])
        new = None
        if like.device.type == "cpu" and self.budget * self.size > slots:
            try:
                new = torch.empty((self.budget * self.size, *shape[1:]), dtype=like.dtype)
            except RuntimeError:  # no address space for it: grow as needed instead
                new = None
        if new is None:
            # Not zeroed: a slot is written before any row reads it, except the null
            # block's, which padding reads.
            new = torch.empty(shape, dtype=like.dtype, device=like.device)
        if old is None:
            new[: self.size].zero_()
        else:
            new[: old.shape[0]] = old
        return new

    def grow_now(self) -> tuple[int, ...] | None:
        """Grow every layer's tensors to `blocks` now (a pass would), and return their
        addresses, which a CUDA graph recorded on them reads (`worker.generation.kv.graphs`);
        None while a layer has none (before the first pass)."""
        for index in range(self.layers):
            keys, values = self.keys[index], self.values[index]
            if keys is None or values is None:
                return None
            self.layer(index, keys[:1].unsqueeze(2), values[:1].unsqueeze(2))
        return tuple(t.data_ptr() for t in (*self.keys, *self.values) if t is not None)

    def write(
        self, layer: int, key_states: torch.Tensor, value_states: torch.Tensor, now: Pass
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Write a pass's new keys and values (`[rows, heads, tokens, head_dim]`, those
        `now.written` names) to their slots `now.slots` of layer `layer`; the layer's key
        and value slots."""
        keys, values = self.layer(layer, key_states, value_states)
        for states, slots in ((key_states, keys), (value_states, values)):
            rows, heads, new, dim = states.shape
            flat = states.transpose(1, 2).reshape(rows * new, heads, dim)
            if now.written is not None:
                flat = flat.index_select(0, now.written)
            slots.index_copy_(0, now.slots, flat)
        return keys, values

    def nbytes(self) -> int:
        """Bytes the store's tensors take (on a CPU, the budget's address space, which
        the OS backs as slots are written)."""
        held = [t for t in (*self.keys, *self.values) if t is not None]
        return sum(t.numel() * t.element_size() for t in held)


@dataclass
class Pass:
    """One forward pass's rows, as its cache layers read and write them.

    `index`: `[rows, past + new]` slots, right-aligned, padding at the null block's first
    slot; `past`: the columns before this pass's tokens; `written`: the positions (in the
    `[rows * new]` order of the pass's tokens) that are real tokens, or None when all are;
    `slots`: the slots they are written to, in that order; `prefix`: for a decode step
    whose rows all begin with the same blocks, those blocks' slots (`cascade`): `index` and
    the layers' gathers then hold only what follows them; `ragged`: for a decode step over
    a CPU's working copy (`worker.generation.kv.ragged`), that copy, whose buckets attention
    reads one by one."""

    index: torch.Tensor
    past: int
    written: torch.Tensor | None
    slots: torch.Tensor
    prefix: torch.Tensor | None = None
    ragged: Any = None


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
        keys, values = self._store.write(self._layer, key_states, value_states, now)
        rows, width = now.index.shape
        flat = now.index.reshape(-1)
        gathered = [
            slots.index_select(0, flat).view(rows, width, *slots.shape[1:]).transpose(1, 2)
            for slots in (keys, values)
        ]
        return gathered[0], gathered[1]

    def get_seq_length(self) -> int:
        return self._current[0].past

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self._current[0].past + query_length, 0


class PagedCache:
    """The cache object a forward pass gets: a `DynamicCache` whose layers read and write
    the store through the pass `set` names."""

    def __init__(self, store: Store) -> None:
        self._store = store
        self.current: list[Pass] = []  # the pass under way, which every layer reads
        self.cache = DynamicCache()
        self.cache.layers = [PagedLayer(store, i, self.current) for i in range(store.layers)]
        self.cache.layer_class_to_replicate = None

    def gather(self, layer: int, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `layer`'s keys and values of the slots `index` names, `[rows, kv heads,
        width, head dim]`."""
        keys, values = self._store.keys[layer], self._store.values[layer]
        assert keys is not None and values is not None
        rows, width = index.shape
        flat = index.reshape(-1)
        return tuple(  # type: ignore[return-value]
            t.index_select(0, flat).view(rows, width, *t.shape[1:]).transpose(1, 2).contiguous()
            for t in (keys, values)
        )

    @contextmanager
    def running(self, forward: Pass, copy: DynamicCache | None = None) -> Iterator[DynamicCache]:
        """The cache for `forward` (`copy`, a working copy, when given), which `cascade`
        reads while the model runs it."""
        _active.state = (self._store, forward)
        try:
            self.current[:] = [forward]
            yield copy if copy is not None else self.cache
        finally:
            _active.state = None


# --- attention over a shared prefix ----------------------------------------------------

CASCADE = "gpufleet_cascade"  # the attention implementation `cascade` is registered as
#: What `cascade` may be called with and still be plain scaled-dot-product attention.
_NEUTRAL = frozenset({"scaling", "is_causal", "position_ids", "cache_position", "use_cache"})


class _Active(threading.local):
    state: tuple[Store, Pass] | None = None


_active = _Active()


def use_cascade(model: Any) -> bool:
    """Route `model`'s attention through `cascade` (which falls back to SDPA whenever it
    has no shared prefix to use): only a model on SDPA, whose layers take the attention
    interface; False, and the model unchanged, for any other."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) not in ("sdpa", CASCADE):
        return False
    if getattr(config, "_attn_implementation", None) == CASCADE:
        return True
    AttentionInterface.register(CASCADE, _cascade_or(sdpa_attention_forward))
    AttentionMaskInterface.register(CASCADE, sdpa_mask)
    try:
        model.set_attn_implementation(CASCADE)
    except Exception:  # a model that takes no custom attention keeps its own
        return False
    return True


def _cascade_or(fallback: Any) -> Any:
    def attention(
        module: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
        attention_mask: torch.Tensor | None, **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:  # fmt: skip
        state = _active.state
        forward = state[1] if state is not None else None
        ragged = forward.ragged if forward is not None else None
        if ragged is not None and ragged.splits and query.shape[2] == 1:
            # a decode step over a CPU's working copy: each bucket over its own width
            return ragged.attend(module, query, fallback, kwargs), None
        if forward is None or forward.prefix is None:
            return fallback(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
        store = state[0] if state is not None else None
        assert store is not None
        prefix_keys, prefix_values = store.layer(module.layer_idx, key, value)
        prefix_keys = prefix_keys.index_select(0, forward.prefix)
        prefix_values = prefix_values.index_select(0, forward.prefix)
        extra = [k for k, v in kwargs.items() if k not in _NEUTRAL and not _unset(v)]
        if extra or query.shape[2] != 1:  # not plain attention: the whole rows, gathered
            rows = key.shape[0]
            key = torch.cat([prefix_keys.transpose(0, 1).expand(rows, -1, -1, -1), key], 2)
            value = torch.cat([prefix_values.transpose(0, 1).expand(rows, -1, -1, -1), value], 2)
            return fallback(module, query, key, value, attention_mask, **kwargs)  # type: ignore[no-any-return]
        scaling = kwargs.get("scaling") or query.shape[-1] ** -0.5
        return cascade(query, key, value, prefix_keys, prefix_values, attention_mask, scaling), None

    return attention


def _unset(value: Any) -> bool:
    """Whether an attention argument asks for nothing (None, False or a zero number)."""
    return value is None or (isinstance(value, (bool, int, float)) and not value)


def cascade(  # noqa: PLR0917 - one attention's parts
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
    prefix_keys: torch.Tensor, prefix_values: torch.Tensor,
    mask: torch.Tensor | None, scaling: float,
) -> torch.Tensor:  # fmt: skip
    """One decode step's attention, the shared prefix read once for every row: each row's
    query against the prefix (`[P, kv_heads, dim]`, one matrix product for all rows) and
    against its own keys (`[rows, kv_heads, S, dim]`), one softmax over both (Flash-
    Decoding's merge of partial softmaxes). `mask` covers `[prefix | own]` columns, as the
    model built it (None: nothing hidden). Returns `[rows, 1, heads, dim]`."""
    rows, heads, _, dim = query.shape
    kv_heads, plen = prefix_keys.shape[1], prefix_keys.shape[0]
    out_dim = values.shape[-1]  # a value's head may differ from a key's
    group = heads // kv_heads
    q = query.view(rows, kv_heads, group, dim).float() * scaling
    shared = _by_kv_head(q, prefix_keys.permute(1, 2, 0).float())  # [rows, kv_heads, group, P]
    own = torch.matmul(q, keys.float().transpose(-1, -2))  # [rows, kv_heads, group, S]
    if mask is not None:
        hidden = mask[:, :, -1:, plen:].reshape(rows, 1, 1, -1)
        if hidden.dtype == torch.bool:
            own = own.masked_fill(~hidden, float("-inf"))
        else:
            own = own + hidden.float()
    top = torch.maximum(shared.amax(-1, keepdim=True), own.amax(-1, keepdim=True))
    shared, own = (shared - top).exp(), (own - top).exp()
    total = shared.sum(-1, keepdim=True) + own.sum(-1, keepdim=True)
    out = _by_kv_head(shared, prefix_values.permute(1, 0, 2).float())
    out = (out + torch.matmul(own, values.float())) / total
    return out.reshape(rows, 1, heads, out_dim).to(query.dtype)


def _by_kv_head(each: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
    """Each row's `[rows, kv_heads, group, k]` times the one `[kv_heads, k, n]` all rows
    share, as one matrix product per KV head: `[rows, kv_heads, group, n]`."""
    count, kv_heads, group, k = each.shape
    flat = each.permute(1, 0, 2, 3).reshape(kv_heads, count * group, k)
    return torch.bmm(flat, shared).view(kv_heads, count, group, -1).permute(1, 0, 2, 3)


class Paged:
    """A replica's KV blocks and their store: kept while the replica is resident, so that
    cached prefixes outlive the engine that made them (`worker.residency`)."""

    def __init__(
        self, budget_tokens: int, layers: int, size: int = BLOCK_TOKENS, *, share: bool = True
    ) -> None:
        # The budget's whole blocks, the null block among them (at least one besides it).
        self.pool = BlockPool(max(1, budget_tokens // size - 1), size, share=share)
        self.store = Store(layers, size)
        self.cache = PagedCache(self.store)
        # its decode steps' CUDA graphs (`worker.generation.kv.graphs`), recorded on its store
        self.graphs: DecodeGraphs | None = None

    @classmethod
    def for_model(cls, model: Any, budget_tokens: int, *, share: bool = True) -> Paged:
        """Blocks for `model`'s layers within `budget_tokens` tokens (`share`: prefixes
        are found in cached blocks; off, only to measure what sharing gains)."""
        layers = len(DynamicCache(config=model.config).layers)
        return cls(budget_tokens, layers, share=share)

    def slots(self, table: Table, start: int, end: int) -> torch.Tensor:
        """The slots of `table`'s tokens `[start, end)`."""
        size = self.pool.size
        positions = torch.arange(start, end)
        owners = torch.tensor(table.blocks, dtype=torch.long)[positions // size]
        return owners * size + positions % size

    def ready(self) -> None:
        """Make the store hold every block the pool has handed out, before a pass."""
        self.store.fit(self.pool.allocated, self.pool.budget)


__all__ = [
    "CASCADE",
    "GROWTH",
    "PagedCache",
    "PagedLayer",
    "Paged",
    "Pass",
    "Store",
    "cascade",
    "use_cascade",
]
