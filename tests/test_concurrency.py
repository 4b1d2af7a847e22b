"""The registry under concurrency: a multi-process soak, and the races it is made of.

The soak (`tests/soak.py`) runs eight OS processes for at least 20 seconds against one
redis-server. Each owns a simulated worker and issues random deploys, evicts, routes,
finishes, heartbeats, reaps and deliberate expiries, some planned on stale reads, while
this process audits the ledger. Afterwards the event stream is replayed against the
ledger and the children's request leases and worker leases, and every worker is shut
down: nothing may be left behind.

Set ``GPUFLEET_SOAK_SECONDS`` to run longer, ``GPUFLEET_SOAK_SEED`` to replay a seed
(each child's choices replay; the interleaving of processes does not).

The tests after the soak pin down, one interleaving each, the bugs the soak found:
an operation that read a snapshot, then ran its script after the fleet moved.
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import redis

from placement.ledger.audit import audit
from placement.ledger.registry import Registry
from placement.policy.state import Demand, Gpu, Level, Snapshot
from tests.acting import evict_now, make_hot, settle_leaving
from tests.conftest import delete_fleet_keys
from tests.soak import EVENTS_MAXLEN, SoakResult, run_soak
from tests.soak_checks import ownership_problems

GiB = 2**30

SOAK_SECONDS = max(20.0, float(os.environ.get("GPUFLEET_SOAK_SECONDS") or 20))
SOAK_PROCESSES = 8

#: Activity a soak must show, so that its checks cannot pass vacuously. Tuned to about
#: a quarter of what a loaded two-core machine does in 20 s.
MINIMUM_EVENTS = {
    "placed": 60,
    "ready": 150,
    "evicted:pressure->WARM": 25,
    "restored": 40,
    "evicted:explicit->WARM": 40,
    "evicted:explicit->COLD": 10,
    "draining": 20,
    "dropped": 10,
    "reaped:expired": 8,
    "released": 10,
    "placed:multi-gpu": 3,
    "placed:across-workers": 1,
    "admitted": 3,
    "settled": 100,
}
MINIMUM_OUTCOMES = {
    "route:ok": 300,
    "route:lost": 20,
    "finish:HOT": 300,
    "heartbeat:ok": 200,
    "heartbeat:late_refused": 8,
    "reap_expired:calls": 50,
    "deploy:with_evictions": 20,
    "deploy:cant": 1,
    "deploy:own_gpus": 20,
    "stale:used": 100,
    "stale:before_expiry": 20,
    "settle:offloaded->WARM": 25,
    "settle:dropped->COLD": 10,
    "confirm:ok": 150,
}


TOO_LITTLE = "too little activity"


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    registry = Registry.from_url(redis_url, fleet, events_maxlen=EVENTS_MAXLEN)
    yield registry
    registry.client.close()


# --- the soak -----------------------------------------------------------------------


def _soak_failures(result: SoakResult) -> list[str]:
    failures: list[str] = []
    if result.exitcodes != [0] * result.processes:
        failures.append(f"child exit codes {result.exitcodes}")
    short = [r.index for r in result.reports if r.elapsed_s < result.seconds]
    if short:
        failures.append(f"children {short} ran shorter than {result.seconds:g} s")
    violations = [f"child {r.index}: {v}" for r in result.reports for v in r.violations]
    if violations:
        failures.append("contract breaches seen by children:\n  " + "\n  ".join(violations[:10]))
    if result.audits < 20:
        failures.append(f"{TOO_LITTLE}: only {result.audits} audits during the run (want >= 20)")
    for name in (
        "audit_failures",
        "ownership_failures",
        "replay_failures",
        "lease_failures",
        "leaks",
    ):
        found = getattr(result, name)
        if found:
            failures.append(f"{name} ({len(found)}):\n  " + "\n  ".join(found[:10]))
    for kind, least in MINIMUM_EVENTS.items():
        if result.events.get(kind, 0) < least:
            failures.append(f"{TOO_LITTLE}: {kind} events {result.events.get(kind, 0)} < {least}")
    counts = result.counts
    for outcome, least in MINIMUM_OUTCOMES.items():
        if counts[outcome] < least:
            failures.append(f"{TOO_LITTLE}: {outcome} {counts[outcome]} < {least}")
    reach = result.lease_reach
    if reach.get("near", 0) < 100:
        failures.append(f"{TOO_LITTLE}: the lease check reached few evictions: {reach}")
    if reach.get("after_lost", 0) < 1:
        failures.append(f"{TOO_LITTLE}: no eviction after a lost lease expired: {reach}")
    return failures


@pytest.mark.slow
@pytest.mark.timeout(int(SOAK_SECONDS * 3 + 240))
def test_eight_processes_for_twenty_seconds_never_double_book_or_leak(
    redis_url: str, fleet: str, tmp_path: Path
) -> None:
    seed = os.environ.get("GPUFLEET_SOAK_SEED") or str(random.SystemRandom().randrange(10**9))
    result = run_soak(
        redis_url, fleet, tmp_path, seed=seed, processes=SOAK_PROCESSES, seconds=SOAK_SECONDS
    )
    print(result.summary())
    failures = _soak_failures(result)
    if failures and all(f.startswith(TOO_LITTLE) for f in failures):
        # The activity minimums keep the checks from passing vacuously; a machine too busy
        # to reach them in the time (ready events 147 < 150 once, beside another test
        # file's fleet) gets a run twice as long, of a fleet of its own, to judge instead.
        again = tmp_path / "again"
        again.mkdir()
        client = redis.Redis.from_url(redis_url)
        try:
            result = run_soak(
                redis_url, f"{fleet}-again", again, seed=seed, processes=SOAK_PROCESSES,
                seconds=2 * SOAK_SECONDS,
            )  # fmt: skip
        finally:
            delete_fleet_keys(client, f"{fleet}-again")
            client.close()
        print(result.summary())
        failures = _soak_failures(result)  # every check held in the first; this one decides
    assert not failures, "\n".join([*failures, "", result.summary()])


# --- races, one interleaving at a time --------------------------------------------------


def sim_gpu(gpu_id: str, total: int = 8 * GiB) -> Gpu:
    host, index = gpu_id.split(":")
    return Gpu(id=gpu_id, host=host, index=int(index), name="Sim", total=total)


def place_hot(reg: Registry, demand: Demand) -> str:
    return make_hot(reg, reg.place(demand, rng=random.Random(0)))


def stale_first(reg: Registry, stale: Snapshot) -> Callable[[], Snapshot]:
    """A `snapshot` that returns `stale` once, then reads the registry again.

    This is the interleaving "read the ledger, then lose the CPU while other processes
    move the fleet, then run the script".
    """
    fresh = reg.snapshot
    calls = iter([stale])
    return lambda: next(calls, None) or fresh()


def test_a_stale_explicit_evict_does_not_let_a_dead_workers_reap_release_a_live_replica(
    reg: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """evict.lua trusts the snapshot's worker: the replica's new owner keeps a stale link.

    R runs on w1's GPU; an evict reads the ledger; w1 dies and is reaped, w2 takes the
    GPU over and R is placed there again. The evict's script still sees R on the same
    GPU, so it drops R and removes it from w1's deployment set instead of w2's. Later
    R runs on w3, and reaping the dead w2 then releases R from under w3 and drops its
    request lease.
    """
    model = Demand("m", size=GiB)
    reg.register_worker("w1", "h0", "q1", [sim_gpu("h0:0")], lease_ms=60_000)
    replica = place_hot(reg, model)
    stale = reg.snapshot()
    reg.reap("w1", force=True)
    reg.register_worker("w2", "h0", "q2", [sim_gpu("h0:0")], lease_ms=300)
    assert place_hot(reg, model) == replica  # the COLD record is reused on the same GPU

    monkeypatch.setattr(reg, "snapshot", stale_first(reg, stale))
    assert reg.evict(replica, to=Level.COLD) is Level.DROPPING
    monkeypatch.undo()
    settle_leaving(reg)
    links = ownership_problems(reg)

    time.sleep(0.4)  # w2's lease lapses; the model goes to a new worker w3
    reg.register_worker("w3", "h1", "q3", [sim_gpu("h1:0")], lease_ms=60_000)
    assert place_hot(reg, model) == replica
    lease = reg.pick("m", ttl_ms=60_000)
    assert lease is not None and lease.worker == "w3"
    assert reg.reap_expired() == ["w2"]

    after = reg.snapshot().deployments[replica]
    assert (after.level, after.worker, after.leases) == (Level.HOT, "w3", 1), (
        f"reaping dead w2 released live w3's replica; right after the stale evict the "
        f"ownership links were already broken: {links}"
    )


def test_a_stale_explicit_drop_of_a_warm_copy_debits_the_host_that_holds_it(
    reg: Registry, monkeypatch: pytest.MonkeyPatch
) -> None:
    """evict.lua drops a WARM copy without checking that it is the copy the caller saw.

    R is WARM on h0; an evict(to=COLD) reads the ledger; meanwhile R is dropped, placed
    on h1 and offloaded WARM there. The stale script drops R again, debiting h0's warm
    cache (which no longer holds it) and leaving h1's counted forever.
    """
    model = Demand("m", size=GiB)
    reg.register_worker("w1", "h0", "q1", [sim_gpu("h0:0")], warm_budget=4 * GiB)
    replica = place_hot(reg, model)
    assert evict_now(reg, replica) is Level.WARM
    stale = reg.snapshot()
    assert evict_now(reg, replica, to=Level.COLD) is Level.COLD
    reg.reap("w1", force=True)
    reg.register_worker("w2", "h1", "q2", [sim_gpu("h1:0")], warm_budget=4 * GiB)
    assert place_hot(reg, model) == replica
    assert evict_now(reg, replica) is Level.WARM  # now WARM on h1

    monkeypatch.setattr(reg, "snapshot", stale_first(reg, stale))
    reg.evict(replica, to=Level.COLD)
    monkeypatch.undo()
    settle_leaving(reg)

    assert audit(reg.snapshot()) == []


def test_offloading_a_replica_that_is_already_warm_keeps_it_warm(reg: Registry) -> None:
    """evict(to=None) of a WARM copy must not drop it just because the cache is full.

    Its own bytes are already in the cache; plan_offload counts them as if it had to
    find room for them a second time, so the copy goes COLD.
    """
    model = Demand("m", size=3 * GiB)
    reg.register_worker("w1", "h0", "q1", [sim_gpu("h0:0", 16 * GiB)], warm_budget=4 * GiB)
    replica = place_hot(reg, model)
    assert evict_now(reg, replica) is Level.WARM
    assert evict_now(reg, replica) is Level.WARM
