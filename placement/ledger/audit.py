"""Invariants of a registry snapshot, checked by tests, the soaks and operators.

Pure: give it a `Snapshot` and it lists every broken rule in words. An empty list
means the ledger is consistent, and agrees with what the workers report holding.
"""

from __future__ import annotations

from collections import defaultdict

from placement.policy.state import (
    ON_DEVICE,
    PENDING,
    RESERVING,
    Deployment,
    Holding,
    Level,
    Snapshot,
)

#: A change of a record is compared with its worker's report only once the report is
#: this much newer: the worker's keeper reacts to a change at once (docs/worker.md), and
#: the grace covers one transition of a large model plus the heartbeat's report.
REPORT_GRACE_MS = 10_000
#: A move that waits for a worker longer than this is a problem (loads included).
PENDING_BOUND_MS = 60_000

# What a worker may report for a record at each level, while the move is pending.
_MAY_HOLD: dict[Level, frozenset[Level]] = {
    Level.HOT: frozenset({Level.HOT}),
    Level.DRAINING: frozenset({Level.HOT}),
    Level.LOADING: frozenset({Level.HOT, Level.WARM}),  # loaded, or its warm source
    Level.WAITING: frozenset({Level.WARM}),  # a warm copy waiting to be restored
    Level.OFFLOADING: frozenset({Level.HOT, Level.WARM}),
    Level.DROPPING: frozenset({Level.HOT, Level.WARM}),
    Level.WARM: frozenset({Level.WARM}),
}


def audit(
    snap: Snapshot,
    *,
    grace_ms: int = REPORT_GRACE_MS,
    pending_bound_ms: int = PENDING_BOUND_MS,
) -> list[str]:
    """Every way `snap` breaks the ledger's rules (see `ledger_problems` and
    `report_problems`)."""
    return ledger_problems(snap, pending_bound_ms) + report_problems(snap, grace_ms)


def ledger_problems(snap: Snapshot, pending_bound_ms: int = PENDING_BOUND_MS) -> list[str]:
    """The ledger against itself.

    - each GPU: `reserved` equals the bytes of its RESERVING replicas and `held` those of
      its ON_DEVICE replicas, each plus the CUDA contexts other workers keep there (`held`
      those it counts), and neither passes `total`; every such context's worker is
      registered, and a context no load opened yet is counted as waited on by exactly its
      worker's WAITING placements there (none left: the context was never opened);
    - each host: `warm_used <= warm_budget`, and equals the cached bytes of its WARM and
      OFFLOADING replicas; its warm index lists exactly its WARM replicas;
    - WARM and COLD replicas hold no GPU bytes; the others hold some;
    - a replica that is not COLD is on a registered worker (reaping a worker makes its
      replicas COLD in the same step, and a plan for a worker without a live lease is
      refused);
    - each model's stored `active` counter equals its RESERVING replicas;
    - no move waits for a worker longer than `pending_bound_ms`;
    - no record the ledger lists is half written (`Snapshot.partial`).
    """
    problems: list[str] = [
        f"replica {r}'s record lacks {', '.join(lacks)} (half written: a Redis that lost"
        f" writes?); workers read it as no record"
        for r, lacks in sorted(snap.partial.items())
    ]
    reserved: dict[str, int] = defaultdict(int)
    held: dict[str, int] = defaultdict(int)
    warm: dict[str, int] = defaultdict(int)
    warm_ids: dict[str, set[str]] = defaultdict(set)
    active: dict[str, int] = defaultdict(int)
    waiting: dict[tuple[str, str], int] = defaultdict(int)  # (GPU, worker) -> WAITING there
    for d in snap.deployments.values():
        if d.level in RESERVING:
            active[d.model] += 1
        if d.level is Level.WAITING:
            for gpu_id in d.gpus:
                waiting[(gpu_id, d.worker)] += 1
        if snap.workers and d.level is not Level.COLD and d.worker not in snap.workers:
            problems.append(
                f"replica {d.replica} ({d.model}) is {d.level.value} on worker {d.worker}, "
                "which has no record: what it holds is charged to no worker"
            )
        on_gpu = d.level in RESERVING or d.level in ON_DEVICE
        if on_gpu and not d.gpus:
            problems.append(f"replica {d.replica} is {d.level.value} but holds no GPU bytes")
        if not on_gpu and d.gpus:
            problems.append(f"replica {d.replica} is {d.level.value} but holds GPU bytes")
        for gpu_id, nbytes in d.gpus.items():
            if gpu_id not in snap.gpus:
                problems.append(f"replica {d.replica} holds bytes on unknown GPU {gpu_id}")
            reserved[gpu_id] += nbytes if d.level in RESERVING else 0
            held[gpu_id] += nbytes if d.level in ON_DEVICE else 0
        if d.level in (Level.WARM, Level.OFFLOADING):
            warm[d.host] += d.cached
        if d.level is Level.WARM:
            warm_ids[d.host].add(d.replica)
        waited = snap.now_ms - d.since_ms
        if d.level in PENDING and d.since_ms and waited > pending_bound_ms:
            problems.append(
                f"replica {d.replica} ({d.model}) has been {d.level.value} for "
                f"{waited / 1000:.0f} s, waiting for worker {d.worker}"
            )
    for g in snap.gpus.values():
        reserved[g.id] += sum(g.contexts.values())
        held[g.id] += sum(g.contexts.get(w, 0) for w in g.held_contexts)
        for worker in sorted(set(g.contexts) - set(snap.workers)) if snap.workers else ():
            problems.append(f"GPU {g.id} charges a CUDA context for unknown worker {worker}")
        for worker in sorted(set(g.contexts) - g.held_contexts):  # no load opened it yet
            relying, counted = waiting[(g.id, worker)], g.waiting_contexts.get(worker, 0)
            if not relying:
                problems.append(
                    f"GPU {g.id} charges a CUDA context of worker {worker} that no placement "
                    "opened or waits to open"
                )
            elif counted != relying:
                problems.append(
                    f"GPU {g.id} counts {counted} placements of worker {worker} waiting on "
                    f"its CUDA context, but {relying} are WAITING there"
                )
        for name, counted, actual in (
            ("reserves", g.reserved, reserved[g.id]),
            ("holds", g.held, held[g.id]),
        ):
            if counted > g.total:
                problems.append(f"GPU {g.id} {name} {counted} > total {g.total}")
            if counted != actual:
                problems.append(
                    f"GPU {g.id} {name} {counted} but its deployments add up to {actual}"
                )
    for h in snap.hosts.values():
        if h.warm_used > h.warm_budget:
            problems.append(f"host {h.name} warm cache {h.warm_used} > budget {h.warm_budget}")
        if h.warm_used != warm[h.name]:
            problems.append(
                f"host {h.name} counts {h.warm_used} warm bytes but its WARM and OFFLOADING "
                f"replicas hold {warm[h.name]}"
            )
        if h.warm != warm_ids[h.name]:
            problems.append(
                f"host {h.name} indexes warm copies {sorted(h.warm)} but its WARM replicas "
                f"are {sorted(warm_ids[h.name])}"
            )
    for model in set(snap.active) | set(active):
        count = snap.active.get(model, 0)
        if count != active[model]:
            problems.append(
                f"model {model} counts {count} active replicas, records show {active[model]}"
            )
    return problems


def report_problems(snap: Snapshot, grace_ms: int = REPORT_GRACE_MS) -> list[str]:
    """The ledger against what its workers report holding (their heartbeats).

    A record is compared once its worker's report is `grace_ms` newer than the record's
    last change, so a move under way is never a problem:
    - a replica the ledger keeps on a worker (HOT, DRAINING, WARM) is reported by that
      worker, at that level, in that epoch and on the ledger's GPUs;
    - a worker holds no copy the ledger does not give it;
    - nothing is left on a worker whose lease lapsed more than `grace_ms` ago.
    """
    problems: list[str] = []
    for d in snap.deployments.values():
        if d.level is Level.COLD or not d.worker:
            continue
        deadline = snap.workers.get(d.worker)
        if deadline is not None and snap.now_ms - deadline > grace_ms:
            problems.append(
                f"replica {d.replica} ({d.model}) is {d.level.value} on worker {d.worker}, "
                f"whose lease lapsed {(snap.now_ms - deadline) / 1000:.0f} s ago"
            )
            continue
        report = snap.reports.get(d.worker)
        if report is None or report.at_ms < d.since_ms + grace_ms or d.level in PENDING:
            continue
        mine = {h.replica: h for h in report.holdings}
        found = mine.get(d.replica)
        if found is None or not _agrees(d, found):
            problems.append(
                f"worker {d.worker} does not hold {d.model} replica {d.replica} as the ledger "
                f"does ({_ledger_view(d)}); it reports {_report_view(found)}"
            )
    for report in snap.reports.values():
        if snap.now_ms - snap.workers.get(report.worker, 0) > grace_ms:
            continue  # a dead worker's last report says nothing of now
        for h in report.holdings:
            record = snap.deployments.get(h.replica)
            if record is not None and report.at_ms < record.since_ms + grace_ms:
                continue
            if record is None or record.worker != report.worker or record.level is Level.COLD:
                owner = f"worker {record.worker}" if record is not None and record.worker else ""
                problems.append(
                    f"worker {report.worker} holds replica {h.replica} "
                    f"({_report_view(h)}), which the ledger gives to {owner or 'nobody'}"
                )
            elif h.level not in _MAY_HOLD.get(record.level, frozenset()):
                problems.append(
                    f"worker {report.worker} holds replica {h.replica} {_report_view(h)} "
                    f"but the ledger has it {_ledger_view(record)}"
                )
    return problems


def _agrees(d: Deployment, h: Holding) -> bool:
    if h.level not in _MAY_HOLD.get(d.level, frozenset()) or h.epoch != d.epoch:
        return False
    return h.level is not Level.HOT or dict(h.gpus) == dict(d.gpus)


def _ledger_view(d: Deployment) -> str:
    where = f" on {', '.join(sorted(d.gpus))}" if d.gpus else ""
    return f"{d.level.value}{where}, epoch {d.epoch}"


def _report_view(h: Holding | None) -> str:
    if h is None:
        return "no copy of it"
    where = f" on {', '.join(sorted(h.gpus))}" if h.gpus else ""
    return f"{h.level.value}{where}, epoch {h.epoch}"
