"""How many connections callers may hold on the bundled Redis, and the guard that holds
them to it.

Redis refuses a new connection once `maxclients` are open, whoever opens it, and has no
limit per user. A caller who opened 10,100 idle connections in 2.5 s thus left none for
the fleet: a new caller's call failed after 19 s, and so did `gpufleet status` (issue 55).
So `gpufleet up` gives its Redis a known `maxclients` (`max_clients`), and a guard in the
launcher keeps every connection that is not the fleet's or the operator's (the `caller`
user's, the tenants', and those that never authenticated) to at most half of it
(`CALLER_SHARE`): every `GUARD_EVERY_S` it counts the connections (INFO, one line) and, past
the bound, reads the client list and closes the excess. What it closes first
(`_close_first`): connections stuck before authenticating; then callers' connections waiting
for nothing (not subscribed, not blocked), the longest idle first; then connections a second
old or less that have not authenticated yet (a fleet process's may be mid-handshake); then
the longest idle of the rest. So a flood of idle connections goes before a caller that is
working or waiting on an answer, and a caller connecting after the flood is served: it is
the flood's connections that make room. (A caller's pooled connection closed while idle
costs it nothing: its client opens another at its next command.)

What holds, then: the fleet's processes and its operator always find a free connection
(the other half, far more than a fleet opens: about ten per worker process), and a
caller connecting during such a flood is either served or sees its connection closed or
Redis's own "max number of clients reached", never a hang. Only a caller that opens
connections faster than half of `maxclients` per `GUARD_EVERY_S` (25,000 a second with the
defaults) could fill the server between two looks. A Redis of your own has no guard: set
its `maxclients`, and limit callers in front of it (docs/deploy.md, "Security").
"""

from __future__ import annotations

import logging
import resource
import threading
from typing import Any

import redis

from placement.ledger import endpoint
from placement.ledger.tenancy import tenants
from placement.server.acl import ADMIN, CALLER, FLEET, OPERATOR

__all__ = ["CALLER_SHARE", "GUARD_EVERY_S", "MAX_CLIENTS", "ConnectionGuard", "max_clients"]

log = logging.getLogger(__name__)

#: Redis's own default `maxclients`, kept where the process may open that many files.
MAX_CLIENTS = 10_000
#: Redis keeps this many file descriptors for itself beyond its clients (its own rule).
_RESERVED_FDS = 32
#: The share of `maxclients` callers may hold. Half: the fleet's own processes open about
#: ten connections each, so the other half holds a fleet of hundreds of workers, and no
#: flood fills the caller's half between two looks (see the module). A policy, not tuned.
CALLER_SHARE = 0.5
#: How often the guard counts the connections.
GUARD_EVERY_S = 0.1


def max_clients() -> int:
    """The `maxclients` the bundled Redis runs with: Redis's default, or what this process
    may open files for (its hard limit, which the server inherits and raises to)."""
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:
        return MAX_CLIENTS
    return max(1, min(MAX_CLIENTS, hard - _RESERVED_FDS))


class ConnectionGuard:
    """Keeps the `caller` user's connections to `limit` (see the module), on a thread."""

    def __init__(self, url: str, limit: int, every_s: float = GUARD_EVERY_S) -> None:
        self.limit = limit
        self._client = endpoint.connect(url, socket_timeout=5, socket_connect_timeout=5)
        self._every_s = every_s
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.closed = 0  # connections closed so far

    def start(self) -> ConnectionGuard:
        self._thread = threading.Thread(target=self._run, name="gpufleet-guard", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        self._client.close()

    def _run(self) -> None:
        while not self._stop.wait(self._every_s):
            try:
                self.check()
            except redis.RedisError as exc:  # a restart, say: look again at the next tick
                log.debug("connection guard: %s", exc)
            except Exception:  # a guard that stopped would leave the flood in: look again
                log.exception("connection guard: the look failed; looking again")

    def check(self) -> int:
        """Close the callers' connections past the limit; returns how many it closed."""
        if int(self._client.info("clients")["connected_clients"]) <= self.limit:
            return 0  # even if every one were a caller's
        outsiders = [c for c in self._client.client_list() if c.get("user") not in _INSIDERS]
        excess = len(outsiders) - self.limit
        if excess <= 0:
            return 0
        victims = sorted(outsiders, key=_close_first)[:excess]
        pipe = self._client.pipeline(transaction=False)
        for client in victims:
            pipe.client_kill_filter(_id=client["id"])
        pipe.execute(raise_on_error=False)  # one may have left meanwhile
        self.closed += len(victims)
        log.warning(
            "closed %d connection(s) of callers: they may hold %d at once", len(victims), self.limit
        )
        return len(victims)


#: The users whose connections the guard leaves alone.
_INSIDERS = frozenset({FLEET, OPERATOR, ADMIN})


def is_caller(user: str) -> bool:
    """Whether `user` is a caller's: the `caller` user's, or a tenant's."""
    return user == CALLER or user.startswith(_TENANT_USERS)


_TENANT_USERS = tenants.user_of("x")[:-1]


def _close_first(client: dict[str, Any]) -> tuple[int, int]:
    """The order in which the guard closes connections (see the module): a tier, then the
    longest idle first."""
    age, idle = int(client.get("age", 0) or 0), int(client.get("idle", 0) or 0)
    flags = str(client.get("flags", ""))
    waiting = int(client.get("sub", 0) or 0) > 0 or "b" in flags or "P" in flags
    if not is_caller(str(client.get("user"))):  # not authenticated (`default` is off)
        return (0 if age >= 1 else 2), -idle
    return (3 if waiting else 1), -idle
