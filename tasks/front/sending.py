"""Sending a call from the event loop: one Celery message, pushed with one async LPUSH.

The front sends what the project's client sends for a caller (`tasks.api.infer` and
`cancel` on the router's queue), but not through kombu: kombu's publish blocks, so each
call would wait for a thread to take it, and pay Celery's producer machinery, on the
answer's path (about half of the front's ~2 ms an embedding, measured with py-spy on this
2-core VM). Celery builds the message (`AMQP.as_task_v2`: the same headers and body as
`apply_async`); this module wraps it in the envelope kombu's virtual transport writes
(`Channel.prepare_message`, `basic_publish`) and pushes it where kombu's Redis transport
would: the queue's list, by its name (a caller's call has priority 0). `tests/test_front.py`
checks it against the message Celery pushes for the same call.

A push that fails on the connection is tried again, as kombu's publish is
(`tasks.config.PUBLISH_RETRY_POLICY`: a Redis restart or a failover is ridden through);
a push that may have landed before it failed leaves a twin under the same task id,
which the fleet answers once. On a Sentinel fleet the push waits, as the fleet's own
publish does (`tasks.broker.transport.SentinelChannel._put`), for a replica to hold it.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from typing import Any

import orjson
import redis
import redis.asyncio
from celery import Celery

from placement.errors import ConfigError, PayloadError
from placement.ledger import endpoint
from tasks.config import PUBLISH_RETRY_POLICY, ROUTER_QUEUE

log = logging.getLogger(__name__)

#: Pushes at once, by default: each holds one of the client's connections for a round
#: trip, and a pool with none free refuses a command; more calls wait their turn.
PUSHES = 32
#: How long one push may take, retries included, before the call is refused (503): about
#: kombu's retry budget (`PUBLISH_RETRY_POLICY`), and a replica's `WAIT` beside it.
PUSH_DEADLINE_S = 12.0
_RETRIED = (redis.ConnectionError, redis.TimeoutError, OSError)


def message(app: Celery, name: str, task_id: str, args: list[Any], queue: str) -> bytes:
    """The message kombu's Redis transport pushes for `app.send_task(name, tuple(args),
    task_id=task_id)` routed to `queue` (anonymous exchange, priority 0), but for its
    delivery tag, a fresh id. Raises `PayloadError` for text that is not Unicode (a lone
    surrogate, which JSON's escapes can carry and UTF-8 cannot)."""
    headers, properties, body, _ = app.amqp.as_task_v2(
        task_id, name, tuple(args), {}, reply_to=app.thread_oid, ignore_result=False
    )
    try:
        payload = orjson.dumps(body)
    except orjson.JSONEncodeError as exc:
        raise PayloadError(
            f"the request holds text that is not valid Unicode ({exc}); send UTF-8 text"
        ) from None
    envelope = {
        "body": base64.b64encode(payload).decode("ascii"),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            **properties,
            "delivery_mode": 2,  # persistent, Celery's `task_default_delivery_mode`
            "delivery_info": {"exchange": "", "routing_key": queue},
            "priority": 0,
            "body_encoding": "base64",
            "delivery_tag": str(uuid.uuid4()),
        },
    }
    return orjson.dumps(envelope)


class Sender:
    """Pushes calls onto the router's queue (`queue`) from the event loop (see the module)."""

    def __init__(
        self,
        app: Celery,
        client: redis.asyncio.Redis,
        *,
        replicated: bool = False,
        queue: str = ROUTER_QUEUE,
        pushes: int = PUSHES,
    ) -> None:
        """`replicated`: a Sentinel fleet (wait for a replica); `pushes`: fewer than the
        client's connections the rest of the process leaves free."""
        _check_settings(app)
        self._app = app
        self._client = client
        self._replicated = replicated
        self._queue = queue
        self._turns = asyncio.Semaphore(pushes)

    async def send(self, name: str, task_id: str, args: list[Any]) -> None:
        """Push `name(*args)` as task `task_id`. Raises `PayloadError` for arguments that
        cannot be sent, and the client's error (or `TimeoutError`) when Redis did not take
        it within `PUSH_DEADLINE_S`: nothing was sent, or it may have been."""
        data = message(self._app, name, task_id, args, self._queue)
        await asyncio.wait_for(self._turn(task_id, data), PUSH_DEADLINE_S)

    async def _turn(self, task_id: str, data: bytes) -> None:
        async with self._turns:
            await self._push(task_id, data)

    async def _push(self, task_id: str, data: bytes) -> None:
        """One push, tried again on a connection error by `PUBLISH_RETRY_POLICY`."""
        policy = PUBLISH_RETRY_POLICY
        wait = float(policy["interval_start"])
        for attempt in range(int(policy["max_retries"]) + 1):
            try:
                await self._push_once(task_id, data)
                return
            except _RETRIED as exc:
                if attempt == policy["max_retries"]:
                    raise
                log.warning("could not send call %s (%s); trying again", task_id, exc)
            await asyncio.sleep(wait)
            wait = min(wait + float(policy["interval_step"]), float(policy["interval_max"]))

    async def _push_once(self, task_id: str, data: bytes) -> None:
        if not self._replicated:
            await self._client.lpush(self._queue, data)
            return
        pipe = self._client.pipeline(transaction=False)
        pipe.lpush(self._queue, data)
        await endpoint.kept_async(pipe, f"call {task_id}")


def _check_settings(app: Celery) -> None:
    """The message `message` writes is the one `app` would send only with the fleet's
    settings: JSON, no compression, persistent messages."""
    conf = app.conf
    persistent = conf.task_default_delivery_mode in ("persistent", 2)
    if (conf.task_serializer, conf.task_compression, persistent) != ("json", None, True):
        raise ConfigError(
            "the HTTP front sends JSON, uncompressed, persistent messages; this app is "
            f"set to {conf.task_serializer!r}, compression {conf.task_compression!r}, "
            f"delivery mode {conf.task_default_delivery_mode!r}"
        )
