"""The engine of one resident replica, sized by its model's KV-cache budget, and the room
it keeps for its model's LoRA adapters."""

from __future__ import annotations

import logging
from typing import Any

import torch

from placement.catalog import adapters
from placement.catalog.catalog import ModelSpec
from worker.adapters.reading import SHELF, Read
from worker.adapters.room import AdapterRoom
from worker.generation.engine import Engine, eos_ids
from worker.generation.kv.paged import Paged
from worker.generation.params import MAX_ROWS
from worker.passes import max_positions

log = logging.getLogger(__name__)


def replica_engine(
    model: Any,
    tokenizer: Any,
    spec: ModelSpec,
    device: torch.device,
    kv: Paged | None = None,
    *,
    graphs: bool | None = None,
) -> Engine:
    """An engine for `model` that holds at most its catalog KV-cache budget in tokens, in
    `kv` (the replica's paged cache, kept from its last engine) or new blocks; its decode
    steps from CUDA graphs as `graphs` says (None: on CUDA). A budget the config could not
    size (no readable config) holds one full-window call."""
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
        eos=eos_ids(model, tokenizer), kv=kv, graphs=graphs,
    )  # fmt: skip


def adapter_room(model: Any, spec: ModelSpec) -> AdapterRoom | None:
    """The room a replica of `spec` keeps for its adapters beside `model` (None if it lists
    none): laid out for the modules its adapters on disk change now (one whose files do
    not read adds none), or, with none there yet, for those peft changes by default on a
    model of its type."""
    if spec.adapters is None:
        return None
    listing = adapters.Adapters(spec.name, spec.adapters)
    targets: set[str] = set()
    for name in listing.names():  # one listing of the directory: `path` reads it back
        targets |= adapters.modules(listing.path(name))
    if not targets:
        targets = _default_targets(model)

    def find(name: str) -> tuple[Read, bool]:
        return SHELF.get(name, listing.path(name))

    room = AdapterRoom(
        model, spec.adapter_memory, spec.adapter_rank, sorted(targets), find=find,
        known=listing.path,
    )  # fmt: skip
    log.info(
        "%s keeps %d adapter slots of rank %d over %d modules (%d bytes)",
        spec.name, room.slots, room.rank, len(room.targets), room.nbytes,
    )  # fmt: skip
    return room


def _default_targets(model: Any) -> set[str]:
    """The modules peft's LoRA changes by default on a model of this type."""
    from peft.utils.constants import TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING

    kind = str(getattr(getattr(model, "config", None), "model_type", ""))
    names = TRANSFORMERS_MODELS_TO_LORA_TARGET_MODULES_MAPPING.get(kind, [])
    return {
        path for path, _ in model.named_modules()
        if any(path == n or path.endswith("." + n) for n in names)
    }  # fmt: skip
