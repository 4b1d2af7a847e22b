"""Tenants without a fleet: the fair order (`placement.rules.fairness`), the registry's
records (`placement.ledger.tenancy.tenants`), the router's mark on a tenant's call
(`tasks.broker.intake`), and each tenant's Redis user on real redis-servers
(`placement.server.acl`, `placement.server.tenant_users`)."""

from __future__ import annotations

import json
import time
from collections import Counter
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from hypothesis import given
from hypothesis import strategies as st

from placement.errors import ConfigError, PayloadError, UnknownTenantError
from placement.ledger.store import Store
from placement.ledger.tenancy import tenants
from placement.ledger.tenancy.usage import Usage
from placement.rules.fairness import FairOrder, FairTurns
from placement.server.acl import ADMIN, Users, tenant_line, user_url
from placement.server.redis_server import RedisServer, find_redis_server, redis_version
from placement.server.tenant_users import TenantUsers
from tasks.broker import intake
from tasks.broker.intake import TENANT_HEADER
from tests.test_acl import allowed

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


def test_weights_share_rows_so_a_tenant_s_calls_of_many_inputs_count_each_input() -> None:
    order = FairOrder()
    line = []
    for i in range(100):  # a sends calls of 8 inputs, b calls of one, equal weights
        line.append((order.arrive("a", 1.0, 8), i, "a"))
        for j in range(8):
            line.append((order.arrive("b", 1.0, 1), 8 * i + j, "b"))
    first = Counter(served(order, line, 90))
    rows = {"a": first["a"] * 8, "b": first["b"]}
    assert abs(rows["a"] - rows["b"]) <= 8, first  # equal rows, not equal calls


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


def tenant_of_queue(queue: str) -> str:
    return tenants.tenant_of(queue) or ""


def test_a_router_takes_from_tenants_queues_in_turns_by_their_weights() -> None:
    weights = {"": 1.0, "a": 3.0, "b": 1.0}
    turns = FairTurns(tenant_of_queue, weights.__getitem__)
    turns.update(["celery", "gpufleet.router", "t.a.celery", "t.b.celery"])
    waiting = {"celery": 0, "gpufleet.router": 0, "t.a.celery": 500, "t.b.celery": 500}
    taken = Counter(take(turns, waiting, 400))
    assert taken == {"t.a.celery": 300, "t.b.celery": 100}


def test_a_tenant_whose_queue_fills_late_gets_its_turn_and_no_burst() -> None:
    turns = FairTurns(tenant_of_queue, lambda t: 1.0)
    turns.update(["t.a.celery", "t.b.celery"])
    waiting = {"t.a.celery": 1000, "t.b.celery": 0}
    assert take(turns, waiting, 200) == ["t.a.celery"] * 200
    waiting["t.b.celery"] = 50
    assert take(turns, waiting, 10) == ["t.b.celery", "t.a.celery"] * 5  # not 200 for b


def test_a_consumer_without_tenants_takes_its_queues_in_turns_as_kombu_s_cycle_does() -> None:
    turns = FairTurns(tenant_of_queue, lambda t: 1.0)
    turns.update(["celery", "gpufleet.router"])
    assert not turns.shared()
    # a backlog of calls does not hold back the router's own queue (retries, scaling)
    waiting = {"celery": 50, "gpufleet.router": 5}
    assert take(turns, waiting, 10) == ["celery", "gpufleet.router"] * 5
    assert take(turns, waiting, 3) == ["celery"] * 3
    turns.update(["celery", "gpufleet.router", "t.a.celery"])
    assert turns.shared()


def test_tenant_names_are_checked_and_queues_map_back_to_their_tenants() -> None:
    assert tenants.queue_of("team-a") == "t.team-a.celery"
    assert tenants.tenant_of("t.team-a.celery") == "team-a"
    for queue in ("celery", "t.celery", "t..celery", "t.Team.celery", "gpufleet.router"):
        assert tenants.tenant_of(queue) is None, queue
    for bad in ("", "Team", "1team", "a.b", "a" * 33, "a b"):
        with pytest.raises(ConfigError, match="tenant name"):
            tenants.check_name(bad)


@given(
    st.text(min_size=1, max_size=40),
    st.sampled_from([tenants.DEFAULT, "team-a", "b", "a" * 32]),
)
def test_the_fleet_s_id_of_a_call_gives_back_its_caller_s_id_and_tenant(
    task_id: str, tenant: str
) -> None:
    named = tenants.call_id(task_id, tenant)
    assert tenants.owner(named) == (task_id, tenant)
    assert len(named) <= len(task_id) + tenants.ID_SUFFIX


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
    # its record stays, removed, while its calls may still drain; the name is free again
    assert tenants.records(store)["team-a"].removed
    again = tenants.add(store, "team-a", 2, "pw-a2")
    assert tenants.all_tenants(store) == {"team-a": again}
    assert not tenants.forget(store, "team-a")  # not a removed tenant's record now
    tenants.remove(store, "team-a")
    assert tenants.forget(store, "team-a") and tenants.records(store) == {}


def test_status_counts_each_tenants_calls_waiting_on_its_queues_and_parked_by_its_quota() -> None:
    from tasks.serving.status import tenants_report

    found = {
        "a": tenants.Tenant("a", 3.0, "d", max_running=2, max_queued=10),
        "b": tenants.Tenant("b", 1.0, "d", removed_ms=5),
    }
    depths = {
        "celery": 4,
        "t.a.celery": 2,
        "gpufleet.h.gpu0": 7,
        "gpufleet.h.gpu0~a": 3,
        "gpufleet.h.gpu1~a": 1,
        "gpufleet.h.gpu1~b": 9,
    }
    limits: dict[str, object] = {"max_running": 0, "max_queued": 0, "parked": 0, "let_in": 0}
    used = {"a": Usage(calls=4, failed=1, gpu_ms=1500.0, tokens_in=7, tokens_out=9, wait_ms=80.0)}
    rows = tenants_report(found, depths, {"a": (2, 5)}, used)
    assert rows == [
        {"name": "a", "weight": 3.0, "removed": False, "max_running": 2, "max_queued": 10,
         "queued": 6 + 5, "parked": 5, "let_in": 2, "calls": 4, "failed": 1,
         "gpu_seconds": 1.5, "tokens_in": 7, "tokens_out": 9, "mean_wait_s": 0.02},
        {"name": "b", "weight": 1.0, "removed": True, **limits, "queued": 9,
         **Usage().report()},
    ]  # fmt: skip
    assert rows[1]["calls"] == 0 and rows[1]["mean_wait_s"] is None


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


def test_a_call_is_named_by_its_tenant_as_the_router_takes_it_and_no_id_names_another_s() -> None:
    assert intake.envelope(message({}), "t.team-a.celery")["headers"]["id"] == "t1@team-a"
    assert intake.envelope(message({}), "celery")["headers"]["id"] == "t1"
    # a fleet queue's call is named already (a router's hand-over to a GPU worker)
    named = json.dumps(json.loads(message({}))).replace('"t1"', '"t1@team-a"').encode()
    assert intake.envelope(named, "gpufleet.router")["headers"]["id"] == "t1@team-a"
    # a caller's id that spells another tenant's call names its own
    forged = message({}).replace(b'"t1"', b'"x@team-b"')
    assert tenants.owner(intake.envelope(forged, "t.team-a.celery")["headers"]["id"]) == (
        "x@team-b",
        "team-a",
    )
    assert tenants.owner(intake.envelope(forged, "celery")["headers"]["id"]) == (
        "x@team-b",
        tenants.DEFAULT,
    )
    too_long = message({}).replace(b'"t1"', b'"' + b"x" * (intake.MAX_CALLER_ID + 1) + b'"')
    with pytest.raises(intake.Refused, match="longer than"):
        intake.envelope(too_long, "t.team-a.celery")


def test_a_tenant_s_result_is_stored_where_its_plain_celery_client_reads_it(
    redis_url: str,
) -> None:
    from celery import Celery, states

    from tasks.broker.results import Backend
    from tasks.serving import streams

    fleet = Celery("fleet-side", backend=f"tasks.broker.results:Backend+{redis_url}")
    fleet.conf.update(result_serializer="json", result_accept_content=["json"])
    backend = fleet.backend
    assert isinstance(backend, Backend)
    backend.store_result("r1@team-a", {"x": 1}, states.SUCCESS)
    backend.store_result("r1", {"x": 0}, states.SUCCESS)  # the default tenant's, same id
    tenant = Celery("tenant-side", backend=redis_url)
    tenant.conf.update(
        result_serializer="json",
        result_accept_content=["json"],
        result_backend_transport_options={"global_keyprefix": tenants.key_prefix("team-a")},
    )
    found = tenant.AsyncResult("r1")
    assert found.get(timeout=5) == {"x": 1} and found.task_id == "r1"
    assert json.loads(backend.client.get("t.team-a.celery-task-meta-r1"))["task_id"] == "r1"
    assert fleet.AsyncResult("r1").get(timeout=5) == {"x": 0}
    backend.store_result("a@team-a@", {"x": 2}, states.SUCCESS)  # a default caller's odd id
    plain = Celery("default-caller", backend=redis_url)
    plain.conf.update(result_serializer="json", result_accept_content=["json"])
    assert plain.AsyncResult("a@team-a").get(timeout=5) == {"x": 2}
    assert not backend.client.exists("t.team-a.celery-task-meta-a")
    plain.close()
    assert streams.key("r1@team-a") == "t.team-a.gpufleet-stream-r1"
    assert streams.key("r1") == "gpufleet-stream-r1"
    tenant.close()
    fleet.close()


def test_a_caller_cannot_set_its_tenant_through_the_body_celery_merges_into_the_request(
    redis_url: str,
) -> None:
    with pytest.raises(PayloadError, match="embed"):
        _checked_from_team_a(redis_url, {"callbacks": None, TENANT_HEADER: "team-b"})


def _checked_from_team_a(redis_url: str, embed: dict[str, Any]) -> None:
    """`intake.check` of a call with `embed` that a client pushed to team-a's queue."""
    from kombu import Connection

    from tasks.api import app  # the app with the fleet's tasks registered

    with Connection(redis_url) as connection:
        connection.default_channel.client.delete("t.team-a.celery")
        producer = connection.Producer(serializer="json")
        headers = {"id": "t2", "task": "gpufleet.infer", "lang": "py"}
        producer.publish([["m", "x"], {}, embed], routing_key="t.team-a.celery", headers=headers)
        queue = connection.SimpleQueue("t.team-a.celery")
        message = queue.get(timeout=5)
        try:
            intake.check(message, app.tasks)
        finally:
            message.ack()
            queue.close()


def test_a_tenant_s_chord_and_any_chained_id_naming_a_call_are_refused(redis_url: str) -> None:
    step = {"task": "gpufleet.status", "args": [], "kwargs": {}, "options": {}}
    with pytest.raises(PayloadError, match="task id"):
        intake.check_canvas({"chain": [{**step, "options": {"task_id": "y@team-b"}}]})
    chord = {"task": "celery.chord", "args": [], "kwargs": {"body": step}, "options": {}}
    intake.check_canvas({"chain": [chord]})  # the default tenant's chords stay
    with pytest.raises(PayloadError, match="chord"):  # a tenant's, anywhere in its canvas
        intake.check_canvas({"chain": [step, chord]}, chords=False)
    with pytest.raises(PayloadError, match="chord"):
        _checked_from_team_a(redis_url, {"callbacks": None, "chain": None, "chord": step})


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


def heard(client: redis.Redis, channel: str) -> object:
    """Subscribe `client` to `channel`: Redis answers the SUBSCRIBE, or refuses it."""
    listener = client.pubsub()
    try:
        listener.subscribe(channel)
        return listener.get_message(timeout=2)
    finally:
        listener.close()


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
        "read its result": lambda: a.get("t.team-a.celery-task-meta-1"),
        "read its streamed text": lambda: a.xread({"t.team-a.gpufleet-stream-1": "0-0"}),
        "hear its results": lambda: heard(a, "t.team-a.celery-task-meta-1"),
    }
    cannot = {
        "read another tenant's result": lambda: a.get("t.team-b.celery-task-meta-1"),
        "read the default tenant's result": lambda: a.get("celery-task-meta-1"),
        "read another tenant's stream": lambda: a.xread({"t.team-b.gpufleet-stream-1": "0-0"}),
        "hear another tenant's results": lambda: heard(a, "t.team-b.celery-task-meta-1"),
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
    # the name added again: a new password, and the old one's connection is closed
    held = tenant_client(server, "team-b", "b-secret")
    held.ping()
    tenants.remove(store, "team-b")
    tenants.add(store, "team-b", 1, "b-new")
    users.sync()
    with pytest.raises(redis.ConnectionError):
        held.lpush("t.team-b.celery", "call")
    assert tenant_client(server, "team-b", "b-new").ping()
    # a restarted Redis lost its users (its append-only file keeps no ACL change): the next
    # sync makes them again
    server.restart()
    with pytest.raises(redis.AuthenticationError):
        tenant_client(server, "team-b", "b-new").ping()
    users.sync()
    assert tenant_client(server, "team-b", "b-new").ping()
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
