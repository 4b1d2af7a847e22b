"""`gpufleet up`: start a whole fleet on one machine, keep it running, and stop all of it.

The `Launcher` starts a bundled Redis unless GPUFLEET_REDIS_URL names one (127.0.0.1, a
generated password, an append-only file in the fleet's own data directory), a router,
one GPU worker per GPU (NVML, or simulated), and Flower on request. It records how to
reach the fleet in a user-only connection file, so `gpufleet` commands and the
project's client find it with no setting.

It supervises every child (`supervise`, called about once a second):
- a child that dies is started again after a backoff (1 s, doubling to 30 s), with one
  log line that says which and why;
- a child that exits (an exit code, or a fault such as SIGSEGV) `CRASH_LIMIT` times
  within `CRASH_WINDOW_S` is a crash loop, which a setting that keeps it from starting
  causes: the launcher gives up with an error that names it and quotes its last log
  lines. A child killed by SIGKILL (`kill -9`, the OOM killer, a chaos test) is started
  again however often, as Kubernetes restarts any container: giving up would stop every
  other process of the fleet too (a 4-minute chaos soak, killing the router every 20 s
  or so, stopped its fleet that way). Kills that reach `CRASH_LIMIT` in the window get a
  warning that asks about memory. (Celery workers and Flower catch SIGTERM and SIGINT
  and exit, so those count as exits);
- each child runs in its own process group, so a dead Celery worker's pool children go
  with it; its successor, under the same node name, puts back first what it had taken
  and not acknowledged (`tasks.broker.presence`; else they would wait out the visibility
  timeout);
- the bundled Redis restarts on the same port and replays its append-only file, so no
  acknowledged write (no queued call) is lost;
- with `--redis-ha` the bundled Redis is a primary, two replicas and three Sentinels
  (`placement.server.sentinel`): the Sentinels fail a lost primary over, and the launcher
  starts each dead node again as a replica of the new primary, and each dead Sentinel.

Children also die with the launcher (PR_SET_PDEATHSIG on Linux), and `stop` ends them
in order, so nothing is left behind.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import redis

from placement.config import (
    DEFAULT_FLOWER_PORT,
    DEFAULT_METRICS_PORT,
    FROM_CONNECTION_FILE,
    FROM_DEFAULT,
    Settings,
    connection_path,
    safe_url,
)
from placement.errors import ConfigError, FleetStoppedError, GpufleetError
from placement.ledger import endpoint
from placement.ledger.keys import Keys
from placement.ledger.registry import Registry
from placement.ledger.tenancy import tenants
from placement.server.acl import ADMIN, CALLER, FLEET, OPERATOR, SENTINEL, Users, user_url
from placement.server.connections import CALLER_SHARE, ConnectionGuard, max_clients
from placement.server.redis_server import (
    HOST,
    RedisServer,
    die_with_parent_preexec,
    find_redis_server,
    redis_version,
)
from placement.server.sentinel import SentinelGroup
from placement.server.tenant_users import PASSWORDS, TenantUsers
from tasks import front
from tasks.broker import quarantine
from tasks.broker.claim import BrokerClaim
from tasks.broker.presence import take_waiting, with_tenants
from tasks.config import ROUTER_QUEUES, is_public, redis_conf
from tasks.front import fleet_map
from tasks.front.keys import UP_KEY_NAME, drop_tenants, new_key, replace_key
from tasks.serving.routing import gpu_queue
from worker.devices import Device, discover
from worker.lifecycle import live_owner

log = logging.getLogger(__name__)

DEFAULT_SIM_GPUS = "2x8GiB"
#: --redis-ha's replicas. Its primary takes a write only while a replica follows it, so
#: that a primary stopped past its failover and let go loses no write; with two, the
#: promoted one still has a replica as the other primary is lost or stopped.
HA_REPLICAS = 2
STOP_GRACE_S = 15.0
#: A child that exits this many times within the window is given up on (not for kills).
CRASH_LIMIT = 5
CRASH_WINDOW_S = 120.0
#: Restart backoff: 1 s, doubling, at most this.
MAX_BACKOFF_S = 30.0
LOG_LINES = 40  # kept per child, quoted when it crash-loops
STOPPED = (
    "the fleet stopped (gpufleet up ended) before this call ran; its bundled Redis, which "
    "held the call, is gone. Send the call again once a fleet runs"
)


@dataclass
class Child:
    """One process the launcher runs and keeps running."""

    name: str
    cmd: list[str]
    env: dict[str, str]
    queues: tuple[str, ...] = ()  # the queues it consumes: unacked messages go back there
    proc: subprocess.Popen[bytes] | None = None
    lines: collections.deque[str] = field(
        default_factory=lambda: collections.deque(maxlen=LOG_LINES)
    )
    # its deaths within `CRASH_WINDOW_S`: when, and whether it was killed (`killed`)
    deaths: collections.deque[tuple[float, bool]] = field(default_factory=collections.deque)
    restart_at: float | None = None
    pass_fds: tuple[int, ...] = ()  # listening sockets it serves on (the launcher keeps them)

    @property
    def node(self) -> str | None:
        """Its Celery node name (`-n`), or None for a process that is no Celery worker."""
        return self.cmd[self.cmd.index("-n") + 1] if "-n" in self.cmd else None

    def describe_exit(self) -> str:
        code = self.proc.returncode if self.proc is not None else None
        if code is not None and code < 0:
            return f"was killed by {signal.Signals(-code).name}"
        return f"exited with code {code}"

    @property
    def killed(self) -> bool:
        """Whether it died by SIGKILL (`kill -9`, the OOM killer), which it cannot catch,
        rather than exiting (any other end: a code, or a signal such as SIGSEGV)."""
        code = self.proc.returncode if self.proc is not None else None
        return code == -signal.SIGKILL


@dataclass
class Launcher:
    """The processes of one local fleet, supervised."""

    models: Path
    settings: Settings
    sim_gpus: str | None = None
    flower: bool = False
    flower_port: int | None = None  # None: the default, or a free port when that is taken
    flower_auth: str = ""
    metrics_port: int | None = None  # None: the default, or a free port when taken; 0: none
    redis_url: str = ""  # the registry, as the fleet's own processes reach it
    broker_url: str = ""  # the Celery broker: the registry's Redis unless set apart
    #: What callers use (`gpufleet url`), and what `gpufleet status` reads with: the
    #: bundled Redis's `caller` and `operator` users (placement.server.acl); with a Redis of
    #: yours, `redis_url` for both.
    caller_url: str = ""
    operator_url: str = ""
    devices: list[Device] = field(default_factory=list)
    children: dict[str, Child] = field(default_factory=dict)
    first_backoff_s: float = 1.0  # doubles with each death, up to MAX_BACKOFF_S
    #: A primary, two replicas and three Sentinels instead of one bundled Redis (--redis-ha).
    redis_ha: bool = False
    api_port: int | None = None  # OpenAI's API: None, the default or a free port; 0: none
    api_key: str = ""  # the key `gpufleet up` made for its API (`tasks.front.keys`)
    _redis: RedisServer | None = None
    _group: SentinelGroup | None = None  # the bundled Redis with --redis-ha
    _guard: ConnectionGuard | None = None  # callers' connections on the bundled Redis
    _tenant_users: TenantUsers | None = None  # tenants' users on the bundled Redis
    _claim: BrokerClaim | None = None  # the broker database, ours while we run (tasks.broker.claim)
    # Bound and listening from `start` on, for the router's /metrics and for Flower: the
    # children serve on these (passed down), so the ports printed are theirs for good.
    _metrics_socket: socket.socket | None = None
    _flower_socket: socket.socket | None = None
    _api_socket: socket.socket | None = None
    _stopping: bool = False

    @property
    def fleet(self) -> str:
        return self.settings.fleet

    @property
    def host(self) -> str:
        return self.settings.host

    @property
    def _bundled(self) -> bool:
        """Whether the fleet's Redis is this launcher's own."""
        return self._redis is not None or self._group is not None

    @property
    def connection_file(self) -> Path:
        return connection_path(self.settings.home, self.fleet)

    # --- start --------------------------------------------------------------------

    def start(self) -> None:
        if not self.models.is_file():
            raise ConfigError(
                f"{self.models}: no such catalog; pass --models or set GPUFLEET_MODELS"
            )
        self._metrics_socket = _port(self.metrics_port, DEFAULT_METRICS_PORT, "--metrics-port")
        self.metrics_port = _bound_port(self._metrics_socket)
        if self.flower:
            self._flower_socket = _port(self.flower_port, DEFAULT_FLOWER_PORT, "--flower-port")
            self.flower_port = _bound_port(self._flower_socket)
        self._api_socket = _port(self.api_port, front.DEFAULT_PORT, "--api-port")
        self.api_port = _bound_port(self._api_socket)
        if self.settings.url_from == FROM_CONNECTION_FILE:
            raise ConfigError(
                f"a gpufleet of fleet {self.fleet!r} already runs on this machine (see "
                f"{self.connection_file}); stop it, or start this one with GPUFLEET_FLEET=<name>"
            )
        external = self.settings.url_from != FROM_DEFAULT
        if external and self.redis_ha:
            raise ConfigError(
                "--redis-ha bundles its own Redis and Sentinels, but GPUFLEET_REDIS_URL names "
                "a Redis of yours; drop one of the two"
            )
        self.redis_url = self.settings.registry_url if external else ""
        self.settings.fleet_dir().mkdir(mode=0o700, parents=True, exist_ok=True)
        self.caller_url = self.operator_url = self.redis_url
        if not self.redis_url:
            self._start_bundled_redis()
        self.broker_url = self.settings.broker_url if external else self.redis_url
        simulated = self.sim_gpus or self.settings.sim_gpus
        self.devices = discover(simulated or DEFAULT_SIM_GPUS, simulate=bool(simulated))
        self._check_owners()
        self._claim = BrokerClaim(self.broker_url, self.fleet)
        self._claim.take()  # before any worker: a second fleet on this database stops here
        self._claim.keep(lambda exc: log.critical("another fleet took the broker: %s", exc))
        metrics: dict[str, str] = {}
        if self._metrics_socket is not None:
            fd = self._metrics_socket.fileno()
            metrics = {
                "GPUFLEET_METRICS_PORT": str(self.metrics_port),
                "GPUFLEET_METRICS_FD": str(fd),
            }
        self._add(
            "router",
            ["-Q", ",".join(ROUTER_QUEUES), "-n", f"router@{self.host}", "-c", "2"],
            "router",
            ROUTER_QUEUES if self._bundled else (),  # the queues are ours alone
            GPUFLEET_METRICS_ADDR="127.0.0.1",
            **metrics,
        )
        if self._metrics_socket is not None:  # served by every router process it starts
            self.children["router"].pass_fds = (self._metrics_socket.fileno(),)
        run = secrets.token_hex(4)  # this launcher's workers replace only each other
        for d in self.devices:
            queue = gpu_queue(self.host, [d.index])
            args = ["-Q", queue, "-n", f"gpu{d.index}@{self.host}", "-c", "1", "-P", "prefork"]
            self._add(
                f"gpu{d.index}",
                args,
                "gpu",
                (queue,),
                GPUFLEET_WORKER_GPUS=str(d.index),
                GPUFLEET_LINEAGE=f"up-{run}-gpu{d.index}",
            )
        if self.flower and self._flower_socket is not None:
            self.flower_auth = self.flower_auth or f"gpufleet:{secrets.token_urlsafe(12)}"
            fd = self._flower_socket.fileno()
            # Flower serves on the socket bound above (tasks.operator.flower_socket), not a
            # port of its own.
            cmd = [sys.executable, "-m", "tasks.operator.flower_socket", str(fd), "-A", "tasks.app"]
            cmd += ["flower", "--address=127.0.0.1", f"--port={self.flower_port}"]
            # Credentials in the environment, not on the command line `ps` shows.
            env = self._env("client", FLOWER_BASIC_AUTH=self.flower_auth)
            self.children["flower"] = Child("flower", cmd, env, pass_fds=(fd,))
        if self._api_socket is not None:
            self._add_api(self._api_socket.fileno())
        for child in list(self.children.values()):
            self.run_child(child)
        self._write_connection()
        # This process talks to the fleet too (readiness pings, the demo call).
        os.environ.update(GPUFLEET_REDIS_URL=self.redis_url, GPUFLEET_FLEET=self.fleet)

    def _start_bundled_redis(self) -> None:
        """One Redis, or with `redis_ha` a primary, two replicas and three Sentinels, each
        with the fleet's users and an append-only file in the fleet's directory."""
        data = self.settings.fleet_dir() / "redis"
        shutil.rmtree(data, ignore_errors=True)  # a new fleet starts with a new ledger
        # and no tenants: the passwords and HTTP API keys kept here for the last fleet's
        # would name Redis users that no longer exist
        (self.settings.fleet_dir() / PASSWORDS).unlink(missing_ok=True)
        drop_tenants(self.settings.fleet_dir() / front.KEY_FILE)
        binary = self.settings.redis_server or find_redis_server(newest=True)
        options: dict[str, Any] = {
            "binary": binary,
            "maxmemory": self.settings.redis_maxmemory or default_maxmemory(),
            "maxclients": max_clients(),
        }
        fleet, operator, caller, replication, sentinel, admin = (
            secrets.token_urlsafe(18) for _ in range(6)
        )  # admin: this process's alone, for tenants' users (`TenantUsers`)
        # Kept once started (a start that fails stops what it started itself).
        if self.redis_ha:
            group = SentinelGroup(
                users=Users(fleet, operator, caller, replication, sentinel, admin),
                data_root=data,
                replicas=HA_REPLICAS,
                min_replicas=1,
                **options,
            ).start()
            urls = {user: group.url_for(user) for user in (FLEET, CALLER, OPERATOR)}
            self._group = group
            nodes = group.nodes

            def sentinels() -> list[str]:  # a tenant's client finds the primary through them
                return [
                    user_url(f"redis://{HOST}:{s.port}", SENTINEL, sentinel)
                    for s in group.sentinels
                ]
        else:
            users = Users(fleet, operator, caller, admin=admin)
            server = RedisServer(data_dir=data, users=users, **options).start()
            urls = {user: server.url_for(user) for user in (FLEET, CALLER, OPERATOR)}
            self._redis = server
            nodes = [server]
            sentinels = list
        self.redis_url, self.caller_url = urls[FLEET], urls[CALLER]
        self.operator_url = urls[OPERATOR]
        self._guard = ConnectionGuard(self.redis_url, int(CALLER_SHARE * max_clients()))
        self._guard.start()
        store = Registry.from_url(self.redis_url, self.fleet)
        major = redis_version(binary)[0]
        self._tenant_users = TenantUsers(
            store, lambda: [n.url_for(ADMIN) for n in nodes if n.running], major, sentinels
        ).start()

    def _check_owners(self) -> None:
        """Refuse to start on GPUs that live workers of this fleet own on this registry
        (another `gpufleet up` with the same host name, fleet and Redis). Workers of this
        host that died with it (a crash, this machine, their processes gone) are taken
        over at once (`worker.lifecycle.live_owner`), not waited out."""
        registry = Registry.from_url(self.redis_url, self.fleet)
        try:
            for d in self.devices:
                owner = live_owner(registry, d.gpu_id(self.host))
                if owner is not None:
                    raise ConfigError(
                        f"GPU {d.gpu_id(self.host)} is owned by live worker {owner.worker} "
                        f"({owner.why}) of fleet {self.fleet!r} on {safe_url(self.redis_url)}: "
                        f"another gpufleet runs here. Stop it, or start this one as a second "
                        f"fleet on a Redis database of its own "
                        f"(GPUFLEET_REDIS_URL=redis://<host>:<port>/<db>) or, for simulated "
                        f"GPUs, as another host (GPUFLEET_HOST=<name>)"
                    )
        finally:
            registry.client.close()

    def _env(self, role: str, **extra: str) -> dict[str, str]:
        env = {
            **os.environ,
            "GPUFLEET_REDIS_URL": self.redis_url,
            "GPUFLEET_BROKER_URL": self.broker_url,
            "GPUFLEET_MODELS": str(self.models.resolve()),
            "GPUFLEET_FLEET": self.fleet,
            "GPUFLEET_HOST": self.host,
            "GPUFLEET_ROLE": role,
            "HF_HUB_OFFLINE": "1",
            **extra,
        }
        if all(d.simulated for d in self.devices):
            env["GPUFLEET_SIM_GPUS"] = self.sim_gpus or self.settings.sim_gpus or DEFAULT_SIM_GPUS
        return env

    def _add(
        self, name: str, args: list[str], role: str, queues: tuple[str, ...], **extra: str
    ) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", "tasks.app", "worker", *args]
        cmd += ["--loglevel=INFO", "-E", "--without-gossip", "--without-mingle"]
        self.children[name] = Child(name, cmd, self._env(role, **extra), queues)

    def _add_api(self, fd: int) -> None:
        """The HTTP front (`tasks.front`) on the socket bound for it, as the `caller` user
        of the bundled Redis, with a new key of its own in the fleet's key file."""
        keys = self.settings.fleet_dir() / front.KEY_FILE
        self.api_key = new_key()
        replace_key(keys, self.api_key, UP_KEY_NAME)
        cmd = [sys.executable, "-m", "tasks.operator.cli", "api", "--fd", str(fd)]
        cmd += ["--keys", str(keys)]
        # the caller's URL for both: results are read, and calls sent, as any caller's
        broker = self.caller_url if self._bundled else self.broker_url
        env = self._env("client", GPUFLEET_REDIS_URL=self.caller_url, GPUFLEET_BROKER_URL=broker)
        env["GPUFLEET_OPERATOR_URL"] = self.operator_url  # the map reads with it (fleet_map)
        self.children["api"] = Child("api", cmd, env, pass_fds=(fd,))

    @property
    def api_url(self) -> str | None:
        return f"http://127.0.0.1:{self.api_port}/v1" if self.api_port else None

    @property
    def map(self) -> dict[str, str] | None:
        """The live map's URL and the operator's name and password that open it
        (`tasks.front.fleet_map`); None without an API, or an operator password."""
        access = fleet_map.MapAccess(self.operator_url or None)
        if not self.api_port or not access.password:
            return None
        url = f"http://127.0.0.1:{self.api_port}/map"
        return {"url": url, "user": access.user, "password": access.password}

    def run_child(self, child: Child) -> None:
        """Start `child` (again) and keep it running from now on (see `supervise`)."""
        self.children[child.name] = child
        log.info("starting %s: %s", child.name, " ".join(child.cmd))
        child.proc = subprocess.Popen(
            child.cmd,
            env=child.env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # its own process group: its pool children die with it
            pass_fds=child.pass_fds,
            preexec_fn=die_with_parent_preexec(),  # noqa: PLW1509
        )
        assert child.proc.stdout is not None
        threading.Thread(target=_relay, args=(child.proc.stdout, child.lines), daemon=True).start()

    def _write_connection(self) -> None:
        """How to reach this fleet, for `gpufleet` commands and clients on this machine."""
        path = self.connection_file  # in the fleet's directory, made by `start`
        record = {
            "redis_url": self.caller_url,
            "operator_url": self.operator_url,
            "fleet_url": self.redis_url,
            "pid": os.getpid(),
            "fleet": self.fleet,
            "metrics": self.metrics_url,
            "flower": f"http://127.0.0.1:{self.flower_port}" if self.flower else None,
            "openai": {"base_url": self.api_url, "api_key": self.api_key} if self.api_url else None,
            "map": self.map,
        }
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as fh:
            json.dump(record, fh)
        os.replace(tmp, path)

    @property
    def metrics_url(self) -> str | None:
        return f"http://127.0.0.1:{self.metrics_port}/metrics" if self.metrics_port else None

    # --- ready ----------------------------------------------------------------------

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every GPU worker of this host holds a live lease, the router answers a
        ping, and the metrics and Flower answer on the ports that will be printed. Only
        this fleet's router and Flower can answer there: they serve on sockets this
        launcher bound (`_port`), and one bound but not served yet makes `_answers` time
        out."""
        registry = Registry.from_url(self.redis_url, self.fleet)
        deadline = time.monotonic() + timeout
        from tasks.app import app

        try:
            while time.monotonic() < deadline:
                self.supervise()
                snap = registry.snapshot()
                alive = sum(
                    g.host == self.host and g.alive(snap.now_ms) for g in snap.gpus.values()
                )
                if (
                    alive >= len(self.devices)
                    and app.control.ping([f"router@{self.host}"], timeout=1.0)
                    and _answers(self.metrics_url)
                    and (not self.flower or _answers(f"http://127.0.0.1:{self.flower_port}"))
                    and _answers(f"{self.api_url}/models" if self.api_url else None)
                ):
                    return
                time.sleep(0.5)
        finally:
            registry.client.close()
        raise ConfigError(f"the fleet did not become ready in {timeout:.0f} s; see the logs above")

    # --- supervise ------------------------------------------------------------------

    def supervise(self) -> None:
        """Restart what died (with backoff); raise `ConfigError` on a crash loop."""
        now = time.monotonic()
        if self._redis is not None and not self._redis.running and not self._stopping:
            log.error("the bundled redis-server died; starting it again on the same port")
            died = time.time()
            self._redis.restart()  # replays its append-only file
            # Every consumer's connection broke: what they had taken and not started is
            # in nobody's hands now (what they run, they may run twice: calls are safe to).
            restored = requeue_unacked(self.broker_url, self._queues(), before=died)
            if restored:
                log.warning("requeued %d call(s) taken before Redis restarted", restored)
        if self._group is not None and not self._stopping:
            for what in self._group.supervise():  # the fleet follows the Sentinels meanwhile
                log.error("bundled Redis: %s", what)
        for child in self.children.values():
            if child.proc is None or child.proc.poll() is None or self._stopping:
                continue
            if child.restart_at is None:
                self._died(child, now)
            elif now >= child.restart_at:
                child.restart_at = None
                self.run_child(child)  # it puts back what it held first (tasks/broker/presence.py)

    def _died(self, child: Child, now: float) -> None:
        assert child.proc is not None
        _kill_group(child.proc.pid)  # what it left behind (a Celery worker's pool children)
        while child.deaths and now - child.deaths[0][0] > CRASH_WINDOW_S:
            child.deaths.popleft()
        child.deaths.append((now, child.killed))
        kills = sum(killed for _, killed in child.deaths)
        exits = len(child.deaths) - kills
        if exits >= CRASH_LIMIT:
            tail = "\n".join(f"  {line}" for line in list(child.lines)[-15:]) or "  (no output)"
            raise ConfigError(
                f"{child.name} {child.describe_exit()} {exits} times in "
                f"{CRASH_WINDOW_S:.0f} s; giving up. Its last log lines:\n{tail}"
            )
        if child.killed and kills == CRASH_LIMIT:
            log.warning("%s was killed by SIGKILL %d times in %.0f s; if not by you, the "
                        "kernel's OOM killer may be ending it: see dmesg", child.name, kills,
                        CRASH_WINDOW_S)  # fmt: skip
        delay = min(MAX_BACKOFF_S, self.first_backoff_s * 2.0 ** (len(child.deaths) - 1))
        log.error("%s %s; starting it again in %.0f s", child.name, child.describe_exit(), delay)
        child.restart_at = now + delay

    # --- stop -----------------------------------------------------------------------

    def stop(self) -> None:
        """SIGTERM every child (Celery's warm shutdown), then SIGKILL stragglers; stop Redis."""
        self._stopping = True
        for child in self.children.values():
            if child.proc is not None and child.proc.poll() is None:
                child.proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for child in self.children.values():
            if child.proc is None:
                continue
            try:
                child.proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", child.name)
                child.proc.kill()
                child.proc.wait()
            _kill_group(child.proc.pid)
        queues = self._queues(with_parked=True)
        nodes = [node for child in self.children.values() if (node := child.node)]
        self.children.clear()
        if self._claim is not None:
            self._claim.close(release=not self._runs_elsewhere())
            self._claim = None
        if self._guard is not None:
            self._guard.stop()
            self._guard = None
        if self._tenant_users is not None:
            self._tenant_users.stop()
            self._tenant_users = None
        if self._bundled:
            self._fail_waiting(queues)
            for server in (self._redis, self._group):
                if server is not None:
                    server.stop()
            self._redis = self._group = None
            shutil.rmtree(self.settings.fleet_dir() / "redis", ignore_errors=True)
        for sock in (self._metrics_socket, self._flower_socket, self._api_socket):
            if sock is not None:
                sock.close()
        self._metrics_socket = self._flower_socket = self._api_socket = None
        self._remove_connection()
        home = self.settings.fleet_dir()
        quarantine.tidy(home / quarantine.IN_HAND, nodes)
        with contextlib.suppress(OSError):
            home.rmdir()  # a fleet that left nothing behind leaves no folder either

    def _queues(self, *, with_parked: bool = False) -> tuple[str, ...]:
        """The queues this host's workers take calls from: their own, every tenant's public
        queue and each tenant's queue of every GPU worker's (`tasks.serving.tenants.tenancy`);
        `with_parked`, the lists of the tenants' parked calls too
        (`placement.ledger.tenancy.quotas`)."""
        own = tuple(q for child in self.children.values() for q in child.queues)
        try:
            registry = Registry.from_url(self.redis_url, self.fleet)
            try:
                found = tenants.records(registry)
            finally:
                registry.client.close()
            parked = tuple(registry.keys.tenant_parked(t.name) for t in found.values())
            return with_tenants(own + tuple(t.queue for t in found.values()), found) + (
                parked if with_parked else ()
            )
        except GpufleetError as exc:
            log.warning("could not read the fleet's tenants: %s", exc)
            return own

    def _sent_lists(self, queues: tuple[str, ...]) -> dict[str, str]:
        """The lists among `queues` that hold callers' messages as sent, each with its
        tenant: the public queues, and the tenants' parked calls (`take_waiting`)."""
        parked = Keys(self.fleet).tenant_parked("")
        sent = {q: tenants.tenant_of(q) or tenants.DEFAULT for q in queues if is_public(q)}
        sent.update({q: q[len(parked) :] for q in queues if q.startswith(parked)})
        return sent

    def _fail_waiting(self, queues: tuple[str, ...]) -> None:
        """Answer the calls still waiting with `FleetStoppedError` before the bundled Redis,
        their broker and result store, goes: their callers learn why at once, rather than
        losing the result store's connection (docs/tasks.md, "When the fleet stops")."""
        from celery import Celery

        client = endpoint.connect(self.broker_url)
        results = Celery(set_as_current=False)
        results.conf.update(
            redis_conf(self.broker_url, self.redis_url, self.settings.visibility_timeout)
        )
        backend = results.backend
        try:
            waiting = take_waiting(client, queues, self._sent_lists(queues))
            for task_id in waiting:
                backend.mark_as_failure(task_id, FleetStoppedError(STOPPED))
        except Exception as exc:  # whatever a list holds, the stop goes on and leaves nothing
            log.warning("could not answer the calls still waiting: %s", exc)
            return
        finally:
            client.close()
        if waiting:
            log.warning("answered %d call(s) still waiting: %s", len(waiting), STOPPED)
            time.sleep(0.2)  # the answers' notifications reach their callers first

    def _runs_elsewhere(self) -> bool:
        """Whether GPU workers of this fleet on other hosts are alive (they use the broker)."""
        registry = Registry.from_url(self.redis_url, self.fleet)
        try:
            snap = registry.snapshot()
            return any(g.host != self.host and g.alive(snap.now_ms) for g in snap.gpus.values())
        except (redis.RedisError, GpufleetError):
            return False  # the release will not reach Redis either
        finally:
            registry.client.close()

    def _remove_connection(self) -> None:
        path = self.connection_file
        try:
            if json.loads(path.read_text()).get("pid") == os.getpid():
                path.unlink()
        except (OSError, ValueError):
            pass


def default_maxmemory() -> int:
    """The bundled Redis's memory cap unless GPUFLEET_REDIS_MAXMEMORY sets one: 10% of RAM,
    at least 256 MiB. A policy default, not a tuned figure: a tenth leaves the host's memory
    to the warm cache (25%) and the models, and still holds hundreds of calls at their
    size limit (`tasks.broker.intake`)."""
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return max(256 * 2**20, ram // 10)


def requeue_unacked(broker_url: str, queues: tuple[str, ...], before: float | None = None) -> int:
    """Return to their queues the messages of `queues` that a worker took and never
    acknowledged (kombu's Redis transport keeps them in its `unacked` hash until the
    visibility timeout), if taken before `before` (epoch seconds). Only for messages whose
    consumer is known to be gone: a dead worker, or connections a Redis restart broke."""
    from tasks.app import app

    restored = 0
    with app.connection_for_write(broker_url) as conn:
        channel: Any = conn.default_channel
        qos = channel.qos
        client = channel.client
        taken = dict(client.zrange(qos.unacked_index_key, 0, -1, withscores=True))
        for tag, payload in client.hgetall(qos.unacked_key).items():
            try:
                _, _, routing_key = json.loads(payload)
            except (ValueError, TypeError):
                continue
            if routing_key not in queues or (before is not None and taken.get(tag, 0) >= before):
                continue
            qos.restore_by_tag(tag.decode() if isinstance(tag, bytes) else tag, leftmost=True)
            restored += 1
    return restored


def _relay(stream: IO[bytes], lines: collections.deque[str]) -> None:
    """Copy a child's output to ours, keeping its last lines for a crash report."""
    for raw in iter(stream.readline, b""):
        line = raw.decode("utf-8", "replace").rstrip("\n")
        lines.append(line)
        with contextlib.suppress(OSError, ValueError):  # our stderr is gone: keep draining
            sys.stderr.write(line + "\n")


def _kill_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


def _port(requested: int | None, default: int, option: str) -> socket.socket | None:
    """A socket on 127.0.0.1, bound and listening, for a child to serve on (passed down
    to it): on `requested` (0: none, so None), or an error when another process holds that
    port; with nothing requested, on `default`, or on a free port when another process
    holds it. The launcher binds it before any child starts and keeps it open, so no other
    process can take the port between this choice and the child's serving, nor while the
    child restarts: the URL printed is the child's."""
    if requested == 0:
        return None
    wanted = default if requested is None else requested
    sock = _listen(wanted)
    if sock is not None:
        return sock
    if requested is not None:
        raise ConfigError(
            f"port {requested} on 127.0.0.1 is taken by another process; pass another "
            f"{option}, or 0 to turn it off"
        )
    sock = _listen(0)
    if sock is None:
        raise ConfigError(f"no free port on 127.0.0.1 for {option}")
    log.info("port %d is taken; using %d instead", default, _bound_port(sock))
    return sock


def _listen(port: int) -> socket.socket | None:
    """A socket bound to 127.0.0.1:`port` and listening, or None when the port is taken."""
    sock = socket.socket()
    try:
        # As http.server and tornado do: a port whose last connections linger in
        # TIME_WAIT is free; one another socket listens on is not.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", port))
        sock.listen(128)
    except OSError:
        sock.close()
        return None
    return sock


def _bound_port(sock: socket.socket | None) -> int:
    """The port `sock` is bound to; 0 for none."""
    if sock is None:
        return 0
    port: int = sock.getsockname()[1]
    return port


def _answers(url: str | None) -> bool:
    """True when nothing is to be served at `url`, or something answers there (within
    1 s: a socket the launcher bound that its child does not serve yet does not)."""
    if url is None:
        return True
    try:
        with urllib.request.urlopen(url, timeout=1.0):
            return True
    except urllib.error.HTTPError:
        return True  # it answered (Flower asks for its password)
    except OSError:
        return False
