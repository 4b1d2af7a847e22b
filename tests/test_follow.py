"""The router's view of a real registry, kept current from its events stream."""

from __future__ import annotations

import random
import time
from collections.abc import Iterator

import pytest

from placement.errors import CantAccommodateError
from placement.ledger.follow import FRESH_S
from placement.ledger.registry import Registry
from placement.policy.room import room_of
from placement.policy.state import Demand, Gpu, Level, Snapshot
from tests.acting import evict_now, make_hot, settle_leaving
from tests.fleets import GiB


def _gpu(gpu_id: str, host: str, index: int) -> Gpu:
    return Gpu(gpu_id, host, index, "Sim", 8 * GiB)


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    registry = Registry.from_url(redis_url, fleet)
    for h in range(2):
        gpus = [_gpu(f"h{h}:{i}", f"h{h}", i) for i in range(2)]
        registry.register_worker(f"w{h}", f"h{h}", f"q{h}", gpus, warm_budget=8 * GiB)
    yield registry
    registry.client.close()


def _ledger(snap: Snapshot) -> tuple[object, ...]:
    """What the policy reads of a snapshot, comparable across two reads."""
    deps = sorted(
        (d.replica, d.level, sorted(d.gpus.items()), d.worker, d.host, d.epoch, d.leases)
        for d in snap.deployments.values()
    )
    gpus = sorted((g.id, g.reserved, g.held, g.worker) for g in snap.gpus.values())
    hosts = sorted((h.name, h.warm_used, sorted(h.warm)) for h in snap.hosts.values())
    shapes = sorted((s.layout, sorted(s.hosts)) for s in room_of(snap).shapes.values())
    return deps, gpus, hosts, shapes, dict(snap.learned)


def test_the_view_follows_placements_evictions_and_settles_without_reading_it_all(
    reg: Registry,
) -> None:
    rng = random.Random(3)
    hot = [make_hot(reg, reg.place(Demand(f"m{i}", size=GiB), rng=rng)) for i in range(5)]
    evict_now(reg, hot[0])  # to WARM, settled by its worker
    reg.evict(hot[1], to=Level.COLD)
    settle_leaving(reg)
    reg.record_measurement("m2", 2 * GiB)
    restored = reg.place(Demand("m0", size=GiB), rng=rng)  # back from the warm cache
    assert restored.replica == hot[0]
    with reg.follower.current() as view:
        assert _ledger(view) == _ledger(reg.snapshot())
    assert reg.follower.full_reads == 1  # one full read, then only what changed


def test_a_worker_joining_makes_the_next_view_a_full_read_that_sees_its_gpus(
    reg: Registry,
) -> None:
    reg.place(Demand("a", size=GiB))
    reg.register_worker("w9", "h9", "q9", [_gpu("h9:0", "h9", 0)])
    with reg.follower.current() as view:
        assert "h9:0" in view.gpus and "h9" in room_of(view).shape_of
    assert reg.follower.full_reads == 2


def test_a_plan_refused_on_a_stale_view_is_planned_again_on_a_full_read(
    reg: Registry, redis_url: str, fleet: str
) -> None:
    for i in range(4):  # every GPU whole to one idle model
        make_hot(reg, reg.place(Demand(f"m{i}", gpus=1.0), rng=random.Random(i)))
    with reg.follower.current():
        pass  # the view has seen them, all idle
    other = Registry.from_url(redis_url, fleet)  # another router's calls: no events
    try:
        assert all(other.pick(f"m{i}") for i in range(4))
        # The view still sees four idle replicas, so it plans an eviction that commit.lua
        # refuses; the full read that follows sees them busy.
        with pytest.raises(CantAccommodateError, match="0 B after evicting idle replicas"):
            reg.place(Demand("late", gpus=1.0))
    finally:
        other.client.close()
    assert reg.follower.full_reads == 2


def test_a_refusal_on_a_view_that_counts_ended_leases_is_planned_again_and_placed(
    reg: Registry, redis_url: str, fleet: str
) -> None:
    for i in range(4):
        make_hot(reg, reg.place(Demand(f"m{i}", gpus=1.0), rng=random.Random(i)))
    other = Registry.from_url(redis_url, fleet)
    try:
        leases = [other.pick(f"m{i}") for i in range(4)]
        reg.follower.invalidate()
        with reg.follower.current() as view:  # read in full while every replica is busy
            assert all(d.leases == 1 for d in view.deployments.values())
        for lease in leases:
            assert lease is not None
            other.finish(lease)  # ends without an event: the view still counts it
    finally:
        other.client.close()
    time.sleep(FRESH_S)  # the view is no longer fresh enough for a refusal to stand
    plan = reg.place(Demand("late", gpus=1.0))
    assert len(plan.evictions) == 1
    assert reg.follower.full_reads == 3  # the first, the busy one, the one that placed
