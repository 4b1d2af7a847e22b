"""What a worker checks in each message it takes (tasks/broker/intake.py), message by message."""

from __future__ import annotations

import base64
import json
from dataclasses import fields
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kombu.utils.json import dumps as kombu_dumps
from kombu.utils.json import loads as kombu_loads

from placement.errors import PayloadError
from tasks.broker import intake
from tasks.broker.intake import MAX_DEPTH, MAX_MESSAGE_BYTES, Refused, check_canvas, envelope
from tasks.serving import leases
from tasks.serving.calls import _FIELDS, Call


def nested(depth: int) -> list[Any]:
    value: list[Any] = []
    for _ in range(depth):
        value = [value]
    return value


def message(headers: dict[str, Any] | None = None, **fields_: Any) -> bytes:
    """A Celery protocol-2 message as kombu writes it to Redis."""
    body = base64.b64encode(json.dumps([["a", "x"], {}, {}]).encode()).decode()
    payload = {
        "body": body,
        "content-type": "application/json",
        "content-encoding": "utf-8",
        "headers": {"task": "gpufleet.infer", "id": "t-1", **(headers or {})},
        "properties": {"delivery_tag": "d-1", "body_encoding": "base64",
                       "delivery_info": {"exchange": "", "routing_key": "elsewhere"}},
    }  # fmt: skip
    return json.dumps(payload | fields_).encode()


def test_a_message_says_the_queue_it_came_from_whatever_its_publisher_wrote() -> None:
    info = envelope(message(), "gpufleet.router")["properties"]["delivery_info"]
    assert info == {"exchange": "", "routing_key": "gpufleet.router"}


def test_the_public_queue_takes_the_fleets_headers_off_and_fleet_queues_keep_them() -> None:
    forged = {"gpufleet_counted": True, "gpufleet_hops": 7, "gpufleet_lease": {"id": "x"}}
    assert not {h for h in envelope(message(forged), "celery")["headers"] if "gpufleet" in h}
    assert envelope(message(forged), "gpufleet.router")["headers"]["gpufleet_hops"] == 7


@pytest.mark.parametrize(
    ("item", "says"),
    [
        (b"{broken", "not JSON"),
        (b"[" * 50_000 + b"]" * 50_000, "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        (message({"id": ["x"]}), "header id"),
        (message({"retries": "many"}), "header retries"),
        (message({"timelimit": [1, "x"]}), "header timelimit"),
        (message({"deep": nested(MAX_DEPTH + 1)}), "deeper"),
        (message(body=5), "body is no string"),
        (message(properties={"delivery_tag": ["t"]}), "property delivery_tag"),
        (message(properties={"delivery_tag": "t", "priority": "high"}), "property priority"),
        (message(properties={"delivery_tag": "t", "body_encoding": "rot13"}), "body_encoding"),
    ],
)
def test_a_malformed_message_is_refused_as_it_is_taken_saying_why(item: bytes, says: str) -> None:
    with pytest.raises(Refused, match=says):
        envelope(item, "celery")


def test_a_message_over_the_size_limit_is_refused_with_its_task_id_when_it_can_be_found() -> None:
    huge = message(body="x" * MAX_MESSAGE_BYTES)
    with pytest.raises(Refused, match="over the limit") as refused:
        envelope(huge, "celery")
    assert refused.value.task_id == "t-1"


def test_depth_is_measured_without_recursion_at_any_depth() -> None:
    deep: list[Any] = []
    for _ in range(100_000):
        deep = [deep]
    assert intake.too_deep(deep, MAX_DEPTH)
    assert not intake.too_deep({"a": [[1, 2], {"b": "c"}]}, MAX_DEPTH)


@pytest.mark.parametrize("levels, deep", [(3, False), (4, True)])
def test_a_value_nesting_past_the_limit_is_too_deep_and_one_at_it_is_not(
    levels: int, deep: bool
) -> None:
    value: Any = "leaf"
    for level in range(levels):
        value = {"k": value, "n": 1} if level % 2 else [value, 2]
    assert intake.too_deep(value, 3) is deep
    assert intake.too_deep("a scalar", 0) is False


def signature(task: str, **options: Any) -> dict[str, Any]:
    return {"task": task, "args": [], "kwargs": {}, "options": options, "subtask_type": None}


@pytest.mark.parametrize(
    ("embed", "says"),
    [
        ({"chain": [signature("gpufleet.scale")]}, "may run only"),
        ({"callbacks": [signature("gpufleet.run")]}, "may run only"),
        ({"chain": [signature("gpufleet.status", queue="gpufleet.router")]}, "only to the queue"),
        ({"callbacks": [signature("gpufleet.status", exchange="celery")]}, "exchange"),
        ({"errbacks": [signature("gpufleet.status")]}, "errbacks"),
        ({"chord": signature("gpufleet.status", link_error=[signature("gpufleet.x")])}, "errbacks"),
        ({"chain": [signature("gpufleet.status", headers={"gpufleet_hops": 1})]}, "headers"),
    ],
)
def test_a_callers_canvas_may_not_make_the_fleet_send_what_the_caller_may_not(
    embed: dict[str, Any], says: str
) -> None:
    with pytest.raises(PayloadError, match=says):
        check_canvas(embed)


def test_a_callers_chain_of_public_tasks_to_the_public_queue_passes() -> None:
    public = [signature("gpufleet.infer"), signature("gpufleet.status", queue="celery")]
    check_canvas({"chain": public})
    check_canvas({"callbacks": None, "errbacks": None, "chain": None, "chord": None})


def test_a_call_may_not_wait_longer_than_the_visibility_timeout() -> None:
    soon = (datetime.now(UTC) + timedelta(minutes=5)).isoformat()
    intake._check_eta(soon)
    with pytest.raises(PayloadError, match="visibility timeout"):
        intake._check_eta((datetime.now(UTC) + timedelta(days=2)).isoformat())
    with pytest.raises(PayloadError, match="ISO 8601"):
        intake._check_eta("next tuesday")


def test_every_field_of_a_routed_call_has_its_check_and_a_bad_one_is_named() -> None:
    assert set(_FIELDS) == {f.name for f in fields(Call)}
    good = Call("a", "x", None, "r", "hot", 0).as_json()
    assert Call.from_json(good) == Call("a", "x", None, "r", "hot", 0)
    for field, bad in [("model", ["x"]), ("replica", ["x"]), ("epoch", {"a": 1}), ("hops", -1)]:
        with pytest.raises(PayloadError, match=f"field {field}"):
            Call.from_json(good | {field: bad})
    with pytest.raises(PayloadError, match="unknown fields: extra"):
        Call.from_json(good | {"extra": 1})
    with pytest.raises(PayloadError, match="lacks model"):
        Call.from_json({k: v for k, v in good.items() if k != "model"})


def test_a_lease_header_is_one_the_fleet_wrote_or_refused() -> None:
    assert leases.from_header("a", None) is None
    lease = leases.from_header("a", {"id": "l", "replica": "r", "deadline_ms": 5, "epoch": 2})
    assert lease is not None and (lease.replica, lease.deadline_ms, lease.epoch) == ("r", 5, 2)
    for bad in [["x"], {"id": "l"}, {"id": "l", "replica": "r", "deadline_ms": "soon"},
                {"id": "l", "replica": "r", "deadline_ms": 10**30}]:  # fmt: skip
        with pytest.raises(PayloadError, match="gpufleet_lease"):
            leases.from_header("a", bad)


@pytest.mark.parametrize(
    "value",
    [
        datetime(2026, 11, 27, 12, 0, tzinfo=UTC),  # kombu writes it as a typed object
        2**70,  # past orjson's 64 bits
        float("nan"),  # JSON has no NaN; Python's parser and kombu's writer take it
        "naïve ✓ text",
        "\ud800",  # a lone surrogate: orjson refuses it both ways
    ],
    ids=["kombu-typed", "big-int", "nan", "unicode", "lone-surrogate"],
)
def test_a_message_reads_and_writes_again_as_kombu_reads_and_writes_it(value: object) -> None:
    item = kombu_dumps({"headers": {"id": "c", "x": value}, "body": "e30="}).encode()
    parsed = intake.parse(item)
    assert repr(parsed) == repr(kombu_loads(item))  # repr: a NaN equals no NaN
    assert repr(kombu_loads(intake.dump(parsed, item))) == repr(kombu_loads(item))


@pytest.mark.parametrize(
    "text",
    [
        b'{"headers": {"id": "c", "x": {"\\u005f_type__": "datetime",'
        b' "__value__": "2026-11-27T12:00:00+00:00"}}}',
        b'{"headers": {"id": "c", "x": [1e400, -1e400]}}',
    ],
    ids=["escaped-kombu-key", "past-a-float"],
)
def test_text_kombu_reads_otherwise_than_orjson_is_read_and_written_as_kombu_does(
    text: bytes,
) -> None:
    assert repr(intake.parse(text)) == repr(kombu_loads(text))
    assert intake.dump(intake.parse(text), text) == kombu_dumps(kombu_loads(text))
