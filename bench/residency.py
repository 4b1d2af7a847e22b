"""How fast a worker moves model weights, against the raw speed of the same hardware.

    python -m bench.residency [--mib 512] [--repeats 3]

Prints one JSON object. It saves a synthetic BERT-style model of about `--mib` MiB as
safetensors, then measures, through `worker.residency.ResidencyManager` (the code the
workers run):

- `cold_load_gbps`: a load from safetensors on disk onto the GPU (the CPU on a machine
  without CUDA), against `disk_read_gbps`, the faster of two raw sequential reads of the
  same files, one just before the load and one just after; `cold_load_ratio` is the
  median of those paired ratios, so a disk whose speed drifts between repeats (this
  machine's ranged 0.7-3.9 GB/s within minutes) neither flatters nor sinks it;
- `page_cache_fill_gbps`: the disk alone, sendfile to /dev/null with no copy to user
  space; gpufleet's reader copies nothing on the CPU either, so its ratio to the `read()`
  loop above can pass 1.0, and this figure is its real ceiling;
- `transformers_load_gbps`: the same load through transformers' `from_pretrained`
  (catalog `loader: transformers`), the loader gpufleet's reader replaces;
- `offload_gbps`: GPU -> pinned CPU, into the worker's pinned arena (`worker.warm.arena`, room
  for two copies, allocated by the first offload and reused by the later ones; the median
  of three is a reuse), against `d2h_prepinned_gbps`, a raw device-to-host copy of the
  same bytes into memory pinned beforehand: what the bus carries. `d2h_fresh_pinned_gbps`
  (pinned memory allocated on the way, in 64 MiB blocks, as every offload did before the
  arena) is kept as a diagnostic: on an H200 it was 2.3 GB/s against 55;
- `warm_restore_gbps`: pinned CPU -> GPU, against `h2d_gbps`, a raw pinned host-to-device
  copy of the same number of bytes (CUDA only; null here). Without CUDA, `offload_gbps`
  and `warm_restore_gbps` are a simulated GPU's copies into and out of the arena, which it
  makes only where its warm copies are published (`worker.warm.sharing`), with no baseline of
  their own but `host_copy_gbps` below;
- `neighbour_read_gbps`: a load that reads the warm copy another worker published
  (`via: warm copy`, docs/worker.md, "Warm copies another worker reads"): the skeleton,
  the checks, and one copy of each tensor from the holder's memory into memory of its own
  on the device, against `host_copy_gbps`, one raw copy of the same bytes from pageable
  host memory into memory faulted in beforehand (the bandwidth alone; on the CPU, the new
  memory's page faults and the skeleton cost the read more than its copy):
  `neighbour_read_ratio`. Compare it with `cold_load_gbps` too: the disk load it replaces.

Both sides of each ratio start from the same page-cache state: before every cold
measurement the files are dropped from the page cache with posix_fadvise(DONTNEED),
which needs no privileges. One untimed load of each kind comes first (a worker imports
transformers once). Medians of `--repeats` runs are reported. Run it with
`python -m bench.residency` (run by path, `bench/placement.py` would shadow the
`placement` package), on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from placement.catalog.catalog import Catalog
from worker.devices import Device, nvml_devices, simulated_devices
from worker.loading import empty_host_cache
from worker.residency import ResidencyManager

log = logging.getLogger("bench.residency")
HOST = "bench"
CHUNK = 16 * 2**20
D2H_CHUNK = 64 * 2**20  # the raw offload baseline's pinned blocks: a power of two, not rounded


def make_checkpoint(directory: Path, mib: int, vocab_size: int = 1024) -> int:
    """Save a randomly initialised BERT of about `mib` MiB; return its tensor bytes."""
    from transformers import BertConfig, BertModel

    hidden = 1024
    per_layer = 12 * hidden * hidden * 4  # attention + MLP weights, float32
    layers = max(1, round(mib * 2**20 / per_layer))
    config = BertConfig(
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=16,
        intermediate_size=4 * hidden,
        vocab_size=vocab_size,
    )
    model = BertModel(config)
    model.save_pretrained(directory, safe_serialization=True)
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())


def drop_page_cache(directory: Path) -> None:
    """Evict the files from the page cache (pages still mapped by a live object stay)."""
    gc.collect()  # release mmaps of models dropped earlier
    for path in directory.iterdir():
        with path.open("rb") as f:
            os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)


def disk_read_gbps(directory: Path) -> float:
    """Raw sequential read of the checkpoint's safetensors files, cold."""
    drop_page_cache(directory)
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    total = 0
    start = time.perf_counter()
    for path in sorted(directory.glob("*.safetensors")):
        with path.open("rb", buffering=0) as f:
            while n := f.readinto(view):
                total += n
    return total / (time.perf_counter() - start) / 1e9


def page_cache_fill_gbps(directory: Path) -> float:
    """The disk with no copy to user space: sendfile of the cold files to /dev/null."""
    drop_page_cache(directory)
    total = 0
    start = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        for path in sorted(directory.glob("*.safetensors")):
            with path.open("rb") as f:
                offset = 0
                while n := os.sendfile(sink.fileno(), f.fileno(), offset, CHUNK):
                    offset += n
                total += offset
    return total / (time.perf_counter() - start) / 1e9


def _copy_gbps(target: torch.Tensor, source: torch.Tensor, device: int | None) -> float:
    """One timed copy of `source` into `target`, after an untimed one that warms the path
    (faults both sides in); `device` is the CUDA device to wait for (None: a CPU copy)."""
    target.copy_(source, non_blocking=device is not None)
    if device is not None:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    target.copy_(source, non_blocking=device is not None)
    if device is not None:
        torch.cuda.synchronize(device)
    return source.numel() / (time.perf_counter() - start) / 1e9


def h2d_gbps(nbytes: int, device: int) -> float:
    """Raw pinned host-to-device copy of `nbytes`."""
    host = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    target = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    gbps = _copy_gbps(target, host, device)
    del target
    torch.cuda.empty_cache()  # the next load starts from an empty device, as the first did
    return gbps


def d2h_prepinned_gbps(nbytes: int, device: int) -> float:
    """Raw device-to-host copy of `nbytes` into memory pinned beforehand (what the bus
    carries; the worker's pinned arena reuses its memory so), the pinning not timed."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    gbps = _copy_gbps(host, source, device)
    del source, host
    torch.cuda.empty_cache()
    empty_host_cache()
    return gbps


def d2h_gbps(nbytes: int, device: int) -> float:
    """Raw device-to-host copy of `nbytes` into pinned memory allocated for it, as an offload
    must (the allocator's pinned cache emptied first, as the worker keeps it)."""
    source = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    empty_host_cache()
    torch.cuda.synchronize(device)
    start = time.perf_counter()
    hosts = []  # in power-of-two chunks, which PyTorch's pinned allocator takes as they are
    for offset in range(0, nbytes, D2H_CHUNK):
        part = source[offset : offset + D2H_CHUNK]
        hosts.append(torch.empty(part.numel(), dtype=torch.uint8, pin_memory=True))
        hosts[-1].copy_(part, non_blocking=True)
    torch.cuda.synchronize(device)
    seconds = time.perf_counter() - start
    del source, hosts
    torch.cuda.empty_cache()
    empty_host_cache()
    return nbytes / seconds / 1e9


def host_copy_gbps(nbytes: int, device: torch.device) -> float:
    """Raw copy of `nbytes` from pageable host memory to `device` (a memory copy when it is
    the CPU): the bandwidth alone."""
    source = torch.ones(nbytes, dtype=torch.uint8)
    target = torch.empty(nbytes, dtype=torch.uint8, device=device)
    gbps = _copy_gbps(target, source, device.index if device.type == "cuda" else None)
    del source, target
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return gbps


def run(mib: int, repeats: int) -> dict[str, Any]:
    cuda = torch.cuda.is_available()
    devices: list[Device] = nvml_devices() if cuda else simulated_devices("1x64GiB")
    gpu = devices[0]
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-") as tmp:
        directory = Path(tmp) / "model"
        model_bytes = make_checkpoint(directory, mib)
        specs = {
            loader: Catalog.from_mapping(
                {"models": {"bench": {"source": str(directory), "task": "forward",
                                      "dtype": "float32", "loader": loader}}}
            ).get("bench")
            for loader in ("auto", "transformers")
        }  # fmt: skip
        slots = {gpu.gpu_id(HOST): 2 * model_bytes}
        # a pinned arena of room for two copies, as a worker's share of its host's warm cache,
        # whose copies another worker of the host (`reader`) may read
        manager = ResidencyManager(
            devices, HOST, warmup=False, arena_bytes=4 * model_bytes, publish=True
        )
        reader = ResidencyManager(devices, HOST, warmup=False)
        target = torch.device("cuda", gpu.cuda_index or 0) if cuda else torch.device("cpu")
        for spec in specs.values():  # a worker imports its libraries once; time the loads only
            manager.load(spec, "imports", slots)
            manager.drop_all()
        disk, fill, cold, ratios, baseline, offload, restore, raw_h2d, raw_d2h = (
            [] for _ in range(9)
        )
        neighbour: list[float] = []
        host_copy: list[float] = []
        neighbour_ratios: list[float] = []
        prepinned: list[float] = []
        via = set()
        for i in range(repeats):
            before = disk_read_gbps(directory)
            drop_page_cache(directory)
            report = manager.load(specs["auto"], f"r{i}", slots)
            offload.append(manager.offload(f"r{i}").gbps)
            read = reader.load(specs["auto"], f"n{i}", slots, source=manager.locator(f"r{i}"))
            via.add(read.via)
            reader.drop_all()
            restore.append(manager.restore(f"r{i}", slots).gbps)
            manager.drop_all()  # the raw copy runs uncapped, with the GPU empty
            neighbour.append(read.gbps)
            host_copy.append(host_copy_gbps(model_bytes, target))
            neighbour_ratios.append(read.gbps / host_copy[-1])
            if cuda:
                raw_h2d.append(h2d_gbps(model_bytes, gpu.cuda_index or 0))
                raw_d2h.append(d2h_gbps(model_bytes, gpu.cuda_index or 0))
                prepinned.append(d2h_prepinned_gbps(model_bytes, gpu.cuda_index or 0))
            disk.append(max(before, disk_read_gbps(directory)))
            fill.append(page_cache_fill_gbps(directory))
            cold.append(report.gbps)
            ratios.append(report.gbps / disk[-1])
            via.add(report.via)
            drop_page_cache(directory)
            baseline.append(manager.load(specs["transformers"], f"t{i}", slots).gbps)
            manager.drop_all()

    def median(values: list[float]) -> float | None:
        return round(statistics.median(values), 3) if values else None

    restore_gbps, h2d = median(restore), median(raw_h2d)
    offload_gbps, d2h = median(offload), median(prepinned)
    return {
        "device": torch.cuda.get_device_name(0) if cuda else f"cpu ({platform.processor()})",
        "model_bytes": model_bytes,
        "repeats": repeats,
        "loader": sorted(via),
        "cold_load_gbps": median(cold),
        "disk_read_gbps": median(disk),
        "cold_load_ratio": median(ratios),
        "page_cache_fill_gbps": median(fill),
        "transformers_load_gbps": median(baseline),
        "offload_gbps": offload_gbps,
        "d2h_prepinned_gbps": d2h,
        "offload_ratio": round(offload_gbps / d2h, 3) if offload_gbps and d2h else None,
        "d2h_fresh_pinned_gbps": median(raw_d2h),  # a diagnostic: pinning on the way
        "warm_restore_gbps": restore_gbps,
        "h2d_gbps": h2d,
        "warm_restore_ratio": round(restore_gbps / h2d, 3) if restore_gbps and h2d else None,
        "neighbour_read_gbps": median(neighbour),
        "host_copy_gbps": median(host_copy),
        "neighbour_read_ratio": median(neighbour_ratios),
        "targets": {
            "cold_load_ratio": ">= 0.7",
            "offload_ratio": ">= 0.8 (CUDA, against d2h_prepinned_gbps)",
            "warm_restore_ratio": ">= 0.85 (CUDA)",
        },
        "machine": {"cpus": os.cpu_count(), "python": platform.python_version()},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=512, help="checkpoint size")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    print(json.dumps(run(args.mib, args.repeats)))


if __name__ == "__main__":
    main()
