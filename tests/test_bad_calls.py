"""End to end: every bad call gets a clear, short error, and the fleet keeps serving.

Each call goes through a plain Celery client (nothing of gpufleet imported on its side) to
a real `gpufleet up`. For every case: the error's type, a message under 500 characters
that says what to do, and a normal call that succeeds right after.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from celery import Celery, chain, chord, group
from kombu import Connection, Exchange, Producer

from tests.running import RunningFleet, fleet_env, fleet_up

pytestmark = pytest.mark.slow

CATALOG = """
models:
  a: {source: synthetic, task: forward, memory: 256MiB}
  big: {source: synthetic, task: forward, memory: 1GiB, max_replicas: 4}
  huge: {source: synthetic, task: forward, memory: 20GiB}
"""
ANSWER_S = 30.0


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    catalog = tmp_path_factory.mktemp("bad") / "models.yaml"
    catalog.write_text(CATALOG)
    with fleet_up(catalog, ["--sim-gpus", "1x4GiB", "--metrics-port", "0"], fleet_env()) as f:
        yield f


def client(fleet: RunningFleet) -> Celery:
    app = Celery(broker=fleet.url, backend=fleet.url)
    app.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json")
    return app


CASES: list[tuple[str, str, tuple[Any, ...], dict[str, Any], str, str]] = [
    # (id, task, args, kwargs, error type, a phrase of the message)
    ("unknown model", "gpufleet.infer", ("llama", "x"), {}, "UnknownModelError", "it serves: a"),
    ("a 1 MB model name", "gpufleet.infer", ("m" * 2**20, "x"), {}, "UnknownModelError", "..."),
    ("a model that is no name", "gpufleet.infer", ({"x": 1}, "x"), {}, "PayloadError", "string"),
    ("a bad payload", "gpufleet.infer", ("a", {"not": "text"}), {}, "PayloadError", "string"),
    ("a missing argument", "gpufleet.infer", ("a",), {}, "PayloadError", "inputs"),
    ("an extra argument", "gpufleet.infer", ("a", "x", None, 5), {}, "PayloadError", "takes"),
    ("an internal argument", "gpufleet.infer", ("a", "x"), {"_hops": 9}, "PayloadError", "_hops"),
    ("a model that never fits", "gpufleet.infer", ("huge", "x"), {}, "NeverFitsError", "largest"),
    ("no replicas", "gpufleet.deploy", ("a", 0), {}, "PayloadError", "from 1 to 8"),
    ("negative replicas", "gpufleet.deploy", ("a", -1), {}, "PayloadError", "from 1 to 8"),
    ("replicas as text", "gpufleet.deploy", ("a", "3"), {}, "PayloadError", "'3' (str)"),
    ("half a replica", "gpufleet.deploy", ("a", 1.5), {}, "PayloadError", "1.5 (float)"),
    ("a billion replicas", "gpufleet.deploy", ("big", 10**9), {}, "PayloadError", "from 1 to 4"),
    ("dedicated as text", "gpufleet.deploy", ("a", 1, "yes"), {}, "PayloadError", "true, false"),
    ("deploy, no model", "gpufleet.deploy", (), {}, "PayloadError", "model"),
    ("an unknown replica", "gpufleet.evict", ("a", "nope"), {}, "UnknownReplicaError", "nope"),
    ("a replica that is no id", "gpufleet.evict", ("a", 7), {}, "PayloadError", "replica"),
]


@pytest.mark.parametrize("case", CASES, ids=[case[0] for case in CASES])
def test_a_bad_call_gets_its_error_type_and_a_short_message_and_the_fleet_serves_on(
    fleet: RunningFleet, case: tuple[str, str, tuple[Any, ...], dict[str, Any], str, str]
) -> None:
    _, task, args, kwargs, kind, says = case
    app = client(fleet)
    started = time.monotonic()
    with pytest.raises(Exception) as err:
        app.send_task(task, args=args, kwargs=kwargs).get(timeout=ANSWER_S)
    assert type(err.value).__name__ == kind, str(err.value)[:500]
    message = str(err.value)
    assert len(message) < 500, message[:600]
    assert says in message
    assert time.monotonic() - started < ANSWER_S
    assert app.send_task("gpufleet.infer", args=("a", "fine")).get(timeout=60)["model"] == "a"


def test_a_deploy_past_the_room_says_what_it_placed_and_what_is_missing(
    fleet: RunningFleet,
) -> None:
    app = client(fleet)
    answer = app.send_task("gpufleet.deploy", args=("big", 4)).get(timeout=60)
    placed = [r for r in answer["replicas"] if r["level"] != "WARM"]
    assert 1 <= len(placed) < 4  # a 3 GiB slot each, on one 4 GiB GPU
    assert answer["missing"] == 4 - len(placed)
    assert "CantAccommodateError" in answer["refused"]
    app.send_task("gpufleet.evict", args=("big",)).get(timeout=60)


def test_a_pickled_call_fails_at_once_instead_of_leaving_its_caller_waiting(
    fleet: RunningFleet,
) -> None:
    app = client(fleet)
    app.conf.accept_content = ["json", "pickle"]
    started = time.monotonic()
    with pytest.raises(Exception) as err:
        app.send_task("gpufleet.infer", args=("a", "x"), serializer="pickle").get(timeout=ANSWER_S)
    assert type(err.value).__name__ == "PayloadError"
    assert "JSON only" in str(err.value)
    assert time.monotonic() - started < 10
    assert app.send_task("gpufleet.infer", args=("a", "after")).get(timeout=60)["model"] == "a"


def test_a_call_whose_json_is_broken_fails_at_once(fleet: RunningFleet) -> None:
    app = client(fleet)
    task_id = str(uuid.uuid4())
    with Connection(fleet.url) as conn:
        Producer(conn).publish(
            b"{this is not json",
            exchange=Exchange("celery", type="direct"),
            routing_key="celery",
            content_type="application/json",
            content_encoding="utf-8",
            serializer=None,
            headers={"id": task_id, "task": "gpufleet.infer", "lang": "py"},
        )
    with pytest.raises(Exception) as err:
        app.AsyncResult(task_id).get(timeout=ANSWER_S)
    assert type(err.value).__name__ == "PayloadError"
    assert "JSON only" in str(err.value)


# Celery built-ins every Celery app registers, and a name no one registered.
FORGED = ["celery.backend_cleanup", "celery.chord_unlock", "celery.map", "no.such.task"]


def test_a_forged_celery_builtin_task_gets_a_stored_error_and_the_fleet_keeps_serving(
    fleet: RunningFleet,
) -> None:
    """Only `gpufleet.*` tasks run, on the router and on a GPU worker alike (a GPU queue
    takes only what the fleet's own user sends, but it refuses the rest too)."""
    app = client(fleet)
    # A call of `a` puts a replica on the GPU worker, whose queue the ledger then names.
    assert app.send_task("gpufleet.infer", args=("a", "before")).get(timeout=60)["model"] == "a"
    gpu_queues = {d.queue for d in fleet.registry.snapshot().replicas("a") if d.queue}
    assert len(gpu_queues) == 1, gpu_queues
    inside = Celery(broker=fleet.fleet_url, backend=fleet.fleet_url)  # only it writes GPU queues
    sent = [(app, name, "celery") for name in FORGED]
    sent += [(inside, "celery.backend_cleanup", gpu_queues.pop())]
    for sender, name, queue in sent:
        started = time.monotonic()
        with pytest.raises(Exception) as err:
            sender.send_task(name, args=(), queue=queue).get(timeout=ANSWER_S)
        message = str(err.value)
        assert type(err.value).__name__ == "PayloadError", (name, queue, message[:500])
        assert f"{name!r} is not one of them" in message
        assert "gpufleet.infer" in message
        assert len(message) < 500, message[:600]
        assert time.monotonic() - started < 10, (name, queue)
    assert app.send_task("gpufleet.infer", args=("a", "after")).get(timeout=60)["model"] == "a"


def test_a_clients_group_chain_and_chord_of_gpufleet_tasks_need_no_celery_builtin(
    fleet: RunningFleet,
) -> None:
    """Canvas is the client's: it sends the member tasks, and the Redis backend's chord
    sends its body from the worker that ends the header (no `celery.chord_unlock`)."""
    app = client(fleet)
    infer = [app.signature("gpufleet.infer", args=("a", f"x{i}")) for i in range(2)]
    status = app.signature("gpufleet.status", immutable=True)
    assert [r["model"] for r in group(infer).apply_async().get(timeout=60)] == ["a", "a"]
    assert "gpus" in chain(infer[0], status).apply_async().get(timeout=60)
    assert "gpus" in chord(infer, status).apply_async().get(timeout=60)
