"""A batch's results: read together, and written as each call is answered without waiting.

Celery's Redis result backend reads each task's stored meta before it writes the task's
result (so that a lost worker's duplicate never overwrites a success), then writes it
with its PUBLISH and waits for Redis's reply: two round trips per call, which a GPU
worker's pool child waits out between a batch's forward pass and the next batch's. While
a batch's tracers run (`tasks.batching.run_batch`), `together`:

- reads every call's meta with one MGET first (a few milliseconds before Celery would
  read each);
- sends each result as its tracer stores it, with the same commands as Celery (MULTI,
  SET or SETEX, PUBLISH, EXEC), so each caller has its answer as soon as its tracer ran,
  but reads Redis's replies only once the batch's tracers are done. A result Redis did
  not take (an error reply, a lost connection) is written again on Celery's own path,
  with its retries, before the block ends. The pool job, and so every call's ack, ends
  after the block: no call is acked before its result is stored.

Why not one write for the whole batch: it saved a little more, but every caller of a
batch then got its answer at the same moment and sent its next call at the same moment,
so the next pass took one call and the rest queued behind it, and back: the waiting count
the scaling rule reads swung under its threshold every other pass, and a burst no longer
scaled out (tests/test_scaling_fleet.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from celery.backends.redis import RedisBackend

log = logging.getLogger(__name__)

_REPLIES = 4  # MULTI, SET/SETEX and PUBLISH queued, EXEC


@contextmanager
def together(backend: Any, task_ids: Sequence[str]) -> Iterator[None]:
    """Within the block, `backend` answers the meta reads of `task_ids` from one MGET and
    sends its result writes without waiting for their replies (see the module)."""
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

    writes = _Writes(backend)
    backend.get = get  # instance attributes over the class's methods
    backend.set = writes.set
    try:
        yield
    finally:
        del backend.get, backend.set
        writes.settle()


class _Writes:
    """Result writes sent on one connection of the backend's pool, replies read later."""

    def __init__(self, backend: RedisBackend) -> None:
        self._backend = backend
        self._connection: Any = None
        self._sent: list[tuple[Any, Any, Any]] = []  # (key, value, expires), in order
        self._unsure: list[tuple[Any, Any, Any]] = []  # sent, but their replies are lost

    def set(self, key: Any, value: Any, expires: Any = None, **retry_policy: Any) -> None:
        """`RedisBackend.set`, but without waiting for the reply."""
        backend = self._backend
        if isinstance(value, str) and len(value) > backend._MAX_STR_VALUE_SIZE:
            RedisBackend.set(backend, key, value, expires, **retry_policy)  # Celery's error
            return
        ttl = backend.expires if expires is None else expires
        store = ("SETEX", key, ttl, value) if ttl else ("SET", key, value)
        commands = [("MULTI",), store, ("PUBLISH", key, value), ("EXEC",)]
        try:
            if self._connection is None:
                self._connection = backend.client.connection_pool.get_connection()
            self._connection.send_packed_command(self._connection.pack_commands(commands))
        except Exception:
            log.warning("could not send a result; storing it the usual way", exc_info=True)
            self._close(broken=True)
            RedisBackend.set(backend, key, value, expires, **retry_policy)
            return
        self._sent.append((key, value, expires))

    def settle(self) -> None:
        """Read every reply; store again, Celery's way, each result Redis did not take."""
        for at, (key, value, expires) in enumerate(self._sent):
            try:
                replies = [self._connection.read_response() for _ in range(_REPLIES)]
            except Exception:
                log.warning(
                    "lost the replies of %d results; storing them again",
                    len(self._sent) - at,
                    exc_info=True,
                )
                self._sent = self._sent[at:]
                self._close(broken=True)
                break
            if any(isinstance(r, Exception) for r in replies[-1] or [None]):
                self._unsure.append((key, value, expires))
        self._sent = []
        self._close(broken=False)
        unsure, self._unsure = self._unsure, []
        for key, value, expires in unsure:
            RedisBackend.set(self._backend, key, value, expires)

    def _close(self, broken: bool) -> None:
        """Give the connection back; a broken one is closed, and what it sent is unsure."""
        if broken:
            self._unsure += self._sent
            self._sent = []
        if self._connection is None:
            return
        if broken:
            self._connection.disconnect()
        self._backend.client.connection_pool.release(self._connection)
        self._connection = None
