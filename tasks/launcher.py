"""`gpufleet up`: start a whole fleet on one machine, and stop all of it.

An embedded Redis (127.0.0.1, no persistence) unless GPUFLEET_REDIS_URL names one, a
router worker, one GPU worker per GPU (NVML, or simulated), and Flower on request.
Children die with the launcher (PR_SET_PDEATHSIG on Linux), and Ctrl-C or SIGTERM
stops them in order, so nothing is left behind.
"""

from __future__ import annotations

import logging
import os
import secrets
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from placement.errors import ConfigError
from placement.redis_server import RedisServer, die_with_parent_preexec
from placement.registry import Registry
from tasks.config import ROUTER_QUEUE, safe_url
from tasks.routing import gpu_queue
from worker.devices import Device, discover
from worker.lifecycle import default_host

log = logging.getLogger(__name__)

DEFAULT_SIM_GPUS = "2x8GiB"
STOP_GRACE_S = 15.0


@dataclass
class Fleet:
    """The processes of one local fleet."""

    models: Path
    sim_gpus: str | None = None
    flower: bool = False
    flower_port: int = 5555
    flower_auth: str = ""
    metrics_port: int = 0  # the router's /metrics on 127.0.0.1; 0: none
    fleet: str = "default"
    host: str = field(default_factory=default_host)
    redis_url: str = ""
    devices: list[Device] = field(default_factory=list)
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    _redis: RedisServer | None = None

    def start(self) -> None:
        if not self.models.is_file():
            raise ConfigError(
                f"{self.models}: no such catalog; pass --models or set GPUFLEET_MODELS"
            )
        self.redis_url = os.environ.get("GPUFLEET_REDIS_URL", "")
        if not self.redis_url:
            self._redis = RedisServer().start()
            self.redis_url = self._redis.url
        # This process talks to the fleet too (readiness pings, the demo call).
        os.environ.update(GPUFLEET_REDIS_URL=self.redis_url, GPUFLEET_FLEET=self.fleet)
        simulated = self.sim_gpus or os.environ.get("GPUFLEET_SIM_GPUS")
        self.devices = discover(simulated or DEFAULT_SIM_GPUS, simulate=bool(simulated))
        self._check_owners()
        metrics = {"GPUFLEET_METRICS_PORT": str(self.metrics_port)} if self.metrics_port else {}
        self._spawn(
            "router",
            ["-Q", ROUTER_QUEUE, "-n", f"router@{self.host}", "-c", "2"],
            "router",
            GPUFLEET_METRICS_ADDR="127.0.0.1",
            **metrics,
        )
        run = secrets.token_hex(4)  # this launcher's workers replace only each other
        for d in self.devices:
            queue = gpu_queue(self.host, [d.index])
            args = ["-Q", queue, "-n", f"gpu{d.index}@{self.host}", "-c", "1", "-P", "prefork"]
            lineage = f"up-{run}-gpu{d.index}"
            self._spawn(
                f"gpu{d.index}",
                args,
                "gpu",
                GPUFLEET_WORKER_GPUS=str(d.index),
                GPUFLEET_LINEAGE=lineage,
            )
        if self.flower:
            self.flower_auth = self.flower_auth or f"gpufleet:{secrets.token_urlsafe(12)}"
            flower = [sys.executable, "-m", "celery", "-A", "tasks.app", "flower"]
            flower += ["--address=127.0.0.1", f"--port={self.flower_port}"]
            # Credentials in the environment, not on the command line `ps` shows.
            self._popen("flower", flower, self._env("client", FLOWER_BASIC_AUTH=self.flower_auth))

    def _check_owners(self) -> None:
        """Refuse to start on GPUs that live workers of this fleet own on this registry
        (another `gpufleet up` with the same host name, fleet and Redis)."""
        registry = Registry.from_url(self.redis_url, self.fleet)
        for d in self.devices:
            owner = registry.owner(d.gpu_id(self.host))
            if owner is not None:
                raise ConfigError(
                    f"GPU {d.gpu_id(self.host)} is owned by live worker {owner[0]} of fleet "
                    f"{self.fleet!r} on {safe_url(self.redis_url)}: another gpufleet runs "
                    f"here. Stop it, or start this one as a second fleet with "
                    f"GPUFLEET_FLEET=<name> (or, for simulated GPUs, GPUFLEET_HOST=<name>)"
                )
        registry.client.close()

    def _env(self, role: str, **extra: str) -> dict[str, str]:
        env = {
            **os.environ,
            "GPUFLEET_REDIS_URL": self.redis_url,
            "GPUFLEET_BROKER_URL": os.environ.get("GPUFLEET_BROKER_URL", self.redis_url),
            "GPUFLEET_MODELS": str(self.models.resolve()),
            "GPUFLEET_FLEET": self.fleet,
            "GPUFLEET_HOST": self.host,
            "GPUFLEET_ROLE": role,
            "HF_HUB_OFFLINE": "1",
            **extra,
        }
        if all(d.simulated for d in self.devices):
            env["GPUFLEET_SIM_GPUS"] = (
                self.sim_gpus or os.environ.get("GPUFLEET_SIM_GPUS") or DEFAULT_SIM_GPUS
            )
        return env

    def _spawn(self, name: str, args: list[str], role: str, **extra: str) -> None:
        cmd = [sys.executable, "-m", "celery", "-A", "tasks.app", "worker", *args]
        cmd += ["--loglevel=INFO", "-E", "--without-gossip", "--without-mingle"]
        self._popen(name, cmd, self._env(role, **extra))

    def _popen(self, name: str, cmd: list[str], env: dict[str, str]) -> None:
        log.info("starting %s: %s", name, " ".join(cmd))
        # Children log to our stderr; stdout stays the launcher's own output.
        self.procs[name] = subprocess.Popen(
            cmd,
            env=env,
            stdout=sys.stderr.fileno(),
            preexec_fn=die_with_parent_preexec(),  # noqa: PLW1509
        )

    def wait_ready(self, timeout: float = 120.0) -> None:
        """Until every GPU worker holds a live lease and the router answers a ping."""
        registry = Registry.from_url(self.redis_url, self.fleet)
        deadline = time.monotonic() + timeout
        from tasks.app import app

        while time.monotonic() < deadline:
            self.check_alive()
            snap = registry.snapshot()
            alive = sum(1 for g in snap.gpus.values() if g.alive(snap.now_ms))
            if alive >= len(self.devices) and app.control.ping(
                [f"router@{self.host}"], timeout=1.0
            ):
                return
            time.sleep(0.5)
        raise ConfigError(f"the fleet did not become ready in {timeout:.0f} s; see the logs above")

    def check_alive(self) -> None:
        for name, proc in self.procs.items():
            if proc.poll() is not None:
                raise ConfigError(f"{name} exited with code {proc.returncode}; see its log above")

    def stop(self) -> None:
        """SIGTERM every child (Celery's warm shutdown), then SIGKILL stragglers; stop Redis."""
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + STOP_GRACE_S
        for name, proc in self.procs.items():
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("%s did not stop in time; killing it", name)
                proc.kill()
                proc.wait()
        self.procs.clear()
        if self._redis is not None:
            self._redis.stop()
            self._redis = None
