"""Invariants of a registry snapshot, checked by tests, the concurrency soak and operators.

Pure: give it a `Snapshot` and it lists every broken rule in words. An empty list
means the ledger is consistent.
"""

from __future__ import annotations

from collections import defaultdict

from placement.state import ON_GPU, Level, Snapshot


def audit(snap: Snapshot) -> list[str]:
    """Every way `snap` breaks the ledger's rules.

    - each GPU: `reserved <= total`, and `reserved` equals the bytes its deployments hold;
    - each host: `warm_used <= warm_budget`, and equals the sizes of its WARM replicas,
      whose ids its warm index lists;
    - WARM and COLD replicas hold no GPU bytes; replicas on GPU hold some;
    - each model's stored `active` counter equals its replicas on GPU.
    """
    problems: list[str] = []
    held: dict[str, int] = defaultdict(int)
    warm: dict[str, int] = defaultdict(int)
    warm_ids: dict[str, set[str]] = defaultdict(set)
    active: dict[str, int] = defaultdict(int)
    for d in snap.deployments.values():
        if d.level in ON_GPU:
            active[d.model] += 1
            if not d.gpus:
                problems.append(f"replica {d.replica} is {d.level.value} but holds no GPU bytes")
            for gpu_id, nbytes in d.gpus.items():
                held[gpu_id] += nbytes
                if gpu_id not in snap.gpus:
                    problems.append(f"replica {d.replica} holds bytes on unknown GPU {gpu_id}")
        elif d.gpus:
            problems.append(f"replica {d.replica} is {d.level.value} but holds GPU bytes")
        if d.level is Level.WARM:
            warm[d.host] += d.size
            warm_ids[d.host].add(d.replica)
    for g in snap.gpus.values():
        if g.reserved > g.total:
            problems.append(f"GPU {g.id} reserves {g.reserved} > total {g.total}")
        if g.reserved != held[g.id]:
            problems.append(
                f"GPU {g.id} reserves {g.reserved} but its deployments hold {held[g.id]}"
            )
    for h in snap.hosts.values():
        if h.warm_used > h.warm_budget:
            problems.append(f"host {h.name} warm cache {h.warm_used} > budget {h.warm_budget}")
        if h.warm_used != warm[h.name]:
            problems.append(
                f"host {h.name} counts {h.warm_used} warm bytes but its WARM replicas "
                f"hold {warm[h.name]}"
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
