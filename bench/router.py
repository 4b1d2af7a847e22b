"""Router throughput: plain-client calls per second through one router, against bare Celery.

    python -m bench.router [--callers 32] [--procs 4] [--seconds 10] [--warmup 2]
        [--drain 2000]

Prints one JSON object. It writes a catalog with one trivially cheap synthetic `forward`
model (`tiny`: a one-layer BERT of hidden size 8, about a millisecond a pass on a CPU),
starts a fleet (`tasks.operator.launcher.Launcher`: an embedded Redis unless GPUFLEET_REDIS_URL is
set, a router and one worker on a simulated 8 GiB GPU), and next to it a *bare* Celery
worker, `celery -A bench.router:bare_app worker -Q bench-router-bare -c 1 -P prefork`,
with the fleet's Celery settings (`tasks.config.celery_conf`) and a GPU worker's flags,
whose one task answers a tiny dict at once: no model, no placement.

The callers are *plain clients*: `--procs` client processes (this module re-run with
`--client`), which import Celery and nothing of gpufleet, each with `--callers / --procs`
threads on one `Celery(broker=..., backend=...)` app configured by hand (JSON only,
`task_default_queue="celery"`), as a user who never installed gpufleet would write it.
Their `send_task("gpufleet.infer", args=(MODEL, INPUTS))` names no queue, so every call
lands on the router's queue; the router forwards a call for the HOT model to the GPU
worker from its consumer (`tasks.serving.forwarding`), and runs anything else in its pool. One
call makes the model HOT first. Each caller is a closed loop: send, `.get()`, send the
next.

Phases, in ABBA order: fleet, bare, bare, fleet; each `--warmup` seconds untimed, then
`--seconds` timed. A call counts in the window it is answered in; latency is publish to
result. An exception or an answer without "outputs" is an error. `bare_calls_per_s` is
the ceiling Celery itself reaches on this machine with the same callers: end to end,
both are bound by the machine's cores, which the callers, Redis and the workers share.

Where each call's CPU goes: utime + stime (/proc/<pid>/stat) of the router's main
process and its pool, the GPU worker's main process and pool, redis-server, the client
processes, this process (the launcher relays its children's logs) and the rest of the
machine (`untracked`, from /proc/stat), sampled at the edges of each timed window, in ms
per answered call. `router_pool_calls` is how many `gpufleet.infer` the router's pool
executed (its `stats()` totals) during the fleet phases, warm-ups included, out of
`fleet_calls_sent`; the rest it forwarded without a pool task.

Last, `router_alone`: the router's own ceiling. With the router and the GPU worker told
to stop consuming (`cancel_consumer`), `--drain` plain calls are queued; the router is
started again and timed until every call is on the GPU worker's queue (calls per second,
and the router's CPU per call); then the GPU worker is started and every answer checked.
Target: calls_per_s >= 1000 through one router, with no errors (`router_alone_met`; the
end-to-end rate is reported against bare Celery's on the same machine).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING, Any

from celery import Celery

from bench.harness import (
    children_of,
    cpu_ticks,
    exit_on_sigterm,
    percentile,
    pid_of,
    plain_client,
    router_cpu,
    start_bare,
    stop_bare,
    wait_bare,
)

if TYPE_CHECKING:
    from tasks.operator.launcher import Launcher

log = logging.getLogger("bench.router")

REPO = Path(__file__).resolve().parents[1]
MODEL = "tiny"
INPUTS = ["route me"]
CATALOG = f"""
models:
  {MODEL}:
    source: synthetic
    task: forward
    memory: 16MiB
    config: {{model_type: bert, hidden_size: 8, num_hidden_layers: 1, num_attention_heads: 1,
             intermediate_size: 16, vocab_size: 64, max_position_embeddings: 32}}
"""
SIM_GPUS = "1x8GiB"
ROUTER_QUEUE = "celery"  # Celery's default queue: where a plain client's call lands
BARE_QUEUE = "bench-router-bare"
BARE_TASK = "bench.router.echo"
BARE_ENV = "GPUFLEET_BENCH_ROUTER_BARE"  # set in the bare worker only
CALL_TIMEOUT_S = 60.0
READY_TIMEOUT_S = 120.0
CLIENT_READY_S = 60.0
STOP_GRACE_S = 15.0
TARGETS = {"calls_per_s": 1000.0}
CLK_TCK = os.sysconf("SC_CLK_TCK")


# ---------------------------------------------------------------------------------------
# The bare worker: the fleet's Celery settings, a task that answers at once


def bare_config() -> dict[str, Any]:
    """The fleet's Celery settings, read from the environment now, on the bare queue."""
    from placement.config import Settings
    from tasks.config import celery_conf

    conf = celery_conf(Settings.from_env())
    conf["task_default_queue"] = BARE_QUEUE
    return conf


# Configured at import only in the bare worker; the benchmark process configures it once
# the fleet has started, and client processes never use it (they import no gpufleet).
bare_app = Celery("gpufleet-bench-router-bare", set_as_current=False)
if os.environ.get(BARE_ENV):
    bare_app.conf.update(bare_config())


@bare_app.task(name=BARE_TASK)  # type: ignore[untyped-decorator]  # Celery is untyped
def bare_echo(model: str, inputs: Any, params: dict[str, Any] | None = None) -> dict[str, Any]:
    """A tiny answer shaped like gpufleet.infer's, with no work behind it."""
    return {"model": model, "replica": "bare", "cache": "hot", "outputs": {"n": len(inputs)}}


# ---------------------------------------------------------------------------------------
# Client processes: Celery only, driven over stdin/stdout, one JSON line each way


def one_call(app: Celery, cmd: dict[str, Any]) -> dict[str, Any]:
    """One call, answered: how long it took and how it ran."""
    start = time.perf_counter()
    handle = app.send_task(cmd["task"], args=cmd["args"], queue=cmd.get("queue"))
    answer = handle.get(timeout=CALL_TIMEOUT_S)
    ms = (time.perf_counter() - start) * 1000
    ok = isinstance(answer, dict) and "outputs" in answer
    cache = answer.get("cache") if isinstance(answer, dict) else None
    return {"ok": ok, "ms": round(ms, 1), "cache": cache, "ran_as": handle.name}


def run_callers(app: Celery, cmd: dict[str, Any]) -> dict[str, Any]:
    """`cmd["threads"]` closed-loop callers until `end_at`; those answered in the window
    [start_at, end_at] (epoch seconds, shared by every client process) count."""
    start_at, end_at = float(cmd["start_at"]), float(cmd["end_at"])
    task, args, queue = cmd["task"], cmd["args"], cmd.get("queue")
    lock = threading.Lock()
    latencies: list[float] = []
    tally = {"sent": 0, "answered": 0, "errors": 0, "window_errors": 0}
    first_error: list[str] = []

    def caller() -> None:
        while time.time() < end_at:
            began = time.time()
            error = None
            try:
                answer = app.send_task(task, args=args, queue=queue).get(timeout=CALL_TIMEOUT_S)
                if not (isinstance(answer, dict) and "outputs" in answer):
                    error = f"wrong answer: {str(answer)[:150]}"
            except Exception as exc:  # counted, and the run fails its check
                error = f"{type(exc).__name__}: {exc}"[:200]
            done = time.time()
            in_window = start_at <= done <= end_at
            with lock:
                tally["sent"] += 1
                if error is not None:
                    tally["errors"] += 1
                    tally["window_errors"] += in_window
                    if not first_error:
                        first_error.append(error)
                else:
                    tally["answered"] += 1
                    if in_window:
                        latencies.append(round((done - began) * 1000, 3))

    threads = [threading.Thread(target=caller, daemon=True) for _ in range(int(cmd["threads"]))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return {
        **tally,
        "latencies_ms": latencies,
        "first_error": first_error[0] if first_error else None,
    }


def client_main() -> None:
    """A client process: the first stdin line sets it up; each next line is a command
    (`call` or `phase`), answered with one JSON line on stdout. It ends at EOF."""

    def emit(obj: dict[str, Any]) -> None:
        sys.stdout.write(json.dumps(obj) + "\n")
        sys.stdout.flush()

    setup = json.loads(sys.stdin.readline())
    app = plain_client(setup["broker"], setup["backend"], int(setup["visibility_timeout"]))
    with app.connection_for_write() as conn:
        conn.ensure_connection(max_retries=5)
    emit({"ready": True, "pid": os.getpid()})
    for line in sys.stdin:
        cmd = json.loads(line)
        if cmd["op"] == "call":
            emit(one_call(app, cmd))
        else:
            emit(run_callers(app, cmd))


class Clients:
    """The client processes, driven from the benchmark process."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen[str]] = []

    def start(self, procs: int, setup: dict[str, Any]) -> None:
        """Start `procs` client processes; return once each is connected."""
        from placement.server.redis_server import die_with_parent_preexec

        env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
        cmd = [sys.executable, "-m", "bench.router", "--client"]
        for _ in range(procs):
            self.procs.append(
                subprocess.Popen(
                    cmd,
                    cwd=REPO,
                    env=env,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    text=True,
                    preexec_fn=die_with_parent_preexec(),  # noqa: PLW1509
                )
            )
        for proc in self.procs:
            self._send(proc, setup)
        deadline = time.monotonic() + CLIENT_READY_S
        for proc in self.procs:
            self._read(proc, max(1.0, deadline - time.monotonic()))

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    @staticmethod
    def _send(proc: subprocess.Popen[str], obj: dict[str, Any]) -> None:
        assert proc.stdin is not None
        proc.stdin.write(json.dumps(obj) + "\n")
        proc.stdin.flush()

    @staticmethod
    def _read(proc: subprocess.Popen[str], timeout: float) -> dict[str, Any]:
        stdout: IO[str] | None = proc.stdout
        assert stdout is not None
        box: list[str] = []
        reader = threading.Thread(target=lambda: box.append(stdout.readline()), daemon=True)
        reader.start()
        reader.join(timeout)
        if not box or not box[0]:
            code = proc.poll()
            raise RuntimeError(f"client pid {proc.pid} gave no answer (exit code {code})")
        answer: dict[str, Any] = json.loads(box[0])
        return answer

    def call(self, cmd: dict[str, Any]) -> dict[str, Any]:
        """One call from the first client process."""
        self._send(self.procs[0], {"op": "call", **cmd})
        return self._read(self.procs[0], CALL_TIMEOUT_S + 10)

    def start_phase(self, cmd: dict[str, Any], callers: int) -> None:
        n = len(self.procs)
        for i, proc in enumerate(self.procs):
            threads = callers // n + (1 if i < callers % n else 0)
            self._send(proc, {"op": "phase", "threads": threads, **cmd})

    def results(self, timeout: float) -> list[dict[str, Any]]:
        return [self._read(proc, timeout) for proc in self.procs]

    def stop(self) -> None:
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                with contextlib.suppress(OSError):
                    proc.stdin.close()  # EOF: the client ends
        for proc in self.procs:
            try:
                proc.wait(5.0)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


# ---------------------------------------------------------------------------------------
# CPU accounting from /proc


def machine_busy_ticks() -> int:
    """Busy ticks of the whole machine (every core): /proc/stat's total less idle, iowait."""
    values = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    guest = sum(values[8:10])  # counted in user and nice already
    return sum(values) - guest - values[3] - values[4]


def redis_pids(urls: set[str]) -> list[int]:
    """The local redis-server processes behind `urls` (INFO's process_id); none remote."""
    import redis

    pids: set[int] = set()
    for url in urls:
        client = redis.Redis.from_url(url)
        try:
            pid = int(client.info("server")["process_id"])
        except (redis.RedisError, KeyError, ValueError):
            continue
        finally:
            client.close()
        try:
            if "redis" in Path(f"/proc/{pid}/comm").read_text():
                pids.add(pid)
        except OSError:
            continue  # on another machine
    return sorted(pids)


Groups = dict[str, list[int]]
Sample = dict[str, dict[int, int]]


def sample(groups: Groups) -> tuple[Sample, int]:
    """CPU ticks per process of each group, and the machine's busy ticks."""
    return {g: {pid: cpu_ticks(pid) for pid in pids} for g, pids in groups.items()}, (
        machine_busy_ticks()
    )


def cpu_ms(before: tuple[Sample, int], after: tuple[Sample, int]) -> dict[str, float]:
    """CPU ms per group between two samples (a process new since counts whole), and the
    machine's busy ms that no group accounts for (`untracked`)."""
    out: dict[str, float] = {}
    for group, ticks in after[0].items():
        old = before[0].get(group, {})
        delta = sum(t - old.get(pid, 0) for pid, t in ticks.items())
        out[group] = delta * 1000 / CLK_TCK
    busy = (after[1] - before[1]) * 1000 / CLK_TCK
    out["untracked"] = max(0.0, busy - sum(out.values()))
    return out


# ---------------------------------------------------------------------------------------
# Phases


def worker_totals(app: Celery, nodes: list[str]) -> dict[str, dict[str, int]]:
    """Each node's `stats()` totals: tasks executed per task name."""
    stats = app.control.inspect(nodes, timeout=3.0).stats() or {}
    return {n: {k: int(v) for k, v in stats.get(n, {}).get("total", {}).items()} for n in nodes}


def totals_delta(
    before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]
) -> dict[str, dict[str, int]]:
    out = {}
    for node, tasks in after.items():
        old = before.get(node, {})
        out[node] = {t: n - old.get(t, 0) for t, n in tasks.items() if n - old.get(t, 0)}
    return out


def run_phase(
    kind: str,
    clients: Clients,
    groups: Groups,
    *,
    callers: int,
    warmup: float,
    seconds: float,
) -> dict[str, Any]:
    """One timed phase; the clients are told when the window starts and ends."""
    if kind == "fleet":
        cmd: dict[str, Any] = {"task": "gpufleet.infer", "args": [MODEL, INPUTS], "queue": None}
    else:
        cmd = {"task": BARE_TASK, "args": [MODEL, INPUTS], "queue": BARE_QUEUE}
    start_at = time.time() + warmup
    end_at = start_at + seconds
    clients.start_phase({**cmd, "start_at": start_at, "end_at": end_at}, callers)
    time.sleep(max(0.0, start_at - time.time()))
    first = sample(groups)
    time.sleep(max(0.0, end_at - time.time()))
    last = sample(groups)
    results = clients.results(CALL_TIMEOUT_S + 30)
    latencies = [ms for r in results for ms in r["latencies_ms"]]
    errors = sum(r["errors"] for r in results)
    cpu = cpu_ms(first, last)
    return {
        "kind": kind,
        "seconds": seconds,
        "answered": len(latencies),
        "calls_per_s": round(len(latencies) / seconds, 1),
        "errors": sum(r["window_errors"] for r in results),
        "errors_total": errors,
        "first_error": next((r["first_error"] for r in results if r["first_error"]), None),
        "sent": sum(r["sent"] for r in results),
        "latencies_ms": latencies,
        "cpu_ms": cpu,
        "cores": {g: round(ms / 1000 / seconds, 3) for g, ms in cpu.items()},
    }


def drain_phase(
    app: Celery, plain: Celery, router: tuple[str, int], gpu: tuple[str, str], calls: int
) -> dict[str, Any]:
    """The router's own ceiling: with the router and the GPU worker not consuming, queue
    `calls` plain-client calls; start the router and time it until every call is on the
    GPU worker's queue; then start the GPU worker and check every answer."""
    import redis

    from tasks.broker.presence import lists

    (router_node, router_pid), (gpu_node, gpu_queue) = router, gpu
    broker = redis.Redis.from_url(plain.conf.broker_url)

    def waiting(queue: str) -> int:
        return sum(int(broker.llen(key)) for key in lists(queue))

    for node, queue in ((router_node, ROUTER_QUEUE), (gpu_node, gpu_queue)):
        app.control.cancel_consumer(queue, destination=[node], reply=True, timeout=5.0)
    handles = [plain.send_task("gpufleet.infer", args=(MODEL, INPUTS)) for _ in range(calls)]
    queued = waiting(ROUTER_QUEUE)
    ticks = router_cpu(router_pid)
    start = time.perf_counter()
    app.control.add_consumer(ROUTER_QUEUE, destination=[router_node], reply=True, timeout=5.0)
    deadline = start + CALL_TIMEOUT_S
    while waiting(gpu_queue) < calls and time.perf_counter() < deadline:
        time.sleep(0.002)
    seconds = time.perf_counter() - start
    used = [(b - a) * 1000 / CLK_TCK for a, b in zip(ticks, router_cpu(router_pid), strict=True)]
    moved = waiting(gpu_queue)
    app.control.add_consumer(gpu_queue, destination=[gpu_node], reply=True, timeout=5.0)
    answers = [h.get(timeout=CALL_TIMEOUT_S) for h in handles]
    right = sum(isinstance(a, dict) and "outputs" in a for a in answers)
    return {
        "calls": calls,
        "queued_at_start": queued,
        "forwarded": moved,
        "seconds": round(seconds, 3),
        "calls_per_s": round(moved / seconds, 1),
        "router_cpu_ms_per_call": {
            "main": round(used[0] / calls, 4),
            "pool": round(used[1] / calls, 4),
        },
        "answered_right": right,
    }


def per_call(phases: list[dict[str, Any]]) -> dict[str, float]:
    """CPU ms per answered call, per group, over `phases`."""
    calls = sum(p["answered"] for p in phases)
    groups = phases[0]["cpu_ms"].keys()
    return {g: round(sum(p["cpu_ms"][g] for p in phases) / max(1, calls), 4) for g in groups}


def latency(values: list[float]) -> dict[str, float | None]:

    if not values:
        return {"p50": None, "p90": None, "p99": None, "mean": None}
    return {
        "p50": round(percentile(values, 50), 2),
        "p90": round(percentile(values, 90), 2),
        "p99": round(percentile(values, 99), 2),
        "mean": round(sum(values) / len(values), 2),
    }


def run(  # noqa: PLR0917 - the command line's options
    callers: int, procs: int, seconds: float, warmup: float, drain_calls: int, directory: Path
) -> dict[str, Any]:
    from bench.fleet import bench_launcher, broker_in_use, loaded_machine
    from placement.config import Settings
    from tasks.serving.routing import gpu_queue

    fleet: Launcher = bench_launcher(directory, CATALOG, "router", SIM_GPUS, warm_cache="1GiB")
    bare: subprocess.Popen[bytes] | None = None
    clients: Clients | None = None
    broker = broker_in_use()
    load_before = os.getloadavg()
    phases: list[dict[str, Any]] = []
    try:
        fleet.start()  # sets GPUFLEET_REDIS_URL here: configure the clients only now
        bare_app.conf.update(bare_config())
        bare = start_bare("bench.router:bare_app", BARE_QUEUE, fleet.host, {BARE_ENV: "1"})
        fleet.wait_ready(READY_TIMEOUT_S)
        wait_bare(bare_app, bare, fleet.host, READY_TIMEOUT_S)
        from tasks.app import app  # this process only: control and inspect

        settings = Settings.from_env()
        setup = {
            "broker": fleet.broker_url,
            "backend": settings.result_backend,
            "visibility_timeout": settings.visibility_timeout,
        }
        clients = Clients()
        clients.start(procs, setup)
        first = clients.call({"task": "gpufleet.infer", "args": [MODEL, INPUTS]})
        log.info("first call (%s, as %s): %.0f ms", first["cache"], first["ran_as"], first["ms"])
        if not first["ok"]:
            raise RuntimeError(f"the first call got a wrong answer: {first}")

        gpu_child = f"gpu{fleet.devices[0].index}"
        router, gpu = f"router@{fleet.host}", f"{gpu_child}@{fleet.host}"
        redis_procs = redis_pids({fleet.redis_url, fleet.broker_url, settings.result_backend})

        def groups(kind: str) -> Groups:
            if kind == "fleet":
                router_pid = pid_of(fleet, "router")
                gpu_pid = pid_of(fleet, gpu_child)
                workers = {
                    "router_main": [router_pid],
                    "router_pool": children_of(router_pid),
                    "gpu_main": [gpu_pid],
                    "gpu_pool": children_of(gpu_pid),
                }
            else:
                assert bare is not None
                workers = {"bare_main": [bare.pid], "bare_pool": children_of(bare.pid)}
            assert clients is not None
            return {
                **workers,
                "redis": redis_procs,
                "clients": clients.pids,
                "bench_main": [os.getpid()],  # the launcher relays the fleet's logs here
            }

        for kind in ("fleet", "bare", "bare", "fleet"):
            before = worker_totals(app, [router, gpu]) if kind == "fleet" else {}
            phase = run_phase(
                kind, clients, groups(kind), callers=callers, warmup=warmup, seconds=seconds
            )
            if kind == "fleet":
                phase["tasks_run"] = totals_delta(before, worker_totals(app, [router, gpu]))
                phase["router_pool_calls"] = phase["tasks_run"][router].get("gpufleet.infer", 0)
            log.info(
                "%s: %.0f calls/s, %d errors, cores %s",
                kind,
                phase["calls_per_s"],
                phase["errors"],
                phase["cores"],
            )
            phases.append(phase)
            fleet.supervise()
        drain = drain_phase(
            app,
            plain_client(fleet.broker_url, settings.result_backend, settings.visibility_timeout),
            (router, pid_of(fleet, "router")),
            (gpu, gpu_queue(fleet.host, [fleet.devices[0].index])),
            drain_calls,
        )
        log.info("router alone: %s", drain)
    finally:
        if clients is not None:
            clients.stop()
        if bare is not None:
            stop_bare(bare)
        fleet.stop()

    fleet_phases = [p for p in phases if p["kind"] == "fleet"]
    bare_phases = [p for p in phases if p["kind"] == "bare"]
    fleet_rate = sum(p["calls_per_s"] for p in fleet_phases) / len(fleet_phases)
    bare_rate = sum(p["calls_per_s"] for p in bare_phases) / len(bare_phases)
    fleet_cpu = per_call(fleet_phases)
    errors = sum(p["errors_total"] for p in phases)
    router_main, router_pool = fleet_cpu["router_main"], fleet_cpu["router_pool"]
    return {
        "callers": callers,
        "procs": procs,
        "seconds": seconds,
        "warmup_s": warmup,
        "order": [p["kind"] for p in phases],
        "model": {
            "name": MODEL,
            "task": "forward",
            "config": "bert, hidden 8, 1 layer, vocab 64",
            "inputs": INPUTS,
            "first_call": first,
        },
        "fleet_calls_per_s": {
            "phases": [p["calls_per_s"] for p in fleet_phases],
            "mean": round(fleet_rate, 1),
        },
        "bare_calls_per_s": {
            "phases": [p["calls_per_s"] for p in bare_phases],
            "mean": round(bare_rate, 1),
        },
        "ratio_to_bare": round(fleet_rate / bare_rate, 3) if bare_rate else None,
        "fleet_latency_ms": latency([ms for p in fleet_phases for ms in p["latencies_ms"]]),
        "bare_latency_ms": latency([ms for p in bare_phases for ms in p["latencies_ms"]]),
        "errors": {
            "fleet": sum(p["errors_total"] for p in fleet_phases),
            "bare": sum(p["errors_total"] for p in bare_phases),
            "first": next((p["first_error"] for p in phases if p["first_error"]), None),
        },
        "router_cpu_ms_per_call": {
            "main": router_main,
            "pool": router_pool,
            "total": round(router_main + router_pool, 4),
        },
        "cpu_ms_per_call": {"fleet": fleet_cpu, "bare": per_call(bare_phases)},
        "cores_busy": [{"kind": p["kind"], **p["cores"]} for p in phases],
        "router_pool_calls": sum(p["router_pool_calls"] for p in fleet_phases),
        "fleet_calls_sent": sum(p["sent"] for p in fleet_phases),
        "tasks_run": [p["tasks_run"] for p in fleet_phases],
        "router_alone": drain,
        "targets": {
            "calls_per_s": f">= {TARGETS['calls_per_s']:.0f}",
            "calls_per_s_met": fleet_rate >= TARGETS["calls_per_s"],
            "router_alone_met": drain["calls_per_s"] >= TARGETS["calls_per_s"],
            "no_errors_met": errors == 0 and drain["answered_right"] == drain["calls"],
        },
        "machine": loaded_machine(SIM_GPUS, broker, load_before),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--callers", type=int, default=32, help="concurrent callers in all")
    parser.add_argument("--procs", type=int, default=4, help="client processes they run in")
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per phase")
    parser.add_argument("--warmup", type=float, default=2.0, help="untimed seconds per phase")
    parser.add_argument(
        "--drain", type=int, default=2000, help="calls queued for the router-alone phase"
    )
    parser.add_argument("--client", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, stream=sys.stderr, format="%(asctime)s %(name)s %(message)s"
    )
    if args.client:
        client_main()
        return
    if min(args.callers, args.procs, args.drain) < 1 or args.seconds <= 0 or args.warmup < 0:
        parser.error("--callers, --procs, --drain and --seconds must be positive")

    signal.signal(signal.SIGTERM, exit_on_sigterm)
    procs = min(args.procs, args.callers)
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-router-") as tmp:
        result = run(args.callers, procs, args.seconds, args.warmup, args.drain, Path(tmp))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
