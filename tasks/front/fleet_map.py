"""The live placement map: every GPU's memory, split into the replicas that hold it, in a
browser, served by the HTTP front beside OpenAI's API (`GET /map`).

The page (`map.html`, no asset from outside) opens a stream of server-sent events
(`GET /map/events`); each event is the whole map as JSON (`GET /map/state` answers the
same once). One `MapFeed` per front builds it for every viewer: it reads the ledger as
the fleet's read-only `operator` user, again within `REFRESH_S` of each event on the
ledger's events stream (a placement, a load, an eviction, a refusal: `XREAD BLOCK`), and
at least every `REFRESH_S` for the calls and queues, which change without events. Its
records are kept by a `Follower`, as the router's are: a read fetches only the records
the events since the last one name. It
stops reading once nobody has looked for `IDLE_S`. A Redis failover shows as a map marked
stale while the feed retries; the page's EventSource reconnects by itself when the front
restarts.

The map shows every tenant's models, so a tenant's API key does not open it: HTTP basic
auth with the operator user's name and password does (`gpufleet url --json` prints them
under `map`).
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import functools
import hashlib
import hmac
import logging
import re
import time
import urllib.parse
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

import anyio
import orjson
import redis
from starlette.requests import Request
from starlette.responses import Response

from placement.errors import GpufleetError
from placement.ledger import endpoint
from placement.ledger.figures import generation
from placement.ledger.follow import Follower
from placement.ledger.load import placed_replicas, read_loads
from placement.ledger.registry import Registry
from placement.ledger.report import load_report, request_report
from placement.policy.state import RESERVING, Level, Snapshot

log = logging.getLogger(__name__)

#: The longest the map lags the ledger: an event wakes the feed at once, and it reads the
#: calls and queues at least this often (not tuned: the issue's "within a second").
REFRESH_S = 1.0
#: The feed reads again at most this often however fast events come (not tuned: a burst of
#: evictions costs a few reads a second, not one per event), and never spends more than
#: half its time reading (a read of 1,000 GPUs takes about 0.2 s: `bench.map`).
SPACING_S = 0.2
#: The longest the feed waits on one reply: its longest read's wait (`REFRESH_S`) and room.
SOCKET_TIMEOUT_S = REFRESH_S + 5.0
#: The feed stops reading once no page has been open, nor the state asked for, this long.
IDLE_S = 30.0
#: A comment line on an open stream this often, so proxies keep it open while nothing moves.
KEEPALIVE_S = 15.0
#: Events of the ledger's stream the feed shows at most (the newest).
FEED_LENGTH = 100
#: Event kinds the feed leaves out: bookkeeping, not moves of memory.
QUIET = frozenset({"measured", "settled"})
REALM = "gpufleet map"
#: What the map's password is derived from, beside the operator's Redis password.
PASSWORD_CONTEXT = b"gpufleet map password"


@functools.cache
def page() -> bytes:
    """The map's page: one HTML file, its script and styles inline."""
    return resources.files("tasks.front").joinpath("map.html").read_bytes()


@functools.cache
def page_headers() -> dict[str, str]:
    """The page's headers. Its policy lets the browser run only the page's own script (by
    its digest, so an injected one would not run), load nothing from elsewhere, connect
    only to this server, and be framed by no other page."""
    script = re.search(rb"<script>(.*?)</script>", page(), re.S)
    assert script is not None, "map.html has its script inline"
    digest = base64.b64encode(hashlib.sha256(script.group(1)).digest()).decode()
    policy = (
        f"default-src 'none'; script-src 'sha256-{digest}'; style-src 'unsafe-inline'; "
        "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
    )
    return {"Cache-Control": "no-store", "Content-Security-Policy": policy,
            "X-Frame-Options": "DENY"}  # fmt: skip


class MapAccess:
    """Who may open the map: the operator user of the URL the front reads the fleet with,
    by its name and a password derived from its Redis password (HMAC-SHA256), so that
    the one a browser keeps and sends opens the map and nothing else: not the fleet's
    Redis, even where the operator's URL is the fleet's own (compose, a Redis of yours).

    `operator_url` is None when the front was given none (`GPUFLEET_OPERATOR_URL`, or the
    connection file `gpufleet up` writes); then, or when that URL has no password, the map
    is off and says how to turn it on."""

    def __init__(self, operator_url: str | None) -> None:
        self.url = operator_url
        self.user, self.password = "", ""
        if operator_url:
            user, password = _credentials(operator_url)
            self.user = user or "operator"
            if password:
                key = password.encode()
                self.password = hmac.new(key, PASSWORD_CONTEXT, hashlib.sha256).hexdigest()[:32]

    def refusal(self, request: Request) -> Response | None:
        """None when `request` carries the operator's name and password; else the answer."""
        if not self.password:
            return Response(
                "the map is off: this API server reads the fleet with no operator password."
                " Run it where `gpufleet up` runs, or set GPUFLEET_OPERATOR_URL to the URL"
                " `gpufleet status` reads with (the operator user's, with its password).\n",
                503,
                media_type="text/plain",
            )
        scheme, _, encoded = request.headers.get("authorization", "").partition(" ")
        given = b""
        if scheme.lower() == "basic":
            with contextlib.suppress(binascii.Error, ValueError):
                given = base64.b64decode(encoded.strip(), validate=True)
        wanted = f"{self.user}:{self.password}".encode()
        if hmac.compare_digest(given, wanted):
            return None
        return Response(
            "the map needs the fleet operator's name and password (`gpufleet url --json`"
            ' prints them under "map"); an API key does not open it.\n',
            401,
            headers={"WWW-Authenticate": f'Basic realm="{REALM}", charset="UTF-8"'},
            media_type="text/plain",
        )


class MapFeed:
    """The map as JSON, read again on the ledger's events and kept for every viewer."""

    def __init__(self, operator_url: str, fleet: str) -> None:
        self._url = operator_url
        self._fleet = fleet
        self._registry: Registry | None = None
        self._follower: Follower  # the ledger as of the last read, kept by its events
        self._latest = b""
        self._changed = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._viewers = 0
        self._asked = 0.0
        self._cursor = ""  # the last event read ("": none yet)
        self._feed: list[dict[str, Any]] = []
        self._calls: dict[str, tuple[float, int]] = {}  # model -> (when, requests) last read

    async def state(self) -> bytes:
        """The map as the feed last read it (starting the feed, and waiting for its first
        read, when nobody was looking)."""
        self._asked = time.monotonic()
        self._ensure()
        if not self._latest:
            await self._changed.wait()
        return self._latest

    async def events(self) -> AsyncIterator[bytes]:
        """Server-sent events: the map now, then again at each change."""
        self._viewers += 1
        try:
            self._ensure()
            if not self._latest:
                await self._changed.wait()
            sent = b""
            while True:
                if self._latest is not sent:  # published while this one was sending
                    sent = self._latest
                    yield b"data: " + sent + b"\n\n"
                    continue
                try:
                    await asyncio.wait_for(self._changed.wait(), KEEPALIVE_S)
                except asyncio.TimeoutError:
                    yield b": still here\n\n"
        finally:
            self._viewers -= 1
            self._asked = time.monotonic()

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    def _ensure(self) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._run())

    def _publish(self, state: dict[str, Any]) -> None:
        """Keep `state` for every viewer, and wake them, unless it is the map they have."""
        latest = orjson.dumps(state)
        if latest == self._latest:
            return
        self._latest = latest
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    async def _run(self) -> None:
        """Read, publish, wait for an event or `REFRESH_S`; until nobody looks, and then
        forget the map, which goes stale from then on."""
        try:
            await self._follow()
        finally:
            self._latest = b""

    async def _follow(self) -> None:
        while self._viewers or time.monotonic() - self._asked < IDLE_S:
            began = time.monotonic()
            pause = SPACING_S
            try:
                self._publish(await anyio.to_thread.run_sync(self.read))
                pause = max(SPACING_S, 2 * (time.monotonic() - began))  # at most half the time
                await anyio.to_thread.run_sync(self._wait_event)
            except Exception as exc:  # one bad read must not end the map
                why = f"the fleet's Redis does not answer: {exc}"
                if isinstance(exc, redis.RedisError | GpufleetError | OSError):
                    log.warning("the map cannot read the fleet: %s", exc)
                else:
                    why = f"the map's read failed (see the API server's log): {exc}"
                    log.exception("the map's read failed")
                stale = orjson.loads(self._latest) if self._latest else _empty(self._fleet)
                stale.update(ok=False, error=why)
                self._publish(stale)
                await asyncio.sleep(REFRESH_S)
            await asyncio.sleep(max(0.0, pause - (time.monotonic() - began)))

    def _client(self) -> Registry:
        """The registry as the operator reads it; a read that waits on a Redis gone quiet
        (a partition, not a refusal) gives up after `SOCKET_TIMEOUT_S`, so the map says so."""
        if self._registry is None:
            found = endpoint.parse(self._url)
            client = found.client(decode_responses=True, socket_timeout=SOCKET_TIMEOUT_S)
            self._registry = Registry(client, self._fleet)
            self._registry.outage_s = found.outage_s or self._registry.outage_s
            self._follower = Follower(self._registry)
        return self._registry

    def _wait_event(self) -> None:
        """Return at the next event on the ledger's stream, or after `REFRESH_S`."""
        registry = self._client()
        stream = registry.keys.events
        registry.client.xread({stream: self._cursor or "$"}, count=1, block=int(REFRESH_S * 1000))

    def read(self) -> dict[str, Any]:
        """The map as the ledger holds it now (blocking: the feed runs it in a thread)."""
        registry = self._client()
        self._read_feed(registry)
        with self._follower.current() as snap:  # reads the records the events since name
            placed = placed_replicas(snap.deployments.values(), snap.by_model)
            loads = load_report(read_loads(registry, placed))
            requests = request_report(registry.stats(snap))["models"]
            kv = generation.kv_held(registry, list(snap.deployments))
            return {
                "ok": True,
                "error": None,
                "fleet": self._fleet,
                "hosts": _hosts(snap, loads, kv),
                "models": self._models(snap, loads, requests),
                "feed": self._feed,
            }

    def _read_feed(self, registry: Registry) -> None:
        """The newest `FEED_LENGTH` events, newest first, read on from the last one."""
        stream = registry.keys.events
        since = f"({self._cursor}" if self._cursor else "-"  # the newest, however many came
        found = list(reversed(registry.client.xrevrange(stream, "+", since, count=FEED_LENGTH)))
        if not found:
            if not self._cursor:
                self._cursor = "0-0"
            return
        self._cursor = found[-1][0]
        rows = [_event(at, fields) for at, fields in found]
        rows = [row for row in rows if row["kind"] not in QUIET]
        self._feed = ([*reversed(rows), *self._feed])[:FEED_LENGTH]

    def _models(
        self, snap: Snapshot, loads: dict[str, Any], requests: dict[str, Any]
    ) -> list[dict[str, Any]]:
        """Per model: its replicas by level, calls waiting and running, and calls a second
        since the last read."""
        now = time.monotonic()
        rows = []
        for model in sorted(set(snap.by_model) | set(loads) | set(requests)):
            levels: dict[str, int] = {}
            for dep in snap.by_model.get(model, ()):
                levels[dep.level.value] = levels.get(dep.level.value, 0) + 1
            load = loads.get(model, {})
            done = int(requests.get(model, {}).get("requests", 0))
            when, before = self._calls.get(model, (now, done))
            self._calls[model] = (now, done)
            rate = (done - before) / (now - when) if now > when else 0.0
            rows.append(
                {
                    "name": model,
                    "levels": levels,
                    "waiting": load.get("waiting", 0) + load.get("routing", 0),
                    "running": load.get("running", 0),
                    "per_second": round(max(0.0, rate), 2),
                }
            )
        return rows


def _hosts(snap: Snapshot, loads: dict[str, Any], kv: dict[str, Any]) -> list[dict[str, Any]]:
    """Each host: its GPUs (their replicas, free room and the process cap) and its warm
    cache's copies."""
    running = {
        replica: figures["in_flight"]
        for load in loads.values()
        for replica, figures in load["replicas"].items()
    }
    on_gpu: dict[str, list[dict[str, Any]]] = {g: [] for g in snap.gpus}
    # the worker process's cap on each GPU: what its placed replicas may use there (a
    # single-GPU replica's admission limit, else its reservation): torch's per-process
    # fraction
    caps: dict[str, int] = dict.fromkeys(snap.gpus, 0)
    warm: dict[str, list[dict[str, Any]]] = {}
    for dep in sorted(snap.deployments.values(), key=lambda d: (d.model, d.replica)):
        if dep.level is Level.WARM:
            warm.setdefault(dep.host, []).append(
                {"model": dep.model, "replica": dep.replica, "bytes": dep.cached}
            )
            continue
        held = kv.get(dep.replica, {})
        for gpu_id, size in dep.gpus.items():
            if gpu_id not in on_gpu:
                continue
            if dep.level in RESERVING:
                caps[gpu_id] += max(size, dep.limit if len(dep.gpus) == 1 else 0)
            on_gpu[gpu_id].append(
                {
                    "model": dep.model,
                    "replica": dep.replica,
                    "level": dep.level.value,
                    "bytes": size,
                    "calls": running.get(dep.replica, dep.leases),
                    "kv_tokens": int(held.get("held_tokens", 0)),
                    "kv_blocks": int(held.get("blocks_in_use", 0)),
                }
            )
    hosts: dict[str, dict[str, Any]] = {}
    for name, host in snap.hosts.items():
        hosts[name] = {
            "name": name,
            "warm_budget": host.warm_budget,
            "warm_used": host.warm_used,
            "warm": warm.get(name, []),
            "gpus": [],
        }
    for gpu in sorted(snap.gpus.values(), key=lambda g: (g.host, g.index, g.id)):
        row = hosts.setdefault(
            gpu.host, {"name": gpu.host, "warm_budget": 0, "warm_used": 0, "warm": [], "gpus": []}
        )
        replicas = on_gpu[gpu.id]
        row["gpus"].append(
            {
                "id": gpu.id,
                "index": gpu.index,
                "name": gpu.name,
                "total": gpu.total,
                "reserved": gpu.reserved,
                "free": gpu.free,
                "cap": caps[gpu.id],
                "alive": gpu.alive(snap.now_ms),
                "replicas": replicas,
            }
        )
    return [hosts[name] for name in sorted(hosts)]


def _event(at: str, fields: dict[str, str]) -> dict[str, Any]:
    """One ledger event as the feed shows it: when (its id's milliseconds: the registry's
    clock), what, of which model and replica (or which worker), and why."""
    row = dict(fields)  # the registry's client decodes replies
    why = ": ".join(row[k] for k in ("cause", "outcome", "why") if row.get(k))
    if row.get("to"):
        why = f"{why} (to {row['to']})" if why else f"to {row['to']}"
    return {
        "at": int(at.partition("-")[0]),
        "kind": row.get("kind", ""),
        "model": row.get("model") or row.get("worker", ""),  # a worker's own events name it
        "replica": row.get("replica", ""),
        "why": why,
    }


def _credentials(url: str) -> tuple[str, str]:
    """The user and password a fleet Redis URL signs in with ("" for none)."""
    found = endpoint.parse(url)
    if found.watched:  # a Sentinel URL: its parts agree on them (`endpoint.parse`)
        return found.username or "", found.password or ""
    parts = urllib.parse.urlsplit(url)
    return urllib.parse.unquote(parts.username or ""), urllib.parse.unquote(parts.password or "")


def _empty(fleet: str) -> dict[str, Any]:
    return {"ok": False, "error": None, "fleet": fleet, "hosts": [], "models": [], "feed": []}
