"""Every call a worker ran, recorded outside Redis: `GPUFLEET_RUN_LOG`.

With the variable set, each process that runs calls appends one line to that file for each
call it ran, as the call ends (Celery's `task_postrun`, in the process that ran it, after
its answer is stored): ``<unix time> <task id> <state> <node> <pid>``. A call run twice
shows twice, wherever the two runs were. Celery's `task-succeeded` events say the same,
but through Redis: those a failing primary held are lost with it, so they count runs from
below. `bench.failover` counts runs from this file.

Only calls that ended here with an answer count, a failure as well as a success (one
whose time limit ended before it ran is answered so, and counts too): a call handed on
(`Ignore`d: a router's, or one whose answer was stored already) or retried is recorded
where it ends. Each line is one `write` to a
file opened for appending, so lines of many processes on one host do not interleave; on
many hosts, give each its own file.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from typing import Any

from celery import states
from celery.signals import task_postrun

from tasks import context
from tasks.config import CALL_TASKS

log = logging.getLogger(__name__)

RAN = frozenset({states.SUCCESS, states.FAILURE})  # ends of a call that ran


@task_postrun.connect
def _record(
    sender: Any = None, task_id: Any = None, task: Any = None, state: Any = None, **_: Any
) -> None:
    path = context.settings().run_log
    if path is None or getattr(sender, "name", None) not in CALL_TASKS or state not in RAN:
        return
    node = getattr(getattr(task, "request", None), "hostname", None) or socket.gethostname()
    line = f"{time.time():.3f} {task_id} {state} {node} {os.getpid()}\n".encode()
    try:
        descriptor = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(descriptor, line)
        finally:
            os.close(descriptor)
    except OSError as exc:
        log.warning("could not record call %s in the run log %s: %s", task_id, path, exc)


def runs(path: str | os.PathLike[str]) -> dict[str, int]:
    """How many times each task id ran, from a run log (none: an empty or missing file)."""
    counts: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                words = line.split()
                if len(words) >= 2:
                    counts[words[1]] = counts.get(words[1], 0) + 1
    except FileNotFoundError:
        pass
    return counts
