"""The launcher's supervision, on plain child processes (no fleet needed), and the ports
it serves on: chosen and bound before any child starts, so two fleets started at once
each print the URLs they serve."""

from __future__ import annotations

import base64
import json
import os
import re
import socket
import sys
import time
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor, wait
from contextlib import ExitStack
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from placement.config import Settings, connection_path
from placement.errors import ConfigError
from tasks.broker import quarantine
from tasks.operator.launcher import CRASH_LIMIT, Child, Launcher, _bound_port, _port
from tests.running import RunningFleet, fleet_env, fleet_up

#: The smallest fleet: one model, nothing loaded by the tests here.
CATALOG = "models:\n  a: {source: synthetic, task: forward, memory: 256MiB}\n"

pytestmark = pytest.mark.slow


def launcher(tmp_path: Path) -> Launcher:
    settings = Settings.from_env({"GPUFLEET_HOME": str(tmp_path)})
    return Launcher(tmp_path / "models.yaml", settings, first_backoff_s=0.01)


def supervise_until(run: Launcher, done: Callable[[], bool], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, "not within the bound"
        run.supervise()
        time.sleep(0.02)


def sleeper(run: Launcher, tmp_path: Path) -> tuple[Child, Callable[[int], bool]]:
    """A child that marks each start and sleeps, started; and whether it has started n
    times. (Not whether the marker exists: open() makes the file before the write reaches
    it, and a kill in between would leave one mark for two starts.)"""
    marker = tmp_path / "starts"
    script = f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(60)"
    child = Child("sleeper", [sys.executable, "-c", script], dict(os.environ))
    run.run_child(child)
    return child, lambda n: marker.exists() and marker.read_text() == "x" * n


def test_a_child_that_dies_is_started_again(tmp_path: Path) -> None:
    run = launcher(tmp_path)
    child, started = sleeper(run, tmp_path)
    first = child.proc
    assert first is not None
    supervise_until(run, lambda: started(1))
    first.kill()
    supervise_until(run, lambda: child.proc is not first and child.proc is not None)
    supervise_until(run, lambda: started(2))
    assert [killed for _, killed in child.deaths] == [True]  # one death, a kill
    run.stop()
    assert child.proc is not None and child.proc.poll() is not None


def test_a_child_killed_by_sigkill_more_often_than_a_crash_loop_is_still_started_again(
    tmp_path: Path,
) -> None:
    # `kill -9`, the OOM killer or a chaos test: giving up would stop the whole fleet (a
    # 4-minute chaos soak kills the router every 20 s or so, which once stopped its fleet)
    run = launcher(tmp_path)
    child, started = sleeper(run, tmp_path)
    for starts in range(1, CRASH_LIMIT + 3):
        supervise_until(run, lambda: started(starts))  # noqa: B023 - called at once
        assert child.proc is not None
        child.proc.kill()
        child.proc.wait()
    supervise_until(run, lambda: started(CRASH_LIMIT + 3))
    assert len(child.deaths) == CRASH_LIMIT + 2  # every one counted, for the backoff
    run.stop()
    assert child.proc is not None and child.proc.poll() is not None


def test_a_child_that_exits_as_often_as_a_crash_loop_between_kills_still_is_one(
    tmp_path: Path,
) -> None:
    # its first start exits with code 3 at once, the next sleeps until killed, and so on;
    # each start writes its pid and which it is
    run = launcher(tmp_path)
    marker = tmp_path / "starts"
    script = (
        f"import os, pathlib, time\nmarker = pathlib.Path({str(marker)!r})\n"
        "n = len(marker.read_text().split()) if marker.exists() else 0\n"
        "open(marker, 'a').write(f'{os.getpid()}:{n % 2} ')\n"
        "if n % 2 == 0: raise SystemExit(3)\ntime.sleep(60)"
    )
    child = Child("halting", [sys.executable, "-c", script], dict(os.environ))
    run.run_child(child)
    killed: set[int] = set()

    def kill_the_sleeper() -> bool:  # a check that acts: kills each sleeping start once
        written = marker.read_text().split() if marker.exists() else []
        proc = child.proc
        if proc is not None and f"{proc.pid}:1" in written and proc.pid not in killed:
            proc.kill()
            killed.add(proc.pid)
        return False

    with pytest.raises(ConfigError) as err:
        supervise_until(run, kill_the_sleeper)
    assert f"halting exited with code 3 {CRASH_LIMIT} times" in str(err.value)
    assert len(killed) == CRASH_LIMIT - 1  # the kills between the exits counted for nothing
    run.stop()


def test_a_crash_loop_stops_supervision_naming_the_child_and_quoting_its_log(
    tmp_path: Path,
) -> None:
    run = launcher(tmp_path)
    script = "print('cannot open the GPU: no such device', flush=True); raise SystemExit(3)"
    run.run_child(Child("flaky", [sys.executable, "-c", script], dict(os.environ)))
    with pytest.raises(ConfigError) as err:
        supervise_until(run, lambda: False)
    message = str(err.value)
    assert f"flaky exited with code 3 {CRASH_LIMIT} times" in message
    assert "cannot open the GPU: no such device" in message
    run.stop()


def listening() -> socket.socket:
    """A port another process holds (this test's socket, listening)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    return sock


def test_a_port_asked_for_that_is_taken_stops_start_up_before_anything_starts(
    tmp_path: Path,
) -> None:
    run = launcher(tmp_path)
    run.models.write_text(CATALOG)
    with listening() as held:
        port = _bound_port(held)
        run.metrics_port = port
        with pytest.raises(ConfigError, match=f"port {port} on 127.0.0.1 is taken"):
            run.start()
    assert run.children == {} and run.redis_url == ""


def test_a_default_port_that_is_taken_gives_a_free_one_held_from_the_choice_on() -> None:
    with listening() as held:
        default = _bound_port(held)
        sock = _port(None, default, "--metrics-port")
        assert sock is not None
        with sock:
            port = _bound_port(sock)
            assert port not in (0, default)
            with pytest.raises(ConfigError, match="--flower-port"):  # nobody else gets it
                _port(port, default, "--flower-port")
    assert _port(0, default, "--metrics-port") is None  # 0: not served at all


def test_two_fleets_started_at_once_each_print_the_metrics_and_flower_they_serve(
    tmp_path: Path,
) -> None:
    """Both want the default ports (9464, 5555) at the same moment, with no --metrics-port
    or --flower-port; each must print, and record, the URLs its own router and Flower
    serve, whichever of them got the defaults."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(CATALOG)
    hosts = ("race-a", "race-b")
    homes = {host: tmp_path / host for host in hosts}
    args = ["--sim-gpus", "1x2GiB", "--flower"]
    starts = [
        fleet_up(catalog, args, fleet_env(GPUFLEET_HOST=h, GPUFLEET_HOME=str(homes[h])))
        for h in hosts
    ]
    with ExitStack() as stack:
        with ThreadPoolExecutor(len(starts)) as pool:
            entering = [pool.submit(start.__enter__) for start in starts]
            wait(entering)
        for start, entered in zip(starts, entering, strict=True):
            if entered.exception() is None:
                stack.push(start.__exit__)  # stopped on the way out, whatever happens
        fleets: list[RunningFleet] = [entered.result() for entered in entering]
        metrics = [_printed(f, r"metrics:\s+(\S+)") for f in fleets]
        flowers = [_printed(f, r"Flower:\s+(\S+) \(basic auth (\S+)\)") for f in fleets]
        assert len({url for (url,) in metrics}) == 2, metrics
        assert len({url for url, _ in flowers}) == 2, flowers
        for host, (url,), (flower, auth) in zip(hosts, metrics, flowers, strict=True):
            recorded = json.loads(connection_path(homes[host], "default").read_text())
            assert (recorded["metrics"], recorded["flower"]) == (url, flower)
            with urllib.request.urlopen(url, timeout=10) as response:
                text = response.read().decode()
            served = {
                sample.labels["host"]
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name == "gpufleet_gpu_memory_bytes"
            }
            assert served == {host}, (url, served)  # this fleet's GPU, not the other's
            # Its own Flower: the other fleet's has other credentials and answers 401.
            request = urllib.request.Request(
                f"{flower}/api/workers",
                headers={"Authorization": "Basic " + base64.b64encode(auth.encode()).decode()},
            )
            with urllib.request.urlopen(request, timeout=10) as response:
                assert response.status == 200
    for home in homes.values():  # stopped between calls: nothing of either fleet is left
        assert not (home / "default").exists(), sorted((home / "default").rglob("*"))


def test_a_stopped_fleet_keeps_only_its_in_hand_records_that_name_a_call(tmp_path: Path) -> None:
    # a worker stopped between calls leaves an empty record; one killed holding a call
    # leaves its id, which its next start under that name counts as a death
    folder = tmp_path / quarantine.IN_HAND
    folder.mkdir()
    (folder / "router@h").write_bytes(b"[]\0")
    (folder / "gpu0@h").write_bytes(b'["call-1"]\0"]')
    (folder / "gpu0@other").write_bytes(b"[]\0")  # another host's worker, on a shared home
    quarantine.tidy(folder, ["router@h", "gpu0@h"])
    assert sorted(p.name for p in folder.iterdir()) == ["gpu0@h", "gpu0@other"]
    (folder / "gpu0@h").write_bytes(b"[]\0")
    quarantine.tidy(folder, ["router@h", "gpu0@h"])
    assert sorted(p.name for p in folder.iterdir()) == ["gpu0@other"]
    quarantine.tidy(folder, ["gpu0@other"])
    assert not folder.exists()


def _printed(fleet: RunningFleet, pattern: str) -> tuple[str, ...]:
    """The groups of `pattern` in the line `gpufleet up` printed with it."""
    return next(m.groups() for line in fleet.lines if (m := re.search(pattern, line)))
