"""OpenAI's request and response shapes, translated to and from the fleet's calls.

Pure functions, no I/O: `tasks.front.server` reads a request's JSON, asks here what fleet
call it means (a model, inputs and `text-generation` or `feature-extraction` params),
sends it, and turns the call's result or error back into the object OpenAI's clients parse.

The translation is strict where silence would mislead: a parameter the fleet cannot honour
(`n` above 1, `logprobs`, `tools`, a JSON response format, a penalty other than 0, ...) is
a 400 that names it, never ignored; one that only describes the caller (`user`,
`metadata`, `store`, ...) is accepted and left out. A field OpenAI does not define is a
400 too, as OpenAI answers it.

Defaults follow OpenAI's, not the fleet's: `temperature` 1, and a chat's `max_tokens` as
many as the model holds (the fleet's `max_new_tokens: null`); a legacy completion makes
16, as OpenAI's does.
"""

from __future__ import annotations

import base64
import struct
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from placement.errors import PayloadError, describe
from worker.generation import params as generation

#: What a finish reason of the fleet is called in OpenAI's API.
FINISH = {"stop": "stop", "length": "length", "cancelled": "stop"}

#: Fields a request may carry that only describe the caller: accepted, not sent on.
_DESCRIPTIVE = frozenset(
    {"user", "metadata", "store", "service_tier", "safety_identifier", "prompt_cache_key"}
)
#: Fields the fleet cannot honour unless they hold the value that asks for nothing.
_NEUTRAL: dict[str, tuple[Any, ...]] = {
    "n": (None, 1),
    "best_of": (None, 1),
    "logprobs": (None, False),
    "top_logprobs": (None, 0),
    "echo": (None, False),
    "suffix": (None, ""),
    "presence_penalty": (None, 0, 0.0),
    "frequency_penalty": (None, 0, 0.0),
    "logit_bias": (None, {}),
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "parallel_tool_calls": (None, False, True),
    "modalities": (None, ["text"]),
    "response_format": (None, {"type": "text"}),
    "dimensions": (None,),
    "encoding_format": (None, "float", "base64"),
}
#: Each endpoint's fields: what it reads itself, beside the neutral and descriptive ones.
_SAMPLING = ("temperature", "top_p", "stop", "seed", "stream", "stream_options")
_CHAT = ("model", "messages", "max_tokens", "max_completion_tokens", *_SAMPLING)
_CHAT_NEUTRAL = (
    "n", "logprobs", "top_logprobs", "presence_penalty", "frequency_penalty", "logit_bias",
    "tools", "tool_choice", "functions", "function_call", "parallel_tool_calls",
    "modalities", "response_format",
)  # fmt: skip
_COMPLETION = ("model", "prompt", "max_tokens", *_SAMPLING)
_COMPLETION_NEUTRAL = (
    "n", "best_of", "logprobs", "echo", "suffix", "presence_penalty", "frequency_penalty",
    "logit_bias",
)  # fmt: skip
_EMBEDDING = ("model", "input")
_EMBEDDING_NEUTRAL = ("dimensions", "encoding_format")

#: A chat's roles, as the fleet's chats name them (OpenAI's `developer` is a system message).
_ROLES = {"system": "system", "developer": "system", "user": "user", "assistant": "assistant"}
#: The fleet's params that OpenAI calls otherwise.
_SAID = {"max_new_tokens": "max_tokens"}
#: A legacy completion's `max_tokens` when none is given (OpenAI's default).
COMPLETION_MAX_TOKENS = 16


class RequestError(PayloadError):
    """A request OpenAI's shapes cannot carry to the fleet: a 400 naming the field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class Call:
    """One fleet call an HTTP request asks for."""

    kind: str  # "chat", "completion" or "embedding": the response's shape
    model: str
    inputs: Any
    params: dict[str, Any]
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    base64: bool = False  # an embedding's encoding_format


def chat_call(body: Any) -> Call:
    """The fleet call a `POST /v1/chat/completions` body asks for, or RequestError."""
    fields = _fields(body, _CHAT, _CHAT_NEUTRAL)
    messages = fields.get("messages")
    if not isinstance(messages, list) or not messages:
        raise RequestError("'messages' must be a non-empty list of messages", "messages")
    chat = [_message(i, m) for i, m in enumerate(messages)]
    limit = fields.get("max_completion_tokens", fields.get("max_tokens"))
    return _generating("chat", fields, chat, limit)


def completion_call(body: Any) -> Call:
    """The fleet call a `POST /v1/completions` body asks for, or RequestError."""
    fields = _fields(body, _COMPLETION, _COMPLETION_NEUTRAL)
    prompt = fields.get("prompt")
    if isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        inputs: Any = list(prompt)
    elif isinstance(prompt, str):
        inputs = prompt
    else:
        raise RequestError(
            f"'prompt' must be a string or a list of strings (token ids are not taken), got"
            f" {describe(prompt)}",
            "prompt",
        )
    limit = fields.get("max_tokens", COMPLETION_MAX_TOKENS)
    return _generating("completion", fields, inputs, limit)


def embedding_call(body: Any) -> Call:
    """The fleet call a `POST /v1/embeddings` body asks for, or RequestError."""
    fields = _fields(body, _EMBEDDING, _EMBEDDING_NEUTRAL)
    text = fields.get("input")
    if not (isinstance(text, str) or (isinstance(text, list) and text and _strings(text))):
        raise RequestError(
            f"'input' must be a string or a non-empty list of strings (token ids are not"
            f" taken), got {describe(text)}",
            "input",
        )
    encoding = fields.get("encoding_format") or "float"
    return Call("embedding", fields["model"], text, {}, base64=encoding == "base64")


def _strings(items: list[Any]) -> bool:
    return all(isinstance(item, str) for item in items)


def _fields(body: Any, own: tuple[str, ...], neutral: tuple[str, ...]) -> dict[str, Any]:
    """`body`'s fields this endpoint reads, with `model` checked; RequestError for a field
    it does not know or a neutral one that asks for something."""
    if not isinstance(body, dict):
        raise RequestError(f"the request body must be a JSON object, got {describe(body)}")
    for name, value in body.items():
        if name in own or name in _DESCRIPTIVE:
            continue
        if name not in neutral:
            raise RequestError(f"unrecognized request argument supplied: {name}", name)
        if not any(value == allowed and type(value) is type(allowed) for allowed in _NEUTRAL[name]):
            raise RequestError(
                f"{name}={describe(value)} is not supported by this server; leave it out", name
            )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise RequestError(f"'model' must be a model's name, got {describe(model)}", "model")
    return {name: value for name, value in body.items() if name not in _DESCRIPTIVE}


def _message(index: int, message: Any) -> dict[str, str]:
    """One chat message as the fleet takes it: a role and a string."""
    where = f"messages[{index}]"
    if not isinstance(message, dict):
        raise RequestError(f"{where} must be an object, got {describe(message)}", where)
    extra = set(message) - {"role", "content", "name"}
    if extra:
        raise RequestError(f"{where}.{sorted(extra)[0]} is not supported; send role and content")
    role = message.get("role")
    if role not in _ROLES:
        raise RequestError(
            f"{where}.role is {describe(role)}; use one of {', '.join(_ROLES)}", f"{where}.role"
        )
    return {"role": _ROLES[role], "content": _content(where, message.get("content"))}


def _content(where: str, content: Any) -> str:
    """A message's text: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = [p.get("text") for p in content if isinstance(p, dict) and p.get("type") == "text"]
        if len(texts) == len(content) and _strings(texts):
            return "".join(str(text) for text in texts)
    raise RequestError(
        f"{where}.content must be a string or a list of text parts, got {describe(content)}",
        f"{where}.content",
    )


def _generating(kind: str, fields: dict[str, Any], inputs: Any, limit: Any) -> Call:
    """A text-generation call: OpenAI's sampling fields as the fleet's params (which the
    router checks again, with the fleet's own messages)."""
    given = {"max_new_tokens": limit, "temperature": fields.get("temperature", 1.0)}
    given |= {name: fields[name] for name in ("top_p", "stop", "seed") if name in fields}
    params: dict[str, Any] = {}
    for name, value in given.items():
        if value is None and name != "max_new_tokens":
            continue  # null: the default
        said = _SAID.get(name, name)
        try:  # checked here too, so that the message names OpenAI's field
            params[name] = generation.PARAMS[name].check(said, value)
        except PayloadError as exc:
            raise RequestError(str(exc), said) from None
    stream = fields.get("stream") or False
    if not isinstance(stream, bool):
        raise RequestError(f"'stream' must be true or false, got {describe(stream)}", "stream")
    options = fields.get("stream_options") or {}
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise RequestError("'stream_options' may only hold include_usage", "stream_options")
    if options and not stream:
        raise RequestError("'stream_options' is only allowed with stream=true", "stream_options")
    usage = options.get("include_usage", False)
    if not isinstance(usage, bool):
        raise RequestError("'stream_options.include_usage' must be true or false", "stream_options")
    return Call(kind, fields["model"], inputs, params, stream=stream, include_usage=usage)


# --- responses ---------------------------------------------------------------------


def completion_id(kind: str, task_id: str) -> str:
    """The response's id: OpenAI's prefix, then the fleet's task id (for Flower, cancels)."""
    return f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{task_id}"


def usage(outputs: Mapping[str, Any]) -> dict[str, int]:
    """A generating call's token counts, as OpenAI's `usage`."""
    prompt = sum(outputs.get("prompt_tokens", []))
    made = sum(len(tokens) for tokens in outputs.get("tokens", []))
    return {"prompt_tokens": prompt, "completion_tokens": made, "total_tokens": prompt + made}


def answer(call: Call, task_id: str, outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The whole response to a call that was not streamed."""
    reasons = [FINISH.get(r, "stop") for r in outputs["finish_reasons"]]
    texts = outputs["texts"]
    if call.kind == "chat":
        choices = [
            {
                "index": 0,
                "message": {"role": "assistant", "content": texts[0], "refusal": None},
                "finish_reason": reasons[0],
                "logprobs": None,
            }
        ]
    else:
        choices = [
            {"index": i, "text": text, "finish_reason": reason, "logprobs": None}
            for i, (text, reason) in enumerate(zip(texts, reasons, strict=True))
        ]
    return {
        "id": completion_id(call.kind, task_id),
        "object": "chat.completion" if call.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "usage": usage(outputs),
        "system_fingerprint": None,
    }


def chunk(
    call: Call,
    task_id: str,
    index: int,
    text: str | None,
    finish: str | None = None,
    *,
    first: bool = False,
) -> dict[str, Any]:
    """One streamed chunk: new text of prompt `index`, or its finish reason."""
    if call.kind == "chat":
        delta: dict[str, Any] = {"role": "assistant"} if first else {}
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {"index": index, "delta": delta}
    else:
        choice = {"index": index, "text": text or ""}
    choice.update(finish_reason=FINISH.get(finish, "stop") if finish else None, logprobs=None)
    return _chunk(call, task_id, [choice], None)


def usage_chunk(call: Call, task_id: str, outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The last chunk of a stream that asked for usage: no choices, the counts."""
    return _chunk(call, task_id, [], usage(outputs))


def _chunk(
    call: Call, task_id: str, choices: list[dict[str, Any]], counts: dict[str, int] | None
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "id": completion_id(call.kind, task_id),
        "object": "chat.completion.chunk" if call.kind == "chat" else "text_completion",
        "created": int(time.time()),
        "model": call.model,
        "choices": choices,
        "system_fingerprint": None,
    }
    if call.include_usage:
        body["usage"] = counts
    return body


def embeddings(call: Call, outputs: Mapping[str, Any]) -> dict[str, Any]:
    """The response to an embedding call: float lists, or base64 of little-endian float32
    (what OpenAI's Python client asks for and decodes)."""
    rows = outputs["embeddings"]
    data = []
    for i, row in enumerate(rows):
        value: Any = row
        if call.base64:
            value = base64.b64encode(struct.pack(f"<{len(row)}f", *row)).decode()
        data.append({"object": "embedding", "embedding": value, "index": i})
    tokens = int(outputs.get("tokens", 0))
    return {
        "object": "list",
        "data": data,
        "model": call.model,
        "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
    }


def models(names: dict[str, list[str]], created: int) -> dict[str, Any]:
    """`GET /v1/models`: the catalog's models, each followed by its adapters (`names`:
    each model's adapters), as `BASE:ADAPTER` with the base as `parent` (as vLLM lists
    LoRA adapters)."""
    data = []
    for name, adapters in names.items():
        data.append(model(name, created))
        data += [model(f"{name}:{adapter}", created, name) for adapter in adapters]
    return {"object": "list", "data": data}


def model(name: str, created: int, parent: str | None = None) -> dict[str, Any]:
    shape = {"id": name, "object": "model", "created": created, "owned_by": "gpufleet"}
    return shape if parent is None else {**shape, "parent": parent}


# --- errors ------------------------------------------------------------------------

#: The HTTP status and OpenAI error type of each fleet error a call may end with (its
#: class name, as Celery stores it), and the seconds to wait before trying again.
_ERRORS: dict[str, tuple[int, str, str, int | None]] = {
    "PayloadError": (400, "invalid_request_error", "invalid_value", None),
    "RequestError": (400, "invalid_request_error", "invalid_value", None),
    "UnknownModelError": (404, "invalid_request_error", "model_not_found", None),
    "UnknownAdapterError": (404, "invalid_request_error", "model_not_found", None),
    "AdapterError": (400, "invalid_request_error", "adapter_unusable", None),
    "NeverFitsError": (400, "invalid_request_error", "model_never_fits", None),
    "CantAccommodateError": (503, "server_error", "fleet_full", 5),
    "SettlingError": (503, "server_error", "fleet_settling", 1),
    "PlanRejectedError": (503, "server_error", "fleet_busy", 1),
    "EvictedError": (503, "server_error", "fleet_busy", 1),
    "FleetStoppedError": (503, "server_error", "fleet_stopped", 5),
    "QuotaError": (429, "rate_limit_error", "quota_exceeded", 1),
    "TaskRevokedError": (409, "invalid_request_error", "cancelled", None),
}


@dataclass(frozen=True)
class Failure:
    """An error response: its status, OpenAI's error object, and `Retry-After`."""

    status: int
    message: str
    type: str
    code: str | None = None
    param: str | None = None
    retry_after: int | None = None

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after)} if self.retry_after is not None else {}


def failure(kind: str, message: str, param: str | None = None) -> Failure:
    """The response to a call that ended with fleet error `kind` (a class name)."""
    status, error_type, code, retry = _ERRORS.get(kind, (500, "server_error", "model_error", None))
    return Failure(status, message, error_type, code, param, retry)
