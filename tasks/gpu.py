"""The GPU worker's tasks: serve calls, load replicas, and follow the ledger.

One Celery worker per GPU, prefork with concurrency 1: the parent answers control
commands and Flower while the child holds the models. The child registers its GPU
and starts its heartbeat in `worker_process_init` (one Redis call; models load lazily,
on the first call or `gpufleet.load`). Whatever the ledger says about a replica wins:
before each load the worker offloads or drops what the ledger moved away (`sync`).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from celery import Task
from celery.signals import worker_init, worker_process_init, worker_process_shutdown

from placement.errors import (
    ConfigError,
    EvictedError,
    GpufleetError,
    GpuOwnedError,
    RegistryError,
)
from placement.memory import parse_size
from placement.state import Level
from tasks import context
from tasks.app import app
from tasks.calls import Call
from tasks.routing import gpu_queue
from worker.devices import Device, discover
from worker.lifecycle import WorkerLease, default_host, make_worker_id
from worker.residency import ResidencyManager

log = logging.getLogger(__name__)

MAX_HOPS = 3  # re-routes of one call before it fails


class GpuWorker:
    """This process's GPU(s), lease, and resident models."""

    def __init__(self, devices: list[Device], host: str, visible: list[Device]) -> None:
        self.host = host
        self.devices = devices
        self.worker_id = make_worker_id(host, devices)
        self.queue = gpu_queue(host, [d.index for d in devices])
        self.registry = context.registry()
        # It owns `devices` in the ledger, but may load onto any GPU of its host: a split
        # model's shards, or a warm copy it holds, restored where the plan says.
        self.manager = ResidencyManager(visible, host, registry=self.registry)
        self.lost = threading.Event()
        self.lease = WorkerLease(
            self.registry,
            self.worker_id,
            host,
            self.queue,
            devices,
            warm_budget=_warm_budget(),
            lease_ms=int(os.environ.get("GPUFLEET_WORKER_LEASE_MS", "15000")),
            on_lost=self.lost.set,
        )

    def start(self) -> None:
        """Register before taking any call (a few Redis round trips); if the GPU is still
        owned by someone else, keep trying in the background."""
        if self._register():
            return

        def retry() -> None:
            while not self._register():
                time.sleep(1.0)

        threading.Thread(target=retry, name="gpufleet-register", daemon=True).start()

    def _register(self) -> bool:
        try:
            self._reap_predecessors()
            self.lease.start()
        except (GpuOwnedError, RegistryError) as exc:
            log.warning("cannot register yet (%s); retrying", exc)
            return False
        log.info("worker %s owns %s (queue %s)", self.worker_id, self.lease.gpu_ids, self.queue)
        return True

    def _reap_predecessors(self) -> None:
        """A worker that held our GPUs and our queue before us is dead: this process
        replaced it. Release it now instead of waiting out its lease, so calls for its
        replicas are re-routed at once rather than bounced back to this queue."""
        for device in self.devices:
            gpu = self.registry.gpu(device.gpu_id(self.host))
            if gpu and gpu.worker and gpu.worker != self.worker_id and gpu.queue == self.queue:
                log.info("releasing %s, the previous worker on %s", gpu.worker, self.queue)
                self.registry.reap(gpu.worker, force=True)

    def ensure(self, replica: str, model: str) -> float:
        """Make `replica` HOT here as the ledger planned it; return the load time in ms."""
        if self.lost.is_set():
            self.lost.clear()
            self.manager.drop_all()  # the lease lapsed: the ledger already marked them COLD
        held = self.manager.residents.get(replica)
        if held is not None and not held.warm:
            return 0.0
        record = self.registry.deployment(replica)
        if (
            record is None
            or record.worker != self.worker_id
            or record.level
            not in (
                Level.LOADING,
                Level.HOT,
            )
        ):
            raise EvictedError(f"replica {replica} of {model} is not planned on this worker")
        self.sync()
        start = time.perf_counter()
        try:
            if held is not None:
                self.manager.restore(replica, record.gpus, record.limit)
            else:
                self.manager.load(context.catalog().get(model), replica, record.gpus, record.limit)
        except Exception as exc:
            # Give the bytes back: a replica that cannot load must not stay LOADING.
            self.manager.abandon(replica, exc)
            self.registry.evict(replica, to=Level.COLD)
            raise
        if not self.registry.confirm(replica, self.worker_id):
            self.manager.drop(replica)  # evicted while it loaded: route the call again
            raise EvictedError(f"replica {replica} of {model} was evicted while loading")
        return (time.perf_counter() - start) * 1000

    def sync(self) -> None:
        """Offload or drop every replica the ledger no longer keeps HOT on this worker."""
        for replica in list(self.manager.residents):
            warm_here = self.manager.residents[replica].warm
            record = self.registry.deployment(replica)
            if record is None or record.worker != self.worker_id or record.level is Level.COLD:
                self.manager.drop(replica)
            elif record.level is Level.WARM and not warm_here:
                self.manager.offload(replica)

    def stop(self) -> None:
        self.lease.stop()
        self.manager.drop_all()


class _Process:
    """The one GpuWorker of this pool child, made by `worker_process_init`."""

    worker: GpuWorker | None = None


_process = _Process()


def this_worker() -> GpuWorker:
    if _process.worker is None:
        raise RuntimeError("not a GPU worker process: start it with GPUFLEET_ROLE=gpu")
    return _process.worker


def serve(task: Task, call: Call) -> dict[str, Any]:
    """Run one call on its replica here; if the replica left this worker, route it again."""
    worker = this_worker()
    started = int(time.time() * 1000)
    try:
        load_ms = worker.ensure(call.replica, call.model)
        compute_start = time.perf_counter()
        outputs = worker.manager.infer(call.replica, call.inputs, call.params)
        compute_ms = (time.perf_counter() - compute_start) * 1000
    except EvictedError:
        if call.hops >= MAX_HOPS:
            raise
        log.info("replica %s left; routing the call for %s again", call.replica, call.model)
        raise task.replace(call.rerouted()) from None
    finally:
        if call.lease is not None:
            try:
                worker.registry.finish(call.lease)
            except GpufleetError:  # the lease expires on its own; the answer stands
                log.warning("could not end lease %s", call.lease.id, exc_info=True)
    resident = worker.manager.residents[call.replica]
    return {
        "model": call.model,
        "replica": call.replica,
        "gpus": sorted(resident.slots),
        "worker": worker.worker_id,
        "cache": call.cache,
        "outputs": outputs,
        "timings_ms": {
            "queue": max(0, started - call.sent_ms),
            "load": round(load_ms, 3),
            "compute": round(compute_ms, 3),
        },
    }


@app.task(name="gpufleet.run", bind=True)
def run(self: Task, call: dict[str, Any]) -> dict[str, Any]:
    """A call the router handed to this worker (internal)."""
    return serve(self, Call.from_json(call))


@app.task(name="gpufleet.load")
def load(replica: str, model: str) -> dict[str, Any]:
    """Load a replica the router placed here, before any call needs it (internal)."""
    worker = this_worker()
    return {"replica": replica, "load_ms": worker.ensure(replica, model)}


@app.task(name="gpufleet.sync")
def sync() -> dict[str, Any]:
    """Follow the ledger: offload or drop replicas moved away from this worker (internal)."""
    worker = this_worker()
    worker.sync()
    return {"residents": worker.manager.summary(), "devices": worker.manager.device_memory()}


def _warm_budget() -> int:
    """CPU memory this host lends to warm copies: GPUFLEET_WARM_CACHE, or 25% of RAM."""
    raw = os.environ.get("GPUFLEET_WARM_CACHE")
    if raw:
        return parse_size(raw)
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def _own_devices() -> list[Device]:
    """The GPUs of GPUFLEET_WORKER_GPUS (NVML indices), or all of them."""
    devices = discover()
    wanted = os.environ.get("GPUFLEET_WORKER_GPUS")
    if not wanted:
        return devices
    indices = {int(i) for i in wanted.split(",")}
    mine = [d for d in devices if d.index in indices]
    if not mine:
        visible = ", ".join(str(d.index) for d in devices) or "none"
        raise ConfigError(
            f"GPUFLEET_WORKER_GPUS={wanted} names no visible GPU (visible: {visible}); "
            f"check CUDA_VISIBLE_DEVICES or the container's device reservation"
        )
    return mine


@worker_init.connect
def _check(**_: Any) -> None:
    """Refuse to start a GPU worker that would own no GPU (the parent, before any fork)."""
    if context.role() == "gpu":
        try:
            _own_devices()  # NVML only: no CUDA context in the parent
        except ConfigError as exc:
            # Celery logs and ignores exceptions of signal handlers; SystemExit stops it.
            raise SystemExit(f"gpufleet worker cannot start: {exc}") from exc


@worker_process_init.connect
def _start(**_: Any) -> None:
    if context.role() != "gpu":
        return
    try:
        _process.worker = GpuWorker(_own_devices(), default_host(), discover())
        _process.worker.start()
    except Exception:
        # Celery would log this and keep a child that fails every call: exit instead.
        log.critical("GPU worker process cannot start", exc_info=True)
        os._exit(1)


@worker_process_shutdown.connect
def _stop(**_: Any) -> None:
    if _process.worker is not None:
        _process.worker.stop()
