"""Tenants' quotas in the workers: a router lets each call in as it takes it, and every
answer frees its call's slot (the rule and its keys: `placement.ledger.quotas`).

- `enter`: a router's forwarder asks it of every `gpufleet.infer` it takes, in its
  consumer's thread, before the call goes anywhere: a call of a tenant with quotas is let
  in, parked (moved out of the router's hands, counted acknowledged) or marked refused,
  which the consumer answers with `QuotaError` (`refusal`).
- `_answered` (Celery's `task_postrun` and `task_revoked`, wherever a call ends: a GPU
  worker's pool child, a router's pool, a cancel) frees the slot of a call that ended with
  an answer (a call handed on, `Ignore`d or retried keeps it).
- `sweep`: a router's timer tick frees the slots of answered calls that no signal
  reported (a refusal stored by a consumer, a process killed between its answer and its
  signal), and lets parked calls into slots a limit raised.

A tenant without quotas costs one dictionary lookup per call here, and no Redis command.
A call taken while the registry cannot be reached goes on unlimited (logged): refusing or
holding it would stop the tenant for an outage the rest of the fleet rides out.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

from celery import states
from celery.signals import task_postrun, task_revoked

from placement.errors import GpufleetError, QuotaError
from placement.ledger import quotas
from placement.ledger.quotas import Entry
from placement.ledger.tenants import Tenant
from tasks import context
from tasks.app import app
from tasks.broker import results
from tasks.serving import tenancy
from tasks.serving.calls import CALL_TASKS, tenant_in, tenant_of

log = logging.getLogger(__name__)

TASK = "gpufleet.infer"  # what a caller sends, which a router takes
#: The attribute of a taken message `enter` refused; the consumer answers it (`refusal`).
REFUSED = "gpufleet_quota_refusal"


def limited(name: str) -> Tenant | None:
    """`name`'s record if it is a tenant with quotas, as this process last read it."""
    found = tenancy.process.refresh().get(name) if name else None
    return found if found is not None and found.limited else None


def enter(message: Any, taken: tuple[str, bytes] | None) -> Entry:
    """Let a router's taken `message` in (see the module): `taken` is its in-flight list
    and bytes. A message refused is marked for `refusal`."""
    headers = message.headers
    task_id = headers.get("id") if isinstance(headers, dict) else None
    if taken is None or not isinstance(task_id, str) or headers.get("task") != TASK:
        return Entry.IN
    tenant = limited(tenant_in(headers))
    if tenant is None or not _one_redis():
        return Entry.IN
    try:
        entry = quotas.enter(context.registry(), tenant, task_id, *taken)
    except GpufleetError as exc:
        log.warning("could not hold call %s to tenant %s's quota: %s", task_id, tenant.name, exc)
        return Entry.IN
    if entry is Entry.REFUSED:
        setattr(message, REFUSED, QuotaError(_refused(tenant)))
    elif entry is Entry.PARKED:
        log.info("call %s of tenant %s waits for a running slot", task_id, tenant.name)
    return entry


def refusal(message: Any) -> QuotaError | None:
    """The error `enter` refused `message` with, if it did."""
    found: QuotaError | None = getattr(message, REFUSED, None)
    return found


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
    """Whether the broker is the registry's Redis, where parked messages can live."""
    settings = context.settings()
    if settings.broker_url == settings.registry_url:
        return True
    log.warning("tenants' quotas are not applied: the broker is not the registry's Redis")
    return False


def sweep(_: Any = None) -> None:
    """A router's timer tick: free the slots of answered calls of every tenant with quotas,
    and let parked calls into free slots (see the module)."""
    found = [t for t in tenancy.process.refresh().values() if t.limited]
    if not found or not _one_redis():
        return
    registry = context.registry()
    backend = app.backend
    for tenant in found:
        ids = quotas.running(registry, tenant.name)
        done = sorted(results.answered(backend, ids)) if ids else []
        if quotas.leave(registry, tenant, done) or done:
            log.info("tenant %s: %d slots freed by the sweep", tenant.name, len(done))


def _leave(tenant_name: str, task_id: Any) -> None:
    tenant = limited(tenant_name)
    if tenant is None or not isinstance(task_id, str) or not _one_redis():
        return
    try:
        quotas.leave(context.registry(), tenant, [task_id])
    except GpufleetError as exc:  # a router's sweep frees it
        log.warning("could not free call %s's slot of tenant %s: %s", task_id, tenant_name, exc)


@task_postrun.connect
def _answered(
    sender: Any = None, task_id: Any = None, task: Any = None, state: Any = None, **_: Any
) -> None:
    if getattr(sender, "name", None) in CALL_TASKS and state in states.READY_STATES:
        _leave(tenant_of(task.request), task_id)


@task_revoked.connect
def _revoked(sender: Any = None, request: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) in CALL_TASKS and request is not None:
        _leave(tenant_of(request), getattr(request, "id", None))
