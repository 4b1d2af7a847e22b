"""The simulator: hand-computed replays for every policy, determinism, Azure input, CLI, Redis.

Tiny fleets use one host and GPUs named "SIM-<n>GB". Arrivals are 10 s apart and
every load takes at most 1.5 s (disk 1 GB/s, host-to-GPU 10 GB/s), so each load is
done before the next request and the counts follow from the policy alone. Slots are
`size x 3` (the factor); each model's true peak is chosen so that the learned slot
(`peak x 1.1`) is the same number of bytes (less at most one), so learning changes nothing here.
"""

from __future__ import annotations

import itertools
import json
import random
from dataclasses import replace
from pathlib import Path

import pytest
from typer.testing import CliRunner

from placement.policy.mirror import mark
from placement.policy.sizing import scale
from placement.policy.state import Demand, Level
from placement.rules.scaling import Scaler
from placement.simulator import (
    POLICIES,
    Fleet,
    GpuType,
    HostSpec,
    MemoryLedger,
    Replay,
    SimModel,
    TimeModel,
    Trace,
    get_policy,
    scenario,
    simulate,
)
from placement.simulator.policies import static_demand
from placement.simulator.report import RunResult
from placement.simulator.serving import ServingReplay
from placement.simulator.workloads import azure, load_azure_times, tile
from placement.units import accelerators
from tasks.operator.cli import app

GB = 10**9
TIME = TimeModel(compute_s=0.1, h2d_bytes_per_s=10 * GB, disk_bytes_per_s=1 * GB)
EVERY = ("default", "ndif", "helix", "static", "oracle")


def model(name: str, size: float) -> SimModel:
    """A model of `size` GB whose learned slot is its x3 slot, give or take a byte."""
    nbytes = int(size * GB)
    peak = nbytes * 30 // 11
    assert 0 <= 3 * nbytes - scale(peak, 1.1) <= 1
    return SimModel(name, nbytes, peak)


def tiny_fleet(gpus_gb: list[int], models: list[SimModel], warm_gb: float = 0) -> Fleet:
    kinds = tuple(GpuType(f"SIM-{g}GB", g * GB) for g in gpus_gb)
    return Fleet((HostSpec("h0", kinds, int(warm_gb * GB)),), tuple(models))


def trace_of(fleet: Fleet, names: str, gap_s: float = 10.0) -> Trace:
    index = {m.name: i for i, m in enumerate(fleet.models)}
    return Trace("hand", [i * gap_s for i in range(len(names))], [index[n] for n in names])


def counts(fleet: Fleet, trace: Trace, policy: str, seed: int = 0) -> dict[str, int]:
    replay = Replay(
        trace, fleet, get_policy(policy), MemoryLedger(fleet.snapshot()), time_model=TIME, seed=seed
    )
    return replay.run().counts()


def expect(hits: int, warm: int, cold: int, evictions: int, queued: int = 0) -> dict[str, int]:
    return {
        "hits": hits,
        "queued": queued,
        "warm_restores": warm,
        "cold_loads": cold,
        "evictions": evictions,
        "rejected": 0,
    }


# --- hand-computed replays ------------------------------------------------------


def test_a_cyclic_trace_defeats_lru_while_the_oracle_keeps_what_comes_back_first() -> None:
    # One 10 GB GPU, no warm cache; a, b, c weigh 1.5 GB -> 4.5 GB slots: two fit (9 GB).
    # Trace a b c a b c.
    # LRU (default, helix, static: 0.45 of the only GPU kind = 4.5 GB; ndif: equal sizes
    # tie on "smallest", then fall back to least recently used):
    #   a cold; b cold; c evicts a (LRU); a evicts b; b evicts c; c evicts a
    #   -> 0 hits, 6 cold loads, 4 evictions.
    # Oracle (Belady): c evicts b (next use #4, after a's #3); a hits;
    #   b evicts a (never used again, before c's #5); c hits
    #   -> 2 hits, 4 cold loads, 2 evictions.
    fleet = tiny_fleet([10], [model("a", 1.5), model("b", 1.5), model("c", 1.5)])
    trace = trace_of(fleet, "abcabc")
    lru = expect(hits=0, warm=0, cold=6, evictions=4)
    answers = {"default": lru, "ndif": lru, "helix": lru, "static": lru}
    answers["oracle"] = expect(hits=2, warm=0, cold=4, evictions=2)
    assert {p: counts(fleet, trace, p) for p in EVERY} == answers


def test_smallest_first_victims_and_the_oracle_beat_lru_when_the_small_model_returns_late() -> None:
    # One 10 GB GPU; a 1 GB warm cache. a = 1 GB (3 GB slot), b = 0.5 GB (1.5 GB slot),
    # c = 2 GB (6 GB slot; its 2 GB copy never fits the warm cache). Trace a b c a b c.
    # LRU (default, helix, static: fractions .30/.15/.60 of 10 GB, the same slots):
    #   1 a cold [a]        2 b cold [a b] 4.5 GB
    #   3 c needs 6: 10.5 > 10, evict LRU a -> WARM (1 GB fits)  [b c] 7.5 GB
    #   4 a: 10.5 > 10, evict LRU b -> WARM (a's restore frees 1 GB); a warm restore [c a]
    #   5 b: 10.5 > 10, evict LRU c -> COLD (2 GB > cache); b warm restore [a b]
    #   6 c: 10.5 > 10, evict LRU a -> WARM; c cold load [b c]
    #   -> 0 hits, 2 warm restores, 4 cold loads, 4 evictions.
    # NDIF (smallest victim first; one GPU, so its random choice is moot):
    #   3 c evicts b (1.5 GB frees enough) -> WARM  [a c] 9 GB
    #   4 a hit
    #   5 b: evict the smaller of a (3) and c (6): a -> WARM (b's restore frees room);
    #     b warm restore [c b]
    #   6 c hit
    #   -> 2 hits, 1 warm restore, 3 cold loads, 2 evictions.
    # Oracle: 3 c evicts b (next use #4 after a's #3) -> WARM; 4 a hit;
    #   5 b evicts a (never used again) -> WARM; b warm restore; 6 c hit -> same as NDIF.
    fleet = tiny_fleet([10], [model("a", 1), model("b", 0.5), model("c", 2)], warm_gb=1)
    trace = trace_of(fleet, "abcabc")
    lru = expect(hits=0, warm=2, cold=4, evictions=4)
    smart = expect(hits=2, warm=1, cold=3, evictions=2)
    answers = {"default": lru, "helix": lru, "static": lru, "ndif": smart, "oracle": smart}
    assert {p: counts(fleet, trace, p) for p in EVERY} == answers


def test_best_fit_keeps_the_big_gpu_whole_where_most_free_fragments_it() -> None:
    # GPUs of 10 GB and 20 GB; no warm cache. a = 1 GB (3 GB slot, fits both);
    # b = 11 GB: too big for 10 GB, and 33 GB >= 0.8 x 20 GB, so the whole 20 GB GPU.
    # Trace a b a b.
    # Best fit (default, oracle): a -> 10 GB GPU (7 GB left < 17); b -> the 20 GB GPU,
    #   free; a hit; b hit -> 2 hits, 2 cold, 0 evictions.
    # Static: a = 0.30 of the smallest kind (3 GB on the 10 GB GPU, 6 GB on the 20 GB one),
    #   best fit puts it on the 10 GB GPU; b = 1 whole GPU of kind "20GB" -> same as default.
    # Most free (helix): a -> the 20 GB GPU; b must evict a (cold: no cache);
    #   a -> the 10 GB GPU (free beats evicting b); b hit -> 1 hit, 3 cold, 1 eviction.
    fleet = tiny_fleet([10, 20], [model("a", 1), model("b", 11)])
    trace = trace_of(fleet, "abab")
    fit = expect(hits=2, warm=0, cold=2, evictions=0)
    answers = {"default": fit, "oracle": fit, "static": fit}
    answers["helix"] = expect(hits=1, warm=0, cold=3, evictions=1)
    assert {p: counts(fleet, trace, p) for p in answers} == answers
    # NDIF picks a's GPU at random: each seed gives one of the two outcomes above,
    # and over ten seeds both occur.
    outcomes = {json.dumps(counts(fleet, trace, "ndif", seed=s)) for s in range(10)}
    assert outcomes == {json.dumps(fit), json.dumps(answers["helix"])}


def test_static_fractions_waste_a_big_gpu_that_bytes_would_share() -> None:
    # GPUs of 4 GB and 20 GB; no warm cache; a, b, c = 1 GB (3 GB slots). Trace a b c a b c.
    # By bytes (default, ndif, helix, oracle): the 4 GB GPU takes one slot, the 20 GB one
    #   six, so all three stay resident wherever they land -> 3 hits, 3 cold, 0 evictions.
    # Static: 3 GB is 0.75 of the smallest kind, and 0.75 of the 20 GB GPU is 15 GB:
    #   1 a -> 4 GB GPU (best fit); 2 b -> 20 GB GPU (15 GB);
    #   3 c: either GPU needs one eviction; LRU prefers the older victim a -> c on 4 GB
    #   4 a: victims c (#3) or b (#2): evict b -> a on 20 GB
    #   5 b: victims c (#3) or a (#4): evict c -> b on 4 GB
    #   6 c: victims b (#5) or a (#4): evict a -> c on 20 GB
    #   -> 0 hits, 6 cold loads, 4 evictions.
    fleet = tiny_fleet([4, 20], [model("a", 1), model("b", 1), model("c", 1)])
    trace = trace_of(fleet, "abcabc")
    by_bytes = expect(hits=3, warm=0, cold=3, evictions=0)
    answers = {p: by_bytes for p in ("default", "ndif", "helix", "oracle")}
    answers["static"] = expect(hits=0, warm=0, cold=6, evictions=4)
    assert {p: counts(fleet, trace, p) for p in EVERY} == answers


def test_requests_queue_while_their_model_loads_and_wait_for_room_held_by_a_load() -> None:
    # One 10 GB GPU; a = 2 GB (6 GB slot, 2 s cold load), b = 2 GB too: only one fits.
    # t=0 a: cold, ready at 2.0.  t=0.5 a: queued (waits 1.5 s).
    # t=1.0 b: a is LOADING, so nothing can be evicted: b is parked until a is ready;
    #   at 2.0 b evicts a (cold) and loads until 4.0 (waited 3 s).
    fleet = tiny_fleet([10], [model("a", 2), model("b", 2)])
    trace = Trace("hand", [0.0, 0.5, 1.0], [0, 0, 1])
    result = Replay(
        trace, fleet, get_policy("default"), MemoryLedger(fleet.snapshot()), time_model=TIME
    ).run()
    assert result.counts() == expect(hits=0, warm=0, cold=2, evictions=1, queued=1)
    waits = sorted(result.rec.waits)
    assert waits == pytest.approx([1.5, 2.0, 3.0])
    assert result.summary()["queue_depth_max"] == 3


def test_learned_peaks_shrink_slots_after_the_first_load() -> None:
    # One 10 GB GPU; a and b weigh 2 GB (6 GB guessed slots: one at a time) but really
    # peak at 2.5 GB (2.75 GB learned slots). Trace a b a b a b.
    # Without learning every request after the first evicts the other model: 0 hits.
    # Learning: a (6 GB) cold; b evicts a (6 + 6 > 10); a reloads at 2.75 GB beside b's 6;
    #   b hits; a hits; b hits -> 3 hits, 3 cold, 1 eviction.
    fleet = Fleet(
        (HostSpec("h0", (GpuType("SIM-10GB", 10 * GB),)),),
        (SimModel("a", 2 * GB, int(2.5 * GB)), SimModel("b", 2 * GB, int(2.5 * GB))),
    )
    trace = trace_of(fleet, "ababab")
    assert counts(fleet, trace, "default") == expect(hits=3, warm=0, cold=3, evictions=1)
    assert counts(fleet, trace, "default-nolearn") == expect(hits=0, warm=0, cold=6, evictions=5)


# --- policies, ledger, determinism ------------------------------------------------


def test_static_demands_size_on_the_smallest_kind_that_takes_them_and_pin_larger_kinds() -> None:
    kinds = [GpuType("NVIDIA L4", 24 * GB), GpuType("NVIDIA A100-SXM4-40GB", 40 * GB)]
    kinds.append(GpuType("NVIDIA A100-SXM4-80GB", 80 * GB))
    settings = POLICIES["static"].settings
    small = static_demand(SimModel("s", 2 * GB, 0), kinds, settings)  # 6 GB of 24
    mid = static_demand(SimModel("m", 8 * GB, 0), kinds, settings)  # 24 GB: < 32 of 40
    big = static_demand(SimModel("b", 20 * GB, 0), kinds, settings)  # 60 GB: < 64 of 80
    whole = static_demand(SimModel("w", 30 * GB, 0), kinds, settings)  # 90 GB: a whole L4? no

    def allowed(demand: Demand) -> list[int]:
        return [k.total // GB for k in kinds if accelerators.matches(k.name, demand.accelerator)]

    assert [(d.gpus, allowed(d)) for d in (small, mid, big, whole)] == [
        (0.25, [24, 40, 80]),
        (0.6, [40, 80]),
        (0.75, [80]),
        (1.0, [40, 80]),
    ]


def test_the_memory_ledger_fold_equals_marking_each_replica_with_the_ledger() -> None:
    fleet = tiny_fleet([10], [model("a", 1), model("b", 1)])
    replayed = MemoryLedger(fleet.snapshot())
    Replay(trace_of(fleet, "abab"), fleet, get_policy("default"), replayed, time_model=TIME).run()
    placed = replayed.snapshot(50_000_000)
    a, b = sorted(placed.deployments.values(), key=lambda d: d.model)
    # a is HOT and gets a hit; b is LOADING and its worker confirms it.
    loading = replace(
        placed, deployments={**placed.deployments, b.replica: replace(b, level=Level.LOADING)}
    )
    ledger = MemoryLedger(loading)
    ledger.touch("a", a.replica, 99_000_000)
    ledger.ready(b.replica, b.worker, 98_000_000)
    folded = ledger.snapshot(100_000_000)
    marked = mark(mark(loading, a.replica, Level.HOT, 99_000_000), b.replica, Level.HOT, 98_000_000)
    assert folded.deployments == marked.deployments
    assert folded.deployments != loading.deployments
    assert folded.now_ms == 100_000_000


def test_runs_are_deterministic_for_a_seed_and_change_with_it() -> None:
    def run(seed: int) -> dict[str, object]:
        trace, fleet = scenario("bursty", requests=3000, seed=seed)
        data = simulate(trace, fleet, seed=seed).to_json()
        for row in data["policies"].values():
            del row["wall_s"], row["plan_us_mean"]
        return data

    first = run(3)
    assert run(3) == first
    assert run(4) != first
    assert set(first["policies"]) == set(EVERY)


def test_the_oracle_hits_at_least_as_often_as_lru_on_zipf() -> None:
    trace, fleet = scenario("zipf", requests=4000, seed=1)
    rows = simulate(trace, fleet, ["default", "oracle"]).to_json()["policies"]
    assert rows["oracle"]["hit_rate"] >= rows["default"]["hit_rate"]
    for row in rows.values():
        assert 0 < row["utilization"] <= 1
        assert row["hits"] + row["queued"] + row["warm_restores"] + row["cold_loads"] == 4000


# --- Azure input -----------------------------------------------------------------


def write_csv(path: Path) -> Path:
    path.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2023-11-16 18:15:46.5000000,374,44\n"
        "2023-11-16 18:15:46.0000000,396,109\n"
        "2023-11-16 18:15:50.2500000,879,55\n"
        "2023-11-16 18:15:51.0000000,91,16"  # the real files end without a newline
    )
    return path


def test_the_azure_loader_reads_arrival_offsets_in_order(tmp_path: Path) -> None:
    times = load_azure_times(write_csv(tmp_path / "trace.csv"))
    assert times == pytest.approx([0.0, 0.5, 4.25, 5.0])


def test_an_azure_trace_maps_requests_to_models_by_a_seeded_draw_and_tiles_when_asked(
    tmp_path: Path,
) -> None:
    csv = write_csv(tmp_path / "AzureLLMInferenceTrace_conv.csv")
    once = azure("azure-conv", 5, path=csv, seed=7)
    assert len(once) == 4 and once.times == pytest.approx([0.0, 0.5, 4.25, 5.0])
    assert azure("azure-conv", 5, path=csv, seed=7).models == once.models
    assert all(0 <= m < 5 for m in once.models)
    longer = azure("azure-conv", 5, 10, data_dir=tmp_path, seed=7)
    # Copies are shifted by the span (5 s) plus the mean gap (5/3 s).
    assert longer.times[4:8] == pytest.approx([t + 5 + 5 / 3 for t in once.times])
    assert len(longer) == 10 and longer.params["tiled"] is True
    assert tile([0.0, 1.0], 3) == pytest.approx([0.0, 1.0, 2.0])


# --- the CLI and the Redis registry ----------------------------------------------

runner = CliRunner()


def test_the_cli_prints_every_policy_with_its_headline_numbers(tmp_path: Path) -> None:
    png = tmp_path / "plot.png"
    args = ["simulate", "--workload", "zipf", "--requests", "400", "--json", "--plot", str(png)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert list(report["policies"]) == list(EVERY)
    for row in report["policies"].values():
        assert {"hit_rate", "reload_rate", "utilization", "p95_ms"} <= row.keys()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_cli_replays_an_azure_csv_from_a_data_dir_with_chosen_policies(tmp_path: Path) -> None:
    write_csv(tmp_path / "AzureLLMInferenceTrace_code.csv")
    args = ["simulate", "--workload", "azure-code", "--data-dir", str(tmp_path), "--json"]
    result = runner.invoke(app, [*args, "--policy", "default", "--policy", "oracle"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    assert list(report["policies"]) == ["default", "oracle"]
    assert report["workload"]["requests"] == 4


def test_the_cli_names_the_choices_when_a_workload_is_unknown() -> None:
    result = runner.invoke(app, ["simulate", "--workload", "nope"])
    assert result.exit_code == 1
    assert "zipf, bursty, hotspot, azure-conv, azure-code" in result.output


def test_the_real_lua_registry_replays_to_the_same_counts_as_the_memory_ledger(
    redis_url: str,
) -> None:
    trace, fleet = scenario("zipf", requests=150, seed=2)
    policies = ["default", "ndif", "oracle"]
    memory = simulate(trace, fleet, policies, seed=2).to_json()["policies"]
    redis = simulate(trace, fleet, policies, seed=2, registry="redis", redis_url=redis_url)
    for name, row in redis.to_json()["policies"].items():
        for key in ("hits", "queued", "warm_restores", "cold_loads", "evictions", "warm_drops"):
            assert row[key] == memory[name][key], (name, key)


# --- service time and scaling (serving.py) ----------------------------------------------


def serve(fleet: Fleet, trace: Trace, scaling: bool) -> RunResult:
    replay = ServingReplay(
        trace, fleet, get_policy("default"), scaler=Scaler() if scaling else None, time_model=TIME
    )
    return replay.run()


def test_a_replica_serves_one_call_at_a_time_so_simultaneous_calls_queue() -> None:
    # a: 1 GB, a 1 s cold load. t=0 misses: ready at 1.0, done at 1.1. At t=5 three calls
    # arrive at once: they run 5.0-5.1, 5.1-5.2, 5.2-5.3 on the one replica.
    fleet = tiny_fleet([10], [model("a", 1)])
    result = serve(fleet, Trace("hand", [0.0, 5.0, 5.0, 5.0], [0, 0, 0, 0]), scaling=False)
    assert result.counts() == expect(hits=3, warm=0, cold=1, evictions=0)
    assert sorted(result.rec.latencies) == pytest.approx([0.1, 0.2, 0.3, 1.1])


def burst_trace(seconds: float, rate: float, tail_s: float) -> Trace:
    """`rate` calls a second of model 0 for `seconds`, then one more call `tail_s` later."""
    times = [i / rate for i in range(int(seconds * rate))]
    times.append(times[-1] + tail_s)
    return Trace("hand", times, [0] * len(times))


def test_scaling_out_serves_a_burst_no_one_replica_can_and_scales_back_after_keep_alive() -> None:
    # 25 calls a second of 100 ms each: one replica serves 10. Three GPUs, one worker each.
    fleet = tiny_fleet([10, 10, 10], [model("a", 1)])
    trace = burst_trace(seconds=30, rate=25, tail_s=400)  # keep_alive is 300 s
    fixed, scaled = serve(fleet, trace, scaling=False), serve(fleet, trace, scaling=True)
    p95 = {name: r.summary()["p95_ms"] for name, r in (("fixed", fixed), ("scaled", scaled))}
    assert p95["scaled"] <= 0.6 * p95["fixed"], p95
    assert fixed.rec.scale_outs == 0 and scaled.rec.scale_outs == 2  # up to three replicas
    assert scaled.rec.scale_ins == 2  # back to one after the burst
    assert scaled.summary()["memory_gib_s"] > fixed.summary()["memory_gib_s"]


def test_no_scale_out_when_one_replica_keeps_up_though_calls_queue_now_and_then() -> None:
    fleet = tiny_fleet([10, 10], [model("a", 1)])
    rng = random.Random(1)
    times = list(itertools.accumulate(rng.expovariate(5.0) for _ in range(3000)))  # half load
    scaled = serve(fleet, Trace("hand", times, [0] * len(times)), scaling=True)
    assert len(scaled.rec.waits) > 100  # calls did queue behind one another
    assert scaled.rec.scale_outs == 0  # never two deep for the whole window
