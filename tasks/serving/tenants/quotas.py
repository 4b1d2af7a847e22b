"""Tenants' quotas in the workers: a router holds each call it takes from a tenant's public
queue to the tenant's quota, and every call's end frees its slot (the rule and its keys:
`placement.ledger.tenancy.quotas`).

- `enter`: a router's forwarder asks it of every `gpufleet.infer` it takes from the public
  queue of a tenant with quotas, in its consumer's thread, before the call goes anywhere
  (after the cheap drops: a revoked call, a call the consumer will refuse): the call takes
  a slot, which it carries on in the `gpufleet_slot` header; or it is parked (moved out of
  the router's hands, counted acknowledged); or it is marked refused, which the consumer
  answers with `QuotaError` (`refusal`).
- `_ended` (Celery's `task_postrun` and `task_revoked`, wherever a call ends: a GPU
  worker's pool child, a router's pool, a cancel) frees the slot of a call that ended
  (a call handed on, `Ignore`d or retried keeps it).
- `sweep`: a router's timer tick frees the slots of answered calls no signal reported (a
  refusal stored by a consumer, a process killed between its answer and its signal) and
  of calls holding one longer than the visibility timeout (a call that stores no result);
  and hands parked calls back into slots free, or all of them to a tenant that has no
  running limit any more.

A tenant without quotas costs one dictionary lookup per call taken, and nothing as its
calls end. A call taken while the registry cannot be reached goes on without a slot
(logged): refusing or holding it would stop the tenant for an outage the rest of the
fleet rides out.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import states
from celery.signals import task_postrun, task_revoked
from celery.worker import state as worker_state

from placement.errors import GpufleetError, QuotaError
from placement.ledger.tenancy import quotas, tenants
from placement.ledger.tenancy.quotas import Entry, member, new_slot
from placement.ledger.tenancy.tenants import Tenant
from tasks import context
from tasks.app import app
from tasks.broker import intake, results
from tasks.broker.intake import SLOT_HEADER
from tasks.config import CALL_TASKS, INFER
from tasks.serving.calls import slot_of, tenant_in, tenant_of
from tasks.serving.tenants import tenancy

log = logging.getLogger(__name__)

#: The attribute of a taken message `enter` refused; the consumer answers it (`refusal`).
REFUSED = "gpufleet_quota_refusal"


def enter(message: Any, taken: tuple[str, bytes] | None) -> Entry:
    """Hold a router's taken `message` to its tenant's quota (see the module): `taken` is
    its in-flight list and bytes. A message refused is marked for `refusal`."""
    headers = message.headers
    task_id = headers.get("id") if isinstance(headers, dict) else None
    if taken is None or not isinstance(task_id, str) or headers.get("task") != INFER:
        return Entry.IN
    tenant = _limited(tenant_in(headers))
    if tenant is None or not _from_public_queue(message, tenant) or not _one_redis():
        return Entry.IN  # the fleet's own hops of a call carry the slot it took
    if task_id in worker_state.revoked or not _takes(message):
        return Entry.IN  # dropped or refused by the consumer: no slot for it
    slot = new_slot()
    try:
        entry = quotas.enter(context.registry(), tenant.name, task_id, *taken, slot)
    except GpufleetError as exc:
        log.warning("could not hold call %s to tenant %s's quota: %s", task_id, tenant.name, exc)
        return Entry.IN
    if entry is Entry.IN:
        headers[SLOT_HEADER] = slot
    elif entry is Entry.REFUSED:
        setattr(message, REFUSED, QuotaError(_refused(tenant)))
    return entry


def refusal(message: Any) -> QuotaError | None:
    """The error `enter` refused `message` with, if it did."""
    found: QuotaError | None = getattr(message, REFUSED, None)
    return found


def _limited(name: str) -> Tenant | None:
    found = tenancy.process.refresh().get(name) if name else None
    return found if found is not None and found.limited else None


def _from_public_queue(message: Any, tenant: Tenant) -> bool:
    """Whether `message` came from `tenant`'s public queue (the transport writes where a
    message came from: `tasks.broker.intake.envelope`)."""
    return (message.delivery_info or {}).get("routing_key") == tenant.queue


def _takes(message: Any) -> bool:
    """Whether the consumer will take `message` (it refuses what fails `intake.check`)."""
    try:
        intake.check(message, app.tasks)
    except GpufleetError:
        return False
    return True


def _refused(tenant: Tenant) -> str:
    if tenant.max_running:
        held = f"{tenant.max_queued} calls waiting for its {tenant.max_running} running slots"
    else:
        held = f"{tenant.max_queued} calls not answered yet"
    return (
        f"tenant {tenant.name!r} has {held} (its --max-queued); send this call again once "
        f"some are answered, or ask the fleet's operator for a higher --max-queued"
    )


@functools.cache
def _one_redis() -> bool:
    """`context.one_redis`, said once in the log when it is not: parked messages live in
    the broker, which the quota scripts must reach."""
    if context.one_redis():
        return True
    log.warning("tenants' quotas are not applied: the broker is not the registry's Redis")
    return False


def sweep(_: Any = None) -> None:
    """A router's timer tick (see the module)."""
    found = list(tenancy.process.refresh().values())
    if not found or not _one_redis():
        return
    registry = context.registry()
    parked = registry._read([("llen", registry.keys.tenant_parked(t.name)) for t in found])
    oldest = registry.now_ms() - context.settings().visibility_timeout * 1000
    for tenant, waiting in zip(found, parked, strict=True):
        if not tenant.limited and not waiting:
            continue
        held = quotas.slots(registry, tenant.name)
        answered = results.answered(app.backend, [s.task_id for s in held]) if held else set()
        done = [s.member for s in held if s.task_id in answered or s.taken_ms < oldest]
        if done or waiting:
            moved = quotas.leave(registry, tenant.name, tenant.queue, done)
            if done or moved:
                log.info(
                    "tenant %s: %d slots freed, %d calls handed back", tenant.name, len(done), moved
                )


def _leave(request: Any, task_id: Any) -> None:
    slot, tenant = slot_of(request), tenant_of(request)
    if not slot or not tenant or not isinstance(task_id, str):
        return  # no quota held it
    try:
        quotas.leave(context.registry(), tenant, tenants.queue_of(tenant), [member(slot, task_id)])
    except GpufleetError as exc:  # a router's sweep frees it
        log.warning("could not free call %s's slot of tenant %s: %s", task_id, tenant, exc)


@task_postrun.connect
def _ended(
    sender: Any = None, task_id: Any = None, task: Any = None, state: Any = None, **_: Any
) -> None:
    if getattr(sender, "name", None) in CALL_TASKS and state in states.READY_STATES:
        _leave(task.request, task_id)


@task_revoked.connect
def _revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) in CALL_TASKS and request is not None:
        _leave(request, getattr(request, "id", None))
