"""Tenants' quotas on a real Redis (`placement.ledger.tenancy.quotas`, its Lua scripts): calls take
running slots, wait parked in order or are refused, as a router takes them from its
in-flight list; ended calls free their slots and hand parked ones back."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator

import pytest
import redis

from placement.errors import ConfigError, UnknownTenantError
from placement.ledger.store import Store
from placement.ledger.tenancy import quotas, tenants
from placement.ledger.tenancy.quotas import Entry, member, new_slot


@pytest.fixture
def store(redis_url: str, fleet: str) -> Iterator[Store]:
    found = Store.from_url(redis_url, fleet)
    yield found
    found.client.delete(inflight(found), *(tenants.queue_of(n) for n in ("team-a", "team-b")))
    found.client.close()


def inflight(store: Store) -> str:
    """A router's in-flight list (the broker's, on the same Redis), this test's own."""
    return f"unacked-router-{store.keys.fleet}"


def message(task_id: str) -> bytes:
    """A call's message as a router takes it (its headers name it)."""
    return json.dumps({"body": "", "headers": {"id": task_id, "task": "gpufleet.infer"}}).encode()


class Router:
    """Takes calls of a tenant as a router does: into its in-flight list, then `enter`."""

    def __init__(self, store: Store, tenant: str) -> None:
        self.store, self.tenant = store, tenant
        self.slots: dict[str, str] = {}  # task id -> the member its slot is

    def take(self, task_id: str) -> Entry:
        self.store.client.lpush(inflight(self.store), message(task_id))
        slot = new_slot()
        entry = quotas.enter(
            self.store, self.tenant, task_id, inflight(self.store), message(task_id), slot
        )
        if entry is Entry.IN:
            self.slots[task_id] = member(slot, task_id)
        return entry

    def end(self, *task_ids: str) -> int:
        members = [self.slots.pop(t) for t in task_ids]
        return quotas.leave(self.store, self.tenant, tenants.queue_of(self.tenant), members)

    def handed_back(self) -> list[str]:
        """The calls on the tenant's public queue, in the order a router takes them."""
        raw = self.store.client.lrange(tenants.queue_of(self.tenant), 0, -1)
        return [json.loads(m)["headers"]["id"] for m in reversed(raw)]


def test_calls_past_the_running_slots_wait_in_order_and_take_slots_as_calls_end(
    store: Store,
) -> None:
    tenants.add(store, "team-a", 1, "pw", max_running=2, max_queued=3)
    router = Router(store, "team-a")
    entries = [router.take(f"c{i}") for i in range(1, 7)]
    assert entries == [Entry.IN, Entry.IN, *[Entry.PARKED] * 3, Entry.REFUSED]
    assert sorted(s.task_id for s in quotas.slots(store, "team-a")) == ["c1", "c2"]
    assert quotas.counts(store, "team-a") == (2, 3)
    # parked calls left the router's hands; the refused one stays for it to answer
    assert store.client.lrange(inflight(store), 0, -1) == [
        message(f"c{i}").decode() for i in (6, 2, 1)
    ]

    assert router.end("c1") == 1
    assert router.handed_back() == ["c3"]  # its slot kept for it as it left the parked list
    assert router.end("c2") == 1  # before a router took c3: c4 goes behind it
    assert router.handed_back() == ["c3", "c4"]
    assert quotas.counts(store, "team-a") == (2, 1)
    assert router.take("c3") is Entry.IN  # taken again: the slot kept for it, no second one
    assert quotas.counts(store, "team-a") == (2, 1)
    assert quotas.leave(store, "team-a", tenants.queue_of("team-a"), [router.slots["c3"]]) == 1
    assert quotas.leave(store, "team-a", tenants.queue_of("team-a"), [router.slots["c3"]]) == 0
    assert router.handed_back() == ["c3", "c4", "c5"]


def test_a_task_id_used_again_takes_a_slot_of_its_own(store: Store) -> None:
    tenants.add(store, "team-a", 1, "pw", max_running=1)
    router = Router(store, "team-a")
    assert router.take("same") is Entry.IN
    store.client.lpush(inflight(store), message("same"))  # a second call, the same id
    again = quotas.enter(store, "team-a", "same", inflight(store), message("same"), new_slot())
    assert again is Entry.PARKED
    assert quotas.counts(store, "team-a") == (1, 1)


def test_a_call_s_entry_run_again_after_its_reply_was_lost_keeps_the_slot_it_took(
    store: Store,
) -> None:
    tenants.add(store, "team-a", 1, "pw", max_running=1)
    store.client.lpush(inflight(store), message("once"))
    slot = new_slot()
    args = ("team-a", "once", inflight(store), message("once"), slot)
    assert quotas.enter(store, *args) is Entry.IN
    # the store sends a step again when its reply is lost: the same slot, not a park
    assert quotas.enter(store, *args) is Entry.IN
    assert [s.task_id for s in quotas.slots(store, "team-a")] == ["once"]
    assert quotas.counts(store, "team-a") == (1, 0)


def test_a_new_call_waits_behind_the_parked_ones_even_when_a_slot_is_free(store: Store) -> None:
    tenants.add(store, "team-a", 1, "pw", max_running=1)
    router = Router(store, "team-a")
    assert [router.take(c) for c in ("first", "second")] == [Entry.IN, Entry.PARKED]
    store.client.zrem(store.keys.tenant_running("team-a"), router.slots.pop("first"))
    assert router.take("third") is Entry.PARKED  # a slot is free, but not ahead of "second"
    quotas.leave(store, "team-a", tenants.queue_of("team-a"))  # the sweep's step
    assert router.handed_back() == ["second"]


def test_without_a_running_limit_max_queued_bounds_the_calls_not_answered(store: Store) -> None:
    tenants.add(store, "team-b", 1, "pw", max_queued=2)
    router = Router(store, "team-b")
    assert [router.take(c) for c in ("a", "b", "c")] == [Entry.IN, Entry.IN, Entry.REFUSED]
    router.end("a")
    assert router.take("c") is Entry.IN
    assert quotas.counts(store, "team-b") == (2, 0)  # nothing is ever parked


def test_a_tenant_whose_running_limit_is_gone_gets_every_parked_call_back(store: Store) -> None:
    tenants.add(store, "team-a", 1, "pw", max_running=1)
    router = Router(store, "team-a")
    assert [router.take(c) for c in ("a", "b", "c")] == [Entry.IN, Entry.PARKED, Entry.PARKED]
    tenants.remove(store, "team-a")
    tenants.add(store, "team-a", 1, "pw2")  # added again with no quota
    assert quotas.leave(store, "team-a", tenants.queue_of("team-a")) == 2  # the sweep's step
    assert router.handed_back() == ["b", "c"]
    assert router.take("d") is Entry.IN and "d" not in router.slots.values()


def test_a_quota_changed_holds_from_the_next_call_and_a_raised_limit_hands_calls_back(
    store: Store,
) -> None:
    tenants.add(store, "team-a", 1, "pw", max_running=1)
    router = Router(store, "team-a")
    assert [router.take(c) for c in ("a", "b", "c")] == [Entry.IN, Entry.PARKED, Entry.PARKED]
    changed = tenants.change(store, "team-a", max_running=2, max_queued=1)
    assert (changed.weight, changed.max_running, changed.max_queued) == (1.0, 2, 1)
    assert tenants.records(store)["team-a"] == changed
    assert router.take("d") is Entry.REFUSED  # two parked: past its new max_queued
    assert quotas.leave(store, "team-a", tenants.queue_of("team-a")) == 1  # the sweep's step
    assert router.handed_back() == ["b"]
    with pytest.raises(UnknownTenantError):
        tenants.change(store, "nobody", weight=2)
    with pytest.raises(ConfigError, match="weight"):
        tenants.change(store, "team-a", weight=0)


def test_a_hand_back_that_fails_leaves_the_call_parked(store: Store) -> None:
    tenants.add(store, "team-a", 1, "pw", max_running=1)
    router = Router(store, "team-a")
    assert [router.take(c) for c in ("a", "b")] == [Entry.IN, Entry.PARKED]
    store.client.sadd(tenants.queue_of("team-a"), "not a list")  # the queue key broken
    with pytest.raises(redis.ResponseError, match="WRONGTYPE"):
        router.end("a")
    assert quotas.counts(store, "team-a")[1] == 1
    store.client.delete(tenants.queue_of("team-a"))
    assert quotas.leave(store, "team-a", tenants.queue_of("team-a")) == 1
    assert router.handed_back() == ["b"]


def test_a_call_no_longer_in_flight_is_left_alone(store: Store) -> None:
    tenants.add(store, "team-a", 1, "pw", max_running=1)
    gone = quotas.enter(store, "team-a", "x", inflight(store), message("x"), uuid.uuid4().hex)
    assert gone is Entry.GONE
    assert quotas.counts(store, "team-a") == (0, 0)


def test_a_tenant_s_quotas_are_kept_in_its_record_and_bad_ones_refused(store: Store) -> None:
    added = tenants.add(store, "team-a", 2, "pw", max_running=4, max_queued=100)
    assert tenants.records(store)["team-a"] == added
    assert (added.max_running, added.max_queued, added.limited) == (4, 100, True)
    tenants.remove(store, "team-a")  # its calls still drain under its quota
    assert tenants.records(store)["team-a"].max_running == 4
    for bad in (-1, 2.5, True, tenants.MAX_LIMIT + 1):
        with pytest.raises(ConfigError, match="--max-running"):
            tenants.add(store, "team-b", 1, "pw", max_running=bad)  # type: ignore[arg-type]
    assert not tenants.add(store, "team-b", 1, "pw").limited
