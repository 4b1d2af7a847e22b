"""The fast path's leases on a real Redis: `forward.lua` leases a HOT replica and moves a
router's taken message onto its queue in one step, or changes nothing."""

from __future__ import annotations

import json
import random
from collections.abc import Iterator

import pytest
import redis

from placement.ledger.hot import GONE, Forwarded, Handover
from placement.ledger.registry import Registry
from placement.policy.state import Demand, Gpu
from tasks.serving import leases
from tests.fleets import GiB

#: A message as a router's consumer took it, and the same one cut where the lease header's
#: value and the queue's name go (`tasks.broker.transport.QoS._pick` cuts the real ones).
TAKEN = b'{"body": "e30=", "headers": {"id": "call-1"}}'
PARTS = (
    '{"body": "e30=", "headers": {"id": "call-1", "lease": ',
    '}, "properties": {"delivery_info": {"routing_key": ',
    "}}}",
)


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    """A registry with one worker (queue `<fleet>.q0`) holding one HOT replica of "m"."""
    registry = Registry.from_url(redis_url, fleet)
    gpu = Gpu(id="h0:0", host="", index=0, name="Sim", total=8 * GiB)
    registry.register_worker("w0", "h0", f"{fleet}.q0", [gpu])
    plan = registry.place(Demand("m", size=GiB), rng=random.Random(0))
    assert registry.confirm(plan.replica, plan.worker, plan.epoch)
    yield registry
    broker_keys = registry.client.keys(f"{fleet}.*")
    if broker_keys:
        registry.client.delete(*broker_keys)


def taken(reg: Registry, fleet: str) -> Handover:
    """`TAKEN`, pushed into a router's in-flight list, ready to go on; the router takes
    from `<fleet>.calls` and `<fleet>.internal`."""
    inflight = f"{fleet}.inflight.router@h0"
    reg.client.lpush(inflight, TAKEN)
    return Handover(inflight, TAKEN, PARTS, "", (f"{fleet}.calls", f"{fleet}.internal"))


def leases_held(reg: Registry) -> int:
    (replica,) = reg.snapshot().deployments.values()
    return replica.leases


def test_a_forwarded_call_lands_on_its_replicas_queue_with_its_lease_in_one_step(
    reg: Registry, fleet: str
) -> None:
    handover = taken(reg, fleet)
    forwarded = reg.forward("m", handover, path="router")
    assert isinstance(forwarded, Forwarded) and forwarded.lease.queue == f"{fleet}.q0"
    lease = forwarded.lease
    assert reg.client.llen(handover.inflight) == 0
    (raw,) = reg.client.lrange(f"{fleet}.q0", 0, -1)
    message = json.loads(raw)
    carried = leases.from_header("m", message["headers"]["lease"])
    assert carried is not None
    assert (carried.id, carried.replica, carried.deadline_ms, carried.epoch) == (
        lease.id,
        lease.replica,
        lease.deadline_ms,
        lease.epoch,
    )
    assert message["properties"]["delivery_info"]["routing_key"] == f"{fleet}.q0"
    assert leases_held(reg) == 1
    assert reg.stats()["m"]["routed"] == 1


def test_a_message_no_longer_in_flight_is_not_moved_and_takes_no_lease(
    reg: Registry, fleet: str
) -> None:
    handover = taken(reg, fleet)
    reg.client.delete(handover.inflight)  # a sweep gave it back meanwhile
    assert reg.forward("m", handover, path="router") == GONE
    assert reg.client.llen(f"{fleet}.q0") == 0
    assert leases_held(reg) == 0


def test_with_no_hot_replica_the_message_stays_in_flight_and_nothing_is_leased(
    reg: Registry, fleet: str
) -> None:
    handover = taken(reg, fleet)
    assert reg.forward("other", handover) is None
    (replica,) = reg.snapshot().deployments
    reg.evict(replica)
    assert reg.forward("m", handover) is None
    assert reg.client.lrange(handover.inflight, 0, -1) == [TAKEN.decode()]
    assert reg.client.keys(f"{fleet}.q*") == []


def test_a_replica_whose_queue_changed_since_it_was_listed_is_read_again(
    reg: Registry, fleet: str
) -> None:
    assert isinstance(reg.forward("m", taken(reg, fleet)), Forwarded)  # lists the replica
    (replica,) = reg.snapshot().deployments
    reg.client.hset(reg.keys.deployment(replica), "queue", f"{fleet}.q1")
    forwarded = reg.forward("m", taken(reg, fleet))
    assert isinstance(forwarded, Forwarded) and forwarded.lease.queue == f"{fleet}.q1"
    assert reg.client.llen(f"{fleet}.q1") == reg.client.llen(f"{fleet}.q0") == 1


def test_a_forward_that_redis_refuses_changes_nothing(reg: Registry, fleet: str) -> None:
    handover = taken(reg, fleet)
    reg.client.set(f"{fleet}.q0", "a string, not a list")
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        reg.forward("m", handover)
    assert reg.client.lrange(handover.inflight, 0, -1) == [TAKEN.decode()]
    assert leases_held(reg) == 0


def test_a_forward_says_whether_the_routers_lists_were_left_empty(
    reg: Registry, fleet: str
) -> None:
    # the router then blocks for its next call at once, or takes what waits
    first = reg.forward("m", taken(reg, fleet))
    assert isinstance(first, Forwarded) and first.drained
    reg.client.lpush(f"{fleet}.internal", b"a call routed again")
    second = reg.forward("m", taken(reg, fleet))
    assert isinstance(second, Forwarded) and not second.drained
    assert reg.client.llen(f"{fleet}.q0") == 2  # both moved all the same


def test_the_routers_move_says_kept_or_not_ours_and_whether_anything_waits(
    reg: Registry, fleet: str
) -> None:
    from tasks.serving.forwarding import _forward  # the router's `Pick.move`

    handover = taken(reg, fleet)
    assert _forward(reg, "other", "router", [], handover) is None  # no replica: the pool's
    assert _forward(reg, "m", "router", [], handover) is True  # moved; nothing waits
    assert _forward(reg, "m", "router", [], handover) is False  # no longer in flight
    reg.client.lpush(f"{fleet}.calls", b"the next call")
    assert _forward(reg, "m", "router", [], taken(reg, fleet)) is False  # moved; a call waits


def test_half_a_record_among_a_models_replicas_leaves_the_others_to_the_fast_path(
    reg: Registry,
) -> None:
    (healthy,) = reg.snapshot().deployments
    # What a Redis that lost some writes may leave: a replica listed, its record one field.
    reg.client.sadd(reg.keys.model_replicas("m"), "half")
    reg.client.hset(reg.keys.deployment("half"), "last_used", 1)
    lease = reg.pick("m")
    assert lease is not None and lease.replica == healthy


STEPS = ("", "\x06\x163", "\x06\x166", "\x06\x169")  # kombu's priority lists of a queue


def test_a_tenant_s_call_waits_in_its_tenant_s_queue_of_the_worker_only_behind_other_calls(
    reg: Registry, fleet: str
) -> None:
    from dataclasses import replace

    own, mine, theirs = f"{fleet}.q0", f"{fleet}.q0~team-a", f"{fleet}.q0~team-b"

    def forward() -> str:
        before = {q: reg.client.llen(q) for q in (own, mine)}
        handover = replace(
            taken(reg, fleet), tenant="team-a", tenants=("team-a", "team-b"), priorities=STEPS
        )
        assert isinstance(reg.forward("m", handover, path="router"), Forwarded)
        (found,) = [q for q in (own, mine) if reg.client.llen(q) > before[q]]
        message = json.loads(reg.client.lpop(found) or b"{}")
        assert message["properties"]["delivery_info"]["routing_key"] == found
        return found

    assert forward() == own  # nothing waits at the worker: where an idle worker waits
    reg.client.lpush(theirs, "another tenant's call")
    assert forward() == mine  # behind calls that wait: in turn, by its tenant's weight
    reg.client.delete(theirs)
    reg.client.lpush(own, "a call of the default tenant")
    assert forward() == mine
    reg.client.delete(own)
    reg.client.lpush(theirs + STEPS[1], "another tenant's call of a higher priority")
    assert forward() == mine
