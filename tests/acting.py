"""Play the workers' part against a real registry, as their keepers would, without models."""

from __future__ import annotations

from placement.registry import Plan, Registry
from placement.state import Level


def settle_leaving(reg: Registry) -> None:
    """Every leaving copy is moved (OFFLOADING -> WARM, DROPPING -> COLD) and every waiting
    placement admitted, as if each worker's keeper had just run."""
    snap = reg.snapshot()
    for d in snap.deployments.values():
        if d.level is Level.OFFLOADING:
            assert reg.settle(d, "offloaded") is Level.WARM
        elif d.level is Level.DROPPING:
            assert reg.settle(d, "dropped") is Level.COLD
    for d in reg.snapshot().deployments.values():
        if d.level is Level.WAITING:
            assert reg.admit(d) is Level.LOADING


def make_hot(reg: Registry, plan: Plan) -> str:
    """Load a committed plan as its worker would: victims leave, it is admitted, confirmed."""
    settle_leaving(reg)
    assert reg.confirm(plan.replica, plan.worker, plan.epoch)
    return plan.replica


def evict_now(reg: Registry, replica: str, to: Level | None = None) -> Level:
    """An explicit evict whose worker settles the move at once: the level it ends at."""
    level = reg.evict(replica, to=to)
    settle_leaving(reg)
    record = reg.deployment(replica)
    assert level is not Level.DRAINING and record is not None
    return record.level
