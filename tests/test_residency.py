"""The resident-model manager on simulated GPUs: load, serve, offload, restore, caps."""

from __future__ import annotations

import weakref
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch

from placement.catalog.catalog import Catalog, ModelSpec
from placement.errors import EvictedError, PayloadError, PlacementError
from placement.ledger.registry import Registry
from placement.units.memory import MiB, process_fraction
from tests.fleets import GiB
from worker import handlers, loading
from worker.devices import Device, simulated_devices
from worker.residency import ResidencyManager

REPO = Path(__file__).resolve().parents[1]
HOST = "testhost"


@pytest.fixture(scope="module")
def catalog() -> Catalog:
    return Catalog.load(REPO / "models.yaml")


@pytest.fixture
def devices() -> list[Device]:
    return simulated_devices("2x8GiB")


@pytest.fixture
def manager(devices: list[Device]) -> Iterator[ResidencyManager]:
    m = ResidencyManager(devices, HOST)
    yield m
    m.drop_all()


def gpu(devices: list[Device], i: int) -> str:
    return devices[i].gpu_id(HOST)


def synthetic(name: str, task: str, memory: int) -> ModelSpec:
    data = {"models": {name: {"source": "synthetic", "task": task, "memory": memory}}}
    return Catalog.from_mapping(data).get(name)


def test_minilm_loads_and_gives_repeatable_384_dimensional_embeddings(
    manager: ResidencyManager, catalog: Catalog, devices: list[Device]
) -> None:
    report = manager.load(catalog.get("minilm"), "r1", {gpu(devices, 0): GiB})
    assert report.nbytes > 80 * MiB  # the real weights, about 87 MiB
    first = manager.calls.infer("r1", ["a cat sat on the mat", "stocks fell sharply"])
    again = manager.calls.infer("r1", ["a cat sat on the mat", "stocks fell sharply"])
    assert first["dim"] == 384
    assert len(first["embeddings"]) == 2
    assert first == again


@pytest.fixture
def reporting(
    redis_url: str, fleet: str, devices: list[Device]
) -> Iterator[tuple[Registry, ResidencyManager]]:
    """A manager that reports measured peaks to a real registry."""
    registry = Registry.from_url(redis_url, fleet)
    manager = ResidencyManager(devices, HOST, registry=registry)
    yield registry, manager
    manager.drop_all()
    registry.client.close()


def test_the_measured_peak_of_a_real_model_reaches_the_registry(
    reporting: tuple[Registry, ResidencyManager], catalog: Catalog, devices: list[Device]
) -> None:
    registry, manager = reporting
    report = manager.load(catalog.get("minilm"), "r1", {gpu(devices, 0): GiB})
    learned = registry.snapshot().learned["minilm"]
    assert learned == report.peak_bytes
    assert learned >= report.nbytes  # weights plus the warm-up call's activations
    assert [e["kind"] for e in registry.events()] == ["measured"]


def test_a_call_that_needs_more_than_the_load_measured_raises_the_learned_peak(
    reporting: tuple[Registry, ResidencyManager], catalog: Catalog, devices: list[Device]
) -> None:
    registry, manager = reporting
    report = manager.load(catalog.get("minilm"), "r1", {gpu(devices, 0): GiB})
    manager.calls.infer("r1", "short")  # needs less than the warm-up: nothing to report
    assert registry.snapshot().learned["minilm"] == report.peak_bytes
    manager.calls.infer("r1", ["a longer sentence about a cat on a mat " * 8] * 4)
    grown = registry.snapshot().learned["minilm"]
    assert grown > report.peak_bytes  # a replica placed now has room for such a call
    manager.calls.infer("r1", "short")
    assert registry.snapshot().learned["minilm"] == grown  # it never shrinks
    assert [e["kind"] for e in registry.events()] == ["measured", "measured"]


def test_offload_then_restore_on_another_gpu_gives_identical_outputs(
    manager: ResidencyManager, catalog: Catalog, devices: list[Device]
) -> None:
    manager.load(catalog.get("minilm"), "r1", {gpu(devices, 0): GiB})
    before = manager.calls.infer("r1", "the same sentence")
    offload = manager.offload("r1")
    assert offload.nbytes > 80 * MiB
    with pytest.raises(EvictedError, match="route the request again"):
        manager.calls.infer("r1", "the same sentence")
    manager.restore("r1", {gpu(devices, 1): GiB})
    assert manager.calls.infer("r1", "the same sentence") == before
    assert manager.summary()[0]["gpus"] == {gpu(devices, 1): GiB}


@pytest.mark.parametrize(
    ("task", "key"),
    [
        ("feature-extraction", "embeddings"),
        ("text-generation", "texts"),
        ("text-classification", "labels"),
        ("forward", "head"),
    ],
)
def test_synthetic_models_serve_every_task_deterministically(
    manager: ResidencyManager, devices: list[Device], task: str, key: str
) -> None:
    spec = synthetic(f"syn-{task}", task, 64 * MiB)
    manager.load(spec, "r1", {gpu(devices, 0): 256 * MiB})
    out = manager.calls.infer("r1", ["hello", "world"])
    assert len(out[key]) in (2, 8)  # a batch of two, or the 8-value head of forward
    assert manager.calls.infer("r1", ["hello", "world"]) == out


def test_a_synthetic_model_is_accounted_at_its_declared_size(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    spec = synthetic("sim-3g", "forward", 3 * GiB)
    manager.load(spec, "r1", {gpu(devices, 0): 4 * GiB})
    assert manager.summary()[0]["accounted_bytes"] == 3 * GiB
    # The cap is the process's whole reservation on the GPU, as with CUDA's per-process
    # fraction: 4 GiB + 0.5 GiB, of which 3 GiB are in use, so 2 GiB more do not fit.
    with pytest.raises(torch.OutOfMemoryError, match="simulated GPU 0 out of memory"):
        manager.load(synthetic("sim-2g", "forward", 2 * GiB), "r2", {gpu(devices, 0): GiB // 2})
    # the failed load left nothing behind, and the first model still serves
    assert [r["replica"] for r in manager.summary()] == ["r1"]
    manager.load(synthetic("sim-1g", "forward", GiB), "r3", {gpu(devices, 0): GiB})
    assert manager.calls.infer("r1", "still here")["shape"]


def test_a_load_beyond_its_reservation_raises_the_cuda_oom_error(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    with pytest.raises(torch.OutOfMemoryError, match="tried to allocate 2 GiB"):
        manager.load(synthetic("big", "forward", 2 * GiB), "r1", {gpu(devices, 0): GiB})
    assert manager.summary() == []


def test_a_call_whose_activations_pass_the_reservation_raises_oom_and_the_worker_goes_on(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    spec = synthetic("tight", "forward", 64 * MiB)
    manager.load(spec, "r1", {gpu(devices, 0): 64 * MiB + 2 * MiB})
    with pytest.raises(torch.OutOfMemoryError, match="send a smaller batch"):
        manager.calls.infer("r1", ["x" * 8000] * 64)
    assert manager.calls.infer("r1", "short")["shape"]


def test_malformed_inputs_get_clear_errors_and_the_model_keeps_serving(
    manager: ResidencyManager, catalog: Catalog, devices: list[Device]
) -> None:
    manager.load(catalog.get("minilm"), "r1", {gpu(devices, 0): GiB})
    with pytest.raises(PayloadError, match="string or a list of strings"):
        manager.calls.infer("r1", {"text": "nested"})
    with pytest.raises(PayloadError, match="unknown"):
        manager.calls.infer("r1", "ok", {"temperature": 2})
    assert manager.calls.infer("r1", "fine")["dim"] == 384


def test_the_process_fraction_follows_the_reservation_and_resets_when_empty(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    assert manager.fraction(0) == 1.0
    manager.load(synthetic("a", "forward", GiB), "r1", {gpu(devices, 0): 2 * GiB})
    manager.load(synthetic("b", "forward", GiB), "r2", {gpu(devices, 0): 2 * GiB})
    assert manager.fraction(0) == process_fraction(4 * GiB, devices[0].total) == 0.5
    assert manager.fraction(1) == 1.0
    manager.offload("r1")
    assert manager.fraction(0) == 0.25
    manager.drop("r2")
    manager.drop("r1")
    assert manager.fraction(0) == 1.0


def test_a_plan_for_a_gpu_this_worker_does_not_own_is_refused(
    manager: ResidencyManager,
) -> None:
    with pytest.raises(PlacementError, match="does not own"):
        manager.load(synthetic("a", "forward", GiB), "r1", {"elsewhere:0": 2 * GiB})


def test_loading_a_replica_twice_is_refused(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    manager.load(synthetic("a", "forward", 64 * MiB), "r1", {gpu(devices, 0): GiB})
    with pytest.raises(PlacementError, match="already held"):
        manager.load(synthetic("a", "forward", 64 * MiB), "r1", {gpu(devices, 1): GiB})


@pytest.mark.parametrize("name", sorted(Catalog.load(REPO / "models.yaml")))
def test_every_demo_model_loads_and_serves_in_the_slot_the_policy_gives_it(
    catalog: Catalog, devices: list[Device], name: str
) -> None:
    from placement.policy.settings import PolicySettings
    from placement.policy.sizing import single_gpu_slot

    spec = catalog.get(name)
    slot = single_gpu_slot(spec.demand(), devices[0].to_gpu(HOST).total, PolicySettings())
    assert slot is not None, f"{name} does not fit one default 8 GiB simulated GPU"
    manager = ResidencyManager(devices, HOST)
    try:
        request, limit = slot
        manager.load(spec, "r1", {gpu(devices, 0): request}, limit)  # with its warm-up call
        assert manager.calls.infer("r1", "a demo call")["batch"] == 1
    finally:
        manager.drop_all()


def test_a_one_gpu_replica_may_grow_to_its_admission_limit_but_no_further(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    # Reserved 64 MiB, all of it weights: only the limit leaves room for activations
    # (about 6 MB for the small call below, about 50 MB for the large one).
    spec = synthetic("env", "forward", 64 * MiB)
    limit = 64 * MiB + 24 * MiB
    manager.load(spec, "r1", {gpu(devices, 0): 64 * MiB}, limit=limit)
    assert manager.fraction(0) == process_fraction(limit, devices[0].total)
    assert manager.calls.infer("r1", ["x" * 512] * 8)["shape"]
    with pytest.raises(torch.OutOfMemoryError):
        manager.calls.infer("r1", ["x" * 8000] * 64)


def test_a_dropped_replica_frees_its_weights_even_while_something_still_refers_to_them(
    manager: ResidencyManager, catalog: Catalog, devices: list[Device]
) -> None:
    manager.load(catalog.get("minilm"), "r1", {gpu(devices, 0): GiB})
    model = manager.residents["r1"].model
    weight = next(model.parameters())
    held = [model]
    held.append(held)  # a reference cycle: only a garbage collection would free it
    assert weight.numel() > 0
    manager.drop("r1")
    assert "r1" not in manager.residents
    assert weight.numel() == 0  # freed at once, with no `gc.collect()` on the drop's path
    assert loading.tensor_bytes(model) == 0


def test_a_model_loaded_again_after_its_drop_reuses_its_tokenizer(
    manager: ResidencyManager, catalog: Catalog, devices: list[Device]
) -> None:
    spec = catalog.get("minilm")
    manager.load(spec, "r1", {gpu(devices, 0): GiB})
    first = manager.residents["r1"].tokenizer
    manager.drop("r1")
    manager.load(spec, "r2", {gpu(devices, 1): GiB})
    assert manager.residents["r2"].tokenizer is first
    assert manager.calls.infer("r2", "same tokens")["dim"] == 384


def passes_of(manager: ResidencyManager, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The replicas of every call `manager.calls` runs from now on (warm-ups too)."""
    passes: list[str] = []
    infer = manager.calls.infer

    def counted(replica: str, *args: Any) -> Any:
        passes.append(replica)
        return infer(replica, *args)

    monkeypatch.setattr(manager.calls, "infer", counted)
    return passes


def test_a_model_loaded_again_in_the_same_process_skips_its_warm_up(
    reporting: tuple[Registry, ResidencyManager],
    catalog: Catalog,
    devices: list[Device],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    registry, manager = reporting
    spec = catalog.get("minilm")
    first = manager.load(spec, "r1", {gpu(devices, 0): GiB})
    manager.drop("r1")
    passes = passes_of(manager, monkeypatch)
    again = manager.load(spec, "r2", {gpu(devices, 1): GiB})
    assert passes == []  # the miss waits for the load alone
    assert again.peak_bytes == first.peak_bytes == registry.snapshot().learned["minilm"]
    assert manager.calls.infer("r2", "served after all")["dim"] == 384


class _Interrupted(Exception):
    """Stands for an error about a whole pass, such as a time limit."""


def test_a_whole_pass_error_fails_every_call_of_the_pass_without_a_retry_one_by_one(
    manager: ResidencyManager,
    catalog: Catalog,
    devices: list[Device],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    manager.load(catalog.get("minilm"), "r1", {gpu(devices, 0): GiB})
    run_many = handlers.run_many

    def interrupted_when_shared(
        task: str, model: Any, tokenizer: Any, texts: Any, *rest: Any
    ) -> Any:
        if len(texts) > 1:
            raise _Interrupted("the pass ran out of time")
        return run_many(task, model, tokenizer, texts, *rest)

    monkeypatch.setattr(handlers, "run_many", interrupted_when_shared)
    requests = [("a cat", None), ("a dog", None)]
    retried, _ = manager.calls.run_batch("r1", requests)
    assert [r.error for r in retried] == [None, None]  # any other error: one by one
    manager.calls.whole_pass_errors = (_Interrupted,)
    failed, _ = manager.calls.run_batch("r1", requests)
    assert all(isinstance(r.error, _Interrupted) and r.batch == 2 for r in failed)


def test_a_failed_pass_frees_what_its_frames_held_while_its_error_is_still_kept(
    manager: ResidencyManager,
    catalog: Catalog,
    devices: list[Device],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """On a GPU a pass's activations are device memory: an error that kept its frames would
    keep them allocated, outside the ledger, until Celery has answered the call."""
    manager.load(catalog.get("minilm"), "r1", {gpu(devices, 0): GiB})
    held: list[weakref.ref[torch.Tensor]] = []

    def fails_holding_activations(*_: Any) -> Any:
        activations = torch.ones(1024, 1024)
        held.append(weakref.ref(activations))
        raise RuntimeError("the pass failed")

    monkeypatch.setattr(handlers, "run_many", fails_holding_activations)
    (ran,), _ = manager.calls.run_batch("r1", [("a cat", None)])
    assert isinstance(ran.error, RuntimeError)
    assert held and held[0]() is None  # freed, though `ran.error` still lives


def test_a_pinned_copy_is_charged_its_power_of_two_blocks() -> None:
    """PyTorch's pinned-memory allocator rounds each block up to a power of two."""
    model = torch.nn.Linear(3, 5)  # weight 60 bytes -> a 64-byte block, bias 20 -> 32
    assert loading.tensor_bytes(model) == 80
    assert loading.pinned_bytes(model) == 96
    exact = torch.nn.Linear(4, 4, bias=False)  # 64 bytes: already a power of two
    assert loading.pinned_bytes(exact) == 64
    twin = torch.nn.Linear(3, 5)
    twin.weight = model.weight  # a tied weight is one tensor, pinned once
    assert loading.pinned_bytes(torch.nn.Sequential(model, twin)) == 96 + 32


def test_a_model_loaded_again_another_way_is_warmed_up_again(
    reporting: tuple[Registry, ResidencyManager],
    catalog: Catalog,
    devices: list[Device],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The warm-up is a build path's first check: a reload through transformers' loader,
    after the reader, runs it again."""
    _, manager = reporting
    spec = catalog.get("minilm")
    assert manager.load(spec, "r1", {gpu(devices, 0): GiB}).via == "safetensors"
    manager.drop("r1")
    passes = passes_of(manager, monkeypatch)
    again = manager.load(replace(spec, loader="transformers"), "r2", {gpu(devices, 1): GiB})
    assert again.via == "transformers"
    assert passes == ["r2"]


def test_a_model_restored_over_several_gpus_is_spread_as_its_load_spread_it() -> None:
    from accelerate import infer_auto_device_map
    from transformers import GPT2Config, GPT2LMHeadModel
    from transformers.integrations.accelerate import _get_device_map

    config = GPT2Config(n_layer=8, n_embd=256, n_head=4, vocab_size=2000, n_positions=128)
    model = GPT2LMHeadModel(config)
    nbytes = loading.tensor_bytes(model)
    limits: dict[int | str, int] = {0: int(nbytes * 0.8), 1: int(nbytes * 0.8), "cpu": 0}
    spread = loading.device_map(model, limits)
    # what from_pretrained(device_map="auto") does at load, not the first GPU filled first
    assert spread == _get_device_map(model, "auto", dict(limits), None)
    greedy = infer_auto_device_map(model, max_memory=dict(limits))
    assert spread != greedy and set(spread.values()) == {0, 1}
    # a load's own map is kept, on the GPUs of the new plan in the same order
    model.hf_device_map = spread
    elsewhere = loading.device_map(model, {2: limits[0], 3: limits[1], "cpu": 0})
    assert elsewhere == {name: {0: 2, 1: 3}[gpu] for name, gpu in spread.items()}
