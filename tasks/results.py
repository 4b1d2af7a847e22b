"""A batch's results, stored together: one read and one write for the whole batch.

Celery's Redis result backend reads each task's stored meta before it writes the task's
result (so that a lost worker's duplicate never overwrites a success), then writes it
with its PUBLISH: two round trips per call, which a GPU worker's pool child waits out
between a batch's forward pass and the next batch's. While a batch's tracers run
(`tasks.batching.run_batch`), the child reads every call's meta with one MGET first and
writes every result in one pipeline last, before the job returns: each call is still
acknowledged only once its result is stored, and what is written is what Celery would
have written, key for key. A write that fails is retried as Celery retries its own
(`Backend.ensure`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import redis
from celery.backends.redis import RedisBackend

log = logging.getLogger(__name__)

_Write = tuple[str, Any, int | None]  # key, encoded meta, expiry (None: the backend's)


@contextmanager
def stored_together(backend: Any, task_ids: Sequence[str]) -> Iterator[None]:
    """Within the block, `backend` answers the meta reads of `task_ids` from one MGET and
    keeps every result write; at its end, it writes them in one pipeline."""
    if len(task_ids) < 2 or not isinstance(backend, RedisBackend):
        yield
        return
    keys = [backend.get_key_for_task(task_id) for task_id in task_ids]
    try:
        read = dict(zip(keys, backend.client.mget(keys), strict=True))
    except redis.RedisError:
        log.warning("could not read a batch's results at once; reading them one by one")
        read = {}
    read_one = backend.get
    writes: list[_Write] = []

    def get(key: Any) -> Any:
        return read.pop(key) if key in read else read_one(key)

    def keep(key: Any, value: Any, expires: int | None = None) -> None:
        writes.append((key, value, expires))

    backend.get, backend._set = get, keep  # instance attributes over the class's methods
    try:
        yield
    finally:
        del backend.get, backend._set
        if writes:
            backend.ensure(_write, (backend, writes))


def _write(backend: RedisBackend, writes: list[_Write]) -> None:
    """Celery's `RedisBackend._set` for every write, in one pipeline."""
    with backend.client.pipeline() as pipe:
        for key, value, expires in writes:
            ttl = backend.expires if expires is None else expires
            pipe.set(key, value, ex=ttl or None)
            pipe.publish(key, value)
        pipe.execute()
