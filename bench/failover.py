"""A fleet whose Redis is a primary, two replicas and three Sentinels, through failovers under load.

    python -m bench.failover [--runs 3] [--faults kill,stop] [--threads 8] > bench/out/failover.json

Prints one JSON object. It starts a Sentinel group as `--redis-ha` does
(`placement.server.sentinel`: down after 1 s, writes only with a replica following), then
`gpufleet up` on it with 2 simulated GPUs and a catalog of two encoders
and a small generation model. Callers, `--threads` in all, call one after another: half
are plain Celery clients configured from `gpufleet url --json`, half use the project's
client (`tasks.api.infer`). An event listener counts each call's `task-succeeded` events.

The baseline, in the same run: the same load for `--quiet` seconds with no fault (calls
per second, p50 and max latency). Then each fault, `--runs` times in turn: `kill` SIGKILLs
the primary, `stop` SIGSTOPs it for `--stop-s` seconds and lets it go. After each, the
stopped or killed node is started again (an empty server on its old port, which the
Sentinels turn into a replica of the new primary) and the run waits for a clean audit.

Per run and in all (and `whole_run`: every call, those sent between windows too): calls
sent in the run's window, lost (never answered, not even after the callers' 60 s; in
`whole_run`, `unheard` when the answer is stored but its caller never heard it), failed
(an error reached the caller), run twice (more than one `task-succeeded`; a lower bound:
events sent to a dead primary are lost), the time from the fault to the first answer of
a call sent after it, and to a clean audit
(`placement.ledger.audit`) once the new primary is named.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery

from placement.ledger import endpoint
from placement.ledger.audit import audit
from placement.ledger.registry import Registry
from placement.server.sentinel import SentinelGroup

CATALOG = """
models:
  a: {source: synthetic, task: forward, memory: 256MiB}
  b:
    source: synthetic
    task: forward
    memory: 256MiB
    config: {model_type: bert, hidden_size: 128, num_hidden_layers: 2, num_attention_heads: 2,
             intermediate_size: 512, vocab_size: 512, max_position_embeddings: 128}
  gen:
    source: synthetic
    task: text-generation
    memory: 128MiB
    config: {model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 64, vocab_size: 512, n_positions: 128}
"""
CALLS = (("a", ["one"], None), ("b", ["two"], None), ("gen", "hi", {"max_new_tokens": 4}))
TIMEOUT_S = 60.0
CLI = (sys.executable, "-m", "tasks.operator.cli")


class Load:
    """Callers that call one after another; every call's (sent, answered, task id, error)."""

    def __init__(self, plain: Celery, threads: int) -> None:
        from tasks.api import infer  # the project's client: imported once the URL is set

        self.calls: list[tuple[float, float | None, str, str]] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [
            threading.Thread(target=self._run, args=(i, plain, infer), daemon=True)
            for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def _run(self, i: int, plain: Celery, infer: Any) -> None:
        model, inputs, params = CALLS[i % len(CALLS)]
        while not self._stop.is_set():
            sent = time.time()
            if i % 2:
                result = infer.apply_async(args=(model, inputs, params))
            else:
                result = plain.send_task("gpufleet.infer", args=(model, inputs, params))
            try:
                result.get(timeout=TIMEOUT_S)
                row = (sent, time.time(), result.id, "")
            except Exception as exc:
                row = (sent, None, result.id, type(exc).__name__)
            with self._lock:
                self.calls.append(row)

    def between(self, start: float, end: float) -> list[tuple[float, float | None, str, str]]:
        with self._lock:
            return [c for c in self.calls if start <= c[0] < end]

    def stop(self) -> None:
        self._stop.set()
        for thread in self._threads:
            thread.join(TIMEOUT_S + 30)


class Runs:
    """How many `task-succeeded` events each task id got (the fleet's own client)."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self._stop = threading.Event()
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        from tasks.app import app

        while not self._stop.is_set():
            try:
                with app.connection_for_read() as conn:
                    receiver = app.events.Receiver(conn, handlers={"task-succeeded": self._seen})
                    while not self._stop.is_set():
                        try:
                            receiver.capture(limit=None, timeout=1.0, wakeup=False)
                        except TimeoutError:
                            continue
            except Exception:  # the primary went away: listen again on the next one
                time.sleep(0.5)

    def _seen(self, event: dict[str, Any]) -> None:
        self.count[event["uuid"]] += 1

    def stop(self) -> None:
        self._stop.set()


def figures(
    rows: list[tuple[float, float | None, str, str]], runs: Runs, stored: set[str] | None = None
) -> dict[str, Any]:
    """The figures of `rows`; with `stored` (the task ids whose answer Redis holds), a call
    the caller gave up on counts as unheard when its answer is there, else as lost."""
    answered = [done - sent for sent, done, _, _ in rows if done is not None]
    gave_up = [task_id for _, done, task_id, why in rows if done is None and why == "TimeoutError"]
    unheard = [t for t in gave_up if stored is not None and t in stored]
    return {
        "sent": len(rows),
        "lost": len(gave_up) - len(unheard),
        "unheard": len(unheard),
        "failed": sum(1 for _, done, _, why in rows if done is None and why != "TimeoutError"),
        "run_twice": sum(1 for _, _, task_id, _ in rows if runs.count[task_id] > 1),
        "p50_s": round(statistics.median(answered), 4) if answered else None,
        "max_s": round(max(answered), 4) if answered else None,
    }


def stored_answers(url: str, rows: list[tuple[float, float | None, str, str]]) -> set[str]:
    """The task ids among `rows` given up on whose answers the primary holds."""
    ids = [task_id for _, done, task_id, _ in rows if done is None]
    if not ids:
        return set()
    client = endpoint.connect(url)
    found = client.mget([f"celery-task-meta-{task_id}" for task_id in ids])
    client.close()
    return {task_id for task_id, meta in zip(ids, found, strict=True) if meta is not None}


def fault(group: SentinelGroup, kind: str, stop_s: float) -> tuple[float, int]:
    """Inject `kind` into the primary; when it happened, and the new primary's port (a
    stopped primary is let go `stop_s` after the fault, from a timer)."""
    old = group.primary_port()
    node = group.node(old)
    at = time.time()
    if kind == "kill":
        os.kill(node.pid, signal.SIGKILL)
        new = group.wait_failover(old)
        node.restart()  # empty, on its old port: the Sentinels make it a replica
    else:
        os.kill(node.pid, signal.SIGSTOP)
        new = group.wait_failover(old)
        threading.Timer(
            max(0.0, stop_s - (time.time() - at)), os.kill, (node.pid, signal.SIGCONT)
        ).start()
    return at, new


def clean_after(registry: Registry, since: float, limit_s: float = 120.0) -> float | None:
    """Seconds from `since` to the first clean audit, or None within `limit_s`."""
    while time.time() - since < limit_s:
        try:
            if not audit(registry.snapshot()):
                return round(time.time() - since, 2)
        except Exception:
            pass
        time.sleep(0.5)
    return None


def run(args: argparse.Namespace) -> dict[str, Any]:
    home = Path(tempfile.mkdtemp(prefix="bench-failover-"))
    catalog = home / "models.yaml"
    catalog.write_text(CATALOG)
    # As `gpufleet up --redis-ha` runs it: two replicas, a primary that needs one to write
    with SentinelGroup(password="bench-failover", replicas=2, min_replicas=1) as group:
        os.environ["GPUFLEET_REDIS_URL"] = group.url
        os.environ["GPUFLEET_HOME"] = str(home)
        env = {**os.environ}
        up = subprocess.Popen(
            [*CLI, "up", "--models", str(catalog), "--sim-gpus", "2x4GiB", "--metrics-port", "0"],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        assert up.stdout is not None
        for line in up.stdout:
            if "Ctrl-C stops" in line:
                break
        try:
            conf = json.loads(
                subprocess.run(
                    [*CLI, "url", "--json"], env=env, capture_output=True, text=True, check=True
                ).stdout
            )["celery"]
            plain = Celery(set_as_current=False)
            plain.conf.update(**conf)
            for model, inputs, params in CALLS:  # loaded before anything is timed
                plain.send_task("gpufleet.infer", args=(model, inputs, params)).get(TIMEOUT_S)
            registry = Registry.from_url(group.url, "default")
            runs = Runs()
            load = Load(plain, args.threads)
            began = time.time()
            time.sleep(args.quiet)
            out: dict[str, Any] = {"baseline": figures(load.between(began, time.time()), runs)}
            out["baseline"]["calls_per_s"] = round(out["baseline"]["sent"] / args.quiet, 1)
            per_run: list[dict[str, Any]] = []
            for kind in args.faults:
                for _ in range(args.runs):
                    at, new = fault(group, kind, args.stop_s)
                    clean = clean_after(registry, at)
                    # past a stopped primary's return, then `settle` more
                    time.sleep(max(0.0, at + args.stop_s - time.time()) + args.settle)
                    rows = load.between(at, time.time())
                    after = [done for sent, done, _, _ in rows if done is not None and sent >= at]
                    per_run.append(
                        {
                            "fault": kind,
                            **figures(rows, runs),
                            "first_new_answer_s": round(min(after) - at, 2) if after else None,
                            "clean_audit_s": clean,
                            "new_primary": new,
                        }
                    )
            load.stop()
            runs.stop()
            out["runs"] = per_run
            # every call of the run, those sent between windows included
            rows = load.between(0.0, time.time())
            out["whole_run"] = figures(rows, runs, stored_answers(group.url, rows))
            out["all"] = {
                kind: {
                    key: sum(r[key] for r in per_run if r["fault"] == kind)
                    for key in ("sent", "lost", "failed", "run_twice")
                }
                | {
                    "first_new_answer_s_max": _worst(
                        [r["first_new_answer_s"] for r in per_run if r["fault"] == kind]
                    ),
                    "clean_audit_s_max": _worst(
                        [r["clean_audit_s"] for r in per_run if r["fault"] == kind]
                    ),
                }
                for kind in args.faults
            }
        finally:
            up.send_signal(signal.SIGTERM)
            up.wait(timeout=120)
    return out


def _worst(values: list[float | None]) -> float | None:
    """The largest of `values`; None when one is missing (no answer, no clean audit)."""
    return None if None in values else max(v for v in values if v is not None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3, help="failovers of each fault")
    parser.add_argument("--faults", default="kill,stop", help="kill, stop, or both")
    parser.add_argument("--threads", type=int, default=8, help="callers in all")
    parser.add_argument("--quiet", type=float, default=10.0, help="seconds of the baseline")
    parser.add_argument("--stop-s", type=float, default=20.0, help="how long a SIGSTOP lasts")
    parser.add_argument("--settle", type=float, default=10.0, help="seconds after each audit")
    args = parser.parse_args()
    args.faults = [f for f in args.faults.split(",") if f]
    if not set(args.faults) <= {"kill", "stop"}:
        parser.error("--faults takes kill, stop or kill,stop")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for name in [k for k in os.environ if k.startswith("GPUFLEET_")]:
        del os.environ[name]
    print(json.dumps(run(args), indent=2))


if __name__ == "__main__":
    main()
