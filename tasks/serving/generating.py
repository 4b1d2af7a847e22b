"""Generating calls on a GPU worker: Celery's side of `worker.generation`.

A GPU worker's pool child runs one job at a time, and a generation is long: a job that ran
only the calls it started with would make every later call wait for its longest one. So a
generation job stays open: while it runs, the worker's main process (`Batcher`) hands the
calls that arrive for the same replica straight to it, over a `Channel` (a Unix
`SOCK_SEQPACKET` socket pair made before the pool forks: one whole message per read, so a
child killed mid-read leaves no half message for the next), and they join the running batch
at its next step. Each call's own Celery tracer runs in the child as soon as its generation
ends, so its result is stored then, not when the job ends.

Acknowledgement stays Celery's, per call, as for batches (`tasks.serving.batching`): the
job's callbacks settle every call it ran (acks_late), and a child lost mid-job fails the
job with `WorkerLostError`, which puts every call it held back in the queue. A call handed
over as the job was ending, which the child never read, is given back to the batcher and
runs in the next job; the child drops such a stale message by its job id.

The main process stops handing calls to a job once other calls wait (they go next: a long
stream of generations never starves another model), once the job is older than a quarter
of the broker's visibility timeout (a message is not left unacknowledged until the broker
delivers it again), and for redelivered calls (which run alone, as in batches). It forwards
a Celery `revoke` of a running call to the child, which stops that call within a step; the
call then ends as revoked.
"""

from __future__ import annotations

import logging
import pickle
import select
import socket
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from celery.exceptions import TimeLimitExceeded

from tasks.serving.calls import Call

log = logging.getLogger(__name__)

MAX_MESSAGE = 4 * 2**20  # bytes of one handed-over call; a larger one waits for a new job
_BUFFER = 8 * 2**20
REVOKED = "gpufleet-revoked"  # a job's return for a call it stopped because it was revoked


class Channel:
    """The worker main process's line to its pool child (see the module)."""

    def __init__(self) -> None:
        self._parent, self._child = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        for end in (self._parent, self._child):
            end.setblocking(False)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, _BUFFER)
            end.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _BUFFER)

    def send(self, message: tuple[Any, ...]) -> bool:
        """From the main process; False when the message cannot go now (too large, or the
        child's side is full), never blocking."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > MAX_MESSAGE:
            return False
        try:
            self._parent.send(data)
        except OSError:
            return False
        return True

    def receive(self, wait: float) -> list[tuple[Any, ...]]:
        """In the child: every message waiting (after up to `wait` s for a first one)."""
        messages = []
        ready, _, _ = select.select([self._child], [], [], wait)
        while ready:
            try:
                # MSG_TRUNC makes a peek of one byte say the whole message's length
                size = self._child.recv_into(bytearray(1), 1, socket.MSG_PEEK | socket.MSG_TRUNC)
                data = self._child.recv(max(size, 1))
            except BlockingIOError:
                break
            # Our own main process wrote it, as billiard pickles jobs to the same child.
            messages.append(pickle.loads(data))
            ready, _, _ = select.select([self._child], [], [], 0)
        return messages


@dataclass
class Job:
    """A generation job the child runs, as the main process sees it."""

    replica: str
    epoch: int
    requests: list[Any]
    id: str = field(default_factory=lambda: uuid.uuid4().hex)
    started: float = field(default_factory=time.monotonic)
    accepted: tuple[int, float] | None = None  # the child's pid and when, once it took it
    timeout: float | None = None  # the pool's hard limit on the whole job (None: none)
    told: dict[str, float] = field(default_factory=dict)  # revoked call -> when last told

    def joinable(self, call: Call, hard: float | None, window_s: float) -> bool:
        """Whether a call (with hard time limit `hard`) may join: the same placement, the
        job young enough, and the call's limit within what is left of the job's."""
        age = time.monotonic() - self.started
        within = self.timeout is None or (hard is not None and age + hard <= self.timeout)
        return (
            call.replica == self.replica and call.epoch == self.epoch and age < window_s and within
        )


# ---------------------------------------------------------------------------------------
# In the child


_Run = Callable[[list[Any]], Any]


class ChildFeed:
    """A `worker.generation.serving.Feed` of a job's calls: the ones it was sent with, then
    the ones its main process hands over while it runs."""

    def __init__(  # noqa: PLR0917 - a job and the callbacks it is run with
        self,
        job_id: str,
        jobs: list[Any],
        channel: Channel | None,
        gen_call: Callable[[Any], Any],
        finish: Callable[[Any, Any, Any, bool], Any],
        counted: Callable[[int], None] = lambda _: None,
        holding: Callable[[int], None] = lambda _: None,
        streamed: Callable[[], None] = lambda: None,
    ) -> None:
        self.job_id = job_id
        self._channel = channel
        self._gen_call = gen_call  # a job tuple -> (GenCall, its job tuple)
        self._finish = finish  # (job tuple, GenCall, outcome, revoked) -> the tracer's return
        self._counted = counted  # told the calls open after each take, once per step
        self.holding = holding  # told the KV-cache tokens held after each step
        self.streamed = streamed  # told after a step's prefill: send the text so far
        self._new = [gen_call(job) for job in jobs]
        self._jobs: dict[str, Any] = {}
        self._cancelled: list[str] = []
        self._revoked: set[str] = set()
        self.results: dict[str, Any] = {}
        self.open = 0  # calls taken and not answered yet

    def take(self, wait: float) -> list[Any]:
        if self._channel is not None:
            for message in self._channel.receive(wait if not self._new else 0.0):
                self._read(message)
        new, self._new = self._new, []
        for gen_call, job in new:
            self._jobs[gen_call.key] = job
        self.open += len(new)
        self._counted(self.open)
        return [gen_call for gen_call, _ in new]

    def _read(self, message: tuple[Any, ...]) -> None:
        kind, job_id, payload = message
        if job_id != self.job_id:
            log.debug("dropped a %s message of an ended job", kind)
            return
        if kind == "call":
            self._new.append(self._gen_call(payload))
        elif kind == "cancel":
            self._cancelled.append(payload)
            self._revoked.add(payload)

    def cancelled(self) -> Iterable[str]:
        cancelled, self._cancelled = self._cancelled, []
        return cancelled

    def finished(self, call: Any, outcome: Any) -> None:
        self.open -= 1
        job = self._jobs[call.key]
        revoked = call.key in self._revoked
        if not revoked and getattr(outcome, "cancelled", False) and _past(call.deadline):
            outcome = TimeLimitExceeded("the call ran past its time limit")
        answer = self._finish(job, call, outcome, revoked)
        del self._jobs[call.key]  # answered: a failure above left it to `unanswered`
        self.results[call.key] = REVOKED if revoked else answer

    def more(self) -> bool:
        return False

    def unanswered(self, error: BaseException) -> None:
        """Fail every call the job holds and has not answered (the job itself failed)."""
        new, self._new = self._new, []
        for gen_call, job in new:
            self._jobs[gen_call.key] = job
        for key in list(self._jobs):
            self.results[key] = self._finish(self._jobs.pop(key), None, error, False)


def _past(deadline: float | None) -> bool:
    return deadline is not None and time.monotonic() >= deadline
