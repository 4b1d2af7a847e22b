"""Durations as people write them ("5m", "30s", "1h30m", "250ms"), as milliseconds.

The catalog's `keep_alive` and the fleet's scaling settings take them; Ollama writes its
`keep_alive` the same way. A bare number is seconds. Pure stdlib.
"""

from __future__ import annotations

import math
import re

from placement.errors import ConfigError

_UNITS_MS = {"ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}
_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(ms|s|m|h)")
_EXAMPLES = "'5m', '30s', '1h30m', '250ms', or seconds as 90"


def parse_duration_ms(value: object) -> int:
    """Whole milliseconds in `value` (rounded up); `ConfigError` says how to write one."""
    if isinstance(value, bool) or value is None:
        raise ConfigError(f"invalid duration {value!r}: write it like {_EXAMPLES}")
    if isinstance(value, int | float):
        if not math.isfinite(value) or value < 0:
            raise ConfigError(f"invalid duration {value!r}: it must be 0 or more seconds")
        return math.ceil(value * 1000)
    if not isinstance(value, str):
        raise ConfigError(f"invalid duration {value!r}: write it like {_EXAMPLES}")
    text = value.strip().lower().replace(" ", "")
    if re.fullmatch(r"[0-9]+(\.[0-9]+)?", text):
        return math.ceil(float(text) * 1000)
    parts = _PART.findall(text)
    if not parts or "".join(n + u for n, u in parts) != text:
        raise ConfigError(f"invalid duration {value!r}: write it like {_EXAMPLES}")
    return math.ceil(sum(float(n) * _UNITS_MS[u] for n, u in parts))


def format_duration_ms(ms: int) -> str:
    """`ms` as the shortest of "250ms", "30s", "5m", "1h30m"."""
    if ms % 1000:
        return f"{ms}ms"
    seconds = ms // 1000
    hours, rest = divmod(seconds, 3600)
    minutes, seconds = divmod(rest, 60)
    text = (f"{hours}h" if hours else "") + (f"{minutes}m" if minutes else "")
    return text + (f"{seconds}s" if seconds or not text else "")
