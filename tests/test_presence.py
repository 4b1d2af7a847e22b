"""A dead worker's calls go back, each once: what it held to its queues, a lost GPU
worker's queue to the router.

Each test owns a redis-server (broker keys such as kombu's `unacked` are per database,
not per fleet). A worker that holds calls and dies is a real kombu consumer in a child
process, killed with SIGKILL after it took them and before it acknowledged them.
"""

from __future__ import annotations

import base64
import json
import multiprocessing
import time
from collections.abc import Iterator
from typing import Any

import pytest
import redis
from celery import Celery
from kombu import Connection, Queue

from placement.ledger.keys import CONSUMERS, unacked_of
from placement.server.redis_server import RedisServer
from tasks.broker import presence
from tasks.broker.intake import LEASE_HEADER, mark_redelivered
from tasks.broker.transport import Onward, Transport, inflight
from tasks.config import INTERNAL_QUEUE, ROUTER_QUEUE
from tasks.serving.calls import HOPS_HEADER

LEASE_MS = 300
GPU_QUEUE = "gpufleet.h1.gpu0"


@pytest.fixture
def broker() -> Iterator[tuple[str, redis.Redis]]:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        yield server.url, client
        client.close()


def _sender(url: str) -> Celery:
    app = Celery(broker=url)  # no result backend: these tests only need the task ids
    app.conf.update(task_serializer="json", accept_content=["json"])
    return app


def _hold(url: str, node: str, queue: str, count: int) -> None:
    """A worker that records itself, takes `count` calls and never acknowledges them."""
    client = redis.Redis.from_url(url)
    presence.Presence(client, node, "router", [queue], LEASE_MS).arrive()
    options = {"consumer_name": node}
    with Connection(url, transport=Transport, transport_options=options) as conn:
        taken: list[Any] = []
        consumer = conn.Consumer(
            Queue(queue), callbacks=[lambda _b, m: taken.append(m)], accept=["json"]
        )
        consumer.qos(prefetch_count=count)
        with consumer:
            while len(taken) < count:
                conn.drain_events(timeout=10)
            time.sleep(600)  # holding them until killed


def _held_by_a_killed_worker(url: str, client: redis.Redis, node: str, queue: str, n: int) -> None:
    child = multiprocessing.get_context("spawn").Process(target=_hold, args=(url, node, queue, n))
    child.start()
    try:
        deadline = time.monotonic() + 30
        while client.scard(unacked_of(node)) < n or not client.hexists(CONSUMERS, node):
            assert time.monotonic() < deadline, "the worker never took its calls"
            time.sleep(0.05)
    finally:
        child.kill()
        child.join()
    time.sleep(LEASE_MS / 1000 + 0.1)  # its record lapses


def _queued(client: redis.Redis, queue: str) -> list[dict[str, Any]]:
    """The messages of `queue` in the order a consumer takes them."""
    return [json.loads(raw) for raw in reversed(client.lrange(queue, 0, -1))]


def _args(payload: dict[str, Any]) -> Any:
    return json.loads(base64.b64decode(payload["body"]))[0]


def _nothing_live() -> set[str]:
    return set()


def _unanswered(_: str) -> bool:
    return False


def _arrived(
    client: redis.Redis, lease_ms: int = LEASE_MS, *, lapsed: bool = False
) -> presence.Presence:
    """A router, router@h1, that recorded itself (and is never renewed unless a test does);
    `lapsed`: once its record's deadline has passed."""
    worker = presence.Presence(client, "router@h1", "router", [ROUTER_QUEUE], lease_ms)
    worker.arrive()
    if lapsed:
        time.sleep(lease_ms / 1000 + 0.1)
    return worker


def test_a_dead_routers_unacknowledged_calls_go_back_first_in_line_in_order_once(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    sent = [_sender(url).send_task("gpufleet.infer", args=["m", f"call {i}"]) for i in range(3)]
    _held_by_a_killed_worker(url, client, "router@h1", ROUTER_QUEUE, 2)
    assert [p["headers"]["id"] for p in _queued(client, ROUTER_QUEUE)] == [sent[2].id]

    moved = presence.sweep(client, _nothing_live, _unanswered)

    assert moved == {"router@h1": 2}
    queued = _queued(client, ROUTER_QUEUE)
    assert [p["headers"]["id"] for p in queued] == [c.id for c in sent]
    assert [p["properties"]["delivery_info"]["redelivered"] for p in queued[:2]] == [True, True]
    assert client.hlen("unacked") == 0
    assert client.scard(unacked_of("router@h1")) == 0
    assert presence.sweep(client, _nothing_live, _unanswered) == {}  # nothing moves twice
    assert presence.records(client)["router@h1"].gone_ms > 0


def test_a_lost_gpu_workers_calls_go_to_the_router_as_infer_calls_with_their_task_ids(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    app = _sender(url)
    call = {"model": "m", "inputs": ["held"], "params": {"k": 1}, "replica": "r", "hops": 1}
    call |= {"cache": "hot", "sent_ms": 0}
    held = app.send_task("gpufleet.run", args=[call], queue=GPU_QUEUE)
    lease = {"id": "l1", "replica": "r", "deadline_ms": 1, "epoch": 1}
    waiting = app.send_task(
        "gpufleet.infer", args=["m", "waiting"], queue=GPU_QUEUE, headers={LEASE_HEADER: lease}
    )
    _held_by_a_killed_worker(url, client, "gpu0@h1", GPU_QUEUE, 1)
    in_flight = json.dumps({"headers": {"id": "x", "task": "gpufleet.infer"}, "properties": {}})
    client.lpush(inflight(GPU_QUEUE, "gpu0@h1"), in_flight)  # it died as it took one more

    assert presence.sweep(client, lambda: {GPU_QUEUE}, _unanswered) == {"gpu0@h1": 2}
    assert [p["headers"]["id"] for p in _queued(client, GPU_QUEUE)] == [held.id, "x", waiting.id]
    assert client.llen(INTERNAL_QUEUE) == 0  # its GPU still holds a ledger lease: not yet

    assert presence.sweep(client, _nothing_live, _unanswered) == {"gpu0@h1": 3}
    routed = _queued(client, INTERNAL_QUEUE)  # the router's own queue: its headers hold
    assert [p["headers"]["id"] for p in routed] == [held.id, "x", waiting.id]
    assert [p["headers"]["task"] for p in routed] == ["gpufleet.infer"] * 3
    assert _args(routed[0]) == ["m", ["held"], {"k": 1}]
    assert routed[0]["headers"][HOPS_HEADER] == 1
    assert _args(routed[2]) == ["m", "waiting"]
    assert LEASE_HEADER not in routed[2]["headers"]
    assert all(p["properties"]["delivery_info"]["routing_key"] == INTERNAL_QUEUE for p in routed)
    assert client.llen(GPU_QUEUE) == 0
    assert client.llen(inflight(GPU_QUEUE, "gpu0@h1")) == 0


def test_a_call_sent_to_a_lost_gpu_worker_later_still_reaches_the_router(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    _held_by_a_killed_worker(url, client, "gpu0@h1", GPU_QUEUE, 0)
    assert presence.sweep(client, _nothing_live, _unanswered) == {}
    late = _sender(url).send_task("gpufleet.infer", args=["m", "late"], queue=GPU_QUEUE)

    assert presence.sweep(client, _nothing_live, _unanswered) == {"gpu0@h1": 1}
    assert [p["headers"]["id"] for p in _queued(client, INTERNAL_QUEUE)] == [late.id]


def test_a_worker_back_under_its_name_keeps_its_queue_and_gets_what_it_held_first(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    app = _sender(url)
    first = app.send_task("gpufleet.infer", args=["m", "first"], queue=GPU_QUEUE)
    second = app.send_task("gpufleet.infer", args=["m", "second"], queue=GPU_QUEUE)
    _held_by_a_killed_worker(url, client, "gpu0@h1", GPU_QUEUE, 1)

    back = presence.Presence(client, "gpu0@h1", "gpu", [GPU_QUEUE], 60_000)
    assert back.arrive() == 1
    assert presence.sweep(client, _nothing_live, _unanswered) == {}
    assert [p["headers"]["id"] for p in _queued(client, GPU_QUEUE)] == [first.id, second.id]
    assert client.llen(INTERNAL_QUEUE) == 0
    assert presence.records(client)["gpu0@h1"].alive(presence.now_ms(client))


def test_a_call_whose_answer_is_stored_is_dropped_not_run_again(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    app = _sender(url)
    done = app.send_task("gpufleet.infer", args=["m", "done"])
    open_call = app.send_task("gpufleet.infer", args=["m", "open"])
    _held_by_a_killed_worker(url, client, "router@h1", ROUTER_QUEUE, 2)

    assert presence.sweep(client, _nothing_live, lambda task: task == done.id) == {"router@h1": 1}
    assert [p["headers"]["id"] for p in _queued(client, ROUTER_QUEUE)] == [open_call.id]
    assert client.hlen("unacked") == 0


def test_a_worker_found_silent_that_comes_back_records_itself_again(
    broker: tuple[str, redis.Redis],
) -> None:
    _, client = broker
    worker = _arrived(client, lapsed=True)
    presence.sweep(client, _nothing_live, _unanswered)
    assert not worker._renewed(leaving=False)  # a sweep marked it gone: not its record now

    worker._rejoin()

    assert worker._renewed(leaving=False)
    assert presence.records(client)["router@h1"].alive(presence.now_ms(client))
    assert client.hexists(CONSUMERS, "router@h1")


def test_a_dead_workers_request_leases_are_ended_once_as_a_sweep_finds_it_dead(
    broker: tuple[str, redis.Redis],
) -> None:
    _, client = broker
    worker = _arrived(client)
    released: list[str] = []

    def release(token: str) -> int:
        released.append(token)
        return 1

    presence.sweep(client, _nothing_live, _unanswered, release)
    assert released == []  # alive: its leases are its own
    time.sleep(LEASE_MS / 1000 + 0.1)
    presence.sweep(client, _nothing_live, _unanswered, release)
    presence.sweep(client, _nothing_live, _unanswered, release)
    assert released == [worker.token]


def test_a_worker_that_renews_as_a_sweep_finds_it_silent_keeps_its_leases(
    broker: tuple[str, redis.Redis],
) -> None:
    _, client = broker
    worker = _arrived(client, lapsed=True)
    released: list[str] = []

    def renewed_meanwhile() -> set[str]:  # the sweep reads the ledger after the records
        assert worker._renewed(leaving=False)
        return set()

    presence.sweep(client, renewed_meanwhile, _unanswered, lambda t: released.append(t) or 1)

    assert released == []
    assert presence.records(client)["router@h1"].alive(presence.now_ms(client))


def test_a_worker_that_stopped_on_its_own_keeps_the_leases_of_the_calls_it_sent(
    broker: tuple[str, redis.Redis],
) -> None:
    _, client = broker
    worker = _arrived(client, 60_000)
    worker.leave()  # a warm shutdown: its pool finished and sent what it took
    released: list[str] = []

    presence.sweep(client, _nothing_live, _unanswered, lambda t: released.append(t) or 1)
    assert presence.records(client)["router@h1"].gone_ms > 0  # swept, as before
    presence.Presence(client, "router@h1", "router", [ROUTER_QUEUE], 60_000).arrive(
        lambda t: released.append(t) or 1
    )

    assert released == []


def test_a_worker_back_under_its_name_ends_the_leases_its_predecessor_took(
    broker: tuple[str, redis.Redis],
) -> None:
    _, client = broker
    first = _arrived(client, 60_000)  # then killed: the launcher starts the next under its name
    released: list[str] = []
    second = presence.Presence(client, "router@h1", "router", [ROUTER_QUEUE], 60_000)

    second.arrive(lambda token: released.append(token) or 0)

    assert released == [first.token] and first.token != second.token
    assert presence.records(client)["router@h1"].token == second.token


def test_a_release_that_fails_neither_fails_the_sweep_nor_keeps_the_calls(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    sent = _sender(url).send_task("gpufleet.infer", args=["m", "held"])
    _held_by_a_killed_worker(url, client, "router@h1", ROUTER_QUEUE, 1)

    def unreachable(_token: str) -> int:
        raise redis.ConnectionError("the registry is down")

    assert presence.sweep(client, _nothing_live, _unanswered, unreachable) == {"router@h1": 1}
    assert [p["headers"]["id"] for p in _queued(client, ROUTER_QUEUE)] == [sent.id]


def test_status_counts_per_queue_the_calls_no_live_worker_will_take(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    for i in range(3):
        _sender(url).send_task("gpufleet.infer", args=["m", f"call {i}"])
    _sender(url).send_task("gpufleet.infer", args=["m", "gpu"], queue=GPU_QUEUE)
    _held_by_a_killed_worker(url, client, "router@h1", ROUTER_QUEUE, 2)

    found = presence.stranded(client, [GPU_QUEUE])
    assert found == {
        ROUTER_QUEUE: {"calls": 3, "last_worker": "router@h1"},
        GPU_QUEUE: {"calls": 1, "last_worker": None},
    }
    problems = presence.stranded_problems(found)
    assert problems[0].startswith("3 call(s) wait on celery, which no live worker takes")
    assert "start a router" in problems[0]

    presence.Presence(client, "router@h2", "router", [ROUTER_QUEUE], 60_000).arrive()
    assert presence.stranded(client, [])[ROUTER_QUEUE]["calls"] == 2  # what the dead one held
    presence.sweep(client, _nothing_live, _unanswered)
    assert ROUTER_QUEUE not in presence.stranded(client, [])


def test_a_call_given_back_is_on_its_way_while_another_message_of_it_waits_or_is_held(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    app = _sender(url)
    routed = app.send_task("gpufleet.infer", args=["m", "routed"])
    _held_by_a_killed_worker(url, client, "router@h1", ROUTER_QUEUE, 1)
    own_tag = next(iter(client.hkeys("unacked"))).decode()
    assert not presence.on_its_way(client, routed.id, own_tag, [GPU_QUEUE])

    handed_on = {"model": "m", "inputs": "routed", "params": None, "replica": "r"}
    app.send_task("gpufleet.run", args=[handed_on], queue=GPU_QUEUE, task_id=routed.id)
    assert presence.on_its_way(client, routed.id, own_tag, [GPU_QUEUE])
    assert not presence.on_its_way(client, "another-call", own_tag, [GPU_QUEUE])


def test_of_two_given_back_copies_of_one_call_exactly_one_goes_on(
    broker: tuple[str, redis.Redis],
) -> None:
    url, client = broker
    app = _sender(url)
    call = app.send_task("gpufleet.infer", args=["m", "x"], queue=GPU_QUEUE)
    app.send_task("gpufleet.infer", args=["m", "x"], queue=GPU_QUEUE, task_id=call.id)
    _held_by_a_killed_worker(url, client, "gpu0@h1", GPU_QUEUE, 0)
    presence.sweep(client, _nothing_live, _unanswered)  # both to the router, given back

    tags = [p["properties"]["delivery_tag"] for p in _queued(client, INTERNAL_QUEUE)]
    assert len(set(tags)) == 2
    yields = [presence.on_its_way(client, call.id, tag, [GPU_QUEUE]) for tag in tags]
    assert sorted(yields) == [False, True]


def test_a_given_back_call_moved_on_by_a_router_is_the_copy_its_given_back_twin_yields_to() -> None:
    # A host lost with a router and a GPU worker leaves two given-back copies of call X:
    # M on `celery` and M2 on the router's queue. M's tag sorts first, so M goes on, and a
    # router moves it to a GPU worker's queue under a new tag; M2 must yield to that copy.
    first, second = (f"00000000-0000-4000-8000-00000000000{n}" for n in (1, 2))
    gpu_queue = "gpufleet.h.gpu0"

    def given_back(tag: str, queue: str) -> str:
        payload = {
            "body": "W10=", "content-encoding": "utf-8", "content-type": "application/json",
            "headers": {"id": "X", "task": "gpufleet.infer"},
            "properties": {"delivery_tag": tag, "body_encoding": "base64", "priority": 0,
                           "delivery_info": {"exchange": "", "routing_key": queue}},
        }  # fmt: skip
        mark_redelivered(payload)
        return json.dumps(payload)

    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        client.lpush("celery", given_back(first, "celery"))
        client.lpush(ROUTER_QUEUE, given_back(second, ROUTER_QUEUE))
        assert not presence.on_its_way(client, "X", first)  # M sorts first: it goes on
        with Connection(
            server.url, transport=Transport, transport_options={"consumer_name": "router@r"}
        ) as conn:
            conn.default_channel.divert = lambda m: Onward(gpu_queue, dict(m.headers), lambda: None)
            with conn.Consumer(Queue("celery"), callbacks=[lambda _b, _m: None]):
                conn.drain_events(timeout=5)
        (moved,) = _queued(client, gpu_queue)
        assert "redelivered" not in moved["headers"]
        assert presence.on_its_way(client, "X", second, queues=[gpu_queue])
        client.close()


def test_a_sweeper_that_could_not_reach_redis_judges_silence_only_a_lease_after_it_answers() -> (
    None
):
    hearing = presence.Hearing(lease_s=15.0)
    assert hearing.heard(100.0)  # a router that always heard Redis sweeps at once
    hearing.lost()  # an outage: every live worker's renewals failed as this sweep did
    assert not hearing.heard(130.0)  # Redis answers again: workers renew within a lease
    assert not hearing.heard(144.9)
    assert hearing.heard(145.0)
    hearing.lost()
    hearing.lost()  # still out: the lease counts from the first answer after it
    assert not hearing.heard(200.0)
    assert hearing.heard(215.0)
