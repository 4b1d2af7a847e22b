"""What several fleet benchmarks share: a bare Celery worker beside the fleet, a plain
client, CPU accounting from /proc, and percentiles.

Kept apart from the benchmarks themselves, so none imports another (`bench.hotpath`,
`bench.router`, `bench.batching` and `bench.miss` each use these).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import TYPE_CHECKING

from celery import Celery

if TYPE_CHECKING:
    from tasks.operator.launcher import Launcher

log = logging.getLogger("bench.harness")

REPO = Path(__file__).resolve().parents[1]
STOP_GRACE_S = 15.0
ROUTER_QUEUE = "celery"  # Celery's default queue: where a plain client's call lands


def start_bare(
    app: str, queue: str, host: str, extra_env: dict[str, str]
) -> subprocess.Popen[bytes]:
    """A bare Celery worker of `app` ("module:attribute") on `queue`, flagged like a GPU
    worker, as `bare@host`; it dies with this process."""
    from placement.server.redis_server import die_with_parent_preexec

    cmd = [sys.executable, "-m", "celery", "-A", app, "worker"]
    cmd += ["-Q", queue, "-n", f"bare@{host}", "-c", "1", "-P", "prefork"]
    cmd += ["--loglevel=INFO", "-E", "--without-gossip", "--without-mingle"]
    env = {**os.environ, **extra_env, "HF_HUB_OFFLINE": "1"}
    env.pop("GPUFLEET_ROLE", None)
    log.info("starting the bare worker: %s", " ".join(cmd))
    return subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=sys.stderr.fileno(),
        preexec_fn=die_with_parent_preexec(),  # noqa: PLW1509
    )


def wait_bare(app: Celery, proc: subprocess.Popen[bytes], host: str, timeout: float) -> None:
    """Return once `start_bare`'s worker answers a ping through `app`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the bare worker exited with code {proc.returncode}")
        if app.control.ping([f"bare@{host}"], timeout=1.0):
            return
        time.sleep(0.5)
    raise RuntimeError(f"the bare worker did not answer a ping in {timeout:.0f} s")


def stop_bare(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        log.warning("the bare worker did not stop in time; killing it")
        proc.kill()
        proc.wait()


def all_at_once(clients: list[Celery], caller: Callable[[Celery], None]) -> float:
    """`caller(client)` for every client, each in a thread of its own, started together:
    the seconds until the last returns (closed-loop callers take their next call in it)."""
    began = time.monotonic()
    threads = [threading.Thread(target=caller, args=(client,)) for client in clients]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return time.monotonic() - began


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile, linearly interpolated between ranks (numpy's default)."""
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def exit_on_sigterm(signum: int, frame: FrameType | None) -> None:
    """A SIGTERM handler for the fleet benchmarks: it unwinds through `finally`, so every
    fleet and child process the run started is stopped."""
    raise SystemExit(128 + signum)


def plain_client(broker: str, backend: str, visibility_timeout: int) -> Celery:
    """What a user who never installed gpufleet writes to call it."""
    app = Celery("plain-client", broker=broker, backend=backend)
    transport = {"visibility_timeout": visibility_timeout}
    app.conf.update(
        task_serializer="json",
        result_serializer="json",
        accept_content=["json"],
        result_accept_content=["json"],
        task_default_queue=ROUTER_QUEUE,
        broker_transport_options=transport,
        result_backend_transport_options=transport,
    )
    return app


def cpu_ticks(pid: int) -> int:
    """utime + stime of `pid` (every thread), in clock ticks; 0 when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0
    fields = text[text.rindex(")") + 2 :].split()  # fields from the 3rd (state) on
    return int(fields[11]) + int(fields[12])  # fields 14 and 15


def children_of(pid: int) -> list[int]:
    """The child processes of `pid` (a Celery worker's pool); none when it is gone."""
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:
        return []


def router_cpu(pid: int) -> tuple[int, int]:
    """CPU ticks of a Celery worker's main process and of its pool."""
    return cpu_ticks(pid), sum(cpu_ticks(child) for child in children_of(pid))


def pid_of(fleet: Launcher, child: str) -> int:
    """The pid of the launcher's `child` now (a restarted child has a new one)."""
    proc = fleet.children[child].proc
    assert proc is not None
    return proc.pid
