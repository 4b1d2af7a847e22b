"""How many CPU threads torch gets in a GPU worker: a share of the host's cores, and one for a
pass too small to split.

Torch's default is every core in every process. A host runs one GPU worker per GPU, and
on simulated GPUs each one's forward passes run on the CPU, so a worker takes an equal
share of the cores (`GPUFLEET_TORCH_THREADS` or `OMP_NUM_THREADS` set it instead).

Within that share, a pass too small to gain from intra-op threads runs on one: its
threads only wait for each other, and for cores that the worker's own Celery process,
Redis and the callers need at that moment. On this project's 2-core machine a lone call
of a tiny synthetic BERT computed in about 3.7 ms on one thread against 4.4 ms on two,
while a batch of 8 MiniLM calls took 55 ms on two threads against 90 ms on one
(docs/benchmarks.md). On a real GPU the pass runs on the device, and the threads serve
only the host-side work around it.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

#: Below this many multiply-adds (estimated, `pass_work`), a pass runs on one thread: a
#: lone short MiniLM call is about 6e8, a tiny synthetic model's about 2e6.
SMALL_PASS = 50_000_000


def share(configured: int | None, gpus: int, cores: int | None = None) -> int:
    """A GPU worker's threads: `configured` when set, else the host's cores split evenly
    among its GPUs (one worker each), at least 1."""
    if configured:
        return configured
    return max(1, (cores or os.cpu_count() or 1) // max(gpus, 1))


def pass_work(model: Any, rows: int, longest: int) -> int | None:
    """Multiply-adds of a transformer encoder's pass over `rows` inputs padded to `longest`
    tokens (about 12 x hidden^2 per token and layer); None when the config says neither."""
    config = getattr(model, "config", None)
    hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", None)
    layers = getattr(config, "num_hidden_layers", None) or getattr(config, "n_layer", None)
    if not isinstance(hidden, int) or not isinstance(layers, int):
        return None
    return rows * longest * layers * 12 * hidden * hidden


def for_pass(threads: int, model: Any, texts: Sequence[str]) -> int:
    """The threads one pass over `texts` runs on: 1 when it is small (`SMALL_PASS`), else
    `threads`."""
    work = pass_work(model, len(texts), max(map(token_bound, texts), default=0))
    return 1 if work is not None and work < SMALL_PASS else threads


def token_bound(text: str) -> int:
    """An upper bound of a text's tokens: its characters (at most 512) and two specials."""
    return min(len(text), 512) + 2
