"""LoRA adapters of a base model: where the catalog says they are, and what each takes.

A text-generation entry may list fine-tunes of itself as PEFT LoRA adapters, served over
its one resident copy instead of as models of their own (docs/worker.md, "Adapters"):

    models:
      base-gpt:
        source: /models/gpt
        task: text-generation
        adapters: /models/gpt-adapters      # each subdirectory an adapter, named by its folder
        # adapters: {support: /a/support, legal: /a/legal}
        adapter_memory: 64MiB               # the GPU room its replicas keep for adapters
        adapter_rank: 16                    # the largest rank that room takes

Callers name an adapter as `BASE:ADAPTER`. A directory is listed again whenever a name is
not found in it, so an adapter copied in is served without a restart. Nothing here loads
an adapter: its bytes come from its safetensors header, and a damaged or unfit one is
reported (`problems`), never a reason to refuse the catalog or the other adapters.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from placement.catalog.estimate import safetensors_header, tensor_bytes
from placement.errors import UnknownAdapterError, describe

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
#: How peft names an adapter's factors for module `m` of its base: PREFIX + m + A_SUFFIX.
PREFIX = "base_model.model."
A_SUFFIX = ".lora_A.weight"
B_SUFFIX = ".lora_B.weight"
#: GPU room a base keeps for adapters when the catalog does not say (not tuned: about a
#: hundred rank-8 adapters on the attention of an 8-layer, 512-wide model).
DEFAULT_ADAPTER_MEMORY = 64 * 2**20
#: The largest adapter rank that room is laid out for when the catalog does not say
#: (vLLM's `max_lora_rank` default).
DEFAULT_ADAPTER_RANK = 16


@dataclass(frozen=True)
class AdapterSource:
    """Where a base model's adapters are: one directory of them, or named directories."""

    directory: Path | None = None
    named: tuple[tuple[str, Path], ...] = ()

    def listing(self) -> dict[str, Path]:
        """Every adapter's directory by name, as the disk holds them now."""
        found = dict(self.named)
        if self.directory is not None and self.directory.is_dir():
            for child in sorted(self.directory.iterdir()):
                if child.is_dir() and not child.name.startswith("."):
                    found.setdefault(child.name, child)
        return found


class Adapters:
    """The adapters one process knows of for one base model, listed again on a miss."""

    def __init__(self, base: str, source: AdapterSource) -> None:
        self.base = base
        self.source = source
        self._lock = threading.Lock()
        self._known: dict[str, Path] = {}

    def path(self, name: str) -> Path:
        """The directory of adapter `name`; UnknownAdapterError when the base lists none so."""
        with self._lock:
            if name not in self._known:
                self._known = self.source.listing()
            found = self._known.get(name)
            names = sorted(self._known)
        if found is None:
            raise UnknownAdapterError(
                f"model {self.base!r} has no adapter {describe(name, 60)}; it serves: "
                f"{', '.join(names) or 'none'}. Copy the adapter into its directory, or ask "
                "the fleet's operator to add it."
            )
        return found

    def names(self) -> list[str]:
        with self._lock:
            self._known = self.source.listing()
            return sorted(self._known)


def problem(path: Path) -> str | None:
    """Why the adapter at `path` cannot be served, found without loading it; None if no
    fault shows in its files (whether it fits the base is the worker's check)."""
    try:
        config = json.loads((path / CONFIG_FILE).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return f"no {CONFIG_FILE} in {path.name}"
    except (OSError, ValueError) as exc:
        return f"{CONFIG_FILE} is not readable JSON ({exc})"
    if not isinstance(config, dict) or config.get("peft_type") != "LORA":
        return "not a LoRA adapter (peft_type must be LORA)"
    try:
        tensor_bytes(path / WEIGHTS_FILE)
    except (OSError, ValueError) as exc:
        return f"{WEIGHTS_FILE}: {exc}"
    return None


def modules(path: Path) -> set[str]:
    """The base's modules the adapter at `path` changes, read from its weights' header
    (empty when the file cannot be read: `problem` says why)."""
    try:
        header, _ = safetensors_header(path / WEIGHTS_FILE)
    except (OSError, ValueError):
        return set()
    return {module_of(key) for key in header if key.endswith(A_SUFFIX)}


def module_of(key: str) -> str:
    """The base's module a factor named `key` (PREFIX + module + A_SUFFIX) belongs to."""
    return key.removesuffix(A_SUFFIX).removeprefix(PREFIX)


def parse_source(value: object, base_dir: Path) -> AdapterSource:
    """The catalog's `adapters` field: a directory, or a mapping of names to directories.
    Raises ValueError with what is wrong."""
    if isinstance(value, str) and value.strip():
        return AdapterSource(directory=_path(value, base_dir))
    if isinstance(value, Mapping) and value:
        named = []
        for name, where in value.items():
            if not isinstance(name, str) or not name or ":" in name:
                raise ValueError(f"adapter name {name!r} must be a non-empty string without ':'")
            if not isinstance(where, str) or not where.strip():
                raise ValueError(f"adapter {name!r}: expected a directory, got {where!r}")
            named.append((name, _path(where, base_dir)))
        return AdapterSource(named=tuple(named))
    raise ValueError(f"expected a directory or a mapping of names to directories, got {value!r}")


def _path(value: str, base_dir: Path) -> Path:
    return base_dir / Path(value.strip()).expanduser()


__all__ = [
    "A_SUFFIX",
    "B_SUFFIX",
    "CONFIG_FILE",
    "DEFAULT_ADAPTER_MEMORY",
    "DEFAULT_ADAPTER_RANK",
    "PREFIX",
    "WEIGHTS_FILE",
    "AdapterSource",
    "Adapters",
    "module_of",
    "modules",
    "parse_source",
    "problem",
]
