"""A primary, its replicas and three Redis Sentinels on 127.0.0.1: a fleet's Redis that
outlives the loss of its primary.

`SentinelGroup` starts `RedisServer`s (the first the primary, the others its replicas)
and Sentinel processes (`redis-server --sentinel`) that monitor the primary under
`master_name`; its `url` is the ``sentinel://`` URL every fleet process and caller
connects with (`placement.ledger.endpoint`). When the Sentinels agree the primary is
down (a quorum of 2 of 3), one of them promotes a replica, and every client connects to
it as it reconnects. The failover itself is Redis Sentinel's, not ours.

The Sentinels' timings (`DOWN_AFTER_MS`, `FAILOVER_TIMEOUT_MS`) set how fast a lost
primary is replaced; each Sentinel keeps its config file (which it rewrites as it
learns the group) in its own temporary directory. With a password, the data nodes and
the Sentinels all take it: `requirepass`, `masterauth` for replication, `auth-pass` for
the Sentinels' own connections to the data nodes and `sentinel-pass` between Sentinels.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import signal
import subprocess
import tempfile
import time
import urllib.parse
from pathlib import Path
from types import TracebackType
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from placement.errors import ConfigError, RegistryError
from placement.ledger import endpoint
from placement.server.acl import FLEET, SENTINEL, Users, sentinel_acl_lines
from placement.server.redis_server import (
    HOST,
    RedisServer,
    conf_quote,
    die_with_parent_preexec,
    find_redis_server,
    free_port,
    ping,
    stop_process,
)

__all__ = ["SentinelGroup", "SentinelServer", "replicas_ready"]

log = logging.getLogger(__name__)

#: How long a primary may not answer before a Sentinel counts it down. Tuned constant:
#: short enough that a lost primary is replaced in a few seconds, and three of Sentinel's
#: 1 s ping periods, because a Sentinel that switches to a new primary sends it its first
#: PING only one period later and counts from the switch: at 1000 ms that PING left as
#: the time ran out, so a promoted primary busy for a moment (every client reconnecting,
#: its replicas syncing) was counted down and failed over again while it took writes, and
#: what it took until the Sentinels reached it again was lost (bench.failover, 2 of about
#: 40 faults on 2 cores). Two periods remain for a loaded primary to answer.
DOWN_AFTER_MS = 3000
#: Redis Sentinel's failover timeout (also the wait before the same primary is failed over
#: again); Redis's default is 3 minutes, too slow for a second failover in one test run.
FAILOVER_TIMEOUT_MS = 5000
#: How long a node that is not the primary may leave a PING unanswered before
#: `SentinelGroup.supervise` kills it (and so starts it again as a replica). Tuned: far
#: above a PING's time on 127.0.0.1 under load, well inside a caller's 10 s.
SILENT_NODE_S = 2.0
#: How many Sentinels must agree a primary is down.
QUORUM = 2
#: How long `SentinelGroup.start` waits for the Sentinels to find each other and the
#: replicas (they announce themselves every 2 s).
FORMED_S = 20.0

#: How many random ports `SentinelServer.start` tries when another process takes the one
#: it picked.
PORT_ATTEMPTS = 5

_CONF_NAME = "sentinel.conf"
_LOG_NAME = "sentinel.log"


def replicas_ready(url: str, count: int = 1) -> bool:
    """Whether every Sentinel of `url` that answers sees `count` replicas of the primary it
    names with their link up and no flag but "slave". A Sentinel reads a replica's INFO
    only every 10 s: until it has seen the link up, it promotes no replica (its failover
    aborts, and waits twice the failover timeout), so a primary lost just after a replica
    (re)joined goes unreplaced for that long."""
    answered = 0
    for _, primary, replicas in endpoint.parse(url).sentinel_views():
        answered += 1
        if not primary or sum(_follows(r, primary) for r in replicas) < count:
            return False
    return answered > 0


def _follows(replica: dict[str, Any], primary: str) -> bool:
    return (
        replica.get("flags") == "slave"
        and replica.get("master-link-status") == "ok"
        and str(replica.get("master-link-down-time")) == "0"
        and f"{replica.get('master-host')}:{replica.get('master-port')}" == primary
    )


class SentinelServer:
    """One Redis Sentinel process on 127.0.0.1 that monitors `master_name` at `primary`."""

    def __init__(
        self,
        master_name: str,
        primary: int,
        *,
        port: int | None = None,
        password: str | None = None,
        users: Users | None = None,
        binary: str | None = None,
        log_path: Path | None = None,
    ) -> None:
        if users is not None and not users.sentinel:
            raise ConfigError("a Sentinel of a group with users needs the sentinel user's")
        self.master_name = master_name
        self.primary = primary
        self.password = password
        self.users = users
        self._binary = binary
        self._requested_port = port
        self.port = 0
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._log_path = log_path  # kept past `stop`; else in its directory, removed then

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int:
        if self._proc is None:
            raise RegistryError("the sentinel is not started; call start() first")
        return self._proc.pid

    def start(self) -> SentinelServer:
        """Start the Sentinel and wait until it answers PING (another port when the one
        picked was taken meanwhile)."""
        if self.running:
            return self
        attempts = 1 if self._requested_port else PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            try:
                return self._start(self._requested_port or free_port())
            except RegistryError as exc:
                if attempt == attempts or "Address already in use" not in str(exc):
                    raise
        raise AssertionError("unreachable")  # pragma: no cover

    def _start(self, port: int) -> SentinelServer:
        self.stop()
        self.port = port
        self._dir = Path(tempfile.mkdtemp(prefix="gpufleet-sentinel-"))
        name = self.master_name
        lines = [
            f"port {self.port}",
            f"bind {HOST}",
            f"dir {self._dir}",
            'logfile ""',
            f"sentinel monitor {name} {HOST} {self.primary} {QUORUM}",
            f"sentinel down-after-milliseconds {name} {DOWN_AFTER_MS}",
            f"sentinel failover-timeout {name} {FAILOVER_TIMEOUT_MS}",
            f"sentinel parallel-syncs {name} 1",
        ]
        if self.users is not None:
            word = conf_quote(self.users.sentinel)
            lines += sentinel_acl_lines(self.users)
            lines += [f"sentinel auth-user {name} {SENTINEL}", f"sentinel auth-pass {name} {word}"]
            lines += [f"sentinel sentinel-user {SENTINEL}", f"sentinel sentinel-pass {word}"]
        elif self.password is not None:
            word = conf_quote(self.password)
            lines += [f"requirepass {word}", f"sentinel auth-pass {name} {word}"]
            lines.append(f"sentinel sentinel-pass {word}")
        conf = self._dir / _CONF_NAME
        fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w", encoding="utf-8") as fh:
            fh.write("".join(f"{line}\n" for line in lines))
        binary = self._binary or find_redis_server()
        log_path = self._log_path or self._dir / _LOG_NAME
        with open(log_path, "ab") as logfh:
            self._proc = subprocess.Popen(
                [binary, str(conf), "--sentinel"],
                stdin=subprocess.DEVNULL,
                stdout=logfh,
                stderr=subprocess.STDOUT,
                cwd=self._dir,
                close_fds=True,
                start_new_session=True,
                preexec_fn=die_with_parent_preexec(),  # noqa: PLW1509
            )
        auth: tuple[str, ...] = (self.password,) if self.password is not None else ()
        if self.users is not None:
            auth = (FLEET, self.users.fleet)
        deadline = time.monotonic() + 10.0
        while (reply := ping(self.port, auth)) != "PONG":
            if self._proc.poll() is not None or time.monotonic() > deadline:
                tail = log_path.read_text(errors="replace")[-2000:]
                self.stop()
                raise RegistryError(f"redis sentinel did not start ({reply}):\n{tail}")
            time.sleep(0.02)
        return self

    def restart(self, primary: int) -> SentinelServer:
        """Start a Sentinel that died again on its port (the URL names it), watching
        `primary`: it learns the replicas and the other Sentinels from there."""
        self._requested_port = self.port or self._requested_port
        self.primary = primary
        self.stop()
        return self.start()

    def stop(self) -> None:
        """Stop the Sentinel and remove its directory; safe to call more than once."""
        proc, folder = self._proc, self._dir
        self._proc = self._dir = None
        stop_process(proc, folder)


class SentinelGroup:
    """A primary, `replicas` replicas and `sentinels` Sentinels on 127.0.0.1 (above).

    ::

        with SentinelGroup() as group:
            client = placement.ledger.endpoint.connect(group.url)

    With `users` (`gpufleet up --redis-ha`), every node has the fleet's users and the
    `replication` and `sentinel` ones (`placement.server.acl`), `url` is the `fleet`
    user's and `url_for` gives the others'; with `data_root`, each node keeps its
    append-only file in a folder of its own there, and each Sentinel its log
    (`sentinel<i>.log`); with `min_replicas`, a primary takes
    writes only while that many replicas follow it (`RedisServer`). `supervise` starts
    again what died.
    """

    def __init__(
        self,
        master_name: str = "gpufleet",
        *,
        replicas: int = 1,
        sentinels: int = 3,
        password: str | None = None,
        users: Users | None = None,
        data_root: Path | None = None,
        maxmemory: int | None = None,
        maxclients: int | None = None,
        min_replicas: int = 0,
        binary: str | None = None,
    ) -> None:
        if sentinels < QUORUM:
            raise ConfigError(f"a Sentinel group needs at least {QUORUM} Sentinels")
        if users is not None and not (users.replication and users.sentinel):
            raise ConfigError("a Sentinel group with users needs replication and sentinel ones")
        self.master_name = master_name
        self.password = password
        self.users = users
        self._data_root = data_root
        self._node_options: dict[str, Any] = {
            "maxmemory": maxmemory,
            "maxclients": maxclients,
            "min_replicas": min_replicas,
        }
        self._binary = binary or find_redis_server()
        self._count = replicas
        self._sentinel_count = sentinels
        #: Every data node, the first started as the primary (`primary_port` says which is now).
        self.nodes: list[RedisServer] = []
        self.sentinels: list[SentinelServer] = []

    @property
    def url(self) -> str:
        """The ``sentinel://`` URL of the group (`placement.ledger.endpoint`); with users,
        the `fleet` user's."""
        if self.users is not None:
            return self.url_for(FLEET)
        auth = f":{urllib.parse.quote(self.password, safe='')}@" if self.password else ""
        return self._url(auth)

    def url_for(self, user: str) -> str:
        """The ``sentinel://`` URL of one of the group's `users`."""
        if self.users is None:
            raise ConfigError("this Sentinel group has no users; use its url")
        quote = functools.partial(urllib.parse.quote, safe="")
        return self._url(f"{quote(user)}:{quote(self.users.password(user))}@")

    def _url(self, auth: str) -> str:
        parts = [f"sentinel://{auth}{HOST}:{s.port}/0" for s in self.sentinels]
        return ";".join(parts) + f"?master_name={urllib.parse.quote(self.master_name)}"

    def start(self) -> SentinelGroup:
        """Start every node and Sentinel, and wait until the Sentinels know each other and
        the replicas (before that, a failover could not happen)."""
        try:
            primary = self._node(0, None).start()
            self.nodes = [primary]
            for i in range(1, self._count + 1):
                self.nodes.append(self._node(i, primary.port).start())
            for _ in range(self._sentinel_count):
                self.sentinels.append(
                    SentinelServer(
                        self.master_name,
                        primary.port,
                        password=self.password,
                        users=self.users,
                        binary=self._binary,
                        log_path=self._sentinel_log(len(self.sentinels)),
                    ).start()
                )
            self._wait_formed()
        except BaseException:
            self.stop()
            raise
        return self

    def _sentinel_log(self, i: int) -> Path | None:
        """Where the `i`th Sentinel logs: beside the nodes' data with a `data_root`, so
        that its elections and failovers outlive it (an operator's and a test's record)."""
        if self._data_root is None:
            return None
        self._data_root.mkdir(parents=True, exist_ok=True)
        return self._data_root / f"sentinel{i}.log"

    def _node(self, i: int, replica_of: int | None) -> RedisServer:
        return RedisServer(
            password=self.password,
            users=self.users,
            binary=self._binary,
            data_dir=self._data_root / f"node{i}" if self._data_root is not None else None,
            replica_of=replica_of,
            **self._node_options,
        )

    def _wait_formed(self) -> None:
        deadline = time.monotonic() + FORMED_S
        while True:
            clients = endpoint.parse(self.url).sentinel_clients(decode_responses=True)
            formed = all([self._knows_group(client) for client in clients])
            if formed:
                return
            if time.monotonic() > deadline:
                raise RegistryError(
                    f"the Sentinels did not find each other and the replicas in {FORMED_S:g} s"
                )
            time.sleep(0.1)

    def _knows_group(self, client: redis.Redis) -> bool:
        try:
            others: Any = client.sentinel_sentinels(self.master_name)
            replicas: Any = client.sentinel_slaves(self.master_name)
        except redis.RedisError:
            return False
        finally:
            client.close()
        up = [r for r in replicas if "s_down" not in str(r.get("flags", ""))]
        return len(others) >= self._sentinel_count - 1 and len(up) >= self._count

    def primary_port(self) -> int:
        """The port of the primary, as the first Sentinel that answers says."""
        found = endpoint.parse(self.url).topology()["primary"]
        if not found:
            raise RegistryError("no Sentinel answers with the primary")
        return int(found.rsplit(":", 1)[1])

    def node(self, port: int) -> RedisServer:
        """The data node listening on `port`."""
        for node in self.nodes:
            if node.running and node.port == port:
                return node
        raise RegistryError(f"no running node on port {port}")

    def wait_failover(self, old_port: int, timeout: float = 30.0) -> int:
        """Wait until the Sentinels name a primary other than `old_port` that takes
        writes; its port."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(RegistryError):
                port = self.primary_port()
                if port != old_port and self._is_primary(port):
                    return port
            time.sleep(0.1)
        raise RegistryError(f"no failover away from port {old_port} in {timeout:g} s")

    def wait_replicas(self, timeout: float = 30.0) -> None:
        """Wait until the Sentinels see a replica in sync with the primary (`replicas_ready`):
        a primary lost before then waits longer for its failover, or takes with it what no
        replica has yet."""
        deadline = time.monotonic() + timeout
        while not replicas_ready(self.url):
            if time.monotonic() > deadline:
                raise RegistryError(f"no replica the Sentinels trust within {timeout:g} s")
            time.sleep(0.2)

    def _is_primary(self, port: int) -> bool:
        client = self._node_client(port)
        try:
            return client.info("replication").get("role") == "master"
        except redis.RedisError:
            return False
        finally:
            client.close()

    def _node_client(self, port: int, timeout: float = 2.0) -> redis.Redis:
        sign_in = (
            {"username": FLEET, "password": self.users.fleet}
            if self.users is not None
            else {"password": self.password}
        )
        return redis.Redis(  # one try: a silent node is the answer, not an error to retry
            HOST,
            port,
            socket_timeout=timeout,
            socket_connect_timeout=timeout,
            retry=Retry(NoBackoff(), 0),
            **sign_in,
        )

    def supervise(self) -> list[str]:
        """Start again each node and Sentinel that died, on its port: a node as a replica
        of the primary the Sentinels name (its old data does not win: it syncs anew), a
        Sentinel watching that primary. A dead primary waits for its failover, unless no
        node is left to take over. A node that is not the primary and does not answer a
        PING within `SILENT_NODE_S` (stopped, hung) is killed first, and so started again:
        its clients' connections break at once, where a stopped server's keep them waiting
        (a plain Celery client's result connection would wait until it came back). What it
        did, in words."""
        started: list[str] = []
        try:
            primary: int | None = self.primary_port()
        except RegistryError:
            primary = None
        for node in self.nodes:
            others = primary is not None and node.running and node.port != primary
            if others and not self._answers(node.port):
                self._kill(node)
                started.append(f"killed redis node {HOST}:{node.port}: it did not answer a PING")
        dead = [node for node in self.nodes if not node.running]
        if dead:
            alive = [node.port for node in self.nodes if node.running]
            for node in dead:
                if primary is None or primary == node.port:
                    if alive:  # the Sentinels have yet to fail it over
                        continue
                    node.replica_of = None  # nothing else holds the data: its own file
                else:
                    node.replica_of = primary
                node.restart()
                role = "the primary" if node.replica_of is None else f"a replica of {primary}"
                started.append(f"started redis node {HOST}:{node.port} as {role}")
        for sentinel in self.sentinels:
            if not sentinel.running:
                with contextlib.suppress(RegistryError):
                    sentinel.restart(self.primary_port())
                    started.append(f"started sentinel {HOST}:{sentinel.port}")
        return started

    def _answers(self, port: int) -> bool:
        client = self._node_client(port, timeout=SILENT_NODE_S)
        try:
            client.ping()
        except (redis.TimeoutError, redis.ConnectionError):
            return False
        except redis.RedisError:  # an error reply (LOADING, ...) is an answer
            return True
        finally:
            client.close()
        return True

    @staticmethod
    def _kill(node: RedisServer) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(node.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while node.running and time.monotonic() < deadline:
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop every Sentinel, then every node."""
        for sentinel in self.sentinels:
            sentinel.stop()
        for node in self.nodes:
            node.stop()
        self.sentinels, self.nodes = [], []

    def __enter__(self) -> SentinelGroup:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
