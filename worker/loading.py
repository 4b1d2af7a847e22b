"""Put a catalog model's weights on the devices a placement plan gave it, and check they landed.

On CUDA the rules come from NDIF's ModelActor (seed 000):
- `torch.cuda.set_device` first, so the CUDA context lands on the target GPU, not GPU 0;
- accelerate's `max_memory` gives each target GPU its planned bytes and every other GPU 0
  (and the CPU 0: a model that does not fit fails loudly instead of spilling to RAM);
- after every load or restore, every parameter must sit on one of the target devices.
Simulated GPUs are the CPU; `worker.residency` accounts their bytes.

Weights are read by `worker.weights.checkpoint` (large sequential reads, several times faster than
transformers' per-tensor loader) whenever the result would equal `from_pretrained`'s;
everything else, and every multi-GPU plan, goes through `from_pretrained` itself.
"""

from __future__ import annotations

import copy
import functools
import itertools
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from placement.catalog.catalog import ModelSpec
from placement.errors import (
    ConfigError,
    PlacementError,
    UnsupportedCheckpointError,
    WarmCopyGoneError,
)
from worker import handlers
from worker.warm import sharing
from worker.warm.arena import PinnedArena, Region, align, layout
from worker.warm.sharing import Slot
from worker.weights.checkpoint import Checkpoint, Entry
from worker.weights.synthetic import build_synthetic

log = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def torch_device(index: int, simulated: bool) -> torch.device:
    """The torch device behind a GPU: itself, or the CPU for a simulated one."""
    return torch.device("cpu") if simulated else torch.device("cuda", index)


def max_memory(plan: Mapping[int, int]) -> dict[int | str, int]:
    """accelerate's `max_memory`: the planned bytes on target GPUs, 0 on all others and the CPU."""
    count = torch.cuda.device_count()
    limits: dict[int | str, int] = {i: int(plan.get(i, 0)) for i in range(count)}
    limits["cpu"] = 0
    return limits


@dataclass(frozen=True)
class Built:
    """A loaded model, its tokenizer, and which loader read the weights."""

    model: Any
    tokenizer: Any
    via: str  # "safetensors" (gpufleet's reader), "transformers", or "synthetic"


def build(spec: ModelSpec, plan: Mapping[int, int], simulated: bool, source: str = "") -> Built:
    """Load `spec` (from disk, a package, or synthetic) onto the planned devices, in eval mode.

    `plan` maps CUDA device index to planned bytes. A checkpoint goes through gpufleet's
    safetensors reader when the model has one GPU (or simulated ones) and its weights map
    one to one onto the model; anything else goes through transformers' `from_pretrained`.
    `source` locates a warm copy of the model that another worker of the host published
    (`worker.warm.sharing`): the same reader takes the weights from there instead, and from
    the disk when the copy is gone, changed while it was read, or does not match.
    """
    if not plan:
        raise PlacementError(f"{spec.name}: a load needs at least one target GPU")
    if not simulated:
        torch.cuda.set_device(min(plan))  # before any CUDA work: the context lands here
    if spec.synthetic:
        model, tokenizer = build_synthetic(spec)
        return Built(place(model, plan, simulated), tokenizer, "synthetic")
    path = spec.source_path()
    if path is None or not (path / "config.json").is_file():
        log.error("%s: its source %r has no config.json at %s", spec.name, spec.source, path)
        raise ConfigError(  # callers see the model's name, not where it lives on the server
            f"model {spec.name!r} cannot be loaded: its catalog `source` has no config.json "
            f"on this worker; the worker's log names the path. Ask the fleet's operator"
        )
    stamp = _stamp(path)  # once per load: the config and the tokenizer are cached by it
    if spec.loader == "auto" and (simulated or len(plan) == 1):
        if source:
            try:
                model = _read_warm_copy(spec, path, stamp, plan, simulated, source)
            except (UnsupportedCheckpointError, WarmCopyGoneError) as why:
                log.info("%s: read from disk, not from a warm copy: %s", spec.name, why)
            else:
                tokenizer = _tokenizer(str(path), spec.trust_remote_code, stamp)
                return Built(model, tokenizer, "warm copy")
        try:
            model = _read_pretrained(spec, path, stamp, plan, simulated)
        except UnsupportedCheckpointError as why:
            log.info("%s: transformers loads it instead of gpufleet's reader: %s", spec.name, why)
        else:
            return Built(model, _tokenizer(str(path), spec.trust_remote_code, stamp), "safetensors")
    model = _from_pretrained(spec, path, plan, simulated)
    return Built(model, _tokenizer(str(path), spec.trust_remote_code, stamp), "transformers")


def _read_pretrained(
    spec: ModelSpec, path: Path, stamp: Stamp, plan: Mapping[int, int], simulated: bool
) -> Any:
    """Build the model on the meta device and fill it from `worker.weights.checkpoint`.

    The result equals `from_pretrained`'s, so every case where transformers would change
    the weights (renamed or fused keys, dtype casts, fp32-kept modules, quantization,
    missing weights it would initialise, remote code) raises `UnsupportedCheckpointError`.
    """
    _refuse_remote_code(spec)
    checkpoint = Checkpoint.open(path)
    with checkpoint.prefetch() as prefetch:  # the disk works while the skeleton is built
        model = _built_empty(spec, path, stamp, {e.dtype for e in checkpoint.entries.values()})
        names = _match(model, checkpoint.entries)
        wanted = set(names.values())
        if simulated:
            tensors = checkpoint.to_cpu(wanted, prefetch)
        else:
            tensors = checkpoint.to_cuda(wanted, torch.device("cuda", min(plan)), prefetch)
    state = {k: tensors[n] for k, n in names.items()}
    return _filled(model, state, spec.name, path, plan=plan, simulated=simulated)


def _read_warm_copy(  # noqa: PLR0917 - `_read_pretrained`'s context and the copy
    spec: ModelSpec,
    path: Path,
    stamp: Stamp,
    plan: Mapping[int, int],
    simulated: bool,
    source: str,
) -> Any:
    """`_read_pretrained`, with the weights copied from a neighbour's warm copy instead of
    the checkpoint: the skeleton and the checks are the same, so the result is too (a
    copy whose tensors do not match the skeleton raises `UnsupportedCheckpointError`)."""
    _refuse_remote_code(spec)
    device = torch_device(min(plan), simulated)
    with sharing.opened(source) as warm:
        model = _built_empty(spec, path, stamp, {s.dtype for s in warm.entries.values()})
        names = _match(model, warm.entries)
        tensors = warm.read(set(names.values()), device)
    state = {k: tensors[n] for k, n in names.items()}
    return _filled(model, state, spec.name, path, plan=plan, simulated=simulated)


def _refuse_remote_code(spec: ModelSpec) -> None:
    if spec.trust_remote_code:
        raise UnsupportedCheckpointError("remote code decides how its weights load")


def _built_empty(spec: ModelSpec, path: Path, stamp: Stamp, dtypes: set[torch.dtype]) -> Any:
    """The skeleton gpufleet's reader fills (`_skeleton`), once it is sure transformers
    would load the weights as they are stored: `UnsupportedCheckpointError` otherwise.
    `dtypes` are the stored weights' (for a dtype "auto" that the config does not name)."""
    from transformers.conversion_mapping import get_model_conversion_mapping

    config = copy.deepcopy(_config(str(path), stamp))  # the skeleton may change it
    if getattr(config, "quantization_config", None):
        raise UnsupportedCheckpointError("the checkpoint is quantized")
    if getattr(config, "transformers_weights", None) or getattr(config, "extra_files", None):
        raise UnsupportedCheckpointError("the config names other weight files")
    dtype = DTYPES.get(spec.dtype) or _checkpoint_dtype(config, dtypes)
    model = _skeleton(handlers.auto_class(spec.task), config, dtype)
    if get_model_conversion_mapping(model, add_legacy=False) or model._get_dtype_plan(dtype):
        raise UnsupportedCheckpointError(f"transformers converts {type(model).__name__} weights")
    return model


def _filled(
    model: Any,
    state: dict[str, torch.Tensor],
    name: str,
    path: Path,
    *,
    plan: Mapping[int, int],
    simulated: bool,
) -> Any:
    """The skeleton with the weights of `state` in it, tied as from_pretrained ties them,
    on the planned device, in eval mode."""
    model.load_state_dict(state, strict=False, assign=True)
    # As from_pretrained: tie only what the file lacks; a stored, different head stays apart.
    model.tie_weights(missing_keys=set(model.state_dict()) - set(state), recompute_mapping=False)
    empty = [n for n, t in (*model.named_parameters(), *model.named_buffers()) if t.is_meta]
    if empty:
        raise UnsupportedCheckpointError(f"the checkpoint has no weights for {empty[:3]}")
    if not simulated:
        model.to(torch.device("cuda", min(plan)))  # buffers the checkpoint lacks were built on CPU
    _generation_config(model, path)
    model.eval()
    verify(model, targets(plan, simulated), name)
    return model


def _skeleton(auto: Any, config: Any, dtype: torch.dtype) -> Any:
    """The model with its parameters on the meta device and its buffers computed.

    As `from_pretrained` does: the modules are built without initialising weights, then
    the model's own `_init_weights` runs with every parameter marked initialised, so only
    the buffers (position ids, rotary frequencies) get their values. Drawing random
    weights into meta tensors costs about 40 ms for MiniLM on this CPU, half a load.
    """
    from accelerate import init_empty_weights

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # an early 5.x release: build it as before, random draws and all
        with init_empty_weights():
            return auto.from_config(config, dtype=dtype)
    # no_init_weights patches torch's init functions process-wide while the skeleton is
    # built; the keeper thread is the only code that builds models in a worker process.
    with init_empty_weights(), no_init_weights():  # buffers stay real (include_buffers=False)
        model = auto.from_config(config, dtype=dtype)
    for parameter in model.parameters():
        parameter._is_hf_initialized = True  # the checkpoint fills each one (`_match`)
    model.initialize_weights()
    return model


def _generation_config(model: Any, path: Path) -> None:
    """generation_config.json, else the generation fields of config.json, as from_pretrained
    reads them (a config object has those fields stripped)."""
    if not (model.can_generate() and hasattr(model, "adjust_generation_fn")):
        return
    try:
        model.adjust_generation_fn(
            None, True, False, str(path), cache_dir=None, force_download=False, proxies=None,
            local_files_only=True, token=None, revision=None, subfolder="",
            trust_remote_code=False,
        )  # fmt: skip
    except TypeError as exc:  # another transformers release changed the signature
        raise UnsupportedCheckpointError(f"cannot read the generation config: {exc}") from exc


def _checkpoint_dtype(config: Any, dtypes: set[torch.dtype]) -> torch.dtype:
    """dtype "auto": the config's dtype, else the one floating dtype of the weights."""
    declared = getattr(config, "dtype", None)
    if isinstance(declared, str):
        declared = getattr(torch, declared, None)
    if isinstance(declared, torch.dtype):
        return declared
    floats = {dtype for dtype in dtypes if dtype.is_floating_point}
    if len(floats) != 1:
        raise UnsupportedCheckpointError(f"the weights mix dtypes {sorted(map(str, floats))}")
    return floats.pop()


def _match(model: Any, entries: Mapping[str, Entry | Slot]) -> dict[str, str]:
    """Model state-dict key -> stored tensor (a checkpoint's or a warm copy's), with or
    without the base-model prefix.

    Every match must have the skeleton's shape and dtype (transformers would cast or
    refuse it otherwise), and every parameter must match or be tied to one that does.
    """
    prefix = getattr(model, "base_model_prefix", "")
    names: dict[str, str] = {}
    for key, skeleton in model.state_dict().items():
        candidates = (key, key.removeprefix(f"{prefix}."), f"{prefix}.{key}") if prefix else (key,)
        name = next((c for c in candidates if c in entries), None)
        if name is None:
            continue
        entry = entries[name]
        if entry.dtype != skeleton.dtype or entry.shape != tuple(skeleton.shape):
            raise UnsupportedCheckpointError(
                f"{name} is {entry.dtype} {list(entry.shape)}, the model wants "
                f"{skeleton.dtype} {list(skeleton.shape)}"
            )
        names[key] = name
    tied = model.get_expanded_tied_weights_keys(all_submodels=True)
    untouched = [k for k, _ in model.named_parameters() if k not in names and k not in tied]
    if untouched:  # transformers would initialise them at random
        raise UnsupportedCheckpointError(f"the checkpoint has no weights for {untouched[:3]}")
    return names


def _from_pretrained(spec: ModelSpec, path: Path, plan: Mapping[int, int], simulated: bool) -> Any:
    kwargs: dict[str, Any] = {
        "local_files_only": True,
        "trust_remote_code": spec.trust_remote_code,
        "dtype": DTYPES.get(spec.dtype, "auto"),
    }
    if not simulated:
        # Straight from safetensors onto the target GPU(s): no staging copy on the host.
        kwargs["device_map"] = {"": min(plan)} if len(plan) == 1 else "auto"
        kwargs["max_memory"] = max_memory(plan)
    auto: Any = handlers.auto_class(spec.task)
    model = auto.from_pretrained(str(path), **kwargs).eval()
    verify(model, targets(plan, simulated), spec.name)
    return model


# A worker process keeps a model's config and tokenizer across evictions: a miss that
# loads the model again reads only its weights. The key holds the files' modification
# times, so an edited model directory is read afresh.


Stamp = tuple[int, ...]


def _stamp(path: Path) -> Stamp:
    """When the model directory's small files last changed (config, tokenizer)."""
    return tuple(
        f.stat().st_mtime_ns for f in sorted(path.glob("*.json")) + sorted(path.glob("*.txt"))
    )


@functools.lru_cache(maxsize=64)
def _config(path: str, stamp: Stamp) -> Any:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, local_files_only=True)


@functools.lru_cache(maxsize=64)
def _tokenizer(path: str, trust_remote_code: bool, stamp: Stamp) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(
        path, local_files_only=True, trust_remote_code=trust_remote_code
    )


def place(model: Any, plan: Mapping[int, int], simulated: bool) -> Any:
    """Move a CPU model onto the planned devices (a restore, or a synthetic build)."""
    if simulated:
        return model  # a simulated GPU keeps its models in CPU memory, where this one is
    if len(plan) == 1:
        model = model.to(torch.device("cuda", min(plan)), non_blocking=True)
        try:
            verify(model, targets(plan, simulated), type(model).__name__)  # as the copies run
        finally:  # no copy may still read the warm copy once this returns or raises
            torch.cuda.synchronize(min(plan))  # that device's copies, not the current one's
        return model
    from accelerate import dispatch_model

    model = dispatch_model(model, device_map=device_map(model, max_memory(plan)))
    verify(model, targets(plan, simulated), type(model).__name__)
    return model


def device_map(model: Any, limits: Mapping[int | str, int]) -> dict[str, int]:
    """Where each module of a model restored over several GPUs goes (`limits`: accelerate's
    `max_memory`, bytes per GPU index): where its load put it, the load's GPUs replaced in
    order by the plan's, or else spread as the load spreads a model.

    The load is `from_pretrained(device_map="auto")`, which balances the weights over the
    GPUs (transformers' `get_balanced_memory`). `infer_auto_device_map` on the plain limits
    fills the first GPU up to its whole slot instead (for a 27.6 MB GPT-2 over two slots of
    0.8 of it, 18.0 and 9.5 MB against the load's 11.7 and 15.8), leaving that GPU no room
    for the activations its cap was sized for."""
    from transformers.integrations.accelerate import get_balanced_memory, infer_auto_device_map

    gpus = sorted(i for i, nbytes in limits.items() if isinstance(i, int) and nbytes > 0)
    loaded = getattr(model, "hf_device_map", None) or {}
    used = sorted({d for d in loaded.values() if isinstance(d, int)})
    if loaded and len(used) == len(gpus) and all(isinstance(d, int) for d in loaded.values()):
        moved = dict(zip(used, gpus, strict=True))
        return {name: moved[d] for name, d in loaded.items()}
    no_split = set(getattr(model, "_no_split_modules", None) or [])
    balanced = get_balanced_memory(model, max_memory=dict(limits), no_split_module_classes=no_split)
    found: dict[str, int] = infer_auto_device_map(
        model, max_memory=balanced, no_split_module_classes=no_split
    )
    return found


def to_cpu(
    model: Any, pin: bool, arena: PinnedArena | None = None, size: int = 0, tail: int = 0
) -> tuple[Any, Region | None]:
    """Take a model off its GPUs: move to CPU, pin for fast restores, drop accelerate's hooks.
    Returns the model and the arena region its copy took (None: it took none). When it
    raises after taking a region, the model's weights are released with it: drop the model.

    Pinned, each tensor is copied from the device straight into pinned memory: going through
    pageable memory first (`model.to("cpu")`, then `pin_memory()`) copies every byte twice,
    and the device-to-pageable copy is the slow one. With an `arena`, the copy takes one
    region of memory pinned beforehand, each tensor a page-aligned slice of it
    (`worker.warm.arena`); without one, or when the arena has no room, each tensor gets a block
    pinned for it, which costs more than the copy. Not pinned but with an `arena` (a
    simulated GPU's model, whose tensors are in CPU memory already), the tensors are copied
    into a region all the same, so that the host's other workers may read the copy
    (`worker.warm.sharing`); a model the region cannot hold whole stays where it is.

    The first copy starts before any other walk over the model: `size` bounds the region
    the copy needs (`pinned_bytes(model, arena=True)`, which the caller measured when the
    model arrived; 0: measured here), the region is reserved when the walk meets the first
    tensor it holds and trimmed to what the copy used plus `tail` bytes (room for what
    `worker.warm.sharing` writes after the tensors), and the hooks leave while the copies run.
    On an H200 the walks cost 9 ms before the first byte moved, a fifth of a 2 GiB
    offload."""
    if not pin and arena is None:
        _remove_hooks(model)
        return model.to("cpu"), None
    moving = "cuda" if pin else "cpu"  # the tensors whose bytes go into the copy
    region = None
    reserving = arena is not None  # until the first tensor the arena holds
    offset = 0  # where the next tensor goes in the region
    rest: list[torch.Tensor] = []  # tensors not copied from a device here
    sources: set[torch.device] = set()
    try:
        for tensor in itertools.chain(model.parameters(), model.buffers()):
            data = tensor.data
            # plain tensors only: a subclass (a quantized weight) keeps state `.data` drops
            if data.device.type != moving or type(data) is not torch.Tensor:
                rest.append(tensor)
                continue
            if reserving and arena is not None:
                reserving = False
                size = size or pinned_bytes(model, arena=True)
                region = arena.reserve(size + tail)
                if region is None:
                    log.warning(
                        "no room in the %s arena for a %d-byte copy: %s", moving, size,
                        "pinned apart" if pin else "kept where it is",
                    )  # fmt: skip
            nbytes = data.numel() * data.element_size()
            if region is not None and arena is not None and offset + nbytes <= region.size:
                host = arena.view(region, offset, data.dtype, data.shape)
                offset += align(nbytes)
            elif pin:  # no arena, or a model grown past the size measured when it arrived
                host = torch.empty(data.shape, dtype=data.dtype, pin_memory=True)
            else:  # unpinned: only a whole copy goes into the region
                raise _NoRoom
            host.copy_(data, non_blocking=pin)
            if pin:
                sources.add(data.device)
            tensor.data = host
        if region is not None and arena is not None and offset:
            region = arena.trim(region, offset + tail)  # no copy writes past `offset`
        # Our placements give the CPU no bytes, so a hook moves activations, never weights:
        # it can leave while the copies run.
        _remove_hooks(model)
        for tensor in rest:
            if pin and (tensor.data.device.type != "cpu" or not tensor.data.is_pinned()):
                tensor.data = tensor.data.to("cpu").pin_memory()
    except _NoRoom:
        if region is not None and arena is not None:
            own_memory(model, arena.raw(region))  # the tensors copied so far leave it
            arena.release(region)
        _remove_hooks(model)
        return model, None
    except BaseException:
        if region is not None and arena is not None:
            for device in sources:  # no copy may still write into the region once it is free
                torch.cuda.synchronize(device)
            release(model)  # nor may a tensor still point into it: the half-made copy goes
            arena.release(region)
        raise
    finally:
        for device in sources:  # the copies are queued: the copy is whole once they ran
            torch.cuda.synchronize(device)
    if region is not None and arena is not None and offset == 0:  # nothing went into it
        arena.release(region)
        region = None
    return model, region


class _NoRoom(Exception):
    """An unpinned copy that its region cannot hold whole (`to_cpu`)."""


def own_memory(model: Any, region: torch.Tensor) -> None:
    """Give every tensor of a model that lies in `region` (an arena region's bytes) memory
    of its own: a simulated GPU's restore, whose region is given back next."""
    start = region.data_ptr()
    end = start + region.numel()
    for tensor in (*model.parameters(), *model.buffers()):
        if start <= tensor.data.data_ptr() < end:
            tensor.data = tensor.data.clone()


def _remove_hooks(model: Any) -> None:
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(model, recurse=True)


def empty_host_cache() -> None:
    """Give the pinned blocks PyTorch's pinned allocator keeps cached back to the OS."""
    empty = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
    empty = empty or getattr(torch._C, "_host_emptyCache", None)  # torch < 2.12
    if empty is not None:
        empty()


def release(model: Any) -> None:
    """Free a model's weights now: every parameter and buffer gives its storage back.

    Whatever still refers to the modules (a reference cycle, a hook, a failed call's
    frame) then holds empty tensors, so the device memory is free without waiting for
    Python's garbage collector (docs/worker.md).
    """
    for tensor in (*model.parameters(), *model.buffers()):
        tensor.data = torch.empty(0, dtype=tensor.dtype, device=tensor.device)


def targets(plan: Mapping[int, int], simulated: bool) -> set[torch.device]:
    return {torch_device(i, simulated) for i in plan}


def verify(model: Any, allowed: set[torch.device], name: str) -> None:
    """Raise if any parameter or buffer sits outside `allowed` (NDIF's placement check)."""
    devices = {t.device for t in itertools.chain(model.parameters(), model.buffers())}
    wanted = {_normal(d) for d in allowed}
    stray = {str(d) for d in devices if _normal(d) not in wanted}
    if stray:
        raise PlacementError(
            f"{name}: weights landed on {sorted(stray)}, outside the planned "
            f"{sorted(str(d) for d in allowed)}; check CUDA_VISIBLE_DEVICES"
        )


def _normal(device: torch.device) -> tuple[str, int]:
    """(type, index) with a bare "cuda" resolved to the current device."""
    index: int | None = device.index
    if index is None:
        index = torch.cuda.current_device() if device.type == "cuda" else 0
    return device.type, index


def pinned_bytes(model: Any, arena: bool = False) -> int:
    """Host memory a pinned CPU copy of the model takes: in an arena, each device tensor's
    bytes rounded up to a page (`worker.warm.arena.layout`); pinned apart, each rounded up to a
    power of two, as PyTorch's pinned-memory allocator does (`torch.cuda.host_memory_stats`),
    so up to twice its tensors' bytes."""
    tensors = [*model.parameters(), *model.buffers()]
    if arena:
        return layout([t.data for t in tensors])[1]
    sizes = (t.numel() * t.element_size() for t in tensors)
    return sum(1 << (n - 1).bit_length() for n in sizes if n > 0)


def tensor_bytes(model: Any, devices: Sequence[torch.device] | None = None) -> int:
    """Bytes of the model's parameters and buffers (on `devices`, when given)."""
    wanted = None if devices is None else {_normal(d) for d in devices}
    return sum(
        t.numel() * t.element_size()
        for t in (*model.parameters(), *model.buffers())
        if wanted is None or _normal(t.device) in wanted
    )
