"""Waiting for many calls at once, with a few Redis connections and no thread per call.

The HTTP front (`tasks.front.server`) may hold thousands of calls open; each waits for
its result and, when streamed, its text. A connection or a thread per call would not
scale, so one process shares:

* `Results`: one SUBSCRIBE connection for every pending result. Celery's Redis backend
  stores a result with SET and PUBLISH on the same key (`celery-task-meta-<id>`), so a
  subscriber hears it as it is stored. Each call is subscribed to before it is sent (as
  Celery's own client does), so no answer comes unheard, and unsubscribed from in the
  background, many at once; every `SWEEP_S` one MGET reads every pending result, so a
  message lost to a reconnect (a failover, a Redis restart) delays an answer by a sweep,
  never loses it.
* `Streams`: one blocking XREAD over every open stream (`tasks.serving.streams`), whose
  entries go to each stream's queue. A stream opened while the read blocks joins the
  next one, at most `XREAD_BLOCK_MS` later.

Both run as tasks of the server's event loop and end with it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import json
import logging
from typing import Any

import orjson
import redis.asyncio
from celery import states

from placement.ledger.tenancy import tenants
from tasks.serving import streams

log = logging.getLogger(__name__)

RESULT_PREFIX = "celery-task-meta-"  # Celery's Redis backend's key of a task's result
#: How often every pending result is read, whatever the channel said (tuned: a lost
#: message costs this long at most; a sweep is one MGET however many calls wait).
SWEEP_S = 1.0
#: How long the shared XREAD blocks: a stream opened meanwhile waits at most this long to
#: join it (tuned: small against a call's routing and prefill, large against Redis's cost
#: of one XREAD over every open stream).
XREAD_BLOCK_MS = 50
XREAD_COUNT = 256  # entries per stream per read
RETRY_S = 0.5  # after a failed read, before the next


class Results:
    """Every pending call's result, heard through one subscription: the calls of
    `tenant` (`client` signs in as its user), whose results live under its key prefix."""

    def __init__(self, client: redis.asyncio.Redis, tenant: str = tenants.DEFAULT) -> None:
        self._client = client
        self._prefix = tenants.key_prefix(tenant) + RESULT_PREFIX
        self._pubsub = client.pubsub(ignore_subscribe_messages=True)
        self._waiting: dict[str, asyncio.Future[dict[str, Any]]] = {}
        self._lock = asyncio.Lock()  # one SUBSCRIBE or UNSUBSCRIBE at a time
        self._subscribed = asyncio.Event()  # set when a SUBSCRIBE was sent
        self._done: set[str] = set()  # keys to unsubscribe from, in one command
        self._finish = asyncio.Event()  # set when `_done` gains a key
        self._tasks: list[asyncio.Task[None]] = []

    def start(self) -> None:
        self._tasks = [
            asyncio.create_task(self._listen(), name="gpufleet-results"),
            asyncio.create_task(self._sweep(), name="gpufleet-results-sweep"),
            asyncio.create_task(self._unsubscribe(), name="gpufleet-results-unsubscribe"),
        ]

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        with contextlib.suppress(Exception):
            await self._pubsub.aclose()  # type: ignore[no-untyped-call]

    async def watch(self, task_id: str) -> asyncio.Future[dict[str, Any]]:
        """Subscribe to `task_id`'s result, before its call is sent (so no answer comes
        unheard); the future is its stored meta once ready (SUCCESS, FAILURE, REVOKED).
        `until` waits for it, and forgets it after."""
        key = self._prefix + task_id
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[key] = future
        self._done.discard(key)
        try:
            async with self._lock:
                await self._pubsub.subscribe(key)
        except BaseException:
            self.forget(task_id)  # its SUBSCRIBE may have been written
            raise
        self._subscribed.set()
        return future

    async def until(
        self, task_id: str, future: asyncio.Future[dict[str, Any]], timeout: float
    ) -> dict[str, Any]:
        """`watch`'s future once it is done (TimeoutError after `timeout` s); then the
        subscription ends."""
        try:
            return await asyncio.wait_for(future, timeout)
        finally:
            self.forget(task_id)

    def forget(self, task_id: str) -> None:
        """End `task_id`'s subscription, off the answer's path (`_unsubscribe`)."""
        key = self._prefix + task_id
        self._waiting.pop(key, None)
        self._done.add(key)
        self._finish.set()

    def _settle(self, key: str, raw: Any) -> None:
        """Hand a stored result to its waiter, if it is ready."""
        future = self._waiting.get(key)
        if raw is None or future is None or future.done():
            return
        try:
            meta = _loads(raw)
        except ValueError:
            log.warning("%s holds no JSON result; left to time out", key)
            return
        if meta.get("status") in states.READY_STATES:
            future.set_result(meta)

    async def _listen(self) -> None:
        while True:
            try:
                if not self._pubsub.subscribed:
                    self._subscribed.clear()
                    await self._subscribed.wait()  # until `watch` subscribes
                    continue
                message = await self._pubsub.get_message(timeout=1.0)
                if message and message.get("type") == "message":
                    self._settle(_text(message["channel"]), message["data"])
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("result channel lost (%s); the sweep reads meanwhile", exc)
                await asyncio.sleep(RETRY_S)

    async def _unsubscribe(self) -> None:
        """Unsubscribe from every key forgotten since the last time, in one command."""
        while True:
            await self._finish.wait()
            self._finish.clear()
            keys = [key for key in self._done if key not in self._waiting]
            self._done.clear()
            if not keys:
                continue
            try:
                async with self._lock:
                    await self._pubsub.unsubscribe(*keys)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the connection is gone: its subscriptions with it
                log.warning("could not unsubscribe from %d results: %s", len(keys), exc)

    def _orphans(self) -> None:
        """Channels subscribed that no call waits for go to `_unsubscribe`: a reconnect
        subscribes again to every channel whose UNSUBSCRIBE was not confirmed yet."""
        stray = {_text(c) for c in self._pubsub.channels} - set(self._waiting)
        stray -= {_text(c) for c in self._pubsub.pending_unsubscribe_channels}
        if stray:
            self._done |= stray
            self._finish.set()

    async def _sweep(self) -> None:
        """Every `SWEEP_S`, read every pending result in one MGET: an answer whose message
        was lost (the channel's connection dropped meanwhile) is found here; and channels
        nobody waits for are dropped (`_orphans`)."""
        while True:
            await asyncio.sleep(SWEEP_S)
            self._orphans()
            keys = [k for k, f in self._waiting.items() if not f.done()]
            if not keys:
                continue
            try:
                for key, raw in zip(keys, await self._client.mget(keys), strict=True):
                    self._settle(key, raw)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("could not read %d pending results: %s", len(keys), exc)


class Stream:
    """One call's streamed text as the shared reader hands it over.

    Its entries are taken only by `drain`, which never awaits: a waiter that is cancelled
    (the call ended first, the client left) loses nothing, as a cancelled `Queue.get`
    inside `wait_for` could (the entry taken, the waiter gone: a piece missing from the
    middle of the text).
    """

    def __init__(self, task_id: str) -> None:
        self.pieces = streams.Pieces(task_id)
        self._entries: collections.deque[tuple[Any, dict[Any, Any]]] = collections.deque()
        self._arrived = asyncio.Event()
        self.broken = False  # the call ran again and wrote other text (`drain`)

    def put(self, entry_id: Any, fields: dict[Any, Any]) -> None:
        self._entries.append((entry_id, fields))
        self._arrived.set()

    async def arrived(self) -> None:
        """Returns once entries wait to be drained."""
        await self._arrived.wait()

    def drain(self) -> list[tuple[int, str]]:
        """The text of every entry handed over so far, up to the end (`pieces.ended`). A
        call that ran again and wrote other text than it streamed (its worker was lost,
        it samples without a seed) sets `broken` instead: its text so far is all it gets."""
        out: list[tuple[int, str]] = []
        while self._entries and self.pieces.ended is None and not self.broken:
            try:
                out += self.pieces.feed(*self._entries.popleft())
            except streams.StreamRestartedError:
                self.broken = True
        if not self._entries:
            self._arrived.clear()
        return out


class Streams:
    """Every open stream of `tenant`'s calls, read by one blocking XREAD."""

    def __init__(self, client: redis.asyncio.Redis, tenant: str = tenants.DEFAULT) -> None:
        self._client = client
        self._tenant = tenant
        self._open: dict[str, Stream] = {}  # stream key -> its reader
        self._last: dict[str, str] = {}  # stream key -> the last entry id read
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._read(), name="gpufleet-streams")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task

    def open(self, task_id: str) -> Stream:
        stream = Stream(task_id)
        name = streams.key(tenants.call_id(task_id, self._tenant))
        self._open[name] = stream
        self._last[name] = "0-0"
        self._wake.set()
        return stream

    def close(self, task_id: str) -> bool:
        """Stop reading `task_id`'s stream; whether it was open."""
        name = streams.key(tenants.call_id(task_id, self._tenant))
        self._last.pop(name, None)
        return self._open.pop(name, None) is not None

    @property
    def count(self) -> int:
        return len(self._open)

    async def _read(self) -> None:
        while True:
            if not self._last:
                self._wake.clear()
                await self._wake.wait()
                continue
            try:
                answer: Any = await self._client.xread(
                    dict(self._last),  # type: ignore[arg-type]
                    block=XREAD_BLOCK_MS,
                    count=XREAD_COUNT,
                )
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.warning("could not read %d streams: %s", len(self._last), exc)
                await asyncio.sleep(RETRY_S)
                continue
            for raw_name, entries in answer or []:
                name = _text(raw_name)
                stream = self._open.get(name)
                if stream is None:
                    continue  # closed while the read blocked
                for entry_id, fields in entries:
                    stream.put(entry_id, fields)
                if any(b"end" in fields or "end" in fields for _, fields in entries):
                    self._last.pop(name, None)  # read to its end: out of the next reads
                elif name in self._last:
                    self._last[name] = _text(entries[-1][0])


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _loads(raw: Any) -> Any:
    """JSON through orjson (several times faster on an embedding's floats), or Python's
    for the NaN and Infinity it writes and orjson refuses."""
    try:
        return orjson.loads(raw)
    except orjson.JSONDecodeError:
        return json.loads(raw)
