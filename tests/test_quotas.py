"""Tenants' quotas on a real Redis (`placement.ledger.quotas`, its Lua scripts): calls let
in, parked in order and refused, as a router takes them from its in-flight list."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from placement.errors import ConfigError
from placement.ledger import quotas, tenants
from placement.ledger.quotas import Entry
from placement.ledger.store import Store
from placement.ledger.tenants import Tenant

INFLIGHT = "unacked-router"  # a router's in-flight list (the broker's, on the same Redis)


@pytest.fixture
def store(redis_url: str, fleet: str) -> Iterator[Store]:
    found = Store.from_url(redis_url, fleet)
    yield found
    found.client.delete(INFLIGHT, *(f"t.{n}.celery" for n in ("team-a", "team-b")))
    found.client.close()


def message(task_id: str) -> bytes:
    """A call's message as a router takes it (its headers name it)."""
    return json.dumps({"body": "", "headers": {"id": task_id, "task": "gpufleet.infer"}}).encode()


def take(store: Store, tenant: Tenant, task_id: str) -> Entry:
    """`task_id`'s message taken into the router's in-flight list, then let in or not."""
    store.client.lpush(INFLIGHT, message(task_id))
    return quotas.enter(store, tenant, task_id, INFLIGHT, message(task_id))


def handed_back(store: Store, tenant: Tenant) -> list[str]:
    """The calls on the tenant's public queue, in the order a router takes them."""
    raw = store.client.lrange(tenant.queue, 0, -1)
    return [json.loads(m)["headers"]["id"] for m in reversed(raw)]


def test_calls_past_the_running_slots_wait_in_order_and_take_slots_as_calls_are_answered(
    store: Store,
) -> None:
    team = Tenant("team-a", 1.0, "d", max_running=2, max_queued=3)
    entries = [take(store, team, f"c{i}") for i in range(1, 7)]
    assert entries == [Entry.IN, Entry.IN, *[Entry.PARKED] * 3, Entry.REFUSED]
    assert quotas.running(store, "team-a") == ["c1", "c2"]
    assert quotas.counts(store, "team-a") == (2, 3)
    # parked calls left the router's hands; the refused one stays for it to answer
    assert store.client.lrange(INFLIGHT, 0, -1) == [message("c6").decode(), *(
        message(f"c{i}").decode() for i in (2, 1))]  # fmt: skip

    assert quotas.leave(store, team, ["c1"]) == 1
    assert handed_back(store, team) == ["c3"]  # let in as it left the parked list
    assert quotas.running(store, "team-a") == ["c2", "c3"]
    assert quotas.leave(store, team, ["c2"]) == 1  # before the router took c3: behind it
    assert quotas.leave(store, team, ["c3", "c3"]) == 1  # reported twice: freed once
    assert handed_back(store, team) == ["c3", "c4", "c5"]
    assert quotas.counts(store, "team-a") == (2, 0)
    # the router takes a handed-back call: it is in already, and takes no second slot
    assert take(store, team, "c4") is Entry.IN
    assert quotas.counts(store, "team-a") == (2, 0)


def test_a_new_call_waits_behind_the_parked_ones_even_when_a_slot_is_free(store: Store) -> None:
    team = Tenant("team-a", 1.0, "d", max_running=1)
    assert [take(store, team, c) for c in ("first", "second")] == [Entry.IN, Entry.PARKED]
    store.client.zrem(store.keys.tenant_running("team-a"), "first")  # freed, not yet moved on
    assert take(store, team, "third") is Entry.PARKED  # not ahead of "second"
    quotas.leave(store, team)  # the sweep: parked calls take the free slot, oldest first
    assert handed_back(store, team) == ["second"]
    assert quotas.running(store, "team-a") == ["second"]


def test_without_a_running_limit_max_queued_bounds_the_calls_not_answered(store: Store) -> None:
    team = Tenant("team-b", 1.0, "d", max_queued=2)
    assert [take(store, team, c) for c in ("a", "b", "c")] == [Entry.IN, Entry.IN, Entry.REFUSED]
    quotas.leave(store, team, ["a"])
    assert take(store, team, "c") is Entry.IN
    assert quotas.counts(store, "team-b") == (2, 0)  # nothing is ever parked


def test_a_call_no_longer_in_flight_is_left_alone(store: Store) -> None:
    team = Tenant("team-a", 1.0, "d", max_running=1)
    assert quotas.enter(store, team, "x", INFLIGHT, message("x")) is Entry.GONE
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
