"""Waking a consumer that waits on one of its lists when a call arrives on another.

A consumer takes through in-flight lists (`tasks.broker.transport`), and Redis can block
a move on one list only (BLMOVE). A consumer of several tenants' queues blocks on the
list it last took from and looks at the others every `IDLE_POLL_MANY_S`: without more, a
call on another tenant's list waits up to that long on an idle worker, at each hop (the
router, then the GPU worker). `Waker` removes that wait where Redis says when a list
grows: it listens to the keyspace notifications of the consumer's lists (one SUBSCRIBE
connection, a thread of its own) and, when a call is pushed onto a list other than the
one the consumer waits on, pushes a wake token (`WAKE`, no message) onto the list it
waits on: its BLMOVE moves the token and returns, the consumer drops the token and takes
over every list at once. One token per wait.

A token is an ordinary list element, so nothing about it can be lost or harm a call: a
consumer that takes one (this one, or another of the same queue) drops it, a stop that
empties the queues skips it, and a token left behind costs its next taker one take.
(`CLIENT UNBLOCK` would wake the wait without a token, but Redis 6.2 and 7.0 crash when
it names a client that a `CLIENT PAUSE` holds, as a failover or a shutdown with replicas
does.)

It needs the server to publish list events (`notify-keyspace-events` including `K` and
`l`, which the bundled Redis sets: `placement.server.redis_server`). Without them nothing
wakes the consumer early, and it finds the call at its next look, as before.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

log = logging.getLogger(__name__)

#: The keyspace events of a push onto a list (LPUSH, RPUSH, LINSERT; a move's destination).
PUSHES = frozenset({"lpush", "rpush", "linsert"})
#: What the waker pushes onto the list a consumer waits on; no message parses as it.
WAKE = b"gpufleet-wake"
LISTEN_S = 0.5  # how long the listener waits for an event before it looks at its lists
RETRY_S = 1.0  # after a lost connection, before it listens again


class Waker:
    """One consumer channel's waker (see the module). The channel says which lists it
    takes from (`watch`), and which it waits on (`waiting`, `awake`)."""

    def __init__(self, client: redis.Redis, db: int) -> None:
        self._client = client  # a client of the channel's pool: safe to share with a thread
        self._prefix = f"__keyspace@{db}__:"
        self._lists: frozenset[str] = frozenset()
        self._waiting: str | None = None  # the list the consumer waits on, not woken yet
        self._stop = threading.Event()
        self._changed = threading.Event()  # `watch` changed the lists (from none: at once)
        self._thread = threading.Thread(target=self._listen, name="gpufleet-waker", daemon=True)
        self._thread.start()

    def watch(self, lists: list[str]) -> None:
        """The lists the consumer takes from now."""
        wanted = frozenset(lists)
        if wanted != self._lists:
            self._lists = wanted
            self._changed.set()

    def waiting(self, on: str) -> None:
        """The consumer is about to wait on list `on`."""
        self._waiting = on

    def awake(self) -> None:
        """The consumer's wait ended."""
        self._waiting = None

    def close(self) -> None:
        self._stop.set()
        self._changed.set()

    def _listen(self) -> None:
        while not self._stop.is_set():
            try:
                self._serve()
            except Exception as exc:  # a lost connection: nothing wakes meanwhile, nothing is lost
                log.debug("keyspace listener stopped (%s); listening again", exc)
                self._stop.wait(RETRY_S)

    def _serve(self) -> None:
        pubsub = self._client.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
        listening: set[str] = set()
        try:
            while not self._stop.is_set():
                self._changed.clear()
                wanted = {self._prefix + name for name in self._lists}
                if wanted != listening:
                    if listening - wanted:
                        pubsub.unsubscribe(*(listening - wanted))
                    if wanted - listening:
                        pubsub.subscribe(*(wanted - listening))
                    listening = wanted
                if not listening:
                    self._changed.wait(LISTEN_S)
                    continue
                message = pubsub.get_message(timeout=LISTEN_S)
                if message is not None and message.get("type") == "message":
                    self._heard(_text(message["channel"]), _text(message["data"]))
        finally:
            pubsub.close()

    def _heard(self, channel: str, event: str) -> None:
        waiting = self._waiting
        if event not in PUSHES or waiting is None:
            return
        key = channel[len(self._prefix) :]
        if key != waiting and key in self._lists:
            self._waiting = None  # one token per wait
            self._client.lpush(waiting, WAKE)


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
