"""Where a call goes: the fast path, and the names of the fleet's queues.

`route` is Celery's `task_routes` callable. It runs in the caller's process when a
`gpufleet.infer` is sent: if the model has a HOT replica, it takes a request lease on
it through `pick.lua` and publishes straight to that GPU worker's queue, with the lease
in the message headers (`tasks.leases` attaches it). Only misses (and clients that do
not import gpufleet, whose calls land on the default queue) pay for the router hop.
"""

from __future__ import annotations

import logging
from typing import Any

from placement.errors import GpufleetError
from tasks import context, leases
from tasks.config import ROUTER_QUEUE

log = logging.getLogger(__name__)


def gpu_queue(host: str, indices: list[int]) -> str:
    """The queue of the GPU worker for `indices` on `host`; stable across restarts, so a
    message left by a dead worker reaches its successor (which re-routes it)."""
    return f"gpufleet.{host}.gpu{'-'.join(str(i) for i in sorted(indices))}"


def route(
    name: str, args: Any, kwargs: Any, options: dict[str, Any], task: Any = None, **_: Any
) -> dict[str, Any] | None:
    """Send a call for a resident model straight to its GPU worker, with a lease."""
    if name != "gpufleet.infer" or options.get("queue"):
        return None  # everything else, and calls already routed, keep their queue
    model = args[0] if args else (kwargs or {}).get("model")
    if not isinstance(model, str):
        return None
    try:
        lease = context.registry().pick(model)
    except GpufleetError as exc:
        log.debug("fast path unavailable for %s: %s", model, exc)
        return None
    if lease is None:
        return {"queue": ROUTER_QUEUE}
    leases.hold(lease)  # a caller's own headers= would replace any we return here
    return {"queue": lease.queue}
