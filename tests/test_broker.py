"""One fleet per broker database: the claim every worker and `gpufleet up` takes.

On the test Redis, under a claim key of each test's own, so a test never meets the
claim of a fleet another test starts.
"""

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Iterator

import pytest
import redis

from placement.errors import BrokerInUseError
from tasks.broker import claim as broker
from tasks.broker.claim import BrokerClaim


@pytest.fixture
def claims(redis_url: str, monkeypatch: pytest.MonkeyPatch) -> Iterator[list[BrokerClaim]]:
    """Claims made by a test (closed after it), on a claim key of its own."""
    key = f"gpufleet:broker-fleet-test-{uuid.uuid4().hex[:12]}"
    monkeypatch.setattr(broker, "CLAIM_KEY", key)
    made: list[BrokerClaim] = []
    yield made
    for claim in made:
        claim.close()
    with redis.Redis.from_url(redis_url) as client:
        client.delete(key)


def claim_of(claims: list[BrokerClaim], url: str, fleet: str) -> BrokerClaim:
    claims.append(BrokerClaim(url, fleet))
    return claims[-1]


def test_a_second_fleet_cannot_claim_a_broker_database_another_fleet_holds(
    redis_url: str, claims: list[BrokerClaim]
) -> None:
    claim_of(claims, redis_url, "blue").take()
    with pytest.raises(BrokerInUseError, match="fleet 'blue'") as refused:
        claim_of(claims, redis_url, "green").take()
    assert "database of its own" in str(refused.value) and "'green'" in str(refused.value)


def test_the_processes_of_one_fleet_share_its_claim_and_renew_it(
    redis_url: str, claims: list[BrokerClaim]
) -> None:
    first, second = claim_of(claims, redis_url, "blue"), claim_of(claims, redis_url, "blue")
    first.take()
    first.client.expire(broker.CLAIM_KEY, 5)  # most of its time gone
    second.take()
    assert 5 < first.client.ttl(broker.CLAIM_KEY) <= broker.CLAIM_TTL_S


def test_only_the_holder_releases_a_claim_and_then_another_fleet_may_take_it(
    redis_url: str, claims: list[BrokerClaim]
) -> None:
    blue, green = claim_of(claims, redis_url, "blue"), claim_of(claims, redis_url, "green")
    blue.take()
    green.release()
    with pytest.raises(BrokerInUseError):
        green.take()
    blue.release()
    green.take()
    assert green.client.get(broker.CLAIM_KEY) == "green"


def test_a_crashed_fleets_claim_lapses(
    redis_url: str, claims: list[BrokerClaim], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(broker, "CLAIM_TTL_S", 1)
    claim_of(claims, redis_url, "blue").take()  # and never renewed nor released
    time.sleep(1.2)
    claim_of(claims, redis_url, "green").take()
    assert claims[-1].client.get(broker.CLAIM_KEY) == "green"


def test_a_renewing_worker_hears_when_another_fleet_took_its_database(
    redis_url: str, claims: list[BrokerClaim], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(broker, "RENEW_EVERY_S", 0.05)
    blue = claim_of(claims, redis_url, "blue")
    blue.take()
    lost: list[BrokerInUseError] = []
    heard = threading.Event()
    blue.keep(lambda exc: (lost.append(exc), heard.set()))
    time.sleep(0.2)
    assert not heard.is_set()  # renewing its own claim is quiet
    blue.client.set(broker.CLAIM_KEY, "green")  # blue's claim lapsed, green took the database
    assert heard.wait(5)
    assert "fleet 'green'" in str(lost[0])
