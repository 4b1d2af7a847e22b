"""The scaling rule (placement/scaling.py) and the durations it is configured with."""

from __future__ import annotations

import pytest

from placement.durations import format_duration_ms, parse_duration_ms
from placement.errors import ConfigError
from placement.scaling import Autoscale, ModelLoad, ReplicaLoad, ScaleIn, ScaleOut, Scaler

RULES = {"m": Autoscale(floor=1, ceiling=3, keep_alive_ms=10_000)}


def hot(replica: str, in_flight: int = 0, idle_ms: int = 0) -> ReplicaLoad:
    return ReplicaLoad(replica, ready=True, in_flight=in_flight, idle_ms=idle_ms)


def loading(replica: str) -> ReplicaLoad:
    return ReplicaLoad(replica, ready=False, in_flight=0, idle_ms=0)


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
