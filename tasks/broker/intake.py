"""What a gpufleet worker checks in each message it takes, before anything can raise
outside a task.

A Celery worker's main process parses each message, builds its request and hands it to
the pool (pickling it) or, on a router, forwards it. An exception there is no task's
failure: it stops the worker ("Unrecoverable error"), the message goes back first in line,
and the worker's successor takes it and stops again. So a message is checked in two
steps, and one that fails either is refused: its caller gets a `PayloadError` (or the
`GpufleetError` that says what is wrong) as its result, and the message is dropped.

1. `envelope`, in the transport, as the message is taken: its size, that it parses, how
   deep it nests, and the types of the fields kombu and Celery read. It also makes the
   message say the truth about where it came from (`delivery_info`: a publisher may write
   anything there, and restores follow it), and takes every `gpufleet_*` header off a
   message taken from a public queue: those headers (leases, re-route counts, "counted")
   are the fleet's own, and a caller may not set them.
2. `check`, in the consumer, before Celery's strategy (and, on a router, before a hot
   call is forwarded): Celery's protocol-2 headers, the task name (a public queue takes
   only `PUBLIC_TASKS`), the arguments against the task's signature (a task's `intake`),
   what only the fleet may ask for (a task's `caller_intake`, for a public queue's
   message), a call's model and payload, and every field of the fleet's internal messages.

Public queues are those any caller may write (`celery`, the router's); the fleet's other
queues (the router's `gpufleet.router`, GPU workers' `gpufleet.<host>.gpuN`) are written by
fleet processes only, which the bundled Redis's users enforce (docs/deploy.md,
"Security").
"""

from __future__ import annotations

import inspect
import math
import re
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import orjson
from kombu.utils.json import dumps, loads

from placement.errors import GpufleetError, PayloadError, describe
from placement.ledger.tenancy.tenants import (
    DEFAULT,
    ID_SEP,
    ID_SUFFIX,
    call_id,
    owner,
    tenant_of,
)
from tasks import context
from tasks.config import PUBLIC_QUEUES, PUBLIC_TASKS, is_public

#: The prefix of the headers only fleet processes may set, and those headers: a call's
#: request lease (`tasks.serving.leases`), whether its outcome is counted already, and how many
#: times it was routed again (`tasks.serving.calls`).
FLEET_HEADERS = "gpufleet_"
LEASE_HEADER = "gpufleet_lease"
#: Set on every message of a call whose outcome is counted already (docs/metrics.md): the
#: fast path's, attached with its lease (the client's `pick` counted the call), and every
#: message bound for a GPU worker or routed again (`tasks.serving.calls`). A retry keeps its
#: headers, and so does a call given back from a dead GPU worker's queue to the router,
#: so the router never counts such a call again.
COUNTED_HEADER = "gpufleet_counted"
HOPS_HEADER = "gpufleet_hops"
#: The tenant whose public queue a call came from (`placement.ledger.tenancy.tenants`), which the
#: router writes as it takes it; absent for the default tenant.
TENANT_HEADER = "gpufleet_tenant"
#: The running slot a call of a tenant with quotas holds until it ends, which the router
#: gave it (`placement.ledger.tenancy.quotas`); absent for calls no quota holds.
SLOT_HEADER = "gpufleet_slot"
#: How deeply a message's headers, properties and arguments may nest. Celery's own
#: canvases (a chain of chords) stay under 12; pickling a request for the pool fails
#: near 500 (the interpreter's recursion limit, less the consumer's own frames).
MAX_DEPTH = 32
#: The largest message taken, in bytes. A call at its inputs' limit
#: (`worker.handlers`: 64 strings of 8192 characters), every character escaped by JSON
#: (6 bytes) and base64-encoded (4/3), takes 4.2 MB; twice that leaves room for headers
#: and for the `gpufleet.run` that carries the same inputs on.
MAX_MESSAGE_BYTES = 8 * 2**20
#: The longest id, name or delivery tag a message may carry.
MAX_NAME = 256
#: The longest task id a caller may give: the fleet's id of its call, with its tenant
#: (`tenants.call_id`), is then at most `MAX_NAME`.
MAX_CALLER_ID = MAX_NAME - ID_SUFFIX
#: The most signatures a caller's callbacks, chain and chord may hold in all. Each step a
#: worker ends sends the rest of the chain on in the next message, so a chain costs the
#: fleet its length squared; Celery's own canvases of a few steps stay far below.
MAX_CANVAS = 16


def redelivered(carrier: Any) -> bool:
    """Whether the broker gave `carrier` (a Celery request or a kombu message) back: marked
    delivered again (`mark_redelivered`), so it may have run before."""
    return bool((getattr(carrier, "delivery_info", None) or {}).get("redelivered"))


def mark_redelivered(payload: dict[str, Any]) -> None:
    """Mark a message's payload delivered again, as kombu marks a message it restores."""
    headers = payload.get("headers")
    if isinstance(headers, dict):
        headers["redelivered"] = True
    info = (payload.get("properties") or {}).get("delivery_info")
    if isinstance(info, dict):
        info["redelivered"] = True


def is_name(value: Any, *, empty: bool = False) -> bool:
    """Whether `value` is an id or name a message may carry: a string of at most
    `MAX_NAME` characters (empty only where `empty` says it may be)."""
    return isinstance(value, str) and (empty or bool(value)) and len(value) <= MAX_NAME


def is_call_id(value: Any) -> bool:
    """Whether `value` may be the fleet's id of a call: a caller's task id of at most
    `MAX_NAME` characters, named by its tenant (`tenants.call_id`)."""
    return isinstance(value, str) and 0 < len(value) <= MAX_NAME + ID_SUFFIX


def is_count(value: Any) -> bool:
    """Whether `value` is a whole number from 0 that fits a Redis integer (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < 2**63


_CELERY_HEADERS: dict[str, Callable[[Any], bool]] = {
    "task": lambda v: v is None or is_name(v),
    "id": lambda v: v is None or is_name(v),
    "lang": lambda v: v is None or isinstance(v, str),
    "root_id": lambda v: v is None or is_name(v),
    "parent_id": lambda v: v is None or is_name(v),
    "group": lambda v: v is None or is_name(v),
    "shadow": lambda v: v is None or is_name(v),
    "group_index": lambda v: v is None or is_count(v),
    "retries": lambda v: v is None or is_count(v),
    "replaced_task_nesting": lambda v: v is None or is_count(v),
    "eta": lambda v: v is None or isinstance(v, str),
    "expires": lambda v: v is None or isinstance(v, str),
    "timelimit": lambda v: v is None or _time_limits(v),
    "argsrepr": lambda v: v is None or isinstance(v, str),
    "kwargsrepr": lambda v: v is None or isinstance(v, str),
    "origin": lambda v: v is None or isinstance(v, str),
    "ignore_result": lambda v: v is None or isinstance(v, bool),
    "redelivered": lambda v: v is None or isinstance(v, bool),
    "stamped_headers": lambda v: v is None or _names(v),
    "stamps": lambda v: v is None or isinstance(v, dict),
}
_PROPERTIES: dict[str, Callable[[Any], bool]] = {
    "delivery_tag": is_name,
    "body_encoding": lambda v: v is None or v == "base64",
    "priority": lambda v: v is None or (is_count(v) and v <= 255),
    "delivery_mode": lambda v: v is None or is_count(v),
    "correlation_id": lambda v: v is None or is_name(v),
    "reply_to": lambda v: v is None or is_name(v),
    "delivery_info": lambda v: v is None or isinstance(v, dict),
}


class Refused(Exception):
    """A message that may not be taken, and why (`task_id` when it could be read)."""

    def __init__(self, why: str, task_id: str | None = None) -> None:
        super().__init__(why)
        self.why = why
        self.task_id = task_id


def envelope(item: bytes | str, queue: str) -> dict[str, Any]:
    """The message `item`, taken from `queue`, checked and made truthful (step 1 of the
    module); raises `Refused`."""
    tenant = (tenant_of(queue) or DEFAULT) if is_public(queue) else None  # None: a fleet queue
    if len(item) > MAX_MESSAGE_BYTES:
        raise Refused(
            f"the call's message is {len(item):,} bytes, over the limit of "
            f"{MAX_MESSAGE_BYTES:,}; send fewer or shorter inputs per call",
            _named(_id_of_large(item), tenant),
        )
    try:
        payload = parse(item)
    except Exception as exc:  # broken JSON, or nested past the parser's recursion limit
        raise Refused(f"the call's message is not JSON ({type(exc).__name__})") from None
    if not isinstance(payload, dict):
        raise Refused(f"the call's message is {describe(payload)}, not a JSON object")
    headers = payload.get("headers")
    task_id = headers.get("id") if isinstance(headers, dict) else None
    task_id = _named(task_id if is_name(task_id) else None, tenant)
    if too_deep({k: v for k, v in payload.items() if k != "body"}, MAX_DEPTH):
        raise Refused(f"the call's headers nest deeper than {MAX_DEPTH} levels", task_id)
    problem = _envelope_problem(payload)
    if problem:
        raise Refused(f"the call's message is malformed: {problem}", task_id)
    assert isinstance(headers, dict)
    properties = payload["properties"]
    info = properties.get("delivery_info")
    given_back = info.get("redelivered") if isinstance(info, dict) else None
    # Where it came from, truly (restores and the consumer's checks follow it).
    properties["delivery_info"] = {"exchange": "", "routing_key": queue}
    if tenant is not None:  # a public queue's
        for name in [n for n in headers if isinstance(n, str) and n.startswith(FLEET_HEADERS)]:
            del headers[name]
        if tenant != DEFAULT:  # known by the queue it may write, never by what it says
            headers[TENANT_HEADER] = tenant
        if task_id is not None:  # its own among every tenant's (`tenants.call_id`)
            if len(headers["id"]) > MAX_CALLER_ID:
                raise Refused(
                    f"the call's task id is longer than {MAX_CALLER_ID} characters; send a "
                    f"shorter one (a UUID, as Celery makes)",
                    task_id,
                )
            headers["id"] = task_id
    if given_back is True:
        properties["delivery_info"]["redelivered"] = True
    return payload


def as_sent(payload: dict[str, Any], queue: str) -> dict[str, Any]:
    """`payload`, which `envelope` took from `queue`, as its caller sent it when that is a
    public queue: under the task id its caller gave. What goes back onto a public queue
    (a restore, a give-back) goes back so, and the router names it again as it takes it."""
    headers = payload.get("headers")
    if not is_public(queue) or not isinstance(headers, dict):
        return payload
    task_id = headers.get("id")
    if not isinstance(task_id, str):
        return payload
    return {**payload, "headers": {**headers, "id": owner(task_id)[0]}}


def _named(task_id: str | None, tenant: str | None) -> str | None:
    """The fleet's id of call `task_id` taken from `tenant`'s public queue (None: a fleet
    queue, whose calls the fleet named already)."""
    if task_id is None or tenant is None:
        return task_id
    return call_id(task_id, tenant)


def parse(item: bytes | str) -> Any:
    """A message's JSON, as kombu's parser reads it: by orjson (a fifth of the time, on the
    router's hot path) where both read it alike (`_by_orjson`)."""
    raw = item.encode() if isinstance(item, str) else item
    read, value = _by_orjson(raw)
    _last.read = (raw, read)  # one assignment: another thread never sees half of it
    return value if read else loads(item)  # type: ignore[no-untyped-call]


def dump(payload: Any, taken: bytes) -> str:
    """`payload`, read by `parse` from message `taken`, as JSON again, as kombu writes it:
    by orjson exactly where `parse` read `taken` with it (so every value is JSON's own).
    The consumer dumps the message it parsed last, whose verdict `parse` kept: it is not
    read a second time on the router's hot path."""
    last = _last.read
    by_orjson = last[1] if last is not None and last[0] is taken else _by_orjson(taken)[0]
    if by_orjson:
        try:
            return orjson.dumps(payload).decode()
        except TypeError:  # not JSON's own after all: kombu's writer says what it is
            pass
    text: str = dumps(payload)  # type: ignore[no-untyped-call]
    return text


#: What orjson reads otherwise than kombu's parser: kombu's typed values (a datetime, a
#: UUID: only kombu turns them back into objects; an escaped printable character could
#: spell their key), NaN and infinities (orjson refuses them, and would write null), and
#: integers past 64 bits (orjson reads floats). Lone surrogates and numbers too large for
#: a float make orjson refuse the text.
_KOMBU_ONLY = (b'"__type__"', b"NaN", b"Infinity")
_KOMBU_ONLY_RE = re.compile(rb"[0-9]{19}|\\u00[2-7][0-9a-fA-F]")


class _LastRead:
    """The message `parse` read last, and whether orjson read it (`dump` asks)."""

    read: tuple[bytes, bool] | None = None


_last = _LastRead()


def _by_orjson(raw: bytes) -> tuple[bool, Any]:
    """(True, orjson's reading of `raw`) where kombu's parser reads it alike, else
    (False, None)."""
    if any(word in raw for word in _KOMBU_ONLY) or _KOMBU_ONLY_RE.search(raw):
        return False, None
    try:
        return True, orjson.loads(raw)
    except orjson.JSONDecodeError:
        return False, None


def _envelope_problem(payload: dict[str, Any]) -> str:
    """What is wrong with the fields kombu and Celery read, or "" when nothing is."""
    properties, headers = payload.get("properties"), payload.get("headers")
    if not isinstance(properties, dict):
        return "its properties are no JSON object"
    if not isinstance(headers, dict):
        return "its headers are no JSON object"
    if not isinstance(payload.get("body"), str):
        return "its body is no string"
    for field in ("content-type", "content-encoding"):
        if not isinstance(payload.get(field), (str, type(None))):
            return f"its {field} is {describe(payload.get(field))}"
    for name, fits in _PROPERTIES.items():
        if not fits(properties.get(name)):
            return f"property {name} is {describe(properties.get(name))}"
    for name, fits in _CELERY_HEADERS.items():
        if not fits(headers.get(name)):
            return f"header {name} is {describe(headers.get(name))}"
    return ""


def check(message: Any, tasks: Any) -> None:
    """Step 2 of the module for a message the transport took: raise the `GpufleetError`
    its caller should get, or return when it may run. `tasks` is the app's task registry.
    A message's verdict is kept on it, so the router's forwarder and Celery's strategy
    check it once."""
    verdict = getattr(message, "_gpufleet_verdict", None)
    if verdict is None:
        try:
            _check(message, tasks)
            verdict = ()
        except GpufleetError as exc:
            verdict = (exc,)
        except Exception as exc:  # nothing a caller sends may raise past this point
            verdict = (PayloadError(f"gpufleet could not read this call ({type(exc).__name__})"),)
        message._gpufleet_verdict = verdict
    if verdict:
        raise verdict[0]


def _check(message: Any, tasks: Any) -> None:
    headers = message.headers
    name = headers.get("task")
    if name is None or headers.get("id") is None:
        raise PayloadError(
            "gpufleet takes Celery's message protocol 2 only (the default since Celery 4): "
            "send the call with a Celery client, protocol 2"
        )
    public_queue = is_public((message.delivery_info or {}).get("routing_key"))
    if public_queue and name.startswith("gpufleet.") and name not in PUBLIC_TASKS:
        raise PayloadError(
            f"{name} is the fleet's own task and runs only when the fleet sends it; callers "
            f"send one of {', '.join(PUBLIC_TASKS)}"
        )
    task = tasks.get(name)
    if task is None:
        return  # Celery's unknown-task path answers it
    try:
        args, kwargs, embed = message.decode()
    except Exception as exc:  # pickle, YAML, broken JSON, a body of another shape
        raise unreadable(exc, message.content_type) from None
    if not isinstance(args, (list, tuple)) or not isinstance(kwargs, dict):
        raise PayloadError(f"{name}: its arguments are no JSON list and object")
    if too_deep([args, kwargs, embed], MAX_DEPTH):
        raise PayloadError(
            f"{name}: its arguments nest deeper than {MAX_DEPTH} levels; send flat JSON"
        )
    if public_queue:
        _check_embed(embed)
        check_canvas(embed, chords=not _from_tenant(message))
        _check_eta(headers.get("eta"))
    arguments = bind(task, args, kwargs)
    check_arguments = getattr(task, "intake", None)
    if check_arguments is not None:
        check_arguments(headers, arguments)
    check_caller = getattr(task, "caller_intake", None)
    if public_queue and check_caller is not None:
        check_caller(arguments)


#: What Celery's message protocol 2 carries in a body's third part, its "embed". Celery
#: merges every key there into the task's request, after the message's headers, so any
#: other key would let a caller set what only the fleet writes (its tenant, its lease).
EMBED_KEYS = frozenset({"callbacks", "errbacks", "chain", "chord"})


def _from_tenant(message: Any) -> bool:
    """Whether `message` came from a tenant's public queue (not the router's `celery`)."""
    return tenant_of(str((message.delivery_info or {}).get("routing_key"))) is not None


def _check_embed(embed: Any) -> None:
    if embed is None:
        return
    if not isinstance(embed, dict):
        raise PayloadError(f"the call's embed (its body's third part) is {describe(embed)}")
    extra = sorted(str(k) for k in embed if k not in EMBED_KEYS)
    if extra:
        raise PayloadError(
            f"the call's embed (its body's third part) may hold only "
            f"{', '.join(sorted(EMBED_KEYS))}, not {describe(', '.join(extra))}; send the "
            f"call with a Celery client"
        )


#: The canvas primitives a caller's chain, group or chord nests (never run as tasks here).
_CHORD = "celery.chord"
_CANVAS = frozenset({"celery.chain", "celery.group", _CHORD})
#: What makes Celery run a signature inside the worker rather than send it: an errback of
#: a task that takes more than one argument is called in place (as is a chord body's, when
#: a part fails), in whichever process fails the call, its main one included.
_ERRBACKS = ("errbacks", "link_error")


def check_canvas(embed: Any, *, chords: bool = True) -> None:
    """Refuse a caller's call whose callbacks, chain or chord would make a fleet process do
    what a caller may not. The worker that ends a call sends what comes next as the fleet,
    so each signature there must name a public task, be routed by the fleet or to a public
    queue by name (an exchange would follow bindings a caller may add), and carry no fleet
    header; no errback is taken at all (`_ERRBACKS`); no call it gives an id names a call
    by its tenant (`@`); without `chords` (a tenant's call), no chord anywhere; and there
    are at most `MAX_CANVAS` signatures (the walk stops at the first past it: a refusal
    costs no more)."""
    stack = [embed]
    signatures = 0
    while stack:
        item = stack.pop()
        if isinstance(item, (list, tuple)):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        if "task" in item:
            signatures += 1
            if signatures > MAX_CANVAS:
                raise PayloadError(
                    f"a caller's chain, callbacks and chord may hold at most {MAX_CANVAS} "
                    f"calls in all; send longer sequences as separate calls"
                )
        stack.extend(item.values())
        options = item.get("options")
        options = options if isinstance(options, dict) else {}
        if any(item.get(key) or options.get(key) for key in _ERRBACKS):
            raise PayloadError(
                "a caller's call may not carry errbacks (link_error): Celery runs them inside "
                "the fleet's worker. Read the call's result for its error instead"
            )
        if not chords and (item.get("chord") or options.get("chord") or item.get("task") == _CHORD):
            raise PayloadError(
                "a tenant's call may not be part of a chord yet (a chord's counter is the "
                "fleet's): send the group, then the call that joins its results"
            )
        name = item.get("task")
        if name is None:
            continue
        if name not in PUBLIC_TASKS and name not in _CANVAS:
            raise PayloadError(
                f"a caller's chain, callback or chord may run only {', '.join(PUBLIC_TASKS)}, "
                f"not {describe(name)}"
            )
        chained_id = options.get("task_id")
        if isinstance(chained_id, str) and ID_SEP in chained_id:
            raise PayloadError(
                f"a caller's chain, callback or chord may not give a call a task id with "
                f"{ID_SEP!r} in it (the fleet names calls so); leave the ids to Celery"
            )
        queue = options.get("queue")
        if queue is not None and queue not in PUBLIC_QUEUES:
            raise PayloadError(
                f"a caller's chain, callback or chord may send only to the queue "
                f"{', '.join(sorted(PUBLIC_QUEUES))}, not {describe(queue)}"
            )
        for option in ("exchange", "routing_key"):
            if options.get(option) is not None:
                raise PayloadError(
                    f"a caller's chain, callback or chord may not name an {option}: give its "
                    f"queue ({', '.join(sorted(PUBLIC_QUEUES))}), or none"
                )
        headers = options.get("headers")
        if isinstance(headers, dict) and any(
            isinstance(h, str) and h.startswith(FLEET_HEADERS) for h in headers
        ):
            raise PayloadError(f"a caller may not set {FLEET_HEADERS}* headers")


def _check_eta(eta: str | None) -> None:
    """Refuse a caller's call to run later than the visibility timeout: a worker holds it
    (in memory, and unacknowledged in Redis) until then, and the broker gives it to another
    worker once the timeout passes, so it would run twice."""
    if eta is None:
        return
    try:
        when = datetime.fromisoformat(eta)
    except ValueError:
        raise PayloadError(f"eta {describe(eta)} is no ISO 8601 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=UTC)
    limit = context.settings().visibility_timeout
    if when > datetime.now(UTC) + timedelta(seconds=limit):
        raise PayloadError(
            f"a call may wait at most the visibility timeout ({limit} s) to run; send it later "
            f"rather than with a far eta or countdown"
        )


def unreadable(exc: Exception, content_type: Any) -> PayloadError:
    """The error of a call whose body cannot be read."""
    return PayloadError(
        f"gpufleet could not read this call ({type(exc).__name__}, content type "
        f"{content_type!s:.60}); it accepts JSON only: send it with serializer='json'"
    )


def bind(task: Any, args: Any, kwargs: Any) -> dict[str, Any]:
    """`args` and `kwargs` by the name of each of `task`'s parameters, defaults filled in;
    `PayloadError` naming what the task takes when they do not bind. A task's `intake`
    (a static method: `intake(headers, arguments)`) checks the values."""
    signature = _signatures.get(task.name)
    if signature is None:
        signature = _signatures[task.name] = inspect.signature(task.run)
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as exc:
        raise PayloadError(
            f"{task.name} takes {shown(signature)}: {exc}; send the arguments it names"
        ) from None
    bound.apply_defaults()
    return bound.arguments


_signatures: dict[str, inspect.Signature] = {}


def shown(signature: inspect.Signature) -> str:
    """`(model, inputs, params=None)`: the signature as a caller writes the call."""
    parts = [
        p.name if p.default is inspect.Parameter.empty else f"{p.name}={p.default!r}"
        for p in signature.parameters.values()
        if p.kind is not inspect.Parameter.KEYWORD_ONLY or p.default is inspect.Parameter.empty
    ]
    return f"({', '.join(parts)})"


def too_deep(value: Any, limit: int) -> bool:
    """Whether JSON `value` nests lists and objects more than `limit` levels deep (checked
    without recursion, so any depth is safe to ask about)."""
    if not isinstance(value, _NESTING):
        return False
    stack: list[tuple[Any, int]] = [(value, 0)]  # containers only: scalars end nothing
    while stack:
        item, depth = stack.pop()
        if depth >= limit:
            return True
        for child in item.values() if isinstance(item, dict) else item:
            if isinstance(child, _NESTING):
                stack.append((child, depth + 1))
    return False


_NESTING = (dict, list, tuple)


def _names(value: Any) -> bool:
    return isinstance(value, list) and all(is_name(v) for v in value)


def _time_limits(value: Any) -> bool:
    return (
        isinstance(value, (list, tuple))
        and len(value) == 2
        and all(
            v is None
            or (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < math.inf)
            for v in value
        )
    )


_ID_FIELD = re.compile(r'"id":\s*"')


def _id_of_large(item: bytes | str) -> str | None:
    """The task id of a message too large to parse, found in its first or last 8 KiB
    (kombu writes the body first and the headers after it); None when not found there."""
    for part in (item[-8192:], item[:8192]):
        text = part.decode("utf-8", "replace") if isinstance(part, bytes) else part
        match = _ID_FIELD.search(text)  # kombu writes `"id": "`, orjson `"id":"`
        end = text.find('"', match.end()) if match else -1
        found = text[match.end() : end] if match and end > 0 else ""
        if is_name(found) and "\\" not in found:
            return found
    return None
