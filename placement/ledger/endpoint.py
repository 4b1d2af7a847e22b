"""Where the fleet's Redis is: one server, or a group that Redis Sentinel watches.

A fleet's Redis is named by one URL (`GPUFLEET_REDIS_URL`, the connection file):

* ``redis://`` or ``rediss://``: one server, as redis-py and Celery read it;
* ``sentinel://``: a primary and its replicas, found through Sentinels, in the form kombu
  reads (one ``sentinel://`` URL per Sentinel, joined by ``;``) with the group's name as
  ``master_name``::

      sentinel://USER:PASSWORD@10.0.0.1:26379/0;sentinel://10.0.0.2:26379;sentinel://10.0.0.3:26379?master_name=gpufleet

  The user, password, database and ``master_name`` may be written on any one of the parts
  (or repeated, alike). The user and password sign in to the Sentinels and to the primary
  alike: give the Sentinels the fleet's users too (`gpufleet up --redis-ha` does).

Every fleet process connects through `connect`. Its connections leave a server that is no
longer the primary (`refuses_writes`: demoted, ``READONLY``; cut off from its replicas,
``NOREPLICAS``; a blocked take cut short by a demotion, ``UNBLOCKED``): they disconnect and
raise `ConnectionError`, which every fleet client retries on a new connection. Through
Sentinels (`PrimaryConnection`) that new connection asks a Sentinel for the primary, as
connections do when they open, and also when the server stops answering
(`FAILOVER_SOCKET_TIMEOUT_S`); at a plain endpoint (`ServerConnection`,
`TlsServerConnection`) it reaches whatever server the address names now, as a managed
Redis whose address follows its primary does. The lookup happens as a connection opens,
never per command: the call path is unchanged.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import redis
import redis.asyncio
import redis.asyncio.sentinel
import redis.sentinel
from redis.exceptions import ReadOnlyError, ResponseError

from placement.errors import ConfigError
from placement.ledger.primaries import primaries

log = logging.getLogger(__name__)

#: The schemes of a fleet's Redis URL.
SCHEMES = ("redis", "rediss", "sentinel")
#: The Sentinel port a part without one is read with (Redis Sentinel's own default).
SENTINEL_PORT = 26379
#: How long a command waits for a Sentinel-watched primary's answer before its connection
#: counts as lost and is made again through the Sentinels: a primary that stops answering
#: (a SIGSTOP, a host cut off) is failed over, and its clients must leave it. Above every
#: fleet command's own time (blocking takes wait at most a second: `tasks.broker.transport`).
FAILOVER_SOCKET_TIMEOUT_S = 5.0
#: How often a fleet process checks, on a Sentinel-watched primary, the connections that
#: wait rather than ask: a blocking take overdue by this much, or a caller's result
#: connection silent this long, is opened again through the Sentinels. Tuned constant:
#: small against the 10 s a caller may wait through a failover, large against a take's
#: own wait (1 s) and a live primary's replies (milliseconds).
FAILOVER_CHECK_S = 2.0
#: How long a write through Sentinels that must survive a failover waits for a replica to
#: hold it (Redis's `WAIT`): a call published, a result stored. Tuned: a replica's
#: acknowledgement takes a round trip (well under 10 ms on a LAN); past this, as while a
#: failover's replica resyncs, the write is on the primary alone.
REPLICA_WAIT_MS = 1000
#: At most one warning this often that writes are on the primary alone: with no replica
#: answering, every write would say so.
ALONE_WARNING_S = 10.0
#: How long a Sentinel-watched fleet waits out a missing primary: the Sentinels' failover
#: (`placement.server.sentinel`: down after 3 s, promoted in about 1 s more) with room to spare.
FAILOVER_WAIT_S = 30.0


@dataclass(frozen=True)
class Endpoint:
    """A parsed fleet Redis URL. `sentinels` is empty for one server (`url` as given)."""

    url: str
    sentinels: tuple[tuple[str, int], ...] = ()
    master_name: str = ""
    username: str | None = None
    password: str | None = None
    db: int = 0

    @property
    def watched(self) -> bool:
        """Whether Sentinels find the primary (a ``sentinel://`` URL)."""
        return bool(self.sentinels)

    @property
    def tls(self) -> bool:
        """Whether a plain endpoint speaks TLS (``rediss://``)."""
        return self.url.startswith("rediss://")

    @property
    def outage_s(self) -> float | None:
        """How long a fleet client waits for this Redis to answer again; None: its own
        default (a plain server's restart)."""
        return FAILOVER_WAIT_S if self.watched else None

    def parts(self, *, secret: bool = True) -> list[str]:
        """One ``sentinel://`` URL per Sentinel, each with the credentials and database, as
        Celery's broker and result backend read them (joined by ``;``); `secret`=False
        masks the password."""
        auth = ""
        if self.username or self.password:
            user = urllib.parse.quote(self.username or "", safe="")
            word = urllib.parse.quote(self.password or "", safe="") if secret else "***"
            auth = f"{user}:{word}@" if self.password else f"{user}@"
        return [f"sentinel://{auth}{host}:{port}/{self.db}" for host, port in self.sentinels]

    def transport_options(self) -> dict[str, Any]:
        """What Celery's broker and result backend need beside `parts` to find the primary:
        the group's name and the Sentinels' own sign-in."""
        return {"master_name": self.master_name, "sentinel_kwargs": self.sign_in()}

    def shown(self) -> str:
        """The URL with its password masked, for output and logs."""
        if not self.watched:
            return masked(self.url)
        return ";".join(self.parts(secret=False)) + f"?master_name={self.master_name}"

    def sign_in(self) -> dict[str, Any]:
        """The user and password the URL gives, as redis-py's connection options."""
        return {k: v for k, v in (("username", self.username), ("password", self.password)) if v}

    def client(self, **kwargs: Any) -> redis.Redis:
        """A redis-py client of the primary (`kwargs`: redis-py's connection options)."""
        if not self.watched:
            kwargs.setdefault("connection_class", server_connection(self.tls))
            return redis.Redis.from_url(self.url, **kwargs)
        sentinel = redis.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            list(self.sentinels), **self._sentinel_options(kwargs)
        )
        primary: redis.Redis = sentinel.master_for(  # type: ignore[no-untyped-call]
            self.master_name, connection_class=PrimaryConnection
        )
        return primary

    def async_client(self, **kwargs: Any) -> redis.asyncio.Redis:
        """An asyncio client of the primary, for a process that sends and waits on many
        calls at once (the HTTP front, `tasks.front`); like `client`, it leaves a server
        that refuses writes (`AsyncPrimaryConnection`, `AsyncServerConnection`,
        `AsyncTlsServerConnection`)."""
        if not self.watched:
            # redis-py's asyncio `from_url` lets a rediss:// URL's class win over a given one
            pool = redis.asyncio.ConnectionPool.from_url(self.url, **kwargs)
            pool.connection_class = AsyncTlsServerConnection if self.tls else AsyncServerConnection
            return redis.asyncio.Redis.from_pool(pool)
        sentinel = redis.asyncio.sentinel.Sentinel(  # type: ignore[no-untyped-call]
            list(self.sentinels), **self._sentinel_options(kwargs)
        )
        primary: redis.asyncio.Redis = sentinel.master_for(
            self.master_name, connection_class=AsyncPrimaryConnection
        )
        return primary

    def _sentinel_options(self, kwargs: dict[str, Any]) -> dict[str, Any]:
        """A Sentinel client's options: its own sign-in and time limits, then the
        primary's connection options (`kwargs`, with the failover time limits)."""
        kwargs.setdefault("socket_timeout", FAILOVER_SOCKET_TIMEOUT_S)
        kwargs.setdefault("socket_connect_timeout", FAILOVER_SOCKET_TIMEOUT_S)
        sign_in = self.sign_in()
        return {
            "sentinel_kwargs": {
                **sign_in,
                "socket_timeout": kwargs["socket_connect_timeout"],
                "socket_connect_timeout": kwargs["socket_connect_timeout"],
            },
            "db": self.db,
            **sign_in,
            **kwargs,
        }

    def topology(self) -> dict[str, Any]:
        """Where the data is now, as `gpufleet status` shows it: the primary, its replicas
        and the Sentinels that answer, each as "HOST:PORT" (for one server, the primary
        alone; "" when no Sentinel names one)."""
        if not self.watched:
            part = urllib.parse.urlsplit(self.url)
            where = f"{part.hostname}:{part.port or 6379}"
            return {"primary": where, "replicas": [], "sentinels": []}
        found: dict[str, Any] = {"primary": "", "replicas": [], "sentinels": []}
        for sentinel, primary, replicas in self.sentinel_views():
            found["sentinels"].append(sentinel)
            if primary and not found["primary"]:
                found["primary"] = primary
                found["replicas"] = sorted(
                    f"{r['ip']}:{r['port']}" for r in replicas if "down" not in str(r.get("flags"))
                )
        return found

    def sentinel_views(self) -> Iterator[tuple[str, str, list[dict[str, Any]]]]:
        """What each Sentinel that answers says, in the URL's order: its own "HOST:PORT",
        the primary as "HOST:PORT" ("" when it names none), and its replicas as
        `SENTINEL REPLICAS` describes them."""
        clients = self.sentinel_clients(decode_responses=True)
        for (host, port), client in zip(self.sentinels, clients, strict=True):
            try:
                primary: Any = client.sentinel_get_master_addr_by_name(self.master_name)
                replicas: Any = client.sentinel_slaves(self.master_name)
            except redis.RedisError:
                continue
            finally:
                client.close()
            yield f"{host}:{port}", f"{primary[0]}:{primary[1]}" if primary else "", replicas

    def sentinel_clients(self, **kwargs: Any) -> list[redis.Redis]:
        """One client per Sentinel, signed in as the URL says."""
        sign_in = self.sign_in()
        kwargs.setdefault("socket_timeout", 2.0)
        kwargs.setdefault("socket_connect_timeout", 2.0)
        return [redis.Redis(host, port, **sign_in, **kwargs) for host, port in self.sentinels]


def parse(url: str) -> Endpoint:
    """Read a fleet Redis URL (the module's forms); `ConfigError` says what is wrong."""
    scheme = urllib.parse.urlsplit(url).scheme
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{masked(url)!r} must start with redis://, rediss:// or sentinel:// "
            f"(Sentinels: sentinel://HOST:PORT;sentinel://HOST:PORT?master_name=NAME)"
        )
    if scheme != "sentinel":
        return Endpoint(url)
    found: dict[str, Any] = {}
    sentinels: list[tuple[str, int]] = []
    for chunk in url.split(";"):
        part = urllib.parse.urlsplit(chunk.strip())
        if part.scheme != "sentinel" or not part.hostname:
            raise ConfigError(
                f"{masked(chunk)!r}: each part of a Sentinel URL is sentinel://HOST:PORT"
            )
        try:
            sentinels.append((part.hostname, part.port or SENTINEL_PORT))
        except ValueError as exc:  # a port out of range, or not a number
            raise ConfigError(f"{masked(chunk)!r}: {exc}") from None
        query = dict(urllib.parse.parse_qsl(part.query))
        unknown = set(query) - {"master_name"}
        if unknown:
            raise ConfigError(f"a Sentinel URL takes only master_name, not {sorted(unknown)}")
        _agree(found, "master_name", query.get("master_name"))
        _agree(found, "username", _unquote(part.username))
        _agree(found, "password", _unquote(part.password))
        _agree(found, "db", _db(part.path, chunk))
    if not found.get("master_name"):
        raise ConfigError(
            f"{masked(url)!r} names no primary: add ?master_name=NAME, the name the "
            f"Sentinels monitor it by"
        )
    return Endpoint(
        url,
        tuple(sentinels),
        master_name=found["master_name"],
        username=found.get("username"),
        password=found.get("password"),
        db=found.get("db") or 0,
    )


def connect(url: str, **kwargs: Any) -> redis.Redis:
    """A redis-py client of the fleet's Redis at `url`, plain or through Sentinels."""
    return parse(url).client(**kwargs)


def kept(pipe: Any, what: str) -> None:
    """Execute `pipe`, writes without a transaction, and Redis's `WAIT` for one replica to
    hold them (at most `REPLICA_WAIT_MS`) on the same connection. A write's error is
    raised: the caller's retry writes again, to the new primary after a failover.

    Writes no replica confirmed are kept where the Sentinels name their server the
    primary (or cannot be asked), and logged as on the primary alone (as with a Redis
    whose ACL lacks `WAIT`). A server they no longer name primary loses them when it
    follows the new one: a primary stopped past its failover and let go takes writes for
    a moment, before it counts its replicas gone or the Sentinels demote it. Then
    `ConnectionError` is raised, which every fleet client retries, on the new primary
    (asking the Sentinels, the pool drops its idle connections to the old one); a twin
    the old server took is dropped with its data."""
    pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS)
    connection = pipe.connection or pipe.connection_pool.get_connection()
    pipe.connection = connection  # so that its server is known: `execute` gives it back
    replies = pipe.execute(raise_on_error=False)
    server = (connection.host, int(connection.port))  # before another thread takes it
    if not _unconfirmed(replies):
        return
    primary = None
    if _watched(connection):
        with contextlib.suppress(redis.RedisError):  # no Sentinel answers: the write stands
            primary = connection.connection_pool.get_master_address()
    _judge(server, primary, replies[-1], what)


async def kept_async(pipe: Any, what: str) -> None:
    """`kept` for an asyncio client's pipeline."""
    pipe.execute_command("WAIT", 1, REPLICA_WAIT_MS)
    connection = pipe.connection or await pipe.connection_pool.get_connection()
    pipe.connection = connection
    replies = await pipe.execute(raise_on_error=False)
    server = (connection.host, int(connection.port))
    if not _unconfirmed(replies):
        return
    primary = None
    if _watched(connection):
        with contextlib.suppress(redis.RedisError):
            primary = await connection.connection_pool.get_master_address()
    _judge(server, primary, replies[-1], what)


def _unconfirmed(replies: list[Any]) -> bool:
    """Whether no replica confirmed a `kept` pipeline's writes (`replies`, `WAIT`'s
    last); raise the first write's error."""
    *written, replicas = replies
    for reply in written:
        if isinstance(reply, Exception):
            raise reply
    return isinstance(replicas, Exception) or not replicas


def _watched(connection: Any) -> bool:
    """Whether `connection` reaches the primary the Sentinels name (its pool asks them)."""
    pool = getattr(connection, "connection_pool", None)
    return bool(getattr(pool, "is_master", False)) and hasattr(pool, "get_master_address")


def _judge(server: tuple[str, int], primary: Any, replicas: Any, what: str) -> None:
    """Writes `what` no replica confirmed (`replicas`: `WAIT`'s reply), made on `server`,
    (host, port): refused when the Sentinels name another `primary` now, else logged as
    on the primary alone (`primary` None: not through Sentinels, or none answered)."""
    if primary is not None and server != (primary[0], int(primary[1])):
        raise redis.ConnectionError(
            f"{what} reached {server[0]}:{server[1]}, which the Sentinels no longer name "
            f"the primary ({primary[0]}:{primary[1]} is): it would be lost there; write it "
            "again"
        )
    _alone.tell(what, replicas)


class _Alone:
    """The warnings that writes are on the primary alone, at most one every
    `ALONE_WARNING_S`, which counts the writes since the last."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._said_at = -ALONE_WARNING_S
        self._unsaid = 0

    def tell(self, what: str, replicas: Any) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._said_at < ALONE_WARNING_S:
                self._unsaid += 1
                return
            unsaid, self._unsaid, self._said_at = self._unsaid, 0, now
        log.warning(
            "%s is on the primary alone: no replica confirmed it within %d ms (%s); %d more "
            "writes since the last such warning. A Sentinel group should refuse writes "
            "with no replica following (min-replicas-to-write 1; docs/deploy.md)",
            what, REPLICA_WAIT_MS, replicas, unsaid,
        )  # fmt: skip


_alone = _Alone()


def refuses_writes(exc: BaseException) -> bool:
    """Whether `exc` is a server's refusal to write because it is no primary to write to
    now: demoted (``READONLY``, which redis-py raises as `ReadOnlyError` without the word;
    on Redis 6 a writing script's ``ERR`` holds it; a take blocked as its server was
    demoted ends ``UNBLOCKED ... instance state changed``, on Redis 6.2 and 7 alike), or
    cut off from its replicas (``NOREPLICAS``: ``min-replicas-to-write``, as a primary that
    was stopped and let go after its failover is). Its clients must find the primary anew."""
    if isinstance(exc, ReadOnlyError):
        return True
    return isinstance(exc, ResponseError) and any(
        word in str(exc) for word in ("READONLY", "NOREPLICAS", "instance state changed")
    )


class _LeavesNonPrimary:
    """A connection that leaves a server refusing writes (`refuses_writes`): it
    disconnects and raises `ConnectionError`, which every fleet client retries on a new
    connection, to the primary. redis-py does this through Sentinels for a plain
    ``READONLY`` only; a primary stopped past its failover and let go still takes
    connections as a primary until the Sentinels demote it, and a write it took then
    would be lost with its data."""

    def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().read_response(*args, **kwargs)  # type: ignore[misc]
        except ResponseError as exc:
            if not refuses_writes(exc):
                raise
            self.disconnect()  # type: ignore[attr-defined]
            raise redis.ConnectionError(f"no primary to write to here: {exc}") from exc


class _AsyncLeavesNonPrimary:
    """`_LeavesNonPrimary` for asyncio clients."""

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)  # type: ignore[misc]
        except ResponseError as exc:
            if not refuses_writes(exc):
                raise
            await self.disconnect(nowait=True)  # type: ignore[attr-defined]
            raise redis.ConnectionError(f"no primary to write to here: {exc}") from exc


class PrimaryConnection(_LeavesNonPrimary, redis.sentinel.SentinelManagedConnection):
    """A connection to the primary the Sentinels name (`_LeavesNonPrimary`). As it
    opens, it tells the process which primary the Sentinels name
    (`placement.ledger.primaries`): every connection of the process to a primary they no
    longer name is shut then, or when a Sentinel announces the switch."""

    def connect_to(self, address: Any) -> None:
        super().connect_to(address)  # type: ignore[no-untyped-call]
        if self.connection_pool.is_master:
            primaries.named(self, (str(address[0]), int(address[1])))


class ServerConnection(_LeavesNonPrimary, redis.Connection):
    """A connection to a plain endpoint (`_LeavesNonPrimary`): the next one reaches the
    server its address names then."""


class TlsServerConnection(_LeavesNonPrimary, redis.SSLConnection):
    """`ServerConnection` over TLS (``rediss://``)."""


class AsyncPrimaryConnection(
    _AsyncLeavesNonPrimary, redis.asyncio.sentinel.SentinelManagedConnection
):
    """`PrimaryConnection` for asyncio clients."""


class AsyncServerConnection(_AsyncLeavesNonPrimary, redis.asyncio.Connection):
    """`ServerConnection` for asyncio clients."""


class AsyncTlsServerConnection(_AsyncLeavesNonPrimary, redis.asyncio.SSLConnection):
    """`TlsServerConnection` for asyncio clients."""


def server_connection(tls: bool) -> type[redis.Connection]:
    """The connection class of a plain endpoint, over TLS or not."""
    return TlsServerConnection if tls else ServerConnection


def _agree(found: dict[str, Any], name: str, value: Any) -> None:
    if value in (None, ""):
        return
    if found.get(name) not in (None, value):
        raise ConfigError(f"the parts of a Sentinel URL give different {name}s")
    found[name] = value


def _unquote(text: str | None) -> str | None:
    return urllib.parse.unquote(text) if text else None


def _db(path: str, chunk: str) -> int | None:
    text = path.strip("/")
    if not text:
        return None
    if not text.isdigit():
        raise ConfigError(f"{masked(chunk)!r}: the database must be a number, not {text!r}")
    return int(text)


def masked(url: str) -> str:
    """`url` (one server's, or one part of a Sentinel URL) with its password masked."""
    parts = urllib.parse.urlsplit(url)
    if not parts.password:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    return parts._replace(netloc=f"{parts.username or ''}:***@{netloc}").geturl()
