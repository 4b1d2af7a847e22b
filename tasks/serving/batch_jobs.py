"""What a batch job runs in a GPU worker's pool child: every call's answer in shared
passes, then each call's own Celery tracer.

The main process's `tasks.serving.batching.Batcher` forms the jobs and sends each as one
pool job of `ChildCall`s. In the child, `run_batch` computes every call's outputs first
(`GpuWorker.serve_batch`), keeps each as the call's `Prepared` answer, then runs each
call's own tracer, which finds it (`take_prepared`, from `tasks.serving.gpu`) and stores
it as that task's result: each call keeps its own message, task id, events and result. A
session's generating calls end one at a time (`run_one`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from billiard.einfo import ExceptionInfo
from celery.exceptions import Ignore

from tasks.broker import results

if TYPE_CHECKING:
    from worker.node import Served  # GPU workers only: it imports torch

log = logging.getLogger(__name__)


class ChildCall(NamedTuple):
    """What the pool child needs to run one call as Celery would: its tracer and the
    tracer's arguments, the call, when it began to wait, the message's own key
    (`tasks.serving.batching.Held.key`), in a session the time (epoch seconds) its hard
    time limit ends, and for a generating call the tenant whose share of the engine's
    rows it takes with that tenant's weight ("" for the default tenant, whose calls each
    take their own: `worker.generation.turns`)."""

    trace: Callable[..., Any]
    args: tuple[Any, ...]
    call: dict[str, Any]
    since_ms: float
    key: str
    deadline: float | None = None
    share: tuple[str, float] = ("", 1.0)  # the default tenant's: each call its own
    #: it may have run already: delivered again by the broker, or put back in line as its
    #: job was let go (`tasks.serving.batching.Held.again`)
    again: bool = False

    @property
    def task_id(self) -> str:
        task_id: str = self.args[1]
        return task_id


@dataclass(frozen=True)
class Prepared:
    """A call's answer, computed by its batch before its tracer runs."""

    outcome: Served | BaseException
    started_ms: int  # when its batch began to run
    batch_wait_ms: float  # from reaching the worker to its batch starting

    def served(self) -> Served:
        if isinstance(self.outcome, BaseException):
            raise self.outcome
        return self.outcome


_prepared: dict[str, Prepared] = {}  # task id -> answer, in the child, while its job runs


def take_prepared(task_id: str | None) -> Prepared | None:
    """The answer a batch computed for this call, if it was batched (once)."""
    return _prepared.pop(task_id, None) if task_id else None


def run_batch(
    jobs: list[ChildCall], serve: Callable[[list[ChildCall]], list[Any]], backend: Any = None
) -> list[Any]:
    """In the child: compute every call's answer in shared passes, then run each call's own
    tracer, which stores its result (`backend`'s reads of them at once: `tasks.broker.results`).
    Returns the tracers' returns, in order."""
    started = time.time() * 1000
    ran = ran_before(jobs, backend)
    fresh = [job for job in jobs if job.task_id not in ran]
    try:
        served = serve(fresh) if fresh else []
    except Exception as exc:
        served = [exc] * len(fresh)
    by_id = dict(zip([job.task_id for job in fresh], served, strict=True))
    outcomes = [by_id[job.task_id] if job.task_id in by_id else ran_already() for job in jobs]
    ids = [job.task_id for job in jobs]
    with _ready(jobs, outcomes, started), results.read_together(backend, ids):
        return [_traced(job.trace, job.args) for job in jobs]


def ran_already() -> Ignore:
    """The outcome of a call whose answer an earlier run stored: its tracer acknowledges
    it (Celery's `Ignore`), and it does not run again."""
    return Ignore("ran before: its answer is stored")


def ran_before(jobs: list[ChildCall], backend: Any) -> set[str]:
    """The calls among `jobs` that may have run already (`ChildCall.again`) whose answers
    are stored. A job the pool let go with a lost connection may have started in this
    child all the same, and its calls, given back by the broker or put back in line,
    reach a later job; the worker's consumer looks for a given-back call's answer as it
    takes it, but the first run may still be going on then. Jobs run here one after
    another, so by now it has ended."""
    return answered_already([job.task_id for job in jobs if job.again], backend)


def answered_already(task_ids: list[str], backend: Any) -> set[str]:
    """The calls among `task_ids`, which may have run already, whose answers are stored:
    one read (none for no calls); when Redis cannot say, none (they run again, and the
    first stored answer stays)."""
    if not task_ids or backend is None:
        return set()
    try:
        found = results.answered(backend, task_ids)
    except Exception as exc:
        log.warning("could not tell whether calls %s ran (%s); running them", task_ids, exc)
        return set()
    if found:
        log.warning("calls %s ran already; not again", sorted(found))
    return found


def run_one(
    trace: Callable[..., Any],
    args: tuple[Any, ...],
    outcome: Served | BaseException,
    started_ms: float,
    batch_wait_ms: float,
) -> Any:
    """In the child: run one call's tracer with its answer computed already (a generating
    call, as it ends: `tasks.serving.generating`)."""
    _prepared[args[1]] = Prepared(outcome, int(started_ms), batch_wait_ms)
    try:
        return _traced(trace, args)
    finally:
        _prepared.pop(args[1], None)


def _traced(trace: Callable[..., Any], args: tuple[Any, ...]) -> Any:
    """One call's tracer; an error of the tracer itself fails that call only (Celery's
    tracer reports the task's own errors in its return already)."""
    try:
        return trace(*args)
    except Exception:
        log.exception("the tracer of call %s failed", args[1])
        return (1, ExceptionInfo(), 0.0)


@contextmanager
def _ready(jobs: list[ChildCall], outcomes: list[Any], started: float) -> Iterator[None]:
    for job, outcome in zip(jobs, outcomes, strict=True):
        _prepared[job.task_id] = Prepared(outcome, int(started), max(0.0, started - job.since_ms))
    try:
        yield
    finally:
        for job in jobs:
            _prepared.pop(job.task_id, None)
