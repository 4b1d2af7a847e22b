"""Which processes a GPU worker is, so that a host started again can tell a dead
predecessor from a live one.

A worker owns its GPUs in the ledger under a lease of a few seconds. When a whole host
dies (SIGKILL, OOM killer, power), its records outlive it until that lease lapses, and a
`gpufleet up` on the same host in the meantime found the GPUs "owned by a live worker".
So a worker records, when it registers, who it is: the machine (`/etc/machine-id`), this
boot of it, its PID namespace, and the PIDs and start times of itself and of its parent
(the Celery main process, for a pool child). A process started later on the same machine,
in the same PID namespace and boot, can then check those processes: if none of them runs
any more (a PID may be reused, so its start time must match; a zombie runs no more), the
worker is dead, whatever its lease says, and its GPUs may be taken over at once.

Nothing is presumed dead that cannot be checked: a worker of another machine or boot (a
machine id is copied with VM and container images), another PID namespace (another
container), a process this user cannot read, or one without a recorded identity, is left
to its lease. Linux only; elsewhere the identity is empty and every verdict is "cannot
tell".
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

MACHINE_ID_FILES = (Path("/etc/machine-id"), Path("/var/lib/dbus/machine-id"))
BOOT_ID = Path("/proc/sys/kernel/random/boot_id")


def _read(path: Path) -> str:
    try:
        return path.read_text().strip()
    except OSError:
        return ""


def _machine() -> str:
    return next((m for m in map(_read, MACHINE_ID_FILES) if m), "")


def _pid_namespace() -> str:
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, str] | None:
    """Process `pid`'s state and start time (clock ticks since boot, /proc/<pid>/stat
    fields 3 and 22), or None when no process of that pid can be read here."""
    stat = _read(Path(f"/proc/{pid}/stat"))
    fields = stat.rsplit(")", 1)[-1].split()  # the name in parentheses may hold spaces
    return (fields[0], fields[19]) if len(fields) > 19 else None


def start_time(pid: int) -> str | None:
    """When process `pid` started, or None when no running process of that pid can be
    read."""
    return _running_since(_stat(pid))


def _running_since(found: tuple[str, str] | None) -> str | None:
    """The start time in `_stat`'s answer, unless it is none or a zombie's (killed, not
    yet reaped by its new parent: in a container, PID 1 may never reap it), which runs no
    more."""
    return None if found is None or found[0] in ("Z", "X") else found[1]


def _exists(pid: int) -> bool:
    """Whether any process has `pid`, readable here or not (signal 0 checks only)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # another user's process
    return True


def gone(pid: int) -> bool:
    """Whether process `pid` of this machine runs no more: no process has it, or it is a
    zombie. False wherever that cannot be told (no `/proc`; a process this user cannot
    read)."""
    found = _stat(pid)
    if found is not None:
        return _running_since(found) is None
    return Path("/proc/self").is_dir() and not _exists(pid)


def describe(pids: Iterable[int]) -> dict[str, Any]:
    """The identity of processes `pids` of this machine (empty off Linux)."""
    machine, boot, namespace = _machine(), _read(BOOT_ID), _pid_namespace()
    if not (machine and boot and namespace):
        return {}
    processes = [[pid, started] for pid in pids if (started := start_time(pid)) is not None]
    return {"machine": machine, "boot": boot, "pid_ns": namespace, "processes": processes}


def domain() -> str:
    """The processes that may map this one's memory through `/proc/<pid>/fd` (a warm
    copy, `worker.warm.sharing`): those of this boot of this machine, in this PID namespace,
    run by this user and group (the kernel's check for reading another process's
    descriptors). '' off Linux."""
    boot, namespace = _read(BOOT_ID), _pid_namespace()
    if not (boot and namespace):
        return ""
    return f"{boot}/{namespace}/{os.getuid()}:{os.getgid()}"


def current() -> dict[str, Any]:
    """This process's identity, and its parent's (a pool child's Celery main process)."""
    return describe(dict.fromkeys([os.getpid(), os.getppid()]))


@dataclass(frozen=True)
class Verdict:
    """Whether the processes of an identity are gone (None: cannot tell here), and why."""

    dead: bool | None
    why: str


def verdict(identity: Mapping[str, Any] | None) -> Verdict:
    """Whether the worker of `identity` is dead, checked from this process."""
    if not identity or not identity.get("processes"):
        return Verdict(None, "it recorded no process identity; wait for its lease to lapse")
    here = describe([])
    # Another boot counts as another machine: machine ids are copied with VM and container
    # images, and a host cannot restart within a lease of seconds anyway.
    if not here or (identity.get("machine"), identity.get("boot")) != (
        here["machine"],
        here["boot"],
    ):
        return Verdict(None, "it runs on another machine; wait for its lease to lapse")
    if identity.get("pid_ns") != here["pid_ns"]:
        return Verdict(None, "it runs in another PID namespace (another container?)")
    for pid, started in identity["processes"]:
        found = _stat(int(pid))
        if found is None and _exists(int(pid)):
            return Verdict(None, f"its process {pid} cannot be read here (another user's?)")
        if _running_since(found) == started:
            return Verdict(False, f"its process {pid} still runs on this machine")
    pids = ", ".join(str(pid) for pid, _ in identity["processes"])
    return Verdict(True, f"its processes ({pids}) are gone")


__all__ = ["Verdict", "current", "describe", "domain", "gone", "start_time", "verdict"]
