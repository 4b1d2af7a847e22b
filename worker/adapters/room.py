"""The room a replica keeps for LoRA adapters, and the batched product that applies them.

A base model's replica lays out, once, stacked factors for a fixed number of adapter
slots: per changed module, on that module's device and in its dtype, `A` as
`[slots + 1, in, rank]` and `B` as `[slots + 1, rank, out]`, slot 0 all zeros (a row of
the base alone). The room's bytes are at most the catalog's `adapter_memory`, charged in
the ledger with the replica (`Demand.beside`), so loading or dropping an adapter never
asks the ledger: the room is already the replica's. This is vLLM's `max_loras` slots and
S-LoRA's unified room, kept simple.

Each step of the engine names, per row, the adapter it runs (`rows`). A forward hook on
every changed module then adds `x @ A[slot] @ B[slot]` per row: rows of one adapter (or a
lone one) as two plain products, a mix as two batched products over the gathered slots
(Punica's BGMV, in torch). So rows of many adapters share every step, and no copy of the
base's weights is made. A row of an adapter of lower rank reads zeros past its rank. A
module fed the batch's tokens flattened row by row (the shared expert of a Qwen2-MoE
block takes `[rows x tokens, in]`) gets them as rows again; one whose tokens cannot be
rows' alike (a routed expert's share of them) fails the step with an `AdapterError`.

Adapters in use (`acquire`d by a running call) stay; the least recently used of the
others leaves when a new one needs a slot. An adapter's factors come from the process's
shelf in host memory (`worker.adapters.reading.Shelf`) or from disk. An adapter in a slot
is not read again while it stays there: files changed in place are served once it leaves,
and rows keep their cached blocks apart by version too (`key_of`).
"""

from __future__ import annotations

import logging
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, cast

import torch

from placement.errors import AdapterError
from worker.adapters.reading import Read, check_fits, module_dims

log = logging.getLogger(__name__)


class RoomFull(Exception):
    """Every slot holds an adapter in use; the call waits for one to be released."""


class AdapterRoom:
    """One replica's adapter slots on its devices (see the module). One thread at a time
    uses it: the engine that holds the replica's lock."""

    def __init__(
        self, model: torch.nn.Module, memory: int, rank: int, targets: Sequence[str],
        *, find: Callable[[str], tuple[Read, bool]], known: Callable[[str], object],
    ) -> None:  # fmt: skip
        laid: dict[str, tuple[int, int, torch.Tensor]] = {}  # in, out, and the weight
        for module in sorted(set(targets)):
            dims = module_dims(model, module)
            if dims is not None:
                laid[module] = (*dims, cast(torch.Tensor, model.get_submodule(module).weight))
        width = sum(w.dtype.itemsize * rank * (i + o) for i, o, w in laid.values())
        # slot 0 (the base's zeros) is laid out too: the room, charged as `memory`, holds
        # one adapter fewer than its bytes would
        self.slots = max(0, memory // width - 1) if width else 0
        self.rank = rank
        self.targets = frozenset(laid)
        self._model = model
        # each module's factors on its own weight's device and dtype (a replica may span
        # GPUs): [slots + 1, in, rank] and [slots + 1, rank, out], slot 0 the base's zeros
        self._a = {m: torch.zeros(self.slots + 1, i, rank, dtype=w.dtype, device=w.device)
                   for m, (i, o, w) in laid.items()}  # fmt: skip
        self._b = {m: torch.zeros(self.slots + 1, rank, o, dtype=w.dtype, device=w.device)
                   for m, (i, o, w) in laid.items()}  # fmt: skip
        self._slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self._keys: dict[str, bytes] = {}  # what each held adapter's cached blocks are keyed by
        self._free = list(range(self.slots, 0, -1))
        self._pins: Counter[str] = Counter()
        self._pass: list[int] = []  # this pass's slot per row (empty: every row the base)
        self._index: dict[torch.device, torch.Tensor] = {}  # the same, on each device
        self._single = 0  # this pass's one slot, when every row has the same
        self._find = find  # an adapter by name: read, and whether it was on the shelf
        self._known = known  # UnknownAdapterError for a name the base does not list
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

    def key_of(self, name: str) -> bytes:
        """Where the block keys of rows of held adapter `name` start: its name and its
        files' stamp, so blocks computed under an earlier version are never read."""
        return self._keys[name]

    def acquire(self, name: str) -> None:
        """Hold adapter `name` in a slot until `release`: loaded if it is not there, into a
        free slot or the least recently used idle one's. RoomFull (before anything is read)
        when every slot holds an adapter in use; UnknownAdapterError or AdapterError when
        it is not found, or does not fit the base or this room."""
        if name in self._slot_of:
            self._slot_of.move_to_end(name)
            self._pins[name] += 1
            self.hits += 1
            return
        if not self.slots:
            raise AdapterError(
                f"adapter {name!r}: the base keeps no room for adapters of rank {self.rank}"
                " (adapter_memory holds no adapter beside the base's slot of zeros); raise"
                " adapter_memory in the catalog"
            )
        self._known(name)  # an unknown name is told at once, not after a wait for a slot
        victim = None  # the idle adapter whose slot it takes, when none is free
        if not self._free:
            victim = next((held for held in self._slot_of if not self._pins[held]), None)
            if victim is None:
                raise RoomFull
        started = time.perf_counter()
        adapter, shelved = self._find(name)
        check_fits(adapter, self._model, self.rank)
        outside = sorted(set(adapter.factors) - self.targets)
        if outside:
            raise AdapterError(
                f"adapter {name!r} changes modules this replica keeps no room for ({outside[0]}"
                f"{', ...' if len(outside) > 1 else ''}); it is served once the replica is"
                " placed again"
            )
        if victim is None:
            slot = self._free.pop()
        else:  # the least recently used that no call holds
            self.evictions += 1
            del self._keys[victim]
            slot = self._slot_of.pop(victim)
        try:
            self._write(slot, adapter)
        except BaseException:
            self._free.append(slot)  # nothing holds it: what it held is gone already
            raise
        where = "shelf" if shelved else "disk"
        took = self.load_ms[where]
        took.append((time.perf_counter() - started) * 1000)
        del took[:-1024]
        self.loads += 1
        self._slot_of[name] = slot
        self._keys[name] = name.encode() + b"\0" + adapter.stamp
        self._pins[name] += 1

    def _write(self, slot: int, adapter: Read) -> None:
        """Copy `adapter`'s factors into `slot` (zeros where it changes nothing, and past
        its rank), its scale folded into B in float32 before B takes the stack's dtype:
        rounded once (to bfloat16, say), not once for B and again for B x scale."""
        for module in self.targets:
            a_stack, b_stack = self._a[module], self._b[module]
            a_stack[slot].zero_()
            b_stack[slot].zero_()
            pair = adapter.factors.get(module)
            if pair is None:
                continue
            a, b = pair
            a_stack[slot, :, : adapter.rank].copy_(a.T)
            b_stack[slot, : adapter.rank, :].copy_(b.T.float() * adapter.scale)

    def release(self, name: str) -> None:
        """One holder of adapter `name` is done with it; it stays loaded until its slot is
        wanted."""
        self._pins[name] -= 1
        if self._pins[name] <= 0:
            del self._pins[name]

    def unpin_all(self) -> None:
        """Forget every holder: a new engine of the replica starts with no call (one that
        failed mid-step may have left its calls' pins)."""
        self._pins.clear()

    @contextmanager
    def rows(self, adapters: Sequence[str | None]) -> Iterator[None]:
        """Within it, the model's passes run row `i` with `adapters[i]` (None: the base)."""
        slots = [self._slot_of[a] if a is not None else 0 for a in adapters]
        self._pass = slots if any(slots) else []
        self._single = slots[0] if slots.count(slots[0]) == len(slots) else 0
        try:
            yield
        finally:
            self._pass, self._index, self._single = [], {}, 0

    def _hook(self, module: str) -> Any:
        a_stack, b_stack = self._a[module], self._b[module]

        def add_product(_: torch.nn.Module, args: tuple[Any, ...], output: Any) -> Any:
            slots = self._pass
            if not slots:
                return None  # the base alone: its output as it is
            x = args[0]
            if self._single:  # one adapter for every row: two plain products
                return output + (x @ a_stack[self._single]) @ b_stack[self._single]
            index = self._index.get(x.device)
            if index is None:
                index = self._index[x.device] = torch.tensor(slots, device=x.device)
            rows = x
            if x.dim() == 2:  # tokens flattened row by row (a MoE's shared expert's input)
                if x.shape[0] % len(slots):
                    raise AdapterError(
                        f"module {module} takes {x.shape[0]} tokens that are not "
                        f"{len(slots)} rows' alike, so its rows' adapters cannot be told "
                        "apart; serve that adapter merged into a model of its own"
                    )
                rows = x.reshape(len(slots), -1, x.shape[-1])
            added = torch.bmm(torch.bmm(rows, a_stack[index]), b_stack[index])
            return output + added.reshape(output.shape)

        return add_product

    def stats(self) -> dict[str, float]:
        """Its slots, adapters held and in use, counts of hits, loads and evictions, and
        the median load into a slot from the shelf and from disk (ms; 0: none yet)."""
        return {
            "adapter_slots": self.slots,
            "adapters_held": len(self._slot_of),
            "adapters_in_use": len(self._pins),
            "adapter_hits": self.hits,
            "adapter_loads": self.loads,
            "adapter_evictions": self.evictions,
            **{
                f"adapter_load_{where}_ms_p50": _median(took)
                for where, took in self.load_ms.items()
            },
        }

    def close(self) -> None:
        """Take its hooks off the model and let its slots go: an engine that outlives the
        replica's stay on the device (a failed call's traceback holding it, say) keeps no
        device memory the ledger no longer charges."""
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
        self._a, self._b, self._index = {}, {}, {}


__all__ = ["AdapterRoom", "RoomFull"]


def _median(values: list[float]) -> float:
    """The median of `values`, rounded to the microsecond (0: none)."""
    return round(sorted(values)[len(values) // 2], 3) if values else 0.0
