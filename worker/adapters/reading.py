"""Reading a PEFT LoRA adapter from disk, and checking it against the base it runs on.

An adapter is a directory with `adapter_config.json` and `adapter_model.safetensors`, as
peft's `save_pretrained` writes it. Reading it gives, per module of the base it changes,
the two factors of its update (`x @ A.T @ B.T * scale` added to the module's output), kept
in host memory by the process's `Shelf` so that a base placed again, or another replica on
this worker, takes it in milliseconds instead of from disk. What an adapter may not do
here (DoRA, biases, per-module ranks, modules saved whole) is refused with its reason: a
row of a mixed batch is the base plus a low-rank product, nothing else.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch

from placement.catalog.adapters import A_SUFFIX, B_SUFFIX, CONFIG_FILE, WEIGHTS_FILE, module_of
from placement.errors import AdapterError

log = logging.getLogger(__name__)

#: Adapters a process keeps read in host memory, and the most bytes they may take; the
#: least recently used leave first (not tuned: hundreds of small adapters, or a few dozen
#: of a 7B model's, whichever comes first).
SHELF_ADAPTERS = 512
SHELF_BYTES = 2**30


@dataclass(frozen=True)
class Read:
    """An adapter as read from disk: its rank and scale, per module path its factors A
    (rank x in) and B (out x rank) in the dtype it was saved in, and its files' stamp
    (`stamp`: which version of them this is)."""

    name: str
    rank: int
    scale: float
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]]
    stamp: bytes

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes + b.nbytes for a, b in self.factors.values())


def read(name: str, path: Path, stamp: bytes = b"") -> Read:
    """Read adapter `name` from `path` (AdapterError naming it when it cannot be served);
    `stamp` names the version of its files read."""
    from peft import LoraConfig  # peft pulls in much of transformers: only when asked
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    if not (path / CONFIG_FILE).is_file():
        raise AdapterError(f"adapter {name!r} has no {CONFIG_FILE}; save it with peft")
    try:
        config = LoraConfig.from_pretrained(str(path))
    except Exception as exc:  # peft raises what its parsing meets
        raise AdapterError(
            f"adapter {name!r}: {CONFIG_FILE} is not a LoRA config ({exc})"
        ) from None
    why = _unsupported(config)
    if why:
        raise AdapterError(f"adapter {name!r} cannot be served: {why}")
    try:
        tensors = load_file(str(path / WEIGHTS_FILE))
    except (OSError, SafetensorError) as exc:
        raise AdapterError(
            f"adapter {name!r}: {WEIGHTS_FILE} cannot be read ({exc}); save it again"
        ) from None
    rank = int(config.r)
    alpha = float(config.lora_alpha)
    scale = alpha / math.sqrt(rank) if config.use_rslora else alpha / rank
    factors: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for key in tensors:
        if not key.endswith((A_SUFFIX, B_SUFFIX)):
            raise AdapterError(
                f"adapter {name!r} holds {key!r}, which is not a LoRA factor (embedding or"
                " token adapters are not served); merge it into a model of its own"
            )
        if not key.endswith(A_SUFFIX):
            continue
        module = module_of(key)
        b = tensors.get(key.replace(".lora_A.", ".lora_B."))
        a = tensors[key]
        if b is None or a.dim() != 2 or b.dim() != 2 or a.shape[0] != rank or b.shape[1] != rank:
            raise AdapterError(
                f"adapter {name!r}: module {module!r} does not hold a rank-{rank} pair of"
                " factors; its file is damaged or not a LoRA adapter"
            )
        factors[module] = (a, b)
    if not factors or len(tensors) != 2 * len(factors):
        raise AdapterError(
            f"adapter {name!r}: {WEIGHTS_FILE} does not hold pairs of LoRA factors; save it again"
        )
    return Read(name, rank, scale, factors, stamp)


def _unsupported(config: Any) -> str:
    """Why an adapter's config asks for more than a low-rank product per module ('' if not)."""
    if str(getattr(config, "peft_type", "")).split(".")[-1].upper() != "LORA":
        return "it is not a LoRA adapter"
    if getattr(config, "use_dora", False):
        return "DoRA adapters are not served; merge it into a model of its own"
    if getattr(config, "bias", "none") != "none" or getattr(config, "lora_bias", False):
        return "adapters that train biases are not served"
    if getattr(config, "modules_to_save", None):
        return "adapters that save whole modules (modules_to_save) are not served"
    if getattr(config, "rank_pattern", None) or getattr(config, "alpha_pattern", None):
        return "per-module ranks or alphas (rank_pattern, alpha_pattern) are not served"
    if getattr(config, "target_parameters", None):
        return "adapters of parameters (target_parameters) are not served"
    if getattr(config, "trainable_token_indices", None):
        return "adapters that train token embeddings (trainable_token_indices) are not served"
    if getattr(config, "layer_replication", None):
        return "adapters that replicate layers (layer_replication) are not served"
    return ""


def module_dims(model: torch.nn.Module, module: str) -> tuple[int, int] | None:
    """(in, out) features of the base's module `module` if a LoRA factor pair can ride on
    it (a Linear, or transformers' Conv1D as GPT-2 has); None when it has no such module."""
    try:
        found = model.get_submodule(module)
    except AttributeError:
        return None
    if isinstance(found, torch.nn.Linear):
        return found.in_features, found.out_features
    if type(found).__name__ == "Conv1D" and getattr(found, "weight", None) is not None:
        shape = cast(torch.Tensor, found.weight).shape
        return int(shape[0]), int(shape[1])
    return None


def check_fits(adapter: Read, model: torch.nn.Module, rank: int) -> None:
    """AdapterError when `adapter` does not fit `model` (a module it lacks, factors of
    other shapes: an adapter of another base) or a room laid out for `rank`."""
    if adapter.rank > rank:
        raise AdapterError(
            f"adapter {adapter.name!r} has rank {adapter.rank}, above its base's adapter_rank"
            f" {rank}; raise adapter_rank in the catalog"
        )
    for module, (a, b) in adapter.factors.items():
        dims = module_dims(model, module)
        if dims is None:
            raise AdapterError(
                f"adapter {adapter.name!r} changes module {module!r}, which its base has not"
                " (as a linear layer); it was trained on another model"
            )
        if (a.shape[1], b.shape[0]) != dims:
            raise AdapterError(
                f"adapter {adapter.name!r}: module {module!r} takes {a.shape[1]} -> "
                f"{b.shape[0]} features, its base's {dims[0]} -> {dims[1]}; it was trained on"
                " another model"
            )


class Shelf:
    """Adapters read in host memory, by directory; the least recently used go first. A
    directory whose files changed since is read again. Thread-safe."""

    def __init__(self, capacity: int = SHELF_ADAPTERS, most_bytes: int = SHELF_BYTES) -> None:
        self.capacity = capacity
        self.most_bytes = most_bytes
        self._lock = threading.Lock()
        self._held: OrderedDict[tuple[str, Path], Read] = OrderedDict()
        self._bytes = 0

    def get(self, name: str, path: Path) -> tuple[Read, bool]:
        """Adapter `name` at `path`, and whether it was on the shelf (False: read now)."""
        key = (name, path)
        stamp = _stamp(path)
        with self._lock:
            held = self._held.get(key)
            if held is not None and held.stamp == stamp:
                self._held.move_to_end(key)
                return held, True
        adapter = read(name, path, stamp)
        with self._lock:
            old = self._held.pop(key, None)
            self._bytes += adapter.nbytes - (old.nbytes if old is not None else 0)
            self._held[key] = adapter
            while len(self._held) > 1 and (
                len(self._held) > self.capacity or self._bytes > self.most_bytes
            ):
                self._bytes -= self._held.popitem(last=False)[1].nbytes
        return adapter, False


def _stamp(path: Path) -> bytes:
    """When and how big the adapter's files were last written (0s when missing)."""
    stamp: list[int] = []
    for file in (path / CONFIG_FILE, path / WEIGHTS_FILE):
        try:
            stat = file.stat()
        except OSError:
            stamp += [0, 0]
        else:
            stamp += [stat.st_mtime_ns, stat.st_size]
    return ":".join(map(str, stamp)).encode()


SHELF = Shelf()

__all__ = [
    "SHELF", "SHELF_ADAPTERS", "SHELF_BYTES", "Read", "Shelf", "check_fits", "module_dims", "read",
]  # fmt: skip
