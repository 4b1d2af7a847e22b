"""Sessions below Celery: a GPU worker's batcher hands every call to the running session
over a real socket pair, the child's feed reads them, and each call is settled once, as it
ends (`tasks.serving.generating`, `tasks.serving.batching`).

The requests and the pool are the same stand-ins as tests/test_batching.py's (what the
batcher reads of them and the callbacks it fans out); the end-to-end tests with real
Celery workers are in tests/test_generation_fleet.py.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest
from celery.exceptions import Ignore
from celery.worker import state as worker_state

from placement.rules.batching import BatchLimits
from tasks.serving import batch_jobs, generating, streams
from tasks.serving.batching import Batcher, Generations
from tasks.serving.generating import Channel, ChildFeed
from tests.test_batching import _Request


class _Pool:
    """A pool that records the generation jobs it is given; the test ends them."""

    def __init__(self) -> None:
        self.jobs: list[dict[str, Any]] = []

    def apply_async(self, target: Any, args: tuple[Any, ...], **callbacks: Any) -> None:
        job_id, jobs = args
        ids = [j.task_id for j in jobs]
        self.jobs.append({"id": job_id, "jobs": jobs, "ids": ids, **callbacks})


def _answers(job: dict[str, Any], **by_id: Any) -> dict[str, Any]:
    """A session's return for the calls it started with, by their task ids."""
    return {j.key: by_id[j.task_id] for j in job["jobs"] if j.task_id in by_id}


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
    """A batcher whose models `g*` generate and the others batch, 8 calls at most."""
    generations = Generations(lambda model: model.startswith("g"), lambda *_: {}, lambda: channel)
    return Batcher(
        pool, timer or _Timer(), lambda _: None, lambda _: BatchLimits(size=8), lambda _: [],
        generations,
    )  # fmt: skip


def _gen(task_id: str, replica: str, **options: Any) -> _Request:
    return _Request(task_id, replica, model="gen", **options)


def _started(pool: _Pool, index: int = 0) -> None:
    """The child took session `index`: calls go to it from now on."""
    pool.jobs[index]["accept_callback"](7, 0.0)


@dataclass
class _Shot:
    replica: str
    epoch: int
    run: Any
    fail: Any


def _child(
    job: dict[str, Any], channel: Channel, ran: list[list[str]] | None = None, size: int = 8
) -> ChildFeed:
    def batch(jobs: list[Any], error: BaseException | None) -> dict[str, Any]:
        if ran is not None:
            ran.append([j.task_id for j in jobs])
        return {j.key: (0, f"answer of {j.task_id}", 0.0) for j in jobs}

    return ChildFeed(
        job["id"], job["jobs"], channel, lambda j: _Key(j.key), _Shot, _finish, batch,
        lambda _: BatchLimits(size=size),
    )  # fmt: skip


class _Key:
    """A generating call as the child's feed makes it: its message's key."""

    def __init__(self, key: str) -> None:
        self.key, self.deadline = key, None


def _finish(job: Any, call: Any, outcome: Any, revoked: bool) -> Any:
    return (0, f"answer of {job.task_id}", 0.0)


def _keys(items: list[Any]) -> list[Any]:
    """What a take brought: each generating call's task id, each batch's replica."""
    return [item.key.split("/")[0] if isinstance(item, _Key) else item.replica for item in items]


def _ended(feed: ChildFeed, task_id: str) -> None:
    """The child's engine ended the call of `task_id`."""
    (key,) = [k for k in feed._jobs if k.split("/")[0] == task_id]
    feed.finished(_Key(key), None)


def test_every_call_reaching_the_worker_while_a_session_runs_joins_it_any_replicas(
    channel: Channel,
) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    first, same, other = _gen("c1", "r1"), _gen("c2", "r1"), _gen("c3", "r2")
    encoder = [_Request("e1", "r3"), _Request("e2", "r3")]
    batcher(first)  # the child is free: a session starts with it
    assert [job["ids"] for job in pool.jobs] == [["c1"]]
    pool.jobs[0]["accept_callback"](7, 0.0)
    for request in (same, other, *encoder):  # each joins the session, through the channel
        batcher(request)
    assert len(pool.jobs) == 1
    assert all(r.seen == ["accepted"] for r in (same, other, *encoder))
    ran: list[list[str]] = []
    feed = _child(pool.jobs[0], channel, ran)
    taken = feed.take(0.0)
    assert _keys(taken) == ["c1", "c2", "c3", "r3"]  # the encoder's two calls: one batch
    taken[-1].run()
    assert ran == [["e1", "e2"]]


def test_each_call_of_a_session_is_settled_as_it_ends_not_when_the_session_does(
    channel: Channel,
) -> None:
    pool, timer = _Pool(), _Timer()
    batcher = _batcher(pool, channel, timer)
    first, encoder, late = _gen("c1", "r1"), _Request("e1", "r3"), _gen("c2", "r1")
    batcher(first)
    _started(pool)
    batcher(encoder)
    feed = _child(pool.jobs[0], channel)
    taken = feed.take(0.0)
    taken[1].run()  # the encoder's pass, between two steps
    for look in timer.repeating:
        look()
    assert encoder.seen == ["accepted", "success (0, 'answer of e1', 0.0)"]  # c1 still runs
    assert first.seen == ["accepted"]
    batcher(late)
    feed.take(0.0)
    _ended(feed, "c1")
    _ended(feed, "c2")
    pool.jobs[0]["callback"](feed.leftover())  # the session ended; its return carries none
    assert first.seen == ["accepted", "success (0, 'answer of c1', 0.0)"]
    assert late.seen == ["accepted", "success (0, 'answer of c2', 0.0)"]
    assert timer.repeating == []  # no session left to look at


def test_on_a_generating_worker_a_model_with_batching_off_joins_a_session_too(
    channel: Channel,
) -> None:
    pool, passed = _Pool(), []
    generations = Generations(lambda model: model.startswith("g"), lambda *_: {}, lambda: channel)
    batcher = Batcher(
        pool, _Timer(), passed.append, lambda _: BatchLimits(size=1), lambda _: [], generations
    )
    batcher(_gen("c1", "r1"))
    _started(pool)
    batcher(_Request("e1", "r3"))
    batcher(_Request("e2", "r3"))
    assert passed == [] and len(pool.jobs) == 1  # not to the pool, which the session holds
    assert _keys(_child(pool.jobs[0], channel, size=1).take(0.0)) == ["c1", "r3", "r3"]


def test_a_call_that_may_not_join_waits_and_so_do_the_calls_behind_it(channel: Channel) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    batcher(_gen("c1", "r1"))
    _started(pool)
    stuck = _gen("c2", "r2")
    stuck.delivery_info = {"redelivered": True}  # it may have killed the last child: alone
    batcher(stuck)
    batcher(_gen("c3", "r1"))  # would join, but c2 goes first
    assert _keys(_child(pool.jobs[0], channel).take(0.0)) == ["c1"]
    pool.jobs[0]["callback"](_answers(pool.jobs[0], c1=(0, "ok", 0.0)))
    assert [job["ids"] for job in pool.jobs][1:] == [["c2"]]
    batcher(_Request("e1", "r3"))  # nothing joins the session of a redelivered call
    assert _keys(_child(pool.jobs[1], channel).take(0.0)) == ["c2"]
    pool.jobs[1]["callback"](_answers(pool.jobs[1], c2=(0, "ok", 0.0)))
    assert [job["ids"] for job in pool.jobs][2:] == [["c3"]]


def test_a_second_message_with_a_held_task_id_is_dropped_at_once(channel: Channel) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    first, twin = _gen("same", "r1"), _gen("same", "r1")
    batcher(first)
    _started(pool)
    batcher(twin)
    assert twin.seen == ["rejected"]  # not run, not left waiting
    assert _keys(_child(pool.jobs[0], channel).take(0.0)) == ["same"]
    pool.jobs[0]["callback"](_answers(pool.jobs[0], same=(0, "ok", 0.0)))
    assert first.seen == ["accepted", "success (0, 'ok', 0.0)"]
    again = _gen("same", "r1")  # once the first is settled, the id is free again
    batcher(again)
    assert again.seen == [] and [job["ids"] for job in pool.jobs][1:] == [["same"]]


def test_a_call_routed_again_to_this_worker_before_its_first_message_settled_runs_as_its_own(
    channel: Channel,
) -> None:
    """Its replica left while it ran here (say): the call comes back under its task id,
    one hop further, possibly before the child has said the first message ended."""
    pool = _Pool()
    batcher = _batcher(pool, channel)
    first, again = _gen("c1", "r1"), _gen("c1", "r2", hops=1)
    batcher(first)
    _started(pool)
    batcher(again)
    assert again.seen == ["accepted"]  # not dropped: a call of its own, in the session
    feed = _child(pool.jobs[0], channel)
    assert _keys(feed.take(0.0)) == ["c1", "c1"]
    for key in list(feed._jobs):
        feed.finished(_Key(key), None)
    pool.jobs[0]["callback"](feed.results)
    answered = ["accepted", "success (0, 'answer of c1', 0.0)"]
    assert first.seen == answered and again.seen == answered  # each settled, once


def test_a_call_handed_over_as_the_session_ended_runs_in_the_next_job(channel: Channel) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    late = _gen("c2", "r1")
    batcher(_gen("c1", "r1"))
    _started(pool)
    batcher(late)  # sent over the channel, but the child ends the job without reading it
    pool.jobs[0]["callback"](_answers(pool.jobs[0], c1=(0, "ok", 0.0)))
    assert late.seen == ["accepted"] and [job["ids"] for job in pool.jobs][1:] == [["c2"]]
    next_feed = _child(pool.jobs[1], channel)
    assert _keys(next_feed.take(0.0)) == ["c2"]  # the stale message dropped


def test_a_call_handed_to_a_session_and_unread_as_the_connection_dropped_runs_next(
    channel: Channel,
) -> None:
    """Handed over, it counts as running: the reconnected consumer does not give its
    message back (tasks.broker.transport), so this worker must run it."""
    pool = _Pool()
    batcher = _batcher(pool, channel)
    late = _gen("c2", "r1")
    batcher(_gen("c1", "r1"))
    _started(pool)
    batcher(late)
    batcher.forget()  # the consumer lost its connection; the child ends without reading c2
    pool.jobs[0]["callback"](_answers(pool.jobs[0], c1=(0, "ok", 0.0)))
    assert late.seen == ["accepted"] and [job["ids"] for job in pool.jobs][1:] == [["c2"]]
    # the session may have run it and lost its word of it: the next looks for its answer
    assert [j.again for j in pool.jobs[1]["jobs"]] == [True]


def test_a_generating_call_that_may_have_run_is_acknowledged_unrun_when_its_answer_is_stored(
    channel: Channel,
) -> None:
    """A session given a call that may have run (`ChildCall.again`) asks whether its answer
    is stored: if so, it runs the call's tracer with Celery's `Ignore` (acknowledged, the
    stored answer stands) instead of generating it again; if not, it generates it."""
    pool = _Pool()
    batcher = _batcher(pool, channel)
    batcher(_gen("c1", "r1"))
    (first,) = pool.jobs[0]["jobs"]
    second = first._replace(args=(first.args[0], "c2", *first.args[2:]), key="c2/2")
    jobs = [j._replace(again=True) for j in (first, second)]
    traced: dict[str, Any] = {}

    def trace(name: str, task_id: str, *_: Any) -> str:
        prepared = batch_jobs.take_prepared(task_id)
        assert prepared is not None
        with pytest.raises(Ignore):
            prepared.served()
        traced[task_id] = "ignored"
        return "ignored"

    jobs = [j._replace(trace=trace) for j in jobs]
    asked: list[list[str]] = []

    def ran_before(some: list[Any]) -> set[str]:
        asked.append([j.task_id for j in some])
        return {"c1"}

    feed = ChildFeed(
        "s1", jobs, None, lambda j: _Key(j.key), _Shot, lambda *a: None, lambda *a: {},
        lambda _: BatchLimits(size=8), ran_before=ran_before,
    )  # fmt: skip
    assert asked == [["c1"], ["c2"]]
    assert traced == {"c1": "ignored"}  # answered before: not generated again
    assert _keys(feed.take(0.0)) == ["c2"]  # not answered: it generates
    assert feed.leftover() == {jobs[0].key: "ignored"}


@contextmanager
def _one_of_two_revoked(channel: Channel) -> Iterator[tuple[_Pool, ChildFeed, Any, Any, _Timer]]:
    """A session running calls c1 and c2, c1 revoked: the main process has told the child,
    whose feed has taken the cancel. Yields the pool, the child's feed, the two calls (c1
    first) and the main process's timer."""
    pool, timer = _Pool(), _Timer()
    batcher = _batcher(pool, channel, timer)
    doomed, other = _Revocable("c1", "r1", model="gen"), _Revocable("c2", "r1", model="gen")
    batcher(doomed)
    _started(pool)
    batcher(other)
    feed = _child(pool.jobs[0], channel)
    feed.take(0.0)
    worker_state.revoked.add("c1")
    try:
        for look in timer.repeating:
            look()
        for look in timer.repeating:  # told again until the job ends: harmless
            look()
        feed.take(0.0)
        assert {key.split("/")[0] for key in feed.cancelled()} == {"c1"}
        yield pool, feed, doomed, other, timer
    finally:
        worker_state.revoked.discard("c1")


def test_a_revoked_running_call_is_stopped_in_the_child_and_announced_revoked(
    channel: Channel,
) -> None:
    with _one_of_two_revoked(channel) as (pool, feed, doomed, other, timer):
        _ended(feed, "c1")
        _ended(feed, "c2")
        pool.jobs[0]["callback"](feed.results)
        assert doomed.seen == ["accepted", "revoked"]
        assert other.seen == ["accepted", "success (0, 'answer of c2', 0.0)"]
        assert timer.repeating == []  # the job ended: nothing more to watch


def test_a_revoked_call_of_a_session_that_fails_is_announced_revoked_not_failed(
    channel: Channel,
) -> None:
    with _one_of_two_revoked(channel) as (pool, feed, doomed, other, _):
        feed.unanswered(RuntimeError("the session failed"))  # before either call ended
        pool.jobs[0]["callback"](feed.leftover())
        assert doomed.seen == ["accepted", "revoked"]
        assert other.seen == ["accepted", "success (0, 'answer of c2', 0.0)"]  # its answer


def test_a_lost_child_fails_every_call_it_still_held_so_each_goes_back_to_the_queue(
    channel: Channel,
) -> None:
    pool, timer = _Pool(), _Timer()
    batcher = _batcher(pool, channel, timer)
    calls = [_gen("c1", "r1"), _gen("c2", "r1"), _gen("c3", "r1")]
    batcher(calls[0])
    _started(pool)
    for request in calls[1:]:
        batcher(request)
    feed = _child(pool.jobs[0], channel)
    feed.take(0.0)
    _ended(feed, "c1")  # settled before the child was lost
    pool.jobs[0]["error_callback"]("lost")
    assert [r.seen for r in calls] == [
        ["accepted", "success (0, 'answer of c1', 0.0)"],
        ["accepted", "failure"],
        ["accepted", "failure"],
    ]


def test_the_channel_carries_whole_messages_both_ways_and_refuses_one_too_large(
    channel: Channel,
) -> None:
    assert channel.receive(0.0) == []
    assert channel.send(("call", "job", "x" * 100_000))
    assert channel.receive(0.1) == [("call", "job", "x" * 100_000)]
    assert not channel.send(("call", "job", "x" * (generating.MAX_MESSAGE + 1)))
    assert channel.receive(0.0) == []
    assert channel.tell_parent(("settled", "job", {"c": 1}))
    assert channel.from_child() == [("settled", "job", {"c": 1})]
    assert channel.from_child() == []


def _stream(client: Any, task_id: str, entries: list[dict[str, str]]) -> None:
    for fields in entries:
        client.xadd(streams.key(task_id), fields)


def test_a_stream_read_skips_what_a_rerun_of_its_call_writes_again(redis_client: Any) -> None:
    run = [{"start": "1"}, {"i": "0", "t": "ab"}, {"i": "0", "t": "c"}]
    rerun = [{"start": "1"}, {"i": "0", "t": "a"}, {"i": "0", "t": "bcd"}, {"i": "0", "t": "e"}]
    _stream(redis_client, "t-rerun", [*run, *rerun, {"end": "length"}])
    pieces = [text for _, text in streams.read(redis_client, "t-rerun", lambda: False, 10)]
    assert pieces == ["ab", "c", "d", "e"]
    redis_client.delete(streams.key("t-rerun"))


def test_a_stream_whose_rerun_wrote_other_text_says_so(redis_client: Any) -> None:
    entries = [{"start": "1"}, {"i": "0", "t": "abc"}, {"start": "1"}, {"i": "0", "t": "abX"}]
    _stream(redis_client, "t-other", entries)
    reader = streams.read(redis_client, "t-other", lambda: False, 10)
    assert next(reader) == (0, "abc")
    with pytest.raises(streams.StreamRestartedError, match=r"read its answer with \.get\(\)"):
        next(reader)
    redis_client.delete(streams.key("t-other"))


def test_a_stream_that_never_ends_stops_once_its_call_is_answered(redis_client: Any) -> None:
    _stream(redis_client, "t-open", [{"start": "1"}, {"i": "0", "t": "hi"}])
    assert list(streams.read(redis_client, "t-open", lambda: True, 10)) == [(0, "hi")]
    redis_client.delete(streams.key("t-open"))


def test_a_session_has_no_pool_limit_and_each_call_carries_the_end_of_its_own(
    channel: Channel,
) -> None:
    """A session may run as long as calls come, so a pool limit would kill other calls
    with it: each call's hard limit ends where it runs (the engine's deadline, or before
    a batch's pass), counted from its hand-over."""
    pool = _Pool()
    batcher = _batcher(pool, channel)
    batcher(_gen("c1", "r1", time_limits=(5.0, None)))
    assert pool.jobs[0].get("timeout") is None
    _started(pool)
    before = time.time()
    batcher(_gen("c2", "r1", time_limits=(100.0, None)))  # joins, whatever its limit
    batcher(_gen("c3", "r1"))  # no limit at all: joins too
    feed = _child(pool.jobs[0], channel)
    feed.take(0.0)
    jobs = {j.task_id: j for j in feed._jobs.values()}
    assert set(jobs) == {"c1", "c2", "c3"} and len(pool.jobs) == 1
    assert jobs["c3"].deadline is None
    assert before + 100 <= jobs["c2"].deadline <= time.time() + 100
    assert jobs["c1"].deadline <= time.time() + 5


def test_calls_wait_for_the_child_to_take_the_session_then_go_to_it(channel: Channel) -> None:
    """A session queued behind one the child still runs (after a lost connection) would
    have that one drop the calls as stale: they go once the child took it."""
    pool = _Pool()
    batcher = _batcher(pool, channel)
    batcher(_gen("c1", "r1"))
    waiting = _gen("c2", "r1")
    batcher(waiting)
    assert channel.receive(0.0) == [] and waiting.seen == []
    _started(pool)
    assert waiting.seen == ["accepted"]
    assert _keys(_child(pool.jobs[0], channel).take(0.0)) == ["c1", "c2"]


def test_a_batch_too_large_for_one_message_goes_to_the_session_in_parts(channel: Channel) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    batcher(_gen("c1", "r1"))
    _started(pool)
    # room for about two calls a message
    channel.limit = 2 * len(channel.encode(("call", pool.jobs[0]["id"], pool.jobs[0]["jobs"][0])))
    calls = [_Request(f"e{i}", "r3") for i in range(4)]
    for request in calls:
        batcher(request)
    assert all(r.seen == ["accepted"] for r in calls)
    messages = [m for m in channel.receive(0.0) if m[0] == "call"]
    assert sum(len(m[2]["jobs"]) for m in messages) == 4 and len(messages) >= 2


def test_the_same_message_delivered_again_while_held_is_left_to_its_first_delivery(
    channel: Channel,
) -> None:
    pool = _Pool()
    batcher = _batcher(pool, channel)
    first, again = _gen("c1", "r1"), _gen("c1", "r1")
    first.message = again.message = SimpleNamespace(delivery_tag="tag-1")
    batcher(first)
    batcher(again)
    assert again.seen == []  # neither rejected (its tag is the first's) nor run twice
    assert pool.jobs[0]["ids"] == ["c1"]
