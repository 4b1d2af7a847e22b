"""Waking a consumer that waits on one of its lists when a call arrives on another.

A consumer takes through in-flight lists (`tasks.broker.transport`), and Redis can block
a move on one list only (BLMOVE). A consumer of several tenants' queues blocks on the
list it last took from and looks at the others every `IDLE_POLL_MANY_S`: without more, a
call on another tenant's list waits up to that long on an idle worker, at each hop (the
router, then the GPU worker). `Waker` removes that wait where Redis says when a list
grows: it listens to the keyspace notifications of the consumer's lists (one SUBSCRIBE
connection, a thread of its own) and, when a call is pushed onto a list other than the
one the consumer waits on, ends the wait with `CLIENT UNBLOCK`, which Redis answers as a
timeout (nothing is moved): the consumer then runs its take over every list at once.

It needs the server to publish list events (`notify-keyspace-events` with `K` and `l`,
which the bundled Redis sets: `placement.server.redis_server`) and the fleet user's
`+client|unblock` (`placement.server.acl`). Without them nothing wakes the consumer early,
and it finds the call at its next look, as before. A wake that comes as the consumer
stops waiting unblocks nothing, or ends its next wait early: one take more, never a call
lost or taken twice (a blocked BLMOVE that is unblocked has moved nothing).
"""

from __future__ import annotations

import logging
import threading
from typing import Any

import redis

log = logging.getLogger(__name__)

#: The keyspace events of a push onto a list (LPUSH, RPUSH, LINSERT; a move's destination).
PUSHES = frozenset({"lpush", "rpush", "linsert"})
LISTEN_S = 0.5  # how long the listener waits for an event before it looks at its lists
RETRY_S = 1.0  # after a lost connection, before it listens again


class Waker:
    """One consumer channel's waker (see the module). The channel says which lists it
    takes from (`watch`), and which it waits on, on which connection (`waiting`, `awake`)."""

    def __init__(self, client: redis.Redis, db: int) -> None:
        self._client = client  # a client of the channel's pool: safe to share with a thread
        self._prefix = f"__keyspace@{db}__:"
        self._lists: frozenset[str] = frozenset()
        self._waiting: tuple[int, str] | None = None  # (the waiting connection's id, its list)
        self._stop = threading.Event()
        self._changed = threading.Event()  # `watch` changed the lists: subscribe at once
        self._thread = threading.Thread(target=self._listen, name="gpufleet-waker", daemon=True)
        self._thread.start()

    def watch(self, lists: list[str]) -> None:
        """The lists the consumer takes from now."""
        wanted = frozenset(lists)
        if wanted != self._lists:
            self._lists = wanted
            self._changed.set()

    def waiting(self, client_id: int, on: str) -> None:
        """The consumer's connection `client_id` is about to wait on list `on`."""
        self._waiting = (client_id, on)

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
        if key != waiting[1] and key in self._lists:
            self._client.client_unblock(waiting[0])


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def client_id(connection: Any) -> int:
    """The server's id of `connection` (a redis-py connection that has nothing pending),
    asked once per socket: a reconnected connection is a new client."""
    known = getattr(connection, "_gpufleet_client", None)
    if known is not None and connection._sock is not None and known[0] is connection._sock:
        return int(known[1])
    connection.send_command("CLIENT", "ID")  # connects first if it has to
    found = int(connection.read_response())
    connection._gpufleet_client = (connection._sock, found)
    return found
