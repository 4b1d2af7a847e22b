"""Batched calls below Celery: the grouping rule, the catalog and settings that shape it,
and one forward pass for many calls on a resident replica (simulated GPUs, real models)."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from placement.catalog.catalog import Catalog, ModelSpec
from placement.config import Settings
from placement.errors import CatalogError, ConfigError, PayloadError
from placement.rules.batching import (
    JOB_MS,
    BatchLimits,
    JobCost,
    Waiting,
    input_chars,
    input_rows,
    take_batch,
)
from placement.units.memory import MiB
from tests.fleets import GiB
from worker.devices import Device, simulated_devices
from worker.residency import ResidencyManager

REPO = Path(__file__).resolve().parents[1]
HOST = "testhost"


# --- which calls share a batch ---------------------------------------------------


def waiting(group: str, chars: int = 10, since: float = 0.0) -> Waiting[str]:
    return Waiting(f"{group}@{since}", group, chars, since)


def test_a_batch_is_the_oldest_call_and_the_calls_of_its_replica_behind_it() -> None:
    queue = [waiting("r1", since=0), waiting("r2", since=1), waiting("r1", since=2)]
    picked, due = take_batch(queue, lambda _: BatchLimits(size=8), now_ms=5)
    assert (picked, due) == ([0, 2], None)
    rest = [w for i, w in enumerate(queue) if i not in picked]
    assert take_batch(rest, lambda _: BatchLimits(size=8), now_ms=5) == ([0], None)


def test_a_batch_stops_at_its_size_and_its_characters_and_a_large_call_runs_alone() -> None:
    queue = [waiting("r1", chars=40, since=t) for t in range(6)]
    assert take_batch(queue, lambda _: BatchLimits(size=4), 10)[0] == [0, 1, 2, 3]
    assert take_batch(queue, lambda _: BatchLimits(size=8, chars=100), 10)[0] == [0, 1]
    large = [waiting("r1", chars=500), waiting("r1", chars=40)]
    assert take_batch(large, lambda _: BatchLimits(size=8, chars=100), 10)[0] == [0]


def test_a_batch_stops_where_its_replica_s_last_jobs_say_it_would_outrun_job_ms() -> None:
    cost = JobCost()
    queue = [waiting("r1", chars=100, since=t) for t in range(40)]
    limits = BatchLimits(size=32, wait_ms=50)
    # nothing known yet: the limits alone
    assert len(take_batch(queue, lambda _: limits, 0, lambda _: cost)[0]) == 32
    per_call = JOB_MS / 20  # and 2 ms a job: 19 calls fit (with 100 characters each)
    for calls in (1, 2, 4, 8, 16):
        cost.ran(calls, 100 * calls, 2 + per_call * calls)
    picked, due = take_batch(queue, lambda _: limits, 0, lambda _: cost)
    assert len(picked) == int((JOB_MS - 2) / per_call) < 32 and due is None  # full: it goes
    # a call that alone would outrun JOB_MS still runs, alone
    slow = JobCost()
    slow.ran(1, 100, 3 * JOB_MS)
    slow.ran(2, 200, 6 * JOB_MS)
    assert take_batch(queue, lambda _: limits, 0, lambda _: slow) == ([0], None)


def test_a_job_s_cost_is_fitted_over_its_calls_and_its_characters() -> None:
    cost = JobCost()
    assert cost.fits(10_000, 10**9)  # nothing ran yet
    scale = JOB_MS / 50  # 1 + 2 x calls + 0.005 x chars, in JOB_MS / 50
    for calls, chars in ((1, 1000), (10, 100), (5, 5000), (20, 200)):
        cost.ran(calls, chars, scale * (1 + 2 * calls + 0.005 * chars))
    assert cost.fits(20, 1000) and not cost.fits(20, 2000)  # 46 and 51 of 50


def test_a_replica_whose_jobs_all_held_as_many_calls_may_try_one_more() -> None:
    cost = JobCost()
    for _ in range(5):  # one call a job, 0.8 of JOB_MS each: mostly a fixed part, or not
        cost.ran(1, 100, 0.8 * JOB_MS)
    assert cost.fits(2, 200) and not cost.fits(3, 300)
    cost.ran(2, 200, 0.85 * JOB_MS)  # two cost hardly more: the fixed part shows
    assert cost.fits(2, 200) and cost.fits(3, 300)


def test_input_rows_are_a_list_s_strings_and_one_for_anything_else() -> None:
    assert [input_rows(x) for x in (["a", "b", "c"], "abc", [], {"text": "a"})] == [3, 1, 1, 1]


def test_a_batch_that_is_not_full_waits_for_more_until_its_oldest_call_waited_long_enough() -> None:
    queue = [waiting("r1", since=100), waiting("r1", since=103)]
    limits = BatchLimits(size=4, wait_ms=20)
    assert take_batch(queue, lambda _: limits, now_ms=110) == ([], 120)
    assert take_batch(queue, lambda _: limits, now_ms=120) == ([0, 1], None)
    full = [waiting("r1", since=100 + t) for t in range(4)]
    assert take_batch(full, lambda _: limits, now_ms=104) == ([0, 1, 2, 3], None)
    lone = [waiting("r1", since=100)]
    assert take_batch(lone, lambda _: BatchLimits(size=4), now_ms=100) == ([0], None)


def test_a_model_that_waits_for_company_never_holds_up_another_model_s_calls() -> None:
    patient = BatchLimits(size=4, wait_ms=300)
    eager = BatchLimits(size=4, wait_ms=0)
    queue = [waiting("slow", since=100), waiting("fast", since=101), waiting("fast", since=102)]
    limits = {"slow": patient, "fast": eager}
    assert take_batch(queue, lambda w: limits[str(w.group)], now_ms=110) == ([1, 2], None)
    assert take_batch(queue[:1], lambda w: limits[str(w.group)], now_ms=110) == ([], 400)


def test_input_size_counts_the_characters_of_a_string_or_a_list_of_strings() -> None:
    assert input_chars("héllo") == 5
    assert input_chars(["ab", "cde", 7]) == 5
    assert input_chars({"text": "abc"}) == 0


def entry(task: str, **fields: Any) -> dict[str, Any]:
    return {"models": {"m": {"source": "synthetic", "task": task, "memory": "1GiB", **fields}}}


def test_the_catalog_batch_field_changes_the_fleet_limits_for_its_model() -> None:
    fleet = BatchLimits(size=32, chars=1000, wait_ms=0)
    spec = Catalog.from_mapping(entry("forward", batch={"size": 8, "wait": "5ms"}))["m"]
    assert spec.batch_limits(fleet) == BatchLimits(size=8, chars=1000, wait_ms=5)
    off = Catalog.from_mapping(entry("forward", batch=False))["m"]
    assert not off.batch_limits(fleet).on
    plain = Catalog.from_mapping(entry("fill-mask"))["m"]
    assert plain.batch_limits(fleet) == fleet
    generation = Catalog.from_mapping(entry("text-generation"))["m"]
    assert not generation.batch_limits(fleet).on


@pytest.mark.parametrize(
    ("task", "batch", "message"),
    [
        ("forward", {"sise": 4}, "unknown keys \\['sise'\\]"),
        ("forward", {"size": 0}, "size must be a whole number >= 1"),
        ("forward", {"wait": "soon"}, "invalid duration"),
        ("forward", 16, "expected false or a mapping"),
        ("text-generation", {"size": 4}, "text-generation calls are never batched"),
    ],
)
def test_a_bad_catalog_batch_field_is_refused_naming_the_model_and_field(
    task: str, batch: object, message: str
) -> None:
    with pytest.raises(CatalogError, match=f"model 'm': field 'batch': .*{message}"):
        Catalog.from_mapping(entry(task, batch=batch))


def test_the_fleet_batch_limits_come_from_the_environment_and_are_checked() -> None:
    env = {"GPUFLEET_BATCH_SIZE": "4", "GPUFLEET_BATCH_CHARS": "900", "GPUFLEET_BATCH_WAIT": "3ms"}
    assert Settings.from_env(env).batch == BatchLimits(size=4, chars=900, wait_ms=3)
    assert Settings.from_env({}).batch == BatchLimits()
    with pytest.raises(ConfigError, match="GPUFLEET_BATCH_SIZE"):
        Settings.from_env({"GPUFLEET_BATCH_SIZE": "0"})


# --- one pass for many calls -----------------------------------------------------


@pytest.fixture
def devices() -> list[Device]:
    return simulated_devices("1x8GiB")


@pytest.fixture
def manager(devices: list[Device]) -> Iterator[ResidencyManager]:
    m = ResidencyManager(devices, HOST)
    yield m
    m.drop_all()


def gpu(devices: list[Device]) -> str:
    return devices[0].gpu_id(HOST)


def synthetic(task: str, memory: int = 256 * MiB) -> ModelSpec:
    return Catalog.from_mapping(entry(task, memory=memory))["m"]


def close(a: object, b: object, tol: float = 1e-5) -> bool:
    """Equal JSON, floats to within `tol`."""
    if isinstance(a, float) and isinstance(b, float):
        return math.isclose(a, b, rel_tol=tol, abs_tol=tol)
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(close(a[k], b[k], tol) for k in a)
    if isinstance(a, list) and isinstance(b, list):
        return len(a) == len(b) and all(close(x, y, tol) for x, y in zip(a, b, strict=True))
    return a == b


MIXED = [
    "a cat sat on the mat",
    ["stocks fell sharply on monday", "rain"],
    "a much longer sentence that pads every shorter input of the batch by a good margin",
    ["x", "the quick brown fox jumps over the lazy dog"],
]


@pytest.mark.parametrize(
    ("task", "inputs", "params"),
    [
        ("feature-extraction", MIXED, None),
        ("feature-extraction", MIXED, {"normalize": False, "max_length": 8}),
        ("text-classification", MIXED, {"top_k": 2}),
        ("forward", MIXED, None),
        ("fill-mask", ["the [MASK] sat", ["a [MASK]", "longer text with one [MASK] in it"]], None),
    ],
)
def test_batched_outputs_equal_each_call_run_alone(
    manager: ResidencyManager, devices: list[Device], task: str, inputs: list[Any], params: Any
) -> None:
    manager.load(synthetic(task), "r1", {gpu(devices): GiB})
    ran, gpus = manager.calls.run_batch("r1", [(i, params) for i in inputs])
    assert gpus == [gpu(devices)]
    assert [r.batch for r in ran] == [len(inputs)] * len(inputs)  # one shared pass
    for call, outcome in zip(inputs, ran, strict=True):
        assert outcome.error is None
        alone = manager.calls.infer("r1", call, params)
        assert close(outcome.outputs, alone), (call, outcome.outputs, alone)


def test_minilm_batched_gives_each_caller_its_own_embeddings_as_alone(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    minilm = Catalog.load(REPO / "models.yaml")["minilm"]
    manager.load(minilm, "r1", {gpu(devices): GiB})
    texts = [f"caller {i} asks about {topic}" for i, topic in enumerate(["cats", "rates", "rain"])]
    ran, _ = manager.calls.run_batch("r1", [(t, None) for t in texts])
    vectors = [r.outputs["embeddings"][0] for r in ran]
    for text, vector in zip(texts, vectors, strict=True):
        assert close(vector, manager.calls.infer("r1", text)["embeddings"][0])
    assert len({tuple(v) for v in vectors}) == 3  # three callers, three answers


def test_a_batch_whose_activations_would_pass_the_reservation_is_split_and_all_answered(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    # 64 MiB of weights and 24 MiB left for activations: one call of eight 512-character
    # inputs needs about 6 MB, so eight such calls cannot share one pass.
    spec = synthetic("forward", 64 * MiB)
    manager.load(spec, "r1", {gpu(devices): 64 * MiB}, limit=64 * MiB + 24 * MiB)
    calls = [([f"{i}" + "x" * 511] * 8, None) for i in range(8)]
    with pytest.raises(torch.OutOfMemoryError):  # the calls as one request do not fit
        manager.calls.infer("r1", [text for call, _ in calls for text in call])
    ran, _ = manager.calls.run_batch("r1", calls)
    assert all(r.error is None for r in ran)
    assert 1 < max(r.batch for r in ran) < len(calls)  # shared, but in several passes
    for (call, _), outcome in zip(calls, ran, strict=True):
        assert close(outcome.outputs, manager.calls.infer("r1", call))


def test_a_bad_call_in_a_batch_fails_alone_and_the_others_are_answered(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    manager.load(synthetic("fill-mask"), "r1", {gpu(devices): GiB})
    requests: list[tuple[object, Any]] = [
        ("the [MASK] sat", None),
        (5, None),
        ("no mask here", None),
        ("a [MASK]", {"temperature": 2}),
        ("one more [MASK]", None),
    ]
    ran, _ = manager.calls.run_batch("r1", requests)
    errors = [type(r.error).__name__ if r.error else None for r in ran]
    assert errors == [None, "PayloadError", "PayloadError", "PayloadError", None]
    assert "has no mask token" in str(ran[2].error)
    assert [r.batch for r in ran if r.error is None] == [2, 2]


def test_a_pass_that_fails_is_run_again_one_call_at_a_time_so_only_its_culprit_fails(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    manager.load(synthetic("fill-mask"), "r1", {gpu(devices): GiB})
    cut = "word " * 40 + "[MASK]"  # truncation at 16 tokens cuts its mask off
    requests = [("the [MASK] sat", {"max_length": 16}), (cut, {"max_length": 16})]
    ran, _ = manager.calls.run_batch("r1", requests)
    assert ran[0].error is None and ran[0].batch == 1  # answered, alone, after the retry
    assert isinstance(ran[1].error, PayloadError)
    assert "cut the mask token" in str(ran[1].error)
    assert close(ran[0].outputs, manager.calls.infer("r1", *requests[0]))


# --- the worker's hold on calls (tasks.serving.batching.Batcher) ----------------------------


class _Request:
    """What the batcher reads of a Celery request, and the callbacks it fans out."""

    def __init__(
        self,
        task_id: str,
        replica: str,
        revoked: bool = False,
        time_limits: tuple[float | None, float | None] = (None, None),
        *,
        model: str = "m",
        hops: int = 0,
        inputs: str | list[str] = "x" * 10,
        tenant: str | None = None,
    ) -> None:
        self.id = task_id
        self.time_limits = time_limits  # (hard, soft), from the message's `timelimit`
        self.task = SimpleNamespace(time_limit=None, soft_time_limit=None)  # no defaults
        self.name = "gpufleet.run"
        self.args = [{"model": model, "inputs": inputs, "params": None, "replica": replica,
                      "cache": "hot", "sent_ms": 0, "hops": hops}]  # fmt: skip
        self.kwargs: dict[str, Any] = {}
        self.request_dict: dict[str, Any] = {"gpufleet_tenant": tenant} if tenant else {}
        self.delivery_info: dict[str, Any] = {}
        self.type = "gpufleet.run"
        self.body = self.content_type = self.content_encoding = None
        self._revoked = revoked
        self.seen: list[str] = []

    @property
    def _app(self) -> Any:
        from tasks.app import app

        return app

    def revoked(self) -> bool:
        return self._revoked

    def on_accepted(self, pid: int, time_accepted: float) -> None:
        self.seen.append("accepted")

    def on_success(self, result: Any) -> None:
        self.seen.append(f"success {result}")

    def on_failure(self, exc_info: Any) -> None:
        self.seen.append("failure")

    def on_timeout(self, soft: bool, timeout: float) -> None:
        self.seen.append(f"{'soft' if soft else 'hard'} timeout {timeout}")

    def reject(self, requeue: bool = False) -> None:
        self.seen.append("rejected")


class _Pool:
    """A pool that records the jobs it is given; the test ends them."""

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []

    def apply_async(self, target: Any, args: tuple[Any, ...], **callbacks: Any) -> None:
        self.jobs.append({"ids": [job[1][1] for job in args[0]], **callbacks})


def test_the_batcher_sends_one_job_per_free_child_and_settles_each_call_of_it() -> None:
    from tasks.serving.batching import Batcher

    pool, passed = _Pool(), []
    batcher = Batcher(pool, None, passed.append, lambda _: BatchLimits(size=8), lambda _: [])
    first, second, third = _Request("c1", "r1"), _Request("c2", "r1"), _Request("c3", "r2")
    gone = _Request("c4", "r1", revoked=True)
    batcher(first)  # the child is free: it goes at once, alone
    for request in (second, gone, third):
        batcher(request)  # the child is busy: they wait
    assert [job["ids"] for job in pool.jobs] == [["c1"]]
    pool.jobs[0]["accept_callback"](7, 0.0)
    pool.jobs[0]["callback"]([(0, "ok", 0.1)])
    assert first.seen == ["accepted", "success (0, 'ok', 0.1)"]
    assert [job["ids"] for job in pool.jobs] == [["c1"], ["c2"]]  # r1's, the revoked skipped
    pool.jobs[1]["error_callback"]("lost")
    assert second.seen == ["failure"] and gone.seen == []
    assert [job["ids"] for job in pool.jobs][-1] == ["c3"]
    unknown = _Request("c5", "r1")
    unknown.name = "gpufleet.status"
    batcher(unknown)
    assert passed == [unknown]  # not a call: Celery's own path


def test_a_job_takes_what_its_replica_s_last_jobs_say_runs_in_job_ms_and_rows_set_the_line() -> (
    None
):
    """Tenant a's calls of 8 inputs each take 0.6 of `JOB_MS` here. After a job of one
    such call, a job may take two (every job so far held one: the fit cannot tell a job's
    fixed part from its calls'), and after one of two, one. b's two calls of one input
    each, arriving behind a's backlog, pass it (a call costs its rows in the line: a's
    next call is due 8 rows on)."""
    from tasks.serving.batching import Batcher

    pool, now = _Pool(), [0.0]
    limits = lambda _: BatchLimits(size=8)  # noqa: E731
    batcher = Batcher(
        pool,
        None,
        lambda _: None,
        limits,
        lambda _: [],
        tenanted=lambda: True,
        clock=lambda: now[0],
    )
    for i in range(4):  # the first goes at once; the others wait
        batcher(_Request(f"a{i}", "r1", inputs=["text"] * 8, tenant="a"))
    batcher(_Request("b0", "r1", tenant="b"))
    batcher(_Request("b1", "r1", tenant="b"))
    for job in range(4):  # each job's calls take 0.6 of JOB_MS each
        pool.jobs[job]["accept_callback"](7, now[0])
        now[0] += 0.6 * JOB_MS / 1000 * len(pool.jobs[job]["ids"])
        pool.jobs[job]["callback"]([(i, "ok", 0.1) for i in range(len(pool.jobs[job]["ids"]))])
    assert [job["ids"] for job in pool.jobs] == [["a0"], ["b0", "b1"], ["a1"], ["a2"], ["a3"]]


def test_without_tenants_competing_a_job_is_bounded_by_its_limits_alone() -> None:
    from tasks.serving.batching import Batcher

    pool, now = _Pool(), [0.0]
    limits = lambda _: BatchLimits(size=8)  # noqa: E731
    batcher = Batcher(pool, None, lambda _: None, limits, lambda _: [], clock=lambda: now[0])
    for i in range(4):
        batcher(_Request(f"c{i}", "r1", inputs=["text"] * 8))
    pool.jobs[0]["accept_callback"](7, now[0])
    now[0] += 3 * JOB_MS / 1000  # arrival order needs no bound, and throughput would pay
    pool.jobs[0]["callback"]([(0, "ok", 0.1)])
    assert [job["ids"] for job in pool.jobs] == [["c0"], ["c1", "c2", "c3"]]


def test_a_job_the_pool_drops_with_a_lost_connection_does_not_hold_up_the_calls_after_it() -> None:
    from tasks.serving.batching import Batcher

    pool = _Pool()
    batcher = Batcher(pool, None, lambda _: None, lambda _: BatchLimits(size=8), lambda _: [])
    batcher(_Request("c1", "r1"))
    # the consumer lost its connection: Celery's pool drops c1's job, never calling it back
    batcher.forget()
    batcher(_Request("c2", "r1"))  # delivered on the new connection
    assert [job["ids"] for job in pool.jobs] == [["c1"], ["c2"]]
    # a job from before the loss that did run ends late: c2's job still holds the child
    pool.jobs[0]["callback"]([(0, "ok", 0.1)])
    batcher(_Request("c3", "r1"))
    assert [job["ids"] for job in pool.jobs] == [["c1"], ["c2"]]
    pool.jobs[1]["callback"]([(0, "ok", 0.1)])
    assert [job["ids"] for job in pool.jobs][-1] == ["c3"]


def test_a_running_call_whose_job_the_pool_drops_with_a_lost_connection_runs_next() -> None:
    """A call that counts as running (a session was handed it and ended unread, so the
    reconnected consumer does not give its message back) is sent in a new job; the
    connection drops again before the child accepts it, and the pool drops that job
    without calling it back: the call must run next, not stay running for good."""
    from celery.worker.state import active_requests

    from tasks.serving.batching import Batcher

    pool = _Pool()
    batcher = Batcher(pool, None, lambda _: None, lambda _: BatchLimits(size=8), lambda _: [])
    running, later = _Request("c1", "r1"), _Request("c2", "r1")
    active_requests.add(running)  # accepted once already: Celery counts it as running
    try:
        batcher(running)
        batcher.forget()  # the child never accepted c1's job: the pool drops it
        batcher(later)  # delivered on the new connection
        assert [job["ids"] for job in pool.jobs] == [["c1"], ["c1", "c2"]]
        pool.jobs[1]["accept_callback"](7, 0.0)
        batcher.forget()  # this job was accepted: it ends on its own, nothing is sent again
        pool.jobs[1]["callback"]([(0, "ok", 0.1), (1, "ok", 0.1)])
        assert running.seen == ["accepted", "success (0, 'ok', 0.1)"]
        assert len(pool.jobs) == 2
    finally:
        active_requests.discard(running)


def test_calls_share_a_batch_only_with_calls_of_their_time_limits_which_the_batch_keeps() -> None:
    from tasks.serving.batching import Batcher

    pool = _Pool()
    batcher = Batcher(pool, None, lambda _: None, lambda _: BatchLimits(size=8), lambda _: [])
    first = _Request("c1", "r1", time_limits=(5.0, 2.0))
    same, other = _Request("c2", "r1", time_limits=(5.0, 2.0)), _Request("c3", "r1")
    for request in (first, same, other):
        batcher(request)  # the first goes at once; the others wait for the child
    assert (pool.jobs[0]["timeout"], pool.jobs[0]["soft_timeout"]) == (5.0, 2.0)
    pool.jobs[0]["callback"]([(0, "ok", 0.1)])
    pool.jobs[1]["timeout_callback"](False, 5.0)  # the pool killed the batch's child
    assert same.seen == ["hard timeout 5.0"] and other.seen == []
    pool.jobs[1]["error_callback"]("lost")
    assert [job["ids"] for job in pool.jobs] == [["c1"], ["c2"], ["c3"]]  # never together
    assert (pool.jobs[2]["timeout"], pool.jobs[2]["soft_timeout"]) == (None, None)
