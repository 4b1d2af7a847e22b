"""Streamed text of generating calls, carried through the fleet's Redis.

A call sent with `params={"stream": true}` gets a Redis Stream named
`gpufleet-stream-<task id>`: the GPU worker appends each new piece of text as an entry
``{"i": prompt index, "t": text}`` (one pipeline per decode step for every streaming call of
the batch), then an entry ``{"end": finish reason}`` when the call is done (``error`` when
it failed). The stream expires `TTL_S` after its end. A caller reads it with XREAD
(its Redis user may: docs/deploy.md, "Security") while the call runs; `read` does that and
stops at the end entry, or raises the call's error. The call's result is stored as for any
call, so a plain `.get()` still returns the whole answer.

Nothing new is deployed for this: the stream rides on the fleet's Redis, and a caller that
never reads costs one short-lived key.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

import redis

log = logging.getLogger(__name__)

PREFIX = "gpufleet-stream-"
TTL_S = 600  # a stream's life after its last write
MAX_ENTRIES = 10_000  # per stream, far above MAX_NEW_TOKENS pieces
READ_BLOCK_MS = 1000  # one XREAD's wait; between two the reader checks the call's result


def key(task_id: str) -> str:
    return f"{PREFIX}{task_id}"


class Writer:
    """Collects the text pieces of a batch's streaming calls and writes them once per step."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pending: list[tuple[str, dict[Any, Any]]] = []
        self._started: set[str] = set()  # streams written to and not ended

    def for_call(self, task_id: str) -> Callable[[int, str], None]:
        """Where the engine hands `task_id`'s new text (prompt index, text)."""
        return lambda index, text: self._pending.append((task_id, {"i": index, "t": text}))

    def end(self, task_id: str, reason: str) -> None:
        self._pending.append((task_id, {"end": reason}))
        self.flush()

    def flush(self) -> None:
        """Write what is pending, in one round trip; a failure loses the pieces, not the
        call (its result holds the whole text)."""
        if not self._pending:
            return
        pending, self._pending = self._pending, []
        pipe = self._client.pipeline(transaction=False)
        for task_id, fields in pending:
            pipe.xadd(key(task_id), fields, maxlen=MAX_ENTRIES, approximate=True)
        # A stream expires TTL_S after its first write and again after its end: a call
        # lasts far less than TTL_S, and one EXPIRE per step would double the writes.
        for task_id, fields in pending:
            if "end" in fields or task_id not in self._started:
                pipe.expire(key(task_id), TTL_S)
                self._started.add(task_id)
            if "end" in fields:
                self._started.discard(task_id)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("could not stream %d pieces of text: %s", len(pending), exc)


def read(
    client: redis.Redis, task_id: str, done: Callable[[], bool], timeout: float | None = None
) -> Iterator[tuple[int, str]]:
    """The (prompt index, text) pieces of `task_id` as they come, until its end entry.

    `done` says whether the call's result is stored: a call that ends without an end
    entry (it failed before it streamed, or its worker died and it ran again elsewhere
    under the same id) is then the caller's to read with `.get()`. Raises TimeoutError
    after `timeout` seconds without the end.
    """
    import time

    name = key(task_id)
    last = "0-0"
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        answer: Any = client.xread({name: last}, block=READ_BLOCK_MS, count=256)
        for _, entries in answer or []:
            for entry_id, raw in entries:
                last = _text(entry_id)
                fields = {_text(k): _text(v) for k, v in raw.items()}
                if "end" in fields:
                    return
                yield int(fields.get("i", 0)), fields.get("t", "")
        if not answer and done():
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"call {task_id} did not finish streaming in {timeout} s")


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
