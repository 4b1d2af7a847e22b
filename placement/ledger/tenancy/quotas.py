"""Tenants' quotas: how many of a tenant's calls run at once, and how many may wait.

A tenant added with `--max-running N` has N running slots across the fleet. A router
holds each call it takes from the tenant's public queue to them (`enter`,
`quota_enter.lua`): the call takes a slot while the tenant has fewer than N taken and
none parked, else it is parked: its message moves from the router's in-flight list onto
the tenant's parked list in the same step. A slot is a token the fleet makes, which the
call carries on (the `gpufleet_slot` header, which no caller can set), so a call keeps its
slot wherever it waits or runs (the router, a GPU worker's queue, a batch) until it ends,
and no more than N of the tenant's calls run at once. As calls end, their slots free
(`leave`, `quota_leave.lua`: from Celery's signals where a call ends, and every router's
sweep each second for calls answered with no signal, or held longer than a call may be),
and the oldest parked calls take them: each goes back to the tenant's public queue, at
the end a router takes next, its slot kept for it. So parked calls run in the order they
came, and none fails for waiting.

`--max-queued M` bounds the waiting: a call that finds M of the tenant's calls parked is
refused at once with `QuotaError`. A tenant with no running limit has no parked calls;
for it, M bounds the calls holding slots (not answered yet).

The scripts read the quotas from the tenant's record, so a limit changed (a tenant added
again) holds from the next call, and a tenant with no running limit any more gets every
parked call back at the next sweep. The parked list holds broker messages, so quotas
apply where the registry's Redis is the broker (every fleet `gpufleet up` starts, and
compose's). Keys: `Keys.tenant_running`, `tenant_parked` and `tenant_handed_back`; a
tenant without quotas has none of them, and its calls pay nothing.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum

from placement.ledger.store import Store
from placement.ledger.tenancy import tenants

__all__ = ["Entry", "Slot", "counts", "enter", "held", "leave", "new_slot", "slots"]

HANDED = "handed:"  # the prefix of a slot kept for a call handed back (`quota_leave.lua`)


class Entry(Enum):
    """What `enter` did with a call."""

    IN = 1  # it goes on, holding the slot it was given (if its tenant has a quota)
    PARKED = 2  # moved to the tenant's parked list: not the router's any more
    REFUSED = 3  # the tenant has its `max_queued` waiting: refuse it (`QuotaError`)
    GONE = -2  # no longer in the router's in-flight list (a sweep gave it back)


@dataclass(frozen=True)
class Slot:
    """One taken slot: its member in the running set, its call, and when it was taken."""

    member: str
    task_id: str  # the fleet's id of it (`tenants.call_id`)
    taken_ms: float


def new_slot() -> str:
    """A fresh slot token."""
    return uuid.uuid4().hex


def member(slot: str, task_id: str) -> str:
    """The running set's member for call `task_id` holding `slot`."""
    return f"{slot}:{task_id}"


def enter(  # noqa: PLR0917 - a call's parts, as a router holds them
    store: Store, tenant: str, task_id: str, inflight: str, taken: bytes, slot: str
) -> Entry:
    """Let call `task_id` of `tenant` take `slot`, park it or refuse it, as a router takes
    it: its message `taken`, in the router's in-flight list `inflight` (see the module)."""
    keys = [
        store.keys.tenant_running(tenant),
        store.keys.tenant_parked(tenant),
        inflight,
        store.keys.tenants,
    ]
    sent_id = tenants.owner(task_id)[0]  # what its message, handed back, says
    return Entry(int(store._run("quota_enter", keys, [tenant, task_id, taken, slot, sent_id])))


def leave(store: Store, tenant: str, queue: str, members: Iterable[str] = ()) -> int:
    """Free `members` of `tenant`'s running set (its calls ended), and hand its oldest
    parked calls back to its public queue `queue` while slots are free; returns how many.
    Idempotent: a slot freed twice frees once."""
    keys = [
        store.keys.tenant_running(tenant),
        store.keys.tenant_parked(tenant),
        queue,
        store.keys.tenant_handed_back(tenant),
        store.keys.tenants,
    ]
    return int(store._run("quota_leave", keys, [tenant, *members]))


def slots(store: Store, tenant: str) -> list[Slot]:
    """`tenant`'s taken slots, oldest first (slots taken in one millisecond, in any order)."""
    key = store.keys.tenant_running(tenant)
    found = store._reaching(lambda: store.client.zrange(key, 0, -1, withscores=True))
    return [Slot(m, _call_of(m, tenant), float(score)) for m, score in found]


def _call_of(member: str, tenant: str) -> str:
    """The fleet's id of the call a running-set member holds a slot for: a slot kept for a
    call handed back names it by the task id its caller gave (`quota_leave.lua`)."""
    slot, _, task_id = member.partition(":")
    return tenants.call_id(task_id, tenant) if slot + ":" == HANDED else task_id


def counts(store: Store, tenant: str) -> tuple[int, int]:
    """`tenant`'s calls holding slots, and its calls parked."""
    return held(store, [tenant])[tenant]


def held(store: Store, tenants: list[str]) -> dict[str, tuple[int, int]]:
    """`counts` of each of `tenants`, in one round trip."""
    keys = store.keys
    found = store._read(
        [(kind, key(name)) for name in tenants
         for kind, key in (("zcard", keys.tenant_running), ("llen", keys.tenant_parked))]
    )  # fmt: skip
    return {name: (int(found[2 * i]), int(found[2 * i + 1])) for i, name in enumerate(tenants)}
