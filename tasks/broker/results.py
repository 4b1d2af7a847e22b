"""The fleet's result backend: Celery's Redis backend, whose results never copy a call's
arguments and never answer a task id the fleet did not run; and a batch's results, read
together.

`result_extended` stores each result with its task's name, queue and worker, which callers
read (`AsyncResult.name`, `.queue`), and with its arguments, which no caller needs back: a
refused 50 MB call then kept its 50 MB in Redis for a day. `Backend` leaves them out, so a
result holds what its call returned, or its short error.

A batch's results, read together: one read for the whole batch, then Celery's writes.

Celery's Redis result backend reads each task's stored meta before it writes the task's
result (so that a lost worker's duplicate never overwrites a success), then writes it
with its PUBLISH: two round trips per call, which a GPU worker's pool child waits out
between a batch's forward pass and the next batch's. While a batch's tracers run
(`tasks.serving.batch_jobs.run_batch`), the child reads every call's meta with one MGET first (a
few milliseconds before Celery would read each); each tracer then writes its result as
Celery does, at once, so each caller has its answer as soon as its tracer ran.

Why not one write for the batch too: it saved a little more, but every caller of a batch
then got its answer at the same moment and sent its next call at the same moment, so
the next pass took one call and the rest queued behind it, and back: the waiting count
the scaling rule reads swung under its threshold every other pass, and a burst no
longer scaled out (tests/test_scaling_fleet.py).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from celery import states
from celery.backends import redis as celery_redis
from celery.backends.redis import RedisBackend

from placement.ledger import endpoint
from placement.ledger.endpoint import FAILOVER_CHECK_S
from placement.ledger.tenancy import tenants
from placement.ledger.tenancy.tenants import ID_SEP

log = logging.getLogger(__name__)

#: How long a caller's result connection may stay silent while calls wait before it is
#: opened again (`_FollowingConsumer`; `placement.ledger.endpoint`).
SILENT_S = FAILOVER_CHECK_S


class _FollowingConsumer(celery_redis.ResultConsumer):
    """Celery's result consumer, which opens its pub/sub connection again (through the
    Sentinels, or at an address that moved) when it has heard nothing for `SILENT_S`
    while calls wait. A pub/sub connection has no liveness check: on a primary that
    stopped answering (SIGSTOP, a host cut off) a caller's `.get()` heard nothing until
    that server came back, long after the Sentinels had promoted another; on an old
    primary that now follows the new one, it missed what was published before it
    followed, and went on hearing the rest, so a call whose answer it missed waited for
    good. Opening it again first reads the results stored meanwhile (Celery's
    `_reconnect_pubsub`); on a live primary it costs one MGET and one SUBSCRIBE per
    `SILENT_S` of waiting."""

    _heard = 0.0

    def on_state_change(self, meta: Any, message: Any) -> None:
        self._heard = time.monotonic()
        super().on_state_change(meta, message)

    def drain_events(self, timeout: float | None = None) -> Any:
        now = time.monotonic()
        if not self._heard:  # its first wait: silent from now
            self._heard = now
        if self.subscribed_to and now - self._heard > SILENT_S:
            self._heard = now
            with self.reconnect_on_error():
                self._reconnect_pubsub()
        return super().drain_events(timeout)


class Backend(RedisBackend):
    """Celery's Redis result backend, less the call's arguments in each result (above),
    writing a failed call's error under that call's own id only (`_fail_chain`), and each
    tenant's results under its own key prefix.

    The fleet's id of a tenant's call holds its tenant (`tenants.call_id`): its result is
    stored, and published, where the tenant's plain Celery client reads it, under the key
    prefix that is its `global_keyprefix` and that its Redis user alone may read, and says
    the caller's own task id."""

    ResultConsumer = _FollowingConsumer

    def _get_pool(self, **params: Any) -> Any:
        """Celery's pool, of connections that leave a server refusing writes
        (`endpoint.ServerConnection`: at an address that moves to a new primary, a result
        stored on the old one would be lost); a Unix socket's as Celery makes them."""
        made = params.get("connection_class")
        if made in (None, redis.Connection, redis.SSLConnection):  # Celery's plain ones
            params["connection_class"] = endpoint.server_connection(made is redis.SSLConnection)
        return super()._get_pool(**params)

    def get_key_for_task(self, task_id: Any, key: Any = "") -> Any:
        caller_id, tenant = tenants.owner(str(task_id))
        if tenant == tenants.DEFAULT:
            return super().get_key_for_task(caller_id, key)
        prefix = self.key_t(tenants.key_prefix(tenant)) + self.task_keyprefix
        return self._get_key_for(prefix, caller_id, key)

    def encode(self, data: Any) -> Any:
        if isinstance(data, dict) and ID_SEP in str(data.get("task_id")):
            data = {**data, "task_id": tenants.owner(data["task_id"])[0]}
            if isinstance(data.get("parent_id"), str):  # a chained call's, the fleet's id
                data["parent_id"] = tenants.owner(data["parent_id"])[0]
        return super().encode(data)

    def _get_result_meta(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        meta: dict[str, Any] = super()._get_result_meta(*args, **kwargs)
        meta.pop("args", None)
        meta.pop("kwargs", None)
        return meta

    def _fail_chain(self, *args: Any, **kwargs: Any) -> None:
        """Celery stores a failed call's error under the task id of every step chained after
        it too. A caller writes those ids, and one that named another caller's running call
        made that caller's `.get()` fail at once with an error it never earned (and a chain
        of 50,000 steps cost 50,000 writes). The fleet honours no id it did not create: a
        chain's later steps are left unanswered, and the caller's `.get()` on the chain
        learns the error from its parent, which Celery's client follows (`follow_parents`)."""


class SentinelBackend(Backend, celery_redis.SentinelBackend):
    """`Backend` on a primary that Sentinels watch (`sentinel://`,
    `placement.ledger.endpoint`): Celery's Sentinel backend finds the primary as each
    connection opens, so a write after a failover reaches the new one, and a caller
    waiting for results leaves a primary that stopped answering (`_FollowingConsumer`)."""

    def _set(self, key: Any, value: Any, expires: Any = None) -> None:
        """Celery's write of a result and its PUBLISH, then Redis's `WAIT` for a replica to
        hold it, on one connection (`endpoint.kept`). A worker acknowledges a call once
        its result is written, and an acknowledgement the dying primary could not take is
        kept and applied on the new one (`transport.QoS.ack`): a result the old primary
        took alone, just before it died, was lost while its call counted as done, and its
        caller waited for an answer no one would send. Now the write returns once a
        replica holds it; a primary that dies first cuts the `WAIT` short, and Celery's
        retry (`set`) writes the result again, to the new primary, as it does for a result
        that a server no longer the primary took."""
        expires = self.expires if expires is None else expires
        with self.client.pipeline(transaction=False) as pipe:
            pipe.set(key, value, ex=expires or None)  # an int (Celery's `prepare_expires`)
            pipe.publish(key, value)
            endpoint.kept(pipe, f"the result under {key!r}")

    def _get_pool(self, **params: Any) -> Any:
        """Celery's pool, of connections that leave a server refusing writes
        (`endpoint.PrimaryConnection`): a result stored there would be lost."""
        return super()._get_pool(**params, connection_class=endpoint.PrimaryConnection)


def answered(backend: Any, task_ids: Sequence[str]) -> set[str]:
    """The calls among `task_ids` whose answer (or error) is stored in `backend`: one MGET,
    never retried (Celery's `get_task_meta` retries for up to a minute while the result
    store is away, which a worker's consumer thread must not wait out)."""
    keys = [backend.get_key_for_task(task_id) for task_id in task_ids]
    return {
        task_id
        for task_id, raw in zip(task_ids, backend.client.mget(keys), strict=True)
        if raw is not None and backend.decode_result(raw)["status"] in states.READY_STATES
    }


@contextmanager
def read_together(backend: Any, task_ids: Sequence[str]) -> Iterator[None]:
    """Within the block, `backend` answers the meta reads of `task_ids` from one MGET."""
    if len(task_ids) < 2 or not isinstance(backend, RedisBackend):
        yield
        return
    try:
        keys = [backend.get_key_for_task(task_id) for task_id in task_ids]
        read = dict(zip(keys, backend.client.mget(keys), strict=True))
    except Exception:
        log.warning("could not read a batch's results at once; reading them one by one")
        read = {}
    read_one = backend.get

    def get(key: Any) -> Any:
        return read.pop(key) if key in read else read_one(key)

    backend.get = get  # an instance attribute over the class's method
    try:
        yield
    finally:
        del backend.get
