"""A supervised fleet of simulated GPUs for one benchmark run, with this process its client."""

from __future__ import annotations

import os
import platform
import uuid
from pathlib import Path
from typing import Any

from placement.config import Settings
from tasks.operator.launcher import Launcher

#: Two small synthetic models: `a` (random weights), and `b`, a BERT whose forward pass on
#: long inputs takes a few tenths of a second on a CPU, for building backlogs. Benchmarks
#: and the end-to-end tests (`tests/running.py`) run fleets of it.
TWO_MODELS = """
models:
  a: {source: synthetic, task: forward, memory: 256MiB}
  b:
    source: synthetic
    task: forward
    memory: 256MiB
    config: {model_type: bert, hidden_size: 256, num_hidden_layers: 4, num_attention_heads: 4,
             intermediate_size: 1024, vocab_size: 512, max_position_embeddings: 512}
"""


def bench_launcher(
    directory: Path, catalog: str, name: str, sim_gpus: str, warm_cache: str, *, api: bool = False
) -> Launcher:
    """A launcher (not started yet) for `catalog`'s text on a fleet name of its own, so a
    run never meets another's records, with its state (GPUFLEET_HOME) in `directory`, so a
    run leaves none behind; this process's environment points at it, with the
    benchmark's warm cache whatever the caller's environment says. With
    GPUFLEET_REDIS_URL set, runs take turns: one broker database carries one fleet. It
    serves OpenAI's API (`tasks.front`) only with `api`."""
    path = directory / "models.yaml"
    path.write_text(catalog)
    os.environ["GPUFLEET_MODELS"] = str(path)
    os.environ["GPUFLEET_HOME"] = str(directory / "home")
    os.environ["GPUFLEET_WARM_CACHE"] = warm_cache  # part of the set-up the figures depend on
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.pop("GPUFLEET_ROLE", None)  # this process is a client
    os.environ["GPUFLEET_FLEET"] = f"{name}-{uuid.uuid4().hex[:8]}"
    api_port = None if api else 0  # None: the default port, or a free one
    return Launcher(path, Settings.from_env(), sim_gpus=sim_gpus, metrics_port=0, api_port=api_port)


def broker_in_use() -> str:
    """Which broker a run is about to use (read before the fleet starts, which sets it)."""
    return "GPUFLEET_REDIS_URL" if os.environ.get("GPUFLEET_REDIS_URL") else "embedded redis"


def loaded_machine(
    sim_gpus: str, broker: str, load_before: tuple[float, float, float]
) -> dict[str, Any]:
    """`fleet_machine`, with the run's broker (`broker_in_use`) and the load averages
    around the run."""
    return fleet_machine(sim_gpus) | {
        "broker": broker,
        "loadavg_before": [round(x, 2) for x in load_before],
        "loadavg_after": [round(x, 2) for x in os.getloadavg()],
    }


def _real_gpus() -> str:
    """The NVIDIA GPUs NVML lists, by name (no CUDA context)."""
    from worker.devices import nvml_devices

    return ", ".join(d.name for d in nvml_devices()) or "none found"


def fleet_machine(sim_gpus: str) -> dict[str, Any]:
    """What a fleet benchmark's figures depend on: the machine and the versions it ran."""
    import celery
    import torch

    return {
        "cpus": os.cpu_count(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "celery": celery.__version__,
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "gpus": f"simulated {sim_gpus} (forward on CPU)" if sim_gpus else _real_gpus(),
    }
