"""A GPU worker's CPU threads: only the thread that serves calls runs torch on several.

OpenMP keeps a team of threads for every thread that ran a parallel region on more than
one thread, while that thread lives, and once a process holds more OpenMP threads than it
has cores, every parallel region sleeps at its barriers (`worker.passes`). One
`GpuWorker` (simulated GPU, a synthetic GPT-2, no Celery) on a real redis-server; the
registry calls stand in for a router.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from typing import TypeVar

import pytest
import torch

from placement.catalog.catalog import Catalog
from placement.ledger.registry import Registry
from worker import passes
from worker.devices import simulated_devices
from worker.node import GpuWorker
from worker.weights.synthetic import build_synthetic

GiB = 2**30
T = TypeVar("T")
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


def _native_threads() -> int:
    """How many of this process's threads Python did not start: OpenMP's workers among
    them (and a pool torch sizes to the last count set, which the test holds still)."""
    started = {t.native_id for t in threading.enumerate()}
    return len({int(tid) for tid in os.listdir("/proc/self/task")} - started)


def _in_a_thread(target: Callable[[], T]) -> T:
    out: list[T] = []
    thread = threading.Thread(target=lambda: out.append(target()))
    thread.start()
    thread.join()
    return out[0]


def _starting_threads() -> int:
    """The CPU threads torch gives a thread that has not run it yet."""
    return _in_a_thread(torch.get_num_threads)


@pytest.fixture(autouse=True)
def _torch_threads() -> Iterator[None]:
    """This thread's torch threads and the count threads start with, as they were."""
    mine, starting = torch.get_num_threads(), _starting_threads()
    yield
    _in_a_thread(lambda: torch.set_num_threads(starting))
    torch.set_num_threads(mine)


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
    assert _in_a_thread(lambda: passes.threads_here(4)) == 4
    dims = passes.Dims(hidden=1024, layers=24, itemsize=4)  # a pass big enough for threads
    assert passes.for_pass(4, dims, ["x" * 500] * 8) == 4

    def helper() -> tuple[int, int, int]:
        passes.helper_thread()
        return passes.threads_here(4), torch.get_num_threads(), passes.for_pass(4, dims, ["x"])

    assert _in_a_thread(helper) == (1, 1, 1)


def test_a_helper_keeps_one_thread_and_leaves_the_count_other_threads_start_with() -> None:
    _in_a_thread(lambda: torch.set_num_threads(2))
    marked, changed = threading.Event(), threading.Event()
    seen: list[int] = []

    def helper() -> None:
        passes.helper_thread()
        marked.set()
        changed.wait(10)
        seen.append(torch.get_num_threads())

    thread = threading.Thread(target=helper)
    thread.start()
    marked.wait(10)
    assert _starting_threads() == 2  # put back for threads that come later
    _in_a_thread(lambda: torch.set_num_threads(3))  # another thread changes the count
    changed.set()
    thread.join()
    assert seen == [1]


def test_the_keepers_load_leaves_the_serving_threads_openmp_team_the_only_one(
    node: GpuWorker,
) -> None:
    # this thread serves, as a worker's does: its team (and every import a load makes) first
    torch.set_num_threads(2)
    model, tokenizer = build_synthetic(CATALOG.get("talker"))
    with torch.inference_mode():
        model(**tokenizer(["a prompt of a few words"] * 4, return_tensors="pt"))
    before = _native_threads()  # this thread's team and torch's pool of 2

    plan = node.registry.place(CATALOG.get("talker").demand())
    node.keeper.ensure(plan.replica, plan.epoch, timeout_s=30)  # its load's warm-up pass
    served = node.serve(plan.replica, plan.epoch, "a prompt", {"max_new_tokens": 4})

    assert len(served.outputs["tokens"][0]) == 4
    torch.set_num_threads(2)  # the pool sized as before
    assert _native_threads() == before, "a thread besides this one made an OpenMP team"
