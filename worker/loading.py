"""Put a catalog model's weights on the devices a placement plan gave it, and check they landed.

On CUDA the rules come from NDIF's ModelActor (seed 000):
- `torch.cuda.set_device` first, so the CUDA context lands on the target GPU, not GPU 0;
- accelerate's `max_memory` gives each target GPU its planned bytes and every other GPU 0
  (and the CPU 0: a model that does not fit fails loudly instead of spilling to RAM);
- after every load or restore, every parameter must sit on one of the target devices.
Simulated GPUs are the CPU; `worker.residency` accounts their bytes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from placement.catalog import ModelSpec
from placement.errors import ConfigError, PlacementError
from worker import handlers
from worker.synthetic import build_synthetic

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


def build(spec: ModelSpec, plan: Mapping[int, int], simulated: bool) -> tuple[Any, Any]:
    """Load `spec` (from disk, a package, or synthetic) onto the planned devices.

    `plan` maps CUDA device index to planned bytes. Returns (model, tokenizer), in eval mode.
    """
    if not plan:
        raise PlacementError(f"{spec.name}: a load needs at least one target GPU")
    if not simulated:
        torch.cuda.set_device(min(plan))  # before any CUDA work: the context lands here
    if spec.synthetic:
        model, tokenizer = build_synthetic(spec)
        return place(model, plan, simulated), tokenizer
    return _from_pretrained(spec, plan, simulated)


def _from_pretrained(spec: ModelSpec, plan: Mapping[int, int], simulated: bool) -> tuple[Any, Any]:
    from transformers import AutoTokenizer

    path = spec.source_path()
    if path is None or not (path / "config.json").is_file():
        raise ConfigError(
            f"{spec.name}: source {spec.source!r} has no config.json at {path}; "
            f"point `source` at a local model directory"
        )
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
    tokenizer = AutoTokenizer.from_pretrained(
        str(path), local_files_only=True, trust_remote_code=spec.trust_remote_code
    )
    verify(model, targets(plan, simulated), spec.name)
    return model, tokenizer


def place(model: Any, plan: Mapping[int, int], simulated: bool) -> Any:
    """Move a CPU model onto the planned devices (a restore, or a synthetic build)."""
    if simulated:
        return model.to("cpu")
    if len(plan) == 1:
        model = model.to(torch.device("cuda", min(plan)), non_blocking=True)
        torch.cuda.synchronize()
    else:
        from accelerate import dispatch_model, infer_auto_device_map

        device_map = infer_auto_device_map(
            model,
            max_memory=max_memory(plan),
            no_split_module_classes=list(getattr(model, "_no_split_modules", None) or []),
        )
        model = dispatch_model(model, device_map=device_map)
    verify(model, targets(plan, simulated), type(model).__name__)
    return model


def to_cpu(model: Any, pin: bool) -> Any:
    """Take a model off its GPUs: drop accelerate's hooks, move to CPU, pin for fast restores."""
    from accelerate.hooks import remove_hook_from_module

    remove_hook_from_module(model, recurse=True)
    model = model.to("cpu")
    if pin:
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.pin_memory()
    return model


def targets(plan: Mapping[int, int], simulated: bool) -> set[torch.device]:
    return {torch_device(i, simulated) for i in plan}


def verify(model: Any, allowed: set[torch.device], name: str) -> None:
    """Raise if any parameter or buffer sits outside `allowed` (NDIF's placement check)."""
    stray = {
        str(t.device)
        for t in (*model.parameters(), *model.buffers())
        if _normal(t.device) not in {_normal(d) for d in allowed}
    }
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


def tensor_bytes(model: Any, devices: Sequence[torch.device] | None = None) -> int:
    """Bytes of the model's parameters and buffers (on `devices`, when given)."""
    wanted = None if devices is None else {_normal(d) for d in devices}
    return sum(
        t.numel() * t.element_size()
        for t in (*model.parameters(), *model.buffers())
        if wanted is None or _normal(t.device) in wanted
    )
