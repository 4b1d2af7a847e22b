"""The worker's membership in the registry: register, keep a heartbeat lease, leave.

A GPU worker owns its GPUs in the registry only while it renews a lease (brief item
10: a worker that stops heartbeating loses its reservations). `WorkerLease` registers
the worker, renews the lease from a daemon thread every third of its length, and on
shutdown releases everything at once instead of waiting for the lease to lapse.

When the lease is lost anyway (a long GC pause, a frozen VM, Redis unreachable for
longer than the lease), any router may already have reaped the worker: every replica
it held is COLD in the registry and its GPU bytes may be promised to others. The
lease then calls ``on_lost`` once, so the owner drops every resident and warm model,
releases whatever the registry still records for the worker, and registers again
under the same worker id with a fresh lease.

Start the lease in the process that holds the models (the Celery prefork child, in
``worker_process_init``: registering is one Redis call), so that when that process
dies its lease lapses with it. A fatal CUDA error ends the process through
`exit_for_restart`, which first releases the leases this process started, so the
replacement child can register at once.
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import secrets
import socket
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import NoReturn

import redis

from placement.config import DEFAULT_WORKER_LEASE_MS
from placement.errors import ConfigError, GpuOwnedError, LeaseLostError, RegistryError
from placement.ledger.registry import Registry
from placement.policy.state import Holding
from worker import identity
from worker.devices import Device

__all__ = [
    "EXIT_RESTART",
    "Owner",
    "WorkerLease",
    "default_lineage",
    "exit_for_restart",
    "is_fatal_cuda_error",
    "live_owner",
    "make_worker_id",
]

log = logging.getLogger(__name__)


#: The exit status of a worker process that must be replaced (EX_SOFTWARE).
EXIT_RESTART = 70

_MIN_LEASE_MS = 30  # below this a heartbeat cannot reliably beat the clock
_FIRST_RETRY_S = 0.05  # the first retry after a failed heartbeat; doubles up to the interval
_JOIN_S = 5.0  # how long stop() waits for the heartbeat thread to finish its call

# Leases started in this process, released by exit_for_restart (weak: stop() is enough).
_started: weakref.WeakSet[WorkerLease] = weakref.WeakSet()


class WorkerLease:
    """A worker's registration and its heartbeat lease, renewed from a daemon thread.

    `start` registers (errors such as `GpuOwnedError` reach the caller) and starts the
    heartbeat; `stop` releases everything. A lost lease calls `on_lost` once, from the
    heartbeat thread, then the lease re-registers; see the module docstring. Use it as a
    context manager to stop on the way out. Every method is safe to call from any thread.
    """

    def __init__(
        self,
        registry: Registry,
        worker_id: str,
        host: str,
        queue: str,
        devices: Sequence[Device],
        *,
        warm_budget: int,
        lease_ms: int = DEFAULT_WORKER_LEASE_MS,
        on_lost: Callable[[], None] | None = None,
        lineage: str = "",
        report: Callable[[], Sequence[Holding]] | None = None,
        contexts: Callable[[], Sequence[str]] | None = None,
        pinned: Callable[[], int] | None = None,
    ) -> None:
        if lease_ms < _MIN_LEASE_MS:
            raise ConfigError(
                f"a worker lease must last at least {_MIN_LEASE_MS} ms, not {lease_ms}"
            )
        if not devices:
            raise ConfigError(f"worker {worker_id} has no GPU to register")
        self.registry = registry
        self.worker_id = worker_id
        self.host = host
        self.queue = queue
        self.warm_budget = warm_budget
        self.lease_ms = lease_ms
        self.on_lost = on_lost
        self.lineage = lineage
        self.report = report  # what the process holds, sent with every heartbeat
        self.contexts = contexts  # GPUs it keeps a CUDA context on, declared when it registers
        self.pinned = pinned  # host memory it keeps pinned, sent with every heartbeat
        self._gpus = tuple(d.to_gpu(host) for d in devices)
        self._interval_s = lease_ms / 3000
        self._lock = threading.Lock()  # guards the fields below
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._started = False
        self._stopped = False
        self._registered = False
        self._deadline_ms = 0  # the registry's deadline of the current lease
        self._lapse_at = 0.0  # time.monotonic() by which the lease surely lapsed
        self._losses = 0
        self._pid = os.getpid()

    # --- what callers read -------------------------------------------------------------

    @property
    def gpu_ids(self) -> tuple[str, ...]:
        """The registry ids of this worker's GPUs."""
        return tuple(g.id for g in self._gpus)

    @property
    def registered(self) -> bool:
        """True while the worker holds a lease it has renewed in time."""
        with self._lock:
            return self._registered

    @property
    def deadline_ms(self) -> int:
        """The current lease's deadline on the registry's clock (0 before `start`)."""
        with self._lock:
            return self._deadline_ms

    @property
    def losses(self) -> int:
        """How many times the lease was lost (and `on_lost` called)."""
        with self._lock:
            return self._losses

    # --- start and stop ------------------------------------------------------------------

    def start(self) -> WorkerLease:
        """Register the worker's GPUs and start the heartbeat thread; returns self.

        Raises `GpuOwnedError` when a live worker owns one of the GPUs, `RegistryError`
        when the registry cannot be reached, and `RuntimeError` if called twice.
        """
        with self._lock:
            if self._started or self._stopped:
                raise RuntimeError(f"the lease of worker {self.worker_id} was already started")
            self._started = True
        try:
            self._register()
        except BaseException:
            with self._lock:
                self._started = False
            raise
        self._thread = threading.Thread(
            target=self._run, name=f"gpufleet-lease-{self.worker_id}", daemon=True
        )
        self._thread.start()
        _started.add(self)
        log.info(
            "worker %s registered GPUs %s on queue %s (lease %d ms)",
            self.worker_id,
            ", ".join(self.gpu_ids),
            self.queue,
            self.lease_ms,
        )
        return self

    def stop(self) -> None:
        """Stop heartbeating and release every GPU and replica of the worker. Idempotent.

        The release is `Registry.reap(worker_id, force=True)`: every replica the worker
        held goes COLD and its GPUs leave the ledger. If the registry cannot be reached,
        a warning is logged and the lease simply lapses, after which any router reaps it.
        """
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            started, self._registered = self._started, False
            self._stop.set()  # under the lock: the thread sees both changes at once
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(_JOIN_S)
        _started.discard(self)
        if not started:
            return
        try:
            released = self.registry.reap(self.worker_id, force=True)
        except (RegistryError, redis.RedisError) as exc:
            log.warning(
                "worker %s could not release its GPUs (%s); they are freed when its lease "
                "lapses within %d ms",
                self.worker_id,
                exc,
                self.lease_ms,
            )
            return
        log.info("worker %s left the fleet (%s replicas released)", self.worker_id, released or 0)

    def __enter__(self) -> WorkerLease:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # --- the heartbeat thread --------------------------------------------------------------

    def _register(self) -> None:
        """Register and record the new lease (the registry reaps a dead previous owner).
        Contexts the process still keeps on other workers' GPUs (after a lost lease) are
        charged again."""
        sent = time.monotonic()
        own = {g.id for g in self._gpus}
        opened = [g for g in self.contexts() if g not in own] if self.contexts else []
        deadline = self.registry.register_worker(
            self.worker_id,
            self.host,
            self.queue,
            self._gpus,
            warm_budget=self.warm_budget,
            lease_ms=self.lease_ms,
            lineage=self.lineage,
            contexts=opened,
            process=identity.current(),
            domain=identity.domain(),
        )
        self._renewed(deadline, sent)

    def _renewed(self, deadline_ms: int, sent: float) -> None:
        with self._lock:
            self._registered = not self._stopped
            self._deadline_ms = deadline_ms
            # Counted from before the call: the registry's deadline is surely no earlier.
            self._lapse_at = sent + self.lease_ms / 1000

    def _run(self) -> None:
        """Renew every `lease_ms / 3`; retry failures with backoff; recover lost leases."""
        failures = 0
        while not self._stop.wait(self._delay(failures)):
            try:
                self._beat()
                failures = 0
            except LeaseLostError as exc:
                if self._stop.is_set():
                    return  # stop() reaped the worker under the in-flight heartbeat
                self._lost(str(exc))
                failures = 0  # re-register right away
            except GpuOwnedError as exc:
                failures += 1
                log.error("worker %s cannot re-register: %s", self.worker_id, exc)
            except (RegistryError, redis.RedisError) as exc:
                failures += 1
                self._failed(exc, failures)
            except Exception as exc:  # the thread must outlive any surprise
                failures += 1
                log.exception("worker %s heartbeat failed unexpectedly", self.worker_id)
                self._failed(exc, failures)
            if self._stop.is_set():
                # A registration that raced with stop() must not outlive it.
                with contextlib.suppress(RegistryError, redis.RedisError):
                    self.registry.reap(self.worker_id, force=True)
                return

    def _delay(self, failures: int) -> float:
        """How long to wait before the next attempt."""
        with self._lock:
            registered, lapse_at = self._registered, self._lapse_at
        if failures == 0:
            return self._interval_s if registered else 0.0  # after a loss, re-register now
        # 50 ms, 100 ms, ... up to the heartbeat interval (the exponent is capped: no overflow).
        backoff = min(self._interval_s, _FIRST_RETRY_S * 2.0 ** min(failures - 1, 30))
        if not registered:
            return backoff
        return max(0.0, min(backoff, lapse_at - time.monotonic()))  # one last try before lapse

    def _beat(self) -> None:
        """One attempt: renew a live lease, or release and register after a loss."""
        if self._stop.is_set():
            return
        if self.registered:
            sent = time.monotonic()
            holdings = self.report() if self.report is not None else None
            pinned = self._pinned()
            deadline = self.registry.heartbeat(
                self.worker_id, self.gpu_ids, self.lease_ms, holdings=holdings, pinned=pinned
            )
            self._renewed(deadline, sent)
            return
        # Whatever the registry still records for us is stale: the owner dropped it all.
        self.registry.reap(self.worker_id, force=True)
        if self._stop.is_set():
            return
        self._register()
        log.warning("worker %s registered again with a fresh lease", self.worker_id)

    def _pinned(self) -> int | None:
        """The pinned bytes to report, or None (the last figure stands): a figure that
        cannot be read never keeps the lease from being renewed."""
        if self.pinned is None:
            return None
        try:
            return self.pinned()
        except Exception:
            log.debug("could not read the pinned host memory", exc_info=True)
            return None

    def _failed(self, exc: BaseException, failures: int) -> None:
        """A transient failure: log it, and declare the lease lost once it surely lapsed."""
        with self._lock:
            registered, lapse_at = self._registered, self._lapse_at
        if registered and time.monotonic() >= lapse_at:
            self._lost(f"the registry was unreachable for the whole lease ({exc})")
            return
        level = logging.WARNING if failures == 1 or not registered else logging.DEBUG
        log.log(
            level,
            "worker %s heartbeat failed (attempt %d), retrying: %s",
            self.worker_id,
            failures,
            exc,
        )

    def _lost(self, why: str) -> None:
        """Mark the lease lost and tell the owner, once per loss."""
        with self._lock:
            if not self._registered:
                return
            self._registered = False
            self._losses += 1
        log.error("worker %s lost its lease: %s; dropping resident models", self.worker_id, why)
        if self.on_lost is not None:
            try:
                self.on_lost()
            except Exception:
                log.exception("worker %s: on_lost failed; registering again anyway", self.worker_id)


@dataclass(frozen=True)
class Owner:
    """The live worker that owns a GPU in the ledger, its lineage, and why it is live."""

    worker: str
    lineage: str
    why: str


def live_owner(registry: Registry, gpu_id: str) -> Owner | None:
    """The worker that owns `gpu_id` and may be alive; None when none does.

    An owner whose lease still runs but whose processes are gone (`worker.identity`: a
    crashed host started again on the same machine) is reaped here, at once, which hands
    back what it held as a lapsed lease would; one that cannot be checked from here keeps
    its GPUs until its lease lapses.
    """
    owner = registry.owner(gpu_id)
    if owner is None:
        return None
    found = identity.verdict(registry.worker_process(owner[0]))
    if found.dead:
        log.warning(
            "worker %s owns %s but is dead (%s): taking its GPUs over", owner[0], gpu_id, found.why
        )
        registry.reap(owner[0], force=True)
        return None
    return Owner(owner[0], owner[1], found.why)


# --- names ---------------------------------------------------------------------------------


def default_lineage(explicit: str = "", parent: bool = False) -> str:
    """The worker slot this process fills: `explicit` (GPUFLEET_LINEAGE) if given, else
    its Celery pool (this machine's boot id and the pool's main process). A process may
    replace a live owner of its GPUs only when both have the same lineage; `parent` is
    True in the pool's main process itself, before it forks.
    """
    if explicit:
        return explicit
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        boot = socket.gethostname()
    return f"{boot}:{os.getpid() if parent else os.getppid()}"


def make_worker_id(host: str, devices: Sequence[Device]) -> str:
    """A readable worker id, unique per process start: ``gpu0@host-3f2a9c``.

    It names the GPU indices (``gpu0_1``, runs shortened as ``gpu0-7``; ``sim`` for
    simulated GPUs), the host, and a random suffix, so a restarted worker never
    collides with the lease of its previous life. It doubles as a Celery node name, so
    every character outside ``[A-Za-z0-9._@-]`` in the host becomes ``-``.
    """
    kind = "sim" if devices and all(d.simulated for d in devices) else "gpu"
    indices = _runs(sorted({d.index for d in devices})) or "none"
    safe_host = re.sub(r"[^A-Za-z0-9._-]+", "-", host).strip("-") or "host"
    return f"{kind}{indices}@{safe_host}-{secrets.token_hex(3)}"


def _runs(indices: list[int]) -> str:
    """[0, 1, 2, 3, 6] -> "0-3_6"."""
    parts: list[str] = []
    i = 0
    while i < len(indices):
        j = i
        while j + 1 < len(indices) and indices[j + 1] == indices[j] + 1:
            j += 1
        if j - i >= 2:
            parts.append(f"{indices[i]}-{indices[j]}")
        else:
            parts.extend(str(n) for n in indices[i : j + 1])
        i = j + 1
    return "_".join(parts)


# --- fatal CUDA errors -----------------------------------------------------------------------

# cudaGetErrorString texts of the "sticky" errors: after one, every later CUDA call in
# the process fails, so only a new process (a new CUDA context) can serve again.
_FATAL_CUDA = (
    "device-side assert triggered",
    "an illegal memory access was encountered",
    "an illegal instruction was encountered",
    "unspecified launch failure",
    "misaligned address",
    "hardware stack error",
    "invalid program counter",
    "operation not supported on global/shared address space",
    "the launch timed out and was terminated",
    "uncorrectable ecc error encountered",
    "cublas_status_execution_failed",
)


def is_fatal_cuda_error(exc: BaseException) -> bool:
    """True when `exc` (or an exception it was raised from) left the CUDA context unusable.

    Sticky CUDA errors, such as a device-side assert or an illegal memory access, poison
    the process's context: the task fails, and so would every later one. Those need a
    process restart (`exit_for_restart`). An out-of-memory error is not one of them
    (`torch.OutOfMemoryError` is recoverable: free memory and retry or re-route), nor is
    any ordinary error.
    """
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        if isinstance(current, RuntimeError) and not _is_oom(current):
            text = str(current).lower()
            if any(marker in text for marker in _FATAL_CUDA):
                return True
        current = current.__cause__ or current.__context__
    return False


def _is_oom(exc: BaseException) -> bool:
    torch = sys.modules.get("torch")  # a torch error implies torch is imported; never import it
    oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    return isinstance(oom, type) and isinstance(exc, oom)


def exit_for_restart(exc: BaseException, *, release_timeout: float = 2.0) -> NoReturn:
    """End this process at once with status 70 so a clean one replaces it.

    Call it from a Celery prefork pool child after `is_fatal_cuda_error(exc)`. The
    leases this process started are released first (best effort, at most
    `release_timeout` seconds, without CUDA), so its replicas leave the registry now
    and the replacement child can own the GPUs at once.

    Why `os._exit` and not `sys.exit`: `SystemExit` is an exception. In a pool child it
    unwinds through the task's ``finally`` blocks, Celery's tracer and billiard's worker
    loop, then runs atexit handlers and interpreter finalisation, all of which may touch
    the poisoned CUDA context (tensor destructors, allocator and context teardown) and
    raise again or hang; raised from any thread but the main one it ends only that
    thread. `os._exit` skips all of that: the billiard parent sees the child exit, fails
    its task with `WorkerLostError` (redelivered with ``task_acks_late`` and
    ``task_reject_on_worker_lost``), and forks a fresh child with no CUDA context.
    """
    log.critical(
        "fatal CUDA error, the CUDA context is unusable; exiting with status %d so that a "
        "fresh worker process replaces this one",
        EXIT_RESTART,
        exc_info=exc,
    )
    leases = [lease for lease in list(_started) if lease._pid == os.getpid()]
    if leases:
        releaser = threading.Thread(target=_release_all, args=(leases,), daemon=True)
        releaser.start()
        releaser.join(release_timeout)  # a hung Redis must not keep a broken process alive
    for handler in logging.getLogger().handlers + log.handlers:
        with contextlib.suppress(Exception):
            handler.flush()  # os._exit skips the flush at interpreter exit
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(EXIT_RESTART)


def _release_all(leases: Sequence[WorkerLease]) -> None:
    for lease in leases:
        try:
            lease.stop()
        except Exception:
            log.exception("could not release worker %s", lease.worker_id)
