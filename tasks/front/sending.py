"""Sending a call from the event loop: one Celery message, pushed with one async LPUSH.

The front sends what the project's client sends for a caller (`tasks.api.infer` and
`cancel` on the router's queue), but not through kombu: kombu's publish blocks, so each
call would wait for a thread to take it, and pay Celery's producer machinery, on the
answer's path (about half a millisecond of an embedding's ~2 ms in the front, measured
with py-spy on this 2-core VM). Celery builds the message (`AMQP.as_task_v2`: the same
headers and body as `apply_async`); this module wraps it in the envelope kombu's virtual
transport writes (`Channel.prepare_message`, `basic_publish`) and pushes it where kombu's
Redis transport would: the queue's list, by its name (a caller's call has priority 0).
`tests/test_api.py` checks the message against the one `apply_async` writes.

On a Sentinel fleet the push waits, as the fleet's own publish does
(`tasks.broker.transport.SentinelChannel._put`), for a replica to hold the call.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import uuid
from typing import Any

import orjson
import redis.asyncio
from celery import Celery

from tasks.broker.transport import PUBLISH_WAIT_MS
from tasks.config import ROUTER_QUEUE

log = logging.getLogger(__name__)

PERSISTENT = 2  # AMQP's delivery mode, as Celery's default `task_default_delivery_mode`
#: Pushes at once, by default: each holds one of the client's connections for a round
#: trip, and a pool with none free refuses a command; more calls wait their turn.
PUSHES = 32


def message(app: Celery, name: str, task_id: str, args: list[Any], queue: str) -> bytes:
    """The bytes kombu's Redis transport pushes for `app.send_task(name, args,
    task_id=task_id)` routed to `queue` (anonymous exchange, priority 0), but for its
    delivery tag, a fresh id."""
    headers, properties, body, _ = app.amqp.as_task_v2(
        task_id, name, args, {}, reply_to=app.thread_oid
    )
    payload = orjson.dumps(body)
    envelope = {
        "body": base64.b64encode(payload).decode("ascii"),
        "content-encoding": "utf-8",
        "content-type": "application/json",
        "headers": headers,
        "properties": {
            **properties,
            "delivery_mode": PERSISTENT,
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
        self._app = app
        self._client = client
        self._replicated = replicated
        self._queue = queue
        self._turns = asyncio.Semaphore(pushes)

    async def send(self, name: str, task_id: str, args: list[Any]) -> None:
        """Push `name(*args)` as task `task_id`; raises the client's error when Redis did
        not take it (nothing was sent, or it may have been: the caller may try again, and
        a twin is answered once)."""
        data = message(self._app, name, task_id, args, self._queue)
        async with self._turns:
            await self._push(task_id, data)

    async def _push(self, task_id: str, data: bytes) -> None:
        if not self._replicated:
            await self._client.lpush(self._queue, data)
            return
        pipe = self._client.pipeline(transaction=False)
        pipe.lpush(self._queue, data)
        pipe.execute_command("WAIT", 1, PUBLISH_WAIT_MS)
        pushed, replicas = await pipe.execute(raise_on_error=False)
        if isinstance(pushed, Exception):
            raise pushed
        if isinstance(replicas, Exception) or not replicas:
            log.warning(
                "call %s is on the primary alone: no replica confirmed it within %d ms (%s)",
                task_id,
                PUBLISH_WAIT_MS,
                replicas,
            )
