"""Every step's logits as an engine's sampling is given them: tests compare two runs of
the same calls step for step (padded against unpadded steps, graphed against eager)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch

from worker.generation import sampling


@contextmanager
def recorded_logits() -> Iterator[list[torch.Tensor]]:
    """While open, each step's logits (a float32 copy on the CPU: a graph's buffer is
    written again by the next step) are appended to the list it gives, in order."""
    seen: list[torch.Tensor] = []
    pick = sampling.pick

    def recording(logits: torch.Tensor, *args: Any) -> list[int]:
        seen.append(logits.detach().to("cpu", torch.float32, copy=True))
        return pick(logits, *args)

    sampling.pick = recording
    try:
        yield seen
    finally:
        sampling.pick = pick
