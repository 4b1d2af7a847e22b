"""Tenants in a running worker: each takes its tenants' calls from queues of their own, in
turns by their weights.

Both kinds of worker read the registry's tenants (`placement.ledger.tenancy.tenants`) at most every
`POLL_S`, from the consumer's timer in the worker's main process, between two messages:

- a router consumes each tenant's public queue `t.<name>.celery` as the tenant is added;
- a GPU worker consumes, beside its own queue, one queue per tenant (`queue~<name>`,
  `placement.ledger.tenancy.tenants.worker_queue`), where routers send that tenant's calls.

Each takes from its queues in turns weighted by their tenants' weights
(`placement.rules.fairness.FairTurns`, `tasks.broker.transport.Channel.take_turns`), and a
GPU worker's batcher orders the calls it holds by the same rule (`tasks.serving.batching`):
so one tenant's burst waits in its own lists, and another tenant's call is taken at the next
turn and runs in the next batch. Each worker records the queues it takes from in its
presence record before it first takes from one, so that a sweep after its death finds
what it held there (`tasks.broker.presence`).

A removed tenant's user is gone at once, so nothing new arrives in its queues; they are
still taken for `KEEP_REMOVED_MS`, and then until they are empty, before a router forgets
the tenant: every call it sent before is answered, never left behind, even one that comes
back to its queue late (a retry, a re-route, a message given back). A call of a tenant no
longer known is sent to the worker's own queue. A tenant's weight reaches the workers
within `POLL_S`; a call of a tenant the worker does not know (yet, or any more) weighs 1.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from placement.errors import GpufleetError
from placement.ledger.tenancy import quotas, tenants
from placement.ledger.tenancy.tenants import DEFAULT, Tenant, split_queue, worker_queue
from tasks import context
from tasks.broker import presence
from tasks.broker.presence import KEEP_GONE_MS

log = logging.getLogger(__name__)

#: How often a worker reads the tenants: how long a new tenant waits for the router to
#: take its calls, and a new weight to apply.
POLL_S = 1.0
#: How often a process reads the tenants again for a name it has not seen (a call of a
#: tenant added since its last read; bounds the reads a forgotten tenant's calls cause).
UNSEEN_S = 0.05
#: How long a removed tenant's queues are still taken (see `forget_removed`). As long as a
#: dead worker's record is kept (`tasks.broker.presence.KEEP_GONE_MS`): longer than any
#: call of it can still be on its way back (the visibility timeout, retries, re-routes).
KEEP_REMOVED_MS = KEEP_GONE_MS


class Tenancy:
    """The fleet's tenants as this process last read them. Only `refresh` reads the
    registry (a worker's timer tick, or a task about to route a call): what the take and
    the batcher ask of it comes from memory."""

    def __init__(self) -> None:
        self._records: dict[str, Tenant] = {}
        self._read_at = -float("inf")

    def refresh(self, within: float = POLL_S) -> dict[str, Tenant]:
        """Every tenant's record by name, removed ones included, read again when older
        than `within` seconds (kept as they were while the registry cannot say)."""
        now = time.monotonic()
        if now - self._read_at >= within:
            self._read_at = now
            try:
                self._records = tenants.records(context.registry())
            except Exception as exc:  # a registry away, a broken record: keep what we had
                log.warning("could not read the fleet's tenants (kept as they were): %s", exc)
        return self._records

    def known(self, tenant: str) -> str:
        """`tenant`, if the fleet has its record (removed or not), else the default
        tenant: a call of a tenant no worker takes queues for goes to the worker's own.
        A name this process has not seen is looked up again first (`UNSEEN_S`): a tenant
        added within the last `POLL_S` is known to the router that took its call before
        it is to this process (a router's pool child)."""
        if tenant == DEFAULT:
            return DEFAULT
        if tenant not in self.refresh():
            self.refresh(UNSEEN_S)
        return tenant if tenant in self._records else DEFAULT

    def tenanted(self) -> bool:
        """Whether the fleet has a tenant besides the default one (as last read, removed
        ones too until they are forgotten): calls of several may then reach this worker."""
        return bool(self._records)

    def weight(self, tenant: str) -> float:
        """`tenant`'s weight (1 for the default tenant, and one not known or removed)."""
        found = self._records.get(tenant)
        return found.weight if found is not None and not found.removed else 1.0


def queue_tenant(queue: str) -> str:
    """The tenant whose queue `queue` is (a public one, or one of a GPU worker's); the
    default tenant's for the workers' own."""
    return tenants.tenant_of(queue) or split_queue(queue)[1]


#: This process's view (a router's or GPU worker's consumer, and the tasks it runs).
process = Tenancy()


def follow_queues(consumer: Any) -> None:
    """A router's timer tick: take from every tenant's public queue, a removed tenant's
    until it is forgotten (`forget_removed`)."""
    found = process.refresh()
    wanted = {t.queue for t in found.values()}
    _consume(consumer, wanted, lambda q: tenants.tenant_of(q) is not None)
    forget_removed(found)


def follow_worker_queues(consumer: Any) -> None:
    """A GPU worker's timer tick: take from its tenants' queues of its own queue, and from a
    queue of a tenant no longer known until it is empty."""
    found = process.refresh()
    consuming = _consuming(consumer)
    if consuming is None:
        return
    own = [q for q in consuming if split_queue(q)[1] == DEFAULT]
    wanted = {worker_queue(q, name) for q in own for name in found}
    for queue in consuming - wanted:
        if split_queue(queue)[1] != DEFAULT and _waiting(queue) != 0:
            wanted.add(queue)  # a forgotten tenant's calls still wait: take them first
    _consume(consumer, wanted, lambda q: split_queue(q)[1] != DEFAULT)


def _consuming(consumer: Any) -> set[str] | None:
    task_consumer = getattr(consumer, "task_consumer", None)
    return None if task_consumer is None else {q.name for q in task_consumer.queues}


def _consume(consumer: Any, wanted: set[str], tenants_queue: Callable[[str], bool]) -> None:
    """Take from exactly `wanted` of the queues `tenants_queue` says are tenants' (and
    from the worker's own as before): recorded first, then consumed."""
    consuming = _consuming(consumer)
    if consuming is None:  # not connected yet
        return
    target = {q for q in consuming if not tenants_queue(q)} | wanted
    if target == consuming:
        return
    try:
        presence.consuming(target)
    except Exception as exc:  # the next tick tries again; nothing taken from them meanwhile
        log.warning("could not record the queues this worker takes: %s", exc)
        return
    for queue in sorted(target - consuming):
        consumer.add_task_queue(queue)
        log.info("taking calls from %s", queue)
    for queue in sorted(consuming - target):
        consumer.cancel_task_queue(queue)
        log.info("no more calls on %s", queue)


def _waiting(queue: str) -> int | None:
    try:
        return presence.waiting(queue)
    except Exception as exc:  # the broker away: as if something waited
        log.warning("could not count the calls waiting on %s: %s", queue, exc)
        return None


def forget_removed(found: dict[str, Tenant]) -> None:
    """Forget each tenant removed more than `KEEP_REMOVED_MS` ago whose calls are gone from
    its public queue, its parked list and its queue of every GPU worker. Until then its queues are
    still taken: a call of it may still come back to one (a retry, a call routed again, a
    message given back after its worker died)."""
    removed = [t for t in found.values() if t.removed]
    if not removed:
        return
    try:
        registry = context.registry()
        now = registry.now_ms()
        due = [t for t in removed if now - t.removed_ms >= KEEP_REMOVED_MS]
        if not due:
            return
        gpus = {g.queue for g in registry.snapshot().gpus.values() if g.queue}
        for tenant in due:
            queues = [tenant.queue, *(worker_queue(q, tenant.name) for q in sorted(gpus))]
            parked = quotas.counts(registry, tenant.name)[1]
            if (
                not parked
                and all(_waiting(q) == 0 for q in queues)
                and tenants.forget(registry, tenant.name)
            ):
                log.info("forgot tenant %s, removed and with no call left", tenant.name)
    except GpufleetError as exc:  # the registry away: look again at the next tick
        log.warning("could not look at the removed tenants: %s", exc)
