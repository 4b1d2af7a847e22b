"""Hearing a call pushed onto one of a consumer's lists while it waits on another.

A consumer takes through in-flight lists (`tasks.broker.transport`), and Redis can block
a move on one list only (BLMOVE). A consumer of several tenants' queues blocks on the
list it last took from and looks at the others every `IDLE_POLL_MANY_S`: without more, a
call on another tenant's list waits up to that long on an idle worker, at each hop (the
router, then the GPU worker).

`Ears` removes that wait where Redis says when a list grows: a connection of its own,
subscribed to the keyspace notifications of the consumer's lists other than the one it
waits on, whose socket the consumer's own poller reads beside its wait
(`transport.Poller`; no thread). When calls are pushed onto those lists, the consumer
takes them at once, over all its lists and on a pooled connection, while its wait goes
on (`transport.Channel._heard`). Such a call costs one round trip more than one on the
list waited on. A push onto the list waited on is not heard: its wait takes it, and the
event would wake the loop a second time for nothing (an idle GPU worker's calls all
arrive on the list it waits on). When the consumer waits on another list, it subscribes
to the one it left; a push onto that one in the moment before the subscription takes
effect is found by its next look (`IDLE_POLL_MANY_S`), as without ears.

(A listener thread that pushed a wake token onto the waited list cost a thread switch,
the push, and the take after the token; `CLIENT UNBLOCK` would wake the wait without a
token, but Redis 6.2 and 7.0 crash when it names a client that a `CLIENT PAUSE` holds, as
a failover or a shutdown with replicas does.)

The connection is a bare one, not redis-py's `PubSub`, whose reads reconnect and
subscribe again inside the caller (here, the worker's event loop) when a reply is not
whole yet. Here a reply not whole yet stays buffered until the rest arrives, and a lost
connection is closed and made again on a later wait (`RETRY_S`).

It needs the server to publish list events (`notify-keyspace-events` including `K` and
`l`, which the bundled Redis sets: `placement.server.redis_server`). Without them nothing
is heard, and a call on another list is found at the consumer's next look, as before.
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Callable
from typing import Any

import redis

#: The keyspace events of a push onto a list (LPUSH, RPUSH, LINSERT; a move's destination).
PUSHES = frozenset({"lpush", "rpush", "linsert"})
#: After a lost connection, how long a consumer goes without ears before it opens them
#: again (each try connects inside its event loop); meanwhile it looks every 50 ms.
RETRY_S = 1.0


class Ears:
    """One consumer channel's subscription to the pushes onto its lists (see the module).
    Its `connection` is read by the consumer's poller, never waited on here."""

    def __init__(self, pool: Any, db: int, closing: Callable[[Any], None]) -> None:
        # Made from the pool's settings, not taken from it, so nothing else closes it;
        # whatever closes it (this, or redis-py on an error) calls `closing` with the
        # socket first, while the poller can still let go of it.
        self.connection = _told_before_closing(pool.connection_class)(**pool.connection_kwargs)
        self.connection.closing = closing
        self.connection.connect()
        self._prefix = f"__keyspace@{db}__:"
        self._lists: frozenset[str] = frozenset()

    def watch(self, lists: list[str]) -> None:
        """Hear pushes onto `lists` from now on (and no others). The replies come with
        the events (`pushed`)."""
        wanted = frozenset(lists)
        if wanted == self._lists:
            return
        # No health check: its PING would read (and drop) the events waiting before it.
        if gone := self._lists - wanted:
            channels = [self._prefix + name for name in gone]
            self.connection.send_command("UNSUBSCRIBE", *channels, check_health=False)
        if new := wanted - self._lists:
            channels = [self._prefix + name for name in new]
            self.connection.send_command("SUBSCRIBE", *channels, check_health=False)
        self._lists = wanted

    def socket(self) -> Any:
        """The socket its consumer's poller reads (None once closed)."""
        return self.connection._sock

    def pushed(self) -> Counter[str]:
        """How many pushes onto each watched list have arrived since the last call; it
        never waits. Raises `redis.ConnectionError` when the connection is lost, and
        `redis.ResponseError` when Redis refused a subscription."""
        found: Counter[str] = Counter()
        connection = self.connection
        if connection._sock is None:  # `can_read` would connect again
            raise redis.ConnectionError("the keyspace events' connection is closed")
        try:
            while connection.can_read(timeout=0):
                reply = connection.read_response(
                    disconnect_on_error=False, push_request=True, timeout=0
                )
                # ["message", channel, event]; subscriptions' replies are ignored
                if isinstance(reply, list) and len(reply) == 3 and _text(reply[0]) == "message":
                    name = _text(reply[1])[len(self._prefix) :]
                    if _text(reply[2]) in PUSHES and name in self._lists:
                        found[name] += 1
        except redis.TimeoutError:  # a reply not whole yet: its rest makes the socket readable
            pass
        return found

    def close(self) -> None:
        self.connection.disconnect()

    def forget(self) -> None:
        """In a forked child: close this process's copy of the socket, telling nothing to
        Redis or to the parent's poller."""
        sock, self.connection._sock = self.connection._sock, None
        if sock is not None:
            sock.close()


@functools.cache
def _told_before_closing(base: type) -> type:
    """`base`, a connection class, calling its `closing(socket)` before it closes its
    socket. A poller must unregister a socket while it is open: once closed, a copy of it
    held by a forked child keeps the registration alive, and a socket shut down reads
    ready forever."""

    class EarsConnection(base):
        closing: Callable[[Any], None] | None = None

        def disconnect(self, *args: Any, **kwargs: Any) -> None:
            try:
                if self._sock is not None and self.closing is not None:
                    self.closing(self._sock)
            finally:
                super().disconnect(*args, **kwargs)

    return EarsConnection


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
