"""compose.yaml: the rules a GPU host relies on, and the file as docker-compose reads it.

The structural tests read the file with PyYAML and need nothing else. The health checks
run for real: Redis's against a redis-server started with the file's arguments, Flower's
against Flower started with the file's command and environment, and against a stand-in
server that answers with and without auth. The `docker-compose config` tests need the
tool: the Debian package `docker-compose` (Compose v1, 1.28 or later), or the Compose v2
plugin (`docker compose`). Without it they fail and say how to install it: a skipped
check is not a passed one. `config` reads the file only, so no Docker engine is needed.
"""

from __future__ import annotations

import base64
import functools
import http.server
import os
import re
import shlex
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest
import redis
import yaml

from placement.ledger import endpoint
from placement.server.redis_server import find_redis_server
from tasks.config import ROUTER_QUEUE
from tasks.serving.routing import gpu_queue
from tests.ports import free_port

COMPOSE = Path(__file__).resolve().parents[1] / "compose.yaml"
COMPOSE_HA = COMPOSE.with_name("compose.ha.yaml")
REQUIRED = ("REDIS_PASSWORD", "FLOWER_USER", "FLOWER_PASSWORD")
ENV = {"REDIS_PASSWORD": "0123abcd", "FLOWER_USER": "admin", "FLOWER_PASSWORD": "flowerpw"}
INSTALL_HINT = (
    "docker-compose is not installed, so compose.yaml cannot be validated: install it with "
    "`apt-get install -y docker-compose` (Debian package, Compose v1) or the Compose v2 "
    "plugin (`docker compose`); scripts/test.sh and CI install it with apt"
)
_VARIABLE = re.compile(
    r"\$\$|\$\{(?P<name>[A-Za-z_][A-Za-z0-9_]*)(?:(?P<op>:?[-?])(?P<arg>[^}]*))?\}"
)


# --- reading the file --------------------------------------------------------------------


def interpolate(value: str, env: Mapping[str, str]) -> str:
    """Compose's `${VAR}`, `${VAR:-default}`, `${VAR:?error}` and `$$`, for the tests."""

    def one(match: re.Match[str]) -> str:
        if match.group(0) == "$$":
            return "$"
        name, op, arg = match.group("name", "op", "arg")
        current = env.get(name)
        if op in (":-", ":?") and not current:
            current = None
        if current is not None:
            return current
        if op and op.endswith("?"):
            raise LookupError(f"{name}: {arg}")
        return arg if op else ""

    return _VARIABLE.sub(one, value)


def resolve(value: Any, env: Mapping[str, str] = ENV) -> Any:
    if isinstance(value, str):
        return interpolate(value, env)
    if isinstance(value, list):
        return [resolve(v, env) for v in value]
    if isinstance(value, dict):
        return {k: resolve(v, env) for k, v in value.items()}
    return value


@pytest.fixture(scope="module")
def services() -> dict[str, dict[str, Any]]:
    data = yaml.safe_load(COMPOSE.read_text())
    found: dict[str, dict[str, Any]] = data["services"]
    return found


def environment(service: Mapping[str, Any]) -> dict[str, str]:
    env = service.get("environment") or {}
    assert isinstance(env, dict), "write environment as a mapping"
    return {str(k): "" if v is None else str(v) for k, v in env.items()}


def argv(service: Mapping[str, Any]) -> list[str]:
    command = resolve(service["command"])
    return list(command) if isinstance(command, list) else shlex.split(command)


def option(args: list[str], flag: str) -> str:
    assert flag in args, f"{flag} missing from {args}"
    return args[args.index(flag) + 1]


def role(service: Mapping[str, Any]) -> str | None:
    return environment(service).get("GPUFLEET_ROLE")


def gpu_workers(
    services: Mapping[str, dict[str, Any]], profile: str | None = None
) -> dict[str, dict[str, Any]]:
    """The GPU workers (of one compose profile: `gpu`, real GPUs, or `sim`)."""
    return {
        name: s
        for name, s in services.items()
        if role(s) == "gpu" and (profile is None or s.get("profiles") == [profile])
    }


def gpufleet_services(services: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Every service that runs the gpufleet image (all but redis)."""
    return {name: s for name, s in services.items() if "GPUFLEET_REDIS_URL" in environment(s)}


def health_command(service: Mapping[str, Any]) -> str:
    test = service["healthcheck"]["test"]
    assert test[0] == "CMD-SHELL", test
    return str(resolve(test[1]))


def device_requests(service: Mapping[str, Any]) -> list[dict[str, Any]]:
    reservations = service.get("deploy", {}).get("resources", {}).get("reservations", {})
    devices: list[dict[str, Any]] = reservations.get("devices", [])
    return devices


# --- structure (PyYAML only) -----------------------------------------------------------


def test_the_fleet_is_redis_a_router_flower_and_one_worker_per_gpu(
    services: dict[str, dict[str, Any]],
) -> None:
    assert {"redis", "router", "flower"} <= set(services)
    assert role(services["router"]) == "router"
    assert len(gpu_workers(services, "gpu")) >= 2
    assert set(gpufleet_services(services)) == set(services) - {"redis"}


def test_gpu_workers_start_in_a_profile_real_or_simulated_and_the_rest_always(
    services: dict[str, dict[str, Any]],
) -> None:
    """`--profile gpu` on a GPU host, `--profile sim` on any host (no NVIDIA toolkit)."""
    real, sim = gpu_workers(services, "gpu"), gpu_workers(services, "sim")
    assert set(real) | set(sim) == set(gpu_workers(services)) and len(sim) >= 2
    for name in ("redis", "router", "flower"):
        assert "profiles" not in services[name], f"{name} must start in every profile"
    for name, service in sim.items():
        env = environment(service)
        count = int(resolve(env["GPUFLEET_SIM_GPUS"]).split("x")[0])
        assert int(env["GPUFLEET_WORKER_GPUS"]) < count, f"{name} claims a GPU it lacks"
        assert not device_requests(service), f"{name} needs no GPU driver"
    claimed = [environment(s)["GPUFLEET_WORKER_GPUS"] for s in sim.values()]
    assert len(set(claimed)) == len(claimed), f"two simulated workers claim one GPU: {claimed}"


def test_every_service_has_a_health_check(services: dict[str, dict[str, Any]]) -> None:
    for name, service in services.items():
        check = service.get("healthcheck")
        assert check, f"{name} has no healthcheck"
        assert not check.get("disable"), f"{name} disables its healthcheck"
        assert check["test"][0] in ("CMD", "CMD-SHELL"), f"{name}: {check['test']}"
        for key in ("interval", "timeout", "retries", "start_period"):
            assert key in check, f"{name}: healthcheck without {key}"


def test_depends_on_waits_until_each_dependency_is_healthy(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in gpufleet_services(services).items():
        depends = service.get("depends_on")
        assert isinstance(depends, dict), f"{name}: depends_on must name a condition"
        assert "redis" in depends, f"{name} does not wait for redis"
        for target, rule in depends.items():
            assert rule == {"condition": "service_healthy"}, f"{name} -> {target}: {rule}"
            assert services[target].get("healthcheck"), f"{name} waits on {target}, unchecked"


def test_redis_requires_the_password_from_the_environment(
    services: dict[str, dict[str, Any]],
) -> None:
    redis_service = services["redis"]
    command = redis_service["command"]
    assert command[0] == "redis-server"
    assert re.fullmatch(r"\$\{REDIS_PASSWORD:\?[^}]+\}", option(command, "--requirepass"))
    # The health check authenticates through REDISCLI_AUTH, not on a command line.
    assert re.fullmatch(
        r"\$\{REDIS_PASSWORD:\?[^}]+\}", environment(redis_service)["REDISCLI_AUTH"]
    )
    assert "-a" not in health_command(redis_service).split()


def test_every_gpufleet_process_reaches_redis_with_the_password_and_shares_settings(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in gpufleet_services(services).items():
        env = environment(service)
        assert re.fullmatch(
            r"redis://:\$\{REDIS_PASSWORD:\?[^}]+\}@\$\{GPUFLEET_REDIS_ADDR:-redis:6379\}/0",
            env["GPUFLEET_REDIS_URL"],
        ), name  # this file's Redis unless a joining host names its fleet's
        assert resolve(env["GPUFLEET_TORCH_THREADS"]) == "", name  # documented, passed
        assert env["GPUFLEET_MODELS"] == "/app/models.yaml", name
        assert resolve(env["GPUFLEET_FLEET"]) == "default", name
        assert "/app/models.yaml:ro" in [
            str(resolve(v)).split(":", 1)[1] for v in service["volumes"]
        ]


def test_redis_flower_the_api_and_metrics_listen_on_loopback_unless_told_otherwise(
    services: dict[str, dict[str, Any]],
) -> None:
    assert resolve(services["redis"]["ports"]) == ["127.0.0.1:6379:6379"]
    assert resolve(services["flower"]["ports"]) == ["127.0.0.1:5555:5555"]
    assert resolve(services["flower"]["ports"], {"FLOWER_BIND": "0.0.0.0"}) == ["0.0.0.0:5555:5555"]
    assert resolve(services["api"]["ports"]) == ["127.0.0.1:8000:8000"]
    assert argv(services["api"])[:2] == ["gpufleet", "api"]
    router = services["router"]
    assert resolve(router["ports"]) == ["127.0.0.1:9464:9464"]
    assert environment(router)["GPUFLEET_METRICS_PORT"] == "9464"  # the published one
    for name, service in services.items():
        if name not in ("redis", "flower", "router", "api"):
            assert "ports" not in service, f"{name} publishes a port"


def test_the_router_consumes_the_default_queue(services: dict[str, dict[str, Any]]) -> None:
    args = argv(services["router"])
    assert args[:4] == ["celery", "-A", "tasks.app", "worker"]
    assert option(args, "-Q") == ROUTER_QUEUE
    assert option(args, "-n") == "router@%h"
    assert option(args, "-c") == "2"


def test_every_gpu_worker_reserves_nvidia_gpus_with_the_gpu_capability(
    services: dict[str, dict[str, Any]],
) -> None:
    for name, service in gpu_workers(services, "gpu").items():
        requests = device_requests(service)
        assert len(requests) == 1, f"{name}: {requests}"
        request = requests[0]
        assert request["driver"] == "nvidia", name
        assert "gpu" in request["capabilities"], name
        assert ("device_ids" in request) != ("count" in request), f"{name}: device_ids or count"
        ids = request.get("device_ids", [])
        assert all(isinstance(i, str) and i.isdigit() for i in ids), f"{name}: quote ids"
        assert len(set(ids)) == len(ids), f"{name}: repeated device ids {ids}"
    for name, service in services.items():
        if name not in gpu_workers(services, "gpu"):
            assert not device_requests(service), f"{name} reserves GPUs it does not use"


def test_every_gpu_worker_sees_the_gpu_it_claims_and_no_two_claim_the_same(
    services: dict[str, dict[str, Any]],
) -> None:
    """The container numbers its visible GPUs 0, 1, ... in PCI order, which is the order
    of their host indices; GPUFLEET_WORKER_GPUS is read inside the container."""
    claimed: dict[tuple[str, str], str] = {}
    for name, service in gpu_workers(services, "gpu").items():
        env = environment(service)
        index = int(env["GPUFLEET_WORKER_GPUS"])
        request = device_requests(service)[0]
        if "device_ids" in request:
            visible = sorted(request["device_ids"], key=int)
            assert index < len(visible), f"{name} claims GPU {index}, sees only {visible}"
            physical = visible[index]
        else:
            assert request["count"] == "all", f"{name}: a count must be `all`"
            physical = str(index)
        for hidden in ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES"):
            assert hidden not in env, f"{name}: {hidden} would renumber or hide its GPUs"
        assert env["CUDA_DEVICE_ORDER"] == "PCI_BUS_ID", name
        key = (resolve(env["GPUFLEET_HOST"]), physical)
        assert key not in claimed, f"{name} and {claimed.get(key)} both claim GPU {key}"
        claimed[key] = name


def test_every_gpu_worker_runs_one_prefork_child_on_its_own_queue(
    services: dict[str, dict[str, Any]],
) -> None:
    queues: dict[str, set[str]] = {}  # per profile: gpu0 and sim0 never run together
    for name, service in gpu_workers(services).items():
        env = resolve(environment(service))
        args = argv(service)
        assert args[:4] == ["celery", "-A", "tasks.app", "worker"], name
        # The queue the worker registers (tasks.serving.routing) is the queue Celery consumes.
        host = env["GPUFLEET_HOST"]
        assert host == "gpuhost", f"{name}: a fixed default host keeps queue names stable"
        queue = gpu_queue(host, [int(env["GPUFLEET_WORKER_GPUS"])])
        assert option(args, "-Q") == queue, name
        assert option(args, "-n") == f"{name}@%h", name
        assert option(args, "-c") == "1", name
        assert option(args, "-P") == "prefork", name
        queues.setdefault(service["profiles"][0], set()).add(queue)
    for profile, names in queues.items():
        assert len(names) == len(gpu_workers(services, profile)), profile


def test_worker_health_checks_ping_the_node_their_service_starts(
    services: dict[str, dict[str, Any]],
) -> None:
    workers = {"router": services["router"], **gpu_workers(services)}
    for name, service in workers.items():
        node = option(argv(service), "-n").split("@")[0]
        command = health_command(service).split()
        assert command[:5] == ["celery", "-A", "tasks.app", "inspect", "ping"], name
        # %h in the node name is the container's hostname, which `hostname` prints.
        assert option(command, "-d") == f"{node}@$(hostname)", name


def test_flower_takes_basic_auth_from_required_variables(
    services: dict[str, dict[str, Any]],
) -> None:
    flower = services["flower"]
    env = environment(flower)
    assert re.fullmatch(
        r"\$\{FLOWER_USER:\?[^}]+\}:\$\{FLOWER_PASSWORD:\?[^}]+\}", env["FLOWER_BASIC_AUTH"]
    )
    for unsafe in ("FLOWER_UNAUTHENTICATED_API", "FLOWER_AUTH"):
        assert unsafe not in env
    args = argv(flower)
    assert args[:4] == ["celery", "-A", "tasks.app", "flower"]
    assert "--port=5555" in args
    # Credentials stay off the command line, which any user of the host can read.
    assert not any(a.startswith("--basic-auth") for a in args)
    assert ENV["FLOWER_PASSWORD"] not in " ".join(args)


# --- the health checks, run --------------------------------------------------------------


class _Flower(http.server.BaseHTTPRequestHandler):
    """Answers like Flower: 401 without the right basic credentials, when it has some."""

    credentials: str | None = "admin:flowerpw"

    def do_GET(self) -> None:
        wanted = self.credentials
        given = self.headers.get("Authorization", "")
        ok = wanted is None or given == "Basic " + base64.b64encode(wanted.encode()).decode()
        self.send_response(200 if ok else 401)
        self.end_headers()
        self.wfile.write(b"tasks" if ok else b"unauthorized")

    def log_message(self, *_: Any) -> None:
        pass


@pytest.fixture
def stand_in_flower() -> Iterator[tuple[str, type[_Flower]]]:
    handler = type("Handler", (_Flower,), {})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize(
    ("server_credentials", "given", "healthy"),
    [
        ("admin:flowerpw", "admin:flowerpw", True),
        ("admin:flowerpw", "admin:wrong", False),
        (None, "admin:flowerpw", False),  # Flower up without auth is unhealthy
    ],
)
def test_the_flower_health_check_passes_only_when_flower_is_up_behind_auth(
    services: dict[str, dict[str, Any]],
    stand_in_flower: tuple[str, type[_Flower]],
    server_credentials: str | None,
    given: str,
    healthy: bool,
) -> None:
    test = services["flower"]["healthcheck"]["test"]
    assert test[:3] == ["CMD", "python", "-c"]
    script = resolve(test[3])
    assert "http://127.0.0.1:5555/" in script
    url, handler = stand_in_flower
    handler.credentials = server_credentials
    env = {"PATH": os.environ.get("PATH", ""), "FLOWER_BASIC_AUTH": given}
    script = script.replace("http://127.0.0.1:5555", url)
    done = subprocess.run(
        [sys.executable, "-c", script], check=False, env=env, capture_output=True, timeout=30
    )
    assert (done.returncode == 0) == healthy, done.stderr.decode()


def test_flower_started_as_compose_starts_it_is_healthy_and_keeps_its_password_off_argv(
    services: dict[str, dict[str, Any]], redis_url: str, tmp_path: Path
) -> None:
    """The real Flower, with compose's command and environment, against the test Redis."""
    flower = services["flower"]
    port = free_port()
    args = [a.replace("--port=5555", f"--port={port}") for a in argv(flower)]
    assert args[0] == "celery"
    args[:1] = [sys.executable, "-m", "celery"]  # this environment's celery, on PATH or not
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith(("GPUFLEET_", "FLOWER_"))},
        **resolve(environment(flower)),
        "GPUFLEET_REDIS_URL": redis_url,
        "GPUFLEET_FLEET": f"compose-{port}",
    }
    check = resolve(flower["healthcheck"]["test"][3]).replace("5555", str(port))
    log = (tmp_path / "flower.log").open("wb")
    process = subprocess.Popen(
        args, env=env, stdout=log, stderr=subprocess.STDOUT, cwd=COMPOSE.parent
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, (tmp_path / "flower.log").read_text()
            done = subprocess.run(
                [sys.executable, "-c", check], check=False, env=env, capture_output=True, timeout=30
            )
            if done.returncode == 0:
                break
            assert time.monotonic() < deadline, done.stderr.decode()
            time.sleep(0.5)
        cmdline = Path(f"/proc/{process.pid}/cmdline").read_bytes().decode()
        assert ENV["FLOWER_PASSWORD"] not in cmdline
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def test_the_redis_health_check_passes_only_with_the_password(
    services: dict[str, dict[str, Any]], tmp_path: Path
) -> None:
    """redis-server runs with compose's arguments; the check runs with compose's shell."""
    server_bin = find_redis_server()
    cli_bin = Path(server_bin).with_name("redis-cli")
    cli = str(cli_bin) if cli_bin.exists() else shutil.which("redis-cli")
    assert cli, "no redis-cli next to redis-server or on PATH"
    service = services["redis"]
    command = resolve(service["command"])
    sock = tmp_path / "redis.sock"
    args = [server_bin, *command[1:], "--port", "0", "--unixsocket", str(sock)]
    server = subprocess.Popen([*args, "--dir", str(tmp_path)], stdout=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while not sock.exists():
            assert server.poll() is None, "redis-server refused compose's arguments"
            assert time.monotonic() < deadline, "redis-server did not start"
            time.sleep(0.05)
        check = health_command(service).replace("redis-cli", f"{shlex.quote(cli)} -s {sock}")
        auth = resolve(environment(service)["REDISCLI_AUTH"])
        assert auth == ENV["REDIS_PASSWORD"]
        for password, healthy in ((auth, True), ("wrong", False)):
            env = {"PATH": os.environ.get("PATH", ""), "REDISCLI_AUTH": password}
            done = subprocess.run(
                ["sh", "-c", check], check=False, env=env, capture_output=True, timeout=30
            )
            assert (done.returncode == 0) == healthy, (password, done.stderr.decode())
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(unix_socket_path=str(sock)).ping()
    finally:
        server.terminate()
        server.wait(timeout=10)


# --- docker-compose config ---------------------------------------------------------------


@functools.cache
def find_compose() -> tuple[str, ...] | None:
    """`docker-compose` (v1, Debian), else `docker compose` (v2 plugin), else None."""
    legacy = shutil.which("docker-compose")
    if legacy:
        return (legacy,)
    docker = shutil.which("docker")
    if docker:
        probe = subprocess.run(
            [docker, "compose", "version"], check=False, capture_output=True, timeout=60
        )
        if probe.returncode == 0:
            return (docker, "compose")
    return None


def compose_cli() -> list[str]:
    """The compose command; a test that needs it fails (not skips) without it."""
    found = find_compose()
    if found is None:
        pytest.fail(INSTALL_HINT)
    return list(found)


def compose_config(
    cli: list[str], env: Mapping[str, str], tmp_path: Path, *flags: str, ha: bool = False
) -> subprocess.CompletedProcess[str]:
    """`config` on compose.yaml (and compose.ha.yaml over it, with `ha`) with exactly `env`:
    no .env file, no inherited settings."""
    empty = tmp_path / "empty.env"
    empty.write_text("")
    clean = {
        k: v
        for k, v in os.environ.items()
        if k not in REQUIRED
        and not k.startswith(("GPUFLEET_", "COMPOSE_", "REDIS_", "FLOWER_", "PYTHON"))
    }
    files = ["-f", str(COMPOSE), *(["-f", str(COMPOSE_HA)] if ha else [])]
    command = [*cli, "--env-file", str(empty), *files, "config", *flags]
    return subprocess.run(
        command,
        check=False,
        env={**clean, **env},
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )


def test_docker_compose_accepts_the_file_with_the_required_variables(
    tmp_path: Path,
) -> None:
    done = compose_config(compose_cli(), ENV, tmp_path, "-q")
    assert done.returncode == 0, done.stderr
    # Every other variable has a default: none is silently blank.
    assert "variable is not set" not in done.stderr, done.stderr


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("FLOWER_PASSWORD", None),
        ("FLOWER_PASSWORD", ""),
        ("FLOWER_USER", None),
        ("REDIS_PASSWORD", None),
    ],
)
def test_docker_compose_refuses_the_file_without_a_required_variable(
    tmp_path: Path, name: str, value: str | None
) -> None:
    env = {k: v for k, v in ENV.items() if k != name}
    if value is not None:
        env[name] = value
    done = compose_config(compose_cli(), env, tmp_path, "-q")
    assert done.returncode != 0
    assert f"set {name} in .env or the environment" in done.stderr, done.stderr


def test_docker_compose_resolves_credentials_and_keeps_the_gpu_reservations(
    tmp_path: Path,
) -> None:
    done = compose_config(compose_cli(), ENV, tmp_path)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    url = f"redis://:{ENV['REDIS_PASSWORD']}@redis:6379/0"
    for name in gpufleet_services(resolved):
        assert resolved[name]["environment"]["GPUFLEET_REDIS_URL"] == url, name
    assert resolved["flower"]["environment"]["FLOWER_BASIC_AUTH"] == "admin:flowerpw"
    assert option(resolved["redis"]["command"], "--requirepass") == ENV["REDIS_PASSWORD"]
    workers = gpu_workers(resolved, "gpu")
    assert set(workers) == set(gpu_workers(yaml.safe_load(COMPOSE.read_text())["services"], "gpu"))
    for name, service in workers.items():
        (request,) = device_requests(service)
        assert request["driver"] == "nvidia", name
        assert "gpu" in request["capabilities"], name


# --- compose.ha.yaml ---------------------------------------------------------------------


def test_the_ha_file_puts_every_gpufleet_service_behind_the_sentinels_of_one_group(
    tmp_path: Path,
) -> None:
    """Over compose.yaml, as compose merges them: every gpufleet service's URL names the
    three Sentinels, by their fixed addresses, and the group they monitor (the primary's
    address), and waits for them and every server."""
    done = compose_config(compose_cli(), ENV, tmp_path, ha=True)
    assert done.returncode == 0, done.stderr
    assert "variable is not set" not in done.stderr, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    sentinels = sorted(name for name in resolved if name.startswith("sentinel"))
    assert len(sentinels) == 3
    address = {
        name: fixed for name, service in resolved.items() if (fixed := _fixed_address(service))
    }
    assert len(set(address.values())) == len(address) == 6  # three servers, three Sentinels
    for name in gpufleet_services(resolved):
        found = endpoint.parse(resolved[name]["environment"]["GPUFLEET_REDIS_URL"])
        assert sorted(found.sentinels) == sorted((address[s], 26379) for s in sentinels), name
        assert found.password == ENV["REDIS_PASSWORD"] and found.master_name == "gpufleet"
        waits = resolved[name]["depends_on"]
        assert set(waits) == {"redis", "redis-replica", "redis-replica2", *sentinels}, name
        assert {w["condition"] for w in waits.values()} == {"service_healthy"}, name
    for name in sentinels:
        script = resolved[name]["command"][-1]
        assert "sentinel monitor gpufleet $$REDIS_HA_NET.10 6379 2" in script, name
        net = resolved[name]["environment"]["REDIS_HA_NET"]
        assert f"{net}.10" == address["redis"], name
        assert ENV["REDIS_PASSWORD"] not in " ".join(resolved[name]["command"]), name


def _fixed_address(service: Mapping[str, Any]) -> str | None:
    """The address a service has on the project network, when it has a fixed one."""
    default = (service.get("networks") or {}).get("default") or {}
    found = default.get("ipv4_address")
    return str(found) if found else None


def test_in_the_ha_file_every_server_writes_only_with_a_replica_and_can_follow_another(
    tmp_path: Path,
) -> None:
    done = compose_config(compose_cli(), ENV, tmp_path, ha=True)
    assert done.returncode == 0, done.stderr
    resolved = yaml.safe_load(done.stdout)["services"]
    for name in ("redis", "redis-replica", "redis-replica2"):
        args = resolved[name]["command"]
        assert (
            option(args, "--requirepass") == option(args, "--masterauth") == ENV["REDIS_PASSWORD"]
        )
        assert option(args, "--min-replicas-to-write") == "1", name
        assert option(args, "--appendonly") == "yes", name
    primary = _fixed_address(resolved["redis"])
    for name in ("redis-replica", "redis-replica2"):
        assert option(resolved[name]["command"], "--replicaof") == primary, name
    assert "--replicaof" not in resolved["redis"]["command"]


def test_a_sentinel_started_as_the_ha_file_starts_it_writes_its_config_once_and_serves(
    tmp_path: Path,
) -> None:
    """The Sentinel's own shell script, run with its environment (its /data here a
    directory of the test's): it writes a config Redis accepts, asks for the password,
    and keeps the file it finds on its next start (a Sentinel rewrites it as it learns)."""
    service = yaml.safe_load(COMPOSE_HA.read_text())["services"]["sentinel1"]
    data = tmp_path / "data"
    data.mkdir()
    port = free_port()
    script = resolve(service["command"][-1]).replace("$$", "$").replace("/data", str(data))
    script = script.replace("port 26379", f"port {port}\nbind 127.0.0.1")
    server_bin = find_redis_server()
    script = script.replace("exec redis-server", f"exec {shlex.quote(server_bin)}")
    env = {k: resolve(str(v)) for k, v in environment(service).items()}
    env["PATH"] = os.environ.get("PATH", "")
    proc = subprocess.Popen(["sh", "-c", script], env=env, stdout=subprocess.DEVNULL)
    try:
        client = redis.Redis(port=port, password=ENV["REDIS_PASSWORD"])
        deadline = time.monotonic() + 10
        while True:
            try:
                assert client.ping()
                break
            except redis.ConnectionError:
                assert proc.poll() is None, "the Sentinel refused the config it wrote"
                assert time.monotonic() < deadline, "the Sentinel did not start"
                time.sleep(0.1)
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(port=port).ping()
        (master,) = client.sentinel_masters().values()
        assert master["name"] == "gpufleet" and master["quorum"] == 2
        assert master["down-after-milliseconds"] == 5000
    finally:
        proc.terminate()
        proc.wait(timeout=10)
    written = (data / "sentinel.conf").read_text()
    (data / "sentinel.conf").write_text(written + "# kept\n")
    subprocess.run(["sh", "-c", script.replace("exec ", "true ")], env=env, check=True)
    assert (data / "sentinel.conf").read_text().endswith("# kept\n")
