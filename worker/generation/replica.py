"""The engine of one resident replica, sized by its model's KV-cache budget."""

from __future__ import annotations

import logging
from typing import Any

import torch

from placement.catalog.catalog import ModelSpec
from worker.generation.engine import Engine, eos_ids

log = logging.getLogger(__name__)

MAX_ROWS = 64  # sequences one batch runs at once, as MAX_BATCH strings per call


def window_of(model: Any) -> int | None:
    """The positions the model holds, from its config (None: no limit it states)."""
    config = getattr(model, "config", None)
    for key in ("max_position_embeddings", "n_positions"):
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def replica_engine(model: Any, tokenizer: Any, spec: ModelSpec, device: torch.device) -> Engine:
    """An engine for `model` that holds at most its catalog KV-cache budget in tokens. A
    budget the config could not size (no readable config) holds one full-window call."""
    budget = spec.kv_budget()
    window = window_of(model)
    tokens = budget.tokens if budget is not None else 0
    if tokens <= 0:
        tokens = window or 2048
        log.warning(
            "%s has no KV-cache budget in tokens; holding one call of %d", spec.name, tokens
        )
    return Engine(
        model, tokenizer, device, budget=tokens, window=window, max_rows=MAX_ROWS,
        eos=eos_ids(model, tokenizer),
    )  # fmt: skip
