"""Sessions on a GPU worker: Celery's side of `worker.session`.

A GPU worker's pool child runs one job at a time, and a generation is long. So a job that
generates is a *session*: while it runs, the worker's main process (`Batcher`) hands it
every call that reaches the worker, any replica's (generating calls one by one, the others
as the batches it formed), over a `Channel`: a Unix `SOCK_SEQPACKET` socket pair made before
the pool forks, one whole message per read, so a child killed mid-read leaves no half
message for the next. The child interleaves them: a call of another model runs between two
decode steps, not after the longest generation (`worker.session`).

Each call is settled as it ends, not when the session does: its Celery tracer runs in the
child (which stores its result, so its caller has the answer then), and the child tells
the main process over the same channel, which settles that request as the pool's callback
would (`acks_late`: acknowledged once its result is stored). So no message of a finished
call waits unacknowledged for the session (it would hold the worker's prefetch, and the
broker would deliver it again after the visibility timeout), and a session may run as long
as calls keep coming. A child lost mid-session fails the job with `WorkerLostError`, which
puts every call it still held back in the queue. A call handed over as the session was
ending, which the child never read, is given back to the batcher and runs in the next job;
the child drops such a stale message by its session id. An answer too large for the
channel travels in the job's own return instead.

The main process hands a session no redelivered call (it runs alone, as in batches), no
call that waits behind one it may not hand over (order is kept), and no call whose time
limit would outlive the session's (`Job.joinable`). It forwards a Celery `revoke` of a
running call to the child, which stops that call within a step; the call then ends as
revoked.
"""

from __future__ import annotations

import functools
import logging
import math
import pickle
import select
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

from celery.exceptions import TimeLimitExceeded

from placement.rules.batching import BatchLimits, Waiting, input_chars, take_batch
from tasks.serving.batch_jobs import ran_already, run_one
from tasks.serving.calls import Call

if TYPE_CHECKING:  # GPU workers only: they import torch
    from worker.generation.serving import GenCall
    from worker.session import OneShot

log = logging.getLogger(__name__)

MAX_MESSAGE = 4 * 2**20  # bytes of one message at most; a larger call waits for a new job
_BUFFER = 8 * 2**20
REVOKED = "gpufleet-revoked"  # a job's return for a call it stopped because it was revoked
SETTLED = "settled"  # the child's message: ("settled", session id, {key: tracer return})


class Channel:
    """The worker main process's line to its pool child, both ways (see the module)."""

    def __init__(self) -> None:
        self._parent, self._child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (self._parent, self._child):
            end.setblocking(False)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)
        # The kernel caps the buffer (net.core.wmem_max, 208 KiB on many hosts) and reports
        # twice what it keeps; one message must fit what it keeps.
        sent = self._parent.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        self.limit = min(MAX_MESSAGE, sent // 2)  # the largest message, in bytes

    def encode(self, message: tuple[Any, ...]) -> bytes:
        """`message` as `send_encoded` sends it (its size says whether it fits `limit`)."""
        return pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)

    def send(self, message: tuple[Any, ...]) -> bool:
        """From the main process; False when the message cannot go now (too large, or the
        child's side is full), never blocking."""
        return self.send_encoded(self.encode(message))

    def send_encoded(self, data: bytes) -> bool:
        """`send` for a message `encode` made."""
        return _send(self._parent, data, self.limit)

    def receive(self, wait: float) -> list[tuple[Any, ...]]:
        """In the child: every message waiting (after up to `wait` s for a first one)."""
        return _receive(self._child, wait)

    def tell_parent(self, message: tuple[Any, ...]) -> bool:
        """From the child; False when the message cannot go now, never blocking."""
        return _send(self._child, self.encode(message), self.limit)

    def from_child(self) -> list[tuple[Any, ...]]:
        """In the main process: every message the child sent, without waiting."""
        return _receive(self._parent, 0.0)


def _send(end: socket.socket, data: bytes, limit: int) -> bool:
    if len(data) > limit:
        return False
    try:
        end.send(data)
    except OSError:
        return False
    return True


def _receive(end: socket.socket, wait: float) -> list[tuple[Any, ...]]:
    messages = []
    ready, _, _ = select.select([end], [], [], wait)
    while ready:
        try:
            # MSG_TRUNC makes a peek of one byte say the whole message's length
            size = end.recv_into(bytearray(1), 1, socket.MSG_PEEK | socket.MSG_TRUNC)
            data = end.recv(max(size, 1))
        except BlockingIOError:
            break
        # Our own processes wrote it, as billiard pickles jobs to the same child.
        messages.append(pickle.loads(data))
        ready, _, _ = select.select([end], [], [], 0)
    return messages


@dataclass
class Job:
    """A session the child runs, as the main process sees it. It has no pool time limit:
    it runs as long as calls come, and each call's own limit holds in the child (a
    generating call's at every step, a batched call's before its pass)."""

    requests: dict[str, Any]  # a message's key -> its `batching.Held`, until settled
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    accepted: tuple[int, float] | None = None  # the child's pid and when, once it took it
    alone: bool = False  # it runs a redelivered call, which may have killed the last child
    told: dict[str, float] = field(default_factory=dict)  # revoked call's key -> when told

    @property
    def joinable(self) -> bool:
        """Whether calls may join it now: once the child took it (a job queued behind a
        session of a lost connection would have that one drop them as stale), and never
        beside a redelivered call."""
        return self.accepted is not None and not self.alone


# ---------------------------------------------------------------------------------------
# In the child


_Finish = Callable[[Any, Any, Any, bool], Any]  # (ChildCall, GenCall, outcome, revoked)
_Batch = Callable[[list[Any], BaseException | None], dict[str, Any]]  # (calls, error) -> returns


class Figures(Protocol):
    """What a session says of its engines as it runs (`worker.session.SessionFeed`'s)."""

    def opened(self, replica: str, gpus: list[str]) -> None: ...

    def stepped(
        self, replica: str, calls: int, held_tokens: int, figures: Callable[[], dict[str, float]]
    ) -> None: ...

    def streamed(self) -> None: ...


class ChildFeed:
    """A `worker.session.SessionFeed` of a session's calls: the ones it was sent with, then
    those its main process hands over while it runs. Settles each call as it ends (see
    the module); `results` keeps what the channel could not carry."""

    def __init__(  # noqa: PLR0917 - a job and the callbacks it is run with
        self,
        job_id: str,
        jobs: list[Any],
        channel: Channel | None,
        gen_call: Callable[[Any], GenCall],
        one_shot: Callable[..., OneShot],
        finish: _Finish,
        batch: _Batch,
        limits_of: Callable[[str], BatchLimits],
        figures: Figures | None = None,
        ran_before: Callable[[list[Any]], set[str]] = lambda jobs: set(),
    ) -> None:
        self.job_id = job_id
        self._channel = channel
        self._gen_call = gen_call  # a generating call's `ChildCall` -> its GenCall (its key)
        self._one_shot = one_shot  # OneShot's constructor (replica, epoch, run, fail)
        self._finish = finish  # runs a generating call's tracer: its return
        self._batch = batch  # runs a batch's tracers (with an error: unrun): their returns
        self._limits_of = limits_of  # a model's batch limits
        self.figures = figures  # opened/stepped/streamed, as `SessionFeed` has them
        self._ran_before = ran_before  # the task ids among `ChildCall`s whose answers are stored
        self._jobs: dict[str, Any] = {}  # a generating call's key -> its `ChildCall`
        self._new: list[GenCall | OneShot] = []
        self._arrivals: list[Waiting[Any]] = []  # calls to batch, taken this turn
        self._unrun: dict[int, list[Any]] = {}  # batches formed and not run yet
        self._cancelled: list[str] = []
        self._revoked: set[str] = set()
        self._unsent: dict[str, Any] = {}  # ended calls the channel had no room to tell of
        self.results: dict[str, Any] = {}
        for job in jobs:
            self._arrived(job)

    def take(self, wait: float) -> list[GenCall | OneShot]:
        self._tell()
        if self._channel is not None:
            waiting = not (self._new or self._arrivals)
            for message in self._channel.receive(wait if waiting else 0.0):
                self._read(message)
        self._form_batches()
        new, self._new = self._new, []
        return new

    def _read(self, message: tuple[Any, ...]) -> None:
        kind, job_id, payload = message
        if job_id != self.job_id:
            log.debug("dropped a %s message of an ended job", kind)
            return
        if kind == "cancel":
            self._cancelled.append(payload)
            self._revoked.add(payload)
        else:
            self._arrived(payload)

    def _arrived(self, payload: Any) -> None:
        """A generating call's `ChildCall`, or a batch: its group and its `ChildCall`s."""
        if not isinstance(payload, dict):
            if payload.again and payload.task_id in self._ran_before([payload]):
                # it ran before (`ChildCall.again`): acknowledged unrun, its answer stands
                ignored = run_one(payload.trace, payload.args, ran_already(), 0, 0)
                self._settle({payload.key: ignored})
                return
            call = self._gen_call(payload)
            self._jobs[call.key] = payload
            self._new.append(call)
            return
        for job in payload["jobs"]:
            chars = input_chars(Call.from_json(job.call).inputs)
            self._arrivals.append(Waiting(job, tuple(payload["group"]), chars, job.since_ms))

    def _form_batches(self) -> None:
        """The calls to batch that arrived together, in batches as the main process forms
        them (`placement.rules.batching`): what queued during a step shares one pass."""
        while self._arrivals:
            picked, _ = take_batch(self._arrivals, self._limits, math.inf)
            chosen = set(picked)
            jobs = [self._arrivals[i].item for i in picked]
            self._arrivals = [w for i, w in enumerate(self._arrivals) if i not in chosen]
            self._unrun[id(jobs)] = jobs
            first = Call.from_json(jobs[0].call)
            self._new.append(
                self._one_shot(
                    first.replica,
                    first.epoch,
                    functools.partial(self._run, jobs, None),
                    functools.partial(self._run, jobs),
                )
            )

    def _limits(self, entry: Waiting[Any]) -> BatchLimits:
        return self._limits_of(Call.from_json(entry.item.call).model)

    def _run(self, batch: list[Any], error: BaseException | None) -> None:
        if self._unrun.pop(id(batch), None) is None:
            return
        try:
            returns = self._batch(batch, error)
        except Exception as exc:  # not the model's (its errors are its calls'): say so to them
            log.exception("could not run a batch of %d call(s)", len(batch))
            returns = self._batch(batch, exc)
        self._settle(returns)

    def cancelled(self) -> Iterable[str]:
        cancelled, self._cancelled = self._cancelled, []
        return cancelled

    def finished(self, call: GenCall, outcome: Any) -> None:
        job = self._jobs[call.key]
        revoked = call.key in self._revoked
        if not revoked and getattr(outcome, "cancelled", False) and _past(call.deadline):
            outcome = TimeLimitExceeded("the call ran past its time limit")
        answer = self._finish(job, call, outcome, revoked)
        del self._jobs[call.key]  # answered: a failure above left it to `unanswered`
        self._settle({call.key: REVOKED if revoked else answer})

    def _settle(self, returns: dict[str, Any]) -> None:
        """Tell the main process these calls ended (at the next turn, if the channel has no
        room now; in the job's return, if it never has)."""
        self._unsent.update(returns)
        self._tell()

    def _tell(self) -> None:
        if not self._unsent or self._channel is None:
            return
        if self._channel.tell_parent((SETTLED, self.job_id, self._unsent)):
            self._unsent = {}
            return
        for key in list(self._unsent):  # too large together (or no room): one at a time
            if not self._channel.tell_parent((SETTLED, self.job_id, {key: self._unsent[key]})):
                return
            del self._unsent[key]

    def leftover(self) -> dict[str, Any]:
        """As the session ends: what it must return, the ended calls it could not tell of."""
        self._tell()
        self.results.update(self._unsent)
        self._unsent = {}
        return self.results

    def more(self) -> bool:
        return False

    def opened(self, replica: str, gpus: list[str]) -> None:
        if self.figures is not None:
            self.figures.opened(replica, gpus)

    def stepped(
        self, replica: str, calls: int, held_tokens: int, figures: Callable[[], dict[str, float]]
    ) -> None:
        if self.figures is not None:
            self.figures.stepped(replica, calls, held_tokens, figures)

    def streamed(self) -> None:
        if self.figures is not None:
            self.figures.streamed()

    def unanswered(self, error: BaseException) -> None:
        """Fail every call the session holds and has not answered (it failed itself)."""
        self._form_batches()
        self._new = []
        for key in list(self._jobs):
            revoked = key in self._revoked  # stopped by its revoke: announced so, as it ends
            answer = self._finish(self._jobs.pop(key), None, error, revoked)
            self._settle({key: REVOKED if revoked else answer})
        for batch in list(self._unrun.values()):
            self._run(batch, error)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
