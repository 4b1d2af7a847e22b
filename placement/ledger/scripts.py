"""The registry's Lua scripts, read from package files and registered once per client.

Each `placement/ledger/lua/<name>.lua` opens with its KEYS/ARGV contract. `_lib.lua` holds
helpers that are prepended to every script, since Redis 6 has no shared functions.
`take.lua` and `move.lua` are the broker's, not the ledger's; `forward.lua` (pick.lua and
move.lua in one step) and the tenants' `quota_*.lua` are both. `tasks.broker.transport`
sends `take` by `sha` and `source` on a connection whose replies it reads itself.

Scripts are called with EVALSHA over a connection each thread holds for itself, made
with the client's own connection settings (password, TLS, database). redis-py's
command path (pool checkout, observability hooks, generic packing) adds about 85 µs to
a 50 µs round trip on the 2-core test machine, and every call of the fast path (`pick`,
`finish`) and of the router's miss path is a script call (docs/placement.md). A script unknown to
the server (NOSCRIPT: after a restart, a failover or a SCRIPT FLUSH) is loaded and called
again; a demoted primary's READONLY drops the connection (`placement.ledger.endpoint`).
"""

from __future__ import annotations

import functools
import hashlib
import os
import threading
import weakref
from importlib import resources
from typing import Any

import redis
import redis.sentinel
from redis.exceptions import NoScriptError
from redis.utils import HIREDIS_AVAILABLE

if HIREDIS_AVAILABLE:
    import hiredis

NAMES = (
    "register",
    "heartbeat",
    "commit",
    "admit",
    "confirm",
    "settle",
    "hold",
    "pick",
    "finish",
    "evict",
    "reap",
    "learn",
    "claim",
    "redeliver",
    "renew",
    "seen",
    "move",
    "forward",
    "quota_enter",
    "quota_leave",
)


@functools.cache
def source(name: str) -> str:
    """The full text sent to Redis for script `name`: the shared helpers, then the script."""
    lua = resources.files("placement.ledger") / "lua"
    return (lua / "_lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


@functools.cache
def sha(name: str) -> str:
    """The SHA1 that Redis knows script `name` by."""
    return hashlib.sha1(source(name).encode()).hexdigest()


class Scripts:
    """The scripts bound to one client, called over one connection per thread."""

    def __init__(self, client: redis.Redis) -> None:
        pool = client.connection_pool
        self._connect = functools.partial(pool.connection_class, **pool.connection_kwargs)
        self._mine = threading.local()
        # A Sentinel-managed connection finds the primary in `connect`, which redis-py's
        # pool calls and its send path does not: a closed one would dial its default host.
        self._dials = isinstance(pool, redis.sentinel.SentinelConnectionPool)

    def __call__(self, name: str, keys: list[str], args: list[Any]) -> Any:
        """Run script `name` and return its reply; a Redis error reply is raised."""
        conn = self._connection()
        if self._dials:
            conn.connect()  # a no-op while connected
        try:
            try:
                return self._call(conn, sha(name), keys, args)
            except NoScriptError:  # a restarted or new primary: load it there
                conn.send_command("SCRIPT", "LOAD", source(name))
                conn.read_response()
                return self._call(conn, sha(name), keys, args)
        except (redis.ConnectionError, redis.TimeoutError):
            # Its reply may still come: the next call on this connection would read it as
            # its own (a Sentinel-managed connection does not drop itself on a timeout).
            conn.disconnect()
            raise

    @staticmethod
    def _call(conn: Any, digest: str, keys: list[str], args: list[Any]) -> Any:
        command = ("EVALSHA", digest, len(keys), *keys, *args)
        if HIREDIS_AVAILABLE:  # hiredis packs str, bytes, int and float by itself
            conn.send_packed_command([hiredis.pack_command(command)])
        else:
            conn.send_command(*command)
        return conn.read_response()

    def _connection(self) -> Any:
        """This thread's connection; a forked child makes its own rather than share one."""
        mine = self._mine
        if getattr(mine, "pid", None) != os.getpid():
            mine.conn, mine.pid = self._connect(), os.getpid()
        return mine.conn


_per_client: weakref.WeakKeyDictionary[redis.Redis, Scripts] = weakref.WeakKeyDictionary()


def scripts_for(client: redis.Redis) -> Scripts:
    """The one `Scripts` of `client`, made on first use."""
    found = _per_client.get(client)
    if found is None:
        found = _per_client[client] = Scripts(client)
    return found
