"""Which server each Sentinel group's primary is, as this process knows it: every connection
of the process leaves the old primary as soon as the process learns of a failover.

A process learns that a primary moved in two ways:
- **a connection opens** (`PrimaryConnection.connect_to`) to another primary than the last
  one: one whose server stopped answering (a SIGSTOP, a host cut off) timed out, or found
  it demoted, and asked the Sentinels again;
- **the Sentinels say so**: while a process holds a connection to a Sentinel-watched
  primary, one thread per Sentinel of the group listens on its ``+switch-master``
  channel, which each Sentinel publishes as it takes the new primary on.

Without the second, a process all of whose connections wait on a stopped primary learns
only as each times out in turn (`endpoint.FAILOVER_SOCKET_TIMEOUT_S`), or never while idle
in a pool; a worker's consumer that reconnected to the stopped server just before the
Sentinels named another left it at its next check, and the first call sent after a
20 s SIGSTOP was answered 10-20 s later. Either way, every connection of the process to
the old server is shut at once (`socket.shutdown`, which also ends a read blocked on it):
its next read or write fails with `ConnectionError`, which every fleet client retries, on
a new connection to the new primary. Writes on the old server would be lost with its data
anyway.

A Sentinel that refuses the fleet's user ``SUBSCRIBE`` (Sentinels of your own whose ACL
lacks ``+subscribe &+switch-master``, docs/deploy.md) is said once in the log; the
connections then leave at their own timeouts, as before.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
import weakref
from typing import Any

import redis

log = logging.getLogger(__name__)

#: The channel on which a Sentinel announces a new primary:
#: "<name> <old ip> <old port> <new ip> <new port>".
SWITCH_CHANNEL = "+switch-master"
#: How long a listener waits before it subscribes again to a Sentinel it lost. Tuned
#: constant: a Sentinel started again is back within a second or two, and a failover's
#: switch comes about 4 s after a primary stops answering.
RESUBSCRIBE_S = 1.0
#: How long a listener waits for a message before it looks again whether it should go on.
LISTEN_S = 1.0

Address = tuple[str, int]
Group = tuple[str, ...]  # the primary's name, then its Sentinels, sorted


class Primaries:
    """The primary the Sentinels last named to this process, per group, the process's open
    connections to primaries, and the listeners on each group's Sentinels."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._named: dict[Group, Address] = {}
        self._open: weakref.WeakSet[Any] = weakref.WeakSet()
        self._heard: dict[Group, object] = {}  # groups heard -> their listeners' token

    def named(self, connection: Any, address: Address) -> None:
        """`connection` (a `PrimaryConnection`) opened to `address`, the primary its
        Sentinels named as it began."""
        group = group_of(connection)
        pool = connection.connection_pool
        with self._lock:
            self._open.add(connection)
            self._listen(group, pool)
            old = self._named.get(group)
            if old is None or old == address:
                self._named[group] = address
                return
        # Another primary than the last: the Sentinels are asked again first, so that a
        # connection that looked up the old one before the failover (or asked a Sentinel
        # that had not heard of it yet) and opened late never sends the process back.
        try:
            now = pool.sentinel_manager.discover_master(pool.service_name)
        except redis.RedisError:
            return
        if (str(now[0]), int(now[1])) == address:
            self.moved(group, address)

    def moved(self, group: Group, address: Address) -> None:
        """The Sentinels of `group` name `address` its primary now: shut every connection
        of this process to the one it knew before."""
        me = os.getpid()
        with self._lock:
            old = self._named.get(group)
            self._named[group] = address
            if old is None or old == address:
                return
            leaving = [
                sock
                for c in self._open
                if c.pid == me and (c.host, int(c.port)) == old and group_of(c) == group
                if (sock := getattr(c, "_sock", None)) is not None
            ]  # fmt: skip
        log.warning(
            "the Sentinels name %s:%d the primary of %s now: leaving %s:%d (%d connections)",
            *address, group[0], *old, len(leaving),
        )  # fmt: skip
        for sock in leaving:  # the sockets of then: one reopened since is left alone
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def _listen(self, group: Group, pool: Any) -> None:
        """Start, once per group and process, a listener on each of its Sentinels (under
        `_lock`)."""
        if group in self._heard:
            return
        token = self._heard[group] = object()
        for sentinel in list(pool.sentinel_manager.sentinels):
            try:
                threading.Thread(
                    target=self._hear,
                    args=(group, sentinel, token),
                    name=f"gpufleet-sentinel-{_where(sentinel)}",
                    daemon=True,
                ).start()
            except RuntimeError:  # no thread to be had: the group's next connection tries
                log.warning("cannot listen to the Sentinels of %s", group[0], exc_info=True)
                del self._heard[group]
                return

    def _hear(self, group: Group, sentinel: redis.Redis, token: object) -> None:
        """Follow one Sentinel's `SWITCH_CHANNEL` for `group`'s primary, subscribing again
        when the Sentinel is lost, while the listeners of `token` are the group's own."""
        name, where = group[0], _where(sentinel)
        # A client of its own: the pool's Sentinel clients are shared, and a connection
        # another thread disconnects under a read raises whatever redis-py meets then.
        kwargs = sentinel.connection_pool.connection_kwargs
        own = redis.Redis(
            kwargs["host"],
            kwargs["port"],
            username=kwargs.get("username"),
            password=kwargs.get("password"),
            socket_timeout=kwargs.get("socket_timeout"),
            socket_connect_timeout=kwargs.get("socket_connect_timeout"),
        )  # connects only when used
        while self._wanted(group, token):
            pubsub: Any = None
            try:
                pubsub = own.pubsub(ignore_subscribe_messages=True)  # type: ignore[no-untyped-call]
                pubsub.subscribe(SWITCH_CHANNEL)
                while self._wanted(group, token):
                    message = pubsub.get_message(timeout=LISTEN_S)
                    if message is not None:
                        self._switch(group, name, message.get("data"))
                break
            except redis.exceptions.NoPermissionError as exc:
                log.warning(
                    "Sentinel %s does not let this user hear failovers (%s): give the "
                    "fleet's users '+subscribe &%s' there (docs/deploy.md); until then "
                    "connections leave a stopped primary only at their own timeouts",
                    where, exc, SWITCH_CHANNEL,
                )  # fmt: skip
                break
            except Exception:  # a listener outlives whatever its connection raises
                log.debug("lost Sentinel %s; subscribing again", where, exc_info=True)
            finally:
                if pubsub is not None:
                    with contextlib.suppress(Exception):
                        pubsub.close()
            time.sleep(RESUBSCRIBE_S)
        own.close()

    def _wanted(self, group: Group, token: object) -> bool:
        """Whether the listeners of `token` still serve `group`: they are its own, and a
        connection of the group is alive in this process (a client's pool keeps its
        connections, open or not, until the client is collected: they and the pool refer
        to each other, so a dropped client goes at the next full collection). When none
        is, the listeners stop, and the group's next connection starts others."""
        with self._lock:
            if self._heard.get(group) is not token:
                return False
            if any(group_of(c) == group for c in self._open):
                return True
            del self._heard[group]
            return False

    def _switch(self, group: Group, name: str, data: Any) -> None:
        """A `SWITCH_CHANNEL` message (`data`) for `group`, whose primary is `name`."""
        text = data.decode(errors="replace") if isinstance(data, bytes) else str(data)
        parts = text.split()
        if len(parts) == 5 and parts[0] == name and parts[4].isdigit():
            self.moved(group, (parts[3], int(parts[4])))

    def forked(self) -> None:
        """In a forked child: the parent's connections are not this process's to shut, nor
        its listeners (threads do not survive a fork) this process's to rely on."""
        self._lock = threading.Lock()
        self._open = weakref.WeakSet()
        self._heard = {}


def group_of(connection: Any) -> Group:
    """A Sentinel-watched connection's group: its primary's name and its Sentinels (read
    once per connection: redis-py reorders a pool's Sentinels as it asks them)."""
    group: Group | None = getattr(connection, "_gpufleet_group", None)
    if group is None:
        pool = connection.connection_pool
        sentinels = sorted(_where(s) for s in list(pool.sentinel_manager.sentinels))
        group = (pool.service_name, *sentinels)
        connection._gpufleet_group = group
    return group


def _where(sentinel: redis.Redis) -> str:
    """A Sentinel client's "HOST:PORT"."""
    kwargs = sentinel.connection_pool.connection_kwargs
    return f"{kwargs.get('host')}:{kwargs.get('port')}"


primaries = Primaries()
os.register_at_fork(after_in_child=primaries.forked)
