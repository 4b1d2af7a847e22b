"""A generation model's KV-cache budget: the memory the ledger reserves for it beside its weights.

A replica of a text-generation model holds its weights and the keys and values of the
tokens its running calls have seen. The second part grows with the calls, so it gets a
budget of its own, in the catalog:

    chat:
      source: /models/my-gpt
      task: text-generation
      kv_cache: 2GiB            # bytes, or
      # kv_cache: {tokens: 16384}

The budget is part of every reservation of the model (`Demand.kv_cache`), and the worker's
engine never holds more than its tokens (`worker.generation.engine`): calls that would pass
it wait. Without the field the budget is **8 calls at the model's full window, at most
32,768 tokens** (defaults, not tuned: eight full-length calls at once, bounded for models
with very long windows).

Tokens and bytes convert with the model's config, read as JSON (no transformers): a token
takes `2 x layers x key-value heads x head size x bytes per value`. A synthetic model's
config is its catalog `config` (else the task's default, `DEFAULT_CONFIGS`); a model on disk
has its `config.json` (`ModelSpec.kv_budget` picks which).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from placement.errors import CatalogError

log = logging.getLogger(__name__)

DEFAULT_CALLS = 8  # full-window calls the default budget holds
DEFAULT_MAX_TOKENS = 32_768  # the default budget's ceiling
_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}

# A small default model per task, for synthetic specs that carry no `config`. Tiny on
# purpose: a synthetic model stands in for a real one, accounted at its declared size.
_TINY_BERT: dict[str, Any] = {
    "model_type": "bert",
    "hidden_size": 32,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "intermediate_size": 64,
    "vocab_size": 512,
    "max_position_embeddings": 128,
}
_TINY_GPT2: dict[str, Any] = {
    "model_type": "gpt2",
    "n_layer": 2,
    "n_head": 2,
    "n_embd": 32,
    "vocab_size": 512,
    "n_positions": 128,
}
DEFAULT_CONFIGS: dict[str, dict[str, Any]] = {
    "feature-extraction": _TINY_BERT,
    "fill-mask": _TINY_BERT,
    "text-classification": _TINY_BERT,
    "forward": _TINY_BERT,
    "text-generation": _TINY_GPT2,
}


@dataclass(frozen=True)
class Budget:
    """A generation model's KV-cache budget."""

    tokens: int
    bytes: int
    per_token: int  # bytes one token's keys and values take


def budget_of(
    name: str,
    dtype: str,
    config: Mapping[str, Any] | None,
    kv_bytes: int | None,
    kv_tokens: int | None,
) -> Budget:
    """The budget of model `name` served at `dtype`, from its config (None: unreadable) and
    its catalog `kv_cache` (bytes or tokens, or neither for the default). Raises
    CatalogError when tokens are given and the config cannot convert them."""
    per_token = _per_token(config, dtype) if config is not None else None
    window = _window(config) if config is not None else None
    if kv_bytes is not None:
        tokens = kv_bytes // per_token if per_token else 0
        return Budget(tokens, kv_bytes, per_token or 0)
    if per_token is None:
        if kv_tokens is not None:
            raise CatalogError(
                f"model {name!r}: field 'kv_cache': cannot turn tokens into bytes without"
                " the model's config (layers, heads, hidden size); give kv_cache in bytes"
            )
        log.warning("model %s: no readable config, so no KV-cache budget is reserved", name)
        return Budget(0, 0, 0)
    count = kv_tokens
    if count is None:
        count = min(DEFAULT_CALLS * (window or 2048), DEFAULT_MAX_TOKENS)
    return Budget(count, count * per_token, per_token)


def read_config(directory: Path | None) -> Mapping[str, Any] | None:
    """A model directory's config.json as plain JSON (a multimodal config's language part),
    or None when there is none to read."""
    if directory is None or not (directory / "config.json").is_file():
        return None
    try:
        loaded = json.loads((directory / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(loaded, dict):
        return None
    text = loaded.get("text_config")
    return text if isinstance(text, dict) else loaded


def _first(config: Mapping[str, Any], *keys: str) -> int | None:
    for key in keys:
        value = config.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def _per_token(config: Mapping[str, Any], dtype: str) -> int | None:
    layers = _first(config, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(config, "num_attention_heads", "n_head")
    hidden = _first(config, "hidden_size", "n_embd", "d_model")
    if layers is None or heads is None or hidden is None:
        return None
    kv_heads = _first(config, "num_key_value_heads") or heads
    head_dim = _first(config, "head_dim") or hidden // heads
    name = dtype
    if name == "auto":
        declared = config.get("dtype", config.get("torch_dtype"))
        name = declared if declared in _ITEMSIZE else "float32"
    return 2 * layers * kv_heads * head_dim * _ITEMSIZE[name]


def _window(config: Mapping[str, Any]) -> int | None:
    return _first(config, "max_position_embeddings", "n_positions", "n_ctx")
