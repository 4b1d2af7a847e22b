"""The running batch's KV cache: rows of keys and values written in place, one column a step.

transformers' `DynamicCache` concatenates every layer's whole cache with each new token, so
a decode step copies the batch's cache twice over (read and write) on top of what attention
reads. Here each layer keeps its keys and values in buffers with room to grow
(`SlotLayer`, a `DynamicLayer` to the model), and a step writes one column per row in
place. Rows share columns, right-aligned: a row's prompt ends where every other row's
history ends, and the columns left of a row's first token are padding the attention mask
hides (as in a left-padded `generate` batch). Joining rows, leaving rows and trimming the
padding nobody needs any more are the only copies, and they happen when calls come and go,
not at every step.

Only full-attention layers are kept this way (`supported`); a model with sliding-window or
linear-attention layers runs its rows one at a time (`worker.generation.engine`).
"""

from __future__ import annotations

from typing import Any

import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

GROWTH = 2  # a full buffer is reallocated this many times larger (amortised growth)


def supported(model: Any) -> bool:
    """Whether `model`'s cache is plain full attention in every layer (the cache
    transformers would build for it, without tensors); False when that cannot be told."""
    try:
        layers = DynamicCache(config=model.config).layers
    except Exception:  # a config transformers' cache cannot read
        return False
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


class SlotLayer(DynamicLayer):  # type: ignore[no-untyped-call]  # transformers' class
    """One layer's rows of keys and values, in buffers written in place (see the module).

    Row `r` of the batch is buffer row `r`; the batch's columns are buffer columns
    `[lo, hi)`, so cutting padding on the left moves nothing, and a step writes column `hi`.
    """

    def __init__(
        self, keys: torch.Tensor, values: torch.Tensor, budget: int,
        room: tuple[int, int] | None = None,
    ) -> None:  # fmt: skip
        """`keys`, `values`: the first rows; `room`: rows and columns to hold from the
        start (so rows expected soon join without regrowing), at least theirs."""
        super().__init__()  # type: ignore[no-untyped-call]
        self.budget = budget  # tokens (rows x columns) its buffers may hold
        self.is_initialized = True
        self.device = keys.device
        rows, width = keys.shape[0], keys.shape[2]
        if room is None or (room[0] <= rows and room[1] <= width):
            self._k, self._v = keys.contiguous(), values.contiguous()
        else:
            have = (max(rows, room[0]), max(width, room[1]))
            self._k = keys.new_empty((have[0], keys.shape[1], have[1], keys.shape[3]))
            self._v = values.new_empty((have[0], values.shape[1], have[1], values.shape[3]))
            self._k[:rows, :, :width] = keys
            self._v[:rows, :, :width] = values
        self._rows, self._lo, self._hi = rows, 0, width
        self._expose()

    def _expose(self) -> None:
        self.keys = self._k[: self._rows, :, self._lo : self._hi]
        self.values = self._v[: self._rows, :, self._lo : self._hi]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """A decode step: one new column for every row."""
        new = key_states.shape[2]
        self._room(self._rows, new)
        self._k[: self._rows, :, self._hi : self._hi + new] = key_states
        self._v[: self._rows, :, self._hi : self._hi + new] = value_states
        self._hi += new
        self._expose()
        return self._k[: self._rows, :, self._lo : self._hi], self._v[
            : self._rows, :, self._lo : self._hi
        ]

    def join(self, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Add rows (prefilled, right-aligned at `hi`); the narrower side gets left padding."""
        rows, length = keys.shape[0], keys.shape[2]
        self._room(self._rows + rows, 0, length)
        total, start = self._rows + rows, self._hi - length
        if start < self._lo:  # the batch gets padding on its left
            self._k[: self._rows, :, start : self._lo].zero_()
            self._v[: self._rows, :, start : self._lo].zero_()
            self._lo = start
        self._k[self._rows : total, :, self._lo : start].zero_()
        self._v[self._rows : total, :, self._lo : start].zero_()
        self._k[self._rows : total, :, start : self._hi] = keys
        self._v[self._rows : total, :, start : self._hi] = values
        self._rows = total
        self._expose()

    def keep(self, order: list[int], cut: int) -> None:
        """Keep the rows `order` names (row j becomes the old row order[j]; only moved rows
        are copied) and drop `cut` columns of padding on the left."""
        for target, source in enumerate(order):
            if source != target:
                self._k[target, :, self._lo : self._hi] = self._k[source, :, self._lo : self._hi]
                self._v[target, :, self._lo : self._hi] = self._v[source, :, self._lo : self._hi]
        self._rows = len(order)
        self._lo += cut
        self._expose()

    def _room(self, rows: int, new: int, length: int = 0) -> None:
        """Make the buffers hold `rows` rows, `new` more columns on the right, and `length`
        columns ending at `hi`: compact left, or grow by GROWTH (within the budget: the
        engine never asks for more than it)."""
        width = max(self._hi - self._lo, length) + new
        have_rows, have_width = self._k.shape[0], self._k.shape[2]
        fits = rows <= have_rows and self._hi + new <= have_width and self._hi >= length
        if fits:
            return
        new_width = have_width
        if width > have_width:
            new_width = max(width, min(have_width * GROWTH, self.budget // max(rows, 1)))
        new_rows = have_rows
        if rows > have_rows:
            new_rows = max(rows, min(have_rows * GROWTH, self.budget // new_width))
        # Within the budget: spare rows go first, then spare columns (what is needed,
        # rows x width, fits it: the engine admits no more).
        if new_rows * new_width > self.budget:
            new_rows = max(rows, self.budget // new_width)
        if new_rows * new_width > self.budget:
            new_width = max(width, self.budget // new_rows)
        # Copy the used columns so that they end at `offset`, leaving room left of them.
        used = self._hi - self._lo
        offset = max(used, length)
        shape = (new_rows, self._k.shape[1], new_width, self._k.shape[3])
        # Not zeroed: a column is written (a step, a join) or zeroed (padding) before any
        # row reads it, and zeroing the growth itself cost as much as the copies.
        k = torch.empty(shape, dtype=self._k.dtype, device=self._k.device)
        v = torch.empty(shape, dtype=self._v.dtype, device=self._v.device)
        k[: self._rows, :, offset - used : offset] = self._k[: self._rows, :, self._lo : self._hi]
        v[: self._rows, :, offset - used : offset] = self._v[: self._rows, :, self._lo : self._hi]
        self._k, self._v = k, v
        self._lo, self._hi = offset - used, offset

    def capacity(self) -> int:
        """Tokens (rows x columns) its buffers hold room for."""
        return int(self._k.shape[0] * self._k.shape[2])


def from_prefill(cache: Any, budget: int) -> DynamicCache:
    """A batch cache of `SlotLayer`s holding a prefill's rows, within `budget` tokens."""
    batch = DynamicCache()
    batch.layers = [SlotLayer(layer.keys, layer.values, budget) for layer in cache.layers]
    batch.layer_class_to_replicate = None
    return batch
