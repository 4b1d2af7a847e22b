"""What a text-generation call may ask for: its prompts (text or a chat) and its parameters.

Checked without torch or a model, so the router refuses a bad call before it costs a GPU
hop (`worker.handlers.validate`). The parameters follow what LLM users know from
transformers' `generate` and OpenAI-style APIs:

====================  =========================  ========================================
param                 allowed                    default
====================  =========================  ========================================
max_new_tokens        1 to 512, or null          16; null: as many as the model holds
temperature           0 to 2; 0 is greedy        0 (greedy: the same call, the same text)
top_p                 above 0, up to 1           1 (off)
top_k                 0 to 1000; 0 is off        0
repetition_penalty    0.01 to 10                 1 (off); transformers' rule
stop                  a string or up to 8        none; the text ends before the first one
                      strings of 1-64 chars
seed                  0 to 2**63-1, or null      null (a fresh seed per call)
stream                true or false              false: no chunks (`tasks.serving.streams`)
adapter               an adapter's name, or null null: the base; `BASE:ADAPTER` sets it
====================  =========================  ========================================

A call's `inputs` is a prompt, a list of prompts (each generated on its own), or a chat:
a list of ``{"role": ..., "content": ...}`` messages, rendered by the model's chat template
(`worker.generation.chat`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from placement.errors import PayloadError, describe
from worker import payloads

MAX_NEW_TOKENS = 512
MAX_TOP_K = 1000
MAX_STOPS = 8
MAX_STOP_CHARS = 64
MAX_MESSAGES = 64
MAX_SEED = 2**63 - 1
MAX_ADAPTER_CHARS = 200
MAX_ROWS = 64  # sequences one job runs at once, as MAX_BATCH strings per call
ROLES = ("system", "user", "assistant")


@dataclass(frozen=True)
class Number:
    """A number parameter within [low, high] (above `low` when `open_low`); `whole` for ints."""

    default: object
    low: float
    high: float
    whole: bool = False
    open_low: bool = False
    nullable: bool = False
    note: str = ""

    def check(self, name: str, value: object) -> object:
        """Return `value` if it is valid, else raise PayloadError saying what is."""
        if value is None and self.nullable:
            return None
        number = isinstance(value, (int, float)) and not isinstance(value, bool)
        if number and self.whole and not isinstance(value, int):
            number = False
        if number and (isinstance(value, int) or math.isfinite(value)):  # type: ignore[arg-type]
            above = value > self.low if self.open_low else value >= self.low  # type: ignore[operator]
            if above and value <= self.high:  # type: ignore[operator]
                return value if self.whole else float(value)  # type: ignore[arg-type]
        kind = "a whole number" if self.whole else "a number"
        low = f"above {_fmt(self.low)}" if self.open_low else f"from {_fmt(self.low)}"
        null = " or null" if self.nullable else ""
        note = f" ({self.note})" if self.note else ""
        raise PayloadError(
            f"param {name!r} must be {kind} {low} to {_fmt(self.high)}{null}{note},"
            f" got {describe(value)}"
        )


@dataclass(frozen=True)
class Stops:
    """Stop strings: one string, or a list of up to MAX_STOPS; always a tuple once checked."""

    default: tuple[str, ...] = ()

    def check(self, name: str, value: object) -> object:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or len(items) > MAX_STOPS:
            raise PayloadError(
                f"param {name!r} must be a string or a list of up to {MAX_STOPS} strings,"
                f" got {describe(value)}"
            )
        for item in items:
            if not isinstance(item, str) or not 1 <= len(item) <= MAX_STOP_CHARS:
                raise PayloadError(
                    f"param {name!r} holds {describe(item)}; each stop is a string of 1 to"
                    f" {MAX_STOP_CHARS} characters"
                )
        return tuple(str.__str__(item) for item in items)


@dataclass(frozen=True)
class AdapterName:
    """The LoRA adapter a call runs (set from the model name `BASE:ADAPTER`), or None."""

    default: None = None

    def check(self, name: str, value: object) -> object:
        if value is None:
            return None
        if not isinstance(value, str) or not 0 < len(value) <= MAX_ADAPTER_CHARS:
            raise PayloadError(
                f"param {name!r} must name an adapter of the model (up to {MAX_ADAPTER_CHARS}"
                f" characters) or be null, got {describe(value)}; call 'BASE:ADAPTER'"
            )
        return str.__str__(value)


def _fmt(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else str(value)


PARAMS: dict[str, Any] = {
    "max_new_tokens": Number(
        16, 1, MAX_NEW_TOKENS, whole=True, nullable=True, note="null: as many as the model holds"
    ),
    "temperature": Number(0.0, 0, 2, note="0 is greedy"),
    "top_p": Number(1.0, 0, 1, open_low=True),
    "top_k": Number(0, 0, MAX_TOP_K, whole=True, note="0 is off"),
    "repetition_penalty": Number(1.0, 0.01, 10, note="1 is off"),
    "stop": Stops(),
    "seed": Number(None, 0, MAX_SEED, whole=True, nullable=True),
    "stream": payloads.Param(bool, False),
    "adapter": AdapterName(),
}


@dataclass(frozen=True)
class Chat:
    """One conversation to continue: (role, content) pairs, checked."""

    messages: tuple[tuple[str, str], ...]

    def as_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]

    def __len__(self) -> int:
        return sum(len(content) for _, content in self.messages)


Prompt = str | Chat


def is_chat(inputs: object) -> bool:
    """Whether `inputs` is meant as a chat: a non-empty list whose first item is a dict."""
    return isinstance(inputs, (list, tuple)) and bool(inputs) and isinstance(inputs[0], dict)


def check_chat(inputs: list[Any] | tuple[Any, ...], max_chars: int) -> Chat:
    """A chat's messages, checked: 1 to MAX_MESSAGES dicts of a known role and a string."""
    if len(inputs) > MAX_MESSAGES:
        raise PayloadError(
            f"the chat holds {len(inputs)} messages, over the limit of {MAX_MESSAGES};"
            " drop the oldest ones"
        )
    messages = []
    for i, message in enumerate(inputs):
        where = f"inputs[{i}]"
        if not isinstance(message, dict) or set(message) != {"role", "content"}:
            raise PayloadError(
                f"{where} must be a message {{'role': ..., 'content': ...}} and nothing else,"
                f" got {describe(message)}"
            )
        role, content = message["role"], message["content"]
        if role not in ROLES:
            raise PayloadError(f"{where}'s role is {describe(role)}; use one of {', '.join(ROLES)}")
        if not isinstance(content, str) or len(content) > max_chars:
            raise PayloadError(
                f"{where}'s content must be a string of up to {max_chars} characters,"
                f" got {describe(content)}"
            )
        try:
            content.encode("utf-8")
        except UnicodeEncodeError:
            raise PayloadError(f"{where}'s content is not valid Unicode; send UTF-8") from None
        messages.append((str.__str__(role), str.__str__(content)))
    return Chat(tuple(messages))


def validate(inputs: object, params: object) -> tuple[list[Prompt], dict[str, Any]]:
    """A generating call's prompts (strings, or one `Chat`) and its full params, or
    PayloadError saying what to send instead."""
    options = payloads.check_params("text-generation", params, PARAMS)
    if is_chat(inputs):
        assert isinstance(inputs, (list, tuple))
        return [check_chat(inputs, payloads.MAX_CHARS)], options
    return list(payloads.validate_inputs(inputs)), options
