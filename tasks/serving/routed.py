"""What a router knows of a call it takes: whether it is answered already or on its way
in another message (a call given back after its router died), and its hold on the model.

`tasks.api` (the router's pool) and `tasks.serving.forwarding` (its consumer) both ask.
"""

from __future__ import annotations

import functools
import logging
from typing import Any

import redis
from celery.signals import task_revoked

from placement.errors import GpufleetError
from placement.ledger import endpoint
from placement.ledger.load import hold_routing
from placement.ledger.registry import Registry
from tasks import context
from tasks.app import app
from tasks.broker import presence, results
from tasks.config import INFER
from tasks.serving.tenants import tenancy

log = logging.getLogger(__name__)


def elsewhere(task_id: str, tag: str) -> bool:
    """Whether a call given back to the router (its message's delivery tag `tag`) is
    answered already, or on its way in another message (tasks.broker.presence.on_its_way): then
    routing it again runs it twice."""
    if answered(task_id):
        return True
    try:
        return presence.on_its_way(broker(), task_id, tag, tenant_names=tenancy.process.refresh())
    except redis.RedisError:
        log.warning("could not look for call %s elsewhere; routing it", task_id, exc_info=True)
        return False


def answered(task_id: str) -> bool:
    """Whether a call's answer (or its error) is already stored."""
    return bool(results.answered(app.backend, [task_id]))


@functools.cache
def broker() -> redis.Redis:
    """This process's client of the broker's own keys (not Celery's connection)."""
    return endpoint.connect(
        context.settings().broker_url, socket_timeout=10, socket_connect_timeout=10
    )


def hold(registry: Registry, model: str, call: str, held: bool) -> None:
    """Count `call` as held by a router for `model` (part of the model's load while it is
    routed), or no longer (a dead router may have held it before it was given back); never
    fail the call over it."""
    try:
        hold_routing(registry, model, call, held)
    except GpufleetError:
        log.warning("could not count a routed call of %s", model, exc_info=True)


@task_revoked.connect
def _unhold(sender: Any = None, request: Any = None, **_: Any) -> None:
    """A call revoked while a router held it (waiting for its retry, say) leaves the model's
    load at once, not when its hold lapses (`ROUTING_TTL_MS`): it would count as waiting,
    and toward a scale-out, for minutes after it ended."""
    if getattr(sender, "name", None) != INFER or context.role() != "router":
        return
    args = getattr(request, "args", None) or ()
    model, task_id = (args[0] if args else None), getattr(request, "id", None)
    if not isinstance(model, str) or not isinstance(task_id, str):
        return
    try:
        base, _adapter = context.catalog().resolve(model)
    except GpufleetError:
        return
    hold(context.registry(), base.name, task_id, False)
