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

`Learned` keeps what the process reported as each model's learned memory: a load reports
its measured peak, and a later call that needed more reports more.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from placement.catalog.catalog import ModelSpec
from placement.errors import GpufleetError
from placement.ledger.registry import Registry

log = logging.getLogger(__name__)


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


class Learned:
    """The peaks this process reported as models' learned memory, and what each model's
    weights took on the device at its last clean load (`weights`, by model name)."""

    def __init__(self, registry: Registry | None) -> None:
        self.registry = registry
        self.weights: dict[str, int] = {}
        self.reported: dict[str, int] = {}

    def report(self, spec: ModelSpec, peak: int) -> None:
        """Report a load's measured `peak` (`kv_bytes` included) for a catalog model; the
        ledger's figure only grows."""
        if self.registry is None or spec.synthetic:
            return
        self.registry.record_measurement(spec.name, peak)
        self.reported[spec.name] = max(peak, self.reported.get(spec.name, 0))

    def learns(self, spec: ModelSpec) -> bool:
        """Whether a pass of `spec` may report a learned peak: a catalog model whose load
        this process reported."""
        return self.registry is not None and not spec.synthetic and spec.name in self.reported

    def learn_from(self, spec: ModelSpec, extra: int) -> None:
        """Report a larger learned peak when a call needed `extra` bytes beyond the weights
        and more than the last report: a replica placed later (scaled out, or loaded again)
        is sized for the calls seen, not only for the warm-up call the load was measured
        with."""
        if self.registry is None or not self.learns(spec):
            return
        name = spec.name
        peak = self.weights.get(name, 0) + extra + kv_bytes(spec)
        if peak > self.reported[name]:
            self.reported[name] = peak
            try:
                self.registry.record_measurement(name, peak)
            except GpufleetError:
                log.warning("could not report %s's larger peak", name, exc_info=True)


def kv_bytes(spec: ModelSpec) -> int:
    """A generation model's KV-cache budget, in bytes (0 for other models): learned memory
    holds it too."""
    budget = spec.kv_budget()
    return budget.bytes if budget is not None else 0
