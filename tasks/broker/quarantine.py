"""A call that stops the worker taking it is put aside after its second time, not taken
forever.

Every check of `tasks.broker.intake` keeps what a caller sends from raising in a worker's main
process; this is the net under it. Celery's main process handles one message at a time,
from the moment the transport takes it until Celery has handed it on (to the pool, to the
batcher, or, on a router, to a GPU worker's queue). While it does, it writes that call's
task id into a small file of its own (`InHand`: one `pwrite`, no Redis round trip). A
worker that dies there leaves the id in the file; its successor under the same node name
(`gpufleet up` restarts it) finds it as it starts and counts one death for that call in
the broker (`placement.ledger.keys.DEATHS`). A call with two deaths is quarantined: whichever
worker takes it next moves its message to `placement.ledger.keys.QUARANTINE` (the newest
`KEEP` are kept), stores a `PayloadError` as its result, and goes on. Every worker reads
the counts as it starts and again every few seconds (`refresh`). `gpufleet status`
reports quarantined calls as a problem.

Why two deaths: a worker killed from outside (SIGKILL, the OOM killer, a lost host) dies
holding whatever call it had in hand; the same call in hand at two deaths is the call's
doing. A worker that cannot write its file (a read-only home) only loses this net.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import redis
from celery.signals import worker_init

from placement.ledger import endpoint
from placement.ledger.keys import DEATHS, QUARANTINE
from tasks import context

log = logging.getLogger(__name__)

#: Deaths in hand that quarantine a call.
DEATHS_TO_QUARANTINE = 2
#: Quarantined messages kept, newest first.
KEEP = 1000
#: How long a call's death count lasts (a day: a call is long answered by then).
COUNT_TTL_S = 24 * 3600
#: The largest in-hand record: a batch's task ids.
RECORD_BYTES = 64 * 1024
#: How often a worker reads the death counts again (other workers' deaths).
REFRESH_S = 5.0
#: The folder, in a fleet's home, of its workers' in-hand records (one per node name).
IN_HAND = "inhand"

QUARANTINED = (
    "this call stopped the gpufleet worker that took it, twice; it is quarantined and will "
    "not run (`gpufleet status` counts it). Check the call's arguments, then send it again"
)


class InHand:
    """The task ids a worker's main process is handling, in a file of its own."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._fd: int | None = None
        self._held: tuple[str, ...] = ()

    def open(self) -> list[str]:
        """Open the file, returning the ids a predecessor left in it (it died holding
        them); it is empty from then on."""
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            left = self.path.read_bytes() if self.path.exists() else b""
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            self._write(())
        except OSError as exc:
            log.warning("no in-hand record at %s (%s): no call is quarantined", self.path, exc)
            self._fd = None
            return []
        return _ids(left)

    @contextlib.contextmanager
    def holding(self, task_ids: Iterable[str]) -> Iterator[None]:
        """Within the block, the file names `task_ids` (and what it named before)."""
        before = self._held
        self._write((*before, *task_ids))
        try:
            yield
        finally:
            self._write(before)

    def _write(self, ids: tuple[str, ...]) -> None:
        self._held = ids
        if self._fd is None:
            return
        data = json.dumps(list(ids)).encode()[:RECORD_BYTES]
        with contextlib.suppress(OSError):  # a full disk only loses the net
            os.pwrite(self._fd, data + b"\0", 0)  # the record ends at its first NUL


def _ids(record: bytes) -> list[str]:
    """The task ids an in-hand record names (none for a record that cannot be read)."""
    try:
        ids = json.loads(record.split(b"\0", 1)[0].strip() or b"[]")
    except ValueError:
        return []
    return [i for i in ids if isinstance(i, str)] if isinstance(ids, list) else []


def tidy(folder: Path, nodes: Iterable[str]) -> None:
    """Remove the in-hand records in `folder` of the workers named `nodes` (stopped) that
    name no call, and the folder once it is empty: what a fleet whose workers all stopped
    between calls leaves. A record that names a call stays for the worker's next start
    under its name (see the module); other workers' records (another host's, on a shared
    home) are left alone."""
    for node in nodes:
        path = folder / node
        with contextlib.suppress(OSError):
            if not _ids(path.read_bytes()):
                path.unlink()
    with contextlib.suppress(OSError):
        folder.rmdir()  # only when every record went


class Quarantine:
    """This worker's view of the calls with deaths, and the move that sets one aside."""

    def __init__(self, client: redis.Redis) -> None:
        self.client = client
        self._suspects: frozenset[str] = frozenset()
        self._lock = threading.Lock()

    def died_holding(self, task_ids: list[str]) -> None:
        """Count one death for each of `task_ids` (a predecessor died holding them)."""
        if not task_ids:
            return
        pipe = self.client.pipeline(transaction=False)
        for task_id in task_ids:
            pipe.hincrby(DEATHS, task_id, 1)
        pipe.expire(DEATHS, COUNT_TTL_S)
        counts = pipe.execute()[:-1]
        for task_id, count in zip(task_ids, counts, strict=True):
            log.error(
                "call %s was in hand when this worker's predecessor died (%d time(s))",
                task_id,
                count,
            )

    def refresh(self) -> None:
        """Read which calls have died `DEATHS_TO_QUARANTINE` times."""
        counts: dict[Any, Any] = self.client.hgetall(DEATHS)
        suspects = frozenset(
            _text(task_id)
            for task_id, count in counts.items()
            if int(count) >= DEATHS_TO_QUARANTINE
        )
        with self._lock:
            self._suspects = suspects

    def holds(self, task_id: str | None) -> bool:
        """Whether call `task_id` is to be quarantined rather than taken."""
        return bool(task_id) and task_id in self._suspects

    def put_aside(self, item: bytes, task_id: str) -> None:
        """Keep the message of a quarantined call, newest first."""
        pipe = self.client.pipeline(transaction=True)
        pipe.lpush(QUARANTINE, item)
        pipe.ltrim(QUARANTINE, 0, KEEP - 1)
        pipe.hdel(DEATHS, task_id)
        pipe.execute()
        log.error("call %s is quarantined: it stopped its worker twice", task_id)
        with self._lock:
            self._suspects = self._suspects - {task_id}


def count(client: redis.Redis) -> int:
    """How many quarantined calls are kept."""
    return int(client.llen(QUARANTINE))


def problems(quarantined: int) -> list[str]:
    """The status line for `quarantined` calls, if any."""
    if not quarantined:
        return []
    return [
        f"{quarantined} call(s) quarantined: each stopped the worker that took it twice and "
        f"will not run; their messages are in the broker's {QUARANTINE} list (read them with "
        f"LRANGE, clear them with DEL)"
    ]


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class _This:
    """This worker process's in-hand record and quarantine view (none in clients)."""

    in_hand: InHand | None = None
    quarantine: Quarantine | None = None
    crash_on: str | None = None  # GPUFLEET_CRASH_ON_CALL (tests only)


_this = _This()


def holds(task_id: str | None) -> bool:
    """Whether this worker is to quarantine call `task_id` rather than take it."""
    return _this.quarantine is not None and _this.quarantine.holds(task_id)


def put_aside(item: bytes, task_id: str) -> None:
    assert _this.quarantine is not None
    _this.quarantine.put_aside(item, task_id)


@contextlib.contextmanager
def in_hand(task_ids: Iterable[str]) -> Iterator[None]:
    """Within the block, this worker's main process handles `task_ids` (see the module)."""
    if _this.in_hand is None:
        yield
        return
    ids = tuple(task_ids)
    with _this.in_hand.holding(ids):
        if _this.crash_on is not None and _this.crash_on in ids:
            log.critical("GPUFLEET_CRASH_ON_CALL: exiting as call %s is taken", _this.crash_on)
            os._exit(70)
        yield


def start(client: redis.Redis, path: Path, crash_on: str | None = None) -> None:
    """Open this worker's in-hand record at `path`, count the deaths its predecessor left
    in it, read every call's count, and keep reading them (before the worker consumes)."""
    in_hand = InHand(path)
    left = in_hand.open()
    quarantine = Quarantine(client)
    try:
        quarantine.died_holding(left)
        quarantine.refresh()
    except redis.RedisError as exc:
        log.warning("could not read the calls' death counts yet (%s); reading again soon", exc)
    _this.in_hand, _this.quarantine, _this.crash_on = in_hand, quarantine, crash_on

    def keep_reading() -> None:
        while True:
            threading.Event().wait(REFRESH_S)
            try:
                quarantine.refresh()
            except redis.RedisError as exc:
                log.warning("could not read the calls' death counts (%s)", exc)

    threading.Thread(target=keep_reading, name="gpufleet-quarantine", daemon=True).start()


@worker_init.connect
def _start(sender: Any = None, **_: Any) -> None:
    """Routers and GPU workers keep an in-hand record under the fleet's home, named after
    their node (`gpufleet up` restarts a worker under the same name on the same host)."""
    settings = context.settings()
    if settings.role not in ("router", "gpu") or sender is None:
        return
    client = endpoint.connect(settings.broker_url, socket_timeout=10, socket_connect_timeout=10)
    path = settings.fleet_dir() / IN_HAND / sender.hostname
    start(client, path, settings.crash_on_call)
