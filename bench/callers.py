"""One caller's attacks on the others: what other callers' calls wait meanwhile.

    python -m bench.callers [--calls 3000] [--connections 10100] > bench/out/callers.json

Prints one JSON object. It starts `gpufleet up` (its bundled Redis, one simulated 8 GiB
GPU, so every model shares one worker) with a catalog of two small generation models, an
encoder, a dedicated model and a model that fits only while the dedicated one is away.
The baseline, measured first in the same run: a plain Celery client's calls of the
encoder on a quiet fleet (`quiet`). Then each attack of the second hostile review (issue
55) runs in a process of its own, with the caller's URL, while this process times the
same encoder calls (`others`: p50, max and count, in seconds), and says what the attack
got:

- `chain`: a call for an unknown model whose 50,000-step chain names made-up ids (5 MiB):
  how soon it was refused, and how many of the chained ids got a result;
- `generations`: 3 calls of 64 prompts x 120 new tokens; meanwhile a call of the dedicated
  model, a 4-token call of the other generation model and one of the same model are timed
  too (`probes`);
- `twins`: 4 generation calls under one task id; the request leases left on the replica
  10 s later;
- `connections`: that many idle connections of the caller's user, opened and held; how
  `gpufleet status` and a new caller's call fared;
- `cancels`: that many `gpufleet.cancel` of made-up ids; how soon all were answered;
- `cancelled_retry`: a call the router retries (the dedicated model blocks it), then
  cancelled: how long it still counted in the model's load;
- `dedicated`: a caller's `deploy(encoder, 8, dedicated=True)`: refused, or how many
  dedicated replicas it placed;
- `stop`: junk in a list no router reads (`celery\\x01\\x023`), a call waiting, then the
  stop: what the waiting call got, and what the stop left behind.

Only the fleet's public interface is used (a plain Celery client, redis-py, the CLI, the
connection file), so the same file measures an earlier tree of gpufleet as well.
"""

from __future__ import annotations

import argparse
import base64
import json
import os
import resource
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import redis
from celery import Celery
from celery.result import AsyncResult

SMALL = "{model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 64, vocab_size: 512, n_positions: 256}"
CATALOG = f"""
models:
  talker: {{source: synthetic, task: text-generation, memory: 64MiB, config: {SMALL}}}
  chatter: {{source: synthetic, task: text-generation, memory: 64MiB, config: {SMALL}}}
  encoder: {{source: synthetic, task: forward, memory: 128MiB}}
  pinned: {{source: synthetic, task: forward, memory: 1GiB, dedicated: true}}
  big: {{source: synthetic, task: forward, memory: {{request: 6GiB, limit: 6GiB}}}}
"""
TIMEOUT_S = 120.0


def client(url: str) -> Celery:
    app = Celery(broker=url, backend=url)
    app.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json")
    return app


def call(app: Celery, model: str, inputs: Any, params: Any = None) -> Any:
    return app.send_task("gpufleet.infer", args=(model, inputs, params)).get(timeout=TIMEOUT_S)


def latencies(samples: list[float]) -> dict[str, Any]:
    if not samples:
        return {"n": 0}
    return {
        "n": len(samples),
        "p50_s": round(statistics.median(samples), 4),
        "max_s": round(max(samples), 4),
    }


def timed(work: Callable[[], Any]) -> float:
    started = time.monotonic()
    work()
    return round(time.monotonic() - started, 4)


# --- the attacks, each in a process of its own -------------------------------------------


def raw_call(task: str, args: list[Any], task_id: str, chain: list[Any]) -> bytes:
    """A Celery message (protocol 2) as a client writes it, with `chain` after it."""
    body = json.dumps([args, {}, {"callbacks": None, "errbacks": None, "chord": None,
                                  "chain": chain}])  # fmt: skip
    return json.dumps(
        {
            "body": base64.b64encode(body.encode()).decode(),
            "content-encoding": "utf-8",
            "content-type": "application/json",
            "headers": {"lang": "py", "task": task, "id": task_id},
            "properties": {"delivery_tag": uuid.uuid4().hex, "body_encoding": "base64"},
        }
    ).encode()


def step(task_id: str) -> dict[str, Any]:
    """One step of a chain, naming `task_id` (what Celery reads of one, and no more)."""
    return {"task": "gpufleet.status", "options": {"task_id": task_id}}


def attack_chain(url: str, fleet_url: str, _: argparse.Namespace) -> dict[str, Any]:
    chained = [uuid.uuid4().hex for _ in range(50_000)]
    steps = [step(i) for i in chained]
    refused = uuid.uuid4().hex
    message = raw_call("gpufleet.infer", ["no-such-model", "x"], refused, steps)
    started = time.monotonic()
    redis.Redis.from_url(url).lpush("celery", message)
    try:
        AsyncResult(refused, app=client(url)).get(timeout=TIMEOUT_S)
        error = "answered"
    except Exception as exc:
        error = type(exc).__name__
    took = time.monotonic() - started
    time.sleep(1.0)
    inside = redis.Redis.from_url(fleet_url)
    written = sum(inside.exists(*[f"celery-task-meta-{i}" for i in chained[k : k + 5000]])
                  for k in range(0, len(chained), 5000))  # fmt: skip
    return {"bytes": len(message), "refused_with": error, "refused_in_s": round(took, 3),
            "chained_results_written": written}  # fmt: skip


def attack_generations(url: str, _: str, __: argparse.Namespace) -> dict[str, Any]:
    app = client(url)
    prompts = [f"prompt {i}" for i in range(64)]
    started = time.monotonic()
    calls = [app.send_task("gpufleet.infer", args=("talker", prompts, {"max_new_tokens": 120}))
             for _ in range(3)]  # fmt: skip
    for each in calls:
        each.get(timeout=600)
    return {"attack_s": round(time.monotonic() - started, 3)}


def attack_twins(url: str, fleet_url: str, _: argparse.Namespace) -> dict[str, Any]:
    from placement.ledger.registry import Registry

    app, shared = client(url), uuid.uuid4().hex
    for _ in range(4):
        app.send_task("gpufleet.infer", args=("talker", "again", {"max_new_tokens": 30}),
                      task_id=shared)  # fmt: skip
    AsyncResult(shared, app=app).get(timeout=TIMEOUT_S)
    time.sleep(10)
    registry = Registry.from_url(fleet_url, "default")
    leases = sum(
        (registry.deployment(d.replica) or d).leases for d in registry.snapshot().replicas("talker")
    )
    return {"leases_left_after_10_s": leases}


def attack_connections(url: str, _: str, args: argparse.Namespace) -> dict[str, Any]:
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    port = int(url.rsplit(":", 1)[1].split("/", maxsplit=1)[0])
    password = url.split("caller:", 1)[1].split("@", 1)[0]
    auth = f"*3\r\n$4\r\nAUTH\r\n$6\r\ncaller\r\n${len(password)}\r\n{password}\r\n".encode()
    opened, refused = [], 0
    started = time.monotonic()
    for _ in range(min(args.connections, hard - 200)):
        try:
            sock = socket.create_connection(("127.0.0.1", port), timeout=5)
            sock.sendall(auth)
            opened.append(sock)
        except OSError:
            refused += 1
    took = time.monotonic() - started
    time.sleep(args.hold)
    for sock in opened:
        sock.close()
    return {"opened": len(opened), "refused": refused, "opened_in_s": round(took, 3)}


def attack_cancels(url: str, _: str, args: argparse.Namespace) -> dict[str, Any]:
    app = client(url)
    started = time.monotonic()
    cancels = [app.send_task("gpufleet.cancel", args=(uuid.uuid4().hex,))
               for _ in range(args.calls)]  # fmt: skip
    sent = time.monotonic() - started
    for each in cancels:
        each.get(timeout=TIMEOUT_S)
    return {"sent_in_s": round(sent, 3), "answered_in_s": round(time.monotonic() - started, 3)}


ATTACKS = {
    "chain": attack_chain,
    "generations": attack_generations,
    "twins": attack_twins,
    "connections": attack_connections,
    "cancels": attack_cancels,
}


# --- this process: the fleet, the other callers, the rest ---------------------------------


class Fleet:
    def __init__(self, home: Path, catalog: Path) -> None:
        self.home = home
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
        self.env["GPUFLEET_HOME"] = str(home)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tasks.operator.cli", "up", "--models", str(catalog),
             "--sim-gpus", "1x8GiB", "--metrics-port", "0"],
            env=self.env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if "Ctrl-C stops" in line:
                break
        known = json.loads((home / "default" / "connection.json").read_text())
        self.url, self.fleet_url = known["redis_url"], known.get("fleet_url") or known["redis_url"]

    def cli(self, *args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "tasks.operator.cli", *args]
        return subprocess.run(
            command, env=self.env, capture_output=True, text=True, timeout=TIMEOUT_S, check=False
        )


def during(attack: str, fleet: Fleet, args: argparse.Namespace,
           probes: dict[str, Callable[[], Any]] | None = None) -> dict[str, Any]:  # fmt: skip
    """Run `attack` in a process of its own; time the other callers' calls meanwhile."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "bench.callers", "--attack", attack, "--url", fleet.url,
         "--fleet-url", fleet.fleet_url, "--calls", str(args.calls),
         "--connections", str(args.connections), "--hold", str(args.hold)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    others, app, probed = [], client(fleet.url), {}
    time.sleep(0.5)
    while proc.poll() is None:
        for what, probe in list((probes or {}).items()):
            probed[what] = timed(probe)
            del probes[what]  # type: ignore[union-attr]
        try:
            others.append(timed(lambda: call(app, "encoder", "another caller")))
        except Exception as exc:
            probed.setdefault("errors", []).append(type(exc).__name__)
            time.sleep(0.1)
    out, _ = proc.communicate()
    return {"attack": json.loads(out), "others": latencies(others), **probed}


def run(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="bench-callers-"))
    catalog = home / "models.yaml"
    catalog.write_text(CATALOG)
    fleet = Fleet(home, catalog)
    app = client(fleet.url)
    result: dict[str, Any] = {}
    try:
        for model in ("talker", "chatter", "encoder", "pinned"):
            call(app, model, "warm")
        result["quiet"] = latencies([timed(lambda: call(app, "encoder", "q")) for _ in range(30)])
        result["chain"] = during("chain", fleet, args)
        result["generations"] = during("generations", fleet, args, probes={
            "pinned_s": lambda: call(app, "pinned", "a short call"),
            "other_generation_model_s": lambda: call(app, "chatter", "hi", {"max_new_tokens": 4}),
            "same_model_short_call_s": lambda: call(app, "talker", "hi", {"max_new_tokens": 4}),
        })  # fmt: skip
        result["twins"] = during("twins", fleet, args)
        status: dict[str, Any] = {}

        def flooded() -> None:
            time.sleep(args.hold / 2)
            shown = fleet.cli("status", "--json")
            status["status_ok"] = shown.returncode == 0
            try:
                status["new_caller_s"] = timed(lambda: call(client(fleet.url), "encoder", "new"))
            except Exception as exc:
                status["new_caller"] = type(exc).__name__

        side = threading.Thread(target=flooded)
        side.start()
        result["connections"] = during("connections", fleet, args) | status
        side.join()
        result["cancels"] = during("cancels", fleet, args)
        result["cancelled_retry"] = cancelled_retry(fleet, app)
        result["dedicated"] = dedicated(fleet, app)
        result["stop"] = stop(fleet, app)
    finally:
        if fleet.proc.poll() is None:
            fleet.proc.send_signal(signal.SIGTERM)
            fleet.proc.wait(timeout=120)
        shutil.rmtree(home, ignore_errors=True)
    return result


def cancelled_retry(fleet: Fleet, app: Celery) -> dict[str, Any]:
    from placement.ledger.keys import Keys

    inside = redis.Redis.from_url(fleet.fleet_url)
    key = Keys("default").model_routing("big")
    app.send_task("gpufleet.deploy", args=("pinned",)).get(timeout=TIMEOUT_S)
    blocked = app.send_task("gpufleet.infer", args=("big", "x"))
    deadline = time.monotonic() + 15
    while not inside.zcard(key) and time.monotonic() < deadline:
        time.sleep(0.05)
    app.send_task("gpufleet.cancel", args=(blocked.id,)).get(timeout=TIMEOUT_S)
    cancelled = time.monotonic()
    while inside.zcard(key) and time.monotonic() - cancelled < 300:
        time.sleep(0.1)
    counted = round(time.monotonic() - cancelled, 2)
    app.send_task("gpufleet.evict", args=("pinned",)).get(timeout=TIMEOUT_S)
    return {"held_routing_after_cancel_s": counted, "key": key}


def dedicated(fleet: Fleet, app: Celery) -> dict[str, Any]:
    try:
        answer = app.send_task("gpufleet.deploy", args=("encoder", 8, True)).get(timeout=TIMEOUT_S)
        placed = sum(r["dedicated"] for r in answer["replicas"])
        outcome: dict[str, Any] = {"refused": False, "dedicated_replicas": placed}
    except Exception as exc:
        outcome = {"refused": type(exc).__name__}
    app.send_task("gpufleet.evict", args=("encoder",)).get(timeout=TIMEOUT_S)
    return outcome


def stop(fleet: Fleet, app: Celery) -> dict[str, Any]:
    junk = "celery\x01\x023"
    try:
        redis.Redis.from_url(fleet.url).lpush(junk, b"\xff not json")
        pushed_by = "caller"
    except redis.exceptions.NoPermissionError:
        redis.Redis.from_url(fleet.fleet_url).lpush(junk, b"\xff not json")
        pushed_by = "fleet (the caller may not)"
    app.send_task("gpufleet.deploy", args=("pinned",)).get(timeout=TIMEOUT_S)
    waiting = app.send_task("gpufleet.infer", args=("big", "x"))
    time.sleep(2)
    fleet.proc.send_signal(signal.SIGTERM)
    try:
        waiting.get(timeout=60)
        got = "answered"
    except Exception as exc:
        got = f"{type(exc).__name__}: {str(exc)[:80]}"
    fleet.proc.wait(timeout=120)
    left = (
        [p.name for p in (fleet.home / "default").glob("*")]
        if (fleet.home / "default").exists()
        else []
    )
    return {"junk_pushed_by": pushed_by, "waiting_call_got": got, "left_behind": left}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=3000, help="cancels of the storm")
    parser.add_argument("--connections", type=int, default=10_100, help="idle connections")
    parser.add_argument("--hold", type=float, default=6.0, help="seconds they are held")
    parser.add_argument("--attack", choices=sorted(ATTACKS), help=argparse.SUPPRESS)
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--fleet-url", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if args.attack:
        print(json.dumps(ATTACKS[args.attack](args.url, args.fleet_url, args)))
        return
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
