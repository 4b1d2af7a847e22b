"""Replicas that follow load: the rule (placement/rules/scaling.py), the durations that configure
it, and its decisions carried out against a real registry (tasks/serving/scaling.py)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from placement.errors import ConfigError
from placement.ledger.audit import audit
from placement.ledger.load import hold_routing, mark_batch, read_changes, read_loads
from placement.ledger.registry import Registry
from placement.policy.state import RESERVING, Demand, Deployment, Gpu, Level
from placement.rules.scaling import Autoscale, ModelLoad, ReplicaLoad, ScaleIn, ScaleOut, Scaler
from placement.units.durations import format_duration_ms, parse_duration_ms
from tasks.serving.scaling import ScalingLoop, scale_in, scale_out
from tests.acting import evict_now, make_hot, settle_leaving
from tests.fleets import GiB

RULES = {"m": Autoscale(floor=1, ceiling=3, keep_alive_ms=10_000)}


def hot(replica: str, in_flight: int = 0, idle_ms: int = 0) -> ReplicaLoad:
    return ReplicaLoad(replica, Level.HOT, in_flight=in_flight, idle_ms=idle_ms)


def loading(replica: str) -> ReplicaLoad:
    return ReplicaLoad(replica, Level.LOADING, in_flight=0, idle_ms=0)


@pytest.mark.parametrize(
    ("text", "ms"),
    [("5m", 300_000), ("30s", 30_000), ("1h30m", 5_400_000), ("250ms", 250), ("90", 90_000),
     (2.5, 2_500), ("1.5s", 1_500), (" 2 m ", 120_000)],
)  # fmt: skip
def test_durations_read_as_people_write_them(text: object, ms: int) -> None:
    assert parse_duration_ms(text) == ms


@pytest.mark.parametrize("bad", ["soon", "5mm", "m5", "", "-1s", -3, True, None, "1d"])
def test_a_bad_duration_says_how_to_write_one(bad: object) -> None:
    with pytest.raises(ConfigError, match=r"write it like '5m'|0 or more seconds"):
        parse_duration_ms(bad)


def test_durations_print_back_in_their_shortest_form() -> None:
    assert [format_duration_ms(ms) for ms in (300_000, 5_400_000, 250, 0, 61_000)] == [
        "5m", "1h30m", "250ms", "0s", "1m1s",
    ]  # fmt: skip


def test_a_model_scales_out_once_the_threshold_held_for_the_window() -> None:
    scaler = Scaler(threshold=2, window_ms=1_000)
    busy = ModelLoad("m", [hot("r1", in_flight=4)])  # 3 waiting on 1 ready replica
    assert scaler.decide(0, [busy], RULES) == []
    assert scaler.decide(900, [busy], RULES) == []
    (out,) = scaler.decide(1_000, [busy], RULES)
    assert isinstance(out, ScaleOut) and (out.placed, out.target) == (1, 2)
    assert out.why == "scale out m 1\u21922: 3 waiting on 1 ready replica"


def test_a_dip_below_the_threshold_restarts_the_window() -> None:
    scaler = Scaler(threshold=2, window_ms=1_000)
    busy, calm = ModelLoad("m", [hot("r1", in_flight=4)]), ModelLoad("m", [hot("r1", 2)])
    scaler.decide(0, [busy], RULES)
    scaler.decide(600, [calm], RULES)  # 1 waiting: under 2
    assert scaler.decide(1_100, [busy], RULES) == []
    assert len(scaler.decide(2_100, [busy], RULES)) == 1


def test_calls_held_by_the_router_count_as_waiting() -> None:
    scaler = Scaler(threshold=2, window_ms=0)
    load = ModelLoad("m", [hot("r1", in_flight=1)], routing=2)
    assert load.waiting == 2 and load.running == 1
    assert isinstance(scaler.decide(0, [load], RULES)[0], ScaleOut)


def test_no_scale_out_past_the_ceiling_or_while_a_replica_is_on_its_way() -> None:
    scaler = Scaler(threshold=2, window_ms=0)
    full = ModelLoad("m", [hot("r1", 9), hot("r2", 9), hot("r3", 9)])
    on_its_way = ModelLoad("m", [hot("r1", 9), loading("r2")])
    assert scaler.decide(0, [full], RULES) == []
    assert scaler.decide(0, [on_its_way], RULES) == []


def test_an_idle_replica_goes_after_keep_alive_down_to_the_floor() -> None:
    scaler = Scaler(threshold=2, window_ms=0)
    two = ModelLoad("m", [hot("r1", idle_ms=12_000), hot("r2", idle_ms=30_000)])
    (gone,) = scaler.decide(0, [two], RULES)
    assert isinstance(gone, ScaleIn) and gone.replica == "r2"  # idle longest
    assert gone.why == "scale in m 2\u21921: replica r2 idle 30 s (keep_alive 10 s)"
    assert scaler.decide(0, [ModelLoad("m", [hot("r1", idle_ms=99_000)])], RULES) == []
    young = ModelLoad("m", [hot("r1", idle_ms=9_000), hot("r2", idle_ms=9_999)])
    assert scaler.decide(0, [young], RULES) == []


def test_a_floor_of_zero_lets_the_last_replica_go_and_the_fleet_keep_alive_applies() -> None:
    scaler = Scaler(window_ms=0, keep_alive_ms=60_000)
    rules = {"m": Autoscale(floor=0, ceiling=2)}
    assert scaler.decide(0, [ModelLoad("m", [hot("r1", idle_ms=59_000)])], rules) == []
    (gone,) = scaler.decide(0, [ModelLoad("m", [hot("r1", idle_ms=60_000)])], rules)
    assert isinstance(gone, ScaleIn) and gone.target == 0


def test_models_without_bounds_are_left_alone() -> None:
    scaler = Scaler(window_ms=0)
    load = ModelLoad("fixed", [hot("r1", in_flight=50)])
    assert scaler.decide(0, [load], RULES) == []


# --- against a real registry ------------------------------------------------------------


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    """Three 8 GiB GPUs on host h0, each owned by its own worker."""
    registry = Registry.from_url(redis_url, fleet)
    for i in range(3):
        gpu = Gpu(id=f"h0:{i}", host="", index=i, name="Sim", total=8 * GiB)
        registry.register_worker(f"w{i}", "h0", f"q{i}", [gpu], warm_budget=8 * GiB)
    yield registry
    registry.client.close()


def events(reg: Registry) -> list[dict[str, str]]:
    return [fields for _, fields in reg.client.xrange(reg.keys.events)]


def placed(reg: Registry, model: str) -> list[Deployment]:
    return [d for d in reg.snapshot().replicas(model) if d.level in RESERVING]


def test_loads_count_leases_in_flight_and_calls_the_router_holds(reg: Registry) -> None:
    replica = make_hot(reg, reg.place(Demand("m", size=GiB)))
    leases = [reg.pick("m") for _ in range(3)]
    assert all(lease is not None for lease in leases)
    assert hold_routing(reg, "m", "call-1", True) == 1
    (load,) = read_loads(reg, {"m": [(replica, Level.HOT, "w0", 1)]})
    assert (load.running, load.waiting, load.ready) == (1, 2 + 1, 1)
    assert hold_routing(reg, "m", "call-1", False) == 0
    for lease in leases:
        assert lease is not None
        reg.finish(lease)
    (load,) = read_loads(reg, {"m": [(replica, Level.HOT, "w0", 1)]})
    assert (load.waiting, load.replicas[0].in_flight) == (0, 0)


def test_calls_in_a_running_batch_count_as_running_and_the_rest_as_waiting(reg: Registry) -> None:
    replica = make_hot(reg, reg.place(Demand("m", size=GiB)))
    leases = [reg.pick("m") for _ in range(10)]
    assert all(lease is not None for lease in leases)
    mark_batch(reg, replica, 6)  # the worker's pass holds 6 calls; 4 wait in its queue
    (load,) = read_loads(reg, {"m": [(replica, Level.HOT, "w0", 1)]})
    assert (load.running, load.waiting) == (6, 4)
    mark_batch(reg, replica, 0)  # the pass ended: one call at a time again, as assumed
    (load,) = read_loads(reg, {"m": [(replica, Level.HOT, "w0", 1)]})
    assert (load.running, load.waiting) == (1, 9)


def test_a_scale_out_lands_on_another_worker_and_its_event_says_why(reg: Registry) -> None:
    first = reg.place(Demand("m", size=GiB))
    make_hot(reg, first)
    out = Demand("m", size=GiB, replicas=2)
    for seed in range(5):  # best fit alone would pick the GPU in use, first's own
        plan, detail = scale_out(
            reg, out, frozenset({first.worker}), f"scale out m 1\u21922: {seed}"
        )
        assert plan is not None and plan.worker != first.worker, detail
        evict_now(reg, plan.replica, Level.COLD)
    whys = [e["why"] for e in events(reg) if e["kind"] == "placed" and e["why"]]
    assert whys == [f"scale out m 1\u21922: {seed}" for seed in range(5)]
    assert audit(reg.snapshot()) == []


def test_a_scale_out_never_evicts_a_protected_model(reg: Registry) -> None:
    for i in range(3):
        make_hot(reg, reg.place(Demand(f"busy{i}", size=2 * GiB, factor=4.0)))  # a whole GPU
    protect = frozenset(f"busy{i}" for i in range(3))
    demand = Demand("m", size=2 * GiB, factor=4.0, protect=protect)
    plan, detail = scale_out(reg, demand, frozenset(), "t")
    assert plan is None and "CantAccommodateError" in detail
    plan, _ = scale_out(reg, Demand("m", size=2 * GiB, factor=4.0), frozenset(), "t")
    assert plan is not None and len(plan.evictions) == 1


def epoch_of(reg: Registry, replica: str) -> int:
    record = reg.deployment(replica)
    assert record is not None
    return record.epoch


def test_a_scale_in_stops_at_the_floor_and_says_why_in_its_event(reg: Registry) -> None:
    replicas = [make_hot(reg, reg.place(Demand("m", size=GiB, replicas=n))) for n in (1, 2)]
    first, second = ((r, epoch_of(reg, r)) for r in replicas)
    level, _ = scale_in(reg, *first, 1, "scale in m 2\u21921: test")
    assert level in (Level.OFFLOADING, Level.DROPPING)
    level, detail = scale_in(reg, *second, 1, "scale in m 1\u21920: test")
    assert level is None and "AtFloorError" in detail and "its floor is 1" in detail
    (gone,) = [e for e in events(reg) if e["kind"] == "evicted"]
    assert (gone["replica"], gone["cause"], gone["why"]) == (
        replicas[0],
        "scale-in",
        "scale in m 2\u21921: test",
    )
    settle_leaving(reg)
    assert [d.replica for d in placed(reg, "m")] == [replicas[1]]


def test_a_scale_in_never_drains_so_a_busy_replica_cannot_take_a_model_below_its_floor(
    reg: Registry,
) -> None:
    replicas = [make_hot(reg, reg.place(Demand("m", size=GiB, replicas=n))) for n in (1, 2)]
    busy, idle = ((r, epoch_of(reg, r)) for r in replicas)
    lease = reg.pick("m")  # ties go to the first by id: lease whichever it picks as busy
    assert lease is not None
    if lease.replica != busy[0]:
        busy, idle = idle, busy
    level, detail = scale_in(reg, *busy, 1, "scale in m 2\u21921: busy")
    assert level is None and "calls in flight" in detail  # not DRAINING: it stays placed
    level, _ = scale_in(reg, *idle, 1, "scale in m 2\u21921: idle")
    assert level in (Level.OFFLOADING, Level.DROPPING)
    reg.finish(lease)
    settle_leaving(reg)
    assert [d.replica for d in placed(reg, "m")] == [busy[0]]  # the floor holds


def test_a_late_scale_in_leaves_a_replica_placed_again_since_alone(reg: Registry) -> None:
    replicas = [make_hot(reg, reg.place(Demand("m", size=GiB, replicas=n))) for n in (1, 2)]
    seen = (replicas[0], epoch_of(reg, replicas[0]))
    level, _ = scale_in(reg, *seen, 1, "scale in m 2\u21921: first")
    assert level is not None
    again, detail = scale_in(reg, *seen, 1, "scale in m 2\u21921: repeated")
    assert again is None and "stays" in detail  # already leaving: not done twice
    settle_leaving(reg)
    restored = make_hot(reg, reg.place(Demand("m", size=GiB, replicas=2)))
    assert restored == replicas[0] and epoch_of(reg, restored) > seen[1]  # same id, new epoch
    late, detail = scale_in(reg, *seen, 1, "scale in m 2\u21921: late")
    assert late is None and "in placement" in detail
    assert len(placed(reg, "m")) == 2
    assert len([e for e in events(reg) if e["kind"] == "evicted"]) == 1


def test_a_decision_made_before_the_models_replicas_changed_changes_nothing(
    reg: Registry,
) -> None:
    first = make_hot(reg, reg.place(Demand("m", size=GiB)))
    before = read_changes(reg, ["m"])["m"]
    second = make_hot(reg, reg.place(Demand("m", size=GiB, replicas=2)))  # another router's
    level, _ = scale_in(reg, second, epoch_of(reg, second), 1, "scale in m 2\u21921: idle")
    assert level is not None
    settle_leaving(reg)  # the model is back at one replica, as the decision saw it
    out = Demand("m", size=GiB, replicas=2)
    plan, detail = scale_out(reg, out, frozenset(), "late", changes=before)
    assert plan is None and "ScaledSinceError" in detail and "changed since" in detail
    assert [d.replica for d in placed(reg, "m")] == [first]
    plan, detail = scale_out(reg, out, frozenset(), "fresh", changes=read_changes(reg, ["m"])["m"])
    assert plan is not None, detail  # a decision on the fleet as it is goes through
    make_hot(reg, plan)
    stale = scale_in(reg, first, epoch_of(reg, first), 1, "late in", changes=before)
    assert stale[0] is None and "ScaledSinceError" in stale[1]
    assert len(placed(reg, "m")) == 2
    assert audit(reg.snapshot()) == []


def test_two_routers_scaling_at_once_stay_within_the_bounds_and_never_double_place(
    redis_url: str, reg: Registry
) -> None:
    rules = {"m": Autoscale(floor=1, ceiling=3, keep_alive_ms=0)}
    first = reg.place(Demand("m", size=GiB))
    make_hot(reg, first)
    leases = [reg.pick("m") for _ in range(10)]  # ten calls in flight on one replica
    routers = [Registry.from_url(redis_url, reg.keys.fleet) for _ in range(2)]
    seen: list[int] = []
    stop = threading.Event()

    def act(router: Registry, kwargs: dict[str, Any]) -> None:
        changes = kwargs["changes"]
        if "target" in kwargs:
            demand = Demand("m", size=GiB, replicas=kwargs["target"])
            scale_out(router, demand, frozenset(kwargs["avoid"]), kwargs["why"], changes=changes)
        else:
            args = (kwargs["replica"], kwargs["epoch"], kwargs["floor"], kwargs["why"])
            scale_in(router, *args, changes=changes)

    def route(router: Registry) -> None:
        loop = ScalingLoop(router, rules, Scaler(window_ms=0), send=lambda kw: act(router, kw))
        while not stop.is_set():
            loop.look()

    def work() -> None:  # the workers' part: load what was placed, move what left
        while not stop.is_set():
            snap = reg.snapshot()
            seen.append(len([d for d in snap.replicas("m") if d.level in RESERVING]))
            for d in snap.replicas("m"):
                if d.level is Level.LOADING:
                    reg.confirm(d.replica, d.worker, d.epoch)
            settle_leaving(reg)

    threads = [threading.Thread(target=route, args=(r,)) for r in routers]
    threads.append(threading.Thread(target=work))
    for t in threads:
        t.start()
    try:
        deadline = time.monotonic() + 20
        while len([d for d in placed(reg, "m") if d.level is Level.HOT]) < 3:
            assert time.monotonic() < deadline, f"not scaled out: {placed(reg, 'm')}"
            time.sleep(0.05)
        for lease in leases:  # the burst is over: every replica idles past keep_alive
            assert lease is not None
            reg.finish(lease)
        while len(placed(reg, "m")) > 1:
            assert time.monotonic() < deadline, f"not scaled in: {placed(reg, 'm')}"
            time.sleep(0.05)
        time.sleep(0.5)  # both routers keep looking at a model at its floor
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        for router in routers:
            router.client.close()
    assert max(seen) == 3 and min(seen[seen.index(3) :]) == 1  # up to max, down to the floor
    outs = [e for e in events(reg) if e["kind"] in ("placed", "restored") and e["why"]]
    assert len(outs) == 2  # 1 -> 2 -> 3: each target placed once, whichever router asked
    assert len({first.worker, *(e["worker"] for e in outs)}) == 3  # one replica per worker
    ins = [e for e in events(reg) if e["kind"] == "evicted"]
    assert len(ins) == 2 and {e["cause"] for e in ins} == {"scale-in"}
    settle_leaving(reg)
    assert audit(reg.snapshot()) == []
