"""The fast path says once, with its reason, when a call cannot take it (a real Redis)."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest

from placement.ledger.registry import Registry
from placement.policy.state import Gpu
from tasks import context
from tasks.config import ROUTER_QUEUE
from tasks.serving import routing
from tests.fleets import GiB


@pytest.fixture
def client_of(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """This process as a client whose settings come from the environment set by the test."""
    monkeypatch.delenv("GPUFLEET_ROLE", raising=False)
    monkeypatch.setattr(routing, "_told", set())
    context.settings.cache_clear()
    context.registry.cache_clear()
    yield
    context.settings.cache_clear()
    context.registry.cache_clear()


def warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def test_a_client_naming_a_fleet_with_no_worker_is_told_once_to_fix_its_fleet_name(
    client_of: None,
    redis_url: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    monkeypatch.setenv("GPUFLEET_REDIS_URL", redis_url)
    monkeypatch.setenv("GPUFLEET_FLEET", "nobody-runs-this-fleet")
    caplog.set_level(logging.WARNING, logger="tasks.serving.routing")
    for _ in range(3):
        assert routing.route("gpufleet.infer", ("m", "x"), {}, {}) == {"queue": ROUTER_QUEUE}
    (told,) = warnings(caplog)
    assert "fleet 'nobody-runs-this-fleet' has no GPU worker" in told
    assert "GPUFLEET_FLEET" in told


def test_a_miss_in_a_live_fleet_is_told_once_as_a_miss(
    client_of: None, redis_url: str, fleet: str, monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:  # fmt: skip
    monkeypatch.setenv("GPUFLEET_REDIS_URL", redis_url)
    monkeypatch.setenv("GPUFLEET_FLEET", fleet)
    reg = Registry.from_url(redis_url, fleet)
    gpu = Gpu(id="g", host="", index=0, name="Sim", total=8 * GiB)
    reg.register_worker("w0", "h0", "q0", [gpu], warm_budget=GiB)
    caplog.set_level(logging.WARNING, logger="tasks.serving.routing")
    for model in ("a", "b", "a"):
        routing.route("gpufleet.infer", (model, "x"), {}, {})
    (told,) = warnings(caplog)
    assert "a has no HOT replica yet" in told
    reg.client.close()


def test_an_unreachable_registry_is_told_once_and_the_call_keeps_its_default_queue(
    client_of: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setenv("GPUFLEET_REDIS_URL", "redis://127.0.0.1:1/0")
    caplog.set_level(logging.WARNING, logger="tasks.serving.routing")
    for _ in range(2):
        assert routing.route("gpufleet.infer", ("m", "x"), {}, {}) is None
    (told,) = warnings(caplog)
    assert "the registry is unreachable" in told
