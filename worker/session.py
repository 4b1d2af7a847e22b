"""What a GPU worker process runs while its calls generate: every engine it holds and every
other call of its replicas, a step at a time.

A worker process runs one pool job at a time, and a generation is long. A job that ran
only the generations it started with held every other model of the worker until its
longest call ended: under 6 calls of 64 prompts x 500 tokens, another model's call waited
105 s (issue 55). So while calls generate, the process runs a *session*: its main process
hands it every call that reaches the worker, for any replica (`tasks.serving.batching`),
and the session interleaves them. Each turn of its loop:

1. takes what arrived (`SessionFeed.take`): generating calls (`GenCall`), and the other
   calls in the batches the main process formed (`OneShot`);
2. opens an engine for each generation replica that has calls and is HOT here, holding
   its lock while it has work; a replica not HOT yet is looked at again next turn
   (`Keeper.watch`), never waited on while anything else can run;
3. runs one waiting one-shot batch of each replica;
4. runs one step of every engine with work, then closes the engines left idle, which
   gives their replicas back to the keeper at once: an eviction drains a replica as its
   own calls end, not when the whole session does.

So a call of another model waits for at most about one decode step of each open engine
(and the passes ahead of it), and a generation of another model runs beside the long
ones, a step each in turn. The session ends once nothing runs, nothing waits for its
replica, and the feed brings nothing more. An engine whose model fails answers its own
calls with the error while the others go on; a fatal CUDA error restarts the process (its
calls are delivered again).
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Protocol

from placement.errors import EvictedError
from worker.calls import Calls, OpenEngine, fail_for
from worker.generation.engine import Engine
from worker.generation.serving import Driver, GenCall, Generated, unstarted
from worker.keeper import LOAD_WAIT_S, Keeper, Readiness, not_ready

__all__ = ["IDLE_WAIT_S", "OneShot", "Session", "SessionFeed"]

log = logging.getLogger(__name__)

#: How long an idle session waits for a new call before it looks at its replicas again.
IDLE_WAIT_S = 0.005


@dataclass(frozen=True)
class OneShot:
    """Calls of one replica that share forward passes (not generating): `run` computes and
    answers them; `fail` answers them with an error, unrun."""

    replica: str
    epoch: int
    run: Callable[[], None]
    fail: Callable[[BaseException], None]


class SessionFeed(Protocol):
    """Where a session's calls come from and where its answers and figures go."""

    def take(self, wait: float) -> list[GenCall | OneShot]:
        """What arrived since the last take (waiting up to `wait` s when nothing did)."""
        ...

    def cancelled(self) -> Iterable[str]:
        """Keys of generating calls to stop now."""
        ...

    def finished(self, call: GenCall, outcome: Generated | BaseException) -> None:
        """A generating call ended: its answer, or the error that fails it."""
        ...

    def more(self) -> bool:
        """Whether calls may still come (False: end once idle)."""
        ...

    def opened(self, replica: str, gpus: list[str]) -> None:
        """An engine opened, now, on these GPUs (a call's wait for it is its own)."""
        ...

    def stepped(
        self, replica: str, calls: int, held_tokens: int, figures: Callable[[], dict[str, float]]
    ) -> None:
        """After each step of `replica`'s engine: its calls open, the KV-cache tokens they
        hold (0 once it closed), and its figures (`kv_figures`), built only if asked for."""
        ...

    def streamed(self) -> None:
        """Mid-step, after new prompts' first tokens: send the streamed text so far."""
        ...


@dataclass
class _NotReady:
    """Work for a replica that is not HOT here yet."""

    ready: Readiness
    calls: list[GenCall] = field(default_factory=list)
    shots: list[OneShot] = field(default_factory=list)


@dataclass
class _Open:
    opened: OpenEngine
    driver: Driver


class Session:
    """One session of a worker process (see the module); `run` it once."""

    def __init__(
        self,
        calls: Calls,
        keeper: Keeper,
        feed: SessionFeed,
        load_wait_s: float = LOAD_WAIT_S,
    ) -> None:
        self.calls = calls
        self.keeper = keeper
        self.feed = feed
        self.load_wait_s = load_wait_s
        self._engines: dict[str, _Open] = {}  # by replica
        self._not_ready: dict[tuple[str, int], _NotReady] = {}
        self._shots: list[OneShot] = []

    def run(self) -> None:
        """Serve until nothing is left to do (see the module)."""
        try:
            while True:
                arrived: dict[str, list[GenCall]] = defaultdict(list)
                for item in self.feed.take(0.0 if self._busy() else IDLE_WAIT_S):
                    self._arrive(item, arrived)
                for replica, calls in arrived.items():
                    self._engines[replica].driver.add(calls)
                for key in self.feed.cancelled():
                    for engine in self._engines.values():
                        engine.driver.cancel(key)
                    self._cancel_waiting(key)
                self._look_again()
                for shot in self._next_shots():
                    shot.run()
                for engine in list(self._engines.values()):
                    self._step(engine)
                if not (self._engines or self._not_ready or self._shots or self.feed.more()):
                    return
        finally:
            for engine in list(self._engines.values()):
                self._close(engine)

    def _next_shots(self) -> list[OneShot]:
        """This turn's one-shot batches: the first waiting of each replica. Each replica
        gets one pass or one step a turn, so a flood of one model's calls does not stall
        the others' generations for its whole backlog."""
        now: dict[str, OneShot] = {}
        later: list[OneShot] = []
        for shot in self._shots:
            if shot.replica in now:
                later.append(shot)
            else:
                now[shot.replica] = shot
        self._shots = later
        return list(now.values())

    def _busy(self) -> bool:
        return bool(self._shots) or any(e.driver.busy for e in self._engines.values())

    def _arrive(self, item: GenCall | OneShot, arrived: dict[str, list[GenCall]]) -> None:
        engine = self._engines.get(item.replica) if isinstance(item, GenCall) else None
        if isinstance(item, GenCall) and engine is not None:
            if item.epoch and item.epoch != engine.opened.epoch:
                self._finished(item, _moved(item.replica))
            else:
                arrived[item.replica].append(item)
            return
        key = (item.replica, item.epoch)
        waiting = self._not_ready.get(key)
        if waiting is None:
            waiting = self._not_ready[key] = _NotReady(self.keeper.watch(*key))
        if isinstance(item, GenCall):
            waiting.calls.append(item)
        else:
            waiting.shots.append(item)

    def _cancel_waiting(self, key: str) -> None:
        """Call `key`, if it waits for its replica to be ready here, ends cancelled now, not
        once the replica is ready or the wait times out; a replica it leaves nothing
        waiting for is no longer watched."""
        for where, waiting in list(self._not_ready.items()):
            gone = [call for call in waiting.calls if call.key == key]
            for call in gone:
                waiting.calls.remove(call)
                self._finished(call, unstarted())
            if gone and not waiting.calls and not waiting.shots:
                self.keeper.unwatch(where[0], waiting.ready)
                del self._not_ready[where]

    def _look_again(self) -> None:
        """Start the work of every replica that became ready (or never will)."""
        for key, waiting in list(self._not_ready.items()):
            replica = key[0]
            if not waiting.ready.done.is_set():
                if time.perf_counter() - waiting.ready.since > self.load_wait_s:
                    self.keeper.unwatch(replica, waiting.ready)
                    del self._not_ready[key]
                    self._fail(waiting, not_ready(replica, self.keeper.worker_id, self.load_wait_s))
                continue
            if waiting.ready.error is not None:
                del self._not_ready[key]
                self._fail(waiting, waiting.ready.error)
                continue
            if waiting.calls and not self._open(replica, waiting):
                continue  # the keeper holds it (it is moving it): look again next turn
            del self._not_ready[key]
            self._shots += waiting.shots

    def _open(self, replica: str, waiting: _NotReady) -> bool:
        """Give `waiting`'s calls to the replica's engine, opened if need be; False while
        the keeper holds the replica's lock."""
        engine = self._engines.get(replica)
        if engine is None:
            _, epoch = waiting.ready.result()
            try:
                opened = self.calls.open_engine(replica, epoch, wait=False)
            except Exception as exc:  # it left meanwhile: route its calls again
                for call in waiting.calls:
                    self._finished(call, exc)
                waiting.calls = []
                return True
            if opened is None:
                return False
            opened.engine.after_prefill = self.feed.streamed
            engine = self._engines[replica] = _Open(
                opened, Driver(opened.engine, opened.template, self.feed.finished)
            )
            self.feed.opened(replica, opened.gpus)
        moved = [c for c in waiting.calls if c.epoch and c.epoch != engine.opened.epoch]
        for call in moved:
            self._finished(call, _moved(replica))
        now = time.monotonic()
        for call in waiting.calls:  # it waited for its replica (its `load`), not to join
            call.received = now
        engine.driver.add(c for c in waiting.calls if c not in moved)
        waiting.calls = []
        return True

    def _finished(self, call: GenCall, outcome: Generated | BaseException) -> None:
        """`feed.finished`, whose own failure is that call's alone."""
        try:
            self.feed.finished(call, outcome)
        except Exception:
            log.exception("could not answer generating call %s", call.key)

    def _fail(self, waiting: _NotReady, error: BaseException) -> None:
        for call in waiting.calls:
            self._finished(call, error)
        for shot in waiting.shots:
            shot.fail(error)

    def _step(self, engine: _Open) -> None:
        """One step of `engine`, if it has work; close it once it has none."""
        replica, driver = engine.opened.replica, engine.driver
        if driver.busy:
            engine.opened.own_threads()
            try:
                driver.step()
            except Exception as exc:  # its model failed: its own calls get the error
                fail_for(exc)  # a fatal CUDA error restarts the process here
                log.warning("generation on %s failed: %s", replica, exc)
                driver.fail(exc)
                self._close(engine)
                return
            opened = engine.opened.engine
            self.feed.stepped(replica, driver.calls, opened.held_tokens, lambda: kv_figures(opened))
        if not driver.busy:
            self._close(engine)

    def _close(self, engine: _Open) -> None:
        replica = engine.opened.replica
        if self._engines.get(replica) is engine:
            del self._engines[replica]
        engine.opened.close()
        closed = engine.opened.engine
        self.feed.stepped(replica, 0, closed.held_tokens, lambda: kv_figures(closed))


def _moved(replica: str) -> EvictedError:
    return EvictedError(
        f"replica {replica} was placed again before the call reached it; route it again"
    )


def kv_figures(engine: Engine) -> dict[str, float]:
    """What a step leaves in `engine`'s KV cache: the tokens its rows hold (none once they
    all left), and, paged, its blocks in use, cached and free and its prompts' reuse; and,
    for a base with adapters, its adapters' room (`worker.adapters.room`)."""
    room = engine.adapters.stats() if engine.adapters is not None else {}
    return {**engine.kv_stats(), **room, "held_tokens": engine.held_tokens}
