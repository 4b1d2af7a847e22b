"""End to end: a real `gpufleet up` serves generating calls as one continuous batch, streams
their text through its Redis, cancels them, keeps them inside the KV-cache budget, and
sends the calls of one prompt to the replica that has it cached.

Plain Celery clients with the callers' URL call a fleet on two simulated GPUs; the reference
for every answer is the same synthetic model run alone in this process (its weights come
from its name, so they are the same bits here and in the worker).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
import redis

from placement.catalog.catalog import Catalog
from placement.policy.settings import PolicySettings
from placement.policy.sizing import scale
from tasks.operator.call_cli import printable
from tasks.serving import streams
from tests.running import REPO, RunningFleet, fleet_env, fleet_up, until
from worker.generation.replica import replica_engine
from worker.generation.serving import GenCall, Generated, run_calls
from worker.weights.synthetic import build_synthetic

pytestmark = pytest.mark.slow

SMALL = "{model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 64, vocab_size: 512, n_positions: 256}"
SLOW = "{model_type: gpt2, n_layer: 6, n_head: 6, n_embd: 384, vocab_size: 2048, n_positions: 1024}"
TEMPLATE = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
CATALOG = f"""
models:
  talker:
    source: synthetic
    task: text-generation
    memory: 64MiB
    config: {SMALL}
    chat_template: "{TEMPLATE}"
  slow-talker:  # a few ms a token here: a call of 500 tokens runs for a second or more
    source: synthetic
    task: text-generation
    memory: 128MiB
    config: {SLOW}
  tight:  # 14 blocks of 16 tokens: not room for two calls of 121 positions to end together;
    # slow, so that four calls sent at once overlap however a loaded machine spreads them
    source: synthetic
    task: text-generation
    memory: 128MiB
    config: {SLOW}
    kv_cache: {{tokens: 250}}
  twins:  # one replica on each GPU
    source: synthetic
    task: text-generation
    memory: 128MiB
    config: {SLOW}
    replicas: 2
"""


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("generation-home")


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("generation") / "models.yaml"
    path.write_text(CATALOG)
    return path


@pytest.fixture(scope="module")
def fleet(catalog: Path, home: Path) -> Iterator[RunningFleet]:
    args = ["--sim-gpus", "2x4GiB", "--metrics-port", "0"]
    with fleet_up(catalog, args, fleet_env(GPUFLEET_HOME=str(home))) as running:
        yield running


def _send(fleet: RunningFleet, model: str, inputs: Any, **params: Any) -> Any:
    return fleet.client.send_task("gpufleet.infer", args=(model, inputs, params))


def _alone(catalog: Path, model: str, inputs: Any, **params: Any) -> dict[str, Any]:
    """What `model` answers to this call alone, in this process."""
    spec = Catalog.load(catalog)[model]
    net, tokenizer = build_synthetic(spec)
    engine = replica_engine(net, tokenizer, spec, build_device())
    [answer] = run_calls(engine, [GenCall("alone", inputs, params)], spec.chat_template)
    assert isinstance(answer, Generated), answer
    return answer.outputs


def build_device() -> Any:
    import torch

    return torch.device("cpu")


def test_a_streamed_call_s_text_arrives_before_it_ends_and_joins_into_its_answer(
    fleet: RunningFleet,
) -> None:
    call = _send(fleet, "slow-talker", "Once upon a time", max_new_tokens=500, stream=True)
    reader = redis.Redis.from_url(fleet.url)  # the callers' own rights
    pieces, ready_at_first = [], None
    for _, text in streams.read(reader, call.id, call.ready, timeout=120):
        if ready_at_first is None:
            ready_at_first = call.ready()
        pieces.append(text)
    answer = call.get(timeout=120)
    assert ready_at_first is False, "the first piece came only once the call had ended"
    assert len(pieces) > 1
    assert "".join(pieces) == answer["outputs"]["texts"][0]
    timings = answer["timings_ms"]
    assert timings["first_token"] < timings["compute"]
    # it joined its engine's next step, and its prefill began before its first token
    assert 0 <= timings["join"] < timings["first_token"]
    assert 0 <= timings["prefill_wait"] <= timings["first_token"]


def test_plain_clients_calling_at_once_each_get_the_tokens_their_call_gets_alone(
    fleet: RunningFleet, catalog: Path
) -> None:
    fleet.infer("talker", "warm up")
    calls = [(f"caller {i} says " + "la " * (i * 3), 10 + 9 * i) for i in range(12)]
    with ThreadPoolExecutor(12) as pool:
        answers = list(
            pool.map(
                lambda c: _send(fleet, "talker", c[0], max_new_tokens=c[1]).get(timeout=120),
                calls,
            )
        )
    for (prompt, new), answer in zip(calls, answers, strict=True):
        alone = _alone(catalog, "talker", prompt, max_new_tokens=new)
        assert answer["outputs"]["tokens"] == alone["tokens"], prompt
        assert answer["outputs"]["texts"] == alone["texts"]


def test_a_short_call_sent_after_a_long_one_is_answered_first(fleet: RunningFleet) -> None:
    fleet.infer("slow-talker", "warm up")
    long = _send(fleet, "slow-talker", "a long story", max_new_tokens=500)
    until("the long call runs", lambda: fleet.active_calls(workers=3) >= 1, 30)
    short = _send(fleet, "slow-talker", "a short one", max_new_tokens=3)
    short.get(timeout=60)
    assert not long.ready(), "the short call waited for the long one"
    assert len(long.get(timeout=120)["outputs"]["tokens"][0]) > 3


def test_a_cancelled_call_stops_within_a_step_ends_revoked_and_the_worker_serves_on(
    fleet: RunningFleet,
) -> None:
    call = _send(fleet, "slow-talker", "tell me everything", max_new_tokens=500, stream=True)
    reader = redis.Redis.from_url(fleet.url)
    pieces = streams.read(reader, call.id, call.ready, timeout=60)
    next(pieces)
    load = fleet.client.send_task("gpufleet.status").get(timeout=30)["load"]["slow-talker"]
    assert load["running"] >= 1, (load, call.ready())  # the scaling rule sees it as load
    asked = time.monotonic()
    fleet.client.send_task("gpufleet.cancel", args=(call.id,)).get(timeout=30)
    rest = list(pieces)  # the stream ends once the worker stopped the call
    stopped = time.monotonic() - asked
    until("the call is revoked", lambda: call.state == "REVOKED", 10)
    assert len(rest) < 250, f"{len(rest)} more pieces came in {stopped:.2f} s after the cancel"
    assert fleet.infer("slow-talker", "still here")["outputs"]["finish_reasons"]


def test_calls_past_the_kv_budget_share_its_blocks_none_fails_and_the_ledger_holds_the_budget(
    fleet: RunningFleet, catalog: Path
) -> None:
    fleet.infer("tight", "warm up")
    prompt = "x" * 20  # 21 tokens with its BOS, + 100 new: a reach of 121 positions
    with ThreadPoolExecutor(4) as pool:
        handles = [_send(fleet, "tight", prompt, max_new_tokens=100) for _ in range(4)]
        answers = list(pool.map(lambda h: h.get(timeout=120), handles))
    alone = _alone(catalog, "tight", prompt, max_new_tokens=100)
    # Four calls' 484 positions are over the 224 that the budget's blocks hold: they were
    # admitted by the blocks their prompts take, and the youngest preempted (recomputed
    # later) as the blocks ran out; every one ends whole, with the tokens it makes alone.
    assert all(a["outputs"]["finish_reasons"] == ["length"] for a in answers)
    assert all(a["outputs"]["tokens"] == alone["tokens"] for a in answers)
    spec = Catalog.load(catalog)["tight"]
    budget = spec.kv_budget()
    assert budget is not None and budget.tokens == 250
    [replica] = fleet.registry.snapshot().replicas("tight")
    factor = PolicySettings().factor
    assert sum(replica.gpus.values()) == scale(128 * 2**20, factor) + budget.bytes


def test_the_cli_streams_a_chat_and_prints_what_the_plain_call_answers(
    fleet: RunningFleet, home: Path
) -> None:
    env = {**fleet_env(GPUFLEET_HOME=str(home)), "PYTHONPATH": str(REPO)}
    base = [sys.executable, "-m", "tasks.operator.cli", "infer", "talker", "hello", "--chat"]
    params = ["-p", "max_new_tokens=24", "-p", "temperature=0.9", "-p", "seed=4"]
    streamed = subprocess.run(
        [*base, *params, "--stream"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert streamed.returncode == 0, streamed.stderr
    plain = subprocess.run(
        [*base, *params, "--json"],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert plain.returncode == 0, plain.stderr
    answer = json.loads(plain.stdout)
    # the terminal gets the text with its control characters escaped (`call_cli.printable`)
    assert streamed.stdout == printable(answer["outputs"]["texts"][0]) + "\n"
    assert answer["outputs"]["finish_reasons"] in (["length"], ["stop"])


def _tight(fleet: RunningFleet) -> dict[str, Any]:
    """The status's generation figures of the `tight` model."""
    report = fleet.client.send_task("gpufleet.status").get(timeout=30)
    figures: dict[str, Any] = report["generation"]["tight"]
    return figures


def test_status_and_metrics_report_what_generating_calls_took_and_the_kv_budget(
    fleet: RunningFleet,
) -> None:
    from placement.ledger.registry import Registry
    from tasks.operator.metrics import FleetCollector

    for new in (5, 9, 13):
        fleet.infer("tight", "status " * new)
        _send(fleet, "tight", "counted", max_new_tokens=new).get(timeout=60)
    # a call's answer is stored within the step that ends it, its KV figures said after
    # that step: a status read at once may find them a moment before they drop to none
    until("the KV tokens are said given back", lambda: _tight(fleet)["kv_held_tokens"] == 0, 10)
    tight = _tight(fleet)
    assert tight["kv_budget_tokens"] == 250 and tight["kv_budget_bytes"] > 0
    assert tight["calls"] >= 6 and tight["tokens"] >= 5 + 9 + 13
    assert tight["ttft_buckets"][-1] == ["+Inf", tight["calls"]]
    assert tight["ttft_mean_ms"] > 0 and tight["inter_token_mean_ms"] > 0
    assert tight["kv_held_tokens"] == 0 and tight["kv_blocks_in_use"] == 0  # nothing runs now
    # The "status status ..." prompts begin alike: the later ones read the first's blocks,
    # which stay cached once their calls ended.
    assert tight["kv_blocks_cached"] > 0 and tight["prefix_hit_rate"] > 0
    collector = FleetCollector(Registry.from_url(fleet.operator_url, "default"), fleet.operator_url)
    families = {family.name: family for family in collector.collect()}
    samples = {
        (s.name, s.labels.get("le")): s.value
        for s in families["gpufleet_time_to_first_token_seconds"].samples
        if s.labels.get("model") == "tight"
    }
    assert samples[("gpufleet_time_to_first_token_seconds_count", None)] == tight["calls"]
    tokens = families["gpufleet_generated_tokens"].samples
    assert any(s.labels["model"] == "tight" and s.value == tight["tokens"] for s in tokens)
    assert "gpufleet_inter_token_seconds" in families
    blocks = {
        s.labels["state"]: s.value
        for s in families["gpufleet_kv_cache_blocks"].samples
        if s.labels["model"] == "tight"
    }
    assert blocks["cached"] == tight["kv_blocks_cached"]
    [hits] = [
        s for s in families["gpufleet_kv_prefix_hit_ratio"].samples if s.labels["model"] == "tight"
    ]
    assert hits.value == tight["prefix_hit_rate"]


def test_greedy_calls_get_the_same_tokens_from_either_replica_and_one_prompt_s_go_to_one(
    fleet: RunningFleet, catalog: Path
) -> None:
    fleet.client.send_task("gpufleet.deploy", args=("twins", 2)).get(timeout=60)

    def hot() -> bool:
        return [r.level for r in fleet.registry.snapshot().replicas("twins")] == ["HOT"] * 2

    until("both replicas of twins are HOT", hot, 120)

    def twelve_at_once(prompt: str) -> list[dict[str, Any]]:
        with ThreadPoolExecutor(12) as pool:
            handles = [_send(fleet, "twins", prompt, max_new_tokens=40) for _ in range(12)]
            return list(pool.map(lambda h: h.get(timeout=120), handles))

    # A prompt shorter than a prefix chunk has no chain: its calls go by load, to both
    # replicas, each of which computes it once and reads it from its cache after that.
    short = "a question of no system prompt"
    answers = twelve_at_once(short) + twelve_at_once(short)
    assert len({a["replica"] for a in answers}) == 2
    alone = _alone(catalog, "twins", short, max_new_tokens=40)
    assert all(a["outputs"]["tokens"] == alone["tokens"] for a in answers)
    # A longer one's calls all go to the replica its prefix was first sent to.
    system = "You answer questions about bicycles, briefly and politely. " * 6
    answers = twelve_at_once(system)
    assert len({a["replica"] for a in answers}) == 1
    alone = _alone(catalog, "twins", system, max_new_tokens=40)
    assert all(a["outputs"]["tokens"] == alone["tokens"] for a in answers)
