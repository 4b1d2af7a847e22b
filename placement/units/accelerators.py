"""GPU types: which GPUs a catalog's `accelerator` lets a model use.

A GPU's name, as NVML reports it ("NVIDIA H100 80GB HBM3"), and an accelerator
pattern are both cut into tokens: lower case, split at anything that is not a letter
or a digit, with a number and a memory unit after it joined ("80 GB" is "80gb"). A
pattern matches a GPU when each of its tokens is a whole token of the GPU's name:

- "H100" and "h100-80gb" match "NVIDIA H100 80GB HBM3";
- "A100 80 GB" matches "NVIDIA A100-SXM4-80GB", "A100-40GB" does not;
- "A10" does not match an A100, "L4" does not match an L40S.

A list of patterns matches when any one of them does: `[V100-16GB, V100-32GB]`.
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Sequence

#: One pattern, several alternatives, or None for any GPU.
Accelerator = str | tuple[str, ...] | None

_UNITS = frozenset({"gb", "gib", "g"})


@functools.lru_cache(maxsize=4096)
def tokens(text: str) -> frozenset[str]:
    """The whole tokens of a GPU name or of one pattern."""
    merged: list[str] = []
    for word in re.findall(r"[a-z0-9]+", text.lower()):
        if merged and merged[-1].isdigit() and word in _UNITS:
            merged[-1] += word  # "80 GB" names the same memory as "80GB"
        else:
            merged.append(word)
    return frozenset(merged)


def alternatives(accelerator: Accelerator) -> tuple[str, ...]:
    """The patterns of `accelerator`, any one of which may match; () for any GPU."""
    if accelerator is None:
        return ()
    return (accelerator,) if isinstance(accelerator, str) else tuple(accelerator)


def matches(gpu_name: str, accelerator: Accelerator) -> bool:
    """True when the GPU named `gpu_name` is one of the types `accelerator` allows."""
    patterns = alternatives(accelerator)
    if not patterns:
        return True
    name = tokens(gpu_name)
    return any(tokens(p) <= name for p in patterns)


def describe(accelerator: Accelerator) -> str:
    """`accelerator` as a refusal message names it."""
    patterns = alternatives(accelerator)
    return " or ".join(repr(p) for p in patterns) if patterns else "any type"


def parse(value: object) -> Accelerator:
    """A catalog's `accelerator`: a non-empty string or a non-empty list of them.

    Raises ValueError saying what was expected.
    """
    if value is None:
        return None
    if isinstance(value, str) and tokens(value):
        return value.strip()
    if isinstance(value, Sequence) and value:
        names = [v for v in value if isinstance(v, str) and tokens(v)]
        if len(names) == len(value):
            return tuple(v.strip() for v in names)
    raise ValueError(f"expected a GPU type name or a list of them, got {value!r}")


def dump(accelerator: Accelerator) -> str:
    """`accelerator` as a ledger record stores it: its patterns as a JSON list, "" for any
    GPU (`load` reads it back)."""
    patterns = alternatives(accelerator)
    return json.dumps(list(patterns)) if patterns else ""


def load(text: str) -> Accelerator:
    """What `dump` wrote: one pattern as a string, several as a tuple, "" as None. A value
    that is not such a list reads as None (any GPU), so a record from before the field
    existed reads as unconstrained."""
    try:
        patterns = json.loads(text) if text else None
    except ValueError:
        return None
    if not isinstance(patterns, list) or not patterns:
        return None
    names = tuple(p for p in patterns if isinstance(p, str))
    return names[0] if len(names) == 1 else names or None
