"""End to end: a real `gpufleet up` serves LoRA adapters of one base model by the names
`BASE:ADAPTER`, to plain Celery clients, to the project's client on its fast path, and to
OpenAI's own client over the HTTP API.

The adapters are made here with peft over the synthetic base (its weights come from its
name, so they are the same bits here and in the worker), and each answer is checked
against the adapter merged into the base by peft and run alone in this process.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
from openai import OpenAI

from placement.catalog.catalog import Catalog
from tests.running import REPO, RunningFleet, fleet_env, fleet_up
from worker.generation.engine import Engine, eos_ids
from worker.generation.serving import GenCall, Generated, run_calls
from worker.weights.synthetic import build_synthetic

pytestmark = pytest.mark.slow

CLI = [sys.executable, "-m", "tasks.operator.cli"]
SMALL = "{model_type: gpt2, n_layer: 2, n_head: 2, n_embd: 64, vocab_size: 512, n_positions: 256}"
ADAPTERS = {"legal": (4, ["c_attn"]), "support": (8, ["c_attn", "c_proj"])}


@pytest.fixture(scope="module")
def catalog(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("adapters-fleet")
    path = root / "models.yaml"
    path.write_text(
        textwrap.dedent(
            f"""
            models:
              writer:
                source: synthetic
                task: text-generation
                memory: 64MiB
                config: {SMALL}
                adapters: ./adapters
                adapter_memory: 1MiB
            """
        )
    )
    spec = Catalog.load(path)["writer"]
    for seed, (name, (rank, targets)) in enumerate(ADAPTERS.items(), start=1):
        net, _ = build_synthetic(spec)
        torch.manual_seed(seed)
        config = peft.LoraConfig(
            r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
        )
        peft.get_peft_model(net, config).save_pretrained(root / "adapters" / name)
    return path


@pytest.fixture(scope="module")
def home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("adapters-home")


@pytest.fixture(scope="module")
def fleet(catalog: Path, home: Path) -> Iterator[RunningFleet]:
    args = ["--sim-gpus", "1x4GiB", "--metrics-port", "0"]
    with fleet_up(catalog, args, fleet_env(GPUFLEET_HOME=str(home)), api=True) as running:
        yield running


def _merged(catalog: Path, adapter: str | None, prompt: str, **params: Any) -> dict[str, Any]:
    """The call's outputs from the adapter merged into the base, run alone here."""
    spec = Catalog.load(catalog)["writer"]
    net, tokenizer = build_synthetic(spec)
    if adapter is not None:
        where = catalog.parent / "adapters" / adapter
        net = peft.PeftModel.from_pretrained(net, where).merge_and_unload()
    engine = Engine(net, tokenizer, torch.device("cpu"), 4096, 256, eos=eos_ids(net, tokenizer))
    [answer] = run_calls(engine, [GenCall("alone", prompt, params)], None)
    assert isinstance(answer, Generated), answer
    return answer.outputs


def _send(fleet: RunningFleet, model: str, prompt: str, **params: Any) -> Any:
    return fleet.client.send_task("gpufleet.infer", args=(model, prompt, params))


def test_plain_celery_clients_calling_two_adapters_and_the_base_at_once_get_the_merged_tokens(
    fleet: RunningFleet, catalog: Path
) -> None:
    calls = [
        ("writer:legal", "Dear counsel"), ("writer:support", "my order is late"),
        ("writer", "the base alone"), ("writer:legal", "a second brief"),
        ("writer:support", "refund please"), ("writer", "once more"),
    ]  # fmt: skip
    with ThreadPoolExecutor(len(calls)) as pool:
        sent = list(pool.map(lambda c: _send(fleet, c[0], c[1], max_new_tokens=10), calls))
    for (model, prompt), call in zip(calls, sent, strict=True):
        answer = call.get(timeout=180)
        adapter = model.partition(":")[2] or None
        want = _merged(catalog, adapter, prompt, max_new_tokens=10)
        assert answer["outputs"]["tokens"] == want["tokens"], model
        assert answer["model"] == "writer"  # the call ran on the base's replica


def test_an_unknown_adapter_or_a_second_name_for_it_gets_a_clear_error_and_the_base_serves_on(
    fleet: RunningFleet, catalog: Path
) -> None:
    with pytest.raises(Exception, match="has no adapter 'nope'") as unknown:
        _send(fleet, "writer:nope", "x", max_new_tokens=2).get(timeout=120)
    assert type(unknown.value).__name__ == "UnknownAdapterError"
    assert "legal, support" in str(unknown.value)
    with pytest.raises(Exception, match="name it once"):
        _send(fleet, "writer:legal", "x", adapter="support").get(timeout=120)
    with pytest.raises(Exception, match="not in the catalog"):
        _send(fleet, "nobody:legal", "x").get(timeout=120)
    answer = _send(fleet, "writer:support", "still serving", max_new_tokens=6).get(timeout=120)
    want = _merged(catalog, "support", "still serving", max_new_tokens=6)
    assert answer["outputs"]["tokens"] == want["tokens"]


def test_the_project_client_s_adapter_calls_take_the_fast_path_to_the_base_s_replica(
    fleet: RunningFleet, catalog: Path
) -> None:
    script = textwrap.dedent(
        """
        import json
        from tasks.app import app

        outs = [app.send_task("gpufleet.infer", args=("writer:legal", "fast one",
                {"max_new_tokens": 8})).get(timeout=120) for _ in range(3)]
        print(json.dumps([o["outputs"]["tokens"] for o in outs]))
        """
    )
    env = fleet_env(GPUFLEET_REDIS_URL=fleet.fleet_url, GPUFLEET_MODELS=str(catalog))
    before = _counts(fleet)
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, env=env, capture_output=True, text=True,
        timeout=240, check=True,
    )  # fmt: skip
    tokens = json.loads(done.stdout.strip().splitlines()[-1])
    want = _merged(catalog, "legal", "fast one", max_new_tokens=8)["tokens"]
    assert tokens == [want] * 3
    after = _counts(fleet)
    assert after.get("fast", 0) - before.get("fast", 0) >= 2  # the replica is HOT: leased


def _counts(fleet: RunningFleet) -> dict[str, int]:
    report = fleet.client.send_task("gpufleet.status").get(timeout=30)
    counts: dict[str, int] = report["requests"]["models"].get("writer", {})
    return counts


def test_openai_s_client_lists_the_adapters_under_their_base_and_calls_one(
    fleet: RunningFleet, catalog: Path, home: Path
) -> None:
    printed = subprocess.run(
        [*CLI, "url", "--json"], cwd=REPO, env=fleet_env(GPUFLEET_HOME=str(home)),
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    conf = json.loads(printed)["openai"]
    client = OpenAI(base_url=conf["base_url"], api_key=conf["api_key"], max_retries=0)
    listed = {m.id: getattr(m, "parent", None) for m in client.models.list()}
    assert listed == {"writer": None, "writer:legal": "writer", "writer:support": "writer"}
    done = client.completions.create(
        model="writer:support", prompt="hello there", max_tokens=8, temperature=0
    )
    want = _merged(catalog, "support", "hello there", max_new_tokens=8)
    assert done.choices[0].text == want["texts"][0]
    assert done.model == "writer:support"


def test_status_and_metrics_show_the_adapters_each_replica_holds_and_a_damaged_one_s_fault(
    fleet: RunningFleet, catalog: Path
) -> None:
    from placement.ledger.registry import Registry
    from tasks.operator.metrics import FleetCollector

    for model in ("writer:legal", "writer:support", "writer:legal"):
        _send(fleet, model, "counted", max_new_tokens=3).get(timeout=120)
    damaged = catalog.parent / "adapters" / "damaged"
    damaged.mkdir()
    try:
        (damaged / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4')
        report = fleet.client.send_task("gpufleet.status").get(timeout=30)
    finally:
        shutil.rmtree(damaged)
    writer = report["generation"]["writer"]
    [(replica, held)] = writer["adapters_by_replica"].items()
    assert held == 2  # legal and support, in the one replica's slots
    assert writer["adapter_loads"] == 2 and writer["adapter_hits"] >= 2
    assert writer["adapter_evictions"] == 0
    assert "not readable JSON" in writer["adapter_problems"]["damaged"]
    assert report["problems"] == []  # the ledger equals what the worker holds
    collector = FleetCollector(Registry.from_url(fleet.operator_url, "default"), fleet.operator_url)
    families = {family.name: family for family in collector.collect()}
    [sample] = [s for s in families["gpufleet_adapters_held"].samples
                if s.labels["model"] == "writer"]  # fmt: skip
    assert (sample.labels["replica"], sample.value) == (replica, 2)
    events = {s.labels["event"]: s.value for s in families["gpufleet_adapter_events"].samples
              if s.labels["model"] == "writer"}  # fmt: skip
    assert events["load"] == 2 and events["eviction"] == 0
