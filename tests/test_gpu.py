"""CUDA behaviour of the worker runtime; skipped without a GPU (run with `pytest -m gpu`)."""

from __future__ import annotations

import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

pytestmark = pytest.mark.gpu
REPO = Path(__file__).resolve().parents[1]


def probe(name: str, arg: str = "0") -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_probe", name, arg],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def gpu_count() -> int:
    import torch

    return torch.cuda.device_count()


def test_allocating_past_the_memory_fraction_raises_oom() -> None:
    result = probe("fraction_cap", "0.05")
    assert result["past"] == "oom"
    assert result["max_reserved"] <= result["cap"]


def test_the_cuda_context_and_the_weights_land_on_the_target_gpu() -> None:
    target = gpu_count() - 1
    result = probe("load_on", str(target))
    assert result["current_device"] == target
    assert result["param_devices"] == [f"cuda:{target}"]
    assert 0.01 <= result["fraction"] <= 0.99
    assert result["embedding_dim"] == 384


def test_offload_frees_device_memory_by_torch_and_nvml_and_restore_lands_as_planned() -> None:
    target = 1 if gpu_count() > 1 else 0
    result = probe("offload_restore", str(target))
    loaded, offloaded = result["reserved"]
    assert offloaded < loaded - 50 * 2**20  # MiniLM is ~87 MiB
    nvml_loaded, nvml_offloaded = result["nvml_used"]
    assert nvml_offloaded < nvml_loaded - 50 * 2**20
    assert result["param_devices"] == [f"cuda:{target}"]
    assert result["same_output"]


def test_two_processes_sharing_one_gpu_each_stay_under_their_own_cap() -> None:
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda share: probe("fill_to_cap", share), ["0.1", "0.15"]))
    for result in results:
        assert 0 < result["max_reserved"] <= result["cap"]


def test_the_safetensors_reader_puts_the_same_weights_on_the_gpu_as_transformers() -> None:
    target = gpu_count() - 1
    result = probe("read_vs_transformers", str(target))
    assert result["via"] == ["safetensors", "transformers"]
    assert result["param_devices"] == [f"cuda:{target}"]
    assert result["same_weights"]
    assert result["same_output"]
    # Nothing but the weights stays allocated: the staging buffers are pinned host memory.
    assert result["allocated_after_read"] <= result["weight_bytes"] + 2**20
