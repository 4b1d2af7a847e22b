"""The registry's Lua scripts, read from package files and registered once per client.

Each `placement/lua/<name>.lua` opens with its KEYS/ARGV contract. `_lib.lua` holds
helpers that are prepended to every script, since Redis 6 has no shared functions.
Calls go through redis-py's `Script`, which uses EVALSHA and falls back to loading
the script on NOSCRIPT.
"""

from __future__ import annotations

import functools
import weakref
from importlib import resources
from typing import Any

import redis

NAMES = (
    "register",
    "heartbeat",
    "commit",
    "admit",
    "confirm",
    "settle",
    "hold",
    "pick",
    "finish",
    "evict",
    "reap",
    "learn",
)


@functools.cache
def source(name: str) -> str:
    """The full text sent to Redis for script `name`: the shared helpers, then the script."""
    lua = resources.files("placement") / "lua"
    return (lua / "_lib.lua").read_text() + "\n" + (lua / f"{name}.lua").read_text()


class Scripts:
    """The scripts bound to one client."""

    def __init__(self, client: redis.Redis) -> None:
        self._scripts = {name: client.register_script(source(name)) for name in NAMES}

    def __call__(self, name: str, keys: list[str], args: list[Any], client: Any = None) -> Any:
        """Run script `name`; `client` may be a pipeline of the same connection."""
        return self._scripts[name](keys=keys, args=args, client=client)


_per_client: weakref.WeakKeyDictionary[redis.Redis, Scripts] = weakref.WeakKeyDictionary()


def scripts_for(client: redis.Redis) -> Scripts:
    """The one `Scripts` of `client`, made on first use."""
    found = _per_client.get(client)
    if found is None:
        found = _per_client[client] = Scripts(client)
    return found
