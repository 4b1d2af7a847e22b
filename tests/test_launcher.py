"""The launcher's supervision, on plain child processes (no fleet needed)."""

from __future__ import annotations

import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from placement.config import Settings
from placement.errors import ConfigError
from tasks.launcher import CRASH_LIMIT, Child, Launcher


def launcher(tmp_path: Path) -> Launcher:
    settings = Settings.from_env({"GPUFLEET_HOME": str(tmp_path)})
    return Launcher(tmp_path / "models.yaml", settings, first_backoff_s=0.01)


def supervise_until(run: Launcher, done: Callable[[], bool], within_s: float = 20.0) -> None:
    deadline = time.monotonic() + within_s
    while not done():
        assert time.monotonic() < deadline, "not within the bound"
        run.supervise()
        time.sleep(0.02)


def test_a_child_that_dies_is_started_again(tmp_path: Path) -> None:
    run = launcher(tmp_path)
    marker = tmp_path / "starts"
    script = f"open({str(marker)!r}, 'a').write('x'); import time; time.sleep(60)"
    child = Child("sleeper", [sys.executable, "-c", script], dict(os.environ))
    run.run_child(child)
    first = child.proc
    assert first is not None
    supervise_until(run, marker.exists)
    first.kill()
    supervise_until(run, lambda: child.proc is not first and child.proc is not None)
    supervise_until(run, lambda: marker.read_text() == "xx")
    assert len(child.crashes) == 1
    run.stop()
    assert child.proc is not None and child.proc.poll() is not None


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
