"""Tenants' quotas: how many of a tenant's calls run at once, and how many may wait.

A tenant added with `--max-running N` has N running slots across the fleet. A router lets
each of its calls in as it takes it (`enter`, `quota_enter.lua`): into the tenant's running
set while it has fewer than N calls there and none parked, else onto the tenant's parked
list, moved there from the router's in-flight list in the same step. A call stays in the
running set from then until it is answered (wherever it waits or runs meanwhile: the
router, a GPU worker's queue, a batch), so no more than N of the tenant's calls ever run
at once. When calls are answered (`leave`, `quota_leave.lua`: the fleet's result backend
as it stores an answer, and every router's sweep for answers it missed) their slots free,
and the oldest parked calls take them: each is let in as it leaves the parked list and
goes back to the tenant's public queue, at the end the router takes next (behind any call
handed back before it that the router has not taken yet). So parked calls run in the
order they came, and none fails for waiting.

`--max-queued M` bounds the waiting: a call that finds M of the tenant's calls parked is
refused at once with `QuotaError` (429 over HTTP). A tenant with no running limit has no
parked calls; for it, M bounds the calls let in and not answered yet.

The parked list holds broker messages, so quotas apply where the registry's Redis is the
broker (every fleet `gpufleet up` starts, and compose's). Keys: `Keys.tenant_running` and
`Keys.tenant_parked`; a tenant without quotas has neither, and its calls pay nothing.
"""

from __future__ import annotations

from collections.abc import Iterable
from enum import Enum

from placement.ledger.store import Store
from placement.ledger.tenants import Tenant

__all__ = ["Entry", "counts", "enter", "leave", "running"]


class Entry(Enum):
    """What `enter` did with a call."""

    IN = 1  # let in: it goes on as a call of a tenant without quotas would
    PARKED = 2  # moved to the tenant's parked list: not the router's any more
    REFUSED = 3  # the tenant has its `max_queued` waiting: refuse it (`QuotaError`)
    GONE = -2  # no longer in the router's in-flight list (a sweep gave it back)


def enter(store: Store, tenant: Tenant, task_id: str, inflight: str, taken: bytes) -> Entry:
    """Let call `task_id` of `tenant` in, park it or refuse it, as its router takes it: its
    message `taken`, in the router's in-flight list `inflight` (see the module)."""
    keys = [store.keys.tenant_running(tenant.name), store.keys.tenant_parked(tenant.name)]
    args = [task_id, taken, tenant.max_running, tenant.max_queued]
    return Entry(int(store._run("quota_enter", [*keys, inflight], args)))


def leave(store: Store, tenant: Tenant, task_ids: Iterable[str] = ()) -> int:
    """Free the running slots of `tenant`'s calls `task_ids` (answered), and give slots
    free to its oldest parked calls; returns how many were let in. Idempotent: a call
    answered twice, or twice reported, frees its slot once."""
    keys = [
        store.keys.tenant_running(tenant.name),
        store.keys.tenant_parked(tenant.name),
        tenant.queue,
        store.keys.tenant_handed_back(tenant.name),
    ]
    return int(store._run("quota_leave", keys, [tenant.max_running, *task_ids]))


def running(store: Store, name: str) -> list[str]:
    """The task ids of tenant `name`'s calls let in and not answered yet, oldest first."""
    found: list[str] = store._one("zrange", store.keys.tenant_running(name), 0, -1)
    return found


def counts(store: Store, name: str) -> tuple[int, int]:
    """Tenant `name`'s calls let in and not answered yet, and its calls parked."""
    let_in, parked = store._read(
        [("zcard", store.keys.tenant_running(name)), ("llen", store.keys.tenant_parked(name))]
    )
    return int(let_in), int(parked)
