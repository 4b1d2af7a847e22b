"""The room a replica keeps for LoRA adapters, and the batched product that applies them.

A base model's replica lays out, once, stacked factors for a fixed number of adapter
slots on its device: per changed module, `A` as `[slots + 1, in, rank]` and `B` as
`[slots + 1, rank, out]`, slot 0 all zeros (a row of the base alone). The room's bytes are
the catalog's `adapter_memory`, charged in the ledger with the replica (`Demand.beside`),
so loading or dropping an adapter never asks the ledger: the room is already the
replica's. This is vLLM's `max_loras` slots and S-LoRA's unified room, kept simple.

Each step of the engine names, per row, the adapter it runs (`rows`). A forward hook on
every changed module then adds `x @ A[slot] @ B[slot]` per row: rows of one adapter (or a
lone one) as two plain products, a mix as two batched products over the gathered slots
(Punica's BGMV, in torch). So rows of many adapters share every step, and no copy of the
base's weights is made. A row of an adapter of lower rank reads zeros past its rank.

Adapters in use (`acquire`d by a running call) stay; the least recently used of the
others leaves when a new one needs a slot. An adapter's factors come from the process's
shelf in host memory (`worker.adapters.reading.Shelf`) or from disk. An adapter in a slot
is not read again while it stays there: files changed in place are served once it leaves.
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch

from placement.errors import AdapterError
from worker.adapters.reading import Read, check_fits, module_dims

log = logging.getLogger(__name__)


class RoomFull(Exception):
    """Every slot holds an adapter in use; the call waits for one to be released."""


class AdapterRoom:
    """One replica's adapter slots on its device (see the module). One thread uses it."""

    def __init__(  # noqa: PLR0917 - what a room is laid out from
        self, model: torch.nn.Module, device: torch.device, memory: int, rank: int,
        targets: Sequence[str], find: Callable[[str], tuple[Read, bool]],
    ) -> None:  # fmt: skip
        dtype = next(model.parameters()).dtype
        dims = {}
        for module in sorted(set(targets)):
            found = module_dims(model, module)
            if found is not None:
                dims[module] = found
        width = dtype.itemsize * rank * sum(i + o for i, o in dims.values())
        self.slots = memory // width if width else 0
        self.rank = rank
        self.targets = frozenset(dims)
        self.memory = memory
        self._model = model
        self._a = {m: torch.zeros(self.slots + 1, i, rank, dtype=dtype, device=device)
                   for m, (i, o) in dims.items()}  # fmt: skip
        self._b = {m: torch.zeros(self.slots + 1, rank, o, dtype=dtype, device=device)
                   for m, (i, o) in dims.items()}  # fmt: skip
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._free = list(range(self.slots, 0, -1))
        self._pins: Counter[str] = Counter()
        self._index: torch.Tensor | None = None  # this pass's slot per row
        self._single: int = 0  # this pass's one slot, when every row has it
        self.device = device
        self._find = find  # an adapter by name: read, and whether it was on the shelf
        self.hits = self.loads = self.evictions = 0
        # an adapter's load into a slot, latest last: from the shelf, and read from disk
        self.load_ms: dict[str, list[float]] = {"shelf": [], "disk": []}
        self._hooks = [
            model.get_submodule(m).register_forward_hook(self._hook(m)) for m in self.targets
        ]

    @property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in (*self._a.values(), *self._b.values()))

    def held(self) -> list[str]:
        """The adapters in its slots, least recently used first."""
        return list(self._slot_of)

    def acquire(self, name: str) -> None:
        """Hold adapter `name` in a slot until `release`: loaded if it is not there, into a
        free slot or the least recently used idle one's. UnknownAdapterError or
        AdapterError when it is not found, or does not fit the base or this room; RoomFull
        when every slot holds an adapter in use."""
        if name in self._slot_of:
            self._slot_of.move_to_end(name)
            self._pins[name] += 1
            self.hits += 1
            return
        started = time.perf_counter()
        adapter, shelved = self._find(name)
        if not self.slots:
            raise AdapterError(
                f"adapter {name!r}: the base keeps no room for adapters of rank {self.rank}"
                " (adapter_memory is below one adapter); raise adapter_memory in the catalog"
            )
        check_fits(adapter, self._model, self.rank)
        outside = sorted(set(adapter.factors) - self.targets)
        if outside:
            raise AdapterError(
                f"adapter {name!r} changes modules this replica keeps no room for ({outside[0]}"
                f"{', ...' if len(outside) > 1 else ''}); it is served once the replica is"
                " placed again"
            )
        slot = self._take_slot()
        for module in self.targets:
            a_stack, b_stack = self._a[module], self._b[module]
            pair = adapter.factors.get(module)
            if pair is None:
                a_stack[slot].zero_()
                b_stack[slot].zero_()
                continue
            a, b = pair
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            a_stack[slot, :, : adapter.rank].copy_(a.T, non_blocking=True)
            b_stack[slot, : adapter.rank, :].copy_(b.T, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        took = self.load_ms["shelf" if shelved else "disk"]
        took.append((time.perf_counter() - started) * 1000)
        del took[:-1024]
        self.loads += 1
        self._slot_of[name] = slot
        self._pins[name] += 1

    def release(self, name: str) -> None:
        """One holder of adapter `name` is done with it; it stays loaded until its slot is
        wanted."""
        self._pins[name] -= 1
        if self._pins[name] <= 0:
            del self._pins[name]

    def _take_slot(self) -> int:
        if self._free:
            return self._free.pop()
        for name in self._slot_of:  # least recently used first
            if not self._pins[name]:
                self.evictions += 1
                return self._slot_of.pop(name)
        raise RoomFull

    @contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within it, the model's passes run row `i` with `adapters[i]` (None: the base)."""
        slots = [self._slot_of[a] if a is not None else 0 for a in adapters]
        if any(slots):
            if len(set(slots)) == 1:
                self._single = slots[0]
            else:
                self._index = torch.tensor(slots, dtype=torch.long, device=self.device)
        try:
            yield
        finally:
            self._index, self._single = None, 0

    def _hook(self, module: str) -> Any:
        a_stack, b_stack = self._a[module], self._b[module]

        def add_product(_: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            if self._single:
                x = args[0]
                return output + (x @ a_stack[self._single]) @ b_stack[self._single]
            if self._index is None:
                return None  # the base alone: its output as it is
            x = args[0]
            index = self._index
            return output + torch.bmm(torch.bmm(x, a_stack[index]), b_stack[index])

        return add_product

    def stats(self) -> dict[str, float]:
        """Its slots, adapters held and in use, and counts of hits, loads and evictions."""
        return {
            "adapter_slots": self.slots,
            "adapters_held": len(self._slot_of),
            "adapters_in_use": len(self._pins),
            "adapter_hits": self.hits,
            "adapter_loads": self.loads,
            "adapter_evictions": self.evictions,
        }

    def close(self) -> None:
        """Take its hooks off the model (its slots leave the device with it)."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []


__all__ = ["AdapterRoom", "RoomFull"]
