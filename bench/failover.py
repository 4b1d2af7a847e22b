"""A fleet whose Redis is a primary, two replicas and three Sentinels, through failovers under load.

    python -m bench.failover [--runs 3] [--faults kill,stop] [--threads 8] [--group launcher]

Prints one JSON object. It runs `gpufleet up --redis-ha` (`--group launcher`, the
default: the group and its supervision as users get them) or `gpufleet up` on a Sentinel
group the bench forms alike but runs itself, with no watchdog (`--group external`, as a
group of your own), with 2 simulated GPUs and a catalog of two encoders and a small
generation model (`placement.server.sentinel`: down after 3 s, writes only with a replica
following). Callers, `--threads` in all, call one after another: half are plain Celery
clients configured from `gpufleet url --json`, half use the project's client
(`tasks.api.infer`). Each worker records the calls it ran in a file (`GPUFLEET_RUN_LOG`,
`tasks.broker.run_log`); an event listener follows each call's task events.

The baseline, in the same run: the same load for `--quiet` seconds with no fault (calls
per second, p50 and max latency). Then each fault, `--runs` times in turn: `kill` SIGKILLs
the primary, `stop` SIGSTOPs it for `--stop-s` seconds and lets it go, each once the
Sentinels trust a replica. A killed node is started again as a replica of the new primary
(by the launcher; with `--group external`, by the bench, on its old port with its data,
as a service manager would, and the Sentinels turn it into one); a stopped one the
launcher kills once failed over (with `--group external` it comes back when let go).
Each run then waits for a clean audit.

Per run and in all (and `whole_run`: every call, the baseline's too), counted once every
caller has its answer or gave up: calls sent since the last run's window ended (a call in
flight at the fault is its run's), lost (never answered, not even after the callers'
60 s, and no answer stored), unheard (given up on, but its answer is stored), failed (an
error reached the caller), run twice (more than one line in the run log: counted where
calls run, not from `task-succeeded` events, which a dying primary loses: `whole_run`
gives their count too, a lower bound), the time from the fault to the first answer of
a call sent after it, and to a clean audit (`placement.ledger.audit`) once the new
primary is named, and whether the Sentinels failed over again before the run ended (a
promoted primary failed over in turn loses what it took alone: docs/deploy.md).
`whole_run` lists the task ids lost and run twice, and the slowest calls; each run, each
caller's call in flight at the fault and its first call sent after it (`callers`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

from celery import Celery

from placement.config import connection_path, read_connection
from placement.ledger import endpoint
from placement.ledger.audit import audit
from placement.ledger.registry import Registry
from placement.server.redis_server import HOST
from placement.server.sentinel import SentinelGroup, replicas_ready
from tasks.broker.run_log import runs as run_log_runs
from tasks.operator.launcher import HA_REPLICAS

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
        self.plain: set[str] = set()  # the task ids a plain Celery client sent
        self.publish_s: dict[str, float] = {}  # how long each call's publish took
        self.caller: dict[str, int] = {}  # which caller sent each call
        self.errors: set[str] = set()  # the kinds of error callers met
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
            task_id = str(uuid.uuid4())
            self.caller[task_id] = i
            row: tuple[float, float | None, str, str]
            try:  # a publish that fails is a failed call, its thread calls on
                if i % 2:
                    result = infer.apply_async(args=(model, inputs, params), task_id=task_id)
                else:
                    self.plain.add(task_id)
                    result = plain.send_task(
                        "gpufleet.infer", args=(model, inputs, params), task_id=task_id
                    )
                self.publish_s[task_id] = time.time() - sent
                result.get(timeout=TIMEOUT_S)
                row = (sent, time.time(), task_id, "")
            except Exception as exc:
                row = (sent, None, task_id, type(exc).__name__)
                if type(exc).__name__ not in self.errors:  # each kind's first, to stderr
                    self.errors.add(type(exc).__name__)
                    traceback.print_exc()
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
    """How many `task-succeeded` events each task id got (the fleet's own client), and
    every task event each got, as "type@worker" (`trail`: where a lost call stopped)."""

    def __init__(self) -> None:
        self.count: Counter[str] = Counter()
        self.trail: dict[str, list[str]] = {}
        self._stop = threading.Event()
        threading.Thread(target=self._listen, daemon=True).start()

    def _listen(self) -> None:
        from tasks.app import app

        while not self._stop.is_set():
            try:
                with app.connection_for_read() as conn:
                    receiver = app.events.Receiver(conn, handlers={"*": self._seen})
                    while not self._stop.is_set():
                        try:
                            receiver.capture(limit=None, timeout=1.0, wakeup=False)
                        except TimeoutError:
                            continue
            except Exception:  # the primary went away: listen again on the next one
                time.sleep(0.5)

    def _seen(self, event: dict[str, Any]) -> None:
        task_id = event.get("uuid")
        if not isinstance(task_id, str):
            return  # a worker's own event (heartbeat, online)
        if event["type"] == "task-succeeded":
            self.count[task_id] += 1
        host = str(event.get("hostname", "?")).split("@")[0]
        self.trail.setdefault(task_id, []).append(f"{event['type'][5:]}@{host}")

    def stop(self) -> None:
        self._stop.set()


def figures(
    rows: list[tuple[float, float | None, str, str]], ran: dict[str, int], stored: set[str]
) -> dict[str, Any]:
    """The figures of `rows`; `stored`: the task ids whose answer Redis holds, so that a call
    its caller gave up on counts as unheard when its answer is there, else as lost."""
    answered = [done - sent for sent, done, _, _ in rows if done is not None]
    gave_up = [task_id for _, done, task_id, why in rows if done is None and why == "TimeoutError"]
    unheard = [t for t in gave_up if t in stored]
    return {
        "sent": len(rows),
        "lost": len(gave_up) - len(unheard),
        "unheard": len(unheard),
        "failed": sum(1 for _, done, _, why in rows if done is None and why != "TimeoutError"),
        "run_twice": sum(1 for _, _, task_id, _ in rows if ran.get(task_id, 0) > 1),
        "p50_s": round(statistics.median(answered), 4) if answered else None,
        "max_s": round(max(answered), 4) if answered else None,
    }


def timeline(rows: list[tuple[float, float | None, str, str]], at: float, load: Load) -> list[str]:
    """Each caller's calls around a fault (at `at`): the one in flight at it and the first
    sent after it, each as "caller C (client): sent +S s, published in P s, answered at
    +A s" (from the fault): where a failover holds a caller."""
    chosen: dict[int, list[tuple[float, float | None, str, str]]] = {}
    for row in sorted(rows):
        sent, done, task_id, _ = row
        calls = chosen.setdefault(load.caller.get(task_id, -1), [])
        if (sent < at and (done is None or done > at)) or (
            sent >= at and not any(c[0] >= at for c in calls)
        ):
            calls.append(row)
    out = []
    for caller, calls in sorted(chosen.items()):
        for sent, done, task_id, why in calls:
            client = "plain" if task_id in load.plain else "project"
            published = load.publish_s.get(task_id)
            publish = f"published in {published:.2f} s" if published is not None else "unpublished"
            answer = f"answered at +{done - at:.2f} s" if done is not None else f"no answer ({why})"
            out.append(f"caller {caller} ({client}): sent {sent - at:+.2f} s, {publish}, {answer}")
    return out


def first_answers(
    rows: list[tuple[float, float | None, str, str]], at: float, load: Load
) -> dict[str, float | None]:
    """Per kind of client, the time from a fault (at `at`) to the first answer of a call
    sent after it: a plain Celery client's result consumer and the project's differ."""
    first: dict[str, float | None] = {"plain": None, "project": None}
    for sent, done, task_id, _ in rows:
        if done is None or sent < at:
            continue
        kind = "plain" if task_id in load.plain else "project"
        took = round(done - at, 2)
        first[kind] = took if first[kind] is None else min(took, first[kind] or took)
    return first


def stored_answers(url: str, rows: list[tuple[float, float | None, str, str]]) -> set[str]:
    """The task ids among `rows` given up on whose answers the primary holds."""
    ids = [task_id for _, done, task_id, _ in rows if done is None]
    if not ids:
        return set()
    client = endpoint.connect(url)
    found = client.mget([f"celery-task-meta-{task_id}" for task_id in ids])
    client.close()
    return {task_id for task_id, meta in zip(ids, found, strict=True) if meta is not None}


def found_in(url: str, task_ids: list[str]) -> dict[str, list[str]]:
    """The keys (lists, hashes) of the primary that mention each of `task_ids`: where a
    lost call stopped."""
    if not task_ids:
        return {}
    client = endpoint.connect(url)
    where: dict[str, list[str]] = {}
    for key in client.scan_iter(count=1000):
        kind = client.type(key)
        if kind == b"list":
            values = client.lrange(key, 0, -1)
        elif kind == b"hash":
            values = client.hvals(key)
        else:
            continue
        text = b"".join(v if isinstance(v, bytes) else v.encode() for v in values)
        for task_id in task_ids:
            if task_id.encode() in text:
                where.setdefault(task_id, []).append(key.decode())
    client.close()
    return where


class Launched:
    """The group `gpufleet up --redis-ha` runs, as its launcher supervises it: a killed
    node is started again by the launcher, a stopped one is killed by it once failed over
    (the watchdog), so the bench only injects the fault."""

    def __init__(self, up: subprocess.Popen[str], url: str) -> None:
        self.up, self.url = up, url

    def primary_port(self) -> int:
        return int(str(endpoint.parse(self.url).topology()["primary"]).rsplit(":", 1)[1])

    def primary(self) -> tuple[int, int]:
        """The primary's port and pid (the launcher's child serving 127.0.0.1:PORT)."""
        port = self.primary_port()
        return port, _child_with(self.up.pid, f"{HOST}:{port}")

    def new_primary(self, old: int, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):
                if (port := self.primary_port()) != old:
                    return port
            time.sleep(0.1)
        raise TimeoutError(f"no failover from port {old} in {timeout:.0f} s")

    def after_kill(self, port: int) -> None:
        """Nothing: the launcher starts the node again."""


class External:
    """A group the bench runs itself (`--group external`), as a group of your own runs:
    no watchdog; the bench starts a killed node again (on its old port, with its data,
    which the Sentinels turn into a replica)."""

    def __init__(self, group: SentinelGroup) -> None:
        self.group, self.url = group, group.url

    def primary_port(self) -> int:
        return self.group.primary_port()

    def primary(self) -> tuple[int, int]:
        port = self.group.primary_port()
        return port, self.group.node(port).pid

    def new_primary(self, old: int) -> int:
        return self.group.wait_failover(old)

    def after_kill(self, port: int) -> None:
        (node,) = [node for node in self.group.nodes if node.port == port]
        node.restart()


def _child_with(parent: int, word: str) -> int:
    """The pid of `parent`'s child whose command line has `word` as one of its words."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == parent and word in cmdline.split():
            return int(entry.name)
    raise LookupError(f"no child of {parent} serves {word}")


def _let_go(pid: int, word: str) -> None:
    """SIGCONT `pid` if it is still the stopped node (`word` in its command line): the
    launcher's watchdog may have killed it, and its pid be another process's now."""
    with contextlib.suppress(OSError):
        if word in Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode():
            os.kill(pid, signal.SIGCONT)


def fault(target: Launched | External, kind: str, stop_s: float) -> tuple[float, int]:
    """Inject `kind` into the primary once the Sentinels trust every replica, the last
    fault's primary among them (a fault before then is a second fault: docs/deploy.md);
    when it happened, and the new primary's port (a stopped primary is let go `stop_s`
    after the fault, from a timer). Trusting one replica was not enough: a stopped
    primary let go is made a replica 10 s later, and a fault then left the promoted one
    with no replica in sync, refusing writes (`min-replicas-to-write`) for longer than
    callers retry: calls failed, none lost."""
    deadline = time.monotonic() + 60
    while not replicas_ready(target.url, HA_REPLICAS) and time.monotonic() < deadline:
        time.sleep(0.5)
    old, pid = target.primary()
    at = time.time()
    if kind == "kill":
        os.kill(pid, signal.SIGKILL)
        new = target.new_primary(old)
        target.after_kill(old)
    else:
        os.kill(pid, signal.SIGSTOP)
        new = target.new_primary(old)
        wait = max(0.0, stop_s - (time.time() - at))
        threading.Timer(wait, _let_go, (pid, f"{HOST}:{old}")).start()
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
    print(f"the fleet's home, its run log and the Sentinels' logs: {home}", file=sys.stderr)
    catalog = home / "models.yaml"
    catalog.write_text(CATALOG)
    os.environ["GPUFLEET_HOME"] = str(home)
    with contextlib.ExitStack() as stack:
        redis_args = ["--redis-ha"]
        group = None
        if args.group == "external":  # as `--redis-ha` forms it, less the launcher's watchdog
            group = stack.enter_context(
                SentinelGroup(
                    password="bench-failover",
                    replicas=HA_REPLICAS,
                    min_replicas=1,
                    data_root=home / "group",
                )
            )
            os.environ["GPUFLEET_REDIS_URL"] = group.url
            redis_args = []
        run_log = home / "runs.log"  # each call's runs, where they ran (outside Redis)
        env = {**os.environ, "GPUFLEET_RUN_LOG": str(run_log)}
        up = subprocess.Popen(
            [*CLI, "up", *redis_args, "--models", str(catalog), "--sim-gpus", "2x4GiB",
             "--metrics-port", "0"],
            env=env, stdout=subprocess.PIPE, text=True,
            stderr=open(args.log, "w") if args.log else subprocess.DEVNULL,  # noqa: SIM115
        )  # fmt: skip
        assert up.stdout is not None
        for line in up.stdout:
            if "Ctrl-C stops" in line:
                break
        threading.Thread(target=up.stdout.read, daemon=True).start()  # never a full pipe
        try:
            known = read_connection(connection_path(home, "default"))
            assert known is not None, "gpufleet up recorded no connection"
            fleet_url = known.fleet
            # the project's client, and the event listener, as the fleet's own user
            os.environ["GPUFLEET_REDIS_URL"] = env["GPUFLEET_REDIS_URL"] = fleet_url
            target = External(group) if group is not None else Launched(up, fleet_url)
            conf = json.loads(
                subprocess.run(
                    [*CLI, "url", "--json"], env=env, capture_output=True, text=True, check=True
                ).stdout
            )["celery"]
            plain = Celery(set_as_current=False)
            plain.conf.update(**conf)
            for model, inputs, params in CALLS:  # loaded before anything is timed
                plain.send_task("gpufleet.infer", args=(model, inputs, params)).get(TIMEOUT_S)
            registry = Registry.from_url(fleet_url, "default")
            runs = Runs()
            load = Load(plain, args.threads)
            began = time.time()
            time.sleep(args.quiet)
            quiet = (began, time.time())
            faults: list[dict[str, Any]] = []
            for kind in args.faults:
                for _ in range(args.runs):
                    at, new = fault(target, kind, args.stop_s)
                    clean = clean_after(registry, at)
                    # past a stopped primary's return, then `settle` more
                    time.sleep(max(0.0, at + args.stop_s - time.time()) + args.settle)
                    faults.append(
                        {"fault": kind, "at": at, "ended": time.time(), "clean_audit_s": clean,
                         "new_primary": new, "failed_over_again": target.primary_port() != new}
                    )  # fmt: skip
            load.stop()  # every call sent is answered or given up on from here
            runs.stop()
            rows = load.between(0.0, time.time())
            stored = stored_answers(fleet_url, rows)
            ran = run_log_runs(run_log)
            out: dict[str, Any] = {"baseline": figures(load.between(*quiet), ran, stored)}
            out["baseline"]["calls_per_s"] = round(out["baseline"]["sent"] / args.quiet, 1)
            per_run: list[dict[str, Any]] = []
            start = quiet[1]  # each run's calls: those sent since the last one's ended
            for f in faults:
                window = load.between(start, f["ended"])
                start = f["ended"]
                after = [done for sent, done, _, _ in window if done and sent >= f["at"]]
                per_run.append(
                    {
                        "fault": f["fault"],
                        **figures(window, ran, stored),
                        "first_new_answer_s": round(min(after) - f["at"], 2) if after else None,
                        "first_new_answer_s_by_client": first_answers(window, f["at"], load),
                        "clean_audit_s": f["clean_audit_s"],
                        "new_primary": f["new_primary"],
                        "failed_over_again": f["failed_over_again"],
                        "callers": timeline(window, f["at"], load),
                    }
                )
            out["runs"] = per_run
            out["whole_run"] = figures(rows, ran, stored)  # the baseline's calls too
            out["whole_run"]["run_twice_ids"] = sorted(t for t, n in ran.items() if n > 1)
            out["whole_run"]["run_twice_by_events"] = sum(1 for n in runs.count.values() if n > 1)
            lost = [
                (sent, t) for sent, done, t, why in rows
                if done is None and why == "TimeoutError" and t not in stored
            ]  # fmt: skip
            where = found_in(fleet_url, [t for _, t in lost])
            out["whole_run"]["lost_ids"] = [
                f"{t} ({'plain' if t in load.plain else 'project'} client, sent at {sent:.1f}, "
                f"published in {load.publish_s.get(t, -1):.2f} s, now in {where.get(t, [])}, "
                f"events {runs.trail.get(t, [])})"
                for sent, t in sorted(lost)
            ]
            slowest = sorted(
                (r for r in rows if r[1] is not None), key=lambda r: r[0] - (r[1] or 0)
            )[:5]
            out["whole_run"]["slowest"] = [
                f"caller {load.caller.get(t)} ({'plain' if t in load.plain else 'project'}): "
                f"sent at {sent - began:.2f} s of the run, published in "
                f"{load.publish_s.get(t, -1):.2f} s, answered in {done - sent:.2f} s"
                for sent, done, t, _ in slowest
                if done is not None
            ]
            out["whole_run"]["faults_at"] = [round(f["at"], 1) for f in faults]
            out["all"] = {
                kind: {
                    key: sum(r[key] for r in per_run if r["fault"] == kind)
                    for key in ("sent", "lost", "failed", "run_twice", "failed_over_again")
                }
                | {
                    "first_new_answer_s_max": _worst(
                        [r["first_new_answer_s"] for r in per_run if r["fault"] == kind]
                    ),
                    "clean_audit_s_max": _worst(
                        [r["clean_audit_s"] for r in per_run if r["fault"] == kind]
                    ),
                    "first_new_answer_s_max_by_client": {
                        client: _worst(
                            [
                                r["first_new_answer_s_by_client"][client]
                                for r in per_run
                                if r["fault"] == kind
                            ]
                        )
                        for client in ("plain", "project")
                    },
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
    parser.add_argument("--log", help="write the fleet's log lines to this file")
    parser.add_argument(
        "--group", choices=("launcher", "external"), default="launcher",
        help="launcher: `gpufleet up --redis-ha`; external: a group the bench runs, no watchdog",
    )  # fmt: skip
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
