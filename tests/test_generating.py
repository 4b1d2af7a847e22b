"""Generating calls below Celery: a GPU worker's batcher hands calls to the running
generation job over a real socket pair, the child's feed reads them, and each call is
settled once (`tasks.serving.generating`, `tasks.serving.batching`).

The requests and the pool are the same stand-ins as tests/test_batching.py's (what the
batcher reads of them and the callbacks it fans out); the end-to-end tests with real
Celery workers are in tests/test_generation_fleet.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from celery.worker import state as worker_state

from placement.rules.batching import BatchLimits
from tasks.serving import generating
from tasks.serving.batching import Batcher, Generations
from tasks.serving.generating import REVOKED, Channel, ChildFeed
from tests.test_batching import _Request


class _Pool:
    """A pool that records the generation jobs it is given; the test ends them."""

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []

    def apply_async(self, target: Any, args: tuple[Any, ...], **callbacks: Any) -> None:
        job_id, jobs = args
        self.jobs.append({"id": job_id, "jobs": jobs, "ids": [j[1][1] for j in jobs], **callbacks})


class _Timer:
    def __init__(self) -> None:
        self.repeating: list[Any] = []

    def call_repeatedly(self, seconds: float, fun: Any) -> Any:
        self.repeating.append(fun)
        return self

    def cancel(self) -> None:
        self.repeating.clear()


class _Revocable(_Request):
    def revoked(self) -> bool:
        announced = self.id in worker_state.revoked
        if announced:
            self.seen.append("revoked")
        return announced


@pytest.fixture
def channel() -> Channel:
    return Channel()


def _batcher(pool: _Pool, channel: Channel, timer: _Timer | None = None) -> Batcher:
    generations = Generations(lambda _: True, lambda *_: {}, lambda: channel, window_s=60.0)
    return Batcher(
        pool, timer or _Timer(), lambda _: None, lambda _: BatchLimits(size=8), lambda _: [],
        generations,
    )  # fmt: skip


def _child(job: dict[str, Any], channel: Channel) -> ChildFeed:
    return ChildFeed(job["id"], job["jobs"], channel, lambda j: (_Key(j[1][1]), j), _finish)


class _Key:
    def __init__(self, key: str) -> None:
        self.key, self.deadline = key, None


def _finish(job: Any, call: Any, outcome: Any, revoked: bool) -> Any:
    return (0, f"answer of {job[1][1]}", 0.0)


def test_calls_arriving_while_a_generation_job_runs_join_it_and_each_is_settled_once(
    channel: Channel,
) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    first, second, elsewhere = _Request("c1", "r1"), _Request("c2", "r1"), _Request("c3", "r2")
    batcher(first)  # the child is free: a generation job starts with it
    assert [job["ids"] for job in pool.jobs] == [["c1"]]
    pool.jobs[0]["accept_callback"](7, 0.0)
    batcher(second)  # joins the running job, through the channel
    assert len(pool.jobs) == 1 and second.seen == ["accepted"]
    feed = _child(pool.jobs[0], channel)
    assert [call.key for call in feed.take(0.0)] == ["c1", "c2"]
    batcher(elsewhere)  # another replica's call waits for the child
    for call in (_Key("c1"), _Key("c2")):
        feed.finished(call, None)
    pool.jobs[0]["callback"](feed.results)
    assert first.seen == ["accepted", "success (0, 'answer of c1', 0.0)"]
    assert second.seen == ["accepted", "success (0, 'answer of c2', 0.0)"]
    assert [job["ids"] for job in pool.jobs][-1] == ["c3"]


def test_a_waiting_call_stops_the_running_job_from_taking_more(channel: Channel) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    batcher(_Request("c1", "r1"))
    batcher(_Request("c2", "r2"))  # another replica's: waits
    batcher(_Request("c3", "r1"))  # would join, but c2 goes first
    assert _child(pool.jobs[0], channel).take(0.0)[0].key == "c1"
    assert channel.receive(0.0) == []
    pool.jobs[0]["callback"]({"c1": (0, "ok", 0.0)})
    assert [job["ids"] for job in pool.jobs][1:] == [["c2"]]
    pool.jobs[1]["callback"]({"c2": (0, "ok", 0.0)})
    assert [job["ids"] for job in pool.jobs][2:] == [["c3"]]


def test_a_call_handed_over_as_the_job_ended_runs_in_the_next_job(channel: Channel) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    late = _Request("c2", "r1")
    batcher(_Request("c1", "r1"))
    batcher(late)  # sent over the channel, but the child ends the job without reading it
    pool.jobs[0]["callback"]({"c1": (0, "ok", 0.0)})
    assert late.seen == [] and [job["ids"] for job in pool.jobs][1:] == [["c2"]]
    next_feed = _child(pool.jobs[1], channel)
    assert [call.key for call in next_feed.take(0.0)] == ["c2"]  # the stale message dropped


def test_a_revoked_running_call_is_stopped_in_the_child_and_announced_revoked(
    channel: Channel,
) -> None:
    pool, timer = _Pool(), _Timer()
    batcher = _batcher(pool, channel, timer)
    doomed, other = _Revocable("c1", "r1"), _Revocable("c2", "r1")
    batcher(doomed)
    batcher(other)
    feed = _child(pool.jobs[0], channel)
    feed.take(0.0)
    worker_state.revoked.add("c1")
    try:
        for forward in timer.repeating:
            forward()
        for forward in timer.repeating:  # told again until the job ends: harmless
            forward()
        feed.take(0.0)
        assert set(feed.cancelled()) == {"c1"}
        feed.finished(_Key("c1"), None)
        feed.finished(_Key("c2"), None)
        assert feed.results["c1"] == REVOKED
        pool.jobs[0]["callback"](feed.results)
        assert doomed.seen == ["revoked"] and other.seen == ["success (0, 'answer of c2', 0.0)"]
        assert timer.repeating == []  # the job ended: nothing more to watch
    finally:
        worker_state.revoked.discard("c1")


def test_a_lost_child_fails_every_call_of_its_job_so_each_goes_back_to_the_queue(
    channel: Channel,
) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    calls = [_Request("c1", "r1"), _Request("c2", "r1")]
    for request in calls:
        batcher(request)
    pool.jobs[0]["error_callback"]("lost")
    assert [request.seen for request in calls] == [["failure"], ["failure"]]


def test_the_channel_carries_whole_messages_and_refuses_one_too_large(channel: Channel) -> None:
    assert channel.receive(0.0) == []
    assert channel.send(("call", "job", "x" * 100_000))
    assert channel.receive(0.1) == [("call", "job", "x" * 100_000)]
    assert not channel.send(("call", "job", "x" * (generating.MAX_MESSAGE + 1)))
    assert channel.receive(0.0) == []
