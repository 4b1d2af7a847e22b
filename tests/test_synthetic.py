"""Synthetic models: built from a catalog config, deterministic per name, harmless to the RNG."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from placement.catalog.catalog import TASKS, ModelSpec
from placement.errors import CatalogError
from worker.handlers import auto_class, run
from worker.weights.synthetic import DEFAULT_CONFIGS, SyntheticTokenizer, build_synthetic, seed_for

ROOT = Path(__file__).resolve().parents[1]
TINY_GPT = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 64,
    "vocab_size": 512,
    "n_positions": 128,
}
# One request per task; fill-mask needs the mask token.
REQUESTS: dict[str, Any] = {
    task: ["the quick brown [MASK]", "héllo [MASK] ✓"]
    if task == "fill-mask"
    else ["the quick brown fox", "héllo wörld ✓"]
    for task in TASKS
}


def spec(
    name: str, task: str, config: dict[str, Any] | None = None, dtype: str = "auto"
) -> ModelSpec:
    return ModelSpec(
        name=name, source="synthetic", task=task, dtype=dtype, memory=1 << 20, config=config
    )


def outputs(name: str) -> dict[str, Any]:
    """Build a synthetic model for every task under `name` and run one request on each."""
    results = {}
    for task in TASKS:
        model, tokenizer = build_synthetic(spec(f"{name}-{task}", task))
        results[task] = run(task, model, tokenizer, REQUESTS[task], None, None)
    return results


@pytest.fixture(scope="module")
def first_outputs() -> dict[str, Any]:
    return outputs("det")


@pytest.fixture(scope="module", autouse=True)
def fresh_process() -> Iterator[subprocess.Popen[str]]:
    """A second Python process computing `outputs("det")`, started first to run alongside."""
    script = textwrap.dedent(
        """
        import json, sys
        sys.path.insert(0, sys.argv[1])
        import tests.test_synthetic as t
        print(json.dumps(t.outputs("det")))
        """
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    process = subprocess.Popen(
        [sys.executable, "-c", script, str(ROOT)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        cwd=ROOT,
    )
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.communicate()


@pytest.mark.parametrize("task", TASKS)
def test_every_task_builds_the_right_auto_class_in_eval_mode_on_cpu_in_float32(
    task: str,
) -> None:
    model, tokenizer = build_synthetic(spec(f"shape-{task}", task))
    expected = auto_class(task)._model_mapping[type(model.config)]  # type: ignore[attr-defined]
    assert type(model) is expected
    assert not model.training
    assert {p.device.type for p in model.parameters()} == {"cpu"}
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    assert len(tokenizer) == model.config.vocab_size
    assert tokenizer.causal is (task == "text-generation")


def test_a_spec_without_config_gets_the_tiny_default_of_its_task() -> None:
    model, _ = build_synthetic(spec("default-gen", "text-generation"))
    assert model.config.model_type == "gpt2"
    assert model.config.n_embd == DEFAULT_CONFIGS["text-generation"]["n_embd"]


def test_the_catalog_config_decides_the_architecture() -> None:
    model, _ = build_synthetic(spec("tiny-gpt", "text-generation", TINY_GPT))
    assert model.config.n_embd == 64
    assert model.config.n_positions == 128
    assert model.config.eos_token_id == SyntheticTokenizer.eos_token_id


def test_the_spec_dtype_is_applied_and_auto_follows_the_config() -> None:
    bf16, tokenizer = build_synthetic(spec("bf16", "forward", dtype="bfloat16"))
    assert {p.dtype for p in bf16.parameters()} == {torch.bfloat16}
    assert run("forward", bf16, tokenizer, "runs in bfloat16", None, None)["batch"] == 1
    config = {**DEFAULT_CONFIGS["forward"], "dtype": "float16"}
    half, _ = build_synthetic(spec("half", "forward", config))
    assert {p.dtype for p in half.parameters()} == {torch.float16}


def test_two_independent_builds_give_bit_identical_outputs_for_every_task(
    first_outputs: dict[str, Any],
) -> None:
    assert outputs("det") == first_outputs


def test_two_independent_builds_give_bit_identical_weights() -> None:
    a, _ = build_synthetic(spec("weights", "text-generation", TINY_GPT))
    b, _ = build_synthetic(spec("weights", "text-generation", TINY_GPT))
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    assert all(torch.equal(sa[key], sb[key]) for key in sa)


def test_different_names_give_different_weights_and_outputs(first_outputs: dict[str, Any]) -> None:
    assert seed_for("det-forward") != seed_for("other-forward")
    other = outputs("other")
    for task in TASKS:
        assert other[task] != first_outputs[task], task


def test_building_leaves_the_global_rng_where_it_was() -> None:
    torch.manual_seed(1234)
    expected = torch.rand(4)
    torch.manual_seed(1234)
    build_synthetic(spec("rng", "forward"))
    assert torch.equal(torch.rand(4), expected)


@pytest.mark.parametrize(
    ("config", "fragment"),
    [
        ({"model_type": "no-such-model"}, "cannot build"),
        ({"model_type": "bert", "vocab_size": 3}, "vocab_size must be"),
        ({"model_type": "bert", "hidden_size": 30, "num_attention_heads": 4}, "cannot build"),
    ],
    ids=["unknown-model-type", "vocab-too-small", "heads-do-not-divide-hidden"],
)
def test_a_config_transformers_cannot_build_raises_catalog_error_naming_the_model(
    config: dict[str, Any], fragment: str
) -> None:
    with pytest.raises(CatalogError, match=fragment) as caught:
        build_synthetic(spec("broken", "forward", config))
    assert "'broken'" in str(caught.value)


# ---------------------------------------------------------------------------------------
# The tokenizer


def test_the_tokenizer_round_trips_utf8_text_when_the_vocab_covers_every_byte() -> None:
    tokenizer = SyntheticTokenizer(512)
    ids = tokenizer.encode("héllo ✓")
    assert ids[0] == tokenizer.cls_token_id
    assert ids[-1] == tokenizer.sep_token_id
    assert tokenizer.decode(ids, skip_special_tokens=True) == "héllo ✓"
    assert tokenizer.decode(ids) == "[CLS]héllo ✓[SEP]"


def test_the_tokenizer_folds_bytes_into_a_small_vocab_and_still_decodes() -> None:
    tokenizer = SyntheticTokenizer(16)
    ids = tokenizer.encode("any text ✓")
    assert max(ids) < 16
    assert isinstance(tokenizer.decode(ids), str)


def test_the_tokenizer_recognises_special_tokens_inside_text() -> None:
    tokenizer = SyntheticTokenizer(512)
    ids = tokenizer.encode("a [MASK] b", add_special_tokens=False)
    assert ids.count(tokenizer.mask_token_id) == 1
    assert tokenizer.convert_ids_to_tokens(ids) == ["a", "<0x20>", "[MASK]", "<0x20>", "b"]
    assert tokenizer.convert_ids_to_tokens(tokenizer.mask_token_id) == "[MASK]"


def test_the_tokenizer_pads_right_with_an_attention_mask_and_truncates_keeping_sep() -> None:
    tokenizer = SyntheticTokenizer(512)
    batch = tokenizer(["abcdef", "a"], padding=True, truncation=True, max_length=5)
    assert batch["input_ids"].tolist() == [[2, 102, 103, 104, 3], [2, 102, 3, 0, 0]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]


def test_a_causal_tokenizer_adds_only_bos_and_can_pad_left() -> None:
    tokenizer = SyntheticTokenizer(512, causal=True)
    batch = tokenizer(["ab", "a"], padding_side="left")
    assert batch["input_ids"].tolist() == [[2, 102, 103], [0, 2, 102]]
    assert batch["attention_mask"].tolist() == [[1, 1, 1], [0, 1, 1]]
    assert tokenizer.batch_decode(batch["input_ids"], skip_special_tokens=True) == ["ab", "a"]


def test_a_fresh_process_builds_bit_identical_models(
    fresh_process: subprocess.Popen[str], first_outputs: dict[str, Any]
) -> None:
    stdout, stderr = fresh_process.communicate(timeout=120)
    assert fresh_process.returncode == 0, stderr[-2000:]
    assert json.loads(stdout.strip().splitlines()[-1]) == first_outputs
