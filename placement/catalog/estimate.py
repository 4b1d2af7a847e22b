"""Estimate a model's GPU bytes from its transformers config, without reading its weights.

The placement policy needs a size before a model has ever been loaded. We build the model
on the meta device (shapes, no storage), then sum its parameter and buffer bytes at the dtype
it will be served in. This costs a second or two of CPU and no memory, and it never touches
the network: a directory is read locally, and a config dict is used as given.

torch, transformers and accelerate are imported inside the functions, so importing
`placement` stays light. `weights_bytes_on_disk` reads safetensors headers with the stdlib.
"""

from __future__ import annotations

import itertools
import json
import logging
import os
import struct
from collections.abc import Callable, Mapping
from functools import partial
from pathlib import Path
from typing import Any

from placement.errors import EstimateError

log = logging.getLogger(__name__)

#: Bytes per element of the dtypes a model can be served in.
ITEMSIZE: dict[str, int] = {"float32": 4, "float16": 2, "bfloat16": 2}

_HEADER_LIMIT = 100 * 2**20  # safetensors caps its JSON header at 100 MB


def estimate_bytes(
    source: str | os.PathLike[str] | Mapping[str, Any],
    dtype: str | None = None,
    trust_remote_code: bool = False,
) -> int:
    """Return the bytes a model's parameters and buffers take at `dtype`.

    `source` is a local model directory holding config.json, or a config dict with a
    `model_type` key (e.g. {"model_type": "bert", "hidden_size": 384, ...}). `dtype` is one of
    float32, float16, bfloat16; "auto" or None means the config's own dtype, else float32.
    Floating-point tensors are counted at `dtype`, integer buffers at their own width.

    Raises `EstimateError` naming the source and what to fix.
    """
    label = _describe(source)
    config = _load_config(source, trust_remote_code, label)
    itemsize = ITEMSIZE[_resolve_dtype(dtype, config, label)]
    model = _build_on_meta(config, trust_remote_code, label)
    total = 0
    for tensor in itertools.chain(model.parameters(), model.buffers()):
        width = itemsize if tensor.is_floating_point() else tensor.element_size()
        total += tensor.numel() * width
    log.debug("estimated %s at %d bytes (%d per element)", label, total, itemsize)
    return total


def weights_bytes_on_disk(directory: str | os.PathLike[str]) -> int:
    """Return the tensor bytes stored in the *.safetensors files of `directory`.

    Only the JSON headers are read, so this is cheap even for large checkpoints. It is the
    ground truth that estimates are checked against.
    """
    root = Path(directory).expanduser()
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise EstimateError(f"{root}: no *.safetensors files; point at a model directory")
    total = 0
    for path in files:
        try:
            total += tensor_bytes(path)
        except (OSError, ValueError) as exc:
            raise EstimateError(f"{path}: not a readable safetensors file ({exc})") from exc
    return total


def tensor_bytes(file: Path) -> int:
    """The bytes of the tensors a safetensors file holds, read from its header alone.
    Raises ValueError when the file is damaged (a header that does not parse, or tensors
    that run past the file's end)."""
    header, size = safetensors_header(file)
    total = 0
    for key, entry in header.items():
        offsets = entry.get("data_offsets")
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) and not isinstance(o, bool) for o in offsets)
        ):
            raise ValueError(f"tensor {key!r} has no data offsets; the file is damaged")
        begin, end = offsets
        if not 0 <= begin <= end <= size:
            raise ValueError(f"tensor {key!r} runs past the end of the file; it is truncated")
        total += end - begin
    return total


def safetensors_header(file: Path) -> tuple[dict[str, dict[str, Any]], int]:
    """A safetensors file's tensor entries by name, and the bytes of data after its
    header; ValueError when the header is not one."""
    with file.open("rb") as handle:
        raw = handle.read(8)
        if len(raw) != 8:
            raise ValueError("shorter than a safetensors header; the file is damaged")
        (length,) = struct.unpack("<Q", raw)
        if length > _HEADER_LIMIT:
            raise ValueError("its header is implausibly long; the file is damaged")
        try:
            header = json.loads(handle.read(length))
        except ValueError:
            raise ValueError("its header is not JSON; the file is damaged") from None
        size = file.stat().st_size - 8 - length
    if not isinstance(header, dict):
        raise ValueError("its header is not a mapping of tensors; the file is damaged")
    header.pop("__metadata__", None)
    if not all(isinstance(entry, dict) for entry in header.values()):
        raise ValueError("its header's tensors are not described; the file is damaged")
    return header, size


def _describe(source: object) -> str:
    if isinstance(source, Mapping):
        return f"config dict (model_type={source.get('model_type')!r})"
    return str(source)


def _short(exc: BaseException) -> str:
    """The first line of an error, trimmed: transformers' messages can list hundreds of names."""
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    return text if len(text) <= 300 else text[:300] + "..."


def _load_config(
    source: str | os.PathLike[str] | Mapping[str, Any], trust_remote_code: bool, label: str
) -> Any:
    from transformers import AutoConfig

    if isinstance(source, Mapping):
        fields = dict(source)
        model_type = fields.pop("model_type", None)
        if not isinstance(model_type, str) or not model_type:
            raise EstimateError(f"{label}: add a 'model_type' key, e.g. 'bert' or 'gpt2'")
        try:
            return AutoConfig.for_model(model_type, **fields)
        except Exception as exc:
            raise EstimateError(f"{label}: transformers cannot build it: {_short(exc)}") from exc
    directory = Path(source).expanduser()
    if not (directory / "config.json").is_file():
        raise EstimateError(
            f"{label}: not a local model directory with a config.json; gpufleet never downloads,"
            " so point at a directory on this host or pass a config dict"
        )
    try:
        return AutoConfig.from_pretrained(
            str(directory), local_files_only=True, trust_remote_code=trust_remote_code
        )
    except Exception as exc:
        hint = "" if trust_remote_code else " (custom code needs trust_remote_code: true)"
        raise EstimateError(f"{label}: cannot read config.json: {_short(exc)}{hint}") from exc


def _resolve_dtype(dtype: str | None, config: Any, label: str) -> str:
    """The dtype name to count floats at: the argument, else the config's, else float32."""
    if dtype is None or dtype == "auto":
        # transformers >= 4.56 calls it `dtype` and warns on reading `torch_dtype`.
        key = "dtype" if hasattr(config, "dtype") else "torch_dtype"
        declared = getattr(config, key, None)
        if declared is None:
            return "float32"
        name = str(declared).removeprefix("torch.")
        if name not in ITEMSIZE:
            raise EstimateError(
                f"{label}: the config's dtype {name!r} is not supported; pass dtype as one of"
                f" {', '.join(ITEMSIZE)}"
            )
        return name
    name = dtype.removeprefix("torch.")
    if name not in ITEMSIZE:
        raise EstimateError(
            f"{label}: unknown dtype {dtype!r}; use one of auto, {', '.join(ITEMSIZE)}"
        )
    return name


def _build_on_meta(config: Any, trust_remote_code: bool, label: str) -> Any:
    """Instantiate the model with every parameter and buffer on the meta device.

    The class named in the config's `architectures` comes first, because it is what the
    checkpoint holds (an untied LM head is real memory). Then AutoModel, then the causal-LM
    auto class for configs that register only that one.
    """
    import transformers
    from accelerate import init_empty_weights

    builders: list[tuple[str, Callable[[], Any]]] = []
    for name in getattr(config, "architectures", None) or ():
        cls = getattr(transformers, name, None)
        if cls is not None:
            builders.append((name, partial(cls, config)))
    for auto in (transformers.AutoModel, transformers.AutoModelForCausalLM):
        build = partial(auto.from_config, config, trust_remote_code=trust_remote_code)
        builders.append((auto.__name__, build))
    failures = []
    for name, builder in builders:
        try:
            with init_empty_weights(include_buffers=True):
                return builder()
        except Exception as exc:
            log.debug("%s: %s failed on meta: %s", label, name, exc)
            failures.append(f"{name}: {_short(exc)}")
    raise EstimateError(
        f"{label}: transformers cannot build this model ({'; '.join(failures)}); check the"
        " config, or declare memory in the catalog instead of estimating it"
    )
