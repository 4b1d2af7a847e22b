"""Play the workers' part against a real registry, as their keepers would, without models."""

from __future__ import annotations

import random
from collections.abc import Callable

from placement.ledger.audit import audit
from placement.ledger.registry import Plan, Registry
from placement.policy.mirror import apply_plan, evict, settle_all
from placement.policy.place import plan_replica
from placement.policy.state import Candidate, Demand, Level, Snapshot


def settle_leaving(reg: Registry, copy_at: str = "") -> None:
    """Every leaving copy is moved (OFFLOADING -> WARM, published at `copy_at`, DROPPING ->
    COLD) and every waiting placement admitted, as if each worker's keeper had just run."""
    snap = reg.snapshot()
    for d in snap.deployments.values():
        if d.level is Level.OFFLOADING:
            assert reg.settle(d, "offloaded", copy_at) is Level.WARM
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


def replay_against_mirror(
    reg: Registry,
    rng: random.Random,
    steps: int,
    demand: Callable[[random.Random], Demand],
    *,
    settle_evicted: bool = False,
    drop_waiting: float = 0.0,
) -> list[Snapshot]:
    """Plan `steps` demands drawn by `demand`, commit each, and check before and after its
    workers settle that the registry holds what `placement.policy.mirror` predicts and passes the
    audit. A demand already placed is evicted instead (its drop settled when
    `settle_evicted`); a placement that waits for its victims is dropped before it loads
    with probability `drop_waiting`. Returns every snapshot checked."""
    seen: list[Snapshot] = []

    def check(expected: Snapshot, step: int) -> None:
        actual = reg.snapshot()
        assert actual.gpus == expected.gpus, step
        assert actual.hosts == expected.hosts, step
        assert {r: (d.level, d.epoch) for r, d in actual.deployments.items()} == {
            r: (d.level, d.epoch) for r, d in expected.deployments.items()
        }, step
        assert {m: c for m, c in actual.active.items() if c} == {
            m: c for m, c in expected.active.items() if c
        }, step
        assert audit(actual) == [], step
        seen.append(actual)

    for step in range(steps):
        snap = reg.snapshot()
        try:
            plan = plan_replica(demand(rng), snap, rng=rng)
        except Exception:
            continue
        if plan.candidate is Candidate.DEPLOYED:
            reg.evict(plan.replica)
            if settle_evicted:
                settle_leaving(reg)
            continue
        expected = apply_plan(snap, plan)
        committed = reg.commit(plan, snap)
        check(expected, step)
        placed = reg.deployment(plan.replica)
        dropped = placed is not None and placed.level is Level.WAITING
        if dropped and rng.random() < drop_waiting:  # before its victims have left
            expected = evict(expected, plan.replica, Level.COLD)
            assert reg.evict(plan.replica, to=Level.COLD) is Level.COLD
            check(expected, step)
        else:
            dropped = False
        expected = settle_all(expected)  # the workers move the victims, admit the newcomer
        settle_leaving(reg)
        check(expected, step)
        assert dropped or reg.confirm(plan.replica, plan.worker, committed.epoch)
    return seen
