"""Properties of the placement policy over random fleets (hypothesis)."""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import given, settings
from hypothesis import strategies as st

from placement.errors import CantAccommodateError, NeverFitsError
from placement.ledger.audit import audit
from placement.policy.mirror import apply_plan
from placement.policy.place import plan_replica
from placement.policy.settings import PolicySettings
from placement.policy.sizing import single_gpu_slot
from placement.policy.state import (
    Candidate,
    Demand,
    Deployment,
    Gpu,
    Host,
    Level,
    Plan,
    Snapshot,
)
from tests.fleets import GiB, fleet, gpu, hot, warm

SIZES = [8, 16, 24, 40, 80]


@st.composite
def fleets(draw: st.DrawFn) -> Snapshot:
    """A consistent fleet: 1-6 GPUs on 1-3 hosts, one worker each, partly filled with
    replicas; a GPU may charge another worker's CUDA context (`Gpu.context`)."""
    n = draw(st.integers(1, 6))
    context = draw(st.sampled_from([0, 0, GiB // 2, GiB]))
    gpus = [
        replace(
            gpu(
                f"g{i}",
                draw(st.sampled_from(SIZES)) * GiB,
                host=f"h{draw(st.integers(0, 2))}",
                index=i,
            ),
            context=context,
        )
        for i in range(n)
    ]
    deps = _filled(draw, gpus, GiB // 2, 8)
    hosts = [Host(f"h{h}", warm_budget=draw(st.integers(0, 8)) * GiB) for h in range(3)]
    for k in range(draw(st.integers(0, 3))):
        host = hosts[draw(st.integers(0, 2))]
        size = draw(st.integers(1, 4)) * GiB // 2
        if host.warm_free >= size:
            hosts[int(host.name[1:])] = replace(host, warm_used=host.warm_used + size)
            deps.append(warm(f"w{k}", f"m{draw(st.integers(0, 9))}", size, host=host.name))
    hosts = [replace(h, warm_used=0) for h in hosts]  # fleet() recounts warm usage
    return fleet(gpus, deps, hosts)


def _filled(draw: st.DrawFn, gpus: list[Gpu], unit: int, most: int) -> list[Deployment]:
    """Up to three HOT replicas of models m0-m9 on each GPU, of 1 to `most` x `unit` bytes
    each, while they fit: some dedicated, some busy, used at various times."""
    deps: list[Deployment] = []
    for i, g in enumerate(gpus):
        free = g.total
        for j in range(draw(st.integers(0, 3))):
            nbytes = draw(st.integers(1, most)) * unit
            if nbytes > free:
                break
            free -= nbytes
            deps.append(
                hot(
                    f"r{i}-{j}",
                    f"m{draw(st.integers(0, 9))}",
                    {g.id: nbytes},
                    host=g.host,
                    used=draw(st.integers(0, 1000)),
                    dedicated=draw(st.booleans()),
                    leases=draw(st.sampled_from([0, 0, 0, 1])),
                    size=nbytes // 2,
                )
            )
    return deps


demands = st.one_of(
    st.builds(
        Demand,
        model=st.sampled_from([f"m{i}" for i in range(10)] + ["new"]),
        size=st.integers(1, 200).map(lambda x: x * GiB // 4),
        dedicated=st.booleans(),
    ),
    st.builds(
        Demand,
        model=st.just("env"),
        request=st.integers(1, 40).map(lambda x: x * GiB // 2),
        limit=st.none(),
    ),
    st.builds(Demand, model=st.just("static"), gpus=st.sampled_from([0.25, 0.5, 1, 2])),
)


def _applied_unless_full(demand: Demand, snap: Snapshot, seed: int) -> tuple[Plan, Snapshot] | None:
    """The policy's plan and the snapshot once it commits, or None when it cannot place
    the demand now."""
    try:
        plan = plan_replica(demand, snap, rng=random.Random(seed))
    except CantAccommodateError:
        return None
    return plan, apply_plan(snap, plan)


def _empty(snap: Snapshot) -> Snapshot:
    return fleet([replace(g, reserved=0) for g in snap.gpus.values()])


@settings(max_examples=300, deadline=None)
@given(snap=fleets(), demand=demands, seed=st.integers(0, 2**16))
def test_every_plan_admits_its_limit_after_evicting_only_idle_non_dedicated_replicas(
    snap: Snapshot, demand: Demand, seed: int
) -> None:
    try:
        plan = plan_replica(demand, snap, rng=random.Random(seed))
    except NeverFitsError:
        # Never-fits is a property of the fleet's shape, not of what is loaded now.
        try:
            plan_replica(demand, _empty(snap), rng=random.Random(seed))
        except NeverFitsError:
            return
        raise AssertionError("NeverFits although the empty fleet takes the model") from None
    except CantAccommodateError:
        plan_replica(demand, _empty(snap), rng=random.Random(seed))  # must fit when empty
        return
    if plan.candidate is Candidate.DEPLOYED:
        assert snap.deployments[plan.replica].model == demand.model
        return
    victims = [snap.deployments[e.replica] for e in plan.evictions]
    assert all(v.evictable for v in victims)
    for gpu_id, nbytes in plan.gpus.items():
        g = snap.gpus[gpu_id]
        freed = sum(v.gpus.get(gpu_id, 0) for v in victims)
        limit = plan.limit if len(plan.gpus) == 1 else nbytes
        assert g.reserved - freed + max(limit, nbytes) + g.charge_for(plan.worker) <= g.total
    assert len({snap.gpus[g].host for g in plan.gpus}) == 1
    after = apply_plan(snap, plan)
    assert audit(after) == []


@settings(max_examples=300, deadline=None)
@given(snap=fleets(), demand=demands, seed=st.integers(0, 2**16))
def test_no_replica_is_evicted_when_some_gpu_has_room_already(
    snap: Snapshot, demand: Demand, seed: int
) -> None:
    room = any(
        g.alive(snap.now_ms)
        and (slot := single_gpu_slot(demand, g.total, PolicySettings())) is not None
        and g.reserved + slot[1] <= g.total
        for g in snap.gpus.values()
    )
    try:
        plan = plan_replica(demand, snap, rng=random.Random(seed))
    except CantAccommodateError:
        assert not room
        return
    if room and plan.candidate is not Candidate.DEPLOYED:
        assert plan.evictions == ()
        assert plan.candidate in (Candidate.FREE, Candidate.CACHED_AND_FREE)


@settings(max_examples=200, deadline=None)
@given(snap=fleets(), demand=demands, seed=st.integers(0, 2**16))
def test_warm_destinations_never_overfill_a_hosts_cache(
    snap: Snapshot, demand: Demand, seed: int
) -> None:
    placed = _applied_unless_full(demand, snap, seed)
    if placed is None:
        return
    plan, after = placed
    for host in after.hosts.values():
        assert 0 <= host.warm_used <= host.warm_budget
    dropped = {r for r in plan.warm_drops}
    assert all(snap.deployments[r].level is Level.WARM for r in dropped)
    assert plan.replica not in dropped


@st.composite
def shared_hosts(draw: st.DrawFn) -> Snapshot:
    """One host of 2-4 GPUs of 8 GiB, one worker each, each charging 1 GiB for another
    worker's CUDA context, filled in eighths of a GiB; worker w-g0 holds a warm copy of
    model "m"."""
    gpus = [
        replace(gpu(f"g{i}", 8 * GiB, index=i), context=GiB) for i in range(draw(st.integers(2, 4)))
    ]
    deps = _filled(draw, gpus, GiB // 8, 40)
    size = draw(st.integers(1, 16)) * GiB // 8
    deps.append(warm("w", "m", size, worker="w-g0"))
    return fleet(gpus, deps, [Host("h0", warm_budget=64 * GiB)])


@settings(max_examples=300, deadline=None)
@given(
    snap=shared_hosts(),
    demand=st.one_of(
        st.builds(Demand, model=st.just("m"), size=st.integers(1, 16).map(lambda x: x * GiB // 8)),
        st.builds(Demand, model=st.just("big"), size=st.integers(9, 40).map(lambda x: x * GiB)),
        st.builds(Demand, model=st.just("pair"), gpus=st.sampled_from([2, 3])),
    ),
    seed=st.integers(0, 2**16),
)
def test_a_plan_leaves_room_for_every_cuda_context_its_loader_opens(
    snap: Snapshot, demand: Demand, seed: int
) -> None:
    placed = _applied_unless_full(demand, snap, seed)
    if placed is None:
        return
    plan, after = placed
    assert audit(after) == []  # no GPU reserves past its total, contexts included
    opened = [g for g in plan.gpus if snap.gpus[g].worker != plan.worker]
    for gpu_id in opened:
        assert after.gpus[gpu_id].contexts == {plan.worker: GiB}
