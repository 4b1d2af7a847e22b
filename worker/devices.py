"""GPU discovery: the NVIDIA GPUs NVML reports, or simulated GPUs when there are none.

A worker announces its GPUs to the registry as `Device` values. Real GPUs come from
NVML (`nvidia-ml-py`), which reads the driver without creating a CUDA context, so
discovery is safe in a Celery prefork parent before it forks. On a machine with no
NVIDIA GPU (a laptop, CI), ``GPUFLEET_SIM_GPUS`` describes simulated GPUs, e.g.
``2x24GiB`` or ``40GB,80GB``, and the whole fleet runs without CUDA (brief item 14).

Indices. `Device.index` is the NVML index, the number ``nvidia-smi`` shows; it is what
the registry stores and operators read. `Device.cuda_index` is the ordinal this process
passes to ``torch.device("cuda", n)``; it differs from `index` when
``CUDA_VISIBLE_DEVICES`` hides or reorders GPUs. Integer entries of
``CUDA_VISIBLE_DEVICES`` are taken as NVML indices, which matches CUDA only when
``CUDA_DEVICE_ORDER=PCI_BUS_ID`` (CUDA's default order, FASTEST_FIRST, may differ from
NVML's PCI order on a host with mixed GPU models; a warning says so). ``GPU-<uuid>``
entries (or unique prefixes of them) are matched against NVML uuids; ``MIG-`` entries
are not supported: MIG slices are not NVML devices by index, and discovery stops there.

Reserve. A real GPU registers less than NVML's total: the memory NVML says the driver
and firmware keep (`nvmlDeviceGetMemoryInfo_v2`'s ``reserved``), and room for the CUDA
context of the process that uses it (``GPUFLEET_GPU_RESERVE``, 1 GiB by default; about
0.7 GB was measured on an H100). Neither is memory torch allocates, so neither the
learned peaks nor the fraction cap see it, and a ledger that handed it out would let a
full GPU fail a real allocation with every process under its cap. A worker that loads
onto a GPU it does not own opens a context of its own there: the ledger charges the GPU
``GPUFLEET_GPU_RESERVE`` more when it does (`Gpu.context`, commit.lua). A simulated GPU
has no driver and no context: it registers its whole size and charges none.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from placement.config import DEFAULT_GPU_RESERVE
from placement.errors import ConfigError, MemorySizeError
from placement.policy.state import Gpu
from placement.units.memory import format_size, parse_size

__all__ = [
    "MAX_SIM_GPUS",
    "SIM_ENV",
    "Device",
    "discover",
    "nvml_devices",
    "parse_sim_gpus",
    "simulated_devices",
]

log = logging.getLogger(__name__)

#: The environment variable that describes simulated GPUs.
SIM_ENV = "GPUFLEET_SIM_GPUS"
#: The most simulated GPUs one worker may announce.
MAX_SIM_GPUS = 64

_SIM_FORMS = (
    "a comma-separated list of sizes, each optionally prefixed by a count and 'x': "
    "'2x24GiB', '40GB,80GB', '2x8GiB,1x80GiB' (sizes as in the catalog: "
    "'8GiB' or '8G' binary, '8GB' decimal)"
)
_SIM_ITEM = re.compile(r"(?:(?P<count>[0-9]+)\s*[xX]\s*)?(?P<size>.+)", re.A)


@dataclass(frozen=True)
class Device:
    """One GPU this worker can use, real or simulated.

    `index` is the NVML index (as ``nvidia-smi`` numbers it) or the position of a
    simulated GPU; `cuda_index` is the CUDA ordinal in this process (None when
    simulated: there is no CUDA device behind it). `total` is in bytes, as NVML reports
    it; `reserve` of them never enter the ledger (the driver's and a CUDA context's).
    """

    index: int
    uuid: str  # the NVML uuid ("GPU-..."); empty for a simulated GPU
    name: str
    total: int
    simulated: bool = False
    cuda_index: int | None = None
    reserve: int = 0
    context: int = 0  # of `reserve`: a CUDA context's, what another process's costs here

    def gpu_id(self, host: str) -> str:
        """The registry id: the NVML uuid, globally unique, or ``<host>:sim<index>``.

        A real GPU keeps its id wherever it is announced from, so a worker restart or a
        renamed host reclaims the same ledger entry; a simulated GPU exists only on its
        host, so the host name makes it unique in the fleet.
        """
        return f"{host}:sim{self.index}" if self.simulated else self.uuid

    def to_gpu(self, host: str) -> Gpu:
        """The ledger entry `Registry.register_worker` takes for this device; a
        `ConfigError` when its reserve leaves it nothing to place models on."""
        if self.total - self.reserve <= 0:
            raise ConfigError(
                f"GPU {self.index} ({self.name}, {format_size(self.total)}) leaves no memory "
                f"to place models on once {format_size(self.reserve)} is kept for its driver "
                f"and a CUDA context; lower GPUFLEET_GPU_RESERVE"
            )
        return Gpu(
            id=self.gpu_id(host),
            host=host,
            index=self.index,
            name=self.name,
            total=self.total - self.reserve,
            context=self.context,  # another worker's, charged when it loads here
        )


# --- simulated GPUs ----------------------------------------------------------------------


def parse_sim_gpus(spec: str) -> list[int]:
    """Return the byte sizes of the simulated GPUs `spec` describes, in order.

    ``"2x24GiB"`` is two 24 GiB GPUs, ``"40GB,80GB"`` one of each, ``"2x8GiB,1x80GiB"``
    mixes both forms. Whitespace around items, counts and sizes is ignored. Raises
    `ConfigError` quoting `spec` and showing these forms when an item is malformed, a
    size is zero, or the total count is outside 1..`MAX_SIM_GPUS`.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise _bad_spec(spec, "it is empty")
    sizes: list[int] = []
    for raw in spec.split(","):
        item = raw.strip()
        match = _SIM_ITEM.fullmatch(item)
        if not item or match is None:
            raise _bad_spec(spec, "an item is empty (a stray comma?)")
        count = int(match["count"]) if match["count"] is not None else 1
        if count < 1:
            raise _bad_spec(spec, f"{item!r} asks for {count} GPUs")
        try:
            size = parse_size(match["size"].strip())
        except MemorySizeError as exc:
            raise _bad_spec(spec, f"{match['size'].strip()!r} is not a memory size") from exc
        if size <= 0:
            raise _bad_spec(spec, f"{item!r} has a GPU of no memory")
        if len(sizes) + count > MAX_SIM_GPUS:
            raise _bad_spec(spec, f"it asks for more than {MAX_SIM_GPUS} GPUs")
        sizes.extend([size] * count)
    return sizes


def _bad_spec(spec: object, why: str) -> ConfigError:
    return ConfigError(
        f"invalid simulated GPU spec {spec!r} ({SIM_ENV}): {why}; write {_SIM_FORMS}"
    )


def simulated_devices(spec: str) -> list[Device]:
    """Simulated `Device` values for `spec` (see `parse_sim_gpus`), indexed from 0."""
    return [
        Device(index=i, uuid="", name=f"Simulated {format_size(size)}", total=size, simulated=True)
        for i, size in enumerate(parse_sim_gpus(spec))
    ]


# --- NVML ----------------------------------------------------------------------------------


def nvml_devices(reserve: int = DEFAULT_GPU_RESERVE) -> list[Device]:
    """The NVIDIA GPUs NVML reports that CUDA would show this process, in CUDA order,
    each keeping `reserve` bytes for a CUDA context besides what the driver keeps.

    Returns [] when `pynvml` or the NVML library is missing, the driver does not answer,
    or there is no GPU; the reason is logged at debug level. A GPU that fails to answer
    on its own (fallen off the bus) is skipped with a warning. NVML is shut down before
    returning, so nothing stays open in a process that forks afterwards.
    """
    devices, why = _probe_nvml(reserve)
    if why:
        log.debug("no NVML GPUs: %s", why)
    return devices


def _probe_nvml(reserve: int) -> tuple[list[Device], str]:
    """NVML devices filtered by CUDA_VISIBLE_DEVICES, and why there are none ("" if some)."""
    try:
        import pynvml
    except ImportError as exc:
        return [], f"pynvml cannot be imported ({exc}); install nvidia-ml-py"
    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        return [], f"NVML cannot start ({exc})"
    try:
        found = _read_nvml(pynvml, reserve)
    except pynvml.NVMLError as exc:
        return [], f"NVML cannot count the GPUs ({exc})"
    finally:
        try:
            pynvml.nvmlShutdown()
        except pynvml.NVMLError as exc:  # nothing to leak: log and go on
            log.debug("nvmlShutdown failed: %s", exc)
    if not found:
        return [], "NVML reports no GPU"
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = found if visible is None else _visible(found, visible)
    if not devices:
        return [], f"CUDA_VISIBLE_DEVICES={visible!r} hides every GPU"
    if len({d.name for d in devices}) > 1 and os.environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
        log.warning(
            "GPUs of different models and CUDA_DEVICE_ORDER is not PCI_BUS_ID: CUDA may number "
            "them differently from NVML; set CUDA_DEVICE_ORDER=PCI_BUS_ID for the worker"
        )
    return devices, ""


def _read_nvml(nvml: Any, reserve: int) -> list[Device]:
    """Every GPU NVML knows, by NVML index (cuda_index = index until filtered)."""
    devices = []
    for i in range(int(nvml.nvmlDeviceGetCount())):
        try:
            handle = nvml.nvmlDeviceGetHandleByIndex(i)
            name = _text(nvml.nvmlDeviceGetName(handle))
            uuid = _text(nvml.nvmlDeviceGetUUID(handle))
            total, driver = _memory(nvml, handle)
        except nvml.NVMLError as exc:
            log.warning("skipping GPU %d: NVML cannot read it (%s)", i, exc)
            continue
        devices.append(
            Device(i, uuid, name, total, cuda_index=i, reserve=driver + reserve, context=reserve)
        )
    return devices


def _memory(nvml: Any, handle: Any) -> tuple[int, int]:
    """A GPU's total memory and what its driver and firmware keep of it: version 2 of
    NVML's memory query says that; drivers and bindings without it count it as used."""
    version = getattr(nvml, "nvmlMemory_v2", None)
    if version is not None:
        try:
            info = nvml.nvmlDeviceGetMemoryInfo(handle, version=version)
            return int(info.total), int(info.reserved)
        except nvml.NVMLError as exc:  # an older driver: no _v2 entry point
            log.debug("NVML memory info v2 unavailable (%s); using v1", exc)
    return int(nvml.nvmlDeviceGetMemoryInfo(handle).total), 0


def _text(value: str | bytes) -> str:
    """NVML strings: bytes in old nvidia-ml-py releases, str in new ones."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def _visible(devices: Sequence[Device], value: str) -> list[Device]:
    """The devices `CUDA_VISIBLE_DEVICES=value` exposes, renumbered in its order.

    Like CUDA, the list is read up to its first entry that names no device (out of
    range, repeated, unknown or ambiguous uuid, a MIG slice, ``-1``): that entry and
    all after it are ignored.
    """
    by_index = {d.index: d for d in devices}
    chosen: list[Device] = []
    for raw in value.split(","):
        entry = raw.strip()
        device = _lookup(entry, by_index, devices)
        if device is None or any(c.index == device.index for c in chosen):
            if entry and entry != "-1":  # -1 is the usual way to hide every GPU
                log.warning(
                    "CUDA_VISIBLE_DEVICES=%r: entry %r names no usable GPU; it and the entries "
                    "after it are ignored, as CUDA does",
                    value,
                    entry,
                )
            break
        chosen.append(replace(device, cuda_index=len(chosen)))
    return chosen


def _lookup(entry: str, by_index: dict[int, Device], devices: Sequence[Device]) -> Device | None:
    if entry.isascii() and entry.isdigit():
        return by_index.get(int(entry))
    if entry.startswith("GPU-"):  # a uuid or a unique prefix of one
        matches = [d for d in devices if d.uuid.startswith(entry)]
        return matches[0] if len(matches) == 1 else None
    if entry.startswith("MIG-"):
        log.warning(
            "CUDA_VISIBLE_DEVICES names a MIG slice (%s); gpufleet does not support MIG", entry
        )
    return None


# --- the entry point -----------------------------------------------------------------------


def discover(
    sim: str | None = None, *, simulate: bool = False, reserve: int = DEFAULT_GPU_RESERVE
) -> list[Device]:
    """The GPUs this worker should announce: real ones, else simulated ones.

    With `simulate` False, NVML GPUs win when there are any; each keeps `reserve` bytes
    (``GPUFLEET_GPU_RESERVE``) out of the ledger. With `simulate` True, or when NVML finds
    none, the devices come from the spec `sim` (``GPUFLEET_SIM_GPUS``). Raises
    `ConfigError` when there is neither a GPU nor a spec, saying how to set one.
    """
    spec = sim.strip() if sim is not None else ""
    why = "simulation was asked for"
    if not simulate:
        real, why = _probe_nvml(reserve)
        if real:
            log.info(
                "using %d NVIDIA GPU(s) from NVML: %s",
                len(real),
                ", ".join(
                    f"{d.index}={d.name} ({format_size(d.total)}, "
                    f"{format_size(d.total - d.reserve)} to place on)"
                    for d in real
                ),
            )
            if spec:
                log.info("ignoring the simulated GPU spec %r: real GPUs are present", spec)
            return real
    if not spec:
        raise ConfigError(
            f"no GPU to announce: {why}, and {SIM_ENV} is not set. To run without a GPU, "
            f"simulate some, e.g. {SIM_ENV}=2x8GiB"
        )
    devices = simulated_devices(spec)
    log.info("using %d simulated GPU(s) from %r (%s)", len(devices), spec, why)
    return devices
