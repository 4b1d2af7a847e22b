"""The router's hot path: a plain client's call for a HOT model goes on from the consumer.

A client that does not import gpufleet sends `gpufleet.infer` to the router's queue. When
the model has a HOT replica, running a task for it in a pool child (and handing the call on
with `Task.replace`) costs the router 12 to 18 ms of CPU for what is one lease and one
publish. So the router's consumer, in the worker's main process, looks at each such call
as it arrives: when its arguments are valid and `pick.lua` leases a HOT replica, it moves
the message, unchanged but for the lease and counted headers, to that replica's GPU
worker queue, acknowledging it in the same transaction (`tasks.transport.Channel.forward`).
The call is then exactly a fast-path call: same task id, name and body, so the caller's
AsyncResult yields the GPU worker's answer, and Flower sees it received and answered there.

Everything else takes Celery's path to the pool, as before: a miss, an unknown model or a
bad payload (the pool stores the error), a call with an ETA, a retry, a call given back
after a router died (which must be looked for elsewhere first, `tasks.api`), and any call
the registry or broker could not forward, after ending its lease. A router killed before
the move leaves the call unacknowledged, and it is given back to a router as any other.
docs/tasks.md, "The router's hot path", says what a caller sees.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from placement.errors import GpufleetError
from tasks import context, leases
from tasks.calls import counted_in, infer_arguments
from worker.handlers import validate

log = logging.getLogger(__name__)

TASK = "gpufleet.infer"
JSON = "application/json"

_Strategy = Callable[..., Any]


def forwarding(strategy: _Strategy) -> _Strategy:
    """Celery's strategy for `gpufleet.infer` on a router, forwarding hot calls first."""
    forward = Forwarder()

    def task_message_handler(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any
    ) -> Any:
        if forward(message):
            return None
        return strategy(message, body, ack, reject, callbacks, **kwargs)

    return task_message_handler


class Forwarder:
    """Moves a hot call to its replica's GPU worker's queue; says whether it did."""

    def __call__(self, message: Any) -> bool:
        plain = plain_call(message)
        if plain is None:
            return False
        model, counted = plain
        try:
            lease = context.registry().pick(model, path="" if counted else "router")
        except GpufleetError:
            log.warning("could not look for a HOT replica of %s; routing the call", model)
            return False
        if lease is None:
            return False  # a miss: the pool places the model
        headers = dict(message.headers)
        headers[leases.HEADER] = leases.header(lease)
        headers[leases.COUNTED_HEADER] = True  # counted by this pick (or before)
        try:
            message.channel.forward(message, lease.queue, headers)
        except Exception:
            log.warning("could not forward a call of %s; routing it", model, exc_info=True)
            leases.end(lease)
            return False
        return True


def plain_call(message: Any) -> tuple[str, bool] | None:
    """The model of a call the consumer may forward, and whether it is counted already;
    None for a call that must take Celery's path (see the module)."""
    headers = message.headers
    if not isinstance(headers, dict) or headers.get("task") != TASK:
        return None  # message protocol 1, or another task
    if headers.get(leases.HEADER) or headers.get("eta") or headers.get("retries"):
        return None
    if (message.delivery_info or {}).get("redelivered") or message.content_type != JSON:
        return None
    if not callable(getattr(message.channel, "forward", None)):
        return None  # not gpufleet's transport
    try:
        args, kwargs, _ = message.decode()
        model, inputs, params = infer_arguments(*args, **kwargs)
    except Exception:  # the pool says what is wrong with it
        return None
    spec = context.catalog().get(model, None) if isinstance(model, str) else None
    if spec is None:
        return None
    try:
        validate(spec.task, inputs, params)
    except GpufleetError:
        return None
    return model, counted_in(headers)
