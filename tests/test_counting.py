"""A call is counted once: by the first routing that pins or refuses it (docs/metrics.md).

The router's half of `gpufleet.infer` runs here in-process (Celery's `apply`), against a
real Redis whose ledger lists a GPU worker that no process runs: each call is counted,
then handed on to that worker's `gpufleet.run`, which fails here (this process is no GPU
worker). What is counted is what the tests look at. Models are placed beforehand, so no
call places one: a placement's Flower event would wait seconds for a broker there is not.
tests/test_fleet.py checks the same end to end (a call routed again after an eviction,
or after its GPU worker died).
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from celery.app.task import Context
from celery.signals import before_task_publish

import tasks.api
import tasks.serving.gpu  # `gpufleet.run` is registered, as on a GPU worker
from placement.ledger.registry import Registry
from placement.ledger.report import request_report
from placement.policy.state import COUNTS, Demand, Gpu
from tasks import context
from tasks.broker import presence
from tasks.broker.intake import COUNTED_HEADER, LEASE_HEADER
from tasks.serving import leases
from tasks.serving.calls import HOPS_HEADER, Call, counted_of
from tests.fleets import GiB

CATALOG = """
models:
  m: {source: synthetic, task: forward, memory: 1GiB}
  loading: {source: synthetic, task: forward, memory: 1GiB}
  huge: {source: synthetic, task: forward, memory: 20GiB}
"""
COUNTED = {COUNTED_HEADER: True}


@pytest.fixture
def router(
    redis_url: str, fleet: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[Registry]:
    """This process as a router of this test's fleet: one 8 GiB GPU, model "m" HOT on it."""
    catalog = tmp_path / "models.yaml"
    catalog.write_text(CATALOG)
    monkeypatch.setenv("GPUFLEET_REDIS_URL", redis_url)
    monkeypatch.setenv("GPUFLEET_FLEET", fleet)
    monkeypatch.setenv("GPUFLEET_MODELS", str(catalog))
    monkeypatch.setenv("GPUFLEET_ROLE", "router")
    caches = (context.settings, context.registry, context.catalog)
    for cached in caches:
        cached.cache_clear()
    reg = context.registry()
    gpu = Gpu(id="h0:0", host="h0", index=0, name="Sim 8GiB", total=8 * GiB)
    reg.register_worker("w0", "h0", f"{fleet}.q0", [gpu], warm_budget=2 * GiB)
    plan = reg.place(Demand("m", size=GiB), rng=random.Random(0))
    assert reg.confirm(plan.replica, plan.worker, plan.epoch)
    yield reg
    leases.take()
    for cached in caches:
        cached.cache_clear()


def route(model: str, headers: dict[str, Any] | None = None) -> BaseException:
    """Run the router's half of one call, as a message with `headers` would; return how the
    handed-on `gpufleet.run` failed here (or the refusal)."""
    result = tasks.api.infer.apply(args=(model, "x"), headers=headers)
    assert isinstance(result.result, BaseException), result.result
    return result.result


def counts(reg: Registry, model: str) -> dict[str, int]:
    return {k: v for k, v in reg.stats()[model].items() if v}


def test_a_pick_for_a_call_counted_already_counts_nothing(router: Registry) -> None:
    leased = [router.pick("m", path="") for _ in range(3)]
    assert all(lease is not None for lease in leased)  # it leases all the same
    assert router.pick("absent", path="") is None
    stats = router.stats()
    assert stats["m"] == dict.fromkeys(COUNTS, 0)
    assert "absent" not in stats
    with pytest.raises(ValueError, match="unknown path"):
        router.pick("m", path="retry")


def test_a_lease_counts_its_hit_with_its_path_and_a_miss_counts_nothing(router: Registry) -> None:
    for path in ("fast", "fast", "router"):
        assert router.pick("m", path=path) is not None
    assert router.pick("absent", path="fast") is None  # a miss is not a fast call...
    assert router.pick("absent", path="router") is None  # ...and its placement counts it
    router.count("absent", "cold")
    router.count("absent", "busy")  # a try, not a request: no path
    router.count("never", "rejected")
    assert counts(router, "m") == {"hit": 3, "fast": 2, "routed": 1}
    assert counts(router, "absent") == {"cold": 1, "busy": 1, "routed": 1}
    assert counts(router, "never") == {"rejected": 1, "routed": 1}
    fleet = request_report(router.stats())["fleet"]
    assert fleet["fast"] + fleet["routed"] == fleet["requests"] == 5


def test_the_router_counts_a_call_it_routes_first_with_its_outcome_and_path(
    router: Registry,
) -> None:
    router.place(Demand("loading", size=GiB), rng=random.Random(0))  # never confirmed
    route("m")  # HOT: a hit
    route("m", {"redelivered": True})  # its router died before handing it on: routed now
    route("loading")  # its replica is still loading: queued
    refused = route("huge")
    assert type(refused).__name__ == "NeverFitsError"
    assert counts(router, "m") == {"hit": 2, "routed": 2}
    assert counts(router, "loading") == {"queued": 1, "routed": 1}
    assert counts(router, "huge") == {"rejected": 1, "routed": 1}


def test_a_call_routed_again_or_given_back_from_a_dead_workers_queue_is_not_counted_again(
    router: Registry,
) -> None:
    router.place(Demand("loading", size=GiB), rng=random.Random(0))  # never confirmed
    again = {HOPS_HEADER: 1, **COUNTED}  # a GPU worker routed it again: its replica left
    given_back = {**COUNTED, "redelivered": True}  # from a dead GPU worker's queue
    old_sender = {HOPS_HEADER: 2}  # routed again by a worker that sets no counted header
    for headers in (again, given_back, old_sender):
        route("m", headers)  # a hit
        route("loading", headers)  # its replica is still loading: queued
        route("huge", headers)  # refused
    assert router.stats()["m"] == dict.fromkeys(COUNTS, 0)
    assert router.stats()["loading"] == dict.fromkeys(COUNTS, 0)
    assert "huge" not in router.stats()


def test_every_message_of_a_counted_call_says_so_and_a_retry_keeps_it(router: Registry) -> None:
    lease = router.pick("m", path="fast")
    assert lease is not None
    leases.hold(lease)
    fast: dict[str, Any] = {"trace": "t-1"}  # the fast path's message, with a caller's header
    before_task_publish.send(sender="gpufleet.infer", body=None, headers=fast)
    call = Call("m", "x", None, lease.replica, "hot", 0).with_lease(lease)
    handed_on = call.to(lease.queue).options["headers"]
    routed_again = call.rerouted().options["headers"]
    plain: dict[str, Any] = {"trace": "t-2"}  # a client's call the router has not seen
    before_task_publish.send(sender="gpufleet.infer", body=None, headers=plain)
    as_run = [Context({"id": "t", **h}) for h in (fast, handed_on, routed_again, plain)]
    assert [counted_of(request) for request in as_run] == [True, True, True, False]
    retry = tasks.api.infer.signature_from_request(as_run[2], ("m", "x"), {})  # `task.retry`
    assert counted_of(Context({"id": "t", **retry.options["headers"]}))
    assert routed_again[HOPS_HEADER] == 1
    stranded = {"headers": {"task": "gpufleet.infer", "id": "t", **fast}, "properties": {}}
    back = presence.for_router(stranded)["headers"]  # a dead GPU worker's call, for the router
    assert LEASE_HEADER not in back and counted_of(Context({"id": "t", **back}))
