"""Request leases in Celery messages: attached at publish, ended when a call never runs."""

from __future__ import annotations

import multiprocessing
import os
import random
from collections.abc import Iterator

import pytest
from celery.app.task import Context
from celery.signals import before_task_publish, task_revoked

import tasks.api
import tasks.serving.gpu
from placement.ledger.hot import Lease, taker_of
from placement.ledger.registry import Registry
from placement.policy.state import Demand, Gpu, Level
from tasks import context
from tasks.app import app
from tasks.broker.intake import LEASE_HEADER
from tasks.serving import leases
from tests.fleets import GiB
from tests.running import until


@pytest.fixture
def registry(redis_url: str, fleet: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[Registry]:
    """The process's registry (`tasks.context`), pointed at this test's fleet, with one HOT
    replica of model "m"."""
    monkeypatch.setenv("GPUFLEET_REDIS_URL", redis_url)
    monkeypatch.setenv("GPUFLEET_FLEET", fleet)
    for cached in (context.settings, context.registry):
        cached.cache_clear()
    reg = context.registry()
    reg.register_worker(
        "w0", "h0", "q0", [Gpu(id="h0:0", host="", index=0, name="Sim", total=8 * GiB)]
    )
    plan = reg.place(Demand("m", size=GiB), rng=random.Random(0))
    assert reg.confirm(plan.replica, plan.worker, plan.epoch)
    yield reg
    leases.take()
    for cached in (context.settings, context.registry):
        cached.cache_clear()


REGISTERED = (tasks.api.infer, tasks.serving.gpu.run)  # the real tasks, so the signals see them


def held(reg: Registry) -> int:
    (replica,) = reg.snapshot().deployments.values()
    return replica.leases


def pick(reg: Registry) -> Lease:
    lease = reg.pick("m")
    assert lease is not None
    return lease


def test_a_lease_whose_publish_never_happened_ends_at_the_next_hold(registry: Registry) -> None:
    first, second = pick(registry), pick(registry)
    leases.hold(first)
    assert held(registry) == 2
    leases.hold(second)  # the first call's publish failed: nobody will ever finish its lease
    assert held(registry) == 1
    assert leases.take() == second
    assert leases.take() is None


def test_the_publish_hook_adds_the_lease_next_to_the_callers_own_headers(
    registry: Registry,
) -> None:
    lease = pick(registry)
    leases.hold(lease)
    headers = {"trace": "t-1"}
    before_task_publish.send(sender="gpufleet.infer", body=None, headers=headers)
    assert headers["trace"] == "t-1"
    assert leases.from_header("m", headers[LEASE_HEADER]) == Lease(
        lease.id, "m", lease.replica, "", "", {}, lease.deadline_ms, lease.epoch
    )
    assert lease.epoch == 1  # the call carries the placement it pins
    assert leases.take() is None  # attached once, to this message only


def test_other_tasks_publish_without_taking_the_parked_lease(registry: Registry) -> None:
    lease = pick(registry)
    leases.hold(lease)
    headers: dict[str, object] = {}
    before_task_publish.send(sender="gpufleet.status", body=None, headers=headers)
    assert headers == {}
    assert leases.take() == lease


@pytest.mark.parametrize("task", ["gpufleet.infer", "gpufleet.run"])
def test_a_revoked_or_expired_call_ends_its_lease(task: str, registry: Registry) -> None:
    lease = pick(registry)
    request = Context({"id": "t1", "args": ["m", "x"], LEASE_HEADER: leases.header(lease)})
    task_revoked.send(
        sender=app.tasks[task], request=request, terminated=False, signum=None, expired=True
    )
    assert held(registry) == 0


def test_a_malformed_lease_header_is_ignored(registry: Registry) -> None:
    pick(registry)
    request = Context({"id": "t1", "args": ["m"], LEASE_HEADER: {"id": "", "replica": 3}})
    task_revoked.send(sender=app.tasks["gpufleet.infer"], request=request, expired=True)
    assert held(registry) == 1  # nothing a stranger's header names is touched


def test_the_leases_a_dead_takers_processes_took_end_and_the_drain_they_pinned_finishes(
    registry: Registry,
) -> None:
    registry.taker = "deadbeef"  # a worker run's token, as its record holds it
    picked, placed = pick(registry), registry.hold(*_placement(registry))
    assert placed is not None and taker_of(picked.id) == ("deadbeef", os.getpid())
    registry.taker = "deadbeef0"  # another run, whose token begins with the first one's
    other = pick(registry)
    registry.taker = ""
    anonymous = pick(registry)  # a client's: it names no taker
    assert taker_of(anonymous.id) is None
    (replica,) = registry.snapshot().deployments
    assert registry.evict(replica) is Level.DRAINING

    assert registry.end_leases_of("deadbeef", dead=lambda pid: pid != os.getpid()) == 0
    assert registry.end_leases_of("deadbeef", dead=lambda pid: pid == os.getpid()) == 2
    assert registry.end_leases_of("deadbeef") == 0  # once
    assert held(registry) == 2
    registry.finish(other)
    assert registry.snapshot().deployments[replica].level is Level.DRAINING
    assert registry.finish(anonymous) is Level.DROPPING  # the last lease: the drain ends


def test_a_pool_child_as_it_starts_ends_the_leases_its_dead_siblings_took(
    registry: Registry, redis_url: str, fleet: str
) -> None:
    registry.taker = "cafe"
    own = pick(registry)
    sibling = multiprocessing.get_context("spawn").Process(
        target=_pick_and_die, args=(redis_url, fleet, "cafe")
    )
    sibling.start()
    sibling.join(timeout=60)
    assert sibling.exitcode == 0 and held(registry) == 2

    leases._end_lost_siblings()  # what Celery's worker_process_init runs in a new child

    until("the dead sibling's lease ended", lambda: held(registry) == 1)
    registry.finish(own)  # the live process's own lease was the one left
    assert held(registry) == 0


def _pick_and_die(url: str, fleet: str, taker: str) -> None:
    """A pool process of worker run `taker` that leases a replica of "m", then exits."""
    reg = Registry.from_url(url, fleet)
    reg.taker = taker
    assert reg.pick("m") is not None


def _placement(reg: Registry) -> tuple[str, int, str]:
    (d,) = reg.snapshot().deployments.values()
    return d.replica, d.epoch, d.worker
