"""One replica a GPU worker process holds, on its GPUs (HOT) or in its CPU memory (WARM):
what `worker.residency` moves and `worker.calls` runs calls on."""

from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any

from placement.catalog.catalog import ModelSpec
from worker.adapters.room import AdapterRoom
from worker.caps import replica_caps
from worker.generation.kv.paged import Paged
from worker.passes import Dims, dims_of
from worker.warm.arena import Region
from worker.warm.sharing import Locator


@dataclass
class Resident:
    """One replica held by this process."""

    replica: str
    spec: ModelSpec
    model: Any
    tokenizer: Any
    slots: dict[str, int]  # ledger GPU id -> reserved bytes; empty while WARM
    accounted: int  # bytes charged on simulated GPUs (a synthetic model's declared size)
    nbytes: int  # its tensors' bytes, measured once at load: moves do not change them
    host_bytes: int  # what its copy takes in host memory once offloaded (pinned: rounded up)
    limit: int = 0  # the ledger's admission limit, when above the reservation
    epoch: int = 0  # the ledger placement it was loaded or restored for
    via: str = ""  # where its load read the weights (`Report.via`)
    header: int = 0  # of `host_bytes`, the room its copy keeps for `worker.warm.sharing`'s header
    region: Region | None = None  # where its warm copy lies in the arena
    shared: Locator | None = None  # where the host's other workers may read its warm copy
    kv: Paged | None = None  # its paged KV cache while HOT: cached prefixes outlive an engine
    adapters: AdapterRoom | None = None  # its LoRA adapters' slots while HOT (same)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def leave_device(self) -> None:
        """Forget what it keeps on its GPUs beside its weights (its KV blocks, its adapters'
        slots): they leave the device with it."""
        self.kv = None
        if self.adapters is not None:
            self.adapters.close()
            self.adapters = None

    @property
    def warm(self) -> bool:
        return not self.slots

    @functools.cached_property
    def dims(self) -> Dims:
        """What its passes scale with (`worker.passes`), read once."""
        return dims_of(self.model)

    @property
    def caps(self) -> dict[str, int]:
        return replica_caps(self.slots, self.limit)
