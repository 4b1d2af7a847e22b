"""The GPU worker's Celery side: bind a `worker.node.GpuWorker` to a prefork pool child.

One Celery worker per GPU, prefork with concurrency 1: the parent answers control
commands and Flower while the child holds the models. The child registers its GPU
and starts its keeper in `worker_process_init` (a few Redis calls; models load when the
ledger places them here). The keeper follows the ledger on its own thread, so an
eviction or a load never waits behind the calls in this worker's queue.
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any, NoReturn

from celery import Task
from celery.exceptions import SoftTimeLimitExceeded, TimeLimitExceeded
from celery.signals import worker_init, worker_process_init, worker_process_shutdown
from celery.utils.log import mlevel

from placement.errors import (
    ConfigError,
    EvictedError,
    GpufleetError,
    GpuOwnedError,
    RegistryError,
)
from placement.ledger.figures import cache, generation
from placement.ledger.load import BATCH_TTL_MS, mark_batch
from placement.rules.batching import BatchLimits
from tasks import context
from tasks.app import app
from tasks.broker.intake import LEASE_HEADER, redelivered
from tasks.config import RUN
from tasks.serving import batch_jobs, generating, leases, streams
from tasks.serving.calls import Call, slot_of, tenant_of, time_limits_of
from tasks.serving.routing import gpu_queue
from worker import passes
from worker.devices import Device, discover
from worker.generation.serving import GenCall, Generated
from worker.lifecycle import default_lineage, live_owner
from worker.node import GpuWorker, Served
from worker.session import OneShot

log = logging.getLogger(__name__)

MAX_HOPS = 3  # re-routes of one call before it fails


class _Process:
    """The one GpuWorker of this pool child, made by `worker_process_init`."""

    worker: GpuWorker | None = None


_process = _Process()


def this_worker() -> GpuWorker:
    if _process.worker is None:
        raise RuntimeError("not a GPU worker process: start it with GPUFLEET_ROLE=gpu")
    return _process.worker


def serve(task: Task, call: Call) -> dict[str, Any]:
    """Run one call on its replica here (or take the answer its batch computed); if the
    replica left this worker, route it again."""
    worker = this_worker()
    prepared = batch_jobs.take_prepared(task.request.id)
    # given back, it may have run (`batch_jobs.ran_before`); Celery acks an `Ignore`
    if (
        prepared is None
        and redelivered(task.request)
        and batch_jobs.answered_already([task.request.id], app.backend)
    ):
        raise batch_jobs.ran_already()
    started = prepared.started_ms if prepared is not None else int(time.time() * 1000)
    try:
        if prepared is not None:
            served = prepared.served()
        else:
            served = worker.serve(call.replica, call.epoch, call.inputs, call.params)
    except EvictedError:
        if call.hops >= MAX_HOPS:
            raise
        log.info("replica %s left; routing the call for %s again", call.replica, call.model)
        raise task.replace(
            call.rerouted(
                time_limits_of(task.request), tenant_of(task.request), slot_of(task.request)
            )
        ) from None
    finally:
        if call.lease is not None and prepared is None:  # a batch ends its calls' leases
            try:
                worker.registry.finish(call.lease)
            except GpufleetError:  # the lease expires on its own; the answer stands
                log.warning("could not end lease %s", call.lease.id, exc_info=True)
    timings: dict[str, Any] = {
        "queue": max(0, started - call.sent_ms),
        "batch_wait": round(prepared.batch_wait_ms, 3) if prepared is not None else 0.0,
        "load": round(served.load_ms, 3),
        "compute": round(served.compute_ms, 3),
        "batch_calls": served.batch,
        # when it began to run here (its batch, or its join of a generation) and ended,
        # epoch ms: what ran at once, from the calls' own answers
        "started_at": started,
        "ended_at": int(time.time() * 1000),
    }
    if served.first_token_ms is not None:
        timings["first_token"] = round(served.first_token_ms, 3)
        timings["inter_token"] = round(served.inter_token_ms or 0.0, 3)
        timings["join"] = round(served.join_ms or 0.0, 3)
        timings["prefill_wait"] = round(served.prefill_wait_ms or 0.0, 3)
    if call.cache != "hot":  # routed to a replica being placed: a miss
        _count_miss(worker, call.model, served.load_ms)
    return {
        "model": call.model,
        "replica": call.replica,
        "gpus": served.gpus,
        "worker": worker.worker_id,
        "cache": call.cache,
        "outputs": served.outputs,
        "timings_ms": timings,
    }


def _count_miss(worker: GpuWorker, model: str, load_ms: float) -> None:
    """Count the wait for its replica of a call that found none HOT (`timings_ms.load`) in
    its model's cache figures (`placement.ledger.figures.cache`); never fail the call over it."""
    try:
        cache.record(worker.registry, [(model, "miss", load_ms / 1000)])
    except Exception:
        log.warning("could not count a miss of %s", model, exc_info=True)


def batch_job(jobs: list[batch_jobs.ChildCall]) -> list[Any]:
    """A pool job of calls for one replica (`tasks.serving.batching`): shared passes, own
    results."""
    return batch_jobs.run_batch(jobs, _serve_jobs, app.backend)


def _serve_jobs(jobs: list[batch_jobs.ChildCall]) -> list[Served | BaseException]:
    return _serve_batch([Call.from_json(job.call) for job in jobs])


def _serve_batch(calls: list[Call]) -> list[Served | BaseException]:
    """The batch's answers; then its calls' leases end, in one round trip, as each call's
    own would once its answer is known. A batch of several says its size while it runs,
    so the scaling rule counts its calls as running (it assumes one otherwise)."""
    first = calls[0]
    worker = this_worker()
    batched = len(calls) > 1
    try:
        if batched:
            _say_batch(worker, first.replica, len(calls))
            log.info("%d calls of %s share a pass on %s", len(calls), first.model, first.replica)
        return worker.serve_batch(first.replica, first.epoch, [(c.inputs, c.params) for c in calls])
    finally:
        if batched:
            _say_batch(worker, first.replica, 0)
        _end_leases(worker, calls)


def _end_leases(worker: GpuWorker, calls: list[Call]) -> None:
    """End the request leases of `calls`, in one round trip, as each call's own would end
    once its answer is known (or once it will not run)."""
    try:
        worker.registry.finish_all([c.lease for c in calls if c.lease is not None])
    except GpufleetError:  # they expire on their own; the answers stand
        log.warning("could not end the leases of %d call(s)", len(calls), exc_info=True)


def session_job(job_id: str, jobs: list[batch_jobs.ChildCall]) -> dict[str, Any]:
    """A pool job that generates: a session, which also runs every call its main process
    hands it meanwhile, any replica's (`tasks.serving.generating`). Each call is settled
    as it ends; returns the tracer returns the channel could not carry, by message key."""
    return _Session(this_worker()).run(job_id, jobs)


class _Session:
    """One session in the child: its calls' leases, streams, answers and figures."""

    def __init__(self, worker: GpuWorker) -> None:
        self.worker = worker
        self.writer = streams.Writer(worker.registry.client)
        #: replica -> when its engine opened here (epoch ms), its GPUs
        self.ready: dict[str, tuple[float, list[str]]] = {}
        self.calls: dict[str, tuple[Call, float]] = {}  # message key -> its call, when it came
        self.counts: dict[str, tuple[int, float]] = {}  # replica -> calls open as said, when
        self.held: dict[str, tuple[int, float]] = {}  # replica -> KV-cache tokens said, when

    def run(self, job_id: str, jobs: list[batch_jobs.ChildCall]) -> dict[str, Any]:
        feed = generating.ChildFeed(
            job_id, jobs, channel(), self.gen_call, OneShot, self.finish, self.batch,
            limits_of, self, ran_before=lambda some: batch_jobs.ran_before(some, app.backend),
        )  # fmt: skip
        try:
            self.worker.serve_session(feed)
        except Exception as exc:
            feed.unanswered(exc)
        finally:
            self.writer.flush()
            for replica in [r for r, (calls, _) in self.counts.items() if calls]:
                _say_batch(self.worker, replica, 0)
            for replica in [r for r, (tokens, _) in self.held.items() if tokens]:
                _say_kv(self.worker, replica, {"held_tokens": 0})
        return feed.leftover()

    def gen_call(self, job: batch_jobs.ChildCall) -> GenCall:
        call = Call.from_json(job.call)
        self.calls[job.key] = (call, time.time() * 1000)
        on_text = self.writer.for_call(job.task_id) if _streams(call) else None
        deadline = None  # the engine's clock: time.monotonic()
        if job.deadline is not None:
            deadline = time.monotonic() + (job.deadline - time.time())
        tenant, weight = job.share  # whose share of the engine's rows it takes
        return GenCall(
            job.key, call.inputs, call.params, on_text, deadline, call.replica, call.epoch,
            owner=("tenant", tenant) if tenant else None, weight=weight,
        )  # fmt: skip

    def batch(
        self, jobs: list[batch_jobs.ChildCall], error: BaseException | None
    ) -> dict[str, Any]:
        """Run a batch of one-shot calls (or, with `error`, answer them with it unrun):
        each call's tracer return, by its message's key. A call whose time limit ended
        while it waited fails with `TimeLimitExceeded`, unrun (a session has no pool limit
        to stop it); the leases of the calls that do not run end here."""

        def serve(fresh: list[batch_jobs.ChildCall]) -> list[Served | BaseException]:
            now = time.time()
            calls = [Call.from_json(job.call) for job in fresh]
            late = [error is not None or (j.deadline or math.inf) <= now for j in fresh]
            _end_leases(self.worker, [c for c, skip in zip(calls, late, strict=True) if skip])
            run = [c for c, skip in zip(calls, late, strict=True) if not skip]
            served = iter(_serve_batch(run) if run else [])
            expired = TimeLimitExceeded("the call's time limit ended before it ran")
            return [(error or expired) if skip else next(served) for skip in late]

        returns = batch_jobs.run_batch(jobs, serve, app.backend)
        return {job.key: ret for job, ret in zip(jobs, returns, strict=True)}

    def finish(
        self, job: batch_jobs.ChildCall, gen_call: GenCall | None, outcome: Any, revoked: bool
    ) -> Any:
        """End a call's lease and stream; run its tracer (not for a revoked call: its
        main process announces it as Celery does); then count its tokens and latencies,
        a round trip the caller does not wait for."""
        taken = self.calls.pop(job.key, None)  # None: a finish that failed once already
        call, started = taken or (Call.from_json(job.call), time.time() * 1000)
        if call.lease is not None:
            try:
                self.worker.registry.finish(call.lease)
            except Exception:  # the lease expires on its own; the answer stands
                log.warning("could not end lease %s", call.lease.id, exc_info=True)
        generated = outcome if isinstance(outcome, Generated) and outcome.tokens else None
        if generated is not None:
            opened_ms, gpus = self.ready.get(call.replica, (started, []))
            load_ms = max(0.0, opened_ms - started)  # its own wait for its replica: 0 if ready
            served: Served | BaseException = Served(
                generated.outputs, gpus, load_ms, generated.compute_ms,
                generated.outputs.get("batch", 1), generated.first_token_ms,
                generated.inter_token_ms, generated.join_ms, generated.prefill_wait_ms,
            )  # fmt: skip
            reason = ",".join(generated.outputs.get("finish_reasons", [])) or "stop"
        else:
            served, reason = outcome, "error"
        if _streams(call):
            try:
                self.writer.end(job.task_id, "cancelled" if revoked else reason)
            except Exception:  # the stream expires on its own; the answer stands
                log.warning("could not end the stream of %s", job.task_id, exc_info=True)
        answer = None
        if not revoked:
            waited = max(0.0, started - job.since_ms)
            answer = batch_jobs.run_one(job.trace, job.args, served, started, waited)
        if generated is not None:
            _record(self.worker, call.model, generated)  # after the answer: not the caller's wait
        return answer

    # --- what the session says as it runs (`generating.Figures`) --------------------

    def opened(self, replica: str, gpus: list[str]) -> None:
        self.ready[replica] = (time.time() * 1000, gpus)  # each call's wait is its own

    def stepped(
        self, replica: str, calls: int, held_tokens: int, figures: Callable[[], dict[str, float]]
    ) -> None:
        """After each step: write the streamed text; say the replica's calls open when
        that changed (or its record nears its expiry), and its KV cache's figures at most
        once a second (and when it starts or stops holding tokens): only then are they
        built."""
        self.writer.flush()
        now = time.monotonic()
        said, when = self.counts.get(replica, (0, 0.0))
        if calls != said or (calls and now - when > BATCH_TTL_MS / 3000):
            self.counts[replica] = (calls, now)
            _say_batch(self.worker, replica, calls)
        held, when = self.held.get(replica, (0, 0.0))
        if bool(held_tokens) != bool(held) or (held_tokens and now - when > KV_SAID_EVERY_S):
            self.held[replica] = (held_tokens, now)
            _say_kv(self.worker, replica, figures())

    def streamed(self) -> None:
        self.writer.flush()


def _streams(call: Call) -> bool:
    """Whether a call asked for its text as it comes (`tasks.serving.streams`)."""
    return isinstance(call.params, dict) and call.params.get("stream") is True


KV_SAID_EVERY_S = 1.0  # how often a generating batch's KV-cache use is said (status)


def _record(worker: GpuWorker, model: str, generated: Generated) -> None:
    """Count an ended generating call's tokens and latencies (status, metrics)."""
    itl = generated.inter_token_ms / 1000 if generated.tokens > 1 else None
    try:
        generation.record(
            worker.registry, model, generated.tokens, generated.first_token_ms / 1000, itl
        )
    except Exception:
        log.warning("could not record a generating call of %s", model, exc_info=True)


def _say_kv(worker: GpuWorker, replica: str, kv: dict[str, float]) -> None:
    try:
        generation.mark_kv(worker.registry, replica, kv)
    except Exception:
        log.warning("could not say the KV-cache use of %s", replica, exc_info=True)


class _Channel:
    """The main process's line to its pool child (`tasks.serving.generating.Channel`), made
    before the pool forks, so that every child, restarted ones too, has it."""

    channel: generating.Channel | None = None


_channel = _Channel()


def channel() -> generating.Channel | None:
    """The worker's channel to its pool child, if this process is a GPU worker's."""
    return _channel.channel


#: Celery's loggers of each call's "received" (the worker's main process) and "succeeded"
#: (its pool child) lines.
CALL_LOGGERS = ("celery.worker.strategy", "celery.app.trace")


def _quiet_call_logs(loglevel: Any) -> None:
    """Keep Celery's per-call INFO lines out of a GPU worker's log unless it runs at DEBUG:
    at hundreds of calls a second they cost the worker more than a batch shares
    (formatting, and the launcher relaying every line). Warnings and failures stay, a batch
    of several logs one line, and Flower shows every call (docs/tasks.md). Set in the
    parent before its pool forks: Celery reads the levels once, as it builds each child's
    tracers and the consumer's strategies."""
    if mlevel(loglevel or logging.WARNING) > logging.DEBUG:
        for name in CALL_LOGGERS:
            logging.getLogger(name).setLevel(logging.WARNING)


def _say_batch(worker: GpuWorker, replica: str, calls: int) -> None:
    """Record the running pass's size (0: it ended); never fail the batch over it."""
    try:
        mark_batch(worker.registry, replica, calls)
    except Exception:
        log.warning("could not report a batch of %d on %s", calls, replica, exc_info=True)


@functools.cache
def limits_of(model: str) -> BatchLimits:
    """How `model`'s calls are batched here; off for a model the catalog lacks (its call
    then fails on its own, as unbatched)."""
    spec = context.catalog().get(model, None)
    if spec is None:
        return BatchLimits(size=1)
    return spec.batch_limits(context.settings().batch)


@functools.cache
def generates(model: str) -> bool:
    """Whether `model`'s calls generate text (a session of their own: `session_job`)."""
    spec = context.catalog().get(model, None)
    return spec is not None and spec.task == "text-generation"


def _run_intake(headers: dict[str, Any], arguments: dict[str, Any]) -> None:
    """What the consumer checks of a `gpufleet.run` (`tasks.broker.intake`): every field of its
    call, and its lease header."""
    call = Call.from_json(arguments["call"])
    leases.from_header(call.model, headers.get(LEASE_HEADER))


@app.task(name=RUN, bind=True, intake=staticmethod(_run_intake))
def run(self: Task, call: dict[str, Any]) -> dict[str, Any]:
    """A call the router handed to this worker (internal)."""
    return serve(self, Call.from_json(call))


def _warm_budget() -> int:
    """CPU memory this host lends to warm copies: GPUFLEET_WARM_CACHE, or 25% of RAM."""
    configured = context.settings().warm_cache
    if configured is not None:
        return configured
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 4


def _visible() -> list[Device]:
    """Every GPU this host's workers see: NVML's, else the simulated ones."""
    settings = context.settings()
    return discover(settings.sim_gpus, reserve=settings.gpu_reserve)


def _own_devices(devices: list[Device]) -> list[Device]:
    """The GPUs of GPUFLEET_WORKER_GPUS (NVML indices) among `devices`, or all of them."""
    wanted = context.settings().worker_gpus
    if wanted is None:
        return devices
    mine = [d for d in devices if d.index in wanted]
    if not mine:
        visible = ", ".join(str(d.index) for d in devices) or "none"
        raise ConfigError(
            f"GPUFLEET_WORKER_GPUS={','.join(map(str, wanted))} names no visible GPU (visible: "
            f"{visible}); check CUDA_VISIBLE_DEVICES or the container's device reservation"
        )
    return mine


_main_pid = 0  # the Celery worker's main process, set there before its pool forks


@worker_init.connect
def _check(sender: Any = None, **_: Any) -> None:
    """Refuse to start a GPU worker that would own no GPU, or GPUs that a live worker of
    another fleet process owns on this registry (the parent, before any fork)."""
    global _main_pid  # noqa: PLW0603 - one value per process, inherited by the pool
    _main_pid = os.getpid()
    if context.role() != "gpu":
        return
    _channel.channel = generating.Channel()
    _quiet_call_logs(getattr(sender, "loglevel", None))
    try:
        devices = _own_devices(_visible())  # NVML only: no CUDA context in the parent
        _check_owners(devices)
    except (ConfigError, GpuOwnedError) as exc:
        # Celery logs and ignores exceptions of signal handlers; SystemExit stops it.
        raise SystemExit(f"gpufleet worker cannot start: {exc}") from exc


def _check_owners(devices: list[Device]) -> None:
    registry = context.registry()
    host = context.settings().host
    mine = default_lineage(context.settings().lineage, parent=True)
    try:
        for device in devices:
            owner = live_owner(registry, device.gpu_id(host))  # a dead one is taken over
            if owner is not None and owner.lineage != mine:
                raise GpuOwnedError(
                    f"GPU {device.gpu_id(host)} is owned by live worker {owner.worker} "
                    f"({owner.why}) of fleet {registry.keys.fleet!r} on this Redis. Stop that "
                    f"worker, or run this one as another fleet on a Redis database of its own "
                    f"(GPUFLEET_REDIS_URL=redis://<host>:<port>/<db>) or, for simulated GPUs, "
                    f"as another host (GPUFLEET_HOST)"
                )
    except RegistryError as exc:
        log.warning("cannot check who owns the GPUs yet (%s); the pool child will", exc)


@worker_process_init.connect
def _start(**_: Any) -> None:
    if context.role() != "gpu":
        return
    try:
        settings = context.settings()
        visible = _visible()  # NVML enumerates once
        devices = _own_devices(visible)
        _process.worker = GpuWorker(
            context.registry(),
            devices,
            visible,
            settings.host,
            gpu_queue(settings.host, [d.index for d in devices]),
            spec_of=lambda model: context.catalog().get(model),
            warm_budget=_warm_budget(),
            lease_ms=settings.worker_lease_ms,
            lineage=default_lineage(settings.lineage),
            # A soft time limit is the batch's (its calls share their limits): fail them
            # all, rather than run each again after the limit.
            whole_pass_errors=(SoftTimeLimitExceeded,),
            threads=passes.share(settings.torch_threads, len(visible)),
            graphs=settings.cuda_graphs,
        )
    except Exception:
        # Celery would log this and keep a child that fails every call: exit instead.
        log.critical("GPU worker process cannot start", exc_info=True)
        os._exit(1)
    _register(_process.worker)


def _register(worker: GpuWorker) -> None:
    """Register before taking any call (`worker_process_init` must return within 4 s, so
    while Redis is unreachable it keeps trying in the background). A GPU owned by another
    fleet's live worker stops the whole Celery worker: two fleets must never consume the
    same queues."""
    if _try_register(worker):
        return

    def retry() -> None:
        while not _try_register(worker):
            time.sleep(1.0)

    threading.Thread(target=retry, name="gpufleet-register", daemon=True).start()


def _try_register(worker: GpuWorker) -> bool:
    try:
        worker.start()
    except GpuOwnedError as exc:
        stop_worker(f"gpufleet worker cannot start: {exc}")
    except RegistryError as exc:
        log.warning("cannot register yet (%s); retrying", exc)
        return False
    return True


def stop_worker(why: str) -> NoReturn:
    """Stop the whole Celery worker from one of its pool children, with a failing exit
    status. SIGINT is Celery's warm shutdown with EX_FAILURE; a SIGTERM sent once the
    worker consumes stops it with status 0, as if it had been asked to."""
    log.critical("%s", why)
    if _main_pid and os.getppid() == _main_pid:  # not whoever adopted an orphan (init)
        os.kill(_main_pid, signal.SIGINT)
    os._exit(1)


@worker_process_shutdown.connect
def _stop(**_: Any) -> None:
    if _process.worker is not None:
        _process.worker.stop()
