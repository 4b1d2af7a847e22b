"""Which of a worker process's CUDA memory figures measure one load or one pass alone.

torch keeps its allocated and peak statistics per device for the whole process, and a GPU
worker loads, restores, offloads and drops replicas on its keeper's thread while it serves
calls on Celery's (docs/worker.md). A peak read while another of these ran on the devices
holds that one's bytes too: a call would report a neighbour's load as its activations, or
a load would miss the bytes a finished call freed from its baseline. A learned figure only
ever grows in the ledger, so one such reading would oversize the model for good.

So every operation that changes this process's device memory runs inside a `Span`. A span
that starts while no other runs may reset the peak statistics (`Span.alone`); its reading
counts (`Spans.clean`) only if it started alone and no other span has started since.
Simulated GPUs need none of this (their figures are computed, not read), but take spans all
the same, so the bookkeeping runs in every test.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass


@dataclass(frozen=True)
class Span:
    """One operation on the devices: whether it began alone, and its place in the order."""

    alone: bool  # no other span was running when it began: it may reset the peaks
    number: int  # how many spans had begun, this one included


class Spans:
    """The spans of one worker process (thread-safe)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._running = 0
        self._begun = 0

    @contextmanager
    def span(self) -> Iterator[Span]:
        """Run the block as one span."""
        counted = False  # a time limit's exception may land anywhere: undo only what was done
        try:
            with self._lock:
                self._begun += 1
                begun = Span(alone=self._running == 0, number=self._begun)
                self._running += 1
                counted = True
            yield begun
        finally:
            if counted:
                with self._lock:
                    self._running -= 1

    @property
    def begun(self) -> int:
        """How many spans have begun."""
        with self._lock:
            return self._begun

    def clean(self, span: Span) -> bool:
        """True while `span` has had the devices to itself: it began alone, and no other
        span has begun since."""
        with self._lock:
            return span.alone and self._begun == span.number
