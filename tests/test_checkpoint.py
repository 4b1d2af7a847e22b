"""gpufleet's safetensors reader: same models as transformers' loader, or a clear refusal."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from placement.catalog.catalog import Catalog, ModelSpec
from placement.errors import CheckpointError
from tests.fleets import GiB
from worker.devices import Device, simulated_devices
from worker.residency import ResidencyManager
from worker.weights import checkpoint as checkpoint_module
from worker.weights.checkpoint import Checkpoint, Prefetch

HOST = "testhost"
REPO = Path(__file__).resolve().parents[1]
TINY = {"num_attention_heads": 2, "vocab_size": 128}
ARCHITECTURES: dict[str, tuple[str, str, dict[str, Any]]] = {
    # name: (transformers class, catalog task, config)
    "bert-masked-lm": (
        "BertForMaskedLM", "fill-mask",
        {"model_type": "bert", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
         "max_position_embeddings": 64, **TINY},
    ),
    "gpt2-tied-head": (
        "GPT2LMHeadModel", "text-generation",
        {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2, "n_positions": 64,
         "vocab_size": 128},
    ),
    "llama-rotary": (
        "LlamaForCausalLM", "text-generation",
        {"model_type": "llama", "hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64,
         "num_key_value_heads": 1, "max_position_embeddings": 64, **TINY},
    ),
}  # fmt: skip


@pytest.fixture
def devices() -> list[Device]:
    return simulated_devices("1x8GiB")


@pytest.fixture
def manager(devices: list[Device]) -> Iterator[ResidencyManager]:
    m = ResidencyManager(devices, HOST, warmup=False)
    yield m
    m.drop_all()


def save(directory: Path, cls_name: str, config: dict[str, Any], **kwargs: Any) -> Path:
    """Save a seeded random transformers model and a word-level tokenizer as a model directory."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    fields = dict(config)
    config_obj = transformers.AutoConfig.for_model(fields.pop("model_type"), **fields)
    torch.manual_seed(0)
    model = getattr(transformers, cls_name)(config_obj)
    model.save_pretrained(directory, **kwargs)
    specials = ["[PAD]", "[UNK]", "[MASK]", "[CLS]", "[SEP]"]
    vocab = {word: i for i, word in enumerate([*specials, *(f"w{i}" for i in range(100))])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend, pad_token="[PAD]", unk_token="[UNK]", mask_token="[MASK]",
        cls_token="[CLS]", sep_token="[SEP]", eos_token="[SEP]",
    )  # fmt: skip
    tokenizer.save_pretrained(directory)
    return directory


def spec(directory: Path, task: str, **fields: Any) -> ModelSpec:
    entry = {"source": str(directory), "task": task, **fields}
    return Catalog.from_mapping({"models": {"m": entry}}).get("m")


def load_both(
    manager: ResidencyManager, devices: list[Device], directory: Path, task: str, **fields: Any
) -> tuple[Any, Any]:
    """The same checkpoint loaded by gpufleet's reader and by transformers."""
    slots = {devices[0].gpu_id(HOST): GiB}
    ours = manager.load(spec(directory, task, **fields), "ours", slots)
    theirs = manager.load(spec(directory, task, loader="transformers", **fields), "theirs", slots)
    assert (ours.via, theirs.via) == ("safetensors", "transformers")
    return manager.residents["ours"].model, manager.residents["theirs"].model


def assert_same_model(ours: Any, theirs: Any) -> None:
    assert type(ours) is type(theirs)
    mine, reference = ours.state_dict(), theirs.state_dict()
    assert mine.keys() == reference.keys()
    for key, tensor in reference.items():
        assert mine[key].dtype == tensor.dtype, key
        assert torch.equal(mine[key], tensor), key
    buffers = dict(theirs.named_buffers())
    assert dict(ours.named_buffers()).keys() == buffers.keys()
    for key, tensor in ours.named_buffers():
        assert torch.equal(tensor, buffers[key]), key
    ids = torch.arange(1, 17).reshape(2, 8)
    with torch.inference_mode():
        first, second = ours(input_ids=ids), theirs(input_ids=ids)
    key = "logits" if "logits" in first else "last_hidden_state"
    assert torch.equal(first[key], second[key])
    assert ours.training is False


@pytest.mark.parametrize("name", sorted(ARCHITECTURES))
def test_the_reader_builds_the_same_model_as_transformers(
    name: str, tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, task, config = ARCHITECTURES[name]
    directory = save(tmp_path / name, cls_name, config)
    ours, theirs = load_both(manager, devices, directory, task)
    assert_same_model(ours, theirs)
    if hasattr(theirs, "generation_config"):
        assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()


def test_minilm_read_by_gpufleet_gives_the_embeddings_transformers_gives(
    manager: ResidencyManager, devices: list[Device]
) -> None:
    minilm = Catalog.load(REPO / "models.yaml").get("minilm")
    source = minilm.source_path()
    assert source is not None
    ours, theirs = load_both(manager, devices, source, "feature-extraction", dtype="float32")
    assert_same_model(ours, theirs)
    sentences = ["A man is eating food.", "The stock market fell sharply today."]
    assert manager.calls.infer("ours", sentences) == manager.calls.infer("theirs", sentences)


def test_a_head_stored_apart_from_tied_embeddings_stays_apart_as_in_transformers(
    tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, task, config = ARCHITECTURES["gpt2-tied-head"]
    directory = save(tmp_path / "untied", cls_name, config)  # the config ties the head
    _store_head_apart(directory)
    ours, theirs = load_both(manager, devices, directory, task)
    assert ours.lm_head.weight is not ours.transformer.wte.weight
    assert_same_model(ours, theirs)


@pytest.mark.parametrize("name", [*sorted(ARCHITECTURES), "gpt2-head-apart"])
def test_a_model_read_from_a_neighbours_warm_copy_is_the_model_read_from_disk(
    name: str, tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, task, config = ARCHITECTURES.get(name, ARCHITECTURES["gpt2-tied-head"])
    directory = save(tmp_path / name, cls_name, config)
    if name == "gpt2-head-apart":
        _store_head_apart(directory)
    model = spec(directory, task)
    holder = ResidencyManager(devices, HOST, warmup=False, arena_bytes=GiB, publish=True)
    slots = {devices[0].gpu_id(HOST): GiB}
    try:
        holder.load(model, "held", slots)
        holder.offload("held")
        read = manager.load(model, "read", slots, source=holder.locator("held"))
    finally:
        holder.drop_all()
    disk = manager.load(model, "disk", slots)
    assert (read.via, disk.via) == ("warm copy", "safetensors")
    ours, theirs = manager.residents["read"].model, manager.residents["disk"].model
    assert_same_model(ours, theirs)
    # tied as the disk's model is tied: a tied pair is one parameter
    assert len(list(ours.parameters())) == len(list(theirs.parameters()))


def _store_head_apart(directory: Path) -> None:
    """Give a tied-head GPT-2 checkpoint a head of its own."""
    from safetensors.torch import load_file, save_file

    weights = load_file(directory / "model.safetensors")
    weights["lm_head.weight"] = torch.randn_like(weights["transformer.wte.weight"])
    save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})


def test_generation_settings_come_from_config_json_when_there_is_no_generation_config(
    tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, task, config = ARCHITECTURES["gpt2-tied-head"]
    directory = save(tmp_path / "m", cls_name, config)
    (directory / "generation_config.json").unlink()
    fields = json.loads((directory / "config.json").read_text())
    fields["no_repeat_ngram_size"] = 2
    (directory / "config.json").write_text(json.dumps(fields))
    ours, theirs = load_both(manager, devices, directory, task)
    assert theirs.generation_config.no_repeat_ngram_size == 2
    assert ours.generation_config.to_dict() == theirs.generation_config.to_dict()


def test_a_task_model_checkpoint_loads_into_the_base_model_without_its_prefix(
    tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, _, config = ARCHITECTURES["gpt2-tied-head"]
    directory = save(tmp_path / "lm", cls_name, config)  # keys start with "transformer."
    ours, theirs = load_both(manager, devices, directory, "feature-extraction")
    assert "wte.weight" in ours.state_dict()
    assert_same_model(ours, theirs)


def test_a_sharded_checkpoint_is_read_from_every_shard(
    tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, task, config = ARCHITECTURES["llama-rotary"]
    directory = save(tmp_path / "sharded", cls_name, config, max_shard_size="40KB")
    assert len(Checkpoint.open(directory).files) > 2
    ours, theirs = load_both(manager, devices, directory, task)
    assert_same_model(ours, theirs)


@pytest.mark.parametrize(
    "why",
    [
        "the catalog asks for another dtype",
        "a weight is missing",
        "the catalog asks for transformers",
    ],
)
def test_checkpoints_the_reader_cannot_match_load_through_transformers(
    why: str, tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, task, config = ARCHITECTURES["gpt2-tied-head"]
    directory = save(tmp_path / "m", cls_name, config)
    fields = {
        "the catalog asks for another dtype": {"dtype": "float16"},
        "the catalog asks for transformers": {"loader": "transformers"},
    }.get(why, {})
    if why == "a weight is missing":
        from safetensors.torch import load_file, save_file

        weights = load_file(directory / "model.safetensors")
        del weights["transformer.h.0.mlp.c_fc.weight"]
        save_file(weights, directory / "model.safetensors", metadata={"format": "pt"})
    report = manager.load(spec(directory, task, **fields), "r", {devices[0].gpu_id(HOST): GiB})
    assert report.via == "transformers"
    assert manager.calls.infer("r", "hello", {"max_new_tokens": 2})["texts"]


def test_writing_to_a_loaded_weight_never_changes_the_file(
    tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, task, config = ARCHITECTURES["gpt2-tied-head"]
    directory = save(tmp_path / "m", cls_name, config)
    digest = hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest()
    manager.load(spec(directory, task), "r", {devices[0].gpu_id(HOST): GiB})
    with torch.no_grad():
        for parameter in manager.residents["r"].model.parameters():
            parameter.add_(1.0)
    assert hashlib.sha256((directory / "model.safetensors").read_bytes()).hexdigest() == digest


def write_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """Write a safetensors file by hand, tensors in the given order with no padding."""
    header: dict[str, Any] = {}
    offset = 0
    for name, (dtype, shape, data) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": shape,
            "data_offsets": [offset, offset + len(data)],
        }
        offset += len(data)
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    body = b"".join(data for _, _, data in tensors.values())
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + body)


def test_a_tensor_at_an_unaligned_offset_is_read_exactly(tmp_path: Path) -> None:
    values = torch.tensor([1.5, -2.25, 3.0], dtype=torch.float32)
    flags = torch.tensor([True, False, True])
    write_safetensors(
        tmp_path / "model.safetensors",
        {
            "flags": ("BOOL", [3], flags.numpy().tobytes()),
            "values": ("F32", [3], values.numpy().tobytes()),  # starts at byte 3
            "empty": ("F32", [0, 4], b""),
        },
    )
    read = Checkpoint.open(tmp_path).to_cpu(["flags", "values", "empty"])
    assert torch.equal(read["values"], values)
    assert torch.equal(read["flags"], flags)
    assert read["empty"].shape == (0, 4)


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        ("truncate", "truncated or corrupt"),
        ("overlap", "overlap or leave a hole"),
        ("header-length", "header length"),
        ("header-json", "not JSON"),
        ("shape", "do not match its shape"),
    ],
)
def test_a_damaged_checkpoint_is_refused_with_what_is_wrong(
    damage: str, message: str, tmp_path: Path, manager: ResidencyManager, devices: list[Device]
) -> None:
    cls_name, task, config = ARCHITECTURES["gpt2-tied-head"]
    directory = save(tmp_path / "m", cls_name, config)
    path = directory / "model.safetensors"
    raw = path.read_bytes()
    (length,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + length])
    if damage == "truncate":
        path.write_bytes(raw[: len(raw) - 100])
    elif damage == "header-length":
        path.write_bytes(struct.pack("<Q", len(raw)) + raw[8:])
    elif damage == "overlap":
        first, second = sorted(
            (k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"]
        )[:2]
        header[second]["data_offsets"] = header[first]["data_offsets"]
        header[second]["shape"] = header[first]["shape"]
        header[second]["dtype"] = header[first]["dtype"]
        body = json.dumps(header, separators=(",", ":")).encode().ljust(length)
        path.write_bytes(raw[:8] + body + raw[8 + length :])
    elif damage == "header-json":
        path.write_bytes(raw[:8] + b"{" * length + raw[8 + length :])
    else:
        header["transformer.wte.weight"]["shape"] = [3, 3]
        body = json.dumps(header, separators=(",", ":")).encode().ljust(length)
        path.write_bytes(raw[:8] + body + raw[8 + length :])
    with pytest.raises(CheckpointError, match=message):
        manager.load(spec(directory, task), "r", {devices[0].gpu_id(HOST): GiB})
    assert manager.residents == {}
    assert manager.fraction(devices[0].index) == 1.0  # nothing reserved or charged


def test_a_file_cut_short_after_its_header_was_read_fails_cleanly_not_with_sigbus(
    tmp_path: Path,
) -> None:
    values = torch.arange(4 * 2**20, dtype=torch.float32)  # 16 MiB
    write_safetensors(
        tmp_path / "model.safetensors", {"w": ("F32", [4 * 2**20], values.numpy().tobytes())}
    )
    script = textwrap.dedent(
        f"""
        import os
        from pathlib import Path
        from placement.errors import CheckpointError
        from worker.weights.checkpoint import Checkpoint
        checkpoint = Checkpoint.open(Path({str(tmp_path)!r}))
        os.truncate({str(tmp_path / "model.safetensors")!r}, 4096)
        try:
            checkpoint.to_cpu(["w"])
        except CheckpointError as exc:
            print("CheckpointError:", exc)
        """
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, (done.returncode, done.stderr[-2000:])  # -7 would be SIGBUS
    assert "CheckpointError:" in done.stdout
    assert "truncated" in done.stdout


def test_a_shard_index_may_not_name_a_file_outside_the_model_directory(tmp_path: Path) -> None:
    index = {"weight_map": {"w": "../../etc/passwd"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="not a file name in its directory"):
        Checkpoint.open(tmp_path)


def test_the_prefetch_waits_for_the_reader_and_stops_when_told(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "blob"
    path.write_bytes(b"x" * (3 * 2**20))
    monkeypatch.setattr(checkpoint_module, "STEP", 2**20)
    monkeypatch.setattr(checkpoint_module, "LEAD", 2**20)
    prefetch = Prefetch([path])
    prefetch._thread.join(timeout=0.5)
    assert prefetch._thread.is_alive()  # held back: a full LEAD ahead of a reader at 0
    prefetch.advance(0, 3 * 2**20)
    prefetch._thread.join(timeout=5)
    assert not prefetch._thread.is_alive()  # read to the end once the reader moved on
    prefetch.stop()
