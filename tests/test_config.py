"""Every GPUFLEET_* setting is read in one place, checked, and documented as it is."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path

import pytest

from placement.config import (
    DEFAULT_URL,
    FROM_CONNECTION_FILE,
    FROM_DEFAULT,
    FROM_ENV,
    VARIABLES,
    Settings,
    connection_path,
)
from placement.errors import ConfigError
from placement.policy.settings import GpuChoice, VictimOrder
from worker.passes import share

REPO = Path(__file__).resolve().parents[1]


def test_defaults_need_no_environment_at_all(tmp_path: Path) -> None:
    s = Settings.from_env({"GPUFLEET_HOME": str(tmp_path)})
    assert (s.registry_url, s.broker_url, s.result_backend) == (DEFAULT_URL,) * 3
    assert (s.fleet, s.role, s.worker_lease_ms, s.max_replicas) == ("default", "client", 15000, 8)
    assert s.url_from == FROM_DEFAULT
    assert s.metrics_port is None and s.warm_cache is None and s.worker_gpus is None
    assert s.gpu_reserve == 2**30


def test_every_variable_is_read_into_its_setting(tmp_path: Path) -> None:
    s = Settings.from_env(
        {
            "GPUFLEET_REDIS_URL": "redis://:pw@10.0.0.1:6380/2",
            "GPUFLEET_FLEET": "blue",
            "GPUFLEET_HOME": str(tmp_path),
            "GPUFLEET_MODELS": "/etc/gpufleet/models.yaml",
            "GPUFLEET_SIM_GPUS": "2x8GiB",
            "GPUFLEET_WARM_CACHE": "4GiB",
            "GPUFLEET_GPU_RESERVE": "512MiB",
            "GPUFLEET_WORKER_LEASE_MS": "3000",
            "GPUFLEET_VISIBILITY_TIMEOUT": "7200",
            "GPUFLEET_HOST": "box-7",
            "GPUFLEET_LINEAGE": "slot-1",
            "GPUFLEET_WORKER_GPUS": "0,2",
            "GPUFLEET_ROLE": "gpu",
            "GPUFLEET_METRICS_PORT": "9464",
            "GPUFLEET_METRICS_ADDR": "0.0.0.0",
            "GPUFLEET_MAX_REPLICAS": "3",
            "GPUFLEET_FACTOR": "2.5",
            "GPUFLEET_GPU_CHOICE": "most-free",
            "GPUFLEET_VICTIM_ORDER": "smallest",
            "GPUFLEET_SIM_DATA": "/data/azure",
        }
    )
    assert s.broker_url == s.result_backend == s.registry_url == "redis://:pw@10.0.0.1:6380/2"
    assert s.url_from == FROM_ENV
    assert (s.fleet, s.home, s.models) == ("blue", tmp_path, Path("/etc/gpufleet/models.yaml"))
    assert (s.sim_gpus, s.warm_cache, s.worker_lease_ms) == ("2x8GiB", 4 * 2**30, 3000)
    assert s.gpu_reserve == 512 * 2**20
    assert (s.visibility_timeout, s.host, s.lineage, s.worker_gpus) == (
        7200,
        "box-7",
        "slot-1",
        (0, 2),
    )
    assert (s.role, s.metrics_port, s.metrics_addr, s.max_replicas) == ("gpu", 9464, "0.0.0.0", 3)
    assert (s.policy.factor, s.policy.gpu_choice) == (2.5, GpuChoice.MOST_FREE)
    assert s.policy.victim_order is VictimOrder.SMALLEST
    assert s.sim_data == Path("/data/azure")


@pytest.mark.parametrize(
    ("name", "value", "says"),
    [
        ("GPUFLEET_WORKER_LEASE_MS", "soon", "whole number"),
        ("GPUFLEET_WORKER_LEASE_MS", "5", "from 30"),
        ("GPUFLEET_METRICS_PORT", "nine", "whole number from 0 up to 65535"),
        ("GPUFLEET_WARM_CACHE", "lots", "GPUFLEET_WARM_CACHE"),
        ("GPUFLEET_GPU_RESERVE", "-1GiB", "cannot be negative"),
        ("GPUFLEET_ROLE", "boss", "router"),
        ("GPUFLEET_FACTOR", "x3", "number"),
        ("GPUFLEET_GPU_CHOICE", "luck", "best-fit"),
        ("GPUFLEET_FLEET", "a b", "GPUFLEET_FLEET"),
        ("GPUFLEET_REDIS_URL", "http://x", "redis://"),
        ("GPUFLEET_WORKER_GPUS", "first", "0,1"),
    ],
)
def test_a_bad_value_is_refused_naming_its_variable(
    name: str, value: str, says: str, tmp_path: Path
) -> None:
    with pytest.raises(ConfigError, match=re.escape(says)) as err:
        Settings.from_env({name: value, "GPUFLEET_HOME": str(tmp_path)})
    assert name in str(err.value) or name == "GPUFLEET_FACTOR"


def test_the_fleet_is_found_through_the_connection_file_of_a_live_launcher(
    tmp_path: Path,
) -> None:
    path = connection_path(tmp_path, "default")
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps({"redis_url": "redis://:pw@127.0.0.1:4242/0", "pid": os.getpid()}))
    s = Settings.from_env({"GPUFLEET_HOME": str(tmp_path)})
    assert (s.registry_url, s.broker_url, s.url_from) == (
        "redis://:pw@127.0.0.1:4242/0",
        "redis://:pw@127.0.0.1:4242/0",
        FROM_CONNECTION_FILE,
    )
    gone = subprocess.Popen(["true"])
    gone.wait()  # a pid that no longer runs: its launcher died without cleaning up
    path.write_text(json.dumps({"redis_url": "redis://127.0.0.1:4242/0", "pid": gone.pid}))
    assert Settings.from_env({"GPUFLEET_HOME": str(tmp_path)}).url_from == FROM_DEFAULT
    explicit = Settings.from_env(
        {"GPUFLEET_HOME": str(tmp_path), "GPUFLEET_REDIS_URL": "redis://h/1"}
    )
    assert explicit.registry_url == "redis://h/1"


def test_the_readme_settings_table_is_the_one_the_code_reads() -> None:
    readme = (REPO / "README.md").read_text()
    table = readme.split("## Settings", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in table.splitlines() if line.startswith("| `GPUFLEET_")]
    documented = [tuple(cell.strip() for cell in row.strip("|").split("|")) for row in rows]
    assert documented == [(f"`{v.name}`", v.default, v.meaning) for v in VARIABLES]


def test_no_module_but_the_config_reads_a_gpufleet_variable() -> None:
    readers = []
    for package in ("placement", "worker", "tasks"):
        for path in (REPO / package).rglob("*.py"):
            text = path.read_text()
            if re.search(
                r"environ(\.get)?\s*[\[(]\s*['\"]GPUFLEET_|getenv\(\s*['\"]GPUFLEET_", text
            ):
                readers.append(str(path.relative_to(REPO)))
    assert readers == []


def test_a_gpu_workers_torch_threads_are_the_setting_or_a_share_of_the_host_s_cores(
    tmp_path: Path,
) -> None:
    def threads(**env: str) -> int | None:
        return Settings.from_env({"GPUFLEET_HOME": str(tmp_path), **env}).torch_threads

    assert threads(GPUFLEET_TORCH_THREADS="3", OMP_NUM_THREADS="2") == 3
    assert threads(OMP_NUM_THREADS="2") == 2
    assert threads(OMP_NUM_THREADS="4,2") == 4  # one per nesting level: the outermost
    assert threads(OMP_NUM_THREADS="lots") is None  # not ours to refuse: the default
    assert threads() is None
    with pytest.raises(ConfigError, match="GPUFLEET_TORCH_THREADS"):
        threads(GPUFLEET_TORCH_THREADS="many")
    assert share(None, gpus=1, cores=2) == 2
    assert share(None, gpus=8, cores=64) == 8
    assert share(None, gpus=4, cores=2) == 1
    assert share(6, gpus=8, cores=64) == 6
