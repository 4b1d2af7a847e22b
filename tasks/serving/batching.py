"""Batched calls on a GPU worker: Celery's side of `placement.rules.batching`.

A GPU worker's pool has one child, which runs one job at a time. Celery's consumer, in the
worker's main process, hands each call it receives to `Batcher` instead of the pool. The
batcher keeps the calls while the child is busy and, each time the child is free, sends it
one job: the first call in line and the calls for the same replica behind it
(`placement.rules.batching.take_batch`). The line is the calls' arrival order while one
tenant sends them; when tenants compete, each call's place is its start tag
(`placement.rules.fairness`, a call costing its inputs), so their calls are served in
proportion to their weights, and a call of a tenant with nothing waiting passes another
tenant's backlog. Then it waits only for the job running, so while the fleet has tenants a
job is also bounded in time (`placement.rules.batching.JOB_MS`, by what the replica's last
jobs took), even while one tenant sends alone; in a fleet without tenants a later call
waits for every call before it whatever the jobs' size, and a bound would only cost
throughput (bench.batching's 32 MiniLM callers got 137 calls/s with a 50 ms bound
against 194 without, on the 2-core test machine). The job (`tasks.serving.batch_jobs`,
in the child) computes every call's outputs in shared forward passes first
(`GpuWorker.serve_batch`), then runs each call's own Celery tracer in turn, which finds its
outputs ready (`take_prepared`): each call keeps its own message, task id, events, result
and request lease.

Acknowledgement stays Celery's, per call: the job's accept, success and failure
callbacks call each request's own. So acks_late holds, and a child killed mid-batch
fails the job with `WorkerLostError`, which makes every request of the batch reject
its message back to the queue (`task_reject_on_worker_lost`): no call is lost.

While the child runs a session (a job that generates: `tasks.serving.generating`), the
batcher hands it every call it can, generating ones one by one and the others in the
batches it forms as usual, so that they run between two decode steps rather than after
the longest generation.

Each message the batcher holds has a key of its own (`Held.key`): a task id may reach
a worker twice, and keyed by it one call's answer settled another's message, which left
request leases pinning the replica for minutes (a caller that reused one id). A call
routed again comes back under its task id too, one hop further, possibly before its first
message is settled. So the worker tells the two apart by (task id, hops) (`Held.twin`): a
second message of a call it holds at the same hop, a caller's reuse of the id, is dropped
at once, its request lease ended, and the call held answers for both (they share one
result); a call routed again is its own call.

Why not `celery-batches`: it flushes on a timer rather than when the GPU is free,
mixes every replica's calls in one list, leaves the messages of a lost child unacked
until the visibility timeout, and leaves results and events to the task. See
docs/tasks.md, "Batched calls".
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import logging
import math
import threading
import time
import uuid
from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from celery.app import trace as celery_trace
from celery.worker.state import active_requests, task_ready
from celery.worker.state import revoked as revoked_tasks

from placement.ledger.tenancy.tenants import DEFAULT
from placement.rules.batching import (
    BatchLimits,
    JobCost,
    Waiting,
    input_chars,
    input_rows,
    take_batch,
)
from placement.rules.fairness import FairOrder
from tasks.broker import quarantine
from tasks.broker.intake import redelivered
from tasks.serving import generating, leases
from tasks.serving.batch_jobs import ChildCall
from tasks.serving.calls import Call, call_of, tenant_of
from worker.generation.params import MAX_ROWS

if TYPE_CHECKING:
    pass  # GPU workers only: it imports torch

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)
class Held:
    """A message the batcher holds: its request, its call, and a key of its own."""

    request: Any
    call: Call
    key: str
    #: put back in line as its job was let go with the connection (`Batcher.forget`), or
    #: as its session ended without a word of it (`Batcher._session_ended`): that job or
    #: session may have run it in the child all the same
    again: bool = False

    @property
    def may_have_run(self) -> bool:
        """Put back (`again`) or given back by the broker: its answer is looked up before
        it runs (`batch_jobs.ran_before`)."""
        return self.again or redelivered(self.request)

    @property
    def twin(self) -> tuple[str, int]:
        """What a second message of the same call at the same hop shares (the module)."""
        return self.request.id, self.call.hops


GENERATE = "generate"  # the last part of a generating call's group
WATCH_S = 0.05  # how often a session's ended calls are settled and its revokes told
#: Replicas whose job costs a batcher keeps (`Batcher._cost`): more than a GPU holds at
#: once; a placement's replica id is new each time, so older ones are dropped. Not tuned.
COSTS_KEPT = 64
RETELL_S = 1.0  # how often the child is told again of a revoke it has not acted on


@dataclass(frozen=True)
class Generations:
    """How a GPU worker runs generating calls (`tasks.serving.generating`)."""

    generates: Callable[[str], bool]  # whether a model's calls generate
    job: Callable[..., Any]  # the pool job of a session (importable)
    channel: Callable[[], generating.Channel | None]


class Batcher:
    """The worker main process's hold on calls waiting for the pool child (see the module).

    `handle` is what Celery would have done with a request: it gets the ones this batcher
    does not batch (other tasks, calls it cannot read, and, on a worker whose models do not
    generate, models with batching off; where they do, those run as batches of one, so
    that a session takes them too).
    """

    def __init__(  # noqa: PLR0917 - the worker's parts it works with
        self,
        pool: Any,
        timer: Any,
        handle: Callable[[Any], Any],
        limits_of: Callable[[str], BatchLimits],
        job: Callable[[list[ChildCall]], list[Any]],
        generations: Generations | None = None,
        weight_of: Callable[[str], float] | None = None,
        tenanted: Callable[[], bool] = lambda: False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._pool = pool
        self._timer = timer
        self._handle = handle
        self._limits_of = limits_of
        self._job = job  # runs a batch in the child: importable, so the pool can send it
        self._gen = generations
        self._weight_of = weight_of or (lambda tenant: 1.0)
        self._fair = FairOrder()  # the line's order when tenants compete (the module)
        self._costs: dict[str, JobCost] = {}  # by replica: what its jobs take (`_send`)
        self._tenanted = tenanted  # whether the fleet has tenants: jobs are then bounded
        self._clock = clock  # the pool's clock (billiard's `time_accepted`): time.monotonic
        self._session: generating.Job | None = None  # the session running, if one is
        self._sessions: dict[str, generating.Job] = {}  # by id, until each ends
        self._watch: Any = None  # the timer entry that settles calls and forwards revokes
        self._waiting: list[Waiting[Held]] = []
        self._twins: dict[tuple[str, int], Held] = {}  # `Held.twin` -> the one held
        self._keys = itertools.count()
        self._busy = False
        self._unstarted: list[Held] = []  # the calls of the job the child has yet to accept
        self._connection = 0  # counts lost connections: a job tells whose it was
        self._wake: Any = None  # the timer entry of a batch waiting to fill
        self._lock = threading.RLock()

    def __call__(self, request: Any) -> None:
        call = _call_of(request)
        generates = call is not None and self._gen is not None and self._gen.generates(call.model)
        # Where calls generate, every call comes here, batched or not: a session takes it.
        if call is None or (self._gen is None and not self._limits_of(call.model).on):
            self._handle(request)
            return
        # A redelivered call may be what killed the last child: it runs alone this time.
        # Calls share a pass only with calls of the same time limits, the batch's own.
        limits = tuple(request.time_limits)
        alone = request.id if redelivered(request) else ""
        group: tuple[Any, ...] = (call.replica, call.epoch, alone)
        group += (GENERATE,) if generates else (limits,)
        with self._lock:
            held = Held(request, call, f"{request.id}/{next(self._keys)}")
            first = self._twins.get(held.twin)
            if first is not None:
                self._refuse_twin(held, first)
                return
            self._twins[held.twin] = held
            tenant = tenant_of(request)
            rows = input_rows(call.inputs)
            start = self._fair.arrive(tenant, self._weight_of(tenant), rows)
            chars = input_chars(call.inputs)
            entry = Waiting(held, group, chars, time.time() * 1000, start)
            bisect.insort_right(self._waiting, entry, key=_in_line)
            self._next()

    def _refuse_twin(self, held: Held, first: Held) -> None:
        """Drop `held`, a second message of `first`'s call (see the module). The same
        message delivered again (the broker restored it while it was held) is left to its
        first delivery, whose acknowledgement and lease it shares."""
        task_ready(held.request)  # Celery's strategy reserved it
        if _tag(held.request) is not None and _tag(held.request) == _tag(first.request):
            log.warning("call %s was delivered again while it is held here", held.request.id)
            return
        log.warning(
            "dropped a second message of call %s: a call with that task id runs here, and its "
            "answer is the id's; send each call with a task id of its own",
            held.request.id,
        )
        lease, held_lease = held.call.lease, first.call.lease
        if lease is not None and (held_lease is None or lease.id != held_lease.id):
            leases.end(lease)
        held.request.reject(requeue=False)

    def _let_go(self, held: Held) -> None:
        """`held` is settled: a message of its call at its hop is a call again."""
        if self._twins.get(held.twin) is held:
            del self._twins[held.twin]

    def forget(self) -> None:
        """Drop the calls held here that never started, unacked: the consumer lost its
        connection, so the broker delivers them again (as Celery does with the requests it
        reserved). A call a session was handed and never read (`_session_ended`) counts
        as running, so its message is not given back: it stays, to run next. The job the
        child may be running is let go too: Celery's pool drops a job whose start it has
        not heard of yet without calling it back (`on_close` flushes it right after), and
        waiting for that job would hold every later call here; the calls of that job that
        count as running go back to the head of the line, to run next. The child may have
        taken that job before the pool let it go, and run it: the next job's child runs
        those calls only if their answers are not stored by then (`Held.again`,
        `batch_jobs.run_batch`)."""
        with self._lock:
            if self._busy:
                log.info(
                    "broker connection lost while a batch ran: later calls will not wait for it"
                )
            dropped = [
                dataclasses.replace(h, again=True)
                for h in self._unstarted
                if h.request in active_requests
            ]
            self._waiting = [self._entry(h) for h in dropped] + [
                w for w in self._waiting if w.item.request in active_requests
            ]
            self._unstarted = []
            if self._session is not None and self._session.accepted is None:
                self._sessions.pop(self._session.id, None)  # dropped: it never ends
                if not self._sessions and self._watch is not None:
                    self._watch.cancel()
                    self._watch = None
            self._twins = {w.item.twin: w.item for w in self._waiting}
            self._busy = False
            self._connection += 1
            if self._wake is not None:
                self._wake.cancel()
                self._wake = None
            self._session = None  # a session of the lost connection settles what it ends

    def _limits(self, entry: Waiting[Held]) -> BatchLimits:
        return self._limits_of(entry.item.call.model)

    def _cost(self, entry: Waiting[Held]) -> JobCost:
        """What jobs of `entry`'s replica take: while the fleet has tenants, it bounds the
        next one (`JOB_MS`), so that another tenant's call waits one short job; without
        them, calls are served in arrival order, and a bound would only cost throughput
        (see the module). Only the `COSTS_KEPT` replicas last batched are kept."""
        replica = entry.item.call.replica
        cost = self._costs.pop(replica, None) or JobCost()
        self._costs[replica] = cost  # the newest last
        while len(self._costs) > COSTS_KEPT:
            del self._costs[next(iter(self._costs))]
        return cost

    def _next(self) -> None:
        """Send the next batch to the child when it is free and a batch is due; while it
        runs a session, hand the session what it may take, in order."""
        while self._waiting and (not self._busy or self._session is not None):
            head = self._waiting[0].group
            generation = _generates(head)
            if generation:  # every call waiting for that replica, at once
                picked = [i for i, w in enumerate(self._waiting) if w.group == head][:MAX_ROWS]
                due = None
                if self._busy:
                    picked = picked[:1]  # a session takes them one by one
            else:  # a session takes a batch at once: it would only wait for the GPU
                now = math.inf if self._busy else time.time() * 1000
                bound = self._cost if self._tenanted() else lambda _: None
                picked, due = take_batch(self._waiting, self._limits, now, bound)
            if not picked:
                if due is not None:
                    self._wake_at(due)
                return
            self._fair.serve(self._waiting[picked[0]].order)
            if self._busy:  # a session's: the revoked ones leave, the others go to it
                revoked = {i for i in picked if self._dropped_revoked(self._waiting[i].item)}
                kept = [i for i in picked if i not in revoked]
                handed = self._hand_over([self._waiting[i] for i in kept], generation)
                gone = revoked | set(kept[:handed])
                self._waiting = [w for i, w in enumerate(self._waiting) if i not in gone]
                if kept and not handed:
                    return  # it waits for the session, and so does all behind it (order)
                continue
            batch = [self._waiting[i] for i in picked]
            chosen = set(picked)
            self._waiting = [w for i, w in enumerate(self._waiting) if i not in chosen]
            live = [w for w in batch if not self._dropped_revoked(w.item)]
            if live and generation:
                self._send_generation(live)
            elif live:
                self._send(live)

    def _dropped_revoked(self, held: Held) -> bool:
        """Whether `held` was revoked (Celery acknowledges and announces it there)."""
        if held.request.revoked():
            self._let_go(held)
            return True
        return False

    def _wake_at(self, due_ms: float) -> None:
        if self._wake is not None:
            self._wake.cancel()
        delay = max(0.0, due_ms / 1000 - time.time())
        self._wake = self._timer.call_after(delay, self._woken)

    def _woken(self) -> None:
        with self._lock:
            self._wake = None
            self._next()

    def _send(self, batch: list[Waiting[Held]]) -> None:
        """Send `batch` to the child as one job; when it ends, its time from the child's
        taking it teaches its replica's `JobCost`."""
        helds = [w.item for w in batch]
        cost, chars = self._cost(batch[0]), sum(w.chars for w in batch)
        began: list[float] = []  # the child's time.monotonic() as it took the job
        requests = [h.request for h in helds]
        jobs = [_child_call(w.item, w.since_ms) for w in batch]
        first = requests[0]
        hard, soft = first.time_limits  # every call of a batch has the same (`__call__`)
        self._busy = True
        self._unstarted = helds
        connection = self._connection

        def accepted(pid: int, time_accepted: float) -> None:
            began.append(time_accepted)  # not this loop's now: it may read the end with it
            self._started(helds)
            for request in requests:
                request.on_accepted(pid, time_accepted)

        def done(results: list[Any]) -> None:
            if began:
                cost.ran(len(helds), chars, (self._clock() - began[0]) * 1000)
            self._finished(lambda i, r: r.on_success(results[i]), helds, connection)

        def failed(exc_info: Any) -> None:
            self._finished(lambda _, r: r.on_failure(exc_info), helds, connection)

        def timed_out(is_soft: bool, timeout: float) -> None:
            for request in requests:  # as Celery does for one: warn, or fail it
                request.on_timeout(is_soft, timeout)

        try:
            with quarantine.in_hand(r.id for r in requests):  # pickled for the pool here
                self._pool.apply_async(
                    self._job,
                    args=(jobs,),
                    accept_callback=accepted,
                    callback=done,
                    error_callback=failed,
                    timeout_callback=timed_out,
                    soft_timeout=soft or first.task.soft_time_limit,
                    timeout=hard or first.task.time_limit,
                    correlation_id=uuid.uuid4().hex,
                )
        except BaseException:
            self._busy = False
            self._unstarted = []
            raise

    def _started(self, helds: list[Held]) -> None:
        """The child accepted the job of `helds`: the pool no longer drops it (`forget`)."""
        with self._lock:
            if self._unstarted is helds:
                self._unstarted = []

    # --- sessions (tasks.serving.generating) ----------------------------------------

    def _hand_over(self, batch: list[Waiting[Held]], generation: bool) -> int:
        """Hand the running session one generating call, or as much of one batch as one
        message holds: how many calls it took (0: none now; a call that may have run, a
        session not started yet or alone, a full channel, or one call too large to hand
        over)."""
        job, gen = self._session, self._gen
        channel = gen.channel() if gen is not None else None
        if not batch or job is None or channel is None or not job.joinable:
            return 0
        if any(w.item.may_have_run for w in batch):
            return 0  # it may have run: the next job looks for its answer as it starts
        count = len(batch)
        while count:
            handed = batch[:count]
            payload: Any = (
                _child_call(
                    handed[0].item, handed[0].since_ms, timed=True, share=self._share(handed[0])
                )
                if generation
                else {"group": handed[0].group,
                      "jobs": [_child_call(w.item, w.since_ms, timed=True) for w in handed]}
            )  # fmt: skip
            data = channel.encode(("call", job.id, payload))
            if len(data) <= channel.limit:
                break
            count //= 2  # too large for one message: fewer calls
        if not count:
            return 0
        with quarantine.in_hand(w.item.request.id for w in handed):
            if not channel.send_encoded(data):
                return 0  # the child's side is full: tried again at the next look
        for w in handed:
            job.requests[w.item.key] = w.item
            if job.accepted is not None:
                w.item.request.on_accepted(*job.accepted)
        return count

    def _send_generation(self, batch: list[Waiting[Held]]) -> None:
        """Start a session with the generating calls `batch` (the next ones go to it once
        the child took it)."""
        gen = self._gen
        assert gen is not None
        job = generating.Job({w.item.key: w.item for w in batch})
        job.alone = any(redelivered(w.item.request) for w in batch)  # alone, as in batches
        jobs = [_child_call(w.item, w.since_ms, timed=True, share=self._share(w)) for w in batch]
        self._busy = True
        self._session = job
        self._sessions[job.id] = job
        helds = [w.item for w in batch]
        self._unstarted = helds
        connection = self._connection

        def accepted(pid: int, time_accepted: float) -> None:
            job.accepted = (pid, time_accepted)
            self._started(helds)
            for held in list(job.requests.values()):
                held.request.on_accepted(pid, time_accepted)
            with self._lock:
                self._next()  # what waited for it to start goes to it now

        def done(results: dict[str, Any]) -> None:
            self._session_ended(job, connection, results, None)

        def failed(exc_info: Any) -> None:
            self._session_ended(job, connection, {}, exc_info)

        try:
            with quarantine.in_hand(w.item.request.id for w in batch):
                self._pool.apply_async(
                    gen.job,
                    args=(job.id, jobs),
                    accept_callback=accepted,
                    callback=done,
                    error_callback=failed,
                    correlation_id=uuid.uuid4().hex,
                )  # no pool limit: each call's own limit ends it in the child
        except BaseException:
            self._busy = False
            self._session = None
            self._unstarted = []
            del self._sessions[job.id]
            raise
        if self._watch is None:
            self._watch = self._timer.call_repeatedly(WATCH_S, self._look_at_sessions)

    def _share(self, entry: Waiting[Held]) -> tuple[str, float]:
        """A generating call's share of its engine's rows (`ChildCall.share`)."""
        tenant = tenant_of(entry.item.request)
        return ("", 1.0) if tenant == DEFAULT else (tenant, self._weight_of(tenant))

    def _look_at_sessions(self) -> None:
        """Settle the calls the child says ended, and tell it of the running calls Celery
        revoked (again at every look until the session ends: a session from before a lost
        connection may still hold the child and read, and drop, what was meant for this)."""
        with self._lock:
            self._collect()
            self._next()  # a hand-over the channel had no room for goes again
            job, gen = self._session, self._gen
            if job is None or gen is None or (channel := gen.channel()) is None:
                return
            now = time.monotonic()
            for key, held in job.requests.items():
                told = job.told.get(key)
                due = told is None or now - told >= RETELL_S
                if (
                    held.request.id in revoked_tasks
                    and due
                    and channel.send(("cancel", job.id, key))
                ):
                    job.told[key] = now

    def _collect(self) -> None:
        """Settle what the child said it ended, for every session still known."""
        channel = self._gen.channel() if self._gen is not None else None
        for message in channel.from_child() if channel is not None else ():
            kind, job_id, returns = message
            job = self._sessions.get(job_id)
            if kind != generating.SETTLED or job is None:
                continue
            settled = [(job.requests.pop(k), r) for k, r in returns.items() if k in job.requests]
            self._settle(settled)

    def _settle(self, settled: list[tuple[Held, Any]]) -> None:
        """Settle each (call, tracer return) as the pool's callback would."""

        def each(index: int, request: Any) -> Any:
            outcome = settled[index][1]
            if outcome == generating.REVOKED:
                # Announced as Celery does for a revoked call (even if its id has aged out
                # of the worker's revoked set since: it must be acknowledged and told).
                if not request.revoked():
                    request._announce_revoked("revoked", False, None, False)
                return None
            return request.on_success(outcome)

        self._each(each, [held for held, _ in settled])

    def _session_ended(
        self, job: generating.Job, connection: int, results: dict[str, Any], error: Any
    ) -> None:
        """Settle each call of an ended session; give back the ones it never read."""
        with self._lock:
            self._collect()  # what it told before it returned: read before its return
            self._sessions.pop(job.id, None)
            if self._session is job:
                self._session = None
            if not self._sessions and self._watch is not None:
                self._watch.cancel()
                self._watch = None
            helds: list[Held] = list(job.requests.values())
            unread = [h for h in helds if error is None and h.key not in results]
            # They run next, a lost connection or not: they count as running here, so the
            # reconnected consumer did not give their messages back (tasks.broker.transport).
            # A session that ran one may have lost its word of it with the connection: the
            # next run looks for its answer first (`Held.again`).
            if unread:
                log.debug("%d calls reached a session as it ended: they run next", len(unread))
                again = [dataclasses.replace(h, again=True) for h in unread]
                for held in again:
                    if self._twins.get(held.twin) in unread:
                        self._twins[held.twin] = held
                self._waiting[:0] = [self._entry(h) for h in again]
            if connection == self._connection:
                self._busy = False
        if error is not None:
            self._each(lambda _, r: r.on_failure(error), helds)
        else:
            self._settle([(h, results[h.key]) for h in helds if h not in unread])
        with self._lock:
            self._next()

    def _entry(self, held: Held) -> Waiting[Held]:
        generates = self._gen is not None and self._gen.generates(held.call.model)
        kind = GENERATE if generates else tuple(held.request.time_limits)
        group = (held.call.replica, held.call.epoch, "", kind)
        return Waiting(held, group, input_chars(held.call.inputs), time.time() * 1000)

    def _finished(
        self, each: Callable[[int, Any], Any], helds: list[Held], connection: int
    ) -> None:
        """The child ended a batch job: tell each request how its call went, then go on.
        A job sent before a lost connection does not free the child for the jobs sent since."""
        with self._lock:
            if connection == self._connection:
                self._busy = False
        self._each(each, helds)
        with self._lock:
            self._next()

    def _each(self, each: Callable[[int, Any], Any], helds: list[Held]) -> None:
        """`each(index, request)` for every call, which this worker then no longer holds;
        an error settles the others first (Celery's signal to stop, raised last)."""
        stop: BaseException | None = None
        for index, held in enumerate(helds):
            with self._lock:
                self._let_go(held)
            try:
                each(index, held.request)
            except (SystemExit, KeyboardInterrupt) as exc:  # Celery's signal to stop
                stop = exc
            except Exception:
                log.exception("could not settle call %s of a batch", held.request.id)
        if stop is not None:
            raise stop


def _in_line(entry: Waiting[Held]) -> float:
    """An entry's place in the line (`Waiting.order`)."""
    return entry.order


def _call_of(request: Any) -> Call | None:
    try:
        return call_of(request.name, request.args, request.kwargs, request.request_dict)
    except Exception:  # a body Celery cannot decode: Celery's own path reports it
        return None


def _child_call(
    held: Held, since_ms: float, *, timed: bool = False, share: tuple[str, float] = ("", 1.0)
) -> ChildCall:
    """What the child needs to run `held` as Celery would (`ChildCall`); `timed`: with the
    end of its hard time limit, counted from now, which a session keeps (it has no pool
    limit); `share`: a generating call's share of its engine's rows."""
    request = held.request
    trace = (
        celery_trace.fast_trace_task
        if request._app.use_fast_trace_task
        else celery_trace.trace_task_ret
    )
    args = (
        request.type,
        request.id,
        request.request_dict,
        request.body,
        request.content_type,
        request.content_encoding,
    )
    hard = _hard(request) if timed else None
    deadline = time.time() + hard if hard is not None else None
    return ChildCall(
        trace, args, held.call.as_json(), since_ms, held.key, deadline, share, held.may_have_run
    )


def _tag(request: Any) -> Any:
    """A request's delivery tag (None where it has no message)."""
    return getattr(getattr(request, "message", None), "delivery_tag", None)


def _generates(group: Hashable) -> bool:
    """Whether a waiting call's group is a generating call's."""
    return isinstance(group, tuple) and bool(group) and group[-1] == GENERATE


def _hard(request: Any) -> float | None:
    """A call's hard time limit in seconds: its own, else its task's (None: none)."""
    hard: float | None = request.time_limits[0] or request.task.time_limit
    return hard
