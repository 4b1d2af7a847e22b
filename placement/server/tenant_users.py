"""Each tenant's Redis user on the bundled Redis, kept equal to the registry's tenants.

`gpufleet tenant add` records a tenant in the registry (`placement.ledger.tenancy.tenants`) with
the digest of its password; the launcher, which runs the bundled Redis, gives it its user
(`placement.server.acl.tenant_rules`) on every data node within `SYNC_S`, and takes away
the user of a tenant removed. Redis keeps no ACL change in its append-only file nor sends
it to replicas, so a node that restarted, or a replica promoted, lacks them: each sync
reads every node's users (`ACL USERS`) and makes what is missing, which also covers a
restart nobody saw. It signs in as the launcher's `admin` user, which may do nothing but
this (`placement.server.acl`), and whose password no other process holds.

Behind Sentinels (`gpufleet up --redis-ha`) a tenant's client finds the primary through
them as its own user, so each Sentinel gets the tenant's user too, with the rights the
fleet's own users have there (`acl.SENTINEL_LOOKUP_RULES`: where the primary is, nothing
more), made and taken away the same way; the launcher signs in to them as `sentinel`.

A Redis of your own has no launcher: `gpufleet tenant add` prints the ACL line instead.

The tenants' passwords themselves are kept on the machine that added them, in the fleet's
directory (`PASSWORDS`, mode 0600, like the connection file): `gpufleet url --tenant`
prints a tenant's URL from there, and the HTTP front signs in as a tenant with it.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import redis

from placement.ledger.store import Store
from placement.ledger.tenancy import tenants
from placement.server.acl import SENTINEL_LOOKUP_RULES, tenant_rules

__all__ = ["PASSWORDS", "SYNC_S", "TenantUsers", "read_passwords", "save_passwords"]

PASSWORDS = "tenants.json"  # in a fleet's directory: tenant -> its Redis password

#: How often the launcher makes the users equal to the registry's tenants: how long a new
#: tenant waits for its user, at most (and a node back from a restart).
SYNC_S = 0.5
_USER_PREFIX = tenants.user_of("x")[:-1]

log = logging.getLogger(__name__)


class TenantUsers:
    """The tenants' users on the Redis nodes `admin_urls` names (the `admin` user's URL of
    each), as `store`'s registry lists its tenants."""

    def __init__(
        self,
        store: Store,
        admin_urls: Callable[[], Iterable[str]],
        redis_major: int,
        sentinel_urls: Callable[[], Iterable[str]] = tuple,
    ) -> None:
        self._store = store
        self._admin_urls = admin_urls
        self._sentinel_urls = sentinel_urls  # each Sentinel's, as its `sentinel` user
        self._major = redis_major
        self._clients: dict[str, Any] = {}  # str replies (decode_responses), untyped
        self._made: dict[str, dict[str, str]] = {}  # node URL -> user -> digest it was made with
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> TenantUsers:
        """Sync every `SYNC_S`, on a thread, until `stop`."""
        self._thread = threading.Thread(target=self._run, name="gpufleet-tenants", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5)
        for client in self._clients.values():
            client.close()
        self._clients.clear()

    def _run(self) -> None:
        while not self._stop.wait(SYNC_S):
            try:
                self.sync()
            except Exception:  # the registry away (a restart): the next tick tries again
                log.debug("could not sync tenants' users (next try)", exc_info=True)

    def sync(self) -> None:
        """Make every node's tenant users equal to the registry's tenants; a node that does
        not answer now is tried again at the next sync (logged)."""
        wanted = tenants.all_tenants(self._store)
        data = [(url, False) for url in self._admin_urls()]
        for url, sentinel in data + [(url, True) for url in self._sentinel_urls()]:
            try:
                self._sync_node(url, wanted, sentinel)
            except redis.RedisError as exc:
                self._clients.pop(url, None)
                log.debug("could not sync tenants' users on a Redis node (next try): %s", exc)

    def _sync_node(self, url: str, wanted: dict[str, tenants.Tenant], sentinel: bool) -> None:
        client: Any = self._clients.get(url)
        if client is None:
            client = self._clients[url] = redis.Redis.from_url(
                url, decode_responses=True, socket_timeout=2, socket_connect_timeout=2
            )  # a node or Sentinel that hangs costs one sync, not every later one
        present = {str(u) for u in client.acl_users() if str(u).startswith(_USER_PREFIX)}
        made = self._made.setdefault(url, {})
        pipe = client.pipeline(transaction=False)
        changes: list[tuple[str, str, str]] = []
        for name, tenant in wanted.items():
            user = tenants.user_of(name)
            if user in present and made.get(user) == tenant.digest:
                continue
            if user in present:  # another password now: its old holders go (DELUSER)
                pipe.execute_command("ACL", "DELUSER", user)
            own = SENTINEL_LOOKUP_RULES.split() if sentinel else tenant_rules(name, self._major)
            rules = ["reset", "on", f"#{tenant.digest}", *own]
            pipe.execute_command("ACL", "SETUSER", user, *rules)
            changes.append(("made", user, tenant.digest))
        stale = sorted(present - {tenants.user_of(n) for n in wanted})
        for user in stale:
            pipe.execute_command("ACL", "DELUSER", user)
            changes.append(("removed", user, ""))
        if not changes:
            return
        pipe.execute()
        for what, user, digest in changes:
            if digest:
                made[user] = digest
            else:
                made.pop(user, None)
            log.info("tenant user %s %s", user, what)


def read_passwords(path: Path) -> dict[str, str]:
    """The tenants' passwords kept at `path` (none when it is missing or unreadable)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}


def save_passwords(path: Path, passwords: dict[str, str]) -> None:
    """Keep `passwords` at `path`, mode 0600, replaced whole in one step."""
    path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        json.dump(passwords, fh)
    os.replace(tmp, path)
