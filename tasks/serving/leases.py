"""Request leases that travel inside Celery messages: attached at publish, ended if never run.

A lease pins a HOT replica from `pick` until the GPU worker that runs the call ends it
(`finish`). Two gaps would otherwise leave it pinned until its deadline (300 s by
default), during which memory pressure cannot evict the replica:

- Celery lets a caller's own `headers=` replace the ones a router returns, so the fast
  path does not return the lease as a header. `route` parks it with `hold`, and a
  `before_task_publish` handler adds it to the message's headers, next to the caller's.
  Routing and publishing run back to back in the sending thread, so the parked lease
  belongs to the next `gpufleet.infer` that thread publishes. If that publish fails, the
  lease stays parked, and the thread's next `hold` ends it.
- A message that is revoked, or expires before a worker runs it, never reaches `finish`.
  A `task_revoked` handler ends its lease in whichever worker process drops it.
- A process killed between taking a lease and publishing its call leaves a lease no call
  carries. Each lease id names its taker, the worker's run and the process
  (`placement.ledger.hot.new_lease_id`). A worker that dies has its leases ended by the
  next run under its name or by a router's sweep (`tasks.broker.presence`). A pool child
  that dies while its worker lives has them ended by the child that replaces it
  (`_end_lost_siblings`).
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

from celery.signals import before_task_publish, task_revoked, worker_process_init

from placement.errors import GpufleetError, PayloadError, describe
from placement.ledger.hot import Lease
from tasks import context
from tasks.broker.intake import COUNTED_HEADER, LEASE_HEADER, is_count, is_name
from tasks.config import CALL_TASKS, INFER
from worker import identity

log = logging.getLogger(__name__)


_parked = threading.local()


def header(lease: Lease) -> dict[str, Any]:
    """The lease as it travels in a message header."""
    return {
        "id": lease.id,
        "replica": lease.replica,
        "deadline_ms": lease.deadline_ms,
        "epoch": lease.epoch,
        "sent_ms": int(time.time() * 1000),
    }


def from_header(model: str, value: Any) -> Lease | None:
    """The lease a message carries, or None when it carries none; `PayloadError` for a
    header that is not one `header` wrote (its consumer refuses the call, `tasks.broker.intake`)."""
    if value is None:
        return None
    if not isinstance(value, dict):
        raise PayloadError(f"header {LEASE_HEADER} is {describe(value)}, not a lease")
    for name, required in _LEASE_FIELDS.items():
        field = value.get(name)
        fits = is_name(field) if name in ("id", "replica") else is_count(field)
        if not fits and (required or field is not None):
            raise PayloadError(f"header {LEASE_HEADER}: field {name} is {describe(field)}")
    epoch = value.get("epoch") or 0
    return Lease(value["id"], model, value["replica"], "", "", {}, value["deadline_ms"], epoch)


_LEASE_FIELDS = {"id": True, "replica": True, "deadline_ms": True, "epoch": False, "sent_ms": False}


def hold(lease: Lease) -> None:
    """Park `lease` for the next `gpufleet.infer` this thread publishes."""
    stale: Lease | None = getattr(_parked, "lease", None)
    _parked.lease = lease
    if stale is not None:  # its publish never happened
        log.info("ending lease %s: its call was never published", stale.id)
        end(stale)


def take() -> Lease | None:
    """Remove and return the lease parked in this thread, if any."""
    lease: Lease | None = getattr(_parked, "lease", None)
    _parked.lease = None
    return lease


def end(lease: Lease) -> None:
    """End a lease whose call will not run; the registry forgets it either way at its deadline."""
    try:
        context.registry().finish(lease)
    except GpufleetError:
        log.warning("could not end lease %s; it lapses at its deadline", lease.id, exc_info=True)


@before_task_publish.connect
def _attach(sender: str | None = None, headers: dict[str, Any] | None = None, **_: Any) -> None:
    if sender != INFER or headers is None:
        return
    lease = take()
    if lease is not None:
        headers[LEASE_HEADER] = header(lease)
        headers[COUNTED_HEADER] = True  # `pick` counted the call with its lease


@task_revoked.connect
def _release(sender: Any = None, request: Any = None, **_: Any) -> None:
    if getattr(sender, "name", None) not in CALL_TASKS or request is None:
        return
    args = getattr(request, "args", None) or ()
    model = args[0] if args and isinstance(args[0], str) else ""
    try:
        lease = from_header(model, getattr(request, LEASE_HEADER, None))
    except PayloadError:
        return  # not a lease this fleet wrote: nothing to end
    if lease is not None:
        log.info("ending lease %s of revoked task %s", lease.id, getattr(request, "id", "?"))
        end(lease)


@worker_process_init.connect
def _end_lost_siblings(**_: Any) -> None:
    """A pool child, as it starts, ends the leases that dead processes of its own worker
    run took (the child it replaces, killed before it sent a call). In the background:
    `worker_process_init` must return within 4 s, and Redis may be slow to answer."""
    registry = context.registry()
    if not registry.taker:  # not a worker that recorded itself (`tasks.broker.presence`)
        return

    def end() -> None:
        try:
            ended = registry.end_leases_of(registry.taker, dead=identity.gone)
        except Exception:  # a thread of its own: say why, and let the leases lapse
            log.warning("could not end the leases of this worker's dead processes", exc_info=True)
            return
        if ended:
            log.warning("ended %d request lease(s) that a dead pool process took", ended)

    threading.Thread(target=end, name="gpufleet-lost-leases", daemon=True).start()
