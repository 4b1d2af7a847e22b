"""The engine of one resident replica, sized by its model's KV-cache budget."""

from __future__ import annotations

import logging
from typing import Any

import torch

from placement.catalog.catalog import ModelSpec
from worker.generation.engine import Engine, eos_ids
from worker.generation.paged import Paged
from worker.generation.params import MAX_ROWS
from worker.passes import max_positions

log = logging.getLogger(__name__)


def replica_engine(
    model: Any, tokenizer: Any, spec: ModelSpec, device: torch.device, kv: Paged | None = None
) -> Engine:
    """An engine for `model` that holds at most its catalog KV-cache budget in tokens, in
    `kv` (the replica's paged cache, kept from its last engine) or new blocks. A budget the
    config could not size (no readable config) holds one full-window call."""
    budget = spec.kv_budget()
    window = max_positions(getattr(model, "config", None))
    tokens = budget.tokens if budget is not None else 0
    if tokens <= 0:
        tokens = window or 2048
        log.warning(
            "%s has no KV-cache budget in tokens; holding one call of %d", spec.name, tokens
        )
    return Engine(
        model, tokenizer, device, budget=tokens, window=window, max_rows=MAX_ROWS,
        eos=eos_ids(model, tokenizer), kv=kv,
    )  # fmt: skip
