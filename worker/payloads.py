"""What every call's payload must be, whatever its task: JSON text within limits, and params
of the names and kinds its task allows.

`worker.handlers` gives each task its params; `worker.generation.params` adds what a
generating call may send. Nothing here needs torch or a model, so the router refuses a bad
call before it costs a GPU hop.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from placement.errors import PayloadError, describe

MAX_BATCH = 64  # strings per request
MAX_CHARS = 8192  # characters per string


@dataclass(frozen=True)
class Param:
    """One request parameter: a bool, or a whole number within [low, high] (None if nullable)."""

    kind: type
    default: object
    low: int = 0
    high: int = 0
    nullable: bool = False

    def check(self, name: str, value: object) -> object:
        """Return `value` if it is valid for this parameter, else raise PayloadError."""
        if value is None and self.nullable:
            return None
        if self.kind is bool:
            if isinstance(value, bool):
                return value
            raise PayloadError(f"param {name!r} must be true or false, got {describe(value)}")
        in_range = (
            isinstance(value, int)
            and not isinstance(value, bool)
            and self.low <= value <= self.high
        )
        if in_range:
            return value
        null = " or null" if self.nullable else ""
        raise PayloadError(
            f"param {name!r} must be a whole number from {self.low} to {self.high}{null},"
            f" got {describe(value)}"
        )


def check_text(where: str, item: object) -> str:
    if isinstance(item, (bytes, bytearray, memoryview)):
        raise PayloadError(
            f"{where} arrived as {type(item).__name__}; gpufleet accepts JSON only and never"
            " unpickles: send text as a string"
        )
    if not isinstance(item, str):
        raise PayloadError(f"{where} must be a string, got {describe(item)}")
    if len(item) > MAX_CHARS:
        raise PayloadError(
            f"{where} is {len(item)} characters, over the limit of {MAX_CHARS} per string;"
            " shorten it or split it into several strings"
        )
    try:
        item.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PayloadError(
            f"{where} is not valid Unicode (a lone surrogate at position {exc.start});"
            " send UTF-8 text"
        ) from None
    return str.__str__(item)  # a plain str, even from a str subclass


def validate_inputs(inputs: object) -> list[str]:
    """The texts of a request: a string, or a list of 1 to MAX_BATCH strings."""
    if isinstance(inputs, str):
        return [check_text("inputs", inputs)]
    if isinstance(inputs, (bytes, bytearray, memoryview)):
        raise PayloadError(
            f"inputs arrived as {type(inputs).__name__}; gpufleet accepts JSON only and never"
            " unpickles: send a string or a list of strings"
        )
    if not isinstance(inputs, (list, tuple)):
        raise PayloadError(f"inputs must be a string or a list of strings, got {describe(inputs)}")
    if not inputs:
        raise PayloadError(
            f"inputs is an empty list; send a string or a list of 1 to {MAX_BATCH} strings"
        )
    if len(inputs) > MAX_BATCH:
        raise PayloadError(
            f"inputs holds {len(inputs)} strings, over the limit of {MAX_BATCH} per request;"
            " split them into several requests"
        )
    return [check_text(f"inputs[{i}]", item) for i, item in enumerate(inputs)]


def check_params(task: str, params: object, allowed: Mapping[str, Any]) -> dict[str, Any]:
    """A call's params for `task`, checked against `allowed` (name -> a check with a
    `default`), with every default filled in."""
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise PayloadError(
            f"params must be a JSON object (a dict) or null, got {describe(params)};"
            f" {task} takes {allowed_names(allowed)}"
        )
    for key in params:
        if not isinstance(key, str):
            raise PayloadError(f"params keys must be strings, got {describe(key)}")
        if key not in allowed:
            raise PayloadError(
                f"unknown param {key!r} for {task}; allowed: {allowed_names(allowed)}"
            )
    return {
        name: param.check(name, params[name]) if name in params else param.default
        for name, param in allowed.items()
    }


def allowed_names(allowed: Mapping[str, Any]) -> str:
    return ", ".join(sorted(allowed)) or "no params"
