"""A fleet's tenants: the teams that share it, each with a weight and a Redis user of its own.

A tenant is known by what it may write, never by what it claims. Its Redis user
(`placement.server.acl.tenant_rules`) may push calls to one list only, its public queue
`t.<name>.celery`: the list a plain Celery client pushes to when its transport option
`global_keyprefix` is `t.<name>.` (what `gpufleet url --tenant NAME --json` prints). The
router takes calls from every tenant's queue and marks each with the tenant of the queue
it came from (`tasks.broker.intake.envelope`), dropping whatever the caller wrote there;
the GPU workers then serve competing tenants in proportion to their weights
(`placement.rules.fairness`). The fleet's `caller` user is the default tenant, "", of
weight 1, on the router's queue `celery`: a fleet with no tenants serves as it always did.

Records live in the registry's hash `gpufleet:{fleet}:tenants`, name -> JSON
`{"weight": w, "digest": sha256-hex, "max_running": n, "max_queued": m}`: the digest of
the tenant's Redis password, which an ACL rule takes as `#<hex>` (the launcher gives each
tenant its user on the bundled Redis, `placement.server.tenant_users`), and its quotas
(`placement.ledger.tenancy.quotas`; 0, or absent: none). The password itself is never stored here.

A removed tenant's record stays, with `"removed_ms"` (when), while calls it sent before may
still wait or come back: its user is gone at once, the workers still take its queues, and
a router forgets the record (`forget`) once it has been removed a day and its queues are
empty (`tasks.serving.tenants.tenancy.forget_removed`). So no call of a removed tenant is left
behind, even one sent just before the router first took its queue.

A tenant's calls are its own (`call_id`). Inside the fleet a call of tenant T with task id
X is the call `X@T`: the router names it so as it takes it from T's queue, so every
record keyed by a call's id (the revoked set a cancel fills, leases, slots, claims) keeps
T's calls apart from another's of the same id. Its result and streamed text are stored
under T's key prefix (`owner` gives both back: `tasks.broker.results`,
`tasks.serving.streams`), which T's Redis user alone may read, so no other tenant can
read, stream or cancel them, even knowing X.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import re
from dataclasses import dataclass
from typing import Any, cast

from placement.errors import ConfigError, UnknownTenantError, describe
from placement.ledger.store import Store

__all__ = [
    "DEFAULT",
    "MAX_WEIGHT",
    "Tenant",
    "ID_SEP",
    "ID_SUFFIX",
    "add",
    "all_tenants",
    "call_id",
    "check_limit",
    "change",
    "check_name",
    "forget",
    "key_prefix",
    "owner",
    "queue_of",
    "records",
    "remove",
    "tenant_of",
    "split_queue",
    "user_of",
    "worker_queue",
    "worker_suffix",
]

#: The default tenant: the fleet's `caller` user, and the fleet's own processes.
DEFAULT = ""
#: The widest ratio of two tenants' shares a fleet takes (weights are 1/MAX..MAX apart).
MAX_WEIGHT = 1000.0
MAX_LIMIT = 1_000_000  # the largest quota a tenant may have (calls)
_NAME = re.compile(r"[a-z][a-z0-9-]{0,31}")
_QUEUE_HEAD, _QUEUE_TAIL = "t.", ".celery"
_WORKER_SEP = "~"  # in no host name, so in no GPU worker's queue name
#: Between a caller's task id and its tenant in the fleet's id of a call (`call_id`).
ID_SEP = "@"
#: The most characters `call_id` adds to a caller's task id (a name has 32 at most).
ID_SUFFIX = len(ID_SEP) + 32


@dataclass(frozen=True)
class Tenant:
    """One tenant: its name, its weight, the digest of its Redis password, and its quotas."""

    name: str
    weight: float
    digest: str
    removed_ms: int = 0  # when it was removed (registry clock); 0: it was not
    max_running: int = 0  # calls of it running at once, at most (0: no limit)
    max_queued: int = 0  # calls of it waiting, at most; past it, `QuotaError` (0: no limit)

    @property
    def queue(self) -> str:
        return queue_of(self.name)

    @property
    def removed(self) -> bool:
        return self.removed_ms > 0

    @property
    def limited(self) -> bool:
        """Whether a quota applies to its calls (`placement.ledger.tenancy.quotas`)."""
        return self.max_running > 0 or self.max_queued > 0

    def record(self) -> str:
        """Its record's JSON (`records` reads it back)."""
        fields: dict[str, Any] = {"weight": self.weight, "digest": self.digest}
        if self.removed_ms:
            fields["removed_ms"] = self.removed_ms
        if self.max_running:
            fields["max_running"] = self.max_running
        if self.max_queued:
            fields["max_queued"] = self.max_queued
        return json.dumps(fields)


def check_name(name: str) -> str:
    """`name` if it can name a tenant (a Redis user, a key prefix, a Prometheus label);
    raises `ConfigError` saying what can."""
    if not isinstance(name, str) or not _NAME.fullmatch(name):
        raise ConfigError(
            f"tenant name {describe(name)} is invalid: use 1 to 32 lowercase letters, digits "
            f"or '-', starting with a letter, e.g. team-a"
        )
    return name


def check_weight(weight: float) -> float:
    """`weight` if a tenant may have it (above 0, at most `MAX_WEIGHT`); raises `ConfigError`."""
    if isinstance(weight, bool) or not isinstance(weight, (int, float)):
        raise ConfigError(f"a tenant's weight must be a number, got {describe(weight)}")
    if not (math.isfinite(weight) and 1 / MAX_WEIGHT <= weight <= MAX_WEIGHT):
        raise ConfigError(
            f"a tenant's weight must be between {1 / MAX_WEIGHT:g} and {MAX_WEIGHT:g}, got "
            f"{weight!r}; a weight is a share, e.g. 3 against another's 1"
        )
    return float(weight)


def check_limit(value: int, what: str) -> int:
    """`value` if a tenant's quota `what` may be it (0, none, to `MAX_LIMIT`); raises
    `ConfigError`."""
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_LIMIT:
        raise ConfigError(
            f"a tenant's {what} must be a whole number of calls from 0 (no limit) to "
            f"{MAX_LIMIT}, got {describe(value)}"
        )
    return value


def key_prefix(name: str) -> str:
    """The prefix of the keys a tenant's client writes and reads (its calls, results and
    streamed text): its `global_keyprefix`; "" for the default tenant."""
    return "" if name == DEFAULT else f"{_QUEUE_HEAD}{check_name(name)}."


def call_id(task_id: str, tenant: str) -> str:
    """The fleet's id of the call `tenant`'s client sent as `task_id` (see the module):
    `task_id@tenant`; the default tenant's keeps its id, or gets a bare `@` after it when
    it holds one, so that no caller's id can name another tenant's call. `owner` reverses
    it. The router names each call once, as it takes it from a public queue
    (`tasks.broker.intake.envelope`)."""
    if tenant == DEFAULT:
        return f"{task_id}{ID_SEP}" if ID_SEP in task_id else task_id
    return f"{task_id}{ID_SEP}{check_name(tenant)}"


def owner(call: str) -> tuple[str, str]:
    """(the caller's task id, its tenant) of the fleet's id of a call (`call_id`). An id
    the fleet made itself, or that a fleet process sent straight to a worker, has no
    tenant after its last `@`, and is the default tenant's whole."""
    head, sep, name = call.rpartition(ID_SEP)
    if not sep:
        return call, DEFAULT
    if not name:
        return head, DEFAULT
    return (head, name) if _NAME.fullmatch(name) else (call, DEFAULT)


def queue_of(name: str) -> str:
    """A tenant's public queue (the router reads it; the tenant alone may push to it)."""
    return f"{key_prefix(name)}celery"


def tenant_of(queue: str) -> str | None:
    """The tenant whose public queue `queue` is, or None for any other queue."""
    if not (queue.startswith(_QUEUE_HEAD) and queue.endswith(_QUEUE_TAIL)):
        return None
    name = queue[len(_QUEUE_HEAD) : -len(_QUEUE_TAIL)]
    return name if _NAME.fullmatch(name) else None


def worker_queue(queue: str, tenant: str) -> str:
    """Where a call of `tenant` for the GPU worker of `queue` waits: a queue of its own per
    tenant (`queue~name`), so the worker takes its tenants' calls in turns and one
    tenant's burst waits in its own list, not ahead of another's call; the worker's own
    queue for the default tenant."""
    return queue + worker_suffix(tenant)


def worker_suffix(tenant: str) -> str:
    """What follows a worker's queue in `tenant`'s queue of it ("" for the default)."""
    return "" if tenant == DEFAULT else f"{_WORKER_SEP}{check_name(tenant)}"


def split_queue(queue: str) -> tuple[str, str]:
    """`worker_queue`'s inverse: (the worker's queue, the tenant)."""
    base, sep, name = queue.rpartition(_WORKER_SEP)
    return (base, name) if sep and _NAME.fullmatch(name) else (queue, DEFAULT)


def user_of(name: str) -> str:
    """A tenant's Redis user name."""
    return f"tenant-{check_name(name)}"


def digest_of(password: str) -> str:
    """What an ACL rule takes for `password` (after a `#`)."""
    return hashlib.sha256(password.encode()).hexdigest()


def add(
    store: Store,
    name: str,
    weight: float,
    password: str,
    *,
    max_running: int = 0,
    max_queued: int = 0,
) -> Tenant:
    """Record a new tenant (in place of a removed one of the same name whose calls still
    drain); raises `ConfigError` when the name is taken or a value is invalid."""
    tenant = Tenant(
        check_name(name),
        check_weight(weight),
        digest_of(password),
        max_running=check_limit(max_running, "--max-running"),
        max_queued=check_limit(max_queued, "--max-queued"),
    )
    record = tenant.record()
    key = store.keys.tenants

    def take(pipe: Any) -> bool:
        found = pipe.hget(key, name)
        if found is not None and not getattr(_parse(name, found), "removed", False):
            return False
        pipe.multi()
        pipe.hset(key, name, record)
        return True

    if not store._reaching(lambda: store.client.transaction(take, key, value_from_callable=True)):
        raise ConfigError(
            f"the fleet has a tenant {name!r} already; `gpufleet tenant remove {name}` first, "
            f"or pick another name"
        )
    return tenant


def change(
    store: Store,
    name: str,
    *,
    weight: float | None = None,
    max_running: int | None = None,
    max_queued: int | None = None,
) -> Tenant:
    """Change tenant `name`'s weight or quotas (None: as they are) and return it; its user
    and password stay. Workers apply a weight within a second; the quota scripts read
    the record, so quotas hold from the next call (a running limit raised or gone hands
    parked calls back at the next sweep). Raises `UnknownTenantError`, or `ConfigError`
    for a value a tenant may not have."""
    key = store.keys.tenants
    fields: dict[str, Any] = {}
    if weight is not None:
        fields["weight"] = check_weight(weight)
    if max_running is not None:
        fields["max_running"] = check_limit(max_running, "--max-running")
    if max_queued is not None:
        fields["max_queued"] = check_limit(max_queued, "--max-queued")

    def update(pipe: Any) -> Tenant | None:
        found = _parse(name, pipe.hget(key, name) or "")
        if found is None or found.removed:
            return None
        changed = dataclasses.replace(found, **fields)
        pipe.multi()
        pipe.hset(key, name, changed.record())
        return changed

    done = store._reaching(lambda: store.client.transaction(update, key, value_from_callable=True))
    if done is None:
        raise UnknownTenantError(_unknown(store, name))
    return cast(Tenant, done)


def remove(store: Store, name: str) -> Tenant:
    """Mark tenant `name` removed and return it (see the module); raises
    `UnknownTenantError`."""
    found = all_tenants(store).get(name)
    if found is None:
        raise UnknownTenantError(_unknown(store, name))
    removed = dataclasses.replace(found, removed_ms=store.now_ms())
    store._one("hset", store.keys.tenants, name, removed.record())
    return found


def forget(store: Store, name: str) -> bool:
    """Forget removed tenant `name`'s record, with its quota's and usage's keys (its queues
    and parked list are empty); False when it is not a removed tenant's (added again
    meanwhile, or forgotten already)."""
    key = store.keys.tenants

    def drop(pipe: Any) -> bool:
        found = pipe.hget(key, name)
        if found is None or not getattr(_parse(name, found), "removed", False):
            return False
        pipe.multi()
        pipe.hdel(key, name)
        keys = store.keys
        pipe.delete(keys.tenant_running(name), keys.tenant_handed_back(name))
        pipe.delete(keys.tenant_usage(name))
        return True

    return bool(
        store._reaching(lambda: store.client.transaction(drop, key, value_from_callable=True))
    )


def records(store: Store) -> dict[str, Tenant]:
    """Every tenant's record by name, removed ones whose calls still drain included (a
    record that does not parse is left out)."""
    raw: dict[str, str] = store._one("hgetall", store.keys.tenants)
    found = {}
    for name, text in sorted(raw.items()):
        tenant = _parse(name, text)
        if tenant is not None:
            found[name] = tenant
    return found


def all_tenants(store: Store) -> dict[str, Tenant]:
    """The fleet's tenants by name (not those removed)."""
    return {name: t for name, t in records(store).items() if not t.removed}


def _parse(name: str, text: str) -> Tenant | None:
    try:
        data: Any = json.loads(text)
        weight, digest = check_weight(data["weight"]), str(data["digest"])
        removed = data.get("removed_ms", 0)
        removed_ms = removed if isinstance(removed, int) and removed > 0 else 0
        return Tenant(
            check_name(name),
            weight,
            digest,
            removed_ms,
            check_limit(data.get("max_running", 0), "max_running"),
            check_limit(data.get("max_queued", 0), "max_queued"),
        )
    except (ValueError, KeyError, TypeError, ConfigError):
        return None


def _unknown(store: Store, name: str) -> str:
    names = ", ".join(all_tenants(store)) or "none yet"
    return f"the fleet has no tenant {name!r} (its tenants: {names}); `gpufleet tenant add`"
