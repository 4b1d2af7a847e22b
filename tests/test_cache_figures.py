"""The model cache's own figures (`placement.ledger.figures.cache`) against a real redis-server:
loads', restores' and misses' durations in their buckets, each eviction's age counted by
the script that evicts, each GPU's LRU age, and all of them in the status object and
/metrics from the first scrape."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from placement.ledger.figures import cache
from placement.ledger.registry import Registry
from placement.ledger.report import status_report
from placement.policy.state import Demand, Gpu, Level
from tasks.operator.metrics import FleetCollector
from tasks.serving.status import full_status
from tests.acting import make_hot, settle_leaving
from tests.fleets import GiB

#: Each family a dashboard queries, as its samples are named.
HISTOGRAM_FAMILIES = (
    "gpufleet_load_duration_seconds",
    "gpufleet_restore_duration_seconds",
    "gpufleet_miss_latency_seconds",
    "gpufleet_eviction_age_seconds",
)


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    """One 8 GiB GPU of worker w0 with a 2 GiB warm cache: two 2 GiB models (a 6 GiB slot
    each) do not fit on it together, nor two warm copies in the cache."""
    registry = Registry.from_url(redis_url, fleet)
    gpu = Gpu(id="h0:0", host="h0", index=0, name="Sim 8GiB", total=8 * GiB)
    registry.register_worker("w0", "h0", f"{fleet}.q0", [gpu], warm_budget=2 * GiB)
    yield registry
    registry.client.close()


def place_hot(reg: Registry, model: str, *, dedicated: bool = False) -> str:
    demand = Demand(model, size=GiB if dedicated else 2 * GiB, dedicated=dedicated)
    return make_hot(reg, reg.place(demand, rng=random.Random(0)))


def samples(reg: Registry, broker_url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    collectors = CollectorRegistry()
    collectors.register(FleetCollector(reg, broker_url))
    text = generate_latest(collectors).decode()
    return {
        (sample.name, tuple(sorted(sample.labels.items()))): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


def bucket(name: str, model: str, le: str) -> tuple[str, tuple[tuple[str, str], ...]]:
    return f"{name}_bucket", (("le", le), ("model", model))


def test_a_duration_lands_in_the_first_bucket_at_or_above_it(reg: Registry) -> None:
    cache.record(reg, [("m", "load", 3.0), ("m", "load", 2.5), ("m", "load", 1000.0)])
    cache.record(reg, [("m", "restore", 0.02), ("other", "miss", 0.0)])
    figures = cache.read(reg, ["m", "other"])
    load = dict(figures["m"]["load"].buckets)
    assert (load["1.0"], load["2.5"], load["5.0"], load["600.0"], load["+Inf"]) == (0, 1, 2, 2, 3)
    assert figures["m"]["load"].sum == pytest.approx(1005.5)
    restore = dict(figures["m"]["restore"].buckets)
    assert (restore["0.01"], restore["0.025"], figures["m"]["restore"].count) == (0, 1, 1)
    assert dict(figures["other"]["miss"].buckets)["0.01"] == 1  # waited nothing: a bucket too
    assert figures["other"]["load"].count == 0
    with pytest.raises(ValueError, match="unknown cache figure"):
        cache.record(reg, [("m", "lunch", 1.0)])


def test_an_explicit_eviction_counts_the_replicas_age_since_its_placement(
    reg: Registry,
) -> None:
    placed = time.monotonic()
    replica = place_hot(reg, "a")
    time.sleep(1.2)  # older than the first bucket's bound (1 s)
    assert reg.evict(replica) is Level.OFFLOADING
    took = time.monotonic() - placed
    age = cache.read(reg, ["a"])["a"]["eviction_age"]
    assert age.count == 1
    assert 1.2 <= age.sum <= took + 0.05  # the registry's clock, against this test's
    assert dict(age.buckets)["1.0"] == 0
    assert dict(age.buckets)["10.0"] == 1
    # Its copy was leaving already: asked to go COLD now, it is not evicted twice.
    assert reg.evict(replica, to=Level.COLD) is Level.DROPPING
    settle_leaving(reg)
    assert cache.read(reg, ["a"])["a"]["eviction_age"].count == 1


def test_each_victim_of_pressure_counts_its_age_once_and_a_dropped_warm_copy_none(
    reg: Registry,
) -> None:
    a = place_hot(reg, "a")
    place_hot(reg, "b")  # evicts a to the warm cache
    assert reg.deployment(a).level is Level.WARM  # type: ignore[union-attr]
    place_hot(reg, "c")  # evicts b; b's warm copy takes a's room, so a is dropped
    events = [(e["kind"], e["model"]) for e in reg.events()]
    assert events.count(("evicted", "a")) == events.count(("evicted", "b")) == 1
    assert ("dropped", "a") in events
    assert reg.deployment(a).level is Level.COLD  # type: ignore[union-attr]
    figures = cache.read(reg, ["a", "b", "c"])
    counts = {m: f["eviction_age"].count for m, f in figures.items()}
    assert counts == {"a": 1, "b": 1, "c": 0}  # the drop of a's warm copy counted nothing


def test_a_gpus_lru_age_is_the_idle_time_of_the_replica_an_eviction_takes_first(
    reg: Registry, fleet: str
) -> None:
    idle = Gpu(id="h0:1", host="h0", index=1, name="Sim 8GiB", total=8 * GiB)
    reg.register_worker("w1", "h0", f"{fleet}.q1", [idle])
    assert cache.lru_ages_ms(reg.snapshot()) == {}  # nothing held: no age
    small = [Demand(m, size=GiB // 2) for m in ("x", "y")]
    place_hot(reg, "pinned", dedicated=True)  # never evicted: not an LRU end
    assert cache.lru_ages_ms(reg.snapshot()) == {}
    started = time.monotonic()
    x = make_hot(reg, reg.place(small[0], rng=random.Random(0)))  # used as it became HOT
    y = make_hot(reg, reg.place(small[1], rng=random.Random(0)))
    snap = reg.snapshot()
    (gpu_id,) = {*snap.deployments[x].gpus, *snap.deployments[y].gpus}
    time.sleep(0.5)
    lease = reg.pick("y")  # y is used now, x not since it became HOT
    assert lease is not None
    reg.finish(lease)
    snap = reg.snapshot()
    ages = cache.lru_ages_ms(snap)
    assert set(ages) == {gpu_id}  # the other GPU holds nothing
    assert 500 <= ages[gpu_id] <= (time.monotonic() - started) * 1000 + 50
    assert [g["lru_age_ms"] for g in status_report(snap)["gpus"] if g["id"] == gpu_id] == [
        ages[gpu_id]
    ]
    busy = reg.pick("x")  # a call that began long ago and runs still: x is no LRU end
    assert busy is not None
    reg.client.hset(reg.keys.deployment(x), "last_used", 1)
    assert cache.lru_ages_ms(reg.snapshot())[gpu_id] < ages[gpu_id]  # y's age, not x's
    reg.finish(busy)
    reg.evict(x)  # y is the LRU end now, used half a second after x
    assert cache.lru_ages_ms(reg.snapshot())[gpu_id] < ages[gpu_id]


def test_every_model_has_its_cache_histograms_from_the_first_scrape(
    reg: Registry, redis_url: str
) -> None:
    replica = place_hot(reg, "a")  # in the ledger, nothing counted yet
    before = samples(reg, redis_url)
    for name in HISTOGRAM_FAMILIES:
        assert before[bucket(name, "a", "+Inf")] == 0
        assert before[(f"{name}_count", (("model", "a"),))] == 0
    (gpu_id,) = reg.deployment(replica).gpus  # type: ignore[union-attr]
    assert before[("gpufleet_lru_age_seconds", (("gpu", gpu_id),))] >= 0
    cache.record(reg, [("a", "load", 0.3), ("a", "miss", 0.3)])
    reg.evict(replica)
    after = samples(reg, redis_url)
    assert after[bucket("gpufleet_load_duration_seconds", "a", "0.25")] == 0
    assert after[bucket("gpufleet_load_duration_seconds", "a", "0.5")] == 1
    assert after[bucket("gpufleet_miss_latency_seconds", "a", "0.5")] == 1
    assert after[bucket("gpufleet_eviction_age_seconds", "a", "+Inf")] == 1
    assert ("gpufleet_lru_age_seconds", (("gpu", gpu_id),)) not in after  # it holds none now
    report = full_status(reg, redis_url)
    assert report["cache"]["a"]["load_count"] == 1
    assert report["cache"]["a"]["eviction_age_count"] == 1
    assert report["cache"]["a"]["restore_mean_s"] is None
