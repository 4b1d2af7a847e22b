"""How big a forward pass is, and what follows from it: its work, its activation memory and
the CPU threads it runs on.

A transformer's pass scales with its hidden size and layer count, read once per resident
model (`Dims`; transformers' config attributes are slow to read, tens of microseconds
each on the 2-core test machine), and with the rows and the longest row of its inputs,
bounded by their characters (`token_bound`), which are known before the tokenizer runs.

Threads. Torch's default is every core in every process. A host runs one GPU worker per
GPU, and on simulated GPUs each one's forward passes run on the CPU, so a worker takes an
equal share of the cores (`share`; `GPUFLEET_TORCH_THREADS` or `OMP_NUM_THREADS` set it
instead). Within that share, a pass too small to gain from intra-op threads runs on one
(`for_pass`): its threads only wait for each other, and for cores that the worker's own
Celery process, Redis and the callers need at that moment. On the 2-core test machine a
lone call of a tiny synthetic BERT computed in about 3.7 ms on one thread against 4.4 ms
on two, while a batch of 8 MiniLM calls took 55 ms on two threads against 90 ms on one
(docs/benchmarks.md). On a real GPU the pass runs on the device, and the threads serve
only the host-side work around it.

One thread of a worker process runs torch on several threads: the one that serves calls.
OpenMP (torch's CPU threads) keeps a team for every thread that ran a parallel region on
more than one thread, for as long as that thread lives; once a process holds more OpenMP
threads than it has cores, libgomp spins only briefly at a region's barriers before its
threads sleep ("throttled" spin), and the short shape's 32 calls took about 1.5 times as long.
The keeper's first load ran its warm-up pass on the worker's share of the cores, so its
team stayed: every call after it paid that. So a helper thread (`helper_thread`: the
keeper, whose loads, moves and warm-up passes are its torch work) runs torch on one
thread, and makes no team.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

#: Below this many multiply-adds (estimated, `Dims.work`), a pass runs on one thread: a
#: lone short MiniLM call is about 6e8, a tiny synthetic model's about 2e6.
SMALL_PASS = 50_000_000


@dataclass(frozen=True)
class Dims:
    """What a transformer's pass scales with; 0 where its config does not say."""

    hidden: int
    layers: int
    itemsize: int  # bytes per value of its weights

    @property
    def known(self) -> bool:
        return self.hidden > 0 and self.layers > 0

    def work(self, rows: int, longest: int) -> int:
        """Multiply-adds of a pass over `rows` inputs padded to `longest` tokens (about
        12 x hidden^2 per token and layer)."""
        return rows * longest * self.layers * 12 * self.hidden * self.hidden

    def activation_bytes(self, rows: int, longest: int) -> int:
        """rows x longest x hidden x (layers + 1) x 4 x itemsize: the worker's estimate of a
        pass's activations. Tokens are bounded by characters, so it only errs high. On CUDA
        it only sizes batches: the allocator's cap is what enforces the reservation."""
        return rows * longest * self.hidden * (self.layers + 1) * 4 * self.itemsize


def dims_of(model: Any) -> Dims:
    """`model`'s `Dims`, from its config (BERT's or GPT-2's names) and first weight."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0) or 0
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", 0) or 0
    first = next(iter(model.parameters()), None)
    itemsize = first.element_size() if first is not None else 4
    return Dims(int(hidden), int(layers), int(itemsize))


def token_bound(text: str) -> int:
    """An upper bound of a text's tokens: its characters (at most 512) and two specials."""
    return min(len(text), 512) + 2


def longest_tokens(texts: Sequence[str]) -> int:
    """The longest of `texts` in tokens at most (`token_bound`); 0 for none."""
    return max(map(token_bound, texts), default=0)


def share(configured: int | None, gpus: int, cores: int | None = None) -> int:
    """A GPU worker's threads: `configured` when set, else the cores this process may run
    on split evenly among the host's GPUs (one worker each), at least 1."""
    if configured:
        return configured
    return max(1, (cores or len(os.sched_getaffinity(0)) or 1) // max(gpus, 1))


_helper = threading.local()  # `on`: this thread is a helper (`helper_thread`)


def helper_thread() -> None:
    """Make this thread a helper from now on: its torch work runs on one CPU thread, and
    `threads_here` says 1 on it (see the module). Call it first in the thread's target.

    Torch keeps a thread's count once the thread has run torch, and `set_num_threads` also
    sets the count threads start with: this thread's is read first (fixed from then on),
    and another, short-lived thread puts the starting count back, so only this thread's
    changes."""
    import torch

    _helper.on = True
    starting = torch.get_num_threads()  # this thread's count, fixed from now on
    torch.set_num_threads(1)
    again = threading.Thread(target=torch.set_num_threads, args=(starting,), daemon=True)
    again.start()
    again.join()


def threads_here(threads: int) -> int:
    """The CPU threads torch may run on in this thread: `threads`, or 1 on a helper."""
    return 1 if getattr(_helper, "on", False) else threads


def use_threads(threads: int) -> None:
    """Run this thread's torch on `threads` CPU threads (0: as it is), set only when it
    differs (a pass and an engine's step each call it)."""
    import torch

    if threads and torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def for_pass(threads: int, dims: Dims, texts: Sequence[str]) -> int:
    """The threads one pass over `texts` runs on: 1 when it is small (`SMALL_PASS`), else
    `threads` (and for a model whose size the config does not say); 1 on a helper thread."""
    small = dims.known and dims.work(len(texts), longest_tokens(texts)) < SMALL_PASS
    return 1 if small else threads_here(threads)


def max_positions(config: Any) -> int | None:
    """How many positions a model can embed, when its config says (None: no limit given)."""
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None
