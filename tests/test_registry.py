"""The Redis registry and its Lua scripts, against a real redis-server."""

from __future__ import annotations

import multiprocessing
import multiprocessing.queues
import random
import threading
import time
from collections.abc import Iterator
from dataclasses import replace
from importlib import resources

import pytest
import redis

from placement.errors import (
    GpuOwnedError,
    LeaseLostError,
    PlanRejectedError,
    RegistryError,
    SettlingError,
)
from placement.ledger.audit import audit
from placement.ledger.keys import Keys
from placement.ledger.registry import Registry
from placement.ledger.report import status_report
from placement.ledger.scripts import NAMES, scripts_for
from placement.policy.place import plan_replica
from placement.policy.state import Candidate, Demand, Gpu, Holding, Level
from placement.server.redis_server import RedisServer
from tests.acting import make_hot, replay_against_mirror, settle_leaving
from tests.fleets import GiB

LEASE_MS = 60_000


def sim_gpu(gpu_id: str, total: int, index: int = 0) -> Gpu:
    return Gpu(id=gpu_id, host="", index=index, name="Sim", total=total)


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    registry = Registry.from_url(redis_url, fleet)
    yield registry
    registry.client.close()


@pytest.fixture
def two_gpus(reg: Registry) -> Registry:
    """Two 8 GiB GPUs on host h0, each owned by its own worker, with a 4 GiB warm cache."""
    for i in range(2):
        reg.register_worker(
            f"w{i}", "h0", f"q{i}", [sim_gpu(f"h0:{i}", 8 * GiB, i)], warm_budget=4 * GiB
        )
    return reg


def place_hot(reg: Registry, demand: Demand, seed: int = 0) -> str:
    return make_hot(reg, reg.place(demand, rng=random.Random(seed)))


# --- workers and leases ------------------------------------------------------------


def test_a_registered_worker_owns_its_gpus_with_a_live_lease(reg: Registry) -> None:
    deadline = reg.register_worker("w0", "h0", "q0", [sim_gpu("h0:0", 8 * GiB)], lease_ms=5000)
    snap = reg.snapshot()
    g = snap.gpus["h0:0"]
    assert (g.worker, g.queue, g.host, g.total, g.reserved) == ("w0", "q0", "h0", 8 * GiB, 0)
    assert g.lease_deadline_ms == deadline
    assert 4000 < deadline - snap.now_ms <= 5000


def test_a_gpu_owned_by_a_live_worker_cannot_be_taken(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("h0:0", 8 * GiB)])
    with pytest.raises(GpuOwnedError, match="owned by live worker w0"):
        reg.register_worker("w1", "h0", "q1", [sim_gpu("h0:0", 8 * GiB)])


def test_a_gpu_of_a_dead_worker_is_reaped_and_taken_over(reg: Registry) -> None:
    reg.register_worker("old", "h0", "q0", [sim_gpu("h0:0", 8 * GiB)], lease_ms=50)
    time.sleep(0.1)
    reg.register_worker("new", "h0", "q1", [sim_gpu("h0:0", 8 * GiB)])
    assert reg.snapshot().gpus["h0:0"].worker == "new"
    assert "old" not in reg.client.smembers(reg.keys.workers)


def test_a_heartbeat_extends_the_lease_and_a_missed_one_loses_it(reg: Registry) -> None:
    # 600 ms: room for a stalled thread before the first heartbeat
    first = reg.register_worker("w0", "h0", "q0", [sim_gpu("h0:0", 8 * GiB)], lease_ms=600)
    time.sleep(0.05)
    assert reg.heartbeat("w0", ["h0:0"], lease_ms=600) > first
    time.sleep(0.7)
    with pytest.raises(LeaseLostError, match="register again"):
        reg.heartbeat("w0", ["h0:0"], lease_ms=600)


def test_a_replica_left_on_a_worker_with_no_record_is_named_by_the_audit(
    two_gpus: Registry,
) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    owner = reg.snapshot().deployments[replica].worker
    assert audit(reg.snapshot()) == []
    reg.client.delete(reg.keys.worker(owner))  # its record went without the reap's step
    reg.client.srem(reg.keys.workers, owner)  # (the other worker's stays)
    problems = audit(reg.snapshot())
    assert any(
        p.startswith(f"replica {replica} (m) is HOT on worker {owner}, which has no record")
        for p in problems
    ), problems


def test_reaping_an_expired_worker_releases_every_byte_and_lease(two_gpus: Registry) -> None:
    reg = two_gpus
    a = place_hot(reg, Demand("a", size=GiB))
    place_hot(reg, Demand("b", size=GiB))
    lease = reg.pick("a")
    assert lease is not None
    owner = reg.snapshot().deployments[a].worker
    gpu_id = next(g for g, d in reg.snapshot().gpus.items() if d.worker == owner)
    assert reg.reap(owner) is None  # alive: nothing happens
    reg.client.hset(reg.keys.worker(owner), "lease_deadline", 0)  # the worker went silent
    assert owner in reg.reap_expired()
    snap = reg.snapshot()
    assert snap.deployments[a].level is Level.COLD
    assert gpu_id not in snap.gpus  # no owner and no bytes left: the record is gone
    assert reg.keys.leases(a) not in reg.lease_keys()
    assert audit(snap) == []
    assert [e["kind"] for e in reg.events() if e["kind"] == "reaped"] == ["reaped"]


# --- placement ----------------------------------------------------------------------


def test_a_placed_replica_loads_then_serves_after_confirmation(two_gpus: Registry) -> None:
    reg = two_gpus
    plan = reg.place(Demand("m", size=GiB), rng=random.Random(1))
    snap = reg.snapshot()
    assert snap.deployments[plan.replica].level is Level.LOADING
    assert reg.pick("m") is None  # not ready yet
    assert reg.confirm(plan.replica, plan.worker, plan.epoch)
    lease = reg.pick("m")
    assert lease is not None and lease.replica == plan.replica
    assert lease.queue == snap.gpus[next(iter(plan.gpus))].queue
    assert reg.snapshot().deployments[plan.replica].leases == 1
    assert reg.finish(lease) is Level.HOT
    assert reg.snapshot().deployments[plan.replica].leases == 0


def test_a_half_written_record_is_named_by_the_audit_and_read_as_no_record(
    two_gpus: Registry,
) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    assert audit(reg.snapshot()) == []
    reg.client.hdel(reg.keys.deployment(replica), "model", "level")  # writes Redis lost
    snap = reg.snapshot()
    assert replica not in snap.deployments
    assert snap.partial == {replica: ("model", "level")}
    problems = audit(snap)
    assert f"replica {replica}'s record lacks model, level (half written" in problems[0]


def test_two_plans_from_one_snapshot_cannot_double_book_a_gpu(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    snap = reg.snapshot()
    first = plan_replica(Demand("a", size=2 * GiB), snap)  # 6 GiB slot
    second = plan_replica(Demand("b", size=2 * GiB), snap)
    reg.commit(first, snap)
    with pytest.raises(PlanRejectedError, match="FULL"):
        reg.commit(second, snap)
    assert reg.snapshot().gpus["g"].reserved == 6 * GiB


def test_a_stale_plan_is_retried_on_a_fresh_snapshot(two_gpus: Registry) -> None:
    reg = two_gpus
    snap = reg.snapshot()
    plan = plan_replica(Demand("a", size=2 * GiB), snap, rng=random.Random(0))
    reg.commit(plan, snap)
    # `place` plans against a fresh snapshot, so b goes to the other GPU.
    other = reg.place(Demand("b", size=2 * GiB), rng=random.Random(0))
    assert set(other.gpus) != set(plan.gpus)


def test_a_commit_sent_again_after_its_reply_was_lost_answers_as_before_and_changes_nothing(
    two_gpus: Registry,
) -> None:
    reg = two_gpus
    snap = reg.snapshot()
    plan = plan_replica(Demand("a", size=2 * GiB), snap, rng=random.Random(0))
    first = reg.commit(plan, snap, lease_id="call-1")
    before = reg.snapshot()
    # the store sends a script again when its reply is lost: the same plan, the same lease
    again = reg.commit(plan, snap, lease_id="call-1")
    after = reg.snapshot()
    assert again.epoch == first.epoch
    assert after.gpus == before.gpus and after.active == before.active
    assert reg.client.zrange(reg.keys.leases(plan.replica), 0, -1) == ["call-1"]
    # without the lease that pins it, the same plan is another router's stale one
    with pytest.raises(PlanRejectedError):
        reg.commit(plan, snap)


def test_concurrent_plans_for_one_replica_place_it_only_once(two_gpus: Registry) -> None:
    reg = two_gpus
    snap = reg.snapshot()
    plans = [plan_replica(Demand("m", size=GiB), snap, rng=random.Random(s)) for s in (1, 2)]
    reg.commit(plans[0], snap)
    with pytest.raises(PlanRejectedError, match="ENOUGH"):
        reg.commit(plans[1], snap)


def test_a_victim_that_became_busy_after_the_snapshot_is_not_evicted(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    victim = place_hot(reg, Demand("v", size=2 * GiB))  # 6 GiB of 8
    snap = reg.snapshot()
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert [e.replica for e in plan.evictions] == [victim]
    assert reg.pick("v") is not None  # a request pins the victim
    with pytest.raises(PlanRejectedError, match="BUSY"):
        reg.commit(plan, snap)
    assert reg.snapshot().deployments[victim].level is Level.HOT


def test_a_worker_hears_of_a_placements_victims_before_the_placement(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    victim = place_hot(reg, Demand("v", size=2 * GiB))  # 6 GiB of 8
    reg.client.delete(reg.keys.control("w0"))  # what its own placement told the worker
    plan = reg.place(Demand("m", size=GiB))
    assert [e.replica for e in plan.evictions] == [victim]
    told = [reg.next_control("w0", timeout_s=1), reg.next_control("w0", timeout_s=1)]
    assert told == [victim, plan.replica]  # so the keeper frees the device first


def test_a_dedicated_replica_is_never_evicted_even_by_a_forged_plan(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    pinned = place_hot(reg, Demand("d", size=2 * GiB, dedicated=True))
    snap = reg.snapshot()
    unpinned = {pinned: replace(snap.deployments[pinned], dedicated=False)}
    forged_view = replace(snap, deployments=unpinned)
    plan = plan_replica(Demand("m", size=GiB), forged_view)
    assert plan.evictions  # the policy was fooled; the script is not
    with pytest.raises(PlanRejectedError, match="PINNED"):
        reg.commit(plan, forged_view)


def test_a_plan_for_a_gpu_whose_lease_expired_is_rejected(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    snap = reg.snapshot()
    plan = plan_replica(Demand("m", size=GiB), snap)
    reg.client.hset(reg.keys.worker("w0"), "lease_deadline", 0)  # its lease lapses
    with pytest.raises(PlanRejectedError, match="DEAD"):
        reg.commit(plan, snap)


def test_an_evicted_replica_goes_warm_and_is_restored_under_the_same_id(two_gpus: Registry) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    assert reg.evict(replica) is Level.OFFLOADING  # until its worker moved it
    settle_leaving(reg)
    snap = reg.snapshot()
    assert snap.hosts["h0"].warm_used == GiB
    assert all(g.reserved == 0 for g in snap.gpus.values())
    plan = reg.place(Demand("m", size=GiB))
    assert (plan.replica, plan.reuse, plan.candidate) == (
        replica,
        Level.WARM,
        Candidate.CACHED_AND_FREE,
    )
    snap = reg.snapshot()
    assert snap.hosts["h0"].warm_used == 0
    assert [e["kind"] for e in reg.events() if e["replica"] == replica][-1] == "restored"
    assert audit(snap) == []


def test_an_evict_of_a_busy_replica_drains_it_until_its_last_request_ends(
    two_gpus: Registry,
) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    lease = reg.pick("m")
    assert lease is not None
    assert reg.evict(replica) is Level.DRAINING
    assert reg.pick("m") is None  # a draining replica takes no new requests
    assert reg.finish(lease) is Level.OFFLOADING  # the last request out turns off the light
    settle_leaving(reg)
    assert reg.snapshot().deployments[replica].level is Level.WARM


def test_a_batch_ends_its_calls_leases_together_and_a_drained_replica_then_leaves(
    two_gpus: Registry,
) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    leases = [reg.pick("m") for _ in range(3)]
    assert all(lease is not None for lease in leases)
    assert reg.evict(replica) is Level.DRAINING
    reg.client.script_flush()  # as after a Redis restart: the round trip loads it again
    reg.finish_all([lease for lease in leases if lease is not None])
    assert reg.snapshot().deployments[replica].leases == 0
    assert reg.snapshot().deployments[replica].level is Level.OFFLOADING
    settle_leaving(reg)
    assert reg.snapshot().deployments[replica].level is Level.WARM


def test_an_expired_request_lease_no_longer_pins_its_replica(two_gpus: Registry) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    assert reg.pick("m", ttl_ms=50) is not None
    time.sleep(0.1)
    assert reg.snapshot().deployments[replica].leases == 0
    assert reg.evict(replica) is Level.OFFLOADING


def test_pressure_eviction_records_why_in_the_event_stream(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)], warm_budget=8 * GiB)
    victim = place_hot(reg, Demand("v", size=2 * GiB))
    newcomer = reg.place(Demand("m", size=GiB))
    evicted = [e for e in reg.events() if e["kind"] == "evicted"]
    assert [(e["replica"], e["cause"], e["to"], e["for"]) for e in evicted] == [
        (victim, "pressure", "WARM", newcomer.replica)
    ]


# --- the state machine: moves wait for the worker that does them ---------------------


def test_a_victims_bytes_stay_held_until_its_worker_settles_and_the_newcomer_waits(
    reg: Registry,
) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)], warm_budget=8 * GiB)
    victim = place_hot(reg, Demand("v", size=2 * GiB))  # a 6 GiB slot of 8
    plan = reg.place(Demand("m", size=GiB))  # needs 3 GiB: v must leave
    snap = reg.snapshot()
    assert snap.deployments[victim].level is Level.OFFLOADING
    assert snap.deployments[plan.replica].level is Level.WAITING
    g = snap.gpus["g"]
    assert (g.reserved, g.held) == (3 * GiB, 6 * GiB)  # planned vs still on the device
    waiting = snap.deployments[plan.replica]
    assert reg.admit(waiting) is None  # v's copy still occupies the device
    assert reg.confirm(plan.replica, "w0", plan.epoch) is False  # not admitted, not loaded
    assert reg.settle(snap.deployments[victim], "offloaded") is Level.WARM
    assert reg.snapshot().gpus["g"].held == 0
    assert reg.admit(waiting) is Level.LOADING
    assert reg.confirm(plan.replica, "w0", plan.epoch)
    snap = reg.snapshot()
    assert (snap.gpus["g"].reserved, snap.gpus["g"].held) == (3 * GiB, 3 * GiB)
    assert snap.hosts["h0"].warm == {victim}
    assert audit(snap) == []


def test_a_placement_with_room_on_the_device_is_loading_at_once(two_gpus: Registry) -> None:
    plan = two_gpus.place(Demand("m", size=GiB))
    record = two_gpus.snapshot().deployments[plan.replica]
    assert (record.level, record.epoch) == (Level.LOADING, plan.epoch)


def test_a_worker_cannot_confirm_or_settle_a_placement_it_did_not_get(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)], warm_budget=8 * GiB)
    first = reg.place(Demand("m", size=GiB))
    assert not reg.confirm(first.replica, "someone-else", first.epoch)
    assert not reg.confirm(first.replica, "w0", first.epoch + 1)  # a later placement's
    record = reg.snapshot().deployments[first.replica]
    assert reg.settle(record, "offloaded") is None  # LOADING is not leaving
    stale = replace(record, epoch=record.epoch - 1)
    assert reg.settle(stale, "failed") is None
    assert reg.snapshot().deployments[first.replica].level is Level.LOADING


def test_a_failed_load_gives_every_byte_back_and_ends_its_calls_leases(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    plan = reg.place(Demand("m", size=GiB), lease_id="call-1")
    record = reg.snapshot().deployments[plan.replica]
    assert record.leases == 1  # the call that caused the placement pins it
    assert reg.settle(record, "failed") is Level.COLD
    snap = reg.snapshot()
    assert (snap.gpus["g"].reserved, snap.gpus["g"].held) == (0, 0)
    assert snap.deployments[plan.replica].leases == 0
    assert audit(snap) == []


def test_a_copy_its_worker_does_not_hold_is_released_as_lost(two_gpus: Registry) -> None:
    replica = place_hot(two_gpus, Demand("m", size=GiB))
    assert two_gpus.pick("m") is not None
    record = two_gpus.snapshot().deployments[replica]
    assert two_gpus.settle(record, "lost") is Level.COLD
    snap = two_gpus.snapshot()
    assert all((g.reserved, g.held) == (0, 0) for g in snap.gpus.values())
    assert snap.deployments[replica].leases == 0  # its calls are routed again
    assert audit(snap) == []


def test_an_explicit_evict_of_a_waiting_or_loading_replica(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)], warm_budget=8 * GiB)
    place_hot(reg, Demand("v", size=GiB))  # 3 GiB
    loading = reg.place(Demand("a", size=GiB))  # 3 GiB more
    assert reg.evict(loading.replica) is Level.DROPPING  # its worker may be loading it now
    assert (reg.snapshot().gpus["g"].reserved, reg.snapshot().gpus["g"].held) == (
        3 * GiB,
        6 * GiB,
    )
    waiting = reg.place(Demand("b", size=GiB, factor=5.0))  # 5 GiB: planned, not on device
    assert reg.snapshot().deployments[waiting.replica].level is Level.WAITING
    assert reg.evict(waiting.replica) is Level.COLD  # nothing of it is on the device
    settle_leaving(reg)
    snap = reg.snapshot()
    assert (snap.gpus["g"].reserved, snap.gpus["g"].held) == (3 * GiB, 3 * GiB)
    assert audit(snap) == []


def test_a_replica_record_keeps_the_gpu_types_its_model_may_use(
    reg: Registry, redis_url: str, fleet: str
) -> None:
    # the policy weighs the room each type must keep for requests pinned to it by these
    for i, name in enumerate(("Tesla T4", "NVIDIA A10")):
        gpu = Gpu(id=f"g{i}", host="h0", index=i, name=name, total=8 * GiB)
        reg.register_worker(f"w{i}", "h0", f"q{i}", [gpu])
    either = reg.place(Demand("either", size=GiB, accelerator=("T4", "A10")))
    one = reg.place(Demand("one", size=GiB, accelerator="A10"))
    anywhere = reg.place(Demand("anywhere", size=GiB))
    reader = Registry.from_url(redis_url, fleet)  # reads the records, not a plan's mirror
    deployments = reader.snapshot().deployments
    reader.client.close()
    assert deployments[either.replica].accelerator == ("T4", "A10")
    assert deployments[one.replica].accelerator == "A10"
    assert deployments[anywhere.replica].accelerator is None


def test_every_worker_a_change_concerns_is_told_on_its_control_list(reg: Registry) -> None:
    for i in range(2):
        reg.register_worker(f"w{i}", "h0", f"q{i}", [sim_gpu(f"g{i}", 8 * GiB, i)])
    victim = place_hot(reg, Demand("v", size=2 * GiB, accelerator=None))
    holder = reg.snapshot().deployments[victim].worker
    for w in ("w0", "w1"):
        reg.client.delete(reg.keys.control(w))
    plan = reg.place(Demand("m", size=2 * GiB), rng=random.Random(0))
    told = {w: reg.client.lrange(reg.keys.control(w), 0, -1) for w in ("w0", "w1")}
    assert plan.replica in told[plan.worker]
    if plan.evictions:
        assert victim in told[holder]
    assert reg.next_control(plan.worker, timeout_s=0.1) in (plan.replica, victim)


def test_a_call_can_pin_a_placed_replica_only_in_the_epoch_it_saw(two_gpus: Registry) -> None:
    plan = two_gpus.place(Demand("m", size=GiB))
    held = two_gpus.hold(plan.replica, plan.epoch, plan.worker)
    assert held is not None and held[1] == "cold"
    assert two_gpus.snapshot().deployments[plan.replica].leases == 1
    assert two_gpus.hold(plan.replica, plan.epoch + 1, plan.worker) is None
    assert two_gpus.hold(plan.replica, plan.epoch, "another-worker") is None


def test_no_request_lease_outlives_the_placement_it_pinned(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    first = reg.place(Demand("m", size=GiB), lease_id="call-1")
    assert reg.evict(first.replica, to=Level.COLD) is Level.DROPPING
    settle_leaving(reg)
    assert reg.snapshot().deployments[first.replica].leases == 0
    again = reg.place(Demand("m", size=GiB))
    assert again.replica == first.replica
    assert reg.snapshot().deployments[again.replica].leases == 0  # evictable by pressure


def test_a_call_cannot_pin_a_placement_on_a_dead_worker(reg: Registry) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    plan = reg.place(Demand("m", size=GiB))
    reg.client.hset(reg.keys.worker("w0"), "lease_deadline", 0)  # its lease lapses
    assert reg.hold(plan.replica, plan.epoch, plan.worker) is None


def test_a_model_whose_only_replica_drains_is_placed_again_once_it_has_left(
    two_gpus: Registry,
) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    lease = reg.pick("m")
    assert lease is not None and reg.evict(replica) is Level.DRAINING
    with pytest.raises(SettlingError, match="DRAINING"):
        reg.place(Demand("m", size=GiB), settle_wait_s=0.05)  # it takes no new calls
    assert reg.finish(lease) is Level.OFFLOADING
    settle_leaving(reg)
    plan = reg.place(Demand("m", size=GiB))
    assert (plan.replica, plan.reuse) == (replica, Level.WARM)


def test_place_waits_for_a_leaving_copy_and_restores_it(two_gpus: Registry) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    assert reg.evict(replica) is Level.OFFLOADING
    worker = threading.Timer(0.1, settle_leaving, args=(reg,))
    worker.start()
    plan = reg.place(Demand("m", size=GiB))  # waits for the worker, then restores
    worker.join()
    assert (plan.replica, plan.reuse) == (replica, Level.WARM)
    assert plan.epoch == 2


def test_place_gives_up_on_a_copy_that_never_settles(two_gpus: Registry) -> None:
    replica = place_hot(two_gpus, Demand("m", size=GiB))
    two_gpus.evict(replica)
    with pytest.raises(SettlingError, match="OFFLOADING"):
        two_gpus.place(Demand("m", size=GiB), settle_wait_s=0.05)


def test_a_heartbeat_carries_what_the_worker_holds_and_the_audit_compares_it(
    reg: Registry,
) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    replica = place_hot(reg, Demand("m", size=GiB))
    record = reg.snapshot().deployments[replica]
    held = Holding(replica, record.epoch, Level.HOT, dict(record.gpus))
    reg.heartbeat("w0", ["g"], holdings=[held])
    snap = reg.snapshot()
    assert snap.reports["w0"].holdings == (held,)
    assert audit(snap, grace_ms=0) == []
    reg.heartbeat("w0", ["g"], holdings=[])  # the worker lost the copy
    problems = audit(reg.snapshot(), grace_ms=0)
    assert len(problems) == 1 and "does not hold m replica" in problems[0]
    stray = Holding("not-in-the-ledger", 1, Level.WARM)
    reg.heartbeat("w0", ["g"], holdings=[held, stray])
    (problem,) = audit(reg.snapshot(), grace_ms=0)
    assert "holds replica not-in-the-ledger" in problem and "nobody" in problem


def test_status_sums_the_pinned_host_memory_each_live_worker_of_a_host_reports(
    reg: Registry,
) -> None:
    reg.register_worker("w0", "h0", "q0", [sim_gpu("h0:0", 8 * GiB)])
    reg.register_worker("w1", "h0", "q1", [sim_gpu("h0:1", 8 * GiB)])
    reg.register_worker("w2", "h1", "q2", [sim_gpu("h1:0", 8 * GiB)])
    for worker, gpu, pinned in (("w0", "h0:0", 3 * GiB), ("w1", "h0:1", GiB), ("w2", "h1:0", 0)):
        reg.heartbeat(worker, [gpu], holdings=[], pinned=pinned)
    report = status_report(reg.snapshot())
    assert {h["name"]: h["pinned_bytes"] for h in report["hosts"]} == {"h0": 4 * GiB, "h1": 0}
    assert {w["id"]: w["pinned_bytes"] for w in report["workers"]}["w0"] == 3 * GiB
    reg.heartbeat("w0", ["h0:0"], holdings=[])  # no figure: the last one stands
    reg.client.hset(reg.keys.worker("w1"), "lease_deadline", 0)  # w1's lease lapses: its
    # pinned memory is no longer counted
    report = status_report(reg.snapshot())
    assert {h["name"]: h["pinned_bytes"] for h in report["hosts"]}["h0"] == 3 * GiB


def test_a_live_predecessor_of_the_same_lineage_is_replaced_any_other_refused(
    reg: Registry,
) -> None:
    gpu = [sim_gpu("g", 8 * GiB)]
    reg.register_worker("old", "h0", "q0", gpu, lineage="pool-1")
    place_hot(reg, Demand("m", size=GiB))
    reg.register_worker("new", "h0", "q0", gpu, lineage="pool-1")  # the pool's next child
    snap = reg.snapshot()
    assert snap.gpus["g"].worker == "new"
    assert all(d.level is Level.COLD for d in snap.deployments.values())
    with pytest.raises(GpuOwnedError, match="database of its own"):
        reg.register_worker("intruder", "h0", "q0", gpu, lineage="another-fleet")
    assert reg.owner("g") == ("new", "pool-1")


def test_a_learned_measurement_sizes_the_next_placement(two_gpus: Registry) -> None:
    reg = two_gpus
    assert reg.record_measurement("m", GiB) == 0
    plan = reg.place(Demand("m", size=2 * GiB))  # the guess would be 6 GiB
    assert sum(plan.gpus.values()) < 2 * GiB
    assert reg.record_measurement("m", 2 * GiB) == GiB
    assert reg.record_measurement("m", GiB) == 2 * GiB  # a smaller figure changes nothing
    assert reg.snapshot().learned["m"] == 2 * GiB


def test_the_python_ledger_and_the_lua_scripts_agree(two_gpus: Registry) -> None:
    def demand(rng: random.Random) -> Demand:
        return Demand(f"m{rng.randrange(8)}", size=rng.randrange(1, 8) * GiB // 2)

    assert replay_against_mirror(two_gpus, random.Random(3), 30, demand)


# --- keys and scripts -------------------------------------------------------------


def test_every_key_of_a_fleet_shares_its_hash_tag(two_gpus: Registry, fleet: str) -> None:
    reg = two_gpus
    place_hot(reg, Demand("m", size=GiB))
    assert reg.pick("m") is not None
    keys = list(reg.client.scan_iter(match="gpufleet:*"))
    mine = [k for k in keys if f"{{{fleet}}}" in k]
    assert len(mine) >= 8
    assert all(k.startswith(f"gpufleet:{{{fleet}}}:") for k in mine)


def test_every_lua_script_opens_with_its_keys_and_argv_contract() -> None:
    lua = resources.files("placement.ledger") / "lua"
    for name in NAMES:
        head = (lua / f"{name}.lua").read_text().splitlines()[:12]
        assert head[0].startswith(f"-- {name}.lua: ")
        assert any(line.startswith("-- KEYS") for line in head), name
        assert any("ARGV" in line for line in head), name
        assert any(
            line.startswith("-- Returns") for line in (lua / f"{name}.lua").read_text().splitlines()
        ), name


def test_scripts_are_registered_once_per_client_and_survive_a_script_flush(
    two_gpus: Registry,
) -> None:
    reg = two_gpus
    assert scripts_for(reg.client) is scripts_for(reg.client)
    reg.client.script_flush()  # e.g. a Redis restart: EVALSHA gets NOSCRIPT, then reloads
    place_hot(reg, Demand("m", size=GiB))
    assert reg.pick("m") is not None


def test_threads_calling_scripts_at_once_each_get_their_own_replies(two_gpus: Registry) -> None:
    reg = two_gpus
    models = [f"m{i}" for i in range(4)]
    for i, model in enumerate(models):
        place_hot(reg, Demand(model, size=GiB // 4), seed=i)
    wrong: list[str] = []

    def picker(model: str) -> None:
        for _ in range(50):
            lease = reg.pick(model, path="fast")
            if lease is None or lease.model != model or reg.finish(lease) is not Level.HOT:
                wrong.append(model)

    threads = [threading.Thread(target=picker, args=(m,)) for m in models * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == []
    assert reg.stats()["m0"]["hit"] == 100


def _picks(reg: Registry, model: str, n: int) -> int:
    """How many of `n` pick/finish pairs got a lease of `model` and a HOT replica back."""
    right = 0
    for _ in range(n):
        lease = reg.pick(model)
        right += lease is not None and lease.model == model and reg.finish(lease) is Level.HOT
    return right


def _picks_in_child(reg: Registry, out: multiprocessing.queues.Queue[int]) -> None:
    out.put(_picks(reg, "child", 300))


def test_a_forked_child_calls_scripts_on_its_own_connection(two_gpus: Registry) -> None:
    reg = two_gpus
    place_hot(reg, Demand("child", size=GiB), seed=0)
    place_hot(reg, Demand("parent", size=GiB), seed=1)
    assert _picks(reg, "parent", 1) == 1  # the parent's connection is open before the fork
    ctx = multiprocessing.get_context("fork")
    out: multiprocessing.queues.Queue[int] = ctx.Queue()
    child = ctx.Process(target=_picks_in_child, args=(reg, out))
    child.start()
    parent_right = _picks(reg, "parent", 300)  # both sides talk to Redis at once
    child.join(60)
    assert child.exitcode == 0
    assert (out.get(timeout=5), parent_right) == (300, 300)


def test_an_evict_given_a_stale_record_reads_the_real_one_and_drops_it(
    two_gpus: Registry,
) -> None:
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    real = reg.deployment(replica)
    assert real is not None
    other = next(g for g in reg.snapshot().gpus if g not in real.gpus)
    stale = replace(real, gpus={other: 1}, worker="w-gone")
    assert reg.evict(replica, to=Level.COLD, seen=stale) is Level.DROPPING
    settle_leaving(reg)
    snap = reg.snapshot()
    assert snap.deployments[replica].level is Level.COLD
    assert all((g.reserved, g.held) == (0, 0) for g in snap.gpus.values())
    assert audit(snap) == []


def test_an_invalid_fleet_name_is_refused() -> None:
    with pytest.raises(Exception, match="fleet name"):
        Keys("bad}name")


def test_a_password_protected_redis_works_and_a_wrong_password_is_an_error() -> None:
    with RedisServer(password="s3cret/with:chars") as server:
        reg = Registry.from_url(server.url, "pw")
        reg.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
        assert reg.snapshot().gpus["g"].worker == "w0"
        bad = server.url.replace("s3cret", "wrong")
        client = redis.Redis.from_url(bad, decode_responses=True, retry=None)
        with pytest.raises(redis.AuthenticationError):
            client.ping()


def test_an_unreachable_registry_is_a_clear_error() -> None:
    reg = Registry.from_url("redis://127.0.0.1:1/0", "x")
    with pytest.raises(RegistryError, match="GPUFLEET_REDIS_URL"):
        reg.record_measurement("m", 1)


def test_a_registry_plans_with_its_own_policy_settings(redis_url: str, fleet: str) -> None:
    from placement.policy.settings import PolicySettings

    registry = Registry.from_url(redis_url, fleet, settings=PolicySettings(factor=1.5))
    registry.register_worker("w0", "h0", "q0", [sim_gpu("g", 8 * GiB)])
    assert registry.place(Demand("m", size=GiB)).gpus == {"g": 3 * GiB // 2}
    assert registry.gpu("g") is not None and registry.gpu("missing") is None


def test_half_a_record_reads_as_none_and_crashes_no_reader(two_gpus: Registry) -> None:
    # What a Redis that lost some writes leaves: a record of one field (records.whole).
    reg = two_gpus
    replica = place_hot(reg, Demand("m", size=GiB))
    reg.client.delete(reg.keys.deployment(replica))
    reg.client.hset(reg.keys.deployment(replica), "last_used", 1)
    assert reg.deployment(replica) is None
    assert replica not in reg.snapshot().deployments
    with reg.follower.current() as view:
        assert replica not in view.deployments
