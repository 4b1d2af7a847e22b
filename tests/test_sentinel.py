"""A fleet whose Redis is a primary, replicas and three Sentinels: URLs, clients that follow
a failover, the users of `gpufleet up --redis-ha`'s group, and two hosts that lose no call
when its primary is killed or stopped (docs/deploy.md, "Redis Sentinel")."""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery

from placement.config import Settings, safe_url
from placement.errors import ConfigError
from placement.ledger import endpoint, primaries
from placement.ledger.audit import ledger_problems
from placement.ledger.registry import Registry
from placement.policy.state import Gpu
from placement.server.acl import CALLER, Users
from placement.server.redis_server import HOST, RedisServer
from placement.server.sentinel import SentinelGroup, replicas_ready
from tasks.broker import run_log
from tasks.config import caller_conf, celery_conf
from tests.calling import Load
from tests.running import REPO, TWO_MODELS, RunningFleet, fleet_env, fleet_up, until, with_signal
from tests.test_chaos import settled

_CLI = (sys.executable, "-m", "tasks.operator.cli")
GROUP = "sentinel://u:p%40ss@10.0.0.1:26379/2;sentinel://10.0.0.2:26380;sentinel://10.0.0.3?master_name=ha"

pytestmark = pytest.mark.slow


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    with SentinelGroup(password="s3cret") as started:
        yield started


def test_a_sentinel_url_names_every_sentinel_the_primary_and_one_sign_in() -> None:
    found = endpoint.parse(GROUP)
    assert found.sentinels == (("10.0.0.1", 26379), ("10.0.0.2", 26380), ("10.0.0.3", 26379))
    assert (found.master_name, found.username, found.password, found.db) == ("ha", "u", "p@ss", 2)
    assert found.parts()[1] == "sentinel://u:p%40ss@10.0.0.2:26380/2"
    assert "p%40ss" not in safe_url(GROUP) and "p@ss" not in found.shown()


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("sentinel://10.0.0.1:26379", "master_name=NAME"),
        ("sentinel://:a@h1?master_name=x;sentinel://:b@h2", "different passwords"),
        ("sentinel://h1?master_name=x;redis://h2", "each part"),
        ("sentinel://h1:99999?master_name=x", "out of range"),
        ("sentinel://h1/zero?master_name=x", "must be a number"),
        ("sentinel://h1?master_name=x&ssl=1", "only master_name"),
        ("memcache://h1", "must start with redis://, rediss:// or sentinel://"),
    ],
)
def test_a_malformed_redis_url_is_refused_with_what_to_write(url: str, says: str) -> None:
    with pytest.raises(ConfigError, match=says.replace("?", r"\?")):
        endpoint.parse(url)
    with pytest.raises(ConfigError, match="GPUFLEET_REDIS_URL"):
        Settings.from_env({"GPUFLEET_REDIS_URL": url})


def test_fleet_processes_take_the_sentinels_from_their_options_and_callers_from_the_url() -> None:
    """kombu switches a connection with `;` alternates to the URL's own transport after a
    failed try: the fleet's broker URL names one Sentinel and its option all of them."""
    conf = celery_conf(Settings.from_env({"GPUFLEET_REDIS_URL": GROUP}))
    assert ";" not in conf["broker_url"]
    assert conf["broker_transport"] == "tasks.broker.transport:SentinelTransport"
    options = conf["broker_transport_options"]
    assert options["sentinels"] == [["10.0.0.1", 26379], ["10.0.0.2", 26380], ["10.0.0.3", 26379]]
    assert options["master_name"] == "ha"
    assert options["sentinel_kwargs"] == {"username": "u", "password": "p@ss"}
    assert conf["result_backend"].startswith("tasks.broker.results:SentinelBackend+sentinel://")
    plain = caller_conf(GROUP)
    assert plain["broker_url"].count(";") == 2 and plain["broker_url"] == plain["result_backend"]
    assert plain["result_backend_transport_options"]["master_name"] == "ha"
    one = caller_conf("redis://:pw@127.0.0.1:6379/0")
    assert "broker_transport_options" not in one
    assert one["broker_url"] == "redis://:pw@127.0.0.1:6379/0"


def test_the_registry_follows_a_killed_primary_to_the_replica_the_sentinels_promote(
    group: SentinelGroup,
) -> None:
    registry = Registry.from_url(group.url, "ha")
    registry.register_worker("w1", "h1", "q1", [_gpu()], lease_ms=60_000)
    _replicated(group)
    old = group.primary_port()
    os.kill(group.node(old).pid, signal.SIGKILL)
    began = time.monotonic()
    snap = registry.snapshot()  # waits out the failover, then reads the new primary
    assert group.primary_port() != old
    assert snap.gpus["h1:0"].worker == "w1"
    assert registry.heartbeat("w1", ["h1:0"], lease_ms=60_000)  # a script, loaded anew there
    assert time.monotonic() - began < endpoint.FAILOVER_WAIT_S


def test_the_registry_leaves_a_primary_that_stops_answering_for_the_one_promoted(
    group: SentinelGroup,
) -> None:
    """A SIGSTOPped primary accepts connections and never answers: each try times out,
    drops its connection (its late reply must not be read as the next call's), and the
    next asks the Sentinels again."""
    registry = Registry.from_url(group.url, "ha")
    registry.register_worker("w1", "h1", "q1", [_gpu()], lease_ms=60_000)
    _replicated(group)
    old = group.primary_port()
    stopped = group.node(old)
    os.kill(stopped.pid, signal.SIGSTOP)
    try:
        for _ in range(3):  # several calls: none reads another's reply
            assert registry.heartbeat("w1", ["h1:0"], lease_ms=60_000)
            assert registry.snapshot().gpus["h1:0"].worker == "w1"
        assert group.primary_port() != old
    finally:
        os.kill(stopped.pid, signal.SIGCONT)


def test_a_client_on_a_demoted_primary_writes_to_the_new_one(group: SentinelGroup) -> None:
    """A graceful failover leaves the old primary running as a replica: writes there fail
    with READONLY, and the client must connect again through the Sentinels."""
    client = endpoint.connect(group.url, decode_responses=True)
    registry = Registry.from_url(group.url, "ha")
    registry.register_worker("w1", "h1", "q1", [_gpu()], lease_ms=60_000)
    client.set("before", "1")
    old = group.primary_port()
    sentinel = redis.Redis("127.0.0.1", group.sentinels[0].port, password="s3cret")
    sentinel.execute_command("SENTINEL", "FAILOVER", group.master_name)
    new = group.wait_failover(old)
    _until_replica(old)
    assert registry.heartbeat("w1", ["h1:0"], lease_ms=60_000)
    client.set("after", "2")
    where = endpoint.parse(group.url).topology()
    assert where["primary"] == f"127.0.0.1:{new}" and len(where["sentinels"]) == 3
    on_new = redis.Redis("127.0.0.1", new, password="s3cret", decode_responses=True)
    assert on_new.get("before") == "1" and on_new.get("after") == "2"


def _send(app: Celery, text: str) -> None:
    """A call no worker will take, sent without subscribing to its result: a result left
    to the garbage collector unsubscribes through its client, and one whose Sentinels
    are gone by then retried for minutes, inside whatever test the collector ran in
    (it was test_hostile's Hypothesis loop: ~285 s)."""
    app.send_task("gpufleet.infer", args=("m", text), ignore_result=True)


def test_a_call_published_through_the_sentinels_returns_once_a_replica_holds_it(
    group: SentinelGroup,
) -> None:
    """A primary lost whole before its replica had a call it acknowledged would lose the
    call unseen, so the fleet's client waits (WAIT) for the replica: stopped, the publish
    waits; let go, the publish returns and the replica holds the call."""
    app = Celery(set_as_current=False)
    app.conf.update(**celery_conf(Settings.from_env({"GPUFLEET_REDIS_URL": group.url})))
    _send(app, "first")  # connected, the queue declared
    replica = _waits_for_the_replica(group, lambda: _send(app, "second"))
    held = redis.Redis("127.0.0.1", replica.port, password="s3cret").llen("celery")
    assert held == 2


def test_a_result_stored_through_the_sentinels_returns_once_a_replica_holds_it(
    group: SentinelGroup,
) -> None:
    """A worker acknowledges a call once its result is written, and an acknowledgement
    Redis could not take as the primary died drops the call's record on the new one: a
    result the old primary took alone was lost with it, and its caller waited for an
    answer no one would send. So a result write waits (WAIT) for a replica, as a
    publish does: stopped, the write waits; let go, it returns and the replica holds it."""
    app = Celery(set_as_current=False)
    app.conf.update(**celery_conf(Settings.from_env({"GPUFLEET_REDIS_URL": group.url})))
    backend = app.backend
    backend.store_result("first", {"ok": 1}, "SUCCESS")  # connected
    replica = _waits_for_the_replica(
        group, lambda: backend.store_result("second", {"ok": 2}, "SUCCESS")
    )
    held = redis.Redis("127.0.0.1", replica.port, password="s3cret")
    assert held.get(backend.get_key_for_task("second")) is not None


def _waits_for_the_replica(group: SentinelGroup, write: Callable[[], object]) -> Any:
    """Run `write` with the group's replica stopped: it must not return in 0.5 s, and
    must within 5 s once the replica runs again. Returns the replica's node."""
    _replicated(group)
    [replica] = [n for n in group.nodes if n.port != group.primary_port()]
    done = threading.Event()
    writer = threading.Thread(target=lambda: (write(), done.set()))
    os.kill(replica.pid, signal.SIGSTOP)
    try:
        writer.start()
        assert not done.wait(0.5), "the write returned before any replica held it"
    finally:
        os.kill(replica.pid, signal.SIGCONT)
    assert done.wait(5)
    writer.join()
    return replica


def test_writes_no_replica_confirms_warn_once_a_period_and_a_refused_write_raises(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(endpoint, "REPLICA_WAIT_MS", 10)
    monkeypatch.setattr(endpoint, "ALONE_WARNING_S", 0.5)
    monkeypatch.setattr(endpoint, "_alone", endpoint._Alone())

    def write(client: redis.Redis, n: int) -> None:
        with client.pipeline(transaction=False) as pipe:
            pipe.set(f"k{n}", n)
            endpoint.kept(pipe, f"write {n}")

    with RedisServer() as server, caplog.at_level("WARNING", logger=endpoint.__name__):
        client = redis.Redis.from_url(server.url)  # a primary no replica follows
        for n in range(3):
            write(client, n)
        time.sleep(0.5)
        write(client, 3)
        warned = [r.getMessage() for r in caplog.records if "primary alone" in r.getMessage()]
        assert len(warned) == 2, warned
        assert warned[0].startswith("write 0 is on the primary alone") and "; 0 more" in warned[0]
        assert warned[1].startswith("write 3 is on") and "; 2 more writes" in warned[1]
        assert [client.get(f"k{n}") for n in range(4)] == [b"0", b"1", b"2", b"3"]
        client.rpush("a-list", 1)
        with client.pipeline(transaction=False) as pipe, pytest.raises(redis.ResponseError):
            pipe.incr("a-list")  # a write Redis refuses (WRONGTYPE)
            endpoint.kept(pipe, "the refused write")
        client.close()


def test_a_write_no_replica_confirms_on_a_server_the_sentinels_do_not_name_is_written_again(
    group: SentinelGroup,
) -> None:
    """A server that takes writes but is not the Sentinels' primary (as a primary stopped
    past its failover takes them for a moment when let go) loses what it took once it
    follows the primary: `kept` refuses such a write, so that its retry reaches the
    primary. The stray here is the replica, made a primary by hand."""
    primary = group.primary_port()
    (stray_port,) = [node.port for node in group.nodes if node.port != primary]
    stray = redis.Redis("127.0.0.1", stray_port, password="s3cret")
    stray.execute_command("REPLICAOF", "NO", "ONE")
    client = endpoint.connect(group.url)
    try:
        pool = client.connection_pool
        connection = pool.get_connection()
        assert connection.port == primary
        # A connection the failover left, in a pool that has not asked the Sentinels since
        # (it keeps only connections to the primary it last learned)
        connection.disconnect()
        connection.connect_to(("127.0.0.1", stray_port))
        pool.proxy.master_address = ("127.0.0.1", stray_port)
        pool.release(connection)
        with client.pipeline(transaction=False) as pipe:
            pipe.set("k", "taken by the stray")
            with pytest.raises(redis.ConnectionError, match="no longer name the primary"):
                endpoint.kept(pipe, "the write")
        assert stray.get("k") == b"taken by the stray"  # what the stray drops as it follows
        with client.pipeline(transaction=False) as pipe:  # the retry: a new connection
            pipe.set("k", "kept")
            endpoint.kept(pipe, "the write")
        assert redis.Redis("127.0.0.1", primary, password="s3cret").get("k") == b"kept"
    finally:
        client.close()
        stray.execute_command("REPLICAOF", "127.0.0.1", str(primary))
        stray.close()


def test_once_one_connection_finds_a_new_primary_every_connection_to_the_old_one_is_shut(
    group: SentinelGroup, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read blocked on a stopped primary ends as soon as another connection of the
    process learns from the Sentinels that the primary moved, not at its own timeout:
    so it does where the Sentinels do not let the fleet hear ``+switch-master`` (their
    listeners are left out here)."""
    monkeypatch.setattr(primaries.Primaries, "_listen", lambda *_: None)
    old = group.primary_port()
    waiting = endpoint.connect(group.url, socket_timeout=60)  # its own timeout: a minute
    waiting.ping()
    ended: list[tuple[float, str]] = []

    def wait() -> None:
        try:
            waiting.blpop(["nothing-comes"], timeout=50)
        except redis.ConnectionError as exc:
            ended.append((time.monotonic(), type(exc).__name__))

    os.kill(group.node(old).pid, signal.SIGSTOP)
    try:
        reader = threading.Thread(target=wait, daemon=True)
        reader.start()
        new = group.wait_failover(old)
        assert not ended, "the read ended before the failover"
        other = endpoint.connect(group.url)
        # opens a connection, to the primary the Sentinels name (once one names it unflagged)
        until("a new connection finds the new primary", lambda: _pings(other), 10)
        learned = time.monotonic()
        assert other.connection_pool.get_connection().port == new
        reader.join(5)
        assert ended, "the read on the old primary did not end"
        assert ended[0][0] - learned < 2.0, ended
        waiting.ping()  # the next command reaches the new primary
        assert waiting.connection_pool.get_connection().port == new
        other.close()
    finally:
        os.kill(group.node(old).pid, signal.SIGCONT)
        waiting.close()


def test_a_read_blocked_on_a_stopped_primary_ends_when_a_sentinel_announces_the_switch(
    group: SentinelGroup, caplog: pytest.LogCaptureFixture
) -> None:
    """With no other connection to learn from, a process leaves a stopped primary at the
    Sentinels' ``+switch-master``, not at its connections' own timeouts."""
    old = group.primary_port()
    waiting = endpoint.connect(group.url, socket_timeout=60)  # its own timeout: a minute
    waiting.ping()  # the process now listens to the group's Sentinels
    ended: list[float] = []

    def wait(client: redis.Redis) -> None:
        with contextlib.suppress(redis.ConnectionError):
            client.blpop(["nothing-comes"], timeout=50)
        ended.append(time.monotonic())

    os.kill(group.node(old).pid, signal.SIGSTOP)
    try:
        reader = threading.Thread(target=wait, args=(waiting,), daemon=True)
        reader.start()
        with caplog.at_level("WARNING", logger=primaries.__name__):
            new = group.wait_failover(old)
            switched = time.monotonic()
            reader.join(10)
        assert ended, "the read on the old primary did not end"
        assert ended[0] - switched < 3.0, "left the old primary long after the switch"
        assert any(f"leaving 127.0.0.1:{old}" in r.getMessage() for r in caplog.records)
        waiting.ping()  # the next command reaches the new primary
        assert waiting.connection_pool.get_connection().port == new
    finally:
        os.kill(group.node(old).pid, signal.SIGCONT)
        waiting.close()
    ports = {f"gpufleet-sentinel-127.0.0.1:{s.port}" for s in group.sentinels}
    assert len(ports & {t.name for t in threading.enumerate()}) == 3  # one per Sentinel
    del waiting
    gc.collect()
    until("the listeners stop with the last client", lambda: not _listening(ports), 5)


def _listening(names: set[str]) -> bool:
    return bool(names & {t.name for t in threading.enumerate()})


def test_a_plain_clients_publish_rides_out_a_failover(group: SentinelGroup) -> None:
    """A plain client configured by `gpufleet url --json` publishes a call sent just as
    the primary dies to the replica the Sentinels promote: no error reaches it. (Its
    connection cycles through the Sentinels' URLs, sleeping only after each round, so
    retries counted once would give up after 3 s, before the failover.)"""
    app = Celery(set_as_current=False)
    app.conf.update(**caller_conf(group.url))
    _send(app, "before")  # connected, the queue declared
    _replicated(group)
    old = group.primary_port()
    os.kill(group.node(old).pid, signal.SIGKILL)
    _send(app, "during")
    new = group.primary_port()
    assert new != old
    assert redis.Redis("127.0.0.1", new, password="s3cret").llen("celery") == 2


def test_a_primary_no_replica_follows_refuses_writes_and_its_clients_look_again() -> None:
    """With `min_replicas`, a primary cut off from its replicas (here: its one replica
    stopped) refuses writes: a fleet client's connection drops as at a failover
    (`endpoint.PrimaryConnection`), so its caller retries, and nothing was written."""
    with SentinelGroup(password="s3cret", min_replicas=1) as group:
        client = endpoint.connect(group.url)
        client.set("before", "1")
        (replica,) = [n for n in group.nodes if n.port != group.primary_port()]
        os.kill(replica.pid, signal.SIGSTOP)
        try:
            deadline = time.monotonic() + 20  # past MIN_REPLICAS_MAX_LAG_S
            for tried in itertools.count():
                try:
                    client.set(f"during {tried}", "2")
                except redis.ConnectionError as exc:
                    assert "NOREPLICAS" in str(exc)
                    break
                assert time.monotonic() < deadline, "the primary kept taking writes"
                time.sleep(0.5)
        finally:
            os.kill(replica.pid, signal.SIGCONT)
        assert client.get(f"during {tried}") is None  # the refused write was not made
        until("writes taken again", lambda: _writes(client), 20)


def _writes(client: redis.Redis) -> bool:
    try:
        return bool(client.set("after", "3"))
    except redis.ConnectionError:
        return False


def test_a_group_with_users_lets_the_fleets_users_look_it_up_and_nothing_more(
    tmp_path: Path,
) -> None:
    """`--redis-ha`'s group: the callers' user may find the primary through a Sentinel but
    not fail the group over or reconfigure it; the `replication` user reads no key."""
    users = Users("f-pw", "o-pw", "c-pw", replication="r-pw", sentinel="s-pw")
    with SentinelGroup(users=users, data_root=tmp_path / "redis") as group:
        fleet = endpoint.connect(group.url)
        assert fleet.lpush("celery", "{}") == 1 and fleet.execute_command("WAIT", 1, 5000) == 1
        caller = endpoint.connect(group.url_for(CALLER))
        assert caller.llen("celery") == 1  # through the Sentinels, to the primary
        found = endpoint.parse(group.url_for(CALLER)).topology()
        assert found["primary"] == f"{HOST}:{group.primary_port()}" and found["replicas"]
        sentinel = redis.Redis(HOST, group.sentinels[0].port, username=CALLER, password="c-pw")
        for command in (("FAILOVER", group.master_name), ("REMOVE", group.master_name)):
            with pytest.raises(redis.exceptions.NoPermissionError):
                sentinel.execute_command("SENTINEL", *command)
        hears = sentinel.pubsub()
        hears.subscribe(primaries.SWITCH_CHANNEL)  # when the primary moves, and only that
        assert hears.get_message(timeout=2)["channel"] == primaries.SWITCH_CHANNEL.encode()
        other = sentinel.pubsub()
        other.subscribe("__sentinel__:hello")  # what the Sentinels tell each other
        with pytest.raises(redis.exceptions.NoPermissionError):
            other.get_message(timeout=2)
        hears.close()
        other.close()
        replication = redis.Redis(
            HOST, group.primary_port(), username="replication", password="r-pw"
        )
        with pytest.raises(redis.exceptions.NoPermissionError):
            replication.get("celery")
        assert (tmp_path / "redis" / "node0").is_dir()  # each node's append-only file
        old = group.primary_port()
        os.kill(group.node(old).pid, signal.SIGKILL)
        group.wait_failover(old)
        assert group.supervise() == [
            f"started redis node {HOST}:{old} as a replica of {group.primary_port()}"
        ]
        group.wait_replicas()
        assert endpoint.connect(group.url).llen("celery") == 1  # the failover lost nothing


def test_a_tenant_behind_sentinels_finds_the_primary_as_its_own_user_and_nothing_more(
    tmp_path: Path,
) -> None:
    """`--redis-ha` with tenants: the launcher's sync makes each tenant's user on every
    data node and on every Sentinel, where it may only find the primary."""
    from placement.ledger.store import Store
    from placement.ledger.tenancy import tenants
    from placement.server.acl import ADMIN, SENTINEL, user_url
    from placement.server.tenant_users import TenantUsers

    users = Users("f-pw", "o-pw", "c-pw", replication="r-pw", sentinel="s-pw", admin="a-pw")
    with SentinelGroup(users=users, data_root=tmp_path / "redis") as group:
        store = Store.from_url(group.url, "ha-tenants")
        tenants.add(store, "team-a", 1, "t-pw")
        major = int(str(store.client.info("server")["redis_version"]).split(".")[0])
        nodes = [n.url_for(ADMIN) for n in group.nodes]
        sentinels = [
            user_url(f"redis://{HOST}:{s.port}", SENTINEL, "s-pw") for s in group.sentinels
        ]
        sync = TenantUsers(store, lambda: nodes, major, lambda: sentinels)
        sync.sync()
        url = user_url(group.url_for(CALLER), tenants.user_of("team-a"), "t-pw")
        assert url.count("tenant-team-a:t-pw@") == len(group.sentinels)
        tenant = endpoint.connect(url)  # through the Sentinels, as its own user
        assert tenant.lpush("t.team-a.celery", "{}") == 1
        with pytest.raises(redis.exceptions.NoPermissionError):
            tenant.lpush("celery", "{}")  # the default tenant's queue
        port = group.sentinels[0].port
        sentinel = redis.Redis(HOST, port, username="tenant-team-a", password="t-pw")
        assert sentinel.execute_command("SENTINEL", "GET-MASTER-ADDR-BY-NAME", group.master_name)
        with pytest.raises(redis.exceptions.NoPermissionError):
            sentinel.execute_command("SENTINEL", "FAILOVER", group.master_name)
        tenants.remove(store, "team-a")
        sync.sync()  # its user goes from the Sentinels too
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(HOST, port, username="tenant-team-a", password="t-pw").ping()
        sync.stop()
        store.client.close()


def test_a_tenant_of_a_redis_ha_fleet_calls_it_with_the_settings_gpufleet_url_prints(
    tmp_path: Path,
) -> None:
    catalog = tmp_path / "models.yaml"
    catalog.write_text(TWO_MODELS)
    env = fleet_env(GPUFLEET_HOME=str(tmp_path / "home"))
    args = ["--redis-ha", "--sim-gpus", "1x4GiB", "--metrics-port", "0"]
    with fleet_up(catalog, args, env, log=tmp_path / "fleet.log"):

        def cli(*words: str) -> str:
            done = subprocess.run(
                [*_CLI, *words], cwd=REPO, env=env, capture_output=True, text=True, timeout=60,
                check=False,
            )  # fmt: skip
            assert done.returncode == 0, (words, done.stdout, done.stderr)
            return done.stdout

        cli("tenant", "add", "ha-team", "--max-running", "2")
        conf = json.loads(cli("url", "--tenant", "ha-team", "--json"))["celery"]
        assert conf["broker_transport_options"]["global_keyprefix"] == "t.ha-team."
        client = Celery(set_as_current=False)
        client.conf.update(**conf)
        try:
            calls = [client.send_task("gpufleet.infer", args=("a", f"x{i}")) for i in range(4)]
            assert all(c.get(timeout=120)["outputs"] for c in calls)
        finally:
            client.close()
        used = {t["name"]: t for t in _status(env)["tenants"]}["ha-team"]
        assert used["calls"] == 4 and used["max_running"] == 2


def test_two_hosts_on_a_redis_ha_fleet_lose_no_call_when_its_primary_is_killed_or_stopped(
    tmp_path: Path,
) -> None:
    """`gpufleet up --redis-ha` on host h1 and a second `gpufleet up` (h2) joining its
    Redis through the Sentinels, one model served on each, under a plain client's load:
    the primary SIGKILLed, then the one the Sentinels promoted, then the next SIGSTOPped.
    Both hosts answer calls sent after each fault within 10 s; h1's launcher starts each
    killed node again as a replica of the new primary (its old data does not win), kills
    the stopped one once failed over (it does not answer), and starts a killed Sentinel
    again; no router or GPU worker restarts; every call ran once, as the workers' run
    log (outside Redis) counts."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(TWO_MODELS)
    runs = tmp_path / "runs.log"
    env = fleet_env(
        GPUFLEET_HOME=str(tmp_path / "h1"), GPUFLEET_HOST="h1", GPUFLEET_RUN_LOG=str(runs)
    )
    args = ["--sim-gpus", "1x1GiB", "--metrics-port", "0"]
    log = tmp_path / "fleet.log"
    with fleet_up(catalog, ["--redis-ha", *args], env, log=log) as h1:
        joining = fleet_env(
            GPUFLEET_REDIS_URL=h1.fleet_url,
            GPUFLEET_HOME=str(tmp_path / "h2"),
            GPUFLEET_HOST="h2",
            GPUFLEET_RUN_LOG=str(runs),
        )
        with fleet_up(catalog, args, joining, log=log) as h2:
            hosts = set()  # a 1 GiB GPU holds one of the two: each host serves one model
            for model in "ab":
                placed = h1.client.send_task("gpufleet.deploy", args=(model,)).get(timeout=120)
                hosts |= {gpu.split(":")[0] for p in placed["placed"] for gpu in p["gpus"]}
            assert hosts == {"h1", "h2"}, hosts
            workers = _workers(h1) + _workers(h2)
            load = Load(h1.client)
            load.start(threads=4)
            load.until(answered=40)
            # The second kills the primary the first promoted; then one is stopped, and let
            # go only after its failover (h1's launcher kills it first: it did not answer).
            for fault in (signal.SIGKILL, signal.SIGKILL, signal.SIGSTOP):
                old = _synced(h1)
                pid = h1.child_named(f"{HOST}:{old}", word=True)
                with_signal(pid, fault)
                at = time.time()
                load.until(answered=40, after=at)
                sent_after = [(done, host) for sent, done, host in load.calls if sent > at]
                assert min(sent_after)[0] - at < 10, (
                    f"no call sent after {fault.name} answered in 10 s; the Sentinels "
                    f"said:\n{_sentinel_logs(tmp_path / 'h1')}"
                )
                until(f"both hosts answer calls sent after {fault.name}", load.both_hosts(at), 30)
                back = functools.partial(_replicates, h1, old)
                until(f"the primary given {fault.name} is a replica again", back, 30)
                with_signal(pid, signal.SIGCONT)  # its data does not win: it synced anew
            sentinel = _status(env)["redis"]["sentinels"][0]
            with_signal(h1.child_named(sentinel, word=True), signal.SIGKILL)
            until("the killed Sentinel is back", lambda: _answers_as_sentinel(h1, sentinel), 15)
            load.stop()
            assert not load.errors, load.errors[:5]
            assert load.sent == len(load.calls)

            def unsettled() -> list[str]:
                snap = h1.registry.snapshot()
                return settled(snap) + ledger_problems(snap)

            deadline = time.monotonic() + 30
            while problems := unsettled():
                assert time.monotonic() < deadline, problems
                time.sleep(0.5)
            assert _workers(h1) + _workers(h2) == workers, "a router or GPU worker restarted"
            ran = run_log.runs(runs)
            odd = {t: ran.get(t, 0) for t in load.answered if ran.get(t) != 1}
            odd |= {t: n for t, n in ran.items() if n > 1}
            assert odd == {}, "calls that did not run once:\n" + "\n".join(
                line
                for line in (runs.read_text() + log.read_text()).splitlines()
                if any(t in line for t in odd)
                or any(w in line for w in ("ran already", "ran (", "put back", "delivered again"))
            )


def _sentinel_logs(home: Path, lines: int = 30) -> str:
    """The last `lines` of each Sentinel's log of the fleet at `home` (its elections and
    failovers, with times), to tell why a failover took as long as it did."""
    logs = sorted(home.rglob("sentinel*.log"))
    tails = [f"{p.name}:\n" + "\n".join(p.read_text().splitlines()[-lines:]) for p in logs]
    return "\n".join(tails) or f"no Sentinel log under {home}"


def _workers(fleet: RunningFleet) -> list[int]:
    """The pids of a one-GPU fleet's Celery workers and its GPU worker's pool child."""
    return [fleet.child_named("router@"), fleet.child_named("gpu0@"), fleet.pool_child(0)]


def _node(fleet: RunningFleet, address: str) -> redis.Redis:
    """A client of one data node of an HA fleet, as the fleet's own user."""
    found = endpoint.parse(fleet.fleet_url)
    host, port = address.rsplit(":", 1)
    return redis.Redis(
        host, int(port), username=found.username, password=found.password, socket_timeout=2
    )


def _synced(fleet: RunningFleet) -> int:
    """Wait until the Sentinels see the replica in sync with the primary (a kill before
    then is a second fault); the primary's port."""
    until("a replica the Sentinels trust", lambda: replicas_ready(fleet.fleet_url), 30)
    return int(endpoint.parse(fleet.fleet_url).topology()["primary"].rsplit(":", 1)[1])


def _in_sync(fleet: RunningFleet, replica: str, primary: str) -> bool:
    try:
        info: Any = _node(fleet, replica).info("replication")
    except redis.RedisError:
        return False
    return (
        info.get("role") == "slave"
        and f"{info.get('master_host')}:{info.get('master_port')}" == primary
        and info.get("master_link_status") == "up"
        and int(info.get("master_sync_in_progress", 1)) == 0
    )


def _replicates(fleet: RunningFleet, port: int) -> bool:
    primary = endpoint.parse(fleet.fleet_url).topology()["primary"]
    return bool(primary) and _in_sync(fleet, f"{HOST}:{port}", str(primary))


def _answers_as_sentinel(fleet: RunningFleet, address: str) -> bool:
    try:
        fleet.child_named(address, word=True)  # started again, on its port
        return bool(_node(fleet, address).execute_command("SENTINEL", "MASTERS"))
    except (AssertionError, redis.RedisError):
        return False


def _status(env: dict[str, str]) -> dict[str, Any]:
    printed = subprocess.run(
        [*_CLI, "status", "--json"], cwd=REPO, env=env, capture_output=True, text=True, check=True
    )
    report: dict[str, Any] = json.loads(printed.stdout)
    return report


def _pings(client: redis.Redis) -> bool:
    try:
        return bool(client.ping())
    except redis.ConnectionError:  # no Sentinel names a primary that is up, for a moment
        return False


def _gpu() -> Gpu:
    return Gpu(id="h1:0", host="h1", index=0, name="Sim", total=4 * 2**30)


def _replicated(group: SentinelGroup) -> None:
    """Wait until the replica has every write the primary took (WAIT)."""
    primary = redis.Redis("127.0.0.1", group.primary_port(), password="s3cret")
    assert primary.execute_command("WAIT", 1, 5000) == 1


def _until_replica(port: int) -> None:
    node = redis.Redis("127.0.0.1", port, password="s3cret", decode_responses=True)
    deadline = time.monotonic() + 20
    while node.info("replication").get("role") != "slave":
        assert time.monotonic() < deadline, "the old primary did not become a replica"
        time.sleep(0.1)
