"""End to end: one caller holding the URL `gpufleet url` prints cannot answer, stall or
starve another caller's calls (issue 55, the second hostile review).

Each test reproduces one finding against a real `gpufleet up` (its bundled Redis, the
newest one found: Redis 7 with Debian's, one simulated GPU so that every model shares one
worker) and checks what must hold instead, timing the other callers' calls meanwhile.
The last test that uses the fleet stops it.
"""

from __future__ import annotations

import base64
import json
import resource
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import redis
from celery import Celery
from celery.exceptions import TimeoutError as NoAnswerError
from celery.result import AsyncResult

from bench.callers import raw_call, step
from placement.server.connections import CALLER_SHARE, max_clients
from tasks.broker.intake import MAX_CANVAS
from tasks.serving.cancelling import Cancels
from tests.running import REPO, RunningFleet, fleet_env, fleet_up, until

pytestmark = pytest.mark.slow

SMALL = "{model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 64, vocab_size: 512, n_positions: 256}"
CATALOG = f"""
models:
  talker:  # the long generations of the attacks
    source: synthetic
    task: text-generation
    memory: 64MiB
    config: {SMALL}
  chatter:  # another generation model on the same worker
    source: synthetic
    task: text-generation
    memory: 64MiB
    config: {SMALL}
  encoder:
    source: synthetic
    task: forward
    memory: 128MiB
  pinned:
    source: synthetic
    task: forward
    memory: 1GiB
    dedicated: true
  big:  # fits the GPU only while `pinned` is not there
    source: synthetic
    task: forward
    memory: {{request: 6GiB, limit: 6GiB}}
"""
ANSWER_S = 30.0
#: What "served within about one decode step" allows on this machine (the issue's figure).
SERVED_S = 2.0


def served_throughout(hot: list[float]) -> bool:
    """Whether another caller's calls went on during an attack: every one but the slowest
    within `SERVED_S`. An attack that queues calls behind it delays every call sent while
    its backlog lasts (a cancel storm's lasted seconds before issue 55), so two slow calls
    show it; one alone can be the 2-core machine's scheduler, shared with another test
    file's fleet (once in CI, one call of hundreds took 2.7 s)."""
    return len(hot) >= 2 and sorted(hot)[-2] < SERVED_S


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("callers-home")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory, home: Path) -> Iterator[RunningFleet]:
    catalog = tmp_path_factory.mktemp("callers") / "models.yaml"
    catalog.write_text(CATALOG)
    log = tmp_path_factory.mktemp("callers-log") / "fleet.log"
    args = ["--sim-gpus", "1x8GiB", "--metrics-port", "0"]
    with fleet_up(catalog, args, fleet_env(GPUFLEET_HOME=str(home)), log=log) as running:
        for model, inputs in [("talker", "hi"), ("chatter", "hi"), ("encoder", "hi")]:
            assert running.infer(model, inputs)["model"] == model
        yield running


def caller(fleet: RunningFleet) -> Celery:
    """A plain Celery client with the caller's URL."""
    app = Celery(broker=fleet.url, backend=fleet.url)
    app.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json")
    return app


def timed(call: Callable[[], Any]) -> float:
    """Seconds `call` took."""
    started = time.monotonic()
    call()
    return time.monotonic() - started


@contextmanager
def others_meanwhile(fleet: RunningFleet) -> Iterator[list[float]]:
    """Another caller's calls of the encoder, one after another, timed until the block ends."""
    times: list[float] = []
    done = threading.Event()

    def other_caller() -> None:
        while not done.is_set():
            times.append(timed(lambda: fleet.infer("encoder", "meanwhile", timeout=ANSWER_S)))

    thread = threading.Thread(target=other_caller)
    thread.start()
    try:
        yield times
    finally:
        done.set()
        thread.join()


# --- 1. a refusal answers the refused call's own id only --------------------------------


def test_a_refused_call_cannot_answer_the_call_its_chain_names(fleet: RunningFleet) -> None:
    app, client = caller(fleet), redis.Redis.from_url(fleet.url)
    victim = app.send_task("gpufleet.infer", args=("talker", "a story", {"max_new_tokens": 200}))
    forged = uuid.uuid4().hex
    client.lpush("celery", raw_call("gpufleet.infer", ["no-such-model", "x"], forged,
                                    [step(victim.id)]))  # fmt: skip
    with pytest.raises(Exception) as err:
        AsyncResult(forged, app=app).get(timeout=ANSWER_S)
    assert type(err.value).__name__ == "UnknownModelError"
    answer = victim.get(timeout=ANSWER_S)  # its own answer, not the forger's error
    assert answer["model"] == "talker" and len(answer["outputs"]["tokens"][0]) > 0


def test_a_chain_past_the_bound_is_refused_as_one_error_and_costs_the_router_little(
    fleet: RunningFleet,
) -> None:
    app, client = caller(fleet), redis.Redis.from_url(fleet.url)
    chained = [uuid.uuid4().hex for _ in range(50_000)]
    refused_id = uuid.uuid4().hex
    message = raw_call("gpufleet.infer", ["no-such-model", "x"], refused_id,
                       [step(i) for i in chained])  # fmt: skip
    assert 5 * 2**20 < len(message) < 8 * 2**20  # the review's call: 5.3 MiB
    with others_meanwhile(fleet) as hot:
        time.sleep(0.5)
        client.lpush("celery", message)
        with pytest.raises(Exception) as err:
            AsyncResult(refused_id, app=app).get(timeout=ANSWER_S)
        time.sleep(0.5)
    assert type(err.value).__name__ == "PayloadError"
    assert f"at most {MAX_CANVAS} calls" in str(err.value)
    inside = redis.Redis.from_url(fleet.fleet_url)
    written = inside.exists(*[f"celery-task-meta-{i}" for i in chained[:1000]])
    assert written == 0  # one result stored: the refused call's own
    assert served_throughout(hot), hot


def test_a_failing_chained_call_is_learnt_from_its_parent_by_a_plain_client(
    fleet: RunningFleet,
) -> None:
    """What leaving a chain's later ids unanswered costs a caller: nothing, as Celery's
    client re-raises a parent's error from the chain's last result."""
    app = caller(fleet)
    chained = app.signature("gpufleet.infer", args=("no-such-model", "x")) | app.signature(
        "gpufleet.status", immutable=True
    )
    with pytest.raises(Exception) as err:
        chained.apply_async().get(timeout=ANSWER_S)
    assert type(err.value).__name__ == "UnknownModelError"


# --- 2. long generations do not hold the worker's other models --------------------------


def test_other_models_calls_are_served_within_a_step_while_long_generations_run(
    fleet: RunningFleet,
) -> None:
    app = caller(fleet)
    prompts = [f"prompt {i}" for i in range(64)]
    began = time.monotonic()
    attack = [
        app.send_task("gpufleet.infer", args=("talker", prompts, {"max_new_tokens": 120}))
        for _ in range(3)
    ]
    until("the attack runs", lambda: fleet.registry.client.exists(_batch_key(fleet)) > 0, 30)
    probes = {
        "another model": lambda: fleet.infer("encoder", "a short call", timeout=ANSWER_S),
        "a dedicated model": lambda: fleet.infer("pinned", "a short call", timeout=ANSWER_S),
        "another generation model": lambda: app.send_task(
            "gpufleet.infer", args=("chatter", "hi", {"max_new_tokens": 4})
        ).get(timeout=ANSWER_S),
        "the same model, a short call": lambda: app.send_task(
            "gpufleet.infer", args=("talker", "hi", {"max_new_tokens": 4})
        ).get(timeout=ANSWER_S),
    }
    waited = {what: timed(probe) for what, probe in probes.items()}
    still_running = sum(not call.ready() for call in attack)
    for call in attack:
        outputs = call.get(timeout=120)["outputs"]
        assert len(outputs["tokens"]) == 64
    attack_s = time.monotonic() - began
    assert still_running >= 2, waited  # the probes ran during the attack
    # Within a step or so, not after the attack: a probe held behind it waited about the
    # attack's own time (105 s before issue 55); here 0.02-0.04 s against 5.4 s. The bound
    # scales with the machine's load as the attack does, where a fixed 2 s was crossed once
    # on a busy 2-core machine (2.003 s).
    assert all(seconds < attack_s / 3 for seconds in waited.values()), (waited, attack_s)
    fleet.client.send_task("gpufleet.evict", args=("pinned",)).get(timeout=ANSWER_S)


def _batch_key(fleet: RunningFleet) -> str:
    replica = fleet.registry.snapshot().replicas("talker")[0].replica
    return fleet.registry.keys.batch(replica)


# --- 3. a task id used twice holds no lease ----------------------------------------------


def test_a_task_id_used_for_four_calls_leaves_no_lease_and_the_replica_evicts(
    fleet: RunningFleet,
) -> None:
    app = caller(fleet)
    shared = uuid.uuid4().hex
    for _ in range(4):
        app.send_task("gpufleet.infer", args=("talker", "again", {"max_new_tokens": 30}),
                      task_id=shared)  # fmt: skip
    assert AsyncResult(shared, app=app).get(timeout=ANSWER_S)["model"] == "talker"
    (replica,) = [d.replica for d in fleet.registry.snapshot().replicas("talker")]

    def leases() -> int:
        held = fleet.registry.deployment(replica)
        return held.leases if held is not None else 0

    until("every lease of the four messages ended", lambda: leases() == 0, 10)
    load = app.send_task("gpufleet.status").get(timeout=ANSWER_S)["load"]["talker"]
    assert (load["waiting"], load["running"]) == (0, 0), load
    evicted = app.send_task("gpufleet.evict", args=("talker",)).get(timeout=ANSWER_S)
    assert [e["level"] for e in evicted["evicted"]] in (["WARM"], ["COLD"]), evicted
    assert fleet.infer("talker", "another caller")["model"] == "talker"


# --- 4. idle connections do not deny the fleet -------------------------------------------


def test_a_flood_of_idle_connections_leaves_the_fleet_and_its_operator_theirs(
    fleet: RunningFleet, home: Path
) -> None:
    limit = max_clients()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    port = int(fleet.url.rsplit(":", 1)[1].split("/")[0])
    password = fleet.url.split("caller:", 1)[1].split("@", 1)[0]
    auth = f"*3\r\n$4\r\nAUTH\r\n$6\r\ncaller\r\n${len(password)}\r\n{password}\r\n".encode()
    opened: list[socket.socket] = []
    try:
        for _ in range(min(limit + 100, hard - 500)):  # the review's 10,100 on Redis's default
            try:
                sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            except OSError:
                break  # refused: the server is full, or the guard closed it
            sock.sendall(auth)
            opened.append(sock)
        status = subprocess.run(
            [sys.executable, "-m", "tasks.operator.cli", "status", "--json"],
            cwd=REPO, env=fleet_env(GPUFLEET_HOME=str(home)), capture_output=True, text=True,
            timeout=60, check=False,
        )  # fmt: skip
        assert status.returncode == 0, status.stderr[-2000:]
        assert json.loads(status.stdout)["gpus"]
        newcomer = caller(fleet)  # connects after the flood: the flood makes room
        answer = newcomer.send_task("gpufleet.infer", args=("encoder", "a new caller"))
        assert answer.get(timeout=ANSWER_S)["model"] == "encoder"
        inside = redis.Redis.from_url(fleet.fleet_url)
        outsiders = [c for c in inside.client_list() if c["user"] not in ("fleet", "operator")]
        assert len(outsiders) <= CALLER_SHARE * limit + 200  # the guard's bound, and a look's
    finally:
        for sock in opened:
            sock.close()
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    after = fleet.client.send_task("gpufleet.infer", args=("encoder", "after the flood"))
    try:
        assert after.get(timeout=120)["model"] == "encoder"
    except NoAnswerError:  # say which side lost it (seen once, not since)
        inside = redis.Redis.from_url(fleet.operator_url or fleet.fleet_url)
        try:
            stored = bool(inside.exists(f"celery-task-meta-{after.id}"))
            lists = {k.decode(): inside.llen(k) for k in inside.scan_iter(_type="list")}
        except redis.RedisError as exc:
            stored, lists = None, {"unread": repr(exc)}
        pytest.fail(f"no answer after the flood: result stored {stored}, lists {lists}")


# --- 6. a storm of bogus cancels ---------------------------------------------------------


STORM_CANCELS = 3000
#: A plain Celery client's cancel storm: argv is the caller's URL and how many cancels;
#: it prints their answers as JSON.
CANCEL_STORM = """
import json, sys, uuid
from celery import Celery
app = Celery(broker=sys.argv[1], backend=sys.argv[1])
app.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json")
ids = [uuid.uuid4().hex for _ in range(int(sys.argv[2]))]
cancels = [app.send_task("gpufleet.cancel", args=(i,)) for i in ids]
print(json.dumps([c.get(timeout=60) for c in cancels]))
"""


def _heard(watcher: Any, quiet_s: float = 0.5) -> Iterator[Any]:
    """The messages `watcher` (a pub/sub) holds, until none comes for `quiet_s`. A message
    only part-way in when a read times out (redis-py raises TimeoutError then; it failed
    CI once on a busy machine) is read on at the next try."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            message = watcher.get_message(timeout=quiet_s)
        except redis.TimeoutError:
            continue
        if message is None:
            return
        yield message
    raise AssertionError("the remote-control channel did not fall quiet in 60 s")


def _cancel_storm(fleet: RunningFleet) -> tuple[list[Any], list[str], float, list[float]]:
    """A plain client's storm of cancels for made-up ids, from a process of its own (sent
    from this one, its 3,000 sends and reads held the interpreter lock the hot caller's
    thread times its calls under), while another caller calls the encoder: the storm's
    answers, the remote-control commands it caused, its seconds, and the hot calls' times."""
    watcher = redis.Redis.from_url(fleet.fleet_url).pubsub()
    watcher.psubscribe("*pidbox*")  # Celery's remote control: every revoke broadcast
    with others_meanwhile(fleet) as hot:
        started = time.monotonic()
        storm = subprocess.run(
            [sys.executable, "-c", CANCEL_STORM, fleet.url, str(STORM_CANCELS)],
            env=fleet_env(),
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        took = time.monotonic() - started
    assert storm.returncode == 0, storm.stderr[-2000:]
    commands: list[str] = []
    for message in _heard(watcher):
        if message["type"] == "pmessage":
            commands.append(
                json.loads(base64.b64decode(json.loads(message["data"])["body"]))["method"]
            )
    watcher.close()
    return json.loads(storm.stdout), commands, took, hot


def test_a_storm_of_cancels_for_made_up_ids_is_answered_in_bulk_and_hot_calls_go_on(
    fleet: RunningFleet,
) -> None:
    answers, commands, took, hot = _cancel_storm(fleet)
    assert answers == [True] * STORM_CANCELS  # none of them had ended: each was cancelled
    # One broadcast per flush (every 50 ms while cancels arrive), not one per cancel: how
    # many flushes the storm takes depends on the machine's speed (307 here with three
    # test files at a time), so the bound is a quarter of the cancels, not a time.
    assert 0 < commands.count("gpufleet_cancel") < STORM_CANCELS // 4, commands
    assert "revoke" not in commands  # which made every worker write each id's result
    if not served_throughout(hot):
        # A storm that queues hot calls behind it does so every time; calls slowed once
        # and not again were the machine's (twice in CI, with another test file's fleet
        # on the same 2 cores: 2.7 s, then 8.8 s of a storm with two calls over 2 s; not
        # in 16 runs on a development VM, alone, beside test files or beside four busy
        # loops, where the slowest took 0.14 s). So a second storm decides.
        first = (round(took, 1), sorted(hot)[-3:])
        _, _, took, hot = _cancel_storm(fleet)
        assert served_throughout(hot), (first, round(took, 1), sorted(hot)[-3:], len(hot))


# --- 7. a call cancelled while the router retries it -------------------------------------


def test_a_call_cancelled_while_the_router_retries_it_leaves_the_load_at_once(
    fleet: RunningFleet,
) -> None:
    app = caller(fleet)
    fleet.client.send_task("gpufleet.deploy", args=("pinned",)).get(timeout=ANSWER_S)
    blocked = app.send_task("gpufleet.infer", args=("big", "x"))  # the dedicated model blocks

    def routing() -> int:
        return int(fleet.registry.client.zcard(_routing_key(fleet)))

    until("the router holds the call", lambda: routing() == 1, 15)
    assert app.send_task("gpufleet.cancel", args=(blocked.id,)).get(timeout=ANSWER_S) is True
    until("the cancelled call left the load", lambda: routing() == 0, 5)
    assert blocked.state == "REVOKED"
    fleet.client.send_task("gpufleet.evict", args=("pinned",)).get(timeout=ANSWER_S)


# --- 8. only an operator overrides the catalog's `dedicated` -----------------------------


def test_a_caller_cannot_make_replicas_dedicated_and_an_operator_can(
    fleet: RunningFleet, home: Path
) -> None:
    app = caller(fleet)
    with pytest.raises(Exception) as err:
        app.send_task("gpufleet.deploy", args=("encoder", 8, True)).get(timeout=ANSWER_S)
    assert type(err.value).__name__ == "PayloadError"
    assert "operator" in str(err.value)
    assert not [d for d in fleet.registry.snapshot().replicas("encoder") if d.dedicated]
    app.send_task("gpufleet.evict", args=("encoder",)).get(timeout=ANSWER_S)  # placed anew below
    operator = subprocess.run(
        [sys.executable, "-m", "tasks.operator.cli", "deploy", "encoder", "--dedicated"],
        cwd=REPO, env=fleet_env(GPUFLEET_HOME=str(home)), capture_output=True, text=True,
        timeout=120, check=False,
    )  # fmt: skip
    assert operator.returncode == 0, operator.stderr[-2000:]
    assert [r["dedicated"] for r in json.loads(operator.stdout)["replicas"]] == [True]
    app.send_task("gpufleet.evict", args=("encoder",)).get(timeout=ANSWER_S)


# --- 5. junk in a list nobody reads, then the stop (last: it stops the fleet) ------------


def test_the_caller_may_push_only_to_lists_a_router_reads_and_the_stop_survives_any_item(
    fleet: RunningFleet, home: Path
) -> None:
    client = redis.Redis.from_url(fleet.url)
    with pytest.raises(redis.exceptions.NoPermissionError):
        client.lpush("celery\x01\x023", "not a call")  # the review's list: nobody reads it
    assert client.lpush("celery\x06\x169", "not a call either")  # a priority list: read
    inside = redis.Redis.from_url(fleet.fleet_url)
    until("the router took it", lambda: not inside.exists("celery\x06\x169"), 10)
    inside.lpush("celery\x01\x023", b"\xff not json")  # whatever is there at the stop
    app = caller(fleet)
    fleet.client.send_task("gpufleet.deploy", args=("pinned",)).get(timeout=ANSWER_S)
    waiting = app.send_task("gpufleet.infer", args=("big", "x"))  # the router retries it
    until("the router holds the call", lambda: inside.zcard(_routing_key(fleet)) == 1, 15)
    fleet.proc.send_signal(signal.SIGTERM)
    with pytest.raises(Exception) as err:
        waiting.get(timeout=60)
    assert type(err.value).__name__ == "FleetStoppedError", err.value
    assert fleet.proc.wait(timeout=60) == 0
    assert not (home / "default" / "connection.json").exists()
    assert not (home / "default" / "redis").exists()


def _routing_key(fleet: RunningFleet) -> str:
    return fleet.registry.keys.model_routing("big")


def test_the_routers_cancel_flush_is_made_anew_on_every_connection() -> None:
    """Celery cancels the timer entries a connection made when it fails; the flush, made
    with the consumer's strategies, must come back with them (it once did not)."""

    class Entry:
        def __init__(self) -> None:
            self.cancelled = False

        def cancel(self) -> None:
            self.cancelled = True

    made: list[Entry] = []

    class Timer:
        def call_repeatedly(self, seconds: float, fun: Any) -> Entry:
            made.append(Entry())
            return made[-1]

    cancels = Cancels(Celery(), lambda: None)
    cancels.install(Timer())
    cancels.install(Timer())  # the consumer reconnected
    assert [entry.cancelled for entry in made] == [True, False]
