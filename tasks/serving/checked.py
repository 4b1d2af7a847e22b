"""The base class of every gpufleet task: it refuses wrong arguments with a `PayloadError`,
and sends what a tenant's call chains after it as that tenant's call.

Celery calls a task's function with whatever arguments the message carries, so a call
with a missing or an extra argument would fail with a bare `TypeError` from deep inside
the worker. The consumer refuses such a call before it reaches the pool
(`tasks.broker.intake.check`); this base checks again when a task runs by other ways (`apply`,
an eager call), with the same message.

A worker that ends a call sends its chain's next step and its callbacks itself, as the
fleet. What a tenant's call sends on that way, a call of another id, goes to that
tenant's public queue, whatever queue the caller named (its client's `celery`, under its
key prefix, is that queue): a router takes it as the tenant's, under its quotas, and its
result is stored where the tenant's client waits for it (`tasks.broker.results`). The
tenant is the one the router named the running call by (`tenants.call_id`), never a
header the caller set (`parent_id` is one); the call's own retries and replacements keep
its id, and their queue.
"""

from __future__ import annotations

from typing import Any

from celery import Task

from placement.ledger.tenancy import tenants
from tasks.broker.intake import bind


class CheckedTask(Task):
    """A task whose arguments are checked against its signature before it runs, and that a
    tenant's call sends on as the tenant's own (see the module)."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        bind(self, args, kwargs)
        return super().__call__(*args, **kwargs)

    def apply_async(self, args: Any = None, kwargs: Any = None, **options: Any) -> Any:
        tenant = _sending_tenant(self.app, options.get("task_id"))
        if tenant != tenants.DEFAULT:
            for option in ("exchange", "routing_key"):
                options.pop(option, None)
            options["queue"] = tenants.queue_of(tenant)
        return super().apply_async(args, kwargs, **options)


def _sending_tenant(app: Any, task_id: Any) -> str:
    """The tenant of the call this worker runs, when what it sends now is another call (a
    chain's next step, a callback); the default tenant otherwise."""
    running = app.current_worker_task
    request = running.request if running is not None else None
    if request is None or not isinstance(request.id, str) or task_id == request.id:
        return tenants.DEFAULT  # sent by no call, or the call itself again (retry, replace)
    return tenants.owner(request.id)[1]  # as the router named it, and its answer's key
