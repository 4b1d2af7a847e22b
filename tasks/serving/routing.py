"""Where a call goes: the fast path, and the names of the fleet's queues.

`route` is Celery's `task_routes` callable. It runs in the caller's process when a
`gpufleet.infer` is sent: if the model has a HOT replica, it takes a request lease on
it through `pick.lua` and publishes straight to that GPU worker's queue, with the lease
in the message headers (`tasks.serving.leases` attaches it). Only misses (and clients that do
not import gpufleet, whose calls land on the default queue) pay for the router hop.

When a call cannot take the fast path, the client says why, once per reason per
process: its URL has a caller's rights (leasing writes the ledger, which only fleet
processes may: docs/deploy.md, "Security"), the registry is unreachable, the fleet it
names has no GPU worker (a `GPUFLEET_FLEET` that differs from the fleet's), or the model
has no HOT replica yet.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Any

from placement.config import safe_url
from placement.errors import AccessDeniedError, GpufleetError
from placement.rules import prefixes
from tasks import context
from tasks.config import INFER, ROUTER_QUEUE
from tasks.serving import leases

log = logging.getLogger(__name__)

_told: set[str] = set()  # the fallback reasons this process has warned about


class _Rights:
    """Whether this process's registry URL has a caller's rights, which lease nothing, and
    whether it has no catalog (its calls are then routed by load alone)."""

    caller = False
    no_catalog = False


_rights = _Rights()


def gpu_queue(host: str, indices: list[int]) -> str:
    """The queue of the GPU worker for `indices` on `host`; stable across restarts, so a
    message left by a dead worker reaches its successor (which re-routes it)."""
    return f"gpufleet.{host}.gpu{'-'.join(str(i) for i in sorted(indices))}"


def route(
    name: str, args: Any, kwargs: Any, options: dict[str, Any], task: Any = None, **_: Any
) -> dict[str, Any] | None:
    """Send a call for a resident model straight to its GPU worker, with a lease."""
    if name != INFER or options.get("queue") or _rights.caller:
        return None  # everything else, calls already routed, and a caller's, keep theirs
    args, kwargs = args or (), kwargs or {}
    model = args[0] if args else kwargs.get("model")
    if not isinstance(model, str):
        return None
    inputs = args[1] if len(args) > 1 else kwargs.get("inputs")
    params = args[2] if len(args) > 2 else kwargs.get("params")
    # An adapter's call leases its base's replica. No catalog here, or a name it does not
    # know: the router says what is wrong.
    if ":" in model and not _rights.no_catalog:
        with contextlib.suppress(GpufleetError):
            model, params = context.catalog().base_call(model, params)
    try:
        lease = context.registry().pick(model, path="fast", prefix=prefix_of(model, inputs, params))
    except AccessDeniedError:  # for good: a URL's user keeps its rights
        _rights.caller = True
        _fall_back("caller", _CALLER)
        return None
    except GpufleetError as exc:
        _fall_back("unreachable", f"the registry is unreachable ({exc})")
        return None
    if lease is None:
        _fall_back_on_miss(model)
        return {"queue": ROUTER_QUEUE}
    leases.hold(lease)  # a caller's own headers= would replace any we return here
    return {"queue": lease.queue}


def prefix_of(model: str, inputs: Any, params: Any, tenant: str = "") -> list[str]:
    """The prefix chain a call of `model` is routed by (`placement.rules.prefixes`): a
    text-generation model's calls have one; none while GPUFLEET_PREFIX_ROUTING is 0, or
    where this process has no catalog."""
    if _rights.no_catalog:
        return []
    try:
        if not context.settings().prefix_routing:
            return []
        spec = context.catalog().get(model, None)
    except GpufleetError:  # a client without a catalog file routes by load from now on
        with contextlib.suppress(GpufleetError):
            _rights.no_catalog = not context.settings().models.exists()
        return []
    if spec is None or spec.task != "text-generation":
        return []
    return prefixes.chain(inputs, params, tenant)


def _fall_back_on_miss(model: str) -> None:
    """Say why a call takes the router's path: the fleet is unknown, or a miss."""
    if "fleet known" in _told:
        _fall_back("miss", _MISS.format(model=model))
        return
    registry = context.registry()
    try:
        known = bool(registry.client.scard(registry.keys.workers))
    except Exception:  # the pick just answered; a failure here only costs the warning
        return
    if not known:
        url = safe_url(context.settings().registry_url)
        _fall_back(
            "unknown fleet",
            f"fleet {registry.keys.fleet!r} has no GPU worker on {url}; set GPUFLEET_FLEET to "
            f"the fleet's name (`gpufleet status` prints it)",
        )
    else:
        _told.add("fleet known")  # checked once: misses from now on are plain misses
        _fall_back("miss", _MISS.format(model=model))


_CALLER = (
    "this URL has a caller's rights (the one `gpufleet url` prints), which lease no replica: "
    "the router forwards calls for resident models in about a millisecond; a client with the "
    "fleet's own user takes the fast path"
)
_MISS = (
    "{model} has no HOT replica yet (normal for a model's first call or after an eviction: "
    "the router places it)"
)


def _fall_back(reason: str, why: str) -> None:
    if reason in _told:
        return
    _told.add(reason)
    level = logging.INFO if reason == "caller" else logging.WARNING  # as designed, not a fault
    log.log(level, "gpufleet fast path not taken: %s; calls go through the router", why)
