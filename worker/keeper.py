"""The keeper: the one thread of a GPU worker process that changes what the process holds.

The registry decides where every replica lives; the keeper makes this process agree with
it, and confirms in the ledger the GPU work that only this process can do (the state
table is in docs/placement.md):

- WAITING here: admit it once its victims left the device (admit.lua), then load it;
- LOADING here: load it from disk, or restore the warm copy this process holds, onto the
  planned GPUs, then confirm it HOT (confirm.lua); a failed load settles 'failed';
- OFFLOADING or DROPPING here: offload the copy to CPU memory, or free it, then settle;
- HOT, DRAINING or WARM here but not held as the ledger says: settle 'lost';
- anything the ledger does not give this process: drop it.

It wakes for three reasons: a replica id on the worker's control list (commit.lua and
evict.lua push one for every worker a change concerns), a call that needs a replica HOT
(`ensure`), and a periodic full pass over everything the ledger and the process hold
(`RECONCILE_EVERY_S`). Control thus never waits behind the calls in the worker's queue: the
keeper runs beside them, and a replica is only moved while no call uses it (a running call
holds its lock; a leased replica is never chosen to leave).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import redis

from placement.catalog.catalog import ModelSpec
from placement.errors import EvictedError, PlacementError, RegistryError
from placement.ledger.figures import cache
from placement.ledger.registry import Registry
from placement.policy.state import Deployment, Level
from worker import passes
from worker.lifecycle import exit_for_restart, is_fatal_cuda_error
from worker.residency import ResidencyManager

__all__ = ["ADMIT_POLL_S", "LOAD_WAIT_S", "RECONCILE_EVERY_S", "Keeper", "Readiness", "not_ready"]

log = logging.getLogger(__name__)

#: The full pass over the ledger and the process: what no control message announced
#: (a lost message, a restart) is repaired within this.
RECONCILE_EVERY_S = 1.0
#: How often a WAITING placement asks to be admitted while its victims leave.
ADMIT_POLL_S = 0.02
#: How long a call waits for its replica to become HOT here before it fails.
LOAD_WAIT_S = 600.0
#: How many failed loads the keeper remembers, to give their calls the real error.
MAX_FAILURES = 64
#: How soon the keeper looks again at a replica it could not reconcile (Redis errors).
RETRY_S = 0.25

_TICK = ""  # an inbox item that only wakes the keeper


def not_ready(replica: str, worker_id: str, timeout_s: float) -> PlacementError:
    """The error of a call whose replica did not become HOT here in time."""
    return PlacementError(
        f"replica {replica} did not become ready on worker {worker_id} within "
        f"{timeout_s:.0f} s; see the worker's log"
    )


@dataclass
class Readiness:
    """A call waiting for its replica to be HOT here in `epoch` (0: whichever is current):
    `done` once it is (`hot`: the epoch it became HOT in) or cannot be (`error`)."""

    epoch: int
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    hot: int = 0  # the epoch it became HOT in
    since: float = field(default_factory=time.perf_counter)
    waited: bool = True  # False: it was HOT when asked

    def result(self) -> tuple[float, int]:
        """Once done: the milliseconds waited and the epoch it is HOT in; or its error."""
        if self.error is not None:
            raise self.error
        return ((time.perf_counter() - self.since) * 1000 if self.waited else 0.0), self.hot


class Keeper:
    """Brings what this process holds in line with the ledger, on a thread of its own."""

    def __init__(
        self,
        registry: Registry,
        manager: ResidencyManager,
        worker_id: str,
        spec_of: Callable[[str], ModelSpec],
        *,
        reconcile_every_s: float = RECONCILE_EVERY_S,
    ) -> None:
        self.registry = registry
        self.manager = manager
        self.worker_id = worker_id
        self.spec_of = spec_of
        self.reconcile_every_s = reconcile_every_s
        self._inbox: queue.Queue[str | None] = queue.Queue()
        self._waiters: dict[str, list[Readiness]] = defaultdict(list)
        self._waiters_lock = threading.Lock()
        self._waiting: set[str] = set()  # WAITING placements not admitted yet
        # Why recent loads failed, by (replica, epoch): a call routed to a placement whose
        # load already failed gets that error, not an eviction to route it again.
        self._failures: OrderedDict[tuple[str, int], BaseException] = OrderedDict()
        self._lost = threading.Event()
        self._recovered = threading.Event()
        self._retry: dict[str, float] = {}  # replica -> when to look again after an error
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []

    # --- what other threads call -----------------------------------------------------

    def start(self) -> Keeper:
        """Start the keeper and the thread that listens to the worker's control list."""
        for name, target in (("keeper", self._run), ("control", self._listen)):
            thread = threading.Thread(
                target=target, name=f"gpufleet-{name}-{self.worker_id}", daemon=True
            )
            thread.start()
            self._threads.append(thread)
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        """Stop both threads (a move under way finishes first) and fail waiting calls."""
        self._stop.set()
        self._inbox.put(None)
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(timeout_s)
        self._fail_all("the worker is shutting down")

    def poke(self, replica: str) -> None:
        """Look at `replica` soon."""
        self._inbox.put(replica)

    def lease_lost(self, timeout_s: float = LOAD_WAIT_S) -> None:
        """The worker's lease lapsed and the ledger released everything it held (the lease's
        `on_lost`): return once the keeper dropped every model, so that the lease registers
        again only when the process holds nothing the new ledger does not count."""
        if not any(t.is_alive() for t in self._threads):
            self._recover()  # no keeper thread: do it here
            return
        self._recovered.clear()
        self._lost.set()
        self._inbox.put(_TICK)
        if not self._recovered.wait(timeout_s):
            log.error("worker %s: its keeper did not drop its models in time", self.worker_id)

    def ensure(
        self, replica: str, epoch: int = 0, timeout_s: float = LOAD_WAIT_S
    ) -> tuple[float, int]:
        """Wait until `replica` is HOT here in placement `epoch` (0: whichever the ledger
        has now); return the milliseconds waited and the epoch it is HOT in.

        Raises `EvictedError` when the ledger places the replica elsewhere (route the
        call again), or the error that failed its load.
        """
        ready = self.watch(replica, epoch)
        if not ready.done.wait(timeout_s):
            self.unwatch(replica, ready)
            raise not_ready(replica, self.worker_id, timeout_s)
        return ready.result()

    def watch(self, replica: str, epoch: int = 0) -> Readiness:
        """`ensure` without the wait: a `Readiness` that is done once `replica` is HOT here
        in `epoch`, or cannot be (a session looks at it between decode steps)."""
        ready = Readiness(epoch)
        if epoch and self.manager.hot(replica, epoch):
            ready.hot, ready.waited = epoch, False
            ready.done.set()
            return ready
        failed = self._failures.get((replica, epoch))
        if failed is not None:
            ready.error = failed
            ready.done.set()
            return ready
        with self._waiters_lock:
            self._waiters[replica].append(ready)
        self.poke(replica)
        return ready

    def unwatch(self, replica: str, ready: Readiness) -> None:
        """Stop waiting for `replica` (a wait that timed out)."""
        with self._waiters_lock:
            if ready in self._waiters.get(replica, []):
                self._waiters[replica].remove(ready)

    # --- the keeper thread -------------------------------------------------------------

    def _listen(self) -> None:
        """Move replica ids from the worker's control list to the inbox."""
        while not self._stop.is_set():
            try:
                replica = self.registry.next_control(self.worker_id, timeout_s=1.0)
            except Exception as exc:  # the listener must outlive any failure
                log.warning("worker %s cannot read its control list: %s", self.worker_id, exc)
                self._stop.wait(0.5)
                continue
            if replica:
                self._inbox.put(replica)

    def _run(self) -> None:
        passes.helper_thread()  # its loads' torch work makes no second OpenMP team
        next_full = time.monotonic()
        while not self._stop.is_set():
            try:
                first = self._inbox.get(timeout=self._wait(next_full))
            except queue.Empty:
                first = _TICK
            batch = {first}
            while True:  # take whatever else came, once each
                try:
                    batch.add(self._inbox.get_nowait())
                except queue.Empty:
                    break
            if None in batch or self._stop.is_set():
                return
            replicas = {r for r in batch if r}
            if self._lost.is_set():
                self._guarded_recover()
            now = time.monotonic()
            if now >= next_full:
                next_full = now + self.reconcile_every_s
                replicas |= self._everything()
            due = {r for r, at in self._retry.items() if at <= now}
            for replica in due:
                del self._retry[replica]
            for replica in self._ordered(replicas | self._waiting | due):
                if self._lost.is_set():
                    break  # the ledger dropped everything: recover first
                self._guarded(replica)

    def _wait(self, next_full: float) -> float:
        """How long the keeper may sleep: until the next pass, admission poll or retry."""
        until = [next_full, *self._retry.values()]
        wait = max(0.0, min(until) - time.monotonic())
        return min(wait, ADMIT_POLL_S) if self._waiting else wait

    def _ordered(self, replicas: set[str]) -> list[str]:
        """Moves that free a device first (other workers' placements may wait for them),
        then admissions, then the rest; loads, the slowest, last."""
        names = sorted(replicas)
        try:
            levels = self.registry.levels(names)
        except (RegistryError, redis.RedisError):
            return names
        rank = {Level.OFFLOADING: 0, Level.DROPPING: 0, Level.WAITING: 1, Level.LOADING: 3}
        return sorted(names, key=lambda r: (rank.get(levels.get(r, Level.COLD), 2), r))

    def _everything(self) -> set[str]:
        """Every replica the ledger gives this worker, and every one it holds."""
        try:
            mine = set(self.registry.replicas_of(self.worker_id))
        except (RegistryError, redis.RedisError) as exc:
            log.warning("worker %s cannot read its replicas: %s", self.worker_id, exc)
            mine = set()
        return mine | set(self.manager.residents)

    def _recover(self) -> None:
        """After a lost lease: the ledger holds nothing for this worker any more."""
        self._lost.clear()
        self._waiting.clear()
        self._retry.clear()
        try:
            self.manager.drop_all()
        finally:
            self._fail_all("the worker lost its lease and dropped its models")
            self._recovered.set()

    def _guarded_recover(self) -> None:
        try:
            self._recover()
        except Exception as exc:
            if is_fatal_cuda_error(exc):
                exit_for_restart(exc)
            log.exception("worker %s could not drop its models after a lost lease", self.worker_id)

    def _guarded(self, replica: str) -> None:
        try:
            self._reconcile(replica)
        except (RegistryError, redis.RedisError) as exc:
            log.warning("worker %s: %s stays as it is for now: %s", self.worker_id, replica, exc)
            self._retry[replica] = time.monotonic() + RETRY_S
        except Exception as exc:
            if is_fatal_cuda_error(exc):
                exit_for_restart(exc)
            log.exception("worker %s could not reconcile %s", self.worker_id, replica)
            self._resolve(replica, error=exc)

    def _reconcile(self, replica: str, depth: int = 0) -> None:
        """Make what this process holds of `replica` what the ledger says; see the module
        docstring for each level."""
        dep = self.registry.deployment(replica)
        if dep is None or dep.worker != self.worker_id or dep.level is Level.COLD:
            self._waiting.discard(replica)
            if replica in self.manager.residents:
                self.manager.drop(replica)
                log.info("dropped %s: the ledger no longer gives it to this worker", replica)
            self._resolve(replica, error=self._gone(replica, dep))
            return
        level = dep.level
        if level is Level.WAITING:
            admitted = self.registry.admit(dep)
            if admitted is None:
                self._waiting.add(replica)
                return
            self._waiting.discard(replica)
            if admitted is not Level.LOADING:  # the record moved on: act on what it is now
                if depth < 2:
                    self._reconcile(replica, depth + 1)
                else:
                    self.poke(replica)
                return
            level = Level.LOADING
        self._waiting.discard(replica)
        if level is Level.LOADING:
            self._load(dep, depth)
        elif level in (Level.HOT, Level.DRAINING):
            if self.manager.hot(replica, dep.epoch):
                self._resolve(replica, hot=dep.epoch)
            else:
                self._lost_copy(dep)
        elif level is Level.OFFLOADING:
            self._offload(dep)
        elif level is Level.DROPPING:
            self.manager.drop(replica)
            self._settle(dep, "dropped")
        elif level is Level.WARM:
            resident = self.manager.residents.get(replica)
            if resident is None:
                self._settle(dep, "lost")
            elif not resident.warm and not self._offloaded(replica):
                self._settle(dep, "lost")  # the ledger had it in CPU memory; it is nowhere
            self._resolve(replica, error=self._gone(replica, dep))

    def _load(self, dep: Deployment, depth: int) -> None:
        """Load or restore a LOADING placement here, then confirm it HOT."""
        replica = dep.replica
        resident = self.manager.residents.get(replica)
        figure = ""  # the cache figure its time counts in: "load", "restore" or none
        try:
            if (
                resident is not None
                and not resident.warm
                and not self.manager.hot(replica, dep.epoch)
            ):
                self.manager.drop(replica)  # a copy of an older placement
                resident = None
            started = time.perf_counter()  # the load's own time: not the stale copy's drop
            restored = resident is not None and resident.warm
            if restored:
                self.manager.restore(replica, dep.gpus, dep.limit, dep.epoch)
                figure = "restore"
            elif resident is None:
                spec = self.spec_of(dep.model)
                self.manager.load(
                    spec, replica, dep.gpus, dep.limit, dep.epoch, source=dep.read_from
                )
                figure = "load"
        except Exception as exc:
            if is_fatal_cuda_error(exc):
                exit_for_restart(exc)
            self.manager.abandon(replica, exc)
            self._failures[(replica, dep.epoch)] = exc
            while len(self._failures) > MAX_FAILURES:
                self._failures.popitem(last=False)
            log.warning("could not load %s (%s): %s", dep.model, replica, exc)
            self._resolve(replica, error=exc)
            self._settle(dep, "failed")
            return
        copy_bytes = self.manager.copy_bytes(replica)
        if self.registry.confirm(replica, self.worker_id, dep.epoch, copy_bytes):
            took = time.perf_counter() - started
            self._resolve(replica, hot=dep.epoch)
            if figure:
                self._count(dep.model, figure, took)
            if restored:
                self.manager.trim_host_cache()  # its CPU copy's blocks, once its calls run
        elif depth < 2:
            self._reconcile(replica, depth + 1)  # it moved on while it loaded
        else:
            self.poke(replica)

    def _count(self, model: str, figure: str, seconds: float) -> None:
        """Count a load or restore that made a replica HOT, from its start here to its
        confirmation, in the model's cache figures (`placement.ledger.figures.cache`), after its
        calls were woken; a registry that does not answer loses the figure, not the load."""
        try:
            cache.record(self.registry, [(model, figure, seconds)])
        except Exception as exc:  # Redis errors above all
            log.warning("could not count the %s of %s (%.2f s): %s", figure, model, seconds, exc)

    def _offload(self, dep: Deployment) -> None:
        resident = self.manager.residents.get(dep.replica)
        kept = resident is not None and (resident.warm or self._offloaded(dep.replica))
        if kept:
            self._settle(dep, "offloaded", self.manager.locator(dep.replica))
        else:
            self._settle(dep, "dropped")

    def _offloaded(self, replica: str) -> bool:
        """Offload a HOT replica here; when that fails, drop it (its half-made copy too)."""
        try:
            self.manager.offload(replica)
        except Exception as exc:
            if is_fatal_cuda_error(exc):
                exit_for_restart(exc)
            log.warning("could not offload %s, dropping it: %s", replica, exc)
            self.manager.abandon(replica, exc)
            return False
        return True

    def _lost_copy(self, dep: Deployment) -> None:
        """The ledger keeps `dep` on this worker, which does not hold it so: release it."""
        self.manager.drop(dep.replica)
        self._settle(dep, "lost")
        log.warning(
            "the ledger had %s (%s) %s here, but this worker did not hold it there; released",
            dep.model,
            dep.replica,
            dep.level.value,
        )

    def _settle(self, dep: Deployment, outcome: str, copy_at: str = "") -> None:
        level = self.registry.settle(dep, outcome, copy_at)
        if level is None:
            self.poke(dep.replica)  # the record moved on meanwhile: look again
        self._resolve(dep.replica, error=self._gone(dep.replica, dep))

    def _gone(self, replica: str, dep: Deployment | None) -> EvictedError:
        where = f"{dep.level.value} on worker {dep.worker or '-'}" if dep else "unknown"
        return EvictedError(
            f"replica {replica} is not on this worker's GPUs (the ledger has it {where}); "
            f"route the request again"
        )

    # --- waiting calls -----------------------------------------------------------------

    def _resolve(
        self, replica: str, *, hot: int | None = None, error: BaseException | None = None
    ) -> None:
        """Wake the calls waiting for `replica`: HOT in placement `hot`, or failed."""
        with self._waiters_lock:
            waiters = self._waiters.pop(replica, [])
        for waiter in waiters:
            failed = self._failures.get((replica, waiter.epoch))
            if failed is not None:
                waiter.error = failed
            elif hot is not None and waiter.epoch not in (0, hot):
                waiter.error = EvictedError(
                    f"replica {replica} was placed again since the call was routed; "
                    f"route the request again"
                )
            elif hot is None:
                waiter.error = error or EvictedError(f"replica {replica} left; route again")
            else:
                waiter.hot = hot
            waiter.done.set()

    def _fail_all(self, why: str) -> None:
        with self._waiters_lock:
            everything, self._waiters = self._waiters, defaultdict(list)
        for replica, waiters in everything.items():
            for waiter in waiters:
                waiter.error = EvictedError(f"replica {replica}: {why}; route the request again")
                waiter.done.set()
