"""Prefix routing on a real Redis: `pick.lua` and `forward.lua` send a call to the replica
its prompt's longest prefix was last sent to, spill to the least busy replica past the
bound, and route a new prefix by load."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import Iterator

import pytest

from placement.ledger.hot import Forwarded, Handover
from placement.ledger.registry import Registry
from placement.policy.state import Demand, Gpu
from placement.rules import prefixes
from tests.fleets import GiB

SYSTEM = "You are the support desk of a shop that sells bicycles and their parts. " * 8
TAKEN = b'{"body": "e30=", "headers": {"id": "call-1"}}'
PARTS = ('{"body": "e30=", "headers": {"id": "call-1", "lease": ', '}, "x": ', "}")


@pytest.fixture
def reg(redis_url: str, fleet: str) -> Iterator[Registry]:
    """A registry with two workers, each holding one HOT replica of "m"."""
    registry = Registry.from_url(redis_url, fleet)
    for n in range(2):
        gpu = Gpu(id=f"h{n}:0", host=f"h{n}", index=0, name="Sim", total=8 * GiB)
        registry.register_worker(f"w{n}", f"h{n}", f"{fleet}.q{n}", [gpu])
    for n in range(2):
        plan = registry.place(Demand("m", size=GiB, replicas=2), rng=random.Random(n))
        assert registry.confirm(plan.replica, plan.worker, plan.epoch)
    assert len(registry.snapshot().by_model["m"]) == 2
    yield registry
    broker_keys = registry.client.keys(f"{fleet}.*")
    if broker_keys:
        registry.client.delete(*broker_keys)


def _pick(reg: Registry, prompt: str, tenant: str = "") -> str:
    lease = reg.pick("m", path="router", prefix=prefixes.chain(prompt, None, tenant))
    assert lease is not None
    return lease.replica


def test_calls_of_one_prefix_go_to_the_replica_that_served_it_first_while_it_is_not_too_busy(
    reg: Registry,
) -> None:
    first = _pick(reg, SYSTEM + "Where is my order?")
    # it holds a lease now: by load alone the next call would go to the other replica
    assert [_pick(reg, SYSTEM + f"question {i}") for i in range(prefixes.SPILL)] == [
        first
    ] * prefixes.SPILL
    spilled = _pick(reg, SYSTEM + "one too many")  # SPILL + 1 leases above the other's 0
    assert spilled != first
    assert _pick(reg, "A prompt of its own, nothing like the support desk's. " * 4) == spilled
    stats = reg.client.hgetall(reg.keys.model_stats("m"))
    counts = {k: int(v) for k, v in stats.items() if k.startswith("prefix_")}
    assert counts == {"prefix_new": 2, "prefix_hit": prefixes.SPILL, "prefix_spill": 1}


def test_the_longest_prefix_a_replica_served_wins_over_a_shorter_one(reg: Registry) -> None:
    short = _pick(reg, SYSTEM[:256] + "a different long middle part. " * 20)
    long = _pick(reg, SYSTEM + "first")  # shares its first 256 characters with the first
    assert long == short  # the 256 characters matched: it went where they were
    reg.client.delete(reg.keys.leases(short))  # both idle again
    other = next(d.replica for d in reg.snapshot().by_model["m"] if d.replica != short)
    prefix_map = reg.keys.prefixes("m")
    for digest in prefixes.chain(SYSTEM + "first")[2:]:  # its longer prefixes: elsewhere
        reg.client.hset(prefix_map, digest, other)
    assert _pick(reg, SYSTEM + "second") == other


def test_a_tenant_s_prefix_never_routes_another_tenant_s_calls(reg: Registry) -> None:
    assert prefixes.chain(SYSTEM, None, "a") != prefixes.chain(SYSTEM, None, "b")
    assert prefixes.chain(SYSTEM, {"adapter": "x"}) != prefixes.chain(SYSTEM)
    a = _pick(reg, SYSTEM, tenant="a")
    b = _pick(reg, SYSTEM, tenant="b")  # a new prefix to it: by load, the idle replica
    assert a != b


def test_a_prefix_of_a_replica_that_left_goes_to_the_one_that_serves_it_now(
    reg: Registry,
) -> None:
    first = _pick(reg, SYSTEM + "x")
    prefix_map = reg.keys.prefixes("m")
    for digest in prefixes.chain(SYSTEM + "x"):
        reg.client.hset(prefix_map, digest, "a-replica-long-gone")
    again = _pick(reg, SYSTEM + "x")
    assert again != first  # by load: the other replica is idle
    owners = {reg.client.hget(prefix_map, d) for d in prefixes.chain(SYSTEM + "x")}
    assert owners == {again}


def test_the_routers_forward_follows_the_prefix_too(reg: Registry, fleet: str) -> None:
    first = _pick(reg, SYSTEM + "one")
    inflight = f"{fleet}.inflight.router@h0"
    reg.client.lpush(inflight, TAKEN)
    handover = Handover(inflight, TAKEN, PARTS, "", (f"{fleet}.calls",))
    forwarded = reg.forward("m", handover, path="router", prefix=prefixes.chain(SYSTEM + "two"))
    assert isinstance(forwarded, Forwarded) and forwarded.lease.replica == first
    assert forwarded.drained  # the router's list, not the prefix map, was looked at


def test_a_prompt_shorter_than_a_chunk_or_a_call_of_no_text_has_no_chain() -> None:
    assert prefixes.chain("short") == []
    assert prefixes.chain(None) == [] and prefixes.chain([1, 2]) == []
    chat = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hi"}]
    same = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "bye"}]
    assert prefixes.chain(chat)[:-1] == prefixes.chain(same)[:-1]
    assert len(prefixes.chain("y" * 100_000)) == prefixes.MAX_CHUNKS


def _hold_one_lease_each(reg: Registry) -> list[str]:
    """Every replica of "m" with one live lease: a tie by load, every replica busy."""
    replicas = sorted(d.replica for d in reg.snapshot().by_model["m"])
    for replica in replicas:
        reg.client.delete(reg.keys.leases(replica))
        reg.client.zadd(reg.keys.leases(replica), {f"held-{replica}": 10**13})
    return replicas


def test_new_prefixes_spread_over_busy_replicas_and_a_trickle_leaves_the_spare_idle(
    reg: Registry,
) -> None:
    chosen = []
    for n in range(4):
        _hold_one_lease_each(reg)  # calls enough to keep both replicas busy
        prompt = f"System prompt number {n}. " * 12
        chosen.append(_pick(reg, prompt))
        _pick(reg, prompt + "and a question")  # prefixes are reused: they bring load
    assert sorted(Counter(chosen).values()) == [2, 2]  # by the new prefixes each was sent
    for replica in _hold_one_lease_each(reg):
        reg.client.delete(reg.keys.leases(replica))
    # one call at a time, each ended before the next: the spare gets none, and idles out
    trickle = [_pick_and_finish(reg, f"A new system prompt {n}. " * 12) for n in range(6)]
    assert trickle == [min(chosen)] * 6  # the first by id, as without a prefix


def test_prompts_that_share_nothing_go_by_load_alone_however_many_each_replica_owns(
    reg: Registry,
) -> None:
    busier, idler = _hold_one_lease_each(reg)
    reg.client.zadd(reg.keys.leases(busier), {"a-second-call": 10**13})  # 2 calls, and 1
    reg.client.hset(reg.keys.prefixes("m"), f"#{idler}", 50)  # it was sent many prefixes
    # the least busy, as without a prefix: no prefix of the model served a call again
    assert _pick(reg, "A prompt of its own, nothing like any other. " * 8) == idler


def _pick_and_finish(reg: Registry, prompt: str) -> str:
    """The replica a call of `prompt` goes to, the call ended at once (its replica idle)."""
    lease = reg.pick("m", path="router", prefix=prefixes.chain(prompt, None, ""))
    assert lease is not None
    reg.finish(lease)
    return lease.replica


def test_a_prefix_whose_replica_left_its_gpu_moves_to_a_ready_one_and_stays_there(
    reg: Registry,
) -> None:
    first = _pick(reg, SYSTEM + "x")
    reg.client.hset(reg.keys.deployment(first), "level", "WARM")  # evicted to the host
    moved = _pick(reg, SYSTEM + "y")
    assert moved != first
    reg.client.hset(reg.keys.deployment(first), "level", "HOT")  # back, busier by nothing
    reg.client.delete(*(reg.keys.leases(r) for r in (first, moved)))
    assert _pick(reg, SYSTEM + "z") == moved  # the prefix went with the call that moved
    stats = reg.client.hgetall(reg.keys.model_stats("m"))
    assert (stats["prefix_new"], stats["prefix_hit"]) == ("2", "1")
