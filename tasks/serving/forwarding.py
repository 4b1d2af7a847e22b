"""The router's hot path: a plain client's call for a HOT model goes on as it is taken.

A client that does not import gpufleet sends `gpufleet.infer` to the router's queue. When
the model has a HOT replica, running a task for it in a pool child (and handing the call on
with `Task.replace`) costs the router 12 to 18 ms of CPU for what is one lease and one
publish. So the router's task channel asks `Forwarder` about each message as it takes it,
in the worker's main process, before recording it as unacknowledged
(`tasks.broker.transport.Channel.divert`): when the call's arguments are valid and a HOT
replica can be leased, the message moves on, unchanged but for the lease and counted
headers, to that replica's GPU worker queue, out of the router's in-flight list in the
same step. Where the broker is the registry's Redis, one script leases and moves
(`forward.lua`, a `Pick`), and says whether the router's lists were left empty: then its
consumer blocks for the next call at once, without a round trip that finds nothing
(between a plain client's calls, the common case). Otherwise `pick.lua` leases and
`move.lua` moves (an `Onward`). The call is then exactly a fast-path call: same task id,
name and body, so the caller's AsyncResult yields the GPU worker's answer, and Flower
sees it received and answered there. Celery's strategy skips it (it is acknowledged already).

A call given back after a router died is looked for elsewhere first
(`tasks.serving.routed.elsewhere`:
its result, then every queue and in-flight list), so that a call already answered or on
its way is not run twice, and messages a caller marked redelivered are not held in the
pool.

Everything else takes Celery's path: a bad call (the consumer refuses it, `tasks.broker.intake`),
and to the pool a miss, a revoked call, a call with an ETA, a retry, a given-back call
found elsewhere, and any call the registry could not lease. A move that did not happen ends
its lease (`forward.lua` takes none without moving), and the call waits in the in-flight
list, which the reconnecting consumer puts back first in line. A router killed at any
point leaves the call in its in-flight list or on the GPU worker's queue, never both (a
lease it took lapses at its deadline). The lease is taken from the consumer's own
thread: while the registry is away (a restart), `pick` or `forward` retries for a few
seconds before the call falls back to the pool, and the router takes no other message
meanwhile. docs/tasks.md, "A call", says what a caller sees.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any

from celery.worker import state as worker_state

from placement.errors import GpufleetError
from placement.ledger.hot import GONE, Handover
from placement.ledger.registry import Registry
from placement.ledger.tenancy.quotas import Entry
from placement.ledger.tenancy.tenants import worker_queue
from tasks import context
from tasks.app import app
from tasks.broker import intake
from tasks.broker.intake import COUNTED_HEADER, LEASE_HEADER
from tasks.broker.transport import MOVED, Moved, Onward, Pick
from tasks.config import INFER
from tasks.serving import leases, routed
from tasks.serving.calls import counted_in, infer_arguments, tenant_in
from tasks.serving.routing import prefix_of
from tasks.serving.tenants import quotas, tenancy

log = logging.getLogger(__name__)

JSON = "application/json"

_Strategy = Callable[..., Any]


def install(channel: Any, strategy: _Strategy) -> _Strategy:
    """Make `channel` (a router's task channel) forward hot calls as it takes them; returns
    Celery's strategy for `gpufleet.infer`, which skips the calls forwarded."""
    channel.divert = Forwarder(channel)

    def task_message_handler(
        message: Any, body: Any, ack: Any, reject: Any, callbacks: Any, **kwargs: Any
    ) -> Any:
        if message.acknowledged:  # forwarded as it was taken
            return None
        return strategy(message, body, ack, reject, callbacks, **kwargs)

    return task_message_handler


class Forwarder:
    """Says where a hot call goes on to (its replica's GPU worker queue, with a lease),
    once its tenant's quota lets it in (`tasks.serving.tenants.quotas`)."""

    def __init__(self, channel: Any) -> None:
        self._channel = channel  # its `taken`: the message's in-flight list and bytes

    def __call__(self, message: Any) -> Onward | Pick | Moved | None:
        given_back = intake.redelivered(message)
        if given_back and _found_elsewhere(message):
            return None  # the pool drops it: its answer comes from elsewhere
        entry = quotas.enter(message, self._channel.taken)
        if entry in (Entry.PARKED, Entry.GONE):
            return MOVED  # parked, or given back by a sweep: not this router's now
        if entry is Entry.REFUSED:
            return None  # the consumer answers it (`quotas.refusal`)
        plain = plain_call(message)
        if plain is None:
            return None
        model, counted, (inputs, params) = plain
        path = "" if counted else "router"
        task_id = message.headers["id"]
        registry = context.registry()
        headers = {**message.headers, COUNTED_HEADER: True}  # counted by the pick (or before)
        tenant = tenancy.process.known(tenant_in(headers))
        prefix = prefix_of(model, inputs, params, tenant)
        if not given_back and context.one_redis():  # lease and move in one step
            move = functools.partial(_forward, registry, model, path, prefix)
            return Pick(headers, LEASE_HEADER, move, tenant, tuple(tenancy.process.refresh()))
        try:
            lease = registry.pick(model, path=path, prefix=prefix)
        except GpufleetError:
            log.warning("could not look for a HOT replica of %s; routing the call", model)
            return None
        if lease is None:
            return None  # a miss: the pool places the model
        if given_back:
            routed.hold(registry, model, task_id, False)
        headers[LEASE_HEADER] = leases.header(lease)
        queue = worker_queue(lease.queue, tenant)
        return Onward(queue, headers, functools.partial(leases.end, lease))


def _found_elsewhere(message: Any) -> bool:
    """Whether a given-back call is answered or on its way elsewhere
    (`tasks.serving.routed.elsewhere`)."""
    headers = message.headers
    task_id = headers.get("id") if isinstance(headers, dict) else None
    if not isinstance(task_id, str) or headers.get("task") != INFER:
        return False
    return routed.elsewhere(task_id, str(message.delivery_tag))


def _forward(
    registry: Registry, model: str, path: str, prefix: list[str], handover: Handover
) -> bool | None:
    """`Pick.move` for a call of `model` (routed by its `prefix` chain): None on a miss
    (the pool places the model), else whether the router's lists were all empty once it
    moved with a lease (False too when its message is no longer in flight: not ours
    either way)."""
    outcome = registry.forward(model, handover, path=path, prefix=prefix)
    if outcome is None:
        return None
    return outcome != GONE and outcome.drained


def plain_call(message: Any) -> tuple[str, bool, tuple[Any, Any]] | None:
    """The model of a call the consumer may forward, whether it is counted already, and
    its inputs and params (the adapter named in them); None for a call that must take
    Celery's path (see the module)."""
    headers = message.headers
    if not isinstance(headers, dict) or headers.get("task") != INFER:
        return None  # message protocol 1, or another task
    if headers.get(LEASE_HEADER) or headers.get("eta") or headers.get("retries"):
        return None
    if message.content_type != JSON:
        return None
    if headers.get("id") in worker_state.revoked:
        return None  # Celery's strategy drops it and says so
    try:
        intake.check(message, app.tasks)  # its model and payload, as the consumer checks them
    except GpufleetError:
        return None  # the consumer refuses it
    args, kwargs, _ = message.decode()
    model, inputs, params = infer_arguments(*args, **kwargs)
    model, params = context.catalog().base_call(model, params)
    return model, counted_in(headers), (inputs, params)
