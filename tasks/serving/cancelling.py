"""The router answers `gpufleet.cancel` in its consumer, and sends the revokes together.

A cancel revokes a call through Celery's remote control, which only the fleet's own user
may broadcast (a caller's may not). Run as a pool task, each cancel cost the router a pool
job and one `revoke` broadcast that every worker of the fleet then handled in its main
process: 3,000 cancels of made-up ids took 14 s to answer, and other callers' hot calls
waited up to 6.8 s behind them (issue 55).

The broadcast cost more than it says: Celery's `revoke` makes every worker that hears it
read and write each id's result in the backend (to mark a queued call REVOKED at once), in
its main process: 3,000 made-up ids cost each worker about 9,000 Redis round trips, while
its consumer took no call. So the fleet broadcasts its own command, `gpufleet_cancel`,
which only adds the ids to each worker's revoked set (Celery's own, `worker_state.revoked`):
a worker holding such a call drops it as Celery drops a revoked call, marking it REVOKED
then (a running generation stops within a step), and an id no worker holds costs each
worker a set insertion. The result of a call revoked while it waits in a queue is
written when a worker takes it, not at the revoke.

And the router's consumer takes each cancel as it takes a hot call, without a pool job;
every `FLUSH_S` it settles the cancels taken since, together:
- one MGET of their targets' results: a call already answered has nothing to stop, and is
  not cancelled (its cancel answers False);
- one `gpufleet_cancel` broadcast naming every other target (its cancel answers True): a
  broadcast per flush, never per cancel;
- then every cancel's result is stored, in one round trip, and their messages are
  acknowledged, in another: a router that dies before a flush leaves its cancels
  unacknowledged, and they are delivered again.

A cancel stops a call of its own tenant only: tenant T's cancel of task id X names the
fleet's call `X@T` (`placement.ledger.tenancy.tenants.call_id`), never another tenant's
call of the same id.

A cancel is no pool task, so Flower does not list it; the router logs each flush.

While a cancel waits for its flush, unacknowledged, it raises the consumer's prefetch by
one (as Celery does for a call with an ETA), so the router goes on taking calls meanwhile.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import states
from celery.worker import state as worker_state
from celery.worker.control import control_command

from placement.ledger.tenancy.tenants import call_id
from tasks.broker import results
from tasks.broker.intake import bind, is_name
from tasks.config import CANCEL
from tasks.serving.calls import tenant_in

log = logging.getLogger(__name__)

FLUSH_S = 0.05  # how often the cancels taken are settled: a cancel waits this long at most

_Strategy = Callable[..., Any]


@dataclass(frozen=True)
class _Taken:
    message: Any
    cancel: str  # the cancel's own task id
    target: str  # the call it stops


class Cancels:
    """The cancels a router's consumer took and has not settled yet (see the module)."""

    def __init__(self, app: Any, qos: Callable[[], Any]) -> None:
        self._app = app
        self._qos = qos  # the consumer's prefetch (Celery's `QoS`)
        self._taken: list[_Taken] = []
        self._flushing: Any = None  # the timer entry, once started

    def install(self, timer: Any) -> _Strategy:
        """The strategy of `gpufleet.cancel` messages, and the flush on `timer`. Called on
        every connection: Celery cancels the timer entries a connection made when it fails,
        so the flush is made anew each time."""
        if self._flushing is not None:
            self._flushing.cancel()
        self._flushing = timer.call_repeatedly(FLUSH_S, self.flush)

        def task_message_handler(message: Any, *_: Any, **__: Any) -> None:
            args, kwargs, _ = message.decode()  # checked already (`tasks.broker.intake`)
            target = bind(self._app.tasks[CANCEL], args, kwargs)["task_id"]
            target = call_id(target, tenant_in(message.headers))  # its own tenant's call
            self._taken.append(_Taken(message, message.headers["id"], target))
            self._qos().increment_eventually()

        return task_message_handler

    def forget(self) -> None:
        """Drop the cancels taken on a lost connection: the broker delivers them again."""
        self._taken = []

    def flush(self) -> None:
        """Settle the cancels taken since the last flush (see the module)."""
        taken, self._taken = self._taken, []
        if not taken:
            return
        backend = self._app.backend
        targets = sorted({t.target for t in taken})
        try:
            ended = results.answered(backend, targets)
            running = [t for t in targets if t not in ended]
            if running:
                cancel_calls(self._app, running)
            _store(backend, {t.cancel: t.target not in ended for t in taken})
            by_channel: dict[int, list[Any]] = {}
            for item in taken:
                by_channel.setdefault(id(item.message.channel), []).append(item.message)
            for messages in by_channel.values():
                messages[0].channel.qos.ack_all(messages)
        except Exception:  # Redis away: try again at the next flush, unacknowledged
            log.warning("could not settle %d cancel(s); retrying", len(taken), exc_info=True)
            self._taken[:0] = [t for t in taken if not t.message.acknowledged]
            return
        self._qos().decrement_eventually(len(taken))
        log.info("cancelled %d call(s) (%d already answered)", len(running), len(ended))


def cancel_calls(app: Any, task_ids: list[str]) -> None:
    """Tell every worker of the fleet that `task_ids` are revoked (see the module)."""
    app.control.broadcast(COMMAND, arguments={"task_ids": task_ids})


@control_command(variadic="task_ids", signature="[id1 [id2 [... [idN]]]]")
def gpufleet_cancel(state: Any, task_ids: Any, **_: Any) -> dict[str, str]:
    """The control command of a cancel: the ids join the worker's revoked set, and nothing
    else happens until it holds such a call (see the module)."""
    ids = [i for i in (task_ids if isinstance(task_ids, list) else [task_ids]) if is_name(i)]
    worker_state.revoked.update(ids)
    return {"ok": f"{len(ids)} call(s) flagged as revoked"}


COMMAND = gpufleet_cancel.__name__


def _store(backend: Any, answers: dict[str, bool]) -> None:
    """Store each cancel's result as Celery's Redis backend does (the value, then its
    PUBLISH to the waiting caller), all in one round trip: a cancel's id is its caller's
    own, answered only here, so the backend's read before each write has nothing to find."""
    pipe = backend.client.pipeline(transaction=False)
    for task_id, value in answers.items():
        meta = backend._get_result_meta(result=value, state=states.SUCCESS, traceback=None,
                                        request=None)  # fmt: skip
        meta["task_id"] = task_id
        key, encoded = backend.get_key_for_task(task_id), backend.encode(meta)
        if backend.expires:
            pipe.setex(key, backend.expires, encoded)
        else:
            pipe.set(key, encoded)
        pipe.publish(key, encoded)
    pipe.execute()
