"""Streamed text of generating calls, carried through the fleet's Redis.

A call sent with `params={"stream": true}` gets a Redis Stream named
`gpufleet-stream-<task id>` (a tenant's call, `t.<name>.gpufleet-stream-<task id>`: `key`):
the GPU worker appends an entry ``{"start": "1"}``, then each
new piece of text as an entry ``{"i": prompt index, "t": text}`` (one pipeline for every
streaming call of the batch after a step's prefill, when it had one, and one after the
step), then an entry ``{"end": finish reason}`` when
the call is done (``error`` when it failed). The stream expires `TTL_S` after its last
write. A call that runs again (its worker was lost) writes a second ``start`` and its text
from the beginning; `read` skips what it already handed out. A caller reads the stream
with XREAD (its Redis user may: docs/deploy.md, "Security") while the call runs; `read`
does that and stops at the end entry. The call's result is stored as for any call, so a
plain `.get()` still returns the whole answer.

Nothing new is deployed for this: the stream rides on the fleet's Redis, and a caller that
never reads costs one short-lived key.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from typing import Any

import redis

from placement.ledger.tenancy import tenants

log = logging.getLogger(__name__)

PREFIX = "gpufleet-stream-"
TTL_S = 600  # a stream's life after its last write
MAX_ENTRIES = 10_000  # per stream, far above MAX_NEW_TOKENS pieces
READ_BLOCK_MS = 1000  # one XREAD's wait; between two the reader checks the call's result


def key(task_id: str) -> str:
    """The stream of the fleet's call `task_id`: a tenant's under its key prefix, with its
    caller's task id (`tenants.call_id`), which its Redis user alone may read."""
    caller_id, tenant = tenants.owner(task_id)
    return f"{tenants.key_prefix(tenant)}{PREFIX}{caller_id}"


class Writer:
    """Collects the text pieces of a batch's streaming calls and writes them in one round
    trip, after a step's prefill and after the step."""

    def __init__(self, client: redis.Redis) -> None:
        self._client = client
        self._pending: list[tuple[str, dict[Any, Any]]] = []
        self._started: set[str] = set()  # streams this writer (an attempt) has begun

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
            if task_id not in self._started:  # this attempt's first write (`read`)
                pipe.xadd(key(task_id), {"start": "1"}, maxlen=MAX_ENTRIES, approximate=True)
                self._started.add(task_id)
            pipe.xadd(key(task_id), fields, maxlen=MAX_ENTRIES, approximate=True)
        for task_id in {t for t, _ in pending}:  # in the same round trip
            pipe.expire(key(task_id), TTL_S)
        try:
            pipe.execute()
        except redis.RedisError as exc:
            log.warning("could not stream %d pieces of text: %s", len(pending), exc)


class StreamRestartedError(RuntimeError):
    """The call ran again (its worker was lost) and wrote other text than it streamed."""


class Pieces:
    """What one reader of a call's stream has handed out, and what each new entry adds.

    A run's entries: ``start``, text pieces, ``end``. A call run again after its worker was
    lost streams again from its start (a second ``start``): the text already handed out is
    skipped, and if the new run wrote other text (sampling without a seed),
    `StreamRestartedError` is raised. Shared by `read` and the HTTP front
    (`tasks.front.waiting`), which reads many streams at once.
    """

    def __init__(self, task_id: str) -> None:
        self.task_id = task_id
        self.last = "0-0"  # the last entry id read
        self.ended: str | None = None  # the end entry's finish reason, once read
        self._given: dict[int, str] = {}  # prompt index -> text handed out
        self._replay: dict[int, str] | None = None  # after a restart: what is left to skip
        self._starts = 0

    def feed(self, entry_id: Any, raw: dict[Any, Any]) -> list[tuple[int, str]]:
        """The (prompt index, text) pieces entry `raw` adds; sets `ended` at the end entry."""
        self.last = _text(entry_id)
        fields = {_text(k): _text(v) for k, v in raw.items()}
        if "end" in fields:
            self.ended = fields["end"]
            return []
        if "start" in fields:
            self._starts += 1
            self._replay = dict(self._given) if self._starts > 1 else None
            return []
        index, text = int(fields.get("i", 0)), fields.get("t", "")
        if self._replay is not None and self._replay.get(index):
            text = _skip(self._replay, index, text, self.task_id)
        if not text:
            return []
        self._given[index] = self._given.get(index, "") + text
        return [(index, text)]


def read(
    client: redis.Redis, task_id: str, done: Callable[[], bool], timeout: float | None = None
) -> Iterator[tuple[int, str]]:
    """The (prompt index, text) pieces of `task_id` as they come, until its end entry.

    `done` says whether the call's result is stored: a call that ends without an end
    entry (it failed before it streamed) is then the caller's to read with `.get()`. A
    run again is read as `Pieces` says. Raises TimeoutError after `timeout` seconds
    without the end.
    """
    name = key(task_id)
    pieces = Pieces(task_id)
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        answer: Any = client.xread({name: pieces.last}, block=READ_BLOCK_MS, count=256)
        for _, entries in answer or []:
            for entry_id, raw in entries:
                yield from pieces.feed(entry_id, raw)
                if pieces.ended is not None:
                    return
        if not answer and done():
            return
        if deadline is not None and time.monotonic() > deadline:
            raise TimeoutError(f"call {task_id} did not finish streaming in {timeout} s")


def _skip(replay: dict[int, str], index: int, text: str, task_id: str) -> str:
    """`text` less what the earlier run already handed out of prompt `index`."""
    pending = replay[index]
    common = min(len(pending), len(text))
    if pending[:common] != text[:common]:
        raise StreamRestartedError(
            f"call {task_id} ran again after its worker was lost and wrote other text than"
            " it had streamed (sampling without a seed?); read its answer with .get()"
        )
    replay[index] = pending[common:]
    return text[common:]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)
