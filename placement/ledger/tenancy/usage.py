"""What each tenant used of the fleet: its calls, GPU time, tokens and waiting.

A GPU worker counts each call of a tenant as it ends (`record`, off the caller's wait), in
the tenant's hash `Keys.tenant_usage`; `gpufleet status` and the Prometheus exporter read
them (`read`). Counts only grow (Prometheus counters), from the tenant's first call; a
tenant removed and forgotten takes its counts with it.

- `calls`, `failed`: calls answered, and of those the ones that ended in an error;
- `gpu_ms`: the call's share of the forward passes it rode on (a pass's time over the
  calls that shared it: a batch of 8 costs each of its calls an eighth), so a tenant's
  GPU time adds up to the passes' time, whatever the batching;
- `tokens_in`, `tokens_out`: a generating call's prompt and generated tokens; an encoder's
  input tokens;
- `wait_ms`: from the router taking the call to its pass starting (`timings_ms.queue`).

The default tenant (the fleet's `caller` user) is not counted here: every call is, in the
fleet's own request counts, and a fleet without tenants pays nothing per call for this.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

from placement.ledger.store import Store

__all__ = ["Usage", "read", "record"]


@dataclass(frozen=True)
class Usage:
    """A tenant's counts (see the module); zero for a tenant with no call answered yet."""

    calls: int = 0
    failed: int = 0
    gpu_ms: float = 0.0
    tokens_in: int = 0
    tokens_out: int = 0
    wait_ms: float = 0.0

    def report(self) -> dict[str, Any]:
        """As `gpufleet status --json` shows it: seconds, and the mean wait."""
        return {
            "calls": self.calls,
            "failed": self.failed,
            "gpu_seconds": round(self.gpu_ms / 1000, 3),
            "tokens_in": self.tokens_in,
            "tokens_out": self.tokens_out,
            "mean_wait_s": round(self.wait_ms / 1000 / self.calls, 4) if self.calls else None,
        }


def record(store: Store, tenant: str, used: Usage) -> None:
    """Add `used` (one call's, or several's) to `tenant`'s counts, in one step."""
    key = store.keys.tenant_usage(tenant)
    commands: list[tuple[Any, ...]] = []
    for field in fields(Usage):
        value = getattr(used, field.name)
        if value:
            kind = "hincrbyfloat" if isinstance(value, float) else "hincrby"
            commands.append((kind, key, field.name, value))
    if commands:
        store._read(commands, atomic=True)


def read(store: Store, tenants: list[str]) -> dict[str, Usage]:
    """Every named tenant's counts."""
    found = store._read([("hgetall", store.keys.tenant_usage(name)) for name in tenants])
    return {name: _parse(raw) for name, raw in zip(tenants, found, strict=True)}


def _parse(raw: dict[str, str]) -> Usage:
    values: dict[str, Any] = {}
    for field in fields(Usage):
        text = raw.get(field.name)
        if text is None:
            continue
        try:
            values[field.name] = float(text) if field.type == "float" else int(text)
        except ValueError:  # a count that is no number: left at zero
            continue
    return Usage(**values)
