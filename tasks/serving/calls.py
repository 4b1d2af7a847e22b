"""One inference call as it travels from the router to a GPU worker, in JSON."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import MISSING, asdict, dataclass, fields, replace
from typing import Any

from celery.canvas import Signature

from placement.errors import ConfigError, GpufleetError, PayloadError, describe
from placement.ledger.hot import Lease
from placement.ledger.tenancy.tenants import DEFAULT, check_name, worker_queue
from tasks import context
from tasks.app import app
from tasks.broker.intake import (
    COUNTED_HEADER,
    HOPS_HEADER,
    LEASE_HEADER,
    SLOT_HEADER,
    TENANT_HEADER,
    is_count,
    is_name,
)
from tasks.config import INFER, INTERNAL_QUEUE, RUN
from tasks.serving import leases

#: A task's time limits in seconds, (hard, soft), as Celery's `timelimit` carries them.
TimeLimits = tuple[float | None, float | None]


def time_limits_of(request: Any) -> TimeLimits:
    """The time limits the caller gave a task (`time_limit`, `soft_time_limit`), so a
    call handed on or routed again keeps them; (None, None) for the worker's defaults."""
    hard, soft = getattr(request, "timelimit", None) or (None, None)
    return hard, soft


def hops_of(request: Any) -> int:
    """How many times a call was routed again (its `gpufleet_hops` header)."""
    return _hops(_header(request, HOPS_HEADER))


def counted_of(request: Any) -> bool:
    """Whether the call's outcome is counted already (docs/metrics.md): its message says so
    (`COUNTED_HEADER`), or it was routed again."""
    return counted_in({name: _header(request, name) for name in _COUNTING})


def counted_in(headers: Mapping[str, Any]) -> bool:
    """`counted_of`, from a message's headers."""
    return headers.get(COUNTED_HEADER) is True or _hops(headers.get(HOPS_HEADER)) > 0


_COUNTING = (COUNTED_HEADER, HOPS_HEADER)


def tenant_of(request: Any) -> str:
    """The tenant a call came from (the router wrote it: `tasks.broker.intake`), or the
    default tenant."""
    return _tenant(_header(request, TENANT_HEADER))


def slot_of(request: Any) -> str:
    """The running slot a call holds under its tenant's quota, or "" (none holds it)."""
    value = _header(request, SLOT_HEADER)
    return value if isinstance(value, str) else ""


def tenant_in(headers: Mapping[str, Any]) -> str:
    """`tenant_of`, from a message's headers."""
    return _tenant(headers.get(TENANT_HEADER))


def _tenant(value: object) -> str:
    try:
        return check_name(value) if isinstance(value, str) else DEFAULT
    except ConfigError:
        return DEFAULT


def _header(request: Any, name: str) -> Any:
    """A custom header of a request: an attribute of a task's request, in its `headers`
    (where a task run in-process with `apply` has it), or in a worker's request's
    `request_dict` (the message's headers, which the batcher reads)."""
    value = getattr(request, name, None)
    for where in ("headers", "request_dict"):
        if value is None:
            found = getattr(request, where, None)
            value = found.get(name) if isinstance(found, dict) else None
    return value


def _hops(value: object) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


@dataclass(frozen=True)
class Call:
    """A call to `model` bound for `replica`, with its request lease when it has one."""

    model: str
    inputs: Any
    params: dict[str, Any] | None
    replica: str
    cache: str  # where the model was when the call arrived: hot, warm or cold
    sent_ms: int  # when the call was routed, for the queue time
    lease_id: str = ""
    lease_deadline_ms: int = 0
    hops: int = 0  # how many times it was routed again after its replica left
    epoch: int = 0  # the placement of `replica` it was routed to (0: whichever is current)

    @property
    def lease(self) -> Lease | None:
        if not self.lease_id:
            return None
        return Lease(
            self.lease_id,
            self.model,
            self.replica,
            "",
            "",
            {},
            self.lease_deadline_ms,
            self.epoch,
        )

    def to(
        self,
        queue: str,
        limits: TimeLimits = (None, None),
        tenant: str = DEFAULT,
        slot: str = "",
    ) -> Signature:
        """`gpufleet.run` of this call on a GPU worker's queue, with the caller's time
        limits, tenant and running slot; its lease rides in a header too, so a worker that
        drops the message unrun can end it (`tasks.serving.leases`)."""
        lease = self.lease
        headers: dict[str, Any] = {COUNTED_HEADER: True}  # counted on its way here
        if lease is not None:
            headers[LEASE_HEADER] = leases.header(lease)
        if tenant != DEFAULT:
            headers[TENANT_HEADER] = tenant
        if slot:
            headers[SLOT_HEADER] = slot
        hard, soft = limits
        return app.signature(
            RUN,
            args=(self.as_json(),),
            queue=worker_queue(queue, tenant),
            headers=headers,
            time_limit=hard,
            soft_time_limit=soft,
        )

    def rerouted(
        self, limits: TimeLimits = (None, None), tenant: str = DEFAULT, slot: str = ""
    ) -> Signature:
        """`gpufleet.infer` of this call back on the router's internal queue, one hop
        further (the count, the tenant and its slot travel in headers, which only the
        fleet's queues keep: `tasks.broker.intake`), counted already."""
        hard, soft = limits
        headers: dict[str, Any] = {HOPS_HEADER: self.hops + 1, COUNTED_HEADER: True}
        if tenant != DEFAULT:
            headers[TENANT_HEADER] = tenant
        if slot:
            headers[SLOT_HEADER] = slot
        return app.signature(
            INFER,
            args=(self.model, self.inputs, self.params),
            queue=INTERNAL_QUEUE,
            headers=headers,
            time_limit=hard,
            soft_time_limit=soft,
        )

    @classmethod
    def from_json(cls, data: Any) -> Call:
        """The call a `gpufleet.run` carries; `PayloadError` naming the first field that
        is missing or of the wrong type (its consumer refuses it, `tasks.broker.intake`)."""
        if not isinstance(data, dict):
            raise PayloadError(f"gpufleet.run carries a call object, got {describe(data)}")
        unknown = sorted(str(k)[:40] for k in data if k not in _FIELDS)
        if unknown:
            raise PayloadError(f"gpufleet.run's call has unknown fields: {', '.join(unknown)}")
        for name, fits in _FIELDS.items():
            if name in data and not fits(data[name]):
                raise PayloadError(f"gpufleet.run's call field {name} is {describe(data[name])}")
        missing = [name for name in _REQUIRED if name not in data]
        if missing:
            raise PayloadError(f"gpufleet.run's call lacks {', '.join(missing)}")
        return cls(**data)

    def as_json(self) -> dict[str, Any]:
        return asdict(self)

    def with_lease(self, lease: Lease) -> Call:
        return replace(
            self, lease_id=lease.id, lease_deadline_ms=lease.deadline_ms, epoch=lease.epoch
        )


#: Each field of a `Call` in JSON, and what it may hold (inputs are the handlers' to check).
_FIELDS: dict[str, Callable[[Any], bool]] = {
    "model": is_name,
    "inputs": lambda v: True,
    "params": lambda v: v is None or isinstance(v, dict),
    "replica": is_name,
    "cache": lambda v: v in ("hot", "warm", "cold"),
    "sent_ms": is_count,
    "lease_id": lambda v: is_name(v, empty=True),
    "lease_deadline_ms": is_count,
    "hops": is_count,
    "epoch": is_count,
}
_REQUIRED = tuple(f.name for f in fields(Call) if f.default is MISSING)


def fast_call(model: Any, inputs: Any, params: Any, header: Any, hops: int) -> Call | None:
    """The call of a fast-path `gpufleet.infer`: bound for the replica its lease header
    names; None without a lease (the call is the router's to place)."""
    lease = leases.from_header(model, header) if isinstance(model, str) else None
    if lease is None:
        return None
    sent = header.get("sent_ms", 0)
    return Call(model, inputs, params, lease.replica, "hot", sent, hops=hops).with_lease(lease)


def call_of(name: str, args: Any, kwargs: Any, headers: dict[str, Any]) -> Call | None:
    """The call a message to a GPU worker carries: a `gpufleet.run`'s, or a fast-path
    `gpufleet.infer`'s. None for other messages, an `infer` without a lease, or arguments
    that do not bind (the task itself then says what is wrong)."""
    try:
        if name == RUN:
            if kwargs or len(args) != 1 or not isinstance(args[0], dict):
                return None
            return Call.from_json(args[0])
        if name == INFER:
            model, inputs, params = infer_arguments(*(args or ()), **(kwargs or {}))
            model, params = context.catalog().base_call(model, params)
            header = headers.get(LEASE_HEADER)
            return fast_call(model, inputs, params, header, _hops(headers.get(HOPS_HEADER)))
    except (TypeError, ValueError, GpufleetError):
        return None
    return None


def infer_arguments(
    model: Any, inputs: Any, params: Any = None
) -> tuple[Any, Any, dict[str, Any] | None]:
    """`gpufleet.infer`'s arguments, bound as the task binds them (TypeError if they do not)."""
    return model, inputs, params
