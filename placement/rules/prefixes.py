"""What a call's prompt begins with, as the routing side sees it: chained digests of its
text, so that a call goes to the replica whose KV cache holds its prefix already.

A replica caches its prompts' KV blocks by their tokens (`worker.generation.kv.blocks`), but
the processes that route calls have no tokenizer. As the SGLang router does, routing
keys prompts by their text instead: the text is cut into chunks of `CHUNK_CHARS`
characters, and each chunk's digest chains its parent's, so the i-th digest names the
prompt's first i chunks. `pick.lua` and `forward.lua` keep, per model, which replica a
prefix was last sent to, and send a call to the replica that served its longest prefix,
unless that replica is `SPILL` calls busier than the least busy one (docs/placement.md,
"Prefix routing"). A chat is keyed by its messages, a stand-in for its templated text
that shares a prefix exactly when the text does. The chain starts from the tenant's name
(and the adapter's): a tenant's calls are routed by its own prefixes only.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence

#: Characters a chunk of the chain covers: about 32 tokens of English (not tuned: fine
#: enough that prompts which differ after a 1,000-token preamble part within it).
CHUNK_CHARS = 128
#: Chunks a chain holds at most: the first 4,096 characters of a prompt decide its route.
MAX_CHUNKS = 32
#: How many more calls in flight the replica holding a call's prefix may have than the
#: least busy replica before the call goes to that one instead (the bounded spill). A
#: replica's batch takes more calls at little more than a step's cost each, but a spilled
#: call prefills its whole prompt where it lands and pushes another prefix out of that
#: cache, so the owner keeps its calls until it is far busier (the SGLang and vLLM routers
#: wait for 64 calls more and 1.5 times the load; Ray's router, by default, never spills).
#: Tuned: at 4, two replicas in `bench.prefix` spilled 37 of 256 calls and took 0.66 of
#: their prompts' tokens from cache; at 16 none spilled and 0.94 did.
SPILL = 16
#: A model's prefix map is cleared when it holds more entries than this (a bound, not a
#: cache policy: the entries come back with the next calls).
MAX_ENTRIES = 65536


def chain(inputs: object, params: object = None, tenant: str = "") -> list[str]:
    """The chained digests of a call's prompt (hex), shortest prefix first; none for a
    call that is not a prompt, a chat or a list of prompts (the first one counts), or
    whose prompt is shorter than one chunk."""
    text = _text(inputs)
    if text is None or len(text) < CHUNK_CHARS:
        return []
    adapter = params.get("adapter") if isinstance(params, Mapping) else None
    parent = hashlib.blake2b(f"{tenant}\0{adapter or ''}".encode(), digest_size=8).digest()
    digests = []
    end = min(len(text) // CHUNK_CHARS, MAX_CHUNKS) * CHUNK_CHARS
    for start in range(0, end, CHUNK_CHARS):
        digest = hashlib.blake2b(parent, digest_size=8)
        digest.update(text[start : start + CHUNK_CHARS].encode("utf-8", "replace"))
        parent = digest.digest()
        digests.append(parent.hex())
    return digests


def _text(inputs: object) -> str | None:
    """The text a call's prefix is read from: its prompt, its first prompt, or its chat's
    messages in order."""
    if isinstance(inputs, str):
        return inputs
    if isinstance(inputs, Sequence) and inputs:
        first = inputs[0]
        if isinstance(first, str):
            return first
        if isinstance(first, Mapping):
            parts = []
            for message in inputs:
                if not isinstance(message, Mapping):
                    return None
                parts.append(f"{message.get('role')}\x1f{message.get('content')}\x1e")
            return "".join(parts)
    return None


__all__ = ["CHUNK_CHARS", "MAX_CHUNKS", "MAX_ENTRIES", "SPILL", "chain"]
