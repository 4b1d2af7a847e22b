"""The HTTP front: OpenAI's API over the fleet, as one asyncio process (Starlette, uvicorn).

Each request becomes one ordinary `gpufleet.infer` call, sent as the project's client
sends it (`tasks.api`), so the router places it, the GPU workers batch it, and Flower and
the metrics count it like any other. The front holds no model and no ledger: it talks to
Redis as the fleet's `caller` user, and may do nothing a caller may not. A tenant's API key
(`gpufleet api-key --tenant NAME`) sends its calls as that tenant's Redis user, to its
queue, under its quotas, its answers read under its key prefix (`Lane`): one tenant's key
reaches no other tenant's calls.

Sending is one async push of the message Celery would send (`tasks.front.sending`), and
waiting never holds a thread: results and streamed text come through the shared readers of
`tasks.front.waiting`, so one process holds thousands of open calls.

A streamed call answers its status only once it has started: the first streamed entry
(200, then server-sent events) or its result (an error has its own status). A client that
goes away cancels its call (`gpufleet.cancel`), so a stream nobody reads stops within a
decode step.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import orjson
import redis
import redis.asyncio
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from placement.catalog.catalog import Catalog
from placement.errors import ConfigError, GpufleetError, UnknownModelError
from placement.ledger import endpoint
from placement.ledger.tenancy import tenants
from placement.server.acl import user_url
from placement.server.tenant_users import read_passwords
from tasks.config import CANCEL, INFER
from tasks.front import fleet_map, sending, shapes
from tasks.front.fleet_map import MapAccess, MapFeed
from tasks.front.keys import KeyFile, tenant_of
from tasks.front.sending import Sender
from tasks.front.shapes import Call, Failure, RequestError
from tasks.front.waiting import Results, Stream, Streams

log = logging.getLogger(__name__)

CALL_TIMEOUT_S = 600.0  # the longest a call may take, as the project's client allows
#: Connections of each of the front's Redis clients: its pushes and its readers.
CONNECTIONS = 2 * sending.PUSHES
MAX_BODY_BYTES = 8 * 1024 * 1024  # a request body above this is refused (413) unread
CANCELS_DEADLINE_S = 5.0  # how long a stopping front gives the cancels it sent to land
RESTARTED = (
    "the call ran again after its worker was lost and wrote other text than it had streamed"
    " (sampling without a seed); send it again, with a seed to make it repeatable"
)
#: The task each endpoint's model must serve.
TASK_OF = {"chat": "text-generation", "completion": "text-generation"}
TASK_OF["embedding"] = "feature-extraction"


@dataclass
class Lane:
    """One tenant's way into the fleet: its calls' sender and readers, signed in as its
    Redis user (the `caller` user for the default tenant), so the front reaches no more of
    the fleet than that tenant may."""

    tenant: str
    redis_url: str  # the fleet's result store, as the tenant's user
    broker_url: str  # the fleet's broker, as the tenant's user
    password: str = ""  # the tenant's, when it opened ("" for the default tenant)
    results: Results = field(init=False)
    streams: Streams = field(init=False)
    sender: Sender = field(init=False)
    #: Cancels sent for callers gone, kept until they are (asyncio holds tasks weakly).
    cancels: set[asyncio.Task[None]] = field(default_factory=set)
    _client: redis.asyncio.Redis = field(init=False)  # its readers'
    _pusher: redis.asyncio.Redis = field(init=False)

    async def start(self) -> None:
        from tasks.app import app

        client = endpoint.parse(self.redis_url).async_client(max_connections=CONNECTIONS)
        broker = endpoint.parse(self.broker_url)
        self._client = self._pusher = client
        if self.broker_url != self.redis_url:
            self._pusher = broker.async_client(max_connections=CONNECTIONS)
        queue = tenants.queue_of(self.tenant)
        self.sender = Sender(app, self._pusher, queue=queue, replicated=broker.watched)
        self.results = Results(client, self.tenant)
        self.streams = Streams(client, self.tenant)
        self.results.start()
        self.streams.start()

    async def stop(self) -> None:
        deadline = time.monotonic() + CANCELS_DEADLINE_S
        while self.cancels and time.monotonic() < deadline:  # sent as clients left
            await asyncio.wait(set(self.cancels), timeout=deadline - time.monotonic())
        if self.cancels:
            log.warning("%d calls were left running: the front stopped", len(self.cancels))
        await self.streams.stop()
        await self.results.stop()
        if self._pusher is not self._client:
            await self._pusher.aclose()
        await self._client.aclose()


@dataclass
class Front:
    """What the front's requests share: the catalog, the keys, and a lane per tenant whose
    key was used (`Lane`), the default tenant's from the start."""

    catalog: Catalog
    keys: KeyFile
    redis_url: str  # the fleet's result store, as the caller user
    broker_url: str  # the fleet's broker, as the caller user
    passwords: Path | None = None  # the tenants' (`tenant_users.PASSWORDS`), if kept here
    #: The fleet's read-only `operator` URL: the map reads with it, and its user, with a
    #: password derived from its own, opens the map (`tasks.front.fleet_map`); None: no map.
    operator_url: str | None = None
    fleet: str = "default"
    started: int = field(default_factory=lambda: int(time.time()))
    lanes: dict[str, Lane] = field(default_factory=dict)
    _opening: asyncio.Lock = field(default_factory=asyncio.Lock)
    #: Lanes replaced (their tenant's password changed), stopping in the background.
    _retiring: set[asyncio.Task[None]] = field(default_factory=set)
    _kept: tuple[tuple[int, int] | None, dict[str, str]] = (None, {})  # passwords, as read
    map_access: MapAccess = field(init=False)
    map_feed: MapFeed | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        self.map_access = MapAccess(self.operator_url)
        if self.operator_url:
            self.map_feed = MapFeed(self.operator_url, self.fleet)

    async def start(self) -> None:
        await self.lane(tenants.DEFAULT)

    async def stop(self) -> None:
        if self.map_feed is not None:
            await self.map_feed.stop()
        await asyncio.gather(*(lane.stop() for lane in self.lanes.values()), *self._retiring)

    async def lane(self, tenant: str) -> Lane:
        """`tenant`'s lane, opened on its first call, and again once the tenant has another
        password (removed and added again)."""
        password = self._password(tenant)
        found = self.lanes.get(tenant)
        if found is not None and found.password == password:
            return found
        async with self._opening:
            found = self.lanes.get(tenant)
            if found is not None and found.password == password:
                return found
            if found is not None:  # its old user is gone: so are the calls it held
                del self.lanes[tenant]
                # Stopped in the background: its stop waits up to CANCELS_DEADLINE_S for
                # the cancels it sent, and neither this call nor another tenant's first
                # (which waits for `_opening`) should wait with it.
                _keep(self._retiring, asyncio.create_task(found.stop()))
            url = self.redis_url
            if tenant != tenants.DEFAULT:
                url = user_url(self.redis_url, tenants.user_of(tenant), password)
            found = Lane(tenant, url, url if tenant else self.broker_url, password)
            await found.start()
            self.lanes[tenant] = found
            if tenant:
                log.info("serving tenant %r", tenant)
        return found

    def _kept_passwords(self) -> dict[str, str]:
        """The tenants' passwords file, read again only when it changed (a stat a call)."""
        if self.passwords is None:
            return {}
        try:
            stat = self.passwords.stat()
            seen: tuple[int, int] | None = (stat.st_mtime_ns, stat.st_size)
        except OSError:
            seen = None
        if seen is None or seen != self._kept[0]:
            self._kept = (seen, read_passwords(self.passwords))
        return self._kept[1]

    def _password(self, tenant: str) -> str:
        """`tenant`'s Redis password, as kept where it was added ("" for the default)."""
        if tenant == tenants.DEFAULT:
            return ""
        tenants.check_name(tenant)
        password = self._kept_passwords().get(tenant)
        if password is None or self.broker_url != self.redis_url:
            raise _Refused(
                Failure(503, f"this API server cannot sign in as tenant {tenant!r}: it keeps "
                "no password for it (the tenant was removed, or added on another machine: "
                "run the API where `gpufleet tenant add` ran), or its broker is not its "
                "result store", "server_error", "tenant_unavailable")
            )  # fmt: skip
        return password


def build(front: Front) -> Starlette:
    """The ASGI app serving `front` under /v1."""

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await front.start()
        try:
            yield
        finally:
            await front.stop()

    def route(
        path: str, handler: Callable[[Front, str, Request], Awaitable[Response]], method: str
    ) -> Route:
        async def endpoint_(request: Request) -> Response:
            try:
                tenant = _authorize(front, request)
                return await handler(front, tenant, request)
            except RequestError as exc:
                return _error(shapes.failure("RequestError", str(exc), exc.param))
            except _Refused as exc:
                return _error(exc.failure)
            except GpufleetError as exc:
                return _error(shapes.failure(type(exc).__name__, str(exc)))

        return Route(path, endpoint_, methods=[method])

    def map_route(path: str, handler: Callable[[MapFeed], Awaitable[Response]]) -> Route:
        async def endpoint_(request: Request) -> Response:
            refused = front.map_access.refusal(request)
            if refused is not None:
                return refused
            assert front.map_feed is not None  # the access refuses without an operator URL
            return await handler(front.map_feed)

        return Route(path, endpoint_, methods=["GET"])

    return Starlette(
        routes=[
            map_route("/map", _map_page),
            map_route("/map/state", _map_state),
            map_route("/map/events", _map_events),
            route("/v1/models", _models, "GET"),
            route("/v1/models/{name:path}", _model, "GET"),
            route("/v1/chat/completions", _chat, "POST"),
            route("/v1/completions", _completion, "POST"),
            route("/v1/embeddings", _embedding, "POST"),
        ],
        lifespan=lifespan,
        exception_handlers={404: _not_found, 405: _not_allowed, 500: _server_error},
    )


async def _map_page(feed: MapFeed) -> Response:
    return Response(fleet_map.page(), media_type="text/html; charset=utf-8",
                    headers=fleet_map.page_headers())  # fmt: skip


async def _map_state(feed: MapFeed) -> Response:
    return Response(await feed.state(), media_type="application/json")


async def _map_events(feed: MapFeed) -> Response:
    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return EventStream(feed.events(), lambda: None, media_type="text/event-stream", headers=headers)


class _Json(JSONResponse):
    """JSON through orjson: an answer's floats and texts, encoded several times faster."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content)


class _Refused(Exception):
    """A request answered with `failure` (OpenAI's error object) instead of a result."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _authorize(front: Front, request: Request) -> str:
    """The tenant whose API key the request carries (`tasks.front.keys.tenant_of`)."""
    scheme, _, key = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        raise _Refused(
            Failure(401, "no API key given: send `Authorization: Bearer KEY` (`gpufleet url "
            "--json` prints the fleet's)", "invalid_request_error", "missing_api_key")
        )  # fmt: skip
    try:
        name = front.keys.name_of(key.strip())
    except ConfigError as exc:  # the operator's to fix; the caller learns no path
        log.error("cannot check API keys: %s", exc)
        raise _Refused(
            Failure(500, "the server cannot read its API keys; see its log", "server_error")
        ) from None
    if name is None:
        raise _Refused(
            Failure(401, "incorrect API key provided; `gpufleet url --json` prints the "
            "fleet's, `gpufleet api-key` makes another", "invalid_request_error",
            "invalid_api_key")
        )  # fmt: skip
    return tenant_of(name)


# --- endpoints ---------------------------------------------------------------------


async def _models(front: Front, _: str, __: Request) -> Response:
    catalog = front.catalog
    names = {}
    for name in catalog:
        adapters = catalog.adapters_of(name)
        names[name] = await asyncio.to_thread(adapters.names) if adapters is not None else []
    return _Json(shapes.models(names, front.started))


async def _model(front: Front, _: str, request: Request) -> Response:
    name = request.path_params["name"]
    spec, adapter = front.catalog.resolve(name)  # UnknownModelError: a 404
    if adapter is None:
        return _Json(shapes.model(name, front.started))
    adapters = front.catalog.adapters_of(spec.name)
    assert adapters is not None  # resolve names adapters of a base that lists them
    await asyncio.to_thread(adapters.path, adapter)  # UnknownAdapterError: a 404
    return _Json(shapes.model(name, front.started, spec.name))


async def _chat(front: Front, tenant: str, request: Request) -> Response:
    call = shapes.chat_call(await _body(request))
    _check_model(front, call)
    return await _generate(await front.lane(tenant), request, call)


async def _completion(front: Front, tenant: str, request: Request) -> Response:
    call = shapes.completion_call(await _body(request))
    _check_model(front, call)
    return await _generate(await front.lane(tenant), request, call)


async def _embedding(front: Front, tenant: str, request: Request) -> Response:
    call = shapes.embedding_call(await _body(request))
    _check_model(front, call)
    lane = await front.lane(tenant)
    task_id, result = await _send(lane, call)
    meta = await _until_answered(lane, request, task_id, result)
    return _Json(shapes.embeddings(call, _outputs(meta)))


async def _generate(lane: Lane, request: Request, call: Call) -> Response:
    """A text-generation call, answered whole or streamed."""
    if not call.stream:
        task_id, result = await _send(lane, call)
        meta = await _until_answered(lane, request, task_id, result)
        return _Json(shapes.answer(call, task_id, _outputs(meta)))
    task_id = _new_id()
    stream = lane.streams.open(task_id)  # before the call: its first entry is not missed
    try:
        task_id, result = await _send(lane, call, task_id)
    except BaseException:
        lane.streams.close(task_id)
        raise
    try:
        first = await _first(lane, request, task_id, stream, result)
    except BaseException:
        _abandon(lane, task_id, result)
        raise
    events = _events(lane, call, task_id, stream, result, first)
    headers = {"Cache-Control": "no-cache"}
    done = functools.partial(_abandon, lane, task_id, result)
    return EventStream(events, done, media_type="text/event-stream", headers=headers)


def _abandon(lane: Lane, task_id: str, result: asyncio.Future[dict[str, Any]]) -> None:
    """A stream's end, however it ended: its reader closed, and its call cancelled unless
    it was answered (its client went away first). Once: later calls find it closed."""
    if lane.streams.close(task_id) and not result.done():
        result.cancel()
        _cancel_soon(lane, task_id)


# --- sending and waiting ------------------------------------------------------------


def _new_id() -> str:
    from celery.utils import uuid

    return str(uuid())


async def _send(
    lane: Lane, call: Call, task_id: str | None = None
) -> tuple[str, asyncio.Future[dict[str, Any]]]:
    """Send `call` as the project's client does (`tasks.api.infer`), its result watched
    first: its task id, and its result's meta to come (`CALL_TIMEOUT_S`)."""
    params = {**call.params, "stream": True} if call.stream else call.params
    task_id = task_id or _new_id()
    try:
        watched = await lane.results.watch(task_id)
    except (redis.RedisError, OSError) as exc:  # the result store is unreachable
        raise _Refused(_unreachable(task_id, exc)) from None
    try:
        await lane.sender.send(INFER, task_id, [call.model, call.inputs, params])
    except GpufleetError:  # a payload that cannot be sent: nothing was
        lane.results.forget(task_id)
        raise
    except BaseException as exc:
        # The broker is unreachable (the caller may try again), or the request ends: the
        # push may have landed before it failed, and its call is cancelled.
        lane.results.forget(task_id)
        _cancel_soon(lane, task_id)
        if isinstance(exc, Exception):
            raise _Refused(_unreachable(task_id, exc)) from None
        raise
    waiting = lane.results.until(task_id, watched, CALL_TIMEOUT_S)
    return task_id, asyncio.ensure_future(waiting)


def _unreachable(task_id: str, exc: BaseException) -> Failure:
    log.warning("could not send call %s: %s", task_id, exc)
    return Failure(
        503, f"the fleet's Redis did not take the call ({type(exc).__name__}); try again "
        "shortly", "server_error", "fleet_unreachable", retry_after=2,
    )  # fmt: skip


def _cancel_soon(lane: Lane, task_id: str) -> None:
    """Cancel `task_id` without waiting (its caller is gone): `tasks.api.cancel`."""

    async def send() -> None:
        try:
            await lane.sender.send(CANCEL, _new_id(), [task_id])
        except Exception as exc:
            log.warning("could not cancel call %s: %s", task_id, exc)

    _keep(lane.cancels, asyncio.ensure_future(send()))


def _keep(tasks: set[asyncio.Task[None]], task: asyncio.Task[None]) -> None:
    tasks.add(task)
    task.add_done_callback(tasks.discard)


async def _until_answered(
    lane: Lane, request: Request, task_id: str, waiting: asyncio.Future[dict[str, Any]]
) -> dict[str, Any]:
    """The call's stored result, or the call cancelled when the client leaves first."""
    gone = asyncio.ensure_future(_disconnect(request))
    left = True
    try:
        await asyncio.wait((waiting, gone), return_when=asyncio.FIRST_COMPLETED)
        left = not waiting.done()
    finally:
        gone.cancel()
        if left:  # the client went away first (or the server stops): the call too
            waiting.cancel()
            _cancel_soon(lane, task_id)
    if left:
        raise _Refused(_gone())
    return _succeeded(lane, task_id, waiting)


async def _disconnect(request: Request) -> None:
    """Returns once the client has gone (its request body was read before)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _succeeded(lane: Lane, task_id: str, waiting: asyncio.Future[dict[str, Any]]) -> dict[str, Any]:
    """The result's meta of a call that succeeded; `_Refused` with its error's status
    otherwise (or a 504 when it did not end in time)."""
    try:
        meta = waiting.result()
    except asyncio.TimeoutError:  # not the builtin one before Python 3.11
        _cancel_soon(lane, task_id)
        raise _Refused(_too_long()) from None
    if meta.get("status") == "SUCCESS":
        return meta
    error = meta.get("result") or {}
    kind = str(error.get("exc_type", "Error"))
    words = error.get("exc_message") or []
    message = " ".join(str(w) for w in words) if isinstance(words, list) else str(words)
    raise _Refused(shapes.failure(kind, message or kind))


def _gone() -> Failure:
    return Failure(499, "the client closed the request", "invalid_request_error")


def _too_long() -> Failure:
    return Failure(
        504, f"the call took over {CALL_TIMEOUT_S:.0f} s and was cancelled", "server_error",
        "timeout",
    )  # fmt: skip


def _outputs(meta: dict[str, Any]) -> dict[str, Any]:
    outputs: dict[str, Any] = meta["result"]["outputs"]
    return outputs


def _check_model(front: Front, call: Call) -> None:
    """A catalog model that serves the endpoint's task (checked here too, for the 404)."""
    try:
        spec, _ = front.catalog.resolve(call.model)  # BASE:ADAPTER: the router splits it
    except UnknownModelError as exc:
        raise _Refused(shapes.failure("UnknownModelError", str(exc), "model")) from None
    if spec.task != TASK_OF[call.kind]:
        raise RequestError(
            f"model {call.model!r} serves {spec.task}; this endpoint needs a "
            f"{TASK_OF[call.kind]} model (GET /v1/models lists them)",
            "model",
        )


async def _body(request: Request) -> Any:
    size = request.headers.get("content-length")
    if size is not None and size.isdigit() and int(size) > MAX_BODY_BYTES:
        raise _Refused(_too_large())
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY_BYTES:
            raise _Refused(_too_large())
    try:
        return json.loads(body)
    except ValueError as exc:
        raise RequestError(f"the request body is not JSON: {exc}") from None


def _too_large() -> Failure:
    return Failure(413, f"the request body is over {MAX_BODY_BYTES} bytes", "invalid_request_error")


# --- streaming ---------------------------------------------------------------------


async def _first(
    lane: Lane,
    request: Request,
    task_id: str,
    stream: Stream,
    result: asyncio.Future[dict[str, Any]],
) -> list[tuple[int, str]]:
    """Until the call has started streaming (its first text) or ended: the text so far.
    A call that failed first is answered with its error's status, not a stream."""
    gone = asyncio.ensure_future(_disconnect(request))
    try:
        while True:
            waits: tuple[asyncio.Future[Any], ...] = (result, gone)
            arrival = None
            if stream.pieces.ended is None and not stream.broken:
                arrival = asyncio.ensure_future(stream.arrived())
                waits = (arrival, *waits)
            try:
                done, _ = await asyncio.wait(
                    waits, timeout=CALL_TIMEOUT_S, return_when=asyncio.FIRST_COMPLETED
                )
            finally:
                if arrival is not None:
                    arrival.cancel()  # an Event's waiter: cancelled, it loses nothing
            if gone.done():
                raise _Refused(_gone())
            if not done:  # nothing in all that time
                raise _Refused(_too_long())
            text = stream.drain()
            if text or result.done():
                break
            # an end (or a broken stream) without text: its result says how it ended
    finally:
        gone.cancel()
    if result.done():
        _succeeded(lane, task_id, result)  # its error, if it failed first
    return text


async def _events(  # noqa: PLR0917 - one call's parts, as `_generate` has them
    lane: Lane,
    call: Call,
    task_id: str,
    stream: Stream,
    result: asyncio.Future[dict[str, Any]],
    first: list[tuple[int, str]],
) -> AsyncIterator[bytes]:
    """The call's server-sent events: its text as it comes, each prompt's finish reason,
    the usage when asked for, then `[DONE]`."""
    given: dict[int, str] = {}
    ended = False

    def event(body: dict[str, Any]) -> bytes:
        return b"data: " + orjson.dumps(body) + b"\n\n"

    def pieces(text: list[tuple[int, str]]) -> list[bytes]:
        out = []
        for index, piece in text:
            out.append(event(shapes.chunk(call, task_id, index, piece, first=index not in given)))
            given[index] = given.get(index, "") + piece
        return out

    try:
        if call.kind == "chat":  # OpenAI's first chunk: the role, no text yet
            yield event(shapes.chunk(call, task_id, 0, "", first=True))
            given[0] = ""
        for out in pieces(first):
            yield out
        while stream.pieces.ended is None and not stream.broken and not result.done():
            arrival = asyncio.ensure_future(stream.arrived())
            try:
                await asyncio.wait((arrival, result), return_when=asyncio.FIRST_COMPLETED)
            finally:
                arrival.cancel()
            # all that came meanwhile, joined: one chunk per prompt, fewer under load
            for out in pieces(_joined(stream.drain())):
                yield out
        for out in pieces(_joined(stream.drain())):
            yield out
        if stream.broken:  # it ran again, with other text: it cannot go on, and is cancelled
            yield event(_restarted().body())
            return
        await asyncio.wait({result})
        try:
            meta = _succeeded(lane, task_id, result)
        except _Refused as exc:  # it failed after it started: OpenAI's error event
            ended = True
            yield event(exc.failure.body())
            return
        outputs = _outputs(meta)
        if _diverged(outputs["texts"], given):  # never end as if the text were whole
            ended = True
            yield event(_restarted().body())
            return
        for index, (whole, reason) in enumerate(
            zip(outputs["texts"], outputs["finish_reasons"], strict=True)
        ):
            rest = whole[len(given.get(index, "")) :]
            if rest:  # what the stream did not carry (it expired, say)
                yield event(shapes.chunk(call, task_id, index, rest, first=index not in given))
            yield event(shapes.chunk(call, task_id, index, None, reason))
        if call.include_usage:
            yield event(shapes.usage_chunk(call, task_id, outputs))
        yield b"data: [DONE]\n\n"
        ended = True
    finally:
        if not ended:
            _abandon(lane, task_id, result)


def _diverged(texts: list[str], given: dict[int, str]) -> bool:
    """Whether the text streamed is not the start of the answer (the call ran again)."""
    return not all(whole.startswith(given.get(i, "")) for i, whole in enumerate(texts))


def _restarted() -> Failure:
    return Failure(500, RESTARTED, "server_error", "stream_restarted")


def _joined(text: list[tuple[int, str]]) -> list[tuple[int, str]]:
    """Consecutive pieces of one prompt as one piece."""
    out: list[tuple[int, str]] = []
    for index, piece in text:
        if out and out[-1][0] == index:
            out[-1] = (index, out[-1][1] + piece)
        else:
            out.append((index, piece))
    return out


class EventStream(StreamingResponse):
    """A streamed response that stops its iterator when the client goes away, on every
    ASGI version (Starlette's own listens only below ASGI 2.4), so the call is cancelled
    at once, not when the next chunk fails to send; then `done` runs, however it ended
    (an iterator cancelled before it started runs no `finally` of its own)."""

    def __init__(self, content: AsyncIterator[bytes], done: Callable[[], None], **kwargs: Any):
        super().__init__(content, **kwargs)
        self._done = done

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            async with anyio.create_task_group() as group:

                async def stream() -> None:
                    with contextlib.suppress(OSError):
                        await self.stream_response(send)
                    group.cancel_scope.cancel()

                group.start_soon(stream)
                await self.listen_for_disconnect(receive)
                group.cancel_scope.cancel()
        finally:
            self._done()


# --- errors --------------------------------------------------------------------------


def _error(failure: Failure) -> Response:
    return _Json(failure.body(), failure.status, headers=failure.headers())


async def _not_found(request: Request, exc: Exception) -> Response:
    return _error(
        Failure(404, f"no such endpoint: {request.url.path}; the API is under /v1",
        "invalid_request_error", "unknown_url")
    )  # fmt: skip


async def _not_allowed(request: Request, exc: Exception) -> Response:
    return _error(
        Failure(405, f"{request.method} is not allowed on {request.url.path}",
        "invalid_request_error", "method_not_allowed")
    )  # fmt: skip


async def _server_error(request: Request, exc: Exception) -> Response:
    log.exception("request %s %s failed", request.method, request.url.path, exc_info=exc)
    return _error(Failure(500, "the server failed on this request; see its log", "server_error"))
