"""A worker process's session (`worker.session`): long generations, another generation
model and another model's one-shot calls share the process a step at a time.

One `GpuWorker` (simulated GPU, synthetic models, no Celery) on a real redis-server; the
registry calls stand in for a router, and the feed for the Celery side.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator

import pytest
import torch

from placement.catalog.catalog import Catalog
from placement.errors import EvictedError
from placement.ledger.registry import Registry
from worker.devices import simulated_devices
from worker.generation.serving import GenCall, Generated
from worker.node import GpuWorker
from worker.session import OneShot, Session

GiB = 2**30
GPT = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512,
       "n_positions": 256}  # fmt: skip
GENERATES = {"source": "synthetic", "task": "text-generation", "memory": "64MiB", "config": GPT}
CATALOG = Catalog.from_mapping(
    {
        "models": {
            "long": GENERATES,
            "short": GENERATES,
            "encoder": {"source": "synthetic", "task": "forward", "memory": "128MiB"},
        }
    }
)


@pytest.fixture
def node(redis_url: str, fleet: str) -> Iterator[GpuWorker]:
    registry = Registry.from_url(redis_url, fleet)
    devices = simulated_devices("1x4GiB")
    worker = GpuWorker(registry, devices, devices, "h0", "q0", spec_of=CATALOG.get,
                       warm_budget=4 * GiB, lease_ms=3000)  # fmt: skip
    worker.start()
    yield worker
    worker.stop()
    registry.client.close()


def hot(node: GpuWorker, model: str) -> tuple[str, int]:
    """Place `model` as a router would; its replica and epoch once HOT here."""
    plan = node.registry.place(CATALOG.get(model).demand())
    node.keeper.ensure(plan.replica, plan.epoch, timeout_s=30)
    return plan.replica, plan.epoch


class _Feed:
    """Hands the session what `arrivals` says at each take; records what happened when."""

    def __init__(self, arrivals: list[list[GenCall | OneShot]]) -> None:
        self.arrivals = arrivals
        self.events: list[tuple[str, str]] = []  # (what, key or replica), in order
        self.outcomes: dict[str, Generated | BaseException] = {}
        self.steps: dict[str, int] = {}

    def take(self, wait: float) -> list[GenCall | OneShot]:
        return self.arrivals.pop(0) if self.arrivals else []

    def cancelled(self) -> Iterable[str]:
        return ()

    def finished(self, call: GenCall, outcome: Generated | BaseException) -> None:
        self.outcomes[call.key] = outcome
        self.events.append(("finished", call.key))

    def more(self) -> bool:
        return bool(self.arrivals)

    def opened(self, replica: str, gpus: list[str]) -> None:
        self.events.append(("opened", replica))

    def stepped(
        self, replica: str, calls: int, held_tokens: int, figures: Callable[[], dict[str, float]]
    ) -> None:
        self.steps[replica] = self.steps.get(replica, 0) + 1
        if not calls:
            self.events.append(("closed", replica))

    def streamed(self) -> None:
        pass


def test_another_models_calls_run_between_the_steps_of_a_long_generation(
    node: GpuWorker,
) -> None:
    long, long_epoch = hot(node, "long")
    short, short_epoch = hot(node, "short")
    encoder, encoder_epoch = hot(node, "encoder")
    ran: list[tuple[int, bool]] = []  # (steps of `long` by then, whether `long` was locked)

    def one_shot() -> None:
        served = node.serve_batch(encoder, encoder_epoch, [("a short call", None)])
        assert not isinstance(served[0], BaseException)
        ran.append((feed.steps.get(long, 0), node.manager.residents[long].lock.locked()))

    def shot() -> OneShot:
        return OneShot(encoder, encoder_epoch, one_shot, lambda error: None)

    prompts = [f"prompt {i}" for i in range(16)]
    feed = _Feed(
        [
            [GenCall("story", prompts, {"max_new_tokens": 100}, replica=long, epoch=long_epoch)],
            [],
            [shot(), GenCall("hi", "hi", {"max_new_tokens": 4}, replica=short, epoch=short_epoch)],
            [shot()],
        ]
    )
    node.serve_session(feed)
    assert isinstance(feed.outcomes["story"], Generated)
    assert isinstance(feed.outcomes["hi"], Generated)
    # The one-shot calls ran while the long generation held its engine, a step or two in.
    assert len(ran) == 2 and all(locked and 0 < steps < 10 for steps, locked in ran), ran
    order = feed.events
    # The short generation ran beside the long one, and gave its replica back at once.
    assert order.index(("finished", "hi")) < order.index(("finished", "story"))
    assert order.index(("closed", short)) < order.index(("finished", "story"))
    assert not node.manager.residents[long].lock.locked()  # every replica given back


def test_a_call_for_a_replica_placed_elsewhere_fails_alone_and_the_session_goes_on(
    node: GpuWorker,
) -> None:
    long, epoch = hot(node, "long")
    feed = _Feed(
        [
            [
                GenCall("fine", "hi", {"max_new_tokens": 8}, replica=long, epoch=epoch),
                GenCall("stale", "hi", {"max_new_tokens": 8}, replica=long, epoch=epoch + 7),
            ]
        ]
    )
    started = time.monotonic()
    node.serve_session(feed)
    assert isinstance(feed.outcomes["stale"], EvictedError)
    assert isinstance(feed.outcomes["fine"], Generated)
    assert time.monotonic() - started < 30


class _Revoking(_Feed):
    """Says call `key` is cancelled (revoked) at its second take."""

    def __init__(self, arrivals: list[list[GenCall | OneShot]], key: str) -> None:
        super().__init__(arrivals)
        self.key, self.takes = key, 0

    def take(self, wait: float) -> list[GenCall | OneShot]:
        self.takes += 1
        return super().take(wait)

    def cancelled(self) -> Iterable[str]:
        return [self.key] if self.takes == 2 else []


def test_a_call_cancelled_while_it_waits_for_its_replica_ends_cancelled_at_once(
    node: GpuWorker,
) -> None:
    # The call waits for its replica's readiness (`Keeper.watch`), as one does while its
    # replica loads; here a replica the ledger does not know, whose watch ends (it is not
    # here: routed again) once the keeper's thread has read the ledger. The cancel comes
    # at the next turn, first: the call ends cancelled, as a revoke ends it in an engine.
    waiting = GenCall("gone", "hi", {"max_new_tokens": 8}, replica="nowhere-1", epoch=1)
    feed = _Revoking([[waiting], []], "gone")
    Session(node.manager.calls, node.keeper, feed).run()
    outcome = feed.outcomes["gone"]
    assert isinstance(outcome, Generated) and outcome.cancelled and outcome.tokens == 0


def test_each_replica_gets_one_pass_a_turn_so_a_flood_of_batches_does_not_stall_a_generation(
    node: GpuWorker,
) -> None:
    long, long_epoch = hot(node, "long")
    encoder, encoder_epoch = hot(node, "encoder")
    ran: list[int] = []  # steps of `long` before each pass

    def pass_() -> None:
        node.serve_batch(encoder, encoder_epoch, [("a call", None)])
        ran.append(feed.steps.get(long, 0))

    flood = [OneShot(encoder, encoder_epoch, pass_, lambda error: None) for _ in range(4)]
    call = GenCall("story", "a prompt", {"max_new_tokens": 40}, replica=long, epoch=long_epoch)
    feed = _Feed([[call], [], flood])
    node.serve_session(feed)
    assert isinstance(feed.outcomes["story"], Generated)
    assert len(ran) == 4 and ran == sorted(set(ran)), ran  # one a turn, a step between each


class _ThreadsFeed(_Feed):
    """A `_Feed` that also records the CPU threads each step of a generation ran on."""

    def __init__(self, arrivals: list[list[GenCall | OneShot]]) -> None:
        super().__init__(arrivals)
        self.threads: list[int] = []

    def stepped(
        self, replica: str, calls: int, held_tokens: int, figures: Callable[[], dict[str, float]]
    ) -> None:
        super().stepped(replica, calls, held_tokens, figures)
        if calls:
            self.threads.append(torch.get_num_threads())


def test_a_small_one_shot_pass_between_two_steps_leaves_the_next_step_the_workers_threads(
    redis_url: str, fleet: str
) -> None:
    registry = Registry.from_url(redis_url, fleet)
    devices = simulated_devices("1x4GiB")
    node = GpuWorker(registry, devices, devices, "h0", "q0", spec_of=CATALOG.get,
                     warm_budget=4 * GiB, lease_ms=3000, threads=2)  # fmt: skip
    node.start()
    threads = torch.get_num_threads()
    try:
        long, long_epoch = hot(node, "long")
        encoder, encoder_epoch = hot(node, "encoder")
        small: list[int] = []  # the threads a small pass ran on

        def pass_() -> None:
            node.serve_batch(encoder, encoder_epoch, [("a call", None)])
            small.append(torch.get_num_threads())

        shots = [OneShot(encoder, encoder_epoch, pass_, lambda error: None) for _ in range(3)]
        call = GenCall("story", "a prompt", {"max_new_tokens": 20}, replica=long, epoch=long_epoch)
        feed = _ThreadsFeed([[call], [], shots])
        node.serve_session(feed)
        assert isinstance(feed.outcomes["story"], Generated)
        assert small == [1, 1, 1]  # a pass that small runs on one (`worker.passes.for_pass`)
        assert feed.threads == [2] * len(feed.threads) and len(feed.threads) >= 10, feed.threads
    finally:
        node.stop()
        registry.client.close()
        torch.set_num_threads(threads)
