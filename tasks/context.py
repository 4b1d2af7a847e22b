"""Per-process singletons: the registry client, the catalog and the policy settings.

Built on first use, so importing the task modules costs nothing and a forked child
makes its own connections.
"""

from __future__ import annotations

import functools
from dataclasses import replace

from placement.catalog.catalog import Catalog, ModelSpec
from placement.catalog.estimate import estimate_bytes
from placement.config import Settings
from placement.ledger.registry import Registry
from placement.policy.state import Demand


@functools.cache
def settings() -> Settings:
    """Every GPUFLEET_* setting of this process, read once."""
    return Settings.from_env()


@functools.cache
def registry() -> Registry:
    s = settings()
    return Registry.from_url(s.registry_url, s.fleet, settings=s.policy)


@functools.cache
def one_redis() -> bool:
    """Whether the broker is the registry's Redis, so one script reaches both (a router's
    `forward.lua`, the tenants' quota scripts, which park broker messages)."""
    s = settings()
    return s.broker_url == s.registry_url


@functools.cache
def catalog() -> Catalog:
    return Catalog.load(settings().models)


@functools.cache
def _estimate(name: str) -> int:
    spec = catalog().get(name)
    path = spec.source_path()
    return estimate_bytes(path, spec.dtype, spec.trust_remote_code) if path else 0


def demand(
    spec: ModelSpec, *, replicas: int | None = None, dedicated: bool | None = None
) -> Demand:
    """What one replica of `spec` asks of the fleet; sizes without `memory` are estimated once."""
    sized = spec.memory is not None or spec.request is not None or spec.gpus is not None
    base = spec.demand(estimated_size=None if sized else _estimate(spec.name))
    if replicas is not None:
        base = replace(base, replicas=replicas)
    if dedicated is not None:
        base = replace(base, dedicated=dedicated)
    return base


def role() -> str:
    """`router` or `gpu`: which kind of Celery worker this process is (GPUFLEET_ROLE)."""
    return settings().role
