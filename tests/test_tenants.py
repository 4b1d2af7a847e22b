"""Tenants without a fleet: the fair order (`placement.rules.fairness`), the registry's
records (`placement.ledger.tenants`), the router's mark on a tenant's call
(`tasks.broker.intake`), and each tenant's Redis user on real redis-servers
(`placement.server.acl`, `placement.server.tenant_users`)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from placement.errors import ConfigError, UnknownTenantError
from placement.ledger import tenants
from placement.ledger.store import Store
from placement.rules.fairness import FairOrder, FairTurns
from placement.server.acl import ADMIN, Users, tenant_line, user_url
from placement.server.redis_server import RedisServer, find_redis_server, redis_version
from placement.server.tenant_users import TenantUsers
from tasks.broker import intake
from tasks.broker.intake import TENANT_HEADER

BINARIES = sorted({find_redis_server(), find_redis_server(newest=True)})


def served(order: FairOrder, line: list[tuple[float, int, str]], n: int) -> list[str]:
    """The tenants of the first `n` calls of `line` (start tag, arrival, tenant) served."""
    out = []
    for tag, _, tenant in sorted(line)[:n]:
        order.serve(tag)
        out.append(tenant)
    return out


def test_a_tenant_alone_is_served_in_the_order_its_calls_arrived() -> None:
    order = FairOrder()
    tags = [order.arrive("a", 2.0) for _ in range(50)]
    assert tags == sorted(tags) and len(set(tags)) == 50


@given(st.integers(1, 9), st.integers(1, 9))
def test_two_backlogged_tenants_are_served_in_proportion_to_their_weights(wa: int, wb: int) -> None:
    order = FairOrder()
    line = []
    for i in range(400):  # both send their whole backlog, interleaved
        line.append((order.arrive("a", wa), i, "a"))
        line.append((order.arrive("b", wb), i, "b"))
    first = Counter(served(order, line, 200))
    assert abs(first["a"] - 200 * wa / (wa + wb)) <= 1 + max(wa, wb) / min(wa, wb)


def test_a_tenant_that_was_idle_passes_another_tenants_backlog_but_banks_no_credit() -> None:
    order = FairOrder()
    backlog = [(order.arrive("a", 1.0), i, "a") for i in range(300)]
    assert served(order, backlog, 100) == ["a"] * 100  # b had nothing waiting
    late = order.arrive("b", 1.0)
    ahead = [tag for tag, _, _ in sorted(backlog)[100:] if tag < late]
    assert len(ahead) <= 1  # b waits for at most one call of a's, not a's 200
    # b was idle for 100 calls: it starts at the virtual time, not 100 calls ahead
    second = order.arrive("b", 1.0)
    assert second == late + 1.0


def test_a_weight_must_be_above_zero() -> None:
    with pytest.raises(ValueError, match="above 0"):
        FairOrder().arrive("a", 0.0)


def take(turns: FairTurns, waiting: dict[str, int], n: int) -> list[str]:
    """What a consumer takes in `n` takes: the first queue in `consume`'s order with a
    message waiting, as take.lua does."""
    out = []
    for _ in range(n):
        queue = next(q for q in turns.consume(len(turns.items)) if waiting[q])
        waiting[queue] -= 1
        turns.rotate(queue)
        out.append(queue)
    return out


def test_a_router_takes_from_tenants_queues_in_turns_by_their_weights() -> None:
    weights = {"celery": 1.0, "t.a.celery": 3.0, "t.b.celery": 1.0}
    turns = FairTurns(weights.__getitem__)
    turns.update(weights)
    taken = Counter(take(turns, {"celery": 0, "t.a.celery": 500, "t.b.celery": 500}, 400))
    assert taken == {"t.a.celery": 300, "t.b.celery": 100}


def test_a_queue_that_fills_after_the_others_ran_a_while_gets_its_turn_and_no_burst() -> None:
    turns = FairTurns(lambda q: 1.0)
    turns.update(["a", "b"])
    waiting = {"a": 1000, "b": 0}
    assert take(turns, waiting, 200) == ["a"] * 200
    waiting["b"] = 50
    assert take(turns, waiting, 10) == ["b", "a"] * 5  # turns from now on, not 200 for b


def test_tenant_names_are_checked_and_queues_map_back_to_their_tenants() -> None:
    assert tenants.queue_of("team-a") == "t.team-a.celery"
    assert tenants.tenant_of("t.team-a.celery") == "team-a"
    for queue in ("celery", "t.celery", "t..celery", "t.Team.celery", "gpufleet.router"):
        assert tenants.tenant_of(queue) is None, queue
    for bad in ("", "Team", "1team", "a.b", "a" * 33, "a b"):
        with pytest.raises(ConfigError, match="tenant name"):
            tenants.check_name(bad)


@pytest.fixture
def store(redis_url: str, fleet: str) -> Iterator[Store]:
    found = Store.from_url(redis_url, fleet)
    yield found
    found.client.close()


def test_a_tenant_is_recorded_once_with_its_weight_and_the_digest_of_its_password(
    store: Store,
) -> None:
    added = tenants.add(store, "team-a", 3, "pw-a")
    assert tenants.all_tenants(store) == {"team-a": added}
    assert added.weight == 3.0 and added.digest == tenants.digest_of("pw-a") != "pw-a"
    with pytest.raises(ConfigError, match="has a tenant 'team-a' already"):
        tenants.add(store, "team-a", 1, "other")
    for weight in (0, -1, float("nan"), 1e9, True):
        with pytest.raises(ConfigError, match="weight"):
            tenants.add(store, "team-b", weight, "pw")
    assert tenants.remove(store, "team-a") == added
    with pytest.raises(UnknownTenantError, match="no tenant 'team-a'"):
        tenants.remove(store, "team-a")
    assert tenants.all_tenants(store) == {}


def message(headers: dict[str, object]) -> bytes:
    return json.dumps(
        {
            "body": "",
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"id": "t1", "task": "gpufleet.infer", **headers},
            "properties": {"delivery_tag": "d1", "body_encoding": "base64"},
        }
    ).encode()


def test_the_router_marks_a_call_with_the_tenant_of_its_queue_never_the_one_it_claims() -> None:
    claimed = message({TENANT_HEADER: "team-b"})
    assert TENANT_HEADER not in intake.envelope(claimed, "celery")["headers"]
    assert intake.envelope(claimed, "t.team-a.celery")["headers"][TENANT_HEADER] == "team-a"
    # a fleet queue keeps what the fleet wrote (a router's hand-over to a GPU worker)
    assert intake.envelope(claimed, "gpufleet.router")["headers"][TENANT_HEADER] == "team-b"


@pytest.fixture(scope="module", params=BINARIES, ids=lambda b: f"redis-{redis_version(b)[0]}")
def server(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[RedisServer]:
    """A bundled Redis as the launcher runs it: with the admin user, and persistent."""
    users = Users(fleet="f-pw", operator="o-pw", caller="c-pw", admin="a-pw")
    data = tmp_path_factory.mktemp("redis")
    with RedisServer(binary=request.param, users=users, data_dir=data) as srv:
        yield srv


def tenant_client(server: RedisServer, name: str, password: str) -> redis.Redis:
    url = f"redis://127.0.0.1:{server.port}/0"
    return redis.Redis.from_url(user_url(url, tenants.user_of(name), password))


def allowed(action: Callable[[], object]) -> bool:
    try:
        action()
    except redis.exceptions.NoPermissionError:
        return False
    return True


def test_the_launcher_gives_each_tenant_a_user_that_may_send_only_to_its_own_queue(
    server: RedisServer,
) -> None:
    fleet = f"ten-{time.monotonic_ns()}"
    store = Store.from_url(server.url, fleet)
    users = TenantUsers(store, lambda: [server.url_for(ADMIN)], redis_version(server.binary)[0])
    tenants.add(store, "team-a", 1, "a-secret")
    tenants.add(store, "team-b", 1, "b-secret")
    users.sync()
    a = tenant_client(server, "team-a", "a-secret")
    can = {
        "send a call": lambda: a.lpush("t.team-a.celery", "call"),
        "send with a priority": lambda: a.lpush("t.team-a.celery\x06\x169", "call"),
        "declare its queue": lambda: a.sadd("t.team-a._kombu.binding.celery", "x"),
        "read a result": lambda: a.get("celery-task-meta-1"),
    }
    cannot = {
        "send to the router's queue": lambda: a.lpush("celery", "call"),
        "send to another tenant's queue": lambda: a.lpush("t.team-b.celery", "call"),
        "send to the router's internal queue": lambda: a.lpush("gpufleet.router", "call"),
        "read the registry": lambda: a.hgetall(store.keys.tenants),
        "make users": lambda: a.execute_command("ACL", "SETUSER", "x", "on", ">p", "+@all"),
    }
    assert {what for what, act in can.items() if not allowed(act)} == set()
    assert {what for what, act in cannot.items() if allowed(act)} == set()
    # removed: its user goes; the other tenant's stays
    tenants.remove(store, "team-a")
    users.sync()
    with pytest.raises(redis.AuthenticationError):
        tenant_client(server, "team-a", "a-secret").ping()
    assert tenant_client(server, "team-b", "b-secret").ping()
    # a restarted Redis lost its users (its append-only file keeps no ACL change): the next
    # sync makes them again
    server.restart()
    with pytest.raises(redis.AuthenticationError):
        tenant_client(server, "team-b", "b-secret").ping()
    users.sync()
    assert tenant_client(server, "team-b", "b-secret").ping()
    users.stop()
    store.client.close()


def test_a_tenant_on_a_redis_of_your_own_gets_the_acl_line_its_user_needs(
    server: RedisServer,
) -> None:
    tenant = tenants.Tenant("team-c", 1.0, tenants.digest_of("c-secret"))
    line = tenant_line(tenant, redis_version(server.binary)[0])
    admin = redis.Redis.from_url(server.url_for(ADMIN))
    admin.execute_command("ACL", "SETUSER", *_split_conf_line(line))
    c = tenant_client(server, "team-c", "c-secret")
    assert allowed(lambda: c.lpush("t.team-c.celery\x06\x163", "call"))
    assert not allowed(lambda: c.lpush("celery", "call"))


def _split_conf_line(line: str) -> list[str]:
    """An ACL file line's words, as redis-server reads them (quoted `\\xHH` escapes)."""
    words = [
        w[1:-1].encode().decode("unicode_escape") if w.startswith('"') and w.endswith('"') else w
        for w in line.split(" ")
    ]
    return words[1:]  # less "user"
