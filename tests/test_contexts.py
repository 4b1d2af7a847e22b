"""CUDA contexts a worker opens on GPUs it does not own, in the ledger of a real redis-server.

One GPU worker per GPU is the default deployment, so a replica split over two GPUs, or a
warm copy restored onto another worker's GPU, makes its loader open a CUDA context on a
GPU whose `total` only kept room for its owner's. Every test here checks the audit too.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from placement.ledger.audit import audit
from placement.ledger.registry import Registry
from placement.ledger.report import status_report
from placement.policy.state import Candidate, Demand, Gpu, Level
from tests.acting import evict_now, make_hot, replay_against_mirror, settle_leaving
from tests.fleets import GiB

CONTEXT = GiB


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    """Host h0: two 8 GiB GPUs, each owned by its own worker (w0, w1), each charging 1 GiB
    for another worker's CUDA context, and an 8 GiB warm cache."""
    registry = Registry.from_url(redis_url, fleet)
    for i in range(2):
        gpu = Gpu(id=f"h0:{i}", host="h0", index=i, name="Sim", total=8 * GiB, context=CONTEXT)
        registry.register_worker(
            f"w{i}", "h0", f"q{i}", [gpu], warm_budget=8 * GiB, domain="h0-processes"
        )
    yield registry
    registry.client.close()


def place(reg: Registry, demand: Demand, *, avoid: str = "") -> str:
    """Place `demand` (on neither GPU of worker `avoid`) and load it as its worker would."""
    avoid_workers = frozenset({avoid}) if avoid else frozenset()
    return make_hot(reg, reg.place(demand, rng=random.Random(0), avoid_workers=avoid_workers))


def test_a_shard_on_another_workers_gpu_charges_its_loaders_context_until_the_loader_is_reaped(
    reg: Registry,
) -> None:
    plan = reg.place(Demand("big", size=10 * GiB), rng=random.Random(0))
    loader = plan.worker
    own, far = ("h0:0", "h0:1") if loader == "w0" else ("h0:1", "h0:0")
    assert set(plan.gpus) == {own, far}
    snap = reg.snapshot()
    mine, other = snap.gpus[own], snap.gpus[far]
    assert (mine.reserved, mine.contexts) == (plan.gpus[own], {})
    assert (other.reserved, other.held) == (plan.gpus[far] + CONTEXT,) * 2
    assert (other.contexts, other.held_contexts) == ({loader: CONTEXT}, frozenset({loader}))
    assert audit(snap) == []
    shown = {g["id"]: g["contexts"] for g in status_report(snap)["gpus"]}
    assert shown == {own: {}, far: {loader: CONTEXT}}  # `gpufleet status --json`

    # The context outlives the replica: its process keeps it until it exits.
    make_hot(reg, plan)
    assert evict_now(reg, plan.replica, Level.COLD) is Level.COLD
    other = reg.snapshot().gpus[far]
    assert (other.reserved, other.held) == (CONTEXT, CONTEXT)
    with reg.follower.current() as view:  # the router's view missed the replica's whole life
        assert view.gpus[far] == other
    # The next split is loaded by the worker whose context is there already: no new one.
    again = reg.place(Demand("big", size=10 * GiB), rng=random.Random(1))
    assert again.worker == loader
    snap = reg.snapshot()
    assert (snap.gpus[far].reserved, snap.gpus[own].contexts) == (again.gpus[far] + CONTEXT, {})
    assert audit(snap) == []

    assert reg.reap(loader, force=True) == 1
    other = reg.snapshot().gpus[far]
    assert (other.reserved, other.held, other.contexts) == (0, 0, {})
    assert audit(reg.snapshot()) == []


def test_whole_gpu_shards_leave_room_on_each_foreign_gpu_for_the_loaders_context(
    reg: Registry,
) -> None:
    plan = reg.place(Demand("pair", gpus=2), rng=random.Random(0))
    assert plan.worker == "w0"  # whole GPUs: the first GPU's worker loads
    assert plan.gpus == {"h0:0": 8 * GiB, "h0:1": 8 * GiB - CONTEXT}
    snap = reg.snapshot()
    assert [snap.gpus[g].reserved for g in ("h0:0", "h0:1")] == [8 * GiB, 8 * GiB]
    assert audit(snap) == []


def test_a_foreign_shard_waiting_for_its_victim_holds_its_context_only_once_admitted(
    reg: Registry,
) -> None:
    place(reg, Demand("small", size=GiB), avoid="w0")  # 3 GiB on h0:1
    plan = reg.place(Demand("big", size=10 * GiB), rng=random.Random(0))
    # w0 loads: h0:1 has room for the 5.5 GiB shard only once "small" leaves, and no room
    # then for w1's context on h0:0 besides
    assert plan.worker == "w0" and plan.evictions
    other = reg.snapshot().gpus["h0:1"]
    assert reg.deployment(plan.replica).level is Level.WAITING  # type: ignore[union-attr]
    assert other.contexts == {"w0": CONTEXT} and other.held_contexts == frozenset()
    assert other.held == 3 * GiB  # the victim, still leaving
    assert audit(reg.snapshot()) == []

    settle_leaving(reg)  # the victim leaves; the shard is admitted with its context
    other = reg.snapshot().gpus["h0:1"]
    assert other.held_contexts == frozenset({"w0"})
    assert other.held == plan.gpus["h0:1"] + CONTEXT
    assert audit(reg.snapshot()) == []


def test_a_foreign_shard_dropped_before_its_load_gives_back_the_context_it_never_opened(
    reg: Registry,
) -> None:
    place(reg, Demand("small", size=GiB), avoid="w0")  # 3 GiB on h0:1
    plan = reg.place(Demand("big", size=10 * GiB), rng=random.Random(0))
    assert plan.worker == "w0" and reg.deployment(plan.replica).level is Level.WAITING  # type: ignore[union-attr]
    assert reg.snapshot().gpus["h0:1"].waiting_contexts == {"w0": 1}

    assert evict_now(reg, plan.replica, Level.COLD) is Level.COLD  # w0 never loaded it
    other = reg.snapshot().gpus["h0:1"]
    assert (other.reserved, other.contexts, other.waiting_contexts) == (0, {}, {})
    assert audit(reg.snapshot()) == []
    assert reg.reap("w0", force=True) == 0  # nothing of w0's is left to give back
    assert reg.snapshot().gpus["h0:1"].reserved == 0


def warm_on_w0(reg: Registry, copy_at: str = "") -> str:
    """A warm copy of "m" (3 GiB placed) held by w0, published to w1 at `copy_at` ('' not),
    whose GPU is then filled."""
    replica = place(reg, Demand("m", size=GiB), avoid="w1")
    assert reg.evict(replica) is Level.OFFLOADING
    settle_leaving(reg, copy_at)
    assert reg.snapshot().deployments[replica].level is Level.WARM
    place(reg, Demand("filler", request=7 * GiB, dedicated=True), avoid="w1")
    return replica


def test_a_warm_copy_restored_onto_another_workers_gpu_charges_its_holders_context(
    reg: Registry,
) -> None:
    replica = warm_on_w0(reg)
    plan = reg.place(Demand("m", size=GiB), rng=random.Random(0))
    assert (plan.replica, plan.reuse, plan.worker) == (replica, Level.WARM, "w0")
    assert plan.candidate is Candidate.CACHED_AND_FREE and set(plan.gpus) == {"h0:1"}
    assert reg.snapshot().gpus["h0:1"].contexts == {"w0": CONTEXT}
    assert audit(reg.snapshot()) == []


def test_a_published_warm_copy_is_read_by_the_gpus_owner_and_no_context_is_opened(
    reg: Registry,
) -> None:
    replica = warm_on_w0(reg, copy_at="4242:5:0:8192:4096:7")
    plan = reg.place(Demand("m", size=GiB), rng=random.Random(0))
    assert (plan.worker, plan.reuse, set(plan.gpus)) == ("w1", None, {"h0:1"})
    snap = reg.snapshot()
    assert snap.gpus["h0:1"].contexts == {}
    assert snap.deployments[plan.replica].read_from == "4242:5:0:8192:4096:7"  # for w1's load
    held_for_call = reg.hold(plan.replica, plan.epoch, "w1")
    assert held_for_call is not None and held_for_call[1] == "warm"  # a call's `cache` label
    held = snap.deployments[replica]
    assert (held.level, held.copy_at) == (Level.WARM, "4242:5:0:8192:4096:7")  # stays w0's
    assert audit(snap) == []


def test_a_warm_copy_is_loaded_afresh_by_the_gpus_owner_when_its_context_would_not_fit(
    reg: Registry,
) -> None:
    replica = warm_on_w0(reg)
    place(reg, Demand("other", request=4 * GiB + GiB // 2, dedicated=True), avoid="w0")
    # h0:1 has 3.5 GiB left: room for the 3 GiB slot, not for it and w0's context too.
    plan = reg.place(Demand("m", size=GiB), rng=random.Random(0))
    assert plan.worker == "w1" and plan.reuse is not Level.WARM and plan.replica != replica
    assert plan.candidate is Candidate.FREE
    snap = reg.snapshot()
    assert snap.gpus["h0:1"].contexts == {}
    assert snap.deployments[replica].level is Level.WARM  # left for a later restore
    assert audit(snap) == []


def test_the_python_ledger_and_the_lua_scripts_agree_on_contexts(reg: Registry) -> None:
    def demand(rng: random.Random) -> Demand:
        return Demand(f"m{rng.randrange(6)}", size=rng.randrange(1, 24) * GiB // 2)

    seen = replay_against_mirror(
        reg, random.Random(5), 60, demand, settle_evicted=True, drop_waiting=0.5
    )
    # the sequence did put a shard on another worker's GPU, and dropped one still waiting
    assert any(g.contexts for snap in seen for g in snap.gpus.values())
    assert any(g.waiting_contexts for snap in seen for g in snap.gpus.values())


@pytest.mark.parametrize("first", ["w0", "w1"])
def test_a_context_declared_on_a_gpu_whose_record_was_reaped_is_charged_when_its_owner_returns(
    reg: Registry, first: str
) -> None:
    # w1 keeps a context on w0's GPU; a long outage reaps both (in either order), which
    # removes h0:0's record. w1 comes back first, declaring the context; then w0.
    gpus = {
        f"w{i}": Gpu(id=f"h0:{i}", host="h0", index=i, name="Sim", total=8 * GiB, context=CONTEXT)
        for i in range(2)
    }
    reg.register_worker("w1", "h0", "q1", [gpus["w1"]], warm_budget=8 * GiB, contexts=["h0:0"])
    assert reg.snapshot().gpus["h0:0"].contexts == {"w1": CONTEXT}
    for worker in (first, "w1" if first == "w0" else "w0"):
        reg.reap(worker, force=True)
    assert "h0:0" not in reg.snapshot().gpus
    reg.register_worker("w1", "h0", "q1", [gpus["w1"]], warm_budget=8 * GiB, contexts=["h0:0"])
    reg.register_worker("w0", "h0", "q0", [gpus["w0"]], warm_budget=8 * GiB)
    snap = reg.snapshot()
    back = snap.gpus["h0:0"]
    assert (back.reserved, back.held, back.contexts) == (CONTEXT, CONTEXT, {"w1": CONTEXT})
    assert audit(snap) == []
    # and it is given back when w1 is reaped, as any context is
    reg.reap("w1", force=True)
    back = reg.snapshot().gpus["h0:0"]
    assert (back.reserved, back.held, back.contexts) == (0, 0, {})


def test_a_context_declared_on_a_gpu_that_never_returns_leaves_nothing_when_its_worker_goes(
    reg: Registry,
) -> None:
    gpu = Gpu(id="h0:1", host="h0", index=1, name="Sim", total=8 * GiB, context=CONTEXT)
    reg.reap("w1", force=True)
    reg.register_worker("w1", "h0", "q1", [gpu], warm_budget=8 * GiB, contexts=["h0:9"])
    reg.reap("w1", force=True)
    assert reg.client.exists(reg.keys.gpu("h0:9")) == 0
