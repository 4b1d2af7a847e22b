"""The message consumer of every gpufleet worker: Celery's, which also answers a message it
cannot read or may not run and, on a GPU worker, batches calls.

Celery drops a message whose body it may not or cannot decode (a pickled call, broken
JSON) after logging it, and its caller waits until its own timeout. When the task id can
be read from the message's headers (Celery's message protocol 2 keeps it there), this
consumer stores a `PayloadError` as that task's result first, so the caller learns at once
what was wrong.

Only gpufleet's own tasks (`gpufleet.*`) run here. Celery registers its built-in tasks
(`celery.backend_cleanup`, `celery.chord_unlock`, `celery.map`, `celery.starmap`,
`celery.chunks`, `celery.group`, `celery.chain`, `celery.chord`, `celery.accumulate`) in
every app, so any client could otherwise run them on a router or a GPU worker. None is
needed: a client's group, chain or chord of gpufleet tasks is sent by the client as the
member tasks themselves (Celery's canvas runs `group`, `chain` and `chord` in the caller's
process), and with the Redis result backend a chord's body is sent by the worker that
finishes its header's last task (native join, `on_chord_part_return`), never through
`celery.chord_unlock`, which only backends without native join use. `celery.accumulate`
only serves `Task.replace` with a group, and gpufleet replaces a call with one task. The
fleet runs no beat, and Redis expires results itself, so `celery.backend_cleanup` has no
work here either. A call of any other name gets a stored `PayloadError`, like a call it
cannot read, and its message is acknowledged.

Nothing a message holds may stop the worker: each message is checked as it is taken
(`tasks.broker.intake`), and one that fails gets its error stored as its result here, without a
pool job, so that a flood of bad calls does not stand in front of good ones. Any other
error raised while Celery takes a message refuses that message, never the worker.

On a router, a call for a model with a HOT replica is forwarded to its GPU worker from here,
in the worker's main process, without a pool job (`tasks.serving.forwarding`), and so is a
`gpufleet.cancel` answered (`tasks.serving.cancelling`).

On a GPU worker, the calls it receives go to a `tasks.serving.batching.Batcher` rather than
straight to the pool, and the worker reserves enough messages (its prefetch) for two
full batches: one running, the next one gathering.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery.exceptions import InvalidTaskError
from celery.worker import state as worker_state
from celery.worker.consumer import Consumer as CeleryConsumer
from kombu.exceptions import ContentDisallowed, DecodeError

from placement.errors import GpufleetError, PayloadError
from placement.ledger.tenancy.tenants import DEFAULT, call_id, tenant_of
from tasks import context
from tasks.broker import intake, results
from tasks.broker.intake import LEASE_HEADER, is_call_id, is_name
from tasks.config import CANCEL, INFER, PUBLIC_TASKS, is_public
from tasks.serving import batching, forwarding, leases
from tasks.serving.batching import Batcher
from tasks.serving.cancelling import Cancels
from tasks.serving.tenants import quotas, tenancy
from worker.generation.params import MAX_ROWS

log = logging.getLogger(__name__)

RECONNECT_STEP_S = 0.25  # each try at the broker waits this much longer than the last...
RECONNECT_MAX_S = 1.0  # ...up to this

#: The prefix of Celery's built-in tasks, which every app registers and no worker here
#: runs: a gpufleet worker runs its own `gpufleet.*` tasks only (an app built on the same
#: configuration, such as bench/hotpath.py's bare worker, its own).
BUILT_IN = "celery."


class _Strategies(dict[str, Any]):
    """Celery's task name -> strategy map; a name that is no string is an unknown task (a
    dict would raise TypeError for an unhashable one, out of Celery's message handler)."""

    def __getitem__(self, name: Any) -> Any:
        if not isinstance(name, str):
            raise KeyError(name)
        return super().__getitem__(name)


class Consumer(CeleryConsumer):
    """Celery's consumer, failing the result of a message it cannot read or may not run."""

    Strategies = _Strategies

    def __init__(self, on_task_request: Any, *args: Any, **kwargs: Any) -> None:
        if context.role() == "gpu":
            on_task_request = self._batching(on_task_request, kwargs)
        self._batcher = on_task_request if isinstance(on_task_request, Batcher) else None
        super().__init__(on_task_request, *args, **kwargs)
        self._cancels: Cancels | None = None
        if context.role() == "router":
            self._cancels = Cancels(self.app, lambda: self.qos)
            self._every(tenancy.POLL_S, tenancy.follow_queues, self)
            self._every(tenancy.POLL_S, quotas.sweep)
        elif context.role() == "gpu":
            self._every(tenancy.POLL_S, tenancy.follow_worker_queues, self)

    def _every(self, seconds: float, tick: Any, *args: Any) -> None:
        """Run `tick(*args)` every `seconds` in the consumer's loop; one that raises is
        logged and runs again at the next tick."""

        def guarded() -> None:
            try:
                tick(*args)
            except Exception:
                log.exception("%s failed; it runs again in %.0f s", tick.__name__, seconds)

        self.timer.call_repeatedly(seconds, guarded)

    def ensure_connected(self, conn: Any) -> Any:
        """Celery's, but trying the broker again at most a second apart. Celery's default
        waits 2, 4, 6, ... up to 30 s between tries, made for a broker far away; a fleet's
        Redis that restarts (the launcher starts it again at once) then found workers asleep
        for as long as it had been down: calls flowed again 3 to 53 s after it was back, in
        five kills in a row. A refused connection costs microseconds, so the bounds here
        are not tuned (issue 43)."""
        ensure = conn.ensure_connection
        conn.ensure_connection = functools.partial(
            ensure, interval_start=0, interval_step=RECONNECT_STEP_S, interval_max=RECONNECT_MAX_S
        )
        try:
            return super().ensure_connected(conn)
        finally:
            del conn.ensure_connection  # the class's method again

    def on_close(self) -> None:
        if self._batcher is not None:
            self._batcher.forget()
        if self._cancels is not None:
            self._cancels.forget()
        super().on_close()

    @staticmethod
    def _batching(on_task_request: Any, kwargs: dict[str, Any]) -> Any:
        from tasks.serving import gpu  # GPU workers only: it imports torch

        catalog = context.catalog()
        largest = max((gpu.limits_of(name).size for name in catalog), default=1)
        generates = any(gpu.generates(name) for name in catalog)
        if largest <= 1 and not generates:
            return on_task_request
        # Room to hold the next batch while one runs, and calls to join a generation.
        per_process = max(2 * largest, 2 * MAX_ROWS if generates else 0)
        # Celery passed processes x its multiplier; the pool has not started yet.
        multiplier = max(1, kwargs.get("prefetch_multiplier") or 1)
        processes = kwargs.get("initial_prefetch_count", 1) // multiplier
        kwargs["prefetch_multiplier"] = per_process
        kwargs["initial_prefetch_count"] = per_process * max(1, processes)
        generations = batching.Generations(gpu.generates, gpu.session_job, gpu.channel)
        return Batcher(
            kwargs["pool"],
            kwargs["timer"],
            on_task_request,
            gpu.limits_of,
            gpu.batch_job,
            generations if generates else None,
            tenancy.process.weight,
            tenancy.process.tenanted,
        )

    def update_strategies(self) -> None:
        """Celery's, less Celery's built-in tasks: a message for one of those goes to
        `on_unknown_task`, as for a name no one registered. On a router, a call for a HOT
        model is forwarded from here (`tasks.serving.forwarding`), never run in the pool."""
        super().update_strategies()
        for name in [name for name in self.strategies if name.startswith(BUILT_IN)]:
            del self.strategies[name]
        # the channel the task consumer is about to take calls on (Celery's `Tasks`)
        channel = self.connection.default_channel
        channel.refuse = self.refuse_taken
        channel.running = _running_tags
        channel.take_turns(tenancy.queue_tenant, tenancy.process.weight)  # tenants' queues
        if context.role() == "router" and INFER in self.strategies:
            default = self.strategies[INFER]
            self.strategies[INFER] = forwarding.install(channel, default)
        if self._cancels is not None and CANCEL in self.strategies:
            self.strategies[CANCEL] = self._cancels.install(self.timer)
        for name, strategy in list(self.strategies.items()):
            self.strategies[name] = self._guarded(strategy)

    def _guarded(self, strategy: Any) -> Any:
        """`strategy`, run only for a message that passes `tasks.broker.intake.check`; a message
        that fails it, or that makes the strategy raise, is refused (see the module)."""
        tasks = self.app.tasks
        passed_on = (InvalidTaskError, ContentDisallowed, DecodeError, *self.connection_errors)

        def task_message_handler(message: Any, body: Any, *args: Any, **kwargs: Any) -> Any:
            if message.acknowledged:  # a router's, moved on as it took it (forwarded, parked)
                return None
            try:
                intake.check(message, tasks)
            except GpufleetError as exc:
                return self.refuse(message, exc)
            over_quota = quotas.refusal(message)  # a router's, as it took it
            if over_quota is not None:
                return self.refuse(message, over_quota)
            if self._answered_already(message):
                return self._settle_answered(message)
            try:
                return strategy(message, body, *args, **kwargs)
            except passed_on:
                raise  # Celery answers these itself, or reconnects
            except Exception as exc:
                log.exception("could not take call %.60s", message.headers.get("id"))
                if message.acknowledged:
                    return None
                failed = PayloadError(f"gpufleet could not take this call ({type(exc).__name__})")
                return self.refuse(message, failed)

        return task_message_handler

    def _answered_already(self, message: Any) -> bool:
        """Whether `message`, on a GPU worker, is a call given back (a broker restore, a
        sweep: marked redelivered) whose answer is stored: its first run ended, and only
        its acknowledgement was lost (sent as Redis failed over, or on a connection that
        closed first). Running it again would run it twice. One read, for given-back calls
        only; when Redis cannot say, the call runs again (its first stored answer stays).
        A router looks for a given-back call elsewhere itself, and lets go of its hold on
        the model then (`tasks.api.dispatch`)."""
        task_id = message.headers.get("id")
        if context.role() != "gpu" or not is_name(task_id):
            return False
        if not intake.redelivered(message):
            return False
        try:
            return bool(results.answered(self.app.backend, [task_id]))
        except Exception:
            log.warning("could not tell whether call %s was answered; running it", task_id)
            return False

    def _settle_answered(self, message: Any) -> None:
        """Acknowledge a given-back call that was answered, ending the request lease it
        carries, without running it (`_answered_already`)."""
        log.info(
            "call %s came back after it was answered; not running it again", message.headers["id"]
        )
        _end_lease(message.headers)
        message.ack_log_error(log, self.connection_errors)

    def refuse(self, message: Any, error: GpufleetError) -> None:
        """Answer a message that may not run with `error`, and drop it (acknowledged),
        ending the request lease it carries: the call will not run, so its replica is not
        to stay pinned (and counted busy) until the lease's deadline."""
        task_id = _call_id(message, None if "id" in message.headers else _decoded(message))
        log.warning("refused call %.60s of %.80r: %s", task_id, message.headers.get("task"), error)
        self._fail(task_id, error)
        _end_lease(message.headers)
        self._dropped(message, task_id, error)

    def _dropped(self, message: Any, task_id: Any, error: GpufleetError) -> None:
        """Acknowledge a refused message, and tell Flower its call failed."""
        message.ack_log_error(log, self.connection_errors)
        if self.event_dispatcher and isinstance(task_id, str):
            self.event_dispatcher.send(
                "task-failed", uuid=task_id, exception=f"{type(error).__name__}({str(error)!r})"
            )

    def refuse_taken(self, refusal: intake.Refused) -> None:
        """Answer a message the transport refused as it took it (`tasks.broker.intake.envelope`)."""
        log.warning("refused call %.60s as it was taken: %s", refusal.task_id, refusal.why)
        self._fail(refusal.task_id, PayloadError(refusal.why))

    def on_unknown_task(self, body: Any, message: Any, exc: Exception) -> None:
        """A task that is not gpufleet's (a Celery built-in, a name no one registered):
        a stored `PayloadError` and one log line, not Celery's `NotRegistered` and
        traceback; the message is acknowledged, never run nor redelivered."""
        if body is None and _field(message, None, "task") is None:
            body = _decoded(message)  # message protocol 1: the name is in the body
        name = _field(message, body, "task")
        task_id = _call_id(message, body)
        log.warning("refused call %.60s of task %.80r: not a task this worker runs", task_id, name)
        shown = repr(name)
        if len(shown) > 100:
            shown = f"{shown[:97]}..."
        refused = PayloadError(
            f"gpufleet runs only its own tasks ({', '.join(PUBLIC_TASKS)}); {shown} is not "
            f"one of them: send one of those by name"
        )
        self._fail(task_id, refused)
        self._dropped(message, task_id, refused)

    def on_invalid_task(self, body: Any, message: Any, exc: Exception) -> None:
        self._unreadable(message, exc)
        super().on_invalid_task(body, message, exc)

    def on_decode_error(self, message: Any, exc: Exception) -> None:
        self._unreadable(message, exc)
        super().on_decode_error(message, exc)

    def _unreadable(self, message: Any, exc: Exception) -> None:
        refused = intake.unreadable(exc, getattr(message, "content_type", "?"))
        self._fail(_field(message, None, "id"), refused)

    def _fail(self, task_id: Any, refused: GpufleetError) -> None:
        """Store `refused` as the result of call `task_id`, so its caller learns at once.
        Under that id only: the ids of what the call chains after it are the caller's words,
        and could name another caller's call (`tasks.broker.results.Backend`)."""
        if not is_call_id(task_id):
            return
        try:
            self.app.backend.mark_as_failure(task_id, refused, call_errbacks=False)
        except Exception:  # the message is dropped either way; say why in the log
            log.warning("could not store the refusal of call %s", task_id, exc_info=True)


def _running_tags() -> set[str]:
    """The delivery tags of the calls this worker runs now (Celery's active requests)."""
    return {
        str(request.message.delivery_tag)
        for request in list(worker_state.active_requests)
        if request.message is not None
    }


def _end_lease(headers: Any) -> None:
    """End the request lease in a refused message's headers, when it holds a readable one
    (a public queue's messages hold none: `tasks.broker.intake` takes fleet headers off)."""
    try:
        lease = leases.from_header("", headers.get(LEASE_HEADER))
    except GpufleetError:  # a malformed lease: nothing it names can be ended
        return
    if lease is not None:
        leases.end(lease)


def _field(message: Any, body: Any, key: str) -> Any:
    """`key` ("id", "task") of a message: from its headers (message protocol 2), else from
    its already decoded body (protocol 1); None where neither has it."""
    headers = getattr(message, "headers", None)
    if isinstance(headers, dict) and key in headers:
        return headers[key]
    return body.get(key) if isinstance(body, dict) else None


def _call_id(message: Any, body: Any) -> Any:
    """The fleet's id of a message's call: its headers' (the router named it as it took it:
    `tasks.broker.intake.envelope`), else its protocol 1 body's, named here by the public
    queue it came from, so that its answer goes to its own tenant's."""
    task_id = _field(message, body, "id")
    headers = getattr(message, "headers", None)
    queue = (getattr(message, "delivery_info", None) or {}).get("routing_key")
    if isinstance(headers, dict) and "id" in headers:
        return task_id
    if isinstance(task_id, str) and isinstance(queue, str) and is_public(queue):
        return call_id(task_id, tenant_of(queue) or DEFAULT)
    return task_id


def _decoded(message: Any) -> Any:
    """A protocol 1 message's body (Celery has decoded it already), or None."""
    try:
        return message.payload
    except Exception:  # not for us to fail on: the call is refused either way
        return None
