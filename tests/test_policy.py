"""The placement policy on hand-built fleets: the seeds' worked examples and the rules."""

from __future__ import annotations

import random
from collections import Counter
from dataclasses import replace

import pytest

from placement.errors import CantAccommodateError, NeverFitsError, PlacementError
from placement.policy.place import plan_offload, plan_replica
from placement.policy.settings import GpuChoice, PolicySettings, VictimOrder
from placement.policy.state import Candidate, Demand, Host, Level, Snapshot
from placement.units import accelerators
from tests.fleets import GB, GiB, fleet, gpu, hot, warm

# --- seed 003: admission control with request and limit ----------------------


def test_a_new_limit_plus_loaded_requests_within_gpu_memory_is_admitted() -> None:
    # 8 GB + (4 GB + 3 GB) = 15 GB <= 16 GB
    snap = fleet(
        [gpu("g", 16 * GB)],
        [
            hot("a", "engine-a", {"g": 4 * GB}, dedicated=True),
            hot("b", "engine-b", {"g": 3 * GB}, dedicated=True),
        ],
    )
    plan = plan_replica(Demand("new", request=6 * GB, limit=8 * GB), snap)
    assert plan.candidate is Candidate.FREE
    assert plan.gpus == {"g": 6 * GB}
    assert plan.limit == 8 * GB
    assert plan.evictions == ()


def test_a_new_limit_that_would_overcommit_loaded_requests_is_refused() -> None:
    # 10 GB + (4 GB + 3 GB) = 17 GB > 16 GB, and both loaded engines are dedicated
    snap = fleet(
        [gpu("g", 16 * GB)],
        [
            hot("a", "engine-a", {"g": 4 * GB}, dedicated=True),
            hot("b", "engine-b", {"g": 3 * GB}, dedicated=True),
        ],
    )
    with pytest.raises(CantAccommodateError, match="may not be evicted"):
        plan_replica(Demand("new", request=6 * GB, limit=10 * GB), snap)


def test_an_overcommitting_limit_evicts_an_idle_engine_to_be_admitted() -> None:
    snap = fleet(
        [gpu("g", 16 * GB)],
        [hot("a", "engine-a", {"g": 4 * GB}), hot("b", "engine-b", {"g": 3 * GB}, dedicated=True)],
    )
    plan = plan_replica(Demand("new", request=6 * GB, limit=10 * GB), snap)
    assert plan.candidate is Candidate.FULL
    assert [e.replica for e in plan.evictions] == ["a"]


# --- seed 002: bytes, not fractions --------------------------------------------


@pytest.mark.parametrize(("total_gib", "fraction"), [(40, 0.25), (80, 0.125)])
def test_ten_gib_is_a_quarter_of_a_40_gib_gpu_and_an_eighth_of_an_80_gib_gpu(
    total_gib: int, fraction: float
) -> None:
    snap = fleet([gpu("g", total_gib * GiB)])
    plan = plan_replica(Demand("m", request=10 * GiB), snap)
    assert plan.gpus == {"g": 10 * GiB}
    assert plan.fraction == fraction


def test_a_tiny_request_rounds_its_fraction_up_to_one_ten_thousandth() -> None:
    snap = fleet([gpu("g", 40 * GB)])
    plan = plan_replica(Demand("m", request=10 * 10**6), snap)
    assert plan.fraction == 0.0003  # 0.00025 rounded up


def test_best_fit_keeps_the_larger_gpu_of_a_mixed_fleet_for_larger_models() -> None:
    snap = fleet([gpu("small", 40 * GiB), gpu("big", 80 * GiB, index=1)])
    plans = [
        plan_replica(Demand("m", request=10 * GiB), snap, rng=random.Random(s)) for s in range(40)
    ]
    assert {next(iter(p.gpus)) for p in plans} == {"small"}


def test_an_accelerator_constraint_keeps_a_model_off_other_gpu_types() -> None:
    snap = fleet(
        [
            gpu("a40", 40 * GiB, name="NVIDIA A100-SXM4-40GB"),
            gpu("a80", 80 * GiB, name="NVIDIA A100-SXM4-80GB", index=1),
        ]
    )
    plan = plan_replica(Demand("m", request=10 * GiB, accelerator="A100-80GB"), snap)
    assert set(plan.gpus) == {"a80"}
    with pytest.raises(CantAccommodateError, match="no live GPU of type 'H100'"):
        plan_replica(Demand("m", request=10 * GiB, accelerator="H100"), snap)


def test_accelerator_names_match_by_words_ignoring_case_and_punctuation() -> None:
    a100 = "NVIDIA A100-SXM4-80GB"
    assert accelerators.matches(a100, "a100 80gb")
    assert accelerators.matches(a100, "A100 80 GB")
    assert accelerators.matches(a100, "NVIDIA_A100")
    assert not accelerators.matches(a100, "H100")
    assert not accelerators.matches(a100, "A100-40GB")


def test_asking_for_both_a_gpu_count_and_bytes_is_an_error() -> None:
    snap = fleet([gpu("g", 80 * GiB)])
    with pytest.raises(PlacementError, match="both a GPU count and bytes"):
        plan_replica(Demand("m", request=GiB, gpus=1), snap)


# --- seed 000: fractional, whole or multi-GPU ----------------------------------


def test_a_one_gib_model_on_an_80_gib_gpu_gets_a_fractional_three_gib_slot() -> None:
    plan = plan_replica(Demand("m", size=GiB), fleet([gpu("g", 80 * GiB)]))
    assert plan.gpus == {"g": 3 * GiB}
    assert plan.fraction == 0.0375


def test_a_30_gib_model_on_an_80_gib_gpu_gets_the_whole_gpu() -> None:
    # 30 GiB x 3 = 90 GiB >= 0.8 x 80 GiB, but 30 GiB fits one GPU
    plan = plan_replica(Demand("m", size=30 * GiB), fleet([gpu("g", 80 * GiB)]))
    assert plan.gpus == {"g": 80 * GiB}
    assert plan.fraction == 1.0


def test_a_model_larger_than_one_gpu_is_split_over_the_fewest_gpus_of_one_host() -> None:
    snap = fleet([gpu(f"g{i}", 80 * GiB, index=i) for i in range(4)])
    plan = plan_replica(Demand("m", size=100 * GiB), snap)
    # Helix: 100 GiB / 2 x 1.1 on each of two GPUs
    assert len(plan.gpus) == 2
    assert set(plan.gpus.values()) == {55 * GiB}


def test_a_split_model_never_spans_two_hosts() -> None:
    snap = fleet(
        [
            gpu("a", 80 * GiB, host="h1"),
            gpu("b", 80 * GiB, host="h2"),
            gpu("c", 80 * GiB, host="h2"),
        ]
    )
    plan = plan_replica(Demand("m", size=100 * GiB), snap)
    assert set(plan.gpus) == {"b", "c"}
    assert plan.host == "h2"


def test_single_gpu_placement_is_tried_before_splitting() -> None:
    snap = fleet([gpu(f"g{i}", 80 * GiB, index=i) for i in range(2)])
    plan = plan_replica(Demand("m", size=50 * GiB), snap)
    assert len(plan.gpus) == 1


def test_a_model_that_can_never_fit_one_gpu_says_how_big_it_is_and_the_largest_gpu() -> None:
    snap = fleet([gpu("g0", 80 * GiB), gpu("g1", 40 * GiB, index=1)])
    with pytest.raises(NeverFitsError) as err:
        plan_replica(Demand("m", request=90 * GiB), snap)
    assert "needs 90 GiB on one GPU; the largest GPU has 80 GiB" in str(err.value)


def test_a_model_larger_than_any_host_is_refused_as_never_fitting() -> None:
    snap = fleet([gpu("a", 24 * GiB, host="h1"), gpu("b", 24 * GiB, host="h2")])
    with pytest.raises(NeverFitsError, match="across the GPUs of one host"):
        plan_replica(Demand("m", size=30 * GiB), snap)


def test_factor_threshold_and_min_free_fraction_are_overridable_per_model() -> None:
    snap = fleet([gpu("g", 80 * GiB)])
    assert plan_replica(Demand("m", size=GiB, factor=1.5), snap).gpus == {"g": 3 * GiB // 2}
    # 30 GiB x 1.0 = 30 GiB < 0.5 x 80 GiB: a fractional slot instead of the whole GPU
    plan = plan_replica(Demand("m", size=30 * GiB, factor=1.0, fractional_threshold=0.5), snap)
    assert plan.gpus == {"g": 30 * GiB}


def test_fleet_wide_settings_change_the_default_slot() -> None:
    plan = plan_replica(
        Demand("m", size=GiB), fleet([gpu("g", 80 * GiB)]), PolicySettings(factor=2.0)
    )
    assert plan.gpus == {"g": 2 * GiB}


def test_min_free_fraction_keeps_shards_off_nearly_full_gpus() -> None:
    gpus = [gpu(f"g{i}", 80 * GiB, index=i) for i in range(3)]
    busy = hot("x", "x", {"g0": 60 * GiB}, dedicated=True)
    snap = fleet(gpus, [busy])
    # 100 GiB split in two: 55 GiB shards; g0 has 20 GiB free (25%) < 30%
    plan = plan_replica(Demand("m", size=100 * GiB), snap)
    assert set(plan.gpus) == {"g1", "g2"}


def test_a_learned_peak_padded_by_the_headroom_replaces_the_factor_guess() -> None:
    snap = fleet([gpu("g", 80 * GiB)])
    settings = PolicySettings(learned_headroom=1.5)
    plan = plan_replica(Demand("m", size=GiB, learned=2 * GiB), snap, settings)
    assert plan.gpus == {"g": 3 * GiB}  # not size x factor = 3 GiB by accident:
    assert plan_replica(Demand("m", size=2 * GiB), snap, settings).gpus == {"g": 6 * GiB}


def test_a_static_fraction_takes_that_share_of_whichever_gpu_it_lands_on() -> None:
    assert plan_replica(Demand("m", gpus=0.25), fleet([gpu("g", 80 * GiB)])).gpus == {"g": 20 * GiB}
    assert plan_replica(Demand("m", gpus=0.25), fleet([gpu("g", 40 * GiB)])).gpus == {"g": 10 * GiB}


def test_a_static_count_of_two_gpus_takes_two_whole_gpus_of_one_host() -> None:
    snap = fleet([gpu(f"g{i}", 40 * GiB, index=i) for i in range(3)])
    plan = plan_replica(Demand("m", gpus=2), snap)
    assert len(plan.gpus) == 2
    assert all(nbytes == 40 * GiB for nbytes in plan.gpus.values())


# --- GPU choice -----------------------------------------------------------------


def test_a_gpu_with_room_is_preferred_over_one_that_needs_evictions() -> None:
    snap = fleet(
        [gpu("full", 8 * GiB), gpu("free", 8 * GiB, index=1)],
        [hot("x", "x", {"full": 7 * GiB})],
    )
    for seed in range(20):
        plan = plan_replica(Demand("m", size=GiB), snap, rng=random.Random(seed))
        assert plan.gpus.keys() == {"free"}
        assert plan.evictions == ()


def test_the_gpu_needing_the_fewest_evictions_is_chosen() -> None:
    snap = fleet(
        [gpu("two", 8 * GiB), gpu("one", 8 * GiB, index=1)],
        [
            hot("a", "a", {"two": 4 * GiB}),
            hot("b", "b", {"two": 4 * GiB}),
            hot("c", "c", {"one": 8 * GiB}),
        ],
    )
    plan = plan_replica(Demand("m", size=2 * GiB, factor=3.0), snap)
    assert plan.gpus.keys() == {"one"}
    assert [e.replica for e in plan.evictions] == ["c"]


def test_ties_between_identical_gpus_do_not_favour_low_indices() -> None:
    snap = fleet([gpu(f"g{i}", 80 * GiB, index=i) for i in range(4)])
    counts = Counter(
        next(iter(plan_replica(Demand("m", size=GiB), snap, rng=random.Random(s)).gpus))
        for s in range(400)
    )
    assert set(counts) == {"g0", "g1", "g2", "g3"}
    assert min(counts.values()) > 50  # each near 100 of 400


@pytest.mark.parametrize(
    ("choice", "expected"), [(GpuChoice.BEST_FIT, "tight"), (GpuChoice.MOST_FREE, "roomy")]
)
def test_the_gpu_choice_setting_picks_best_fit_or_most_free(
    choice: GpuChoice, expected: str
) -> None:
    snap = fleet(
        [gpu("tight", 8 * GiB), gpu("roomy", 8 * GiB, index=1)],
        [hot("x", "x", {"tight": 4 * GiB}, dedicated=True)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap, PolicySettings(gpu_choice=choice))
    assert plan.gpus.keys() == {expected}


# --- candidate levels and replicas ---------------------------------------------------


def test_a_resident_model_is_deployed_and_needs_no_plan() -> None:
    snap = fleet([gpu("g", 8 * GiB)], [hot("r1", "m", {"g": 3 * GiB})])
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert plan.candidate is Candidate.DEPLOYED
    assert plan.replica == "r1"


def test_a_warm_replica_on_the_host_is_restored_before_a_new_one_is_made() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB), gpu("other", 8 * GiB, index=1)],
        [warm("old", "m", GiB, used=5, worker="w-other")],
        [Host("h0", warm_budget=4 * GiB)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert plan.candidate is Candidate.CACHED_AND_FREE
    assert plan.replica == "old"
    assert plan.reuse is Level.WARM
    assert (plan.worker, plan.queue) == ("w-other", "q-w-other")  # its holder restores it


def test_a_warm_copy_is_restored_onto_its_holders_own_gpu_of_equally_good_ones() -> None:
    """Restored on another worker's GPU, the holder would keep a second CUDA context there
    that the ledger does not count."""
    gpus = [gpu(f"g{i}", 8 * GiB, index=i) for i in range(4)]
    snap = fleet(
        gpus,
        [warm("old", "m", GiB, used=5, worker="w-g2")],
        [Host("h0", warm_budget=4 * GiB)],
    )
    for seed in range(20):
        plan = plan_replica(Demand("m", size=GiB), snap, rng=random.Random(seed))
        assert plan.reuse is Level.WARM and set(plan.gpus) == {"g2"}


def test_a_warm_copy_restored_after_evictions_goes_to_its_holders_gpu_of_equal_ones() -> None:
    gpus = [gpu(f"g{i}", 8 * GiB, index=i) for i in range(4)]
    full = [hot(f"x{i}", f"other{i}", {f"g{i}": 8 * GiB}, used=1) for i in range(4)]
    snap = fleet(
        gpus,
        [*full, warm("old", "m", GiB, used=5, worker="w-g1")],
        [Host("h0", warm_budget=20 * GiB)],
    )
    for seed in range(20):
        plan = plan_replica(Demand("m", size=GiB), snap, rng=random.Random(seed))
        assert plan.reuse is Level.WARM and set(plan.gpus) == {"g1"}
        assert [e.replica for e in plan.evictions] == ["x1"]


def _holder_full(
    copy_at: str, victim_size: int = 0, domains: tuple[str, str] = ("d", "d")
) -> Snapshot:
    """GPU g0's worker holds a warm copy of "m" but has no room for it; g1's worker would
    have to host the holder's CUDA context (1 GiB) for a restore. With `victim_size`, g1
    is full of an idle replica that size, and the warm cache has room for the copy and 1 GiB.
    `domains` are the GPUs' workers' (`Gpu.domain`)."""
    gpus = [
        replace(gpu(f"g{i}", 8 * GiB, index=i), context=GiB, domain=domains[i]) for i in range(2)
    ]
    deployments = [
        hot("filler", "filler", {"g0": 8 * GiB}, dedicated=True),
        warm("old", "m", GiB, used=1, worker="w-g0", copy_at=copy_at),
    ]
    if victim_size:
        deployments.append(hot("v", "v", {"g1": 8 * GiB}, size=victim_size, used=50))
    return fleet(gpus, deployments, [Host("h0", warm_budget=2 * GiB)])


def test_a_published_warm_copy_is_read_by_the_gpus_worker_not_restored_by_its_holder() -> None:
    read = plan_replica(Demand("m", size=GiB), _holder_full("4242:5:0:8192:4096:7"))
    assert (read.worker, read.reuse, read.read_from) == ("w-g1", None, "4242:5:0:8192:4096:7")
    assert read.replica != "old" and read.candidate is Candidate.CACHED_AND_FREE
    for snap in (
        _holder_full(""),  # not published
        _holder_full("4242:5:0:8192:4096:7", domains=("d", "other")),  # g1's worker can't map it
        _holder_full("4242:5:0:8192:4096:7", domains=("", "")),  # nor can a worker of no domain
    ):
        restored = plan_replica(Demand("m", size=GiB), snap)
        assert (restored.worker, restored.reuse, restored.replica) == ("w-g0", Level.WARM, "old")
        assert restored.read_from == ""


def test_the_warm_copy_a_placement_reads_is_never_dropped_to_make_room_for_its_victims() -> None:
    """Under LRU the victim (used at 50) would displace the older copy (used at 1) to go
    warm; that copy is the one the load reads, so the victim goes cold instead."""
    plan = plan_replica(Demand("m", size=GiB), _holder_full("4242:5:0:8192:4096:7", 2 * GiB))
    assert plan.read_from and plan.worker == "w-g1"
    assert plan.warm_drops == ()
    assert [(e.replica, e.to) for e in plan.evictions] == [("v", Level.COLD)]


def test_a_warm_copy_whose_holder_is_dead_is_not_a_cache_hit() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [warm("old", "m", GiB, used=5, worker="gone")],
        [Host("h0", warm_budget=4 * GiB)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert plan.candidate is Candidate.FREE
    assert plan.replica != "old"


def test_a_warm_replica_on_another_host_is_not_a_cache_hit() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB, host="h1")],
        [warm("old", "m", GiB, host="h2")],
        [Host("h2", warm_budget=4 * GiB)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert plan.candidate is Candidate.FREE
    assert plan.replica != "old"


def test_a_free_gpu_beats_a_cached_copy_that_needs_evictions() -> None:
    snap = fleet(
        [gpu("a", 8 * GiB, host="h1"), gpu("b", 8 * GiB, host="h2")],
        [hot("x", "x", {"a": 8 * GiB}, host="h1"), warm("old", "m", GiB, host="h1")],
        [Host("h1", warm_budget=4 * GiB)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert plan.candidate is Candidate.FREE
    assert plan.gpus.keys() == {"b"}


def test_more_replicas_are_placed_until_the_catalog_count_is_reached() -> None:
    snap = fleet([gpu("g", 80 * GiB)], [hot("r1", "m", {"g": 3 * GiB})])
    plan = plan_replica(Demand("m", size=GiB, replicas=2), snap)
    assert plan.candidate is Candidate.FREE
    assert plan.replica != "r1"
    assert len(plan.replica) == 32 and int(plan.replica, 16) >= 0  # opaque uuid hex


def test_replica_ids_replay_exactly_for_a_seed() -> None:
    snap = fleet([gpu("g", 80 * GiB)])
    a = plan_replica(Demand("m", size=GiB), snap, rng=random.Random(7))
    b = plan_replica(Demand("m", size=GiB), snap, rng=random.Random(7))
    assert a == b


# --- eviction ---------------------------------------------------------------------


def test_only_idle_non_dedicated_replicas_are_evicted() -> None:
    snap = fleet(
        [gpu("g", 12 * GiB)],
        [
            hot("busy", "busy", {"g": 4 * GiB}, leases=1, used=1),
            hot("pinned", "pinned", {"g": 4 * GiB}, dedicated=True, used=2),
            hot("idle", "idle", {"g": 4 * GiB}, used=3),
        ],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert [e.replica for e in plan.evictions] == ["idle"]


def test_a_second_replica_never_makes_room_by_evicting_the_first() -> None:
    """Evicting a sibling would leave the model with as many replicas as before: a deploy of
    two replicas once evicted the first to place the second, and said one was missing."""
    snap = fleet(
        [gpu("g0", 8 * GiB), gpu("g1", 8 * GiB, index=1)],
        [
            hot("first", "m", {"g0": 6 * GiB}, used=1),  # the least recently used of all
            hot("other", "o", {"g1": 4 * GiB}, used=5),
        ],
    )
    plan = plan_replica(Demand("m", size=2 * GiB, replicas=2), snap)  # 6 GiB each
    assert plan.gpus == {"g1": 6 * GiB}
    assert [e.replica for e in plan.evictions] == ["other"]


def test_a_model_whose_only_room_is_its_own_replica_gets_no_second_one() -> None:
    snap = fleet([gpu("g", 8 * GiB)], [hot("first", "m", {"g": 6 * GiB})])
    with pytest.raises(CantAccommodateError) as err:
        plan_replica(Demand("m", size=2 * GiB, replicas=2), snap)
    assert "free now is 2 GiB, and 2 GiB after evicting" in str(err.value)  # not its own 6
    assert "m's own, which a further replica never evicts" in str(err.value)


def test_lru_evicts_the_least_recently_used_idle_replica_first() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [hot("old", "a", {"g": 4 * GiB}, used=10), hot("new", "b", {"g": 4 * GiB}, used=20)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert [e.replica for e in plan.evictions] == ["old"]


def test_lru_spares_an_older_replica_that_the_next_victim_makes_room_without() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [
            hot("oldest", "a", {"g": GiB}, used=10),
            hot("older", "b", {"g": 4 * GiB}, used=20),
            hot("newest", "c", {"g": 3 * GiB}, used=30),
        ],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)  # 3 GiB: "older" alone frees 4
    assert [e.replica for e in plan.evictions] == ["older"]


def test_the_ndif_order_evicts_the_smallest_idle_replica_first() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [hot("big", "a", {"g": 5 * GiB}, used=10), hot("small", "b", {"g": 3 * GiB}, used=20)],
    )
    settings = PolicySettings(victim_order=VictimOrder.SMALLEST)
    plan = plan_replica(Demand("m", size=GiB), snap, settings)
    assert [e.replica for e in plan.evictions] == ["small"]


def test_dedicated_replicas_are_never_evicted_by_pressure() -> None:
    snap = fleet([gpu("g", 8 * GiB)], [hot("d", "d", {"g": 8 * GiB}, dedicated=True)])
    with pytest.raises(CantAccommodateError) as err:
        plan_replica(Demand("m", size=GiB), snap)
    assert not isinstance(err.value, NeverFitsError)
    assert "the most any has free now is 0 B, and 0 B after evicting" in str(err.value)


def test_an_evicted_replica_goes_warm_when_its_host_cache_has_room() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [hot("v", "v", {"g": 8 * GiB}, size=2 * GiB)],
        [Host("h0", warm_budget=4 * GiB)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert [(e.replica, e.to) for e in plan.evictions] == [("v", Level.WARM)]


def test_an_evicted_replica_is_dropped_when_it_cannot_fit_the_warm_cache() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [hot("v", "v", {"g": 8 * GiB}, size=6 * GiB)],
        [Host("h0", warm_budget=4 * GiB)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert [(e.replica, e.to) for e in plan.evictions] == [("v", Level.COLD)]


def test_a_full_warm_cache_drops_its_least_recently_used_copies_for_a_fresher_one() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [
            hot("v", "v", {"g": 8 * GiB}, size=2 * GiB, used=50),
            warm("stale", "s", 2 * GiB, used=10),
            warm("fresh", "f", 2 * GiB, used=90),
        ],
        [Host("h0", warm_budget=4 * GiB)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert plan.warm_drops == ("stale",)
    assert plan.evictions[0].to is Level.WARM


def test_a_victim_older_than_every_warm_copy_displaces_none_of_them() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [hot("v", "v", {"g": 8 * GiB}, size=2 * GiB, used=5), warm("w", "w", 4 * GiB, used=10)],
        [Host("h0", warm_budget=4 * GiB)],
    )
    plan = plan_replica(Demand("m", size=GiB), snap)
    assert plan.warm_drops == ()
    assert plan.evictions[0].to is Level.COLD


def test_an_explicit_offload_goes_warm_or_cold_by_the_same_rule() -> None:
    snap = fleet(
        [gpu("g", 8 * GiB)],
        [hot("v", "v", {"g": 2 * GiB}, size=2 * GiB)],
        [Host("h0", warm_budget=GiB)],
    )
    eviction, drops = plan_offload("v", snap)
    assert eviction.to is Level.COLD and drops == ()


def test_a_model_without_any_memory_figure_is_refused_with_advice() -> None:
    with pytest.raises(PlacementError, match="set `memory` or `gpus`"):
        plan_replica(Demand("m"), fleet([gpu("g", GiB)]))


def test_a_fleet_with_no_live_gpu_refuses_at_once_and_says_so() -> None:
    dead = gpu("g", 8 * GiB)
    snap = fleet([dead])
    snap = type(snap)(
        gpus={"g": type(dead)(**{**dead.__dict__, "lease_deadline_ms": 0})},
        deployments={},
        hosts={},
        now_ms=snap.now_ms,
    )
    with pytest.raises(CantAccommodateError, match="no live GPU"):
        plan_replica(Demand("m", size=GiB), snap)
