"""A GPU worker's CPU threads: only the thread that serves calls runs torch on several.

OpenMP keeps a team of threads for every thread that ran a parallel region while that
thread lives, and once a process holds more of them than it has cores, every parallel
region sleeps at its barriers (`worker.passes`). One `GpuWorker` (simulated GPU, a
synthetic GPT-2, no Celery) on a real redis-server; the registry calls stand in for a
router.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator

import pytest
import torch

from placement.catalog.catalog import Catalog
from placement.ledger.registry import Registry
from worker import passes
from worker.devices import simulated_devices
from worker.node import GpuWorker
from worker.weights.synthetic import build_synthetic

GiB = 2**30
GPT = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512,
       "n_positions": 256}  # fmt: skip
CATALOG = Catalog.from_mapping(
    {
        "models": {
            "talker": {
                "source": "synthetic",
                "task": "text-generation",
                "memory": "64MiB",
                "config": GPT,
            }
        }
    }
)


def _native_threads() -> set[int]:
    """This process's threads that Python did not start: OpenMP's workers among them."""
    started = {t.native_id for t in threading.enumerate()}
    return {int(tid) for tid in os.listdir("/proc/self/task")} - started


def _in_a_thread(target: object) -> object:
    out: list[object] = []
    thread = threading.Thread(target=lambda: out.append(target()))  # type: ignore[operator]
    thread.start()
    thread.join()
    return out[0]


@pytest.fixture
def node(redis_url: str, fleet: str) -> Iterator[GpuWorker]:
    registry = Registry.from_url(redis_url, fleet)
    devices = simulated_devices("1x4GiB")
    worker = GpuWorker(registry, devices, devices, "h0", "q0", spec_of=CATALOG.get,
                       warm_budget=4 * GiB, lease_ms=3000, threads=2)  # fmt: skip
    worker.start()
    yield worker
    worker.stop()
    registry.client.close()


def test_a_helper_thread_runs_torch_on_one_thread_and_others_keep_the_workers_share() -> None:
    def helper() -> tuple[int, int]:
        passes.helper_thread()
        return passes.threads_here(4), torch.get_num_threads()

    assert _in_a_thread(lambda: passes.threads_here(4)) == 4
    assert _in_a_thread(helper) == (1, 1)
    dims = passes.Dims(hidden=1024, layers=24, itemsize=4)  # a pass big enough for threads
    assert passes.for_pass(4, dims, ["x" * 500] * 8) == 4


def test_the_keepers_load_leaves_the_serving_threads_openmp_team_the_only_one(
    node: GpuWorker,
) -> None:
    # this thread serves, as a worker's does: its team (and every import a load makes) first
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model, tokenizer = build_synthetic(CATALOG.get("talker"))
        with torch.inference_mode():
            model(**tokenizer(["a prompt of a few words"] * 4, return_tensors="pt"))
        before = _native_threads()

        plan = node.registry.place(CATALOG.get("talker").demand())
        node.keeper.ensure(plan.replica, plan.epoch, timeout_s=30)  # its load's warm-up pass
        served = node.serve(plan.replica, plan.epoch, "a prompt", {"max_new_tokens": 4})

        assert len(served.outputs["tokens"][0]) == 4
        assert _native_threads() - before == set(), "a thread besides this one made a team"
    finally:
        torch.set_num_threads(threads)
