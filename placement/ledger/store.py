"""The Redis side of a registry: one client, one fleet's keys, the scripts, plain reads.

`Membership` (workers) and `Registry` (placements and requests) build on it. Reads are
plain pipelined commands; every write is one atomic script (`placement/ledger/lua/*.lua`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import orjson
import redis
from redis.exceptions import NoPermissionError

from placement.errors import AccessDeniedError, ConfigError, RegistryError
from placement.ledger import endpoint, records
from placement.ledger.keys import KeyList, Keys
from placement.ledger.scripts import Scripts, scripts_for
from placement.policy.settings import PolicySettings
from placement.policy.state import Deployment, Gpu, Level

DEFAULT_EVENTS_MAXLEN = 100_000
#: How long calls wait for a registry that answered before to come back (a restart).
RECONNECT_S = 5.0

S = TypeVar("S", bound="Store")
T = TypeVar("T")
log = logging.getLogger(__name__)


class Store:
    """One fleet's records in one Redis database, and the scripts that change them."""

    def __init__(
        self,
        client: redis.Redis,
        fleet: str = "default",
        *,
        settings: PolicySettings | None = None,
        events_maxlen: int = DEFAULT_EVENTS_MAXLEN,
    ) -> None:
        """`settings` are the policy settings this fleet plans and evicts with, unless a
        call passes its own (evictions it starts itself, such as finishing a drain, too)."""
        if not client.get_connection_kwargs().get("decode_responses"):
            raise ConfigError("the registry needs a Redis client made with decode_responses=True")
        self.client: Any = client  # str replies (decode_responses), which redis-py cannot type
        self.keys = Keys(fleet)
        self.settings = settings or PolicySettings()
        self.events_maxlen = events_maxlen
        self._scripts: Scripts = scripts_for(client)
        self._answered = False  # has this registry answered once? Then outages are waited out
        self.outage_s = RECONNECT_S  # how long: a restart (from_url: a failover too)
        #: Who takes this client's request leases: a Celery worker's presence token (its
        #: process and its pool's), which starts every lease id it makes (`hot.new_lease_id`).
        self.taker = ""

    @classmethod
    def from_url(cls: type[S], url: str, fleet: str = "default", **kwargs: Any) -> S:
        """Connect with a `redis://`, `rediss://` or `sentinel://` URL (passwords in the URL
        work; `placement.ledger.endpoint`)."""
        found = endpoint.parse(url)
        store = cls(found.client(decode_responses=True), fleet, **kwargs)
        store.outage_s = found.outage_s or RECONNECT_S
        return store

    def _run(self, name: str, keys: list[str], args: list[Any]) -> Any:
        return self._reaching(lambda: self._scripts(name, keys, args))

    def _run_json(self, name: str, keys: KeyList, payload: dict[str, Any]) -> Any:
        payload["maxlen"] = self.events_maxlen
        return self._run(name, keys.names, [orjson.dumps(payload)])  # ~10x json's speed

    def _read(self, commands: list[tuple[Any, ...]], *, atomic: bool = False) -> list[Any]:
        def execute() -> list[Any]:
            pipe = self.client.pipeline(transaction=atomic)
            for name, *args in commands:
                getattr(pipe, name)(*args)
            return list(pipe.execute())

        return self._reaching(execute)

    def _reaching(self, call: Callable[[], T]) -> T:
        """`call`, tried again while a Redis that answered before is briefly away (a
        restart replaying its append-only file, a failover) for up to `outage_s`; a Redis
        that never answered fails at once. A demoted primary's refusal (READONLY: the
        connection drops itself, `placement.ledger.endpoint`), and a primary that stops
        answering (a timeout: Sentinel clients have one), count as away: the next try
        connects to the primary the Sentinels name then, or the address names. A script
        whose reply was lost may thus run twice: the ledger's scripts check their
        preconditions, so a second run changes nothing or is refused (a `pick` may hold a
        second lease until its deadline)."""
        deadline = time.monotonic() + self.outage_s
        delay = 0.05
        while True:
            try:
                result = call()
            except NoPermissionError as exc:
                raise AccessDeniedError(
                    f"this registry URL's Redis user may not do that ({exc}); the URL "
                    f"`gpufleet url` prints has a caller's rights: send calls and read results"
                ) from None
            except (redis.ConnectionError, redis.TimeoutError) as exc:
                if endpoint.refuses_writes(exc.__cause__ or exc):  # a server no longer
                    self.client.connection_pool.disconnect()  # primary: its idle ones too
                if not self._answered or time.monotonic() + delay > deadline:
                    raise unreachable(exc) from exc
                log.warning("registry unreachable (%s); trying again", exc)
                time.sleep(delay)
                delay = min(delay * 2, 0.5)
                continue
            self._answered = True
            return result

    def _one(self, name: str, *args: Any) -> Any:
        return self._read([(name, *args)])[0]

    def now_ms(self) -> int:
        return time_ms(self._one("time"))

    def gpu(self, gpu_id: str) -> Gpu | None:
        """One GPU's ledger record, or None if it is not registered."""
        row = self._one("hgetall", self.keys.gpu(gpu_id))
        return records.gpu(row) if row else None

    def deployment(self, replica: str) -> Deployment | None:
        """One replica's record with its live lease count, or None if there is none."""
        k = self.keys
        (sec, usec), row, held = self._read(
            [
                ("time",),
                ("hgetall", k.deployment(replica)),
                ("zrange", k.leases(replica), 0, -1, False, True),
            ],
            atomic=True,
        )
        if not records.whole(row):
            return None
        now = time_ms((sec, usec))
        return records.deployment(row, sum(1 for _, deadline in held if deadline > now))

    def levels(self, replicas: Sequence[str]) -> dict[str, Level]:
        """The level of each replica that has a record (one pipelined read)."""
        rows = self._read([("hget", self.keys.deployment(r), "level") for r in replicas])
        return {r: Level(level) for r, level in zip(replicas, rows, strict=True) if level}

    def events(self, count: int | None = None) -> list[dict[str, str]]:
        """The event stream, oldest first."""
        return [fields for _, fields in self._one("xrange", self.keys.events, "-", "+", count)]

    def lease_keys(self) -> list[str]:
        """Every request-lease key left in the fleet."""
        return list(self.client.scan_iter(match=f"{self.keys.prefix}:dep:*:leases"))


def time_ms(reply: Sequence[Any]) -> int:
    """Redis `TIME` (seconds, microseconds) in milliseconds: the registry's one clock."""
    seconds, micros = reply
    return int(seconds) * 1000 + int(micros) // 1000


def unreachable(exc: redis.RedisError) -> RegistryError:
    """The error for a registry that does not answer, saying what to do."""
    why = str(exc).strip().rstrip(".")
    return RegistryError(
        f"registry unreachable ({why}); start a fleet with `gpufleet up`, or set "
        f"GPUFLEET_REDIS_URL to the Redis of yours"
    )
