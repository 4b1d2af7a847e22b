"""One GPU worker process: its GPUs, its lease in the registry, its keeper and its models.

`GpuWorker` is what a Celery pool child of a GPU worker runs (`tasks.serving.gpu` binds it to
Celery): it registers the process's GPUs under a heartbeat lease that reports what the
process holds, starts the keeper that follows the ledger, and serves calls on HOT
replicas. It owns `devices` in the ledger, but may load onto any GPU of its host (`visible`):
a split model's shards, or a warm copy restored where the plan says.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from placement.catalog.catalog import ModelSpec
from placement.config import DEFAULT_WORKER_LEASE_MS
from placement.ledger.registry import Registry
from worker.devices import Device
from worker.keeper import Keeper
from worker.lifecycle import WorkerLease, make_worker_id
from worker.residency import ResidencyManager
from worker.session import Session, SessionFeed

__all__ = ["GpuWorker", "Served"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Served:
    """One call's answer, with where it ran and what it waited for."""

    outputs: dict[str, Any]
    gpus: list[str]  # the ledger GPU ids of the copy that ran it
    load_ms: float  # waiting for the replica to be loaded or restored here
    compute_ms: float  # its forward pass, shared by `batch` calls
    batch: int = 1
    first_token_ms: float | None = None  # a generating call: until its first token
    inter_token_ms: float | None = None  # and the mean gap between its later tokens
    join_ms: float | None = None  # and from reaching its engine's process to its first step
    prefill_wait_ms: float | None = None  # and from reaching its engine to its prefill


class GpuWorker:
    """This process's GPUs, lease, keeper and resident models."""

    def __init__(
        self,
        registry: Registry,
        devices: list[Device],
        visible: list[Device],
        host: str,
        queue: str,
        *,
        spec_of: Callable[[str], ModelSpec],
        warm_budget: int,
        lease_ms: int = DEFAULT_WORKER_LEASE_MS,
        lineage: str = "",
        whole_pass_errors: tuple[type[BaseException], ...] = (),
        threads: int = 0,
        graphs: bool = True,
    ) -> None:
        self.registry = registry
        self.devices = devices
        self.host = host
        self.queue = queue
        self.worker_id = make_worker_id(host, devices)
        self.manager = ResidencyManager(
            visible, host, registry=registry, whole_pass_errors=whole_pass_errors,
            threads=threads, graphs=graphs,
            # this process's share of the host's warm cache, as the GPUs it owns of the host's
            arena_bytes=warm_budget * len(devices) // max(len(visible), 1),
            publish=len(devices) < len(visible),  # other workers of the host may read copies
        )  # fmt: skip
        self.keeper = Keeper(registry, self.manager, self.worker_id, spec_of)
        self.lease = WorkerLease(
            registry,
            self.worker_id,
            host,
            queue,
            devices,
            warm_budget=warm_budget,
            lease_ms=lease_ms,
            on_lost=self.keeper.lease_lost,
            lineage=lineage,
            report=self.manager.holdings,
            contexts=self.manager.contexts,
            pinned=self.manager.pinned_bytes,
        )

    def start(self) -> None:
        """Register (raises `GpuOwnedError` when another fleet owns the GPUs, `RegistryError`
        when Redis is unreachable), then start following the ledger."""
        self.lease.start()
        self.keeper.start()
        log.info("worker %s owns %s (queue %s)", self.worker_id, self.lease.gpu_ids, self.queue)

    def serve(self, replica: str, epoch: int, inputs: object, params: object | None) -> Served:
        """Run one call on `replica` as placed in `epoch` (0: as placed now).

        Waits while the keeper loads or restores it here; raises `EvictedError` when the
        ledger places it elsewhere (the call must be routed again).
        """
        load_ms, epoch = self.keeper.ensure(replica, epoch)
        start = time.perf_counter()
        outputs, gpus = self.manager.calls.run(replica, inputs, params, epoch)
        return Served(outputs, gpus, load_ms, (time.perf_counter() - start) * 1000)

    def serve_batch(
        self, replica: str, epoch: int, requests: Sequence[tuple[object, object | None]]
    ) -> list[Served | BaseException]:
        """Run calls bound for one replica together (`Calls.run_batch`): each
        call's answer, or the error that fails it alone, in order. An `EvictedError` fails
        them all: each is routed again."""
        try:
            load_ms, epoch = self.keeper.ensure(replica, epoch)
            ran, gpus = self.manager.calls.run_batch(replica, requests, epoch)
        except Exception as exc:
            return [exc] * len(requests)
        return [
            r.error
            if r.error is not None
            else Served(r.outputs, gpus, load_ms, r.compute_ms, r.batch)
            for r in ran
        ]

    def serve_session(self, feed: SessionFeed) -> None:
        """Run the calls `feed` brings, on any of this process's replicas, generations a
        step at a time beside everything else, until it has no more (`worker.session`)."""
        Session(self.manager.calls, self.keeper, feed).run()

    def stop(self) -> None:
        """Stop following the ledger, release every GPU and replica, drop the models."""
        self.keeper.stop()
        self.lease.stop()
        self.manager.drop_all()
