"""LoRA adapters over one base: the catalog's listing, the engine's mixed batches, and the
errors of adapters that cannot be served.

A GPT-2 is saved to disk, and adapters are made from it at run time with peft (with
random factors, so each changes the tokens). The reference for an adapter's rows is the
adapter merged into the base by peft (`merge_and_unload`) and run alone.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import peft
import pytest
import torch
import transformers

from placement.catalog import adapters
from placement.catalog.catalog import Catalog
from placement.catalog.estimate import tensor_bytes
from placement.errors import AdapterError, CatalogError, PayloadError, UnknownAdapterError
from worker.adapters.room import AdapterRoom
from worker.generation.engine import Engine
from worker.generation.replica import adapter_room
from worker.generation.serving import Driver, GenCall, Generated, run_calls
from worker.weights.synthetic import SyntheticTokenizer

CPU = torch.device("cpu")
SMALL = {"n_layer": 2, "n_head": 2, "n_embd": 64, "vocab_size": 512, "n_positions": 256}
OTHER = {"n_layer": 2, "n_head": 2, "n_embd": 32, "vocab_size": 512, "n_positions": 256}
TOKENIZER = SyntheticTokenizer(512, causal=True)
# (rank, target modules) of each adapter: ranks below the room's, and different modules
LAYOUT = {"legal": (4, ["c_attn"]), "support": (8, ["c_attn", "c_proj"]), "chat": (2, ["c_fc"])}


def _gpt(config: dict[str, int], seed: int) -> Any:
    torch.manual_seed(seed)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(**config)).eval()


def _save_adapter(base: Path, where: Path, rank: int, targets: list[str], seed: int) -> None:
    torch.manual_seed(seed)
    net = transformers.GPT2LMHeadModel.from_pretrained(base)
    config = peft.LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False
    )
    peft.get_peft_model(net, config).save_pretrained(where)


@pytest.fixture(scope="module")
def disk(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A base GPT saved to disk, its adapters in `adapters/`, and one of another base."""
    root = tmp_path_factory.mktemp("adapters")
    _gpt(SMALL, 0).save_pretrained(root / "base")
    for seed, (name, (rank, targets)) in enumerate(LAYOUT.items(), start=1):
        _save_adapter(root / "base", root / "adapters" / name, rank, targets, seed)
    _gpt(OTHER, 0).save_pretrained(root / "other")
    _save_adapter(root / "other", root / "foreign" / "stranger", 4, ["c_attn"], 9)
    return root


def _catalog(disk: Path, **fields: Any) -> Catalog:
    entry = {
        "source": str(disk / "base"), "task": "text-generation", "memory": "64MiB",
        "adapters": str(disk / "adapters"), **fields,
    }  # fmt: skip
    return Catalog.from_mapping({"models": {"base": entry}})


@pytest.fixture
def engine(disk: Path) -> Iterator[Engine]:
    spec = _catalog(disk)["base"]
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
    engine = Engine(net, TOKENIZER, CPU, budget=4096, window=256)
    engine.adapters = adapter_room(net, spec)
    yield engine
    assert engine.adapters is not None
    engine.adapters.close()


def _merged(disk: Path, adapter: str | None) -> Any:
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
    if adapter is None:
        return net
    return peft.PeftModel.from_pretrained(net, disk / "adapters" / adapter).merge_and_unload()


def _alone(disk: Path, adapter: str | None, prompt: str, **params: Any) -> list[int]:
    engine = Engine(_merged(disk, adapter), TOKENIZER, CPU, budget=4096, window=256)
    [answer] = run_calls(engine, [GenCall("alone", prompt, params)], None)
    assert isinstance(answer, Generated), answer
    tokens: list[int] = answer.outputs["tokens"][0]
    return tokens


def _tokens(outcome: object) -> list[int]:
    assert isinstance(outcome, Generated), outcome
    tokens: list[int] = outcome.outputs["tokens"][0]
    return tokens


def test_a_base_with_adapters_steps_rows_of_the_base_alone_in_its_decode_graphs_shapes(
    disk: Path,
) -> None:
    spec = _catalog(disk)["base"]
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
    engine = Engine(net, TOKENIZER, CPU, budget=4096, window=256, graphs=True)
    engine.adapters = adapter_room(net, spec)
    assert engine.kv is not None and engine._graphs is not None
    [base] = run_calls(engine, [GenCall("base", "plain rows", {"max_new_tokens": 6})], None)
    shaped = dict(engine.kv.graphs._shapes) if engine.kv.graphs is not None else {}
    assert shaped  # its decode steps ran in the graphs' fixed shapes (padded, on a CPU)
    [tuned] = run_calls(
        engine, [GenCall("tuned", "adapted rows", {"max_new_tokens": 6, "adapter": "legal"})],
        None,
    )  # fmt: skip
    assert _tokens(base) == _alone(disk, None, "plain rows", max_new_tokens=6)
    assert _tokens(tuned) == _alone(disk, "legal", "adapted rows", max_new_tokens=6)


def test_rows_of_different_adapters_in_one_batch_equal_each_adapter_merged_and_run_alone(
    disk: Path, engine: Engine
) -> None:
    prompts = ["Dear counsel,", "my order is late", "hi", "the base model alone", "again hi"]
    names = ["legal", "support", "chat", None, "legal"]
    calls = [
        GenCall(str(i), prompt, {"max_new_tokens": 12, "adapter": name})
        for i, (prompt, name) in enumerate(zip(prompts, names, strict=True))
    ]
    outcomes = run_calls(engine, calls, None)
    for outcome, prompt, name in zip(outcomes, prompts, names, strict=True):
        assert _tokens(outcome) == _alone(disk, name, prompt, max_new_tokens=12), name
    assert len({tuple(_tokens(o)) for o in outcomes[:4]}) == 4  # each adapter changed them
    assert engine.adapters is not None
    assert engine.adapters.stats()["adapter_loads"] == 3
    assert engine.adapters.stats()["adapters_in_use"] == 0  # every call let its slot go


def test_a_mixed_batch_s_logits_are_within_1e_4_of_the_merged_models(
    disk: Path, engine: Engine
) -> None:
    room = engine.adapters
    assert room is not None
    for name in LAYOUT:
        room.acquire(name)
    ids = torch.tensor([TOKENIZER.encode("the same prompt")] * 4)
    order = ["support", None, "chat", "legal"]
    with torch.no_grad(), room.rows(order):
        mixed = engine.model(input_ids=ids).logits
    for row, name in enumerate(order):
        with torch.no_grad():
            alone = _merged(disk, name)(input_ids=ids[:1]).logits[0]
        assert (mixed[row] - alone).abs().max().item() <= 1e-4, name


MOE = {
    "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 64, "num_hidden_layers": 2, "num_attention_heads": 2,
    "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
    "max_position_embeddings": 256,
}  # fmt: skip


def test_a_mixed_batch_through_a_moe_s_shared_expert_equals_each_adapter_merged(
    tmp_path: Path,
) -> None:
    # the shared expert's projections take the batch's tokens flattened, [rows x tokens, in]
    torch.manual_seed(0)
    config = transformers.Qwen2MoeConfig(**MOE)
    transformers.Qwen2MoeForCausalLM(config).eval().save_pretrained(tmp_path / "base")
    targets = ["q_proj", "gate_proj", "up_proj", "down_proj"]
    for seed, name in enumerate(("one", "two"), start=1):
        torch.manual_seed(seed)
        net = transformers.Qwen2MoeForCausalLM.from_pretrained(tmp_path / "base")
        lora = peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False)
        peft.get_peft_model(net, lora).save_pretrained(tmp_path / "adapters" / name)
    base = transformers.Qwen2MoeForCausalLM.from_pretrained(tmp_path / "base").eval()
    room = adapter_room(base, _catalog(tmp_path)["base"])
    assert room is not None
    assert any("shared_expert" in module for module in room._a)  # the case under test
    ids = torch.tensor([TOKENIZER.encode("the same prompt")] * 3)
    order = ["two", None, "one"]
    for name in ("one", "two"):
        room.acquire(name)
    with torch.no_grad(), room.rows(order):
        mixed = base(input_ids=ids).logits
    for row, name in enumerate(order):
        alone = transformers.Qwen2MoeForCausalLM.from_pretrained(tmp_path / "base").eval()
        if name is not None:
            merged = peft.PeftModel.from_pretrained(alone, tmp_path / "adapters" / name)
            alone = merged.merge_and_unload()
        with torch.no_grad():
            want = alone(input_ids=ids[:1]).logits[0]
        assert (mixed[row] - want).abs().max().item() <= 1e-4, name
    assert (mixed[0] - mixed[2]).abs().max().item() > 1e-3  # the adapters differ
    room.close()


def test_seeded_sampling_with_an_adapter_equals_its_merged_model(
    disk: Path, engine: Engine
) -> None:
    params = {"max_new_tokens": 10, "temperature": 0.9, "top_k": 50, "seed": 7}
    call = GenCall("s", "sample me", {**params, "adapter": "support"})
    [outcome] = run_calls(engine, [call], None)
    assert _tokens(outcome) == _alone(disk, "support", "sample me", **params)


def test_the_same_prompt_under_two_adapters_shares_no_cached_block(engine: Engine) -> None:
    prompt = "a system prompt long enough to fill several blocks of sixteen tokens " * 2
    run_calls(engine, [GenCall("a", prompt, {"max_new_tokens": 2, "adapter": "legal"})], None)
    assert engine.kv is not None
    before = engine.kv.pool.reused_tokens
    run_calls(engine, [GenCall("b", prompt, {"max_new_tokens": 2, "adapter": "chat"})], None)
    assert engine.kv.pool.reused_tokens == before  # another adapter's keys: nothing reused
    run_calls(engine, [GenCall("c", prompt, {"max_new_tokens": 2, "adapter": "chat"})], None)
    assert engine.kv.pool.reused_tokens > before  # its own adapter's prefix is reused


def test_unknown_foreign_and_damaged_adapters_get_clear_errors_and_the_engine_serves_on(
    disk: Path, engine: Engine, tmp_path: Path
) -> None:
    shutil.copytree(disk / "foreign" / "stranger", disk / "adapters" / "stranger")
    damaged = disk / "adapters" / "damaged"
    shutil.copytree(disk / "adapters" / "legal", damaged)
    weights = damaged / adapters.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    try:
        calls = [
            GenCall("unknown", "x", {"max_new_tokens": 2, "adapter": "nope"}),
            GenCall("foreign", "x", {"max_new_tokens": 2, "adapter": "stranger"}),
            GenCall("damaged", "x", {"max_new_tokens": 2, "adapter": "damaged"}),
            GenCall("fine", "still here", {"max_new_tokens": 6, "adapter": "legal"}),
        ]
        unknown, foreign, bad, fine = run_calls(engine, calls, None)
    finally:
        shutil.rmtree(disk / "adapters" / "stranger")
        shutil.rmtree(damaged)
    assert isinstance(unknown, UnknownAdapterError)
    assert "has no adapter 'nope'" in str(unknown) and "legal" in str(unknown)
    assert isinstance(foreign, AdapterError) and "'stranger'" in str(foreign)
    assert "another model" in str(foreign)
    assert isinstance(bad, AdapterError) and "'damaged'" in str(bad)
    assert "save it again" in str(bad)
    assert _tokens(fine) == _alone(disk, "legal", "still here", max_new_tokens=6)
    assert adapters.problem(disk / "adapters" / "legal") is None


def test_an_adapter_copied_into_the_directory_is_served_without_a_restart(
    disk: Path, engine: Engine
) -> None:
    call = GenCall("a", "x", {"max_new_tokens": 2, "adapter": "late"})
    [refused] = run_calls(engine, [call], None)
    assert isinstance(refused, UnknownAdapterError)
    shutil.copytree(disk / "adapters" / "legal", disk / "adapters" / "late")
    try:
        [served] = run_calls(
            engine, [GenCall("b", "late one", {"max_new_tokens": 5, "adapter": "late"})], None
        )
    finally:
        shutil.rmtree(disk / "adapters" / "late")
    assert _tokens(served) == _alone(disk, "legal", "late one", max_new_tokens=5)


def _one_slot(disk: Path) -> tuple[Driver, AdapterRoom, dict[str, object]]:
    """A driver of an engine whose room holds one adapter, and where its answers go."""
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
    room = adapter_room(net, _catalog(disk, adapter_memory="150KiB", adapter_rank=8)["base"])
    assert room is not None and room.slots == 1
    engine = Engine(net, TOKENIZER, CPU, budget=4096, window=256)
    engine.adapters = room
    outcomes: dict[str, object] = {}
    driver = Driver(engine, None, lambda call, out: outcomes.__setitem__(call.key, out))
    return driver, room, outcomes


@pytest.mark.parametrize("memory", ["100KiB", "150KiB", "1MiB", "32MiB"])
def test_a_room_takes_no_more_bytes_than_the_adapter_memory_the_ledger_charges(
    disk: Path, memory: str
) -> None:
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
    spec = _catalog(disk, adapter_memory=memory, adapter_rank=8)["base"]
    room = adapter_room(net, spec)
    assert room is not None
    assert room.nbytes <= spec.adapter_memory
    room.close()
    assert room.nbytes == 0  # its slots let go with its hooks


def test_a_bfloat16_room_rounds_each_scaled_factor_once(disk: Path) -> None:
    # a scale of 3/8 (alpha 3, rank 8): rounding B, then B x scale, differs from rounding
    # B x scale once, where a power-of-two scale (the other adapters' 2) would not
    torch.manual_seed(11)
    tuned = peft.get_peft_model(
        transformers.GPT2LMHeadModel.from_pretrained(disk / "base"),
        peft.LoraConfig(r=8, lora_alpha=3, target_modules=["c_attn"], init_lora_weights=False),
    )
    tuned.save_pretrained(disk / "adapters" / "odd")
    try:
        net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
        room = adapter_room(net.to(torch.bfloat16), _catalog(disk)["base"])
        assert room is not None
        room.acquire("odd")
        read, _ = room._find("odd")
        slot = room._slot_of["odd"]
    finally:
        shutil.rmtree(disk / "adapters" / "odd")
    assert read.scale == 3 / 8
    for module, (_, b) in read.factors.items():
        kept = room._b[module][slot, : read.rank, :]
        assert kept.dtype == torch.bfloat16
        assert torch.equal(kept, (b.T.float() * read.scale).to(torch.bfloat16)), module


def test_a_room_of_one_slot_runs_two_adapters_in_turn_and_keeps_the_least_recently_used_out(
    disk: Path,
) -> None:
    driver, room, outcomes = _one_slot(disk)
    driver.add([GenCall("first", "one", {"max_new_tokens": 8, "adapter": "legal"})])
    driver.add([GenCall("second", "two", {"max_new_tokens": 8, "adapter": "support"})])
    driver.step()
    assert room.held() == ["legal"]  # the second waits for the slot
    while driver.busy:
        driver.step()
    room.close()
    assert _tokens(outcomes["first"]) == _alone(disk, "legal", "one", max_new_tokens=8)
    assert _tokens(outcomes["second"]) == _alone(disk, "support", "two", max_new_tokens=8)
    assert room.stats()["adapter_evictions"] == 1 and room.held() == ["support"]


def test_a_waiting_call_cancelled_before_it_got_a_slot_ends_cancelled_and_the_other_runs(
    disk: Path,
) -> None:
    driver, room, outcomes = _one_slot(disk)
    driver.add([GenCall("first", "one", {"max_new_tokens": 6, "adapter": "legal"})])
    driver.add([GenCall("second", "two", {"max_new_tokens": 6, "adapter": "support"})])
    driver.cancel("second")
    while driver.busy:
        driver.step()
    room.close()
    second = outcomes["second"]
    assert isinstance(second, Generated) and second.cancelled
    assert second.outputs["finish_reasons"] == ["cancelled"]
    assert _tokens(outcomes["first"]) == _alone(disk, "legal", "one", max_new_tokens=6)
    assert room.held() == ["legal"] and room.stats()["adapters_in_use"] == 0


def test_an_unknown_adapter_is_told_at_once_even_while_every_slot_is_in_use(disk: Path) -> None:
    driver, room, outcomes = _one_slot(disk)
    driver.add([GenCall("first", "one", {"max_new_tokens": 6, "adapter": "legal"})])
    driver.add([GenCall("unknown", "two", {"max_new_tokens": 6, "adapter": "nope"})])
    assert isinstance(outcomes.get("unknown"), UnknownAdapterError)  # before any step
    while driver.busy:
        driver.step()
    room.close()
    assert isinstance(outcomes["first"], Generated)


def test_a_step_that_fails_lets_go_of_its_calls_adapters_and_the_room_serves_the_next_engine(
    disk: Path,
) -> None:
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
    room = adapter_room(net, _catalog(disk, adapter_memory="150KiB", adapter_rank=8)["base"])
    assert room is not None
    failing = {"on": True}

    def fail(*_: object) -> None:
        if failing["on"]:
            raise RuntimeError("the device failed")

    hook = net.transformer.h[0].register_forward_pre_hook(fail)
    engine = Engine(net, TOKENIZER, CPU, budget=4096, window=256)
    engine.adapters = room
    with pytest.raises(RuntimeError, match="the device failed"):
        run_calls(engine, [GenCall("a", "x", {"max_new_tokens": 3, "adapter": "legal"})], None)
    assert room.stats()["adapters_in_use"] == 0  # its slot is free for others
    failing["on"] = False
    hook.remove()
    engine = Engine(net, TOKENIZER, CPU, budget=4096, window=256)
    engine.adapters = room
    call = GenCall("b", "after", {"max_new_tokens": 4, "adapter": "support"})
    [served] = run_calls(engine, [call], None)  # the one slot goes to another adapter
    room.close()
    assert _tokens(served) == _alone(disk, "support", "after", max_new_tokens=4)


def test_an_adapter_of_a_rank_above_the_room_s_is_refused_with_what_to_change(
    disk: Path,
) -> None:
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
    room = adapter_room(net, _catalog(disk, adapter_rank=4)["base"])
    assert room is not None
    with pytest.raises(AdapterError, match="raise adapter_rank"):
        room.acquire("support")
    room.close()


def test_a_model_without_adapters_refuses_an_adapter_call_and_serves_on(disk: Path) -> None:
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval()
    engine = Engine(net, TOKENIZER, CPU, budget=4096, window=256)
    refused, served = run_calls(
        engine,
        [GenCall("a", "x", {"adapter": "legal"}), GenCall("b", "y", {"max_new_tokens": 3})],
        None,
    )
    assert isinstance(refused, PayloadError) and "serves no adapters" in str(refused)
    assert isinstance(served, Generated)


def test_the_catalog_resolves_base_colon_adapter_and_charges_the_adapters_room(
    disk: Path,
) -> None:
    catalog = _catalog(disk, adapter_memory="32MiB")
    spec, adapter = catalog.resolve("base:legal")
    assert (spec.name, adapter) == ("base", "legal")
    assert catalog.resolve("base") == (spec, None)
    assert spec.demand().beside == spec.demand().kv_cache + 32 * 2**20
    listing = catalog.adapters_of("base")
    assert listing is not None and listing.names() == sorted(LAYOUT)


@pytest.mark.parametrize(
    ("fields", "fragment"),
    [
        ({"adapters": 7}, "expected a directory or a mapping"),
        ({"adapters": {"a:b": "x"}}, "without ':'"),
        ({"adapter_rank": 8}, "add 'adapters'"),
        ({"adapters": "x", "adapter_rank": 0}, "whole number >= 1"),
        ({"adapters": "x", "adapter_memory": "lots"}, "adapter_memory"),
    ],
)
def test_a_bad_adapters_field_fails_the_catalog_naming_it(
    fields: dict[str, Any], fragment: str
) -> None:
    entry = {"source": "synthetic", "task": "text-generation", "memory": "64MiB", **fields}
    with pytest.raises(CatalogError, match=fragment):
        Catalog.from_mapping({"models": {"gen": entry}})


def test_a_model_name_that_reads_as_another_s_adapter_is_refused_at_load() -> None:
    entry = {"source": "synthetic", "task": "text-generation", "memory": "64MiB"}
    models = {"gen": {**entry, "adapters": "x"}, "gen:tuned": entry}
    with pytest.raises(CatalogError, match="reads as adapter 'tuned' of 'gen'"):
        Catalog.from_mapping({"models": models})
    encoder = {"source": "synthetic", "task": "feature-extraction", "memory": "64MiB"}
    with pytest.raises(CatalogError, match="only a text-generation model takes adapters"):
        Catalog.from_mapping({"models": {"enc": {**encoder, "adapters": "x"}}})


def test_a_damaged_adapter_is_reported_by_its_files_without_loading_it(
    disk: Path, tmp_path: Path
) -> None:
    shutil.copytree(disk / "adapters" / "legal", tmp_path / "cut")
    weights = tmp_path / "cut" / adapters.WEIGHTS_FILE
    weights.write_bytes(weights.read_bytes()[:-100])
    assert "truncated" in str(adapters.problem(tmp_path / "cut"))
    weights.write_bytes(b"\x02\x00\x00\x00\x00\x00\x00\x0042")  # a header that is a number
    assert "not a mapping of tensors" in str(adapters.problem(tmp_path / "cut"))
    assert adapters.modules(tmp_path / "cut") == set()
    (tmp_path / "cut" / adapters.CONFIG_FILE).write_text("{not json")
    assert "not readable JSON" in str(adapters.problem(tmp_path / "cut"))
    assert tensor_bytes(disk / "adapters" / "legal" / adapters.WEIGHTS_FILE) > 0


@pytest.mark.gpu
def test_rows_of_different_adapters_on_the_gpu_equal_each_adapter_merged_and_run_alone(
    disk: Path,
) -> None:
    cuda = torch.device("cuda:0")
    net = transformers.GPT2LMHeadModel.from_pretrained(disk / "base").eval().to(cuda)
    engine = Engine(net, TOKENIZER, cuda, budget=4096, window=256)
    engine.adapters = adapter_room(net, _catalog(disk)["base"])
    assert engine.adapters is not None and engine.adapters.nbytes > 0
    prompts = ["Dear counsel,", "my order is late", "hi", "the base alone"]
    names = ["legal", "support", "chat", None]
    calls = [
        GenCall(str(i), prompt, {"max_new_tokens": 10, "adapter": name})
        for i, (prompt, name) in enumerate(zip(prompts, names, strict=True))
    ]
    outcomes = run_calls(engine, calls, None)
    engine.adapters.close()
    for outcome, prompt, name in zip(outcomes, prompts, names, strict=True):
        alone = Engine(_merged(disk, name).to(cuda), TOKENIZER, cuda, budget=4096, window=256)
        [want] = run_calls(alone, [GenCall("alone", prompt, {"max_new_tokens": 10})], None)
        assert _tokens(outcome) == _tokens(want), name
