"""A worker's process identity (`worker.identity`): what tells a dead predecessor from a
live one, checked against real processes this test starts and stops."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from worker.identity import current, describe, gone, start_time, verdict


@pytest.fixture
def sleeper() -> Iterator[subprocess.Popen[bytes]]:
    """A process of this test's own, stopped however the test ends."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_this_process_and_its_parent_are_recorded_and_found_running() -> None:
    me = current()
    assert [pid for pid, _ in me["processes"]] == [os.getpid(), os.getppid()]
    found = verdict(me)
    assert found.dead is False and f"process {os.getpid()} still runs" in found.why


def test_a_worker_whose_processes_were_killed_is_dead(sleeper: subprocess.Popen[bytes]) -> None:
    recorded = describe([sleeper.pid])
    assert verdict(recorded).dead is False
    sleeper.kill()
    sleeper.wait()
    assert start_time(sleeper.pid) is None
    found = verdict(recorded)
    assert found.dead is True and str(sleeper.pid) in found.why


def test_a_reused_pid_does_not_keep_a_dead_worker_alive() -> None:
    recorded = current()
    recorded["processes"] = [[os.getpid(), "1"]]  # this pid, started at another time
    assert verdict(recorded).dead is True


def test_a_worker_of_another_machine_or_namespace_or_none_recorded_is_left_to_its_lease() -> None:
    here = current()
    for elsewhere in (here | {"machine": "another"}, here | {"pid_ns": "pid:[1]"}, {}, None):
        found = verdict(elsewhere)
        assert found.dead is None, elsewhere
        assert "lease" in found.why or "namespace" in found.why


def test_a_worker_of_another_boot_is_left_to_its_lease_machine_ids_are_copied() -> None:
    found = verdict(current() | {"boot": "an earlier boot"})
    assert found.dead is None and "lease" in found.why


def test_a_killed_process_not_yet_reaped_counts_as_gone() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    recorded = describe([proc.pid])
    proc.kill()  # a zombie until waited for, as a dead host's workers under PID 1
    try:
        for _ in range(100):
            if start_time(proc.pid) is None:
                break
            time.sleep(0.02)
        assert verdict(recorded).dead is True
    finally:
        proc.wait()


def test_a_pid_is_gone_once_its_process_exits_or_is_a_zombie_and_never_while_it_runs(
    sleeper: subprocess.Popen[bytes],
) -> None:
    assert not gone(os.getpid()) and not gone(sleeper.pid)
    sleeper.kill()  # a zombie until waited for
    for _ in range(100):
        if gone(sleeper.pid):
            break
        time.sleep(0.02)
    assert gone(sleeper.pid)
    sleeper.wait()
    assert gone(sleeper.pid)
    assert not gone(1)  # another user's or an unreadable process is never presumed gone
