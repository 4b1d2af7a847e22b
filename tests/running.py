"""A real `gpufleet up` for end-to-end tests, and the processes it started (only those).

Tests find, signal and kill processes only among the descendants of the fleet they
started, so they pass while other fleets run on the machine.
"""

from __future__ import annotations

import gc
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from celery import Celery
from celery.result import AsyncResult

from bench.fleet import TWO_MODELS  # noqa: F401  (the end-to-end tests' catalog)
from placement.config import connection_path, read_connection
from placement.ledger import endpoint
from placement.ledger.registry import Registry
from tasks.config import caller_conf

REPO = Path(__file__).resolve().parents[1]
READY_S = 180.0
#: The arguments of a call of `b` (TWO_MODELS) that computes for a few tenths of a second.
LARGE = (["y" * 2000] * 2, {"max_length": 512})


@dataclass
class RunningFleet:
    """A started `gpufleet up`: its process, the callers' URL it printed with a plain
    Celery client of it, and the registry as the fleet's own user reaches it."""

    proc: subprocess.Popen[str]
    url: str  # the caller's (`gpufleet url`)
    client: Celery
    registry: Registry
    lines: list[str]  # what `gpufleet up` printed on stdout until it was ready
    fleet_url: str = ""  # the fleet's own user (its connection file)
    operator_url: str = ""
    log: Path | None = None  # where its processes' logs go, when the test asked
    _inside: Celery | None = None

    @property
    def inside(self) -> Celery:
        """A Celery client with the fleet's own user: Celery's remote control (inspect,
        ping) and the fleet's internal queues, which a caller's user may not reach."""
        if self._inside is None:
            self._inside = _client(self.fleet_url)
        return self._inside

    def infer(self, model: str, inputs: Any, timeout: float = 120) -> dict[str, Any]:
        result: dict[str, Any] = self.client.send_task("gpufleet.infer", args=(model, inputs)).get(
            timeout=timeout
        )
        return result

    def pool_child(self, gpu_index: int) -> int:
        """The pid of GPU worker `gpu_index`'s pool child (the process that holds models)."""
        worker = self.child_named(f"gpu{gpu_index}@")
        children = [pid for pid, parent in parents().items() if parent == worker]
        assert len(children) == 1, (gpu_index, worker, children)
        return children[0]

    def child_named(self, needle: str, *, word: bool = False) -> int:
        """The pid of the launcher's direct child whose command line has `needle`: a
        Celery worker's main process (`"gpu0@"`, `"router@"`) or the `"redis-server"`;
        with `word`, as one of its words (a bundled Redis node's `127.0.0.1:PORT`)."""
        found = [
            pid
            for pid, parent in parents().items()
            if parent == self.proc.pid
            and (needle in _cmdline(pid).split() if word else needle in _cmdline(pid))
        ]
        assert len(found) == 1, (needle, found)
        return found[0]

    def active_calls(self, workers: int = 2) -> int:
        """The most calls any worker reports running at once. `workers` is how many the
        fleet has (a router and one GPU worker): inspect returns when all of them have
        answered, in milliseconds, rather than at its timeout."""
        inspect = self.inside.control.inspect(timeout=2.0, limit=workers)
        active: dict[str, list[Any]] = inspect.active() or {}
        return max((len(calls) for calls in active.values()), default=0)

    def kill_mid_call(
        self,
        pid: int,
        running: int = 1,
        workers: int = 2,
        calls: Sequence[AsyncResult] = (),
        batch: int = 0,
    ) -> datetime:
        """SIGKILL `pid` once `running` calls run at once on one of the fleet's `workers`
        Celery workers and, with `calls`, more of them than one `batch` takes are still
        unanswered (so one waits behind the running ones, and is answered after the kill
        however soon they end); return when (for `answered_after`)."""
        deadline = time.monotonic() + 30
        while self.active_calls(workers) < running or (
            calls and sum(not c.ready() for c in calls) <= batch
        ):
            assert time.monotonic() < deadline, f"{running} calls never ran at once"
        killed = datetime.now(UTC)
        with_signal(pid, signal.SIGKILL)
        return killed


def answered_after(calls: Sequence[AsyncResult], moment: datetime) -> int:
    """How many of `calls` (all answered) got their answer after `moment`."""
    done = [c.date_done for c in calls]
    assert all(isinstance(d, datetime) for d in done), done
    return sum((d if d.tzinfo else d.replace(tzinfo=UTC)) > moment for d in done)


def until(what: str, done: Callable[[], bool], seconds: float = 30.0) -> None:
    """Wait for `done()`, failing with `what` after `seconds`."""
    deadline = time.monotonic() + seconds
    while not done():
        assert time.monotonic() < deadline, f"{what} within {seconds:.0f} s"
        time.sleep(0.1)


def gpufleet(home: Path, *args: str) -> str:
    """What `gpufleet ARGS` prints for the fleet whose home is `home`; it must succeed."""
    done = subprocess.run(
        [sys.executable, "-m", "tasks.operator.cli", *args], cwd=REPO,
        env=fleet_env(GPUFLEET_HOME=str(home)), capture_output=True, text=True, timeout=60,
        check=False,
    )  # fmt: skip
    assert done.returncode == 0, (args, done.stdout, done.stderr)
    return done.stdout


def fleet_env(**extra: str) -> dict[str, str]:
    """This process's environment without any GPUFLEET_ setting, plus `extra`."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFLEET_")}
    return env | extra


@contextmanager
def fleet_up(
    catalog: Path,
    args: list[str],
    env: Mapping[str, str],
    fleet: str = "default",
    log: Path | None = None,
    *,
    api: bool = False,
) -> Iterator[RunningFleet]:
    """Start `gpufleet up --models catalog *args`; stop it (SIGTERM) on the way out.

    Without a GPUFLEET_HOME in `env`, the fleet gets a home of its own (its connection file
    and Redis data), so it never meets another fleet of the same name on this machine.
    Its processes' logs are appended to `log` when given, else dropped. It serves no HTTP
    API unless `api` or `args` asks for one (`--api-port`): a process fewer on a loaded
    machine.
    """
    env = dict(env)
    if not api and "--api-port" not in args:
        args = [*args, "--api-port", "0"]
    home = None
    if "GPUFLEET_HOME" not in env:
        home = tempfile.mkdtemp(prefix="gpufleet-home-")
        env["GPUFLEET_HOME"] = home
    proc = subprocess.Popen(
        [sys.executable, "-m", "tasks.operator.cli", "up", "--models", str(catalog), *args],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=log.open("a") if log is not None else subprocess.DEVNULL,
        text=True,
    )
    try:
        lines = wait_ready(proc)
        url = next(m.group(1) for line in lines if (m := re.search(r"registry (\S+)", line)))
        client = _client(url)
        known = read_connection(connection_path(Path(env["GPUFLEET_HOME"]).expanduser(), fleet))
        assert known is not None and known.caller == url, (known, url)
        registry = Registry.from_url(known.fleet, fleet)
        running = RunningFleet(proc, url, client, registry, lines, known.fleet, known.operator, log)
        yield running
        registry.client.close()
        gc.collect()  # the clients its tests made and dropped let go while its Redis is up
        for each in (running.client, running._inside):
            if each is not None:
                stop_waiting(each)
    finally:
        stop(proc)
        if home is not None:
            shutil.rmtree(home, ignore_errors=True)


def _client(url: str) -> Celery:
    """A plain Celery client of `url`; of Sentinels, as `gpufleet url --json` configures it."""
    client = Celery(broker=url, backend=url)
    client.conf.update(task_serializer="json", accept_content=["json"], result_serializer="json")
    if endpoint.parse(url).watched:
        client.conf.update(**caller_conf(url))
    return client


def stop_waiting(client: Celery) -> None:
    """Unsubscribe `client` from the results it still waits on, while its Redis is up.

    Celery keeps a result whose `get` timed out subscribed until the result object is
    freed; freed once its Redis has gone, it retries the unsubscribe once a second for
    about 20 s in whichever thread frees it, which stalls a later test past the leases
    of the workers it registered.
    """
    backend = client.backend
    prefix = len(backend.task_keyprefix)
    for key in list(backend.result_consumer.subscribed_to):
        backend.result_consumer.cancel_for(key[prefix:].decode())


def wait_ready(proc: subprocess.Popen[str], marker: str = "Ctrl-C stops") -> list[str]:
    """The lines `gpufleet up` prints until it says it is up."""
    assert proc.stdout is not None
    deadline = time.monotonic() + READY_S
    lines: list[str] = []
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line and proc.poll() is not None:
            raise AssertionError(f"gpufleet up exited with {proc.returncode}: {lines}")
        lines.append(line)
        if marker in line:
            return lines
    raise AssertionError(f"gpufleet up did not become ready in {READY_S:.0f} s: {lines}")


def stop(proc: subprocess.Popen[str]) -> int:
    """SIGTERM `gpufleet up` and wait; it stops every process it started."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    if proc.stdout is not None:
        proc.stdout.close()
    try:
        return proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        for pid in descendants(proc.pid):
            with_signal(pid, signal.SIGKILL)
        proc.kill()
        return proc.wait(timeout=10)


def parents() -> dict[int, int]:
    """pid -> parent pid of every process, from /proc."""
    found: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            found[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    return found


def descendants(pid: int) -> set[int]:
    """Every process below `pid`."""
    tree = parents()
    found: set[int] = set()
    frontier = {pid}
    while frontier:
        frontier = {child for child, parent in tree.items() if parent in frontier} - found
        found |= frontier
    return found


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split()[2] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def with_signal(pid: int, sig: signal.Signals) -> None:
    with suppress(ProcessLookupError):
        os.kill(pid, sig)


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""
