"""Shared fixtures: a real redis-server per session, a client and a fleet per test.

Tests isolate from each other by fleet name: every registry key of a fleet lives under
``gpufleet:{<fleet>}:``, and the `fleet` fixture deletes exactly those keys afterwards.
Nothing here runs FLUSHALL/FLUSHDB, so pointing the suite at a server of your own
with ``GPUFLEET_TEST_REDIS_URL=redis://...`` leaves that server's other data alone.

Tests marked ``gpu`` are skipped unless ``torch.cuda.is_available()``.
"""

from __future__ import annotations

import os
import re
import shutil
import tempfile
import urllib.parse
import uuid
from collections.abc import Iterator

import pytest
import redis

from placement.ledger.keys import BROKER_CLAIM
from placement.server.redis_server import RedisServer

REDIS_URL_ENV = "GPUFLEET_TEST_REDIS_URL"
_HOME = pytest.StashKey[tuple[str, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    """Give the tests a GPUFLEET_HOME of their own before any module reads the settings: a
    fleet the user runs on this machine (its connection file under the real home) must
    never be found, let alone called, by a test."""
    home = tempfile.mkdtemp(prefix="gpufleet-tests-home-")
    config.stash[_HOME] = (home, os.environ.get("GPUFLEET_HOME"))
    os.environ["GPUFLEET_HOME"] = home


def pytest_unconfigure(config: pytest.Config) -> None:
    home, before = config.stash.get(_HOME, ("", None))
    if before is None:
        os.environ.pop("GPUFLEET_HOME", None)
    else:
        os.environ["GPUFLEET_HOME"] = before
    if home:
        shutil.rmtree(home, ignore_errors=True)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The longest files first, then the others marked slow (each starts fleets):
    # `scripts/test.sh` runs two files at a time (pytest-xdist, --dist loadfile), and a
    # long file started last would run alone at the end.
    items.sort(key=_started_first)
    gpu_items = [item for item in items if item.get_closest_marker("gpu") is not None]
    if not gpu_items:
        return  # do not pay for importing torch
    reason = _no_cuda_reason()
    if reason is None:
        return
    skip = pytest.mark.skip(reason=reason)
    for item in gpu_items:
        item.add_marker(skip)


#: The files that took longest on the 2-core test machine, longest first (`--durations=0`,
#: summed per file, 2026-12-01: test_sentinel 164 s, test_supervision 110 s, then 74 down
#: to 34 s). Measured, not derived: reorder when the durations say otherwise. Only the
#: order of the run depends on it.
LONGEST_FILES = (
    "test_sentinel.py",
    "test_supervision.py",
    "test_tenants_fleet.py",
    "test_control.py",
    "test_host_loss.py",
    "test_openai_fleet.py",
    "test_generation_fleet.py",
    "test_transport.py",
    "test_callers_apart.py",
    "test_fleet.py",
    "test_hostile.py",
    "test_chaos.py",
)


def _started_first(item: pytest.Item) -> tuple[int, int]:
    name = item.path.name
    longest = LONGEST_FILES.index(name) if name in LONGEST_FILES else len(LONGEST_FILES)
    return (item.get_closest_marker("slow") is None, longest)


def _no_cuda_reason() -> str | None:
    """Why CUDA tests cannot run here, or None when they can."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken CUDA install
        return f"needs a CUDA device: torch cannot be imported ({exc})"
    if not torch.cuda.is_available():
        return (
            f"needs a CUDA device: torch.cuda.is_available() is False "
            f"(torch {torch.__version__}, CUDA build {torch.version.cuda or 'none'})"
        )
    return None


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """The URL of the test Redis: $GPUFLEET_TEST_REDIS_URL, else a private server."""
    url = os.environ.get(REDIS_URL_ENV)
    if url:
        client = redis.Redis.from_url(url)
        try:
            client.ping()
        except redis.RedisError as exc:
            pytest.exit(f"{REDIS_URL_ENV}={_redact(url)} does not answer PING: {exc}", returncode=4)
        finally:
            client.close()
        yield url
        return
    with RedisServer() as server:
        yield server.url


@pytest.fixture
def redis_client(redis_url: str) -> Iterator[redis.Redis]:
    """A ``decode_responses=True`` client of the test Redis, closed after the test."""
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        yield client
    finally:
        client.close()


@pytest.fixture
def fleet(redis_url: str) -> Iterator[str]:
    """A fleet name of its own for this test; its ``gpufleet:{<fleet>}:*`` keys go after."""
    name = f"t-{uuid.uuid4().hex[:12]}"
    yield name
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    try:
        delete_fleet_keys(client, name)
    finally:
        client.close()


@pytest.fixture
def fleet_elsewhere(redis_url: str) -> Iterator[tuple[str, str]]:
    """The test Redis's next database (0-15) and a fleet name of its own there; its keys
    go after. A second fleet beside `fleet`, with a broker database apart."""
    parts = urllib.parse.urlsplit(redis_url)
    db = (int(parts.path.strip("/") or 0) + 1) % 16
    url = urllib.parse.urlunsplit(parts._replace(path=f"/{db}"))
    name = f"t-{uuid.uuid4().hex[:12]}"
    yield url, name
    client = redis.Redis.from_url(url, decode_responses=True)
    try:
        delete_fleet_keys(client, name)
    finally:
        client.close()


def delete_fleet_keys(client: redis.Redis, fleet: str, batch: int = 500) -> int:
    """Delete every ``gpufleet:{<fleet>}:*`` key with SCAN (never KEYS), and the fleet's
    claim on the database if it still holds it (a fleet killed before it released it);
    return how many keys."""
    if client.get(BROKER_CLAIM) == fleet:
        client.delete(BROKER_CLAIM)
    pattern = f"gpufleet:{{{_glob_escape(fleet)}}}:*"
    deleted = 0
    pending: list[str] = []
    for key in client.scan_iter(match=pattern, count=batch):
        pending.append(key)
        if len(pending) >= batch:
            deleted += int(client.unlink(*pending))
            pending.clear()
    if pending:
        deleted += int(client.unlink(*pending))
    return deleted


def _glob_escape(text: str) -> str:
    """Escape Redis glob specials so a fleet name matches only itself."""
    return re.sub(r"([\\*?\[\]])", r"\\\1", text)


def _redact(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    if parts.password is None:
        return url
    netloc = parts.netloc.rsplit("@", 1)[1]
    user = parts.username or ""
    return urllib.parse.urlunsplit(parts._replace(netloc=f"{user}:***@{netloc}"))


@pytest.fixture(autouse=True)
def offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No test may reach the Hugging Face hub: any attempt fails instead of downloading."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("TRANSFORMERS_OFFLINE", "1")
