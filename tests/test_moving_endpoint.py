"""A plain Redis endpoint whose address moves to a promoted replica, as a managed Redis's
does on failover: the fleet's connections leave the old primary as it refuses them
(`placement.ledger.endpoint.ServerConnection`) and reach the new one at the same address.

The address is a loopback proxy (`MovingAddress`): each connection it takes goes to the
server it points at then, and stays there, so connections made before the move still reach
the old primary, now a replica, which answers writes with READONLY and ends a blocked take
with UNBLOCKED, as a managed Redis's old primary does until it drops its clients. The
failover is Redis's coordinated one (`FAILOVER`), as a managed Redis's planned one is: a
promotion without it drops what the old primary took after it, and one such run lost a
call here.
"""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from celery import Celery

from placement.config import Settings
from placement.ledger import endpoint
from placement.ledger.registry import Registry
from placement.server.redis_server import HOST, RedisServer
from tasks.config import celery_conf
from tests.calling import Load
from tests.fleets import gpu
from tests.running import TWO_MODELS, fleet_env, fleet_up

PASSWORD = "moving-pw"


class MovingAddress:
    """A TCP address on 127.0.0.1 that forwards each connection to `target`'s port, the one
    set when the connection was taken (`move` changes it for the next ones)."""

    def __init__(self, target: int) -> None:
        self.target = target
        self._listener = socket.create_server((HOST, 0))
        self.port = self._listener.getsockname()[1]
        self._sockets: list[socket.socket] = [self._listener]
        self._closed = threading.Event()
        threading.Thread(target=self._accept, daemon=True).start()

    def move(self, target: int) -> None:
        self.target = target

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            server = socket.create_connection((HOST, self.target))
            self._sockets += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=_pipe, args=(source, sink), daemon=True).start()

    def close(self) -> None:
        self._closed.set()
        for each in self._sockets:
            each.close()


def _pipe(source: socket.socket, sink: socket.socket) -> None:
    try:
        while data := source.recv(65536):
            sink.sendall(data)
    except OSError:
        pass
    finally:
        for each in (source, sink):
            with contextlib.suppress(OSError):
                each.shutdown(socket.SHUT_RDWR)


def _promote(old: RedisServer, new: RedisServer, address: MovingAddress) -> None:
    """The managed failover: Redis's coordinated `FAILOVER` (the old primary pauses
    writes until the replica has them all, promotes it and follows it), then the address
    moves to the new primary. Clients still on the old one get READONLY, and a take
    blocked there ends UNBLOCKED; a new connection before the move meets READONLY too."""
    client = redis.Redis(HOST, new.port, password=PASSWORD)
    deadline = time.monotonic() + 30
    while client.info("replication")["master_link_status"] != "up":  # in sync first
        assert time.monotonic() < deadline, "the replica did not sync"
        time.sleep(0.05)
    redis.Redis(HOST, old.port, password=PASSWORD).execute_command("FAILOVER", "TO", HOST, new.port)
    while client.info("replication")["role"] != "master":
        assert time.monotonic() < deadline, "the replica was not promoted"
        time.sleep(0.005)
    address.move(new.port)


@pytest.fixture
def servers() -> Iterator[tuple[RedisServer, RedisServer, MovingAddress]]:
    with (
        RedisServer(password=PASSWORD) as first,
        RedisServer(password=PASSWORD, replica_of=first.port) as second,
    ):
        address = MovingAddress(first.port)
        try:
            yield first, second, address
        finally:
            address.close()


def test_the_registry_s_scripts_and_reads_follow_an_address_moved_to_the_promoted_replica(
    servers: tuple[RedisServer, RedisServer, MovingAddress],
) -> None:
    first, second, address = servers
    url = f"redis://:{PASSWORD}@{HOST}:{address.port}/0"
    registry = Registry.from_url(url, "moving")
    registry.register_worker("w1", "h1", "q1", [gpu("h1:0", 8 << 30, host="h1")], lease_ms=60_000)
    assert registry.snapshot().gpus["h1:0"].alive(registry.snapshot().now_ms)
    _promote(first, second, address)
    # the registry's pooled connection and its scripts' own still reach the old primary:
    # each meets READONLY once, leaves it, and the call goes on at the moved address
    assert registry.heartbeat("w1", ["h1:0"], lease_ms=60_000)
    assert "h1:0" in registry.snapshot().gpus
    on_new = redis.Redis(HOST, second.port, password=PASSWORD)
    assert on_new.info("replication")["role"] == "master"
    assert any(on_new.scan_iter("*moving*")), "the ledger is not on the new primary"


def test_a_refusal_by_a_server_that_is_no_longer_the_primary_is_a_lost_connection() -> None:
    refused = redis.exceptions.ReadOnlyError("You can't write against a read only replica.")
    unblocked = redis.ResponseError(
        "UNBLOCKED force unblock from blocking operation, instance state changed "
        "(master -> replica?)"
    )
    assert endpoint.refuses_writes(refused) and endpoint.refuses_writes(unblocked)
    assert not endpoint.refuses_writes(redis.ResponseError("WRONGTYPE Operation against a key"))
    assert endpoint.parse("redis://h:1/0").client().connection_pool.connection_class is (
        endpoint.ServerConnection
    )
    tls = endpoint.parse("rediss://h:1/0").client().connection_pool.connection_class
    assert tls is endpoint.TlsServerConnection
    for url, made in (
        ("redis://h:1/0", endpoint.AsyncServerConnection),
        ("rediss://h:1/0", endpoint.AsyncTlsServerConnection),
    ):
        assert endpoint.parse(url).async_client().connection_pool.connection_class is made


@pytest.mark.slow
def test_a_fleet_at_an_address_moved_to_a_promoted_replica_under_load_loses_no_call(
    servers: tuple[RedisServer, RedisServer, MovingAddress], tmp_path: Path
) -> None:
    """`gpufleet up` on a plain Redis URL (the proxy's), the project's client calling two
    models from four threads; the address moves to the promoted replica: every call is
    answered, calls sent after the move too, and no worker restarts."""
    first, second, address = servers
    url = f"redis://:{PASSWORD}@{HOST}:{address.port}/0"
    catalog = tmp_path / "models.yaml"
    catalog.write_text(TWO_MODELS)
    env = fleet_env(GPUFLEET_REDIS_URL=url, GPUFLEET_HOME=str(tmp_path / "home"))
    args = ["--sim-gpus", "1x4GiB", "--metrics-port", "0"]
    with fleet_up(catalog, args, env, log=tmp_path / "fleet.log") as fleet:
        client = Celery(set_as_current=False)
        client.conf.update(**celery_conf(Settings.from_env({"GPUFLEET_REDIS_URL": url})))
        workers = [fleet.child_named("router@"), fleet.child_named("gpu0@"), fleet.pool_child(0)]
        load = Load(client)
        try:
            load.start(threads=4)
            load.until(answered=40)
            _promote(first, second, address)
            moved = time.time()
            load.until(answered=40, after=moved)
            sent_after = [done for sent, done, _ in load.calls if sent > moved]
            assert len(sent_after) >= 20, "too few calls were sent after the move"
        finally:
            load.stop()
            client.close()
        assert not load.errors, load.errors[:5]
        assert load.sent == len(load.calls)
        assert [fleet.child_named("router@"), fleet.child_named("gpu0@")] == workers[:2]
        assert fleet.pool_child(0) == workers[2], "the GPU worker's pool child restarted"
