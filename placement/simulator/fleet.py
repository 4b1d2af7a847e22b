"""The simulated fleet: hosts of mixed 24/40/80 GB GPUs, their warm caches, and the model mix.

A simulation needs two things that a live registry would hold: the GPUs (with the
host each sits on and the CPU warm-cache budget of every host) and the catalog of
models with their sizes. Both are plain frozen values here, built from a seed, so a
run replays exactly.

The model mix is drawn log-uniformly between 0.1 GB and 30 GB of weights: many small
models (embedders, classifiers, small LLMs) and a tail of large ones, as in a real
multi-tenant catalog. Each model also has a *true peak*: the bytes it really uses
once loaded and warmed up. Only policies that learn (gpufleet's default and the
oracle) ever see it, through `Demand.learned`, exactly as the router sees a peak a
worker has measured (`Registry.record_measurement`).

The catalog is sized against the fleet: models are drawn until the fleet's GPU
memory is `share` (30% by default) of the catalog's footprint, where a model's
footprint is `size x factor` (the x3 guess every seed policy starts from).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

from placement.errors import ConfigError
from placement.policy.sizing import scale
from placement.policy.state import Gpu, Host, Snapshot

GB = 10**9

#: The lease deadline given to simulated GPUs: far enough that they never expire.
FOREVER_MS = 2**62


@dataclass(frozen=True)
class GpuType:
    """A kind of GPU: its NVML name (matched by `Demand.accelerator`) and memory in bytes."""

    name: str
    total: int


L4 = GpuType("NVIDIA L4", 24 * GB)
A100_40GB = GpuType("NVIDIA A100-SXM4-40GB", 40 * GB)
A100_80GB = GpuType("NVIDIA A100-SXM4-80GB", 80 * GB)

#: One host of the default fleet: one GPU of each size and a second 80 GB one.
MIXED_HOST: tuple[GpuType, ...] = (L4, A100_40GB, A100_80GB, A100_80GB)


@dataclass(frozen=True)
class HostSpec:
    """One machine: its GPUs, in index order, and its CPU warm-cache budget in bytes."""

    name: str
    gpus: tuple[GpuType, ...]
    warm_budget: int = 0


@dataclass(frozen=True)
class SimModel:
    """A catalog model: weight bytes (`size`) and the peak it really uses once loaded."""

    name: str
    size: int
    peak: int


@dataclass(frozen=True)
class Fleet:
    """The GPUs, hosts and models of one simulation."""

    hosts: tuple[HostSpec, ...]
    models: tuple[SimModel, ...]

    def __post_init__(self) -> None:
        if not self.hosts or not any(h.gpus for h in self.hosts):
            raise ConfigError("a simulated fleet needs at least one GPU")
        if not self.models:
            raise ConfigError("a simulated fleet needs at least one model")
        names = [m.name for m in self.models]
        if len(set(names)) != len(names):
            raise ConfigError("model names in a simulated fleet must be unique")

    @property
    def gpu_bytes(self) -> int:
        """Total GPU memory of the fleet."""
        return sum(g.total for h in self.hosts for g in h.gpus)

    def gpu_types(self) -> list[GpuType]:
        """The distinct GPU kinds of the fleet, smallest first."""
        return sorted({g for h in self.hosts for g in h.gpus}, key=lambda g: (g.total, g.name))

    def footprint(self, factor: float = 3.0) -> int:
        """The catalog's GPU footprint: the sum of `size x factor` over its models."""
        return sum(scale(m.size, factor) for m in self.models)

    def snapshot(self) -> Snapshot:
        """The empty ledger: every GPU live and owned by its own worker, nothing placed.

        GPU ids are `<host>/<index>`, one worker (and queue) per GPU, as gpufleet runs
        one prefork worker process per GPU. GPUs are keyed in sorted id order, which is
        also how `Registry.snapshot` returns them, so both modes shuffle alike.
        """
        gpus: dict[str, Gpu] = {}
        for host in self.hosts:
            for index, kind in enumerate(host.gpus):
                gpu_id = gpu_id_of(host.name, index)
                gpus[gpu_id] = Gpu(
                    id=gpu_id,
                    host=host.name,
                    index=index,
                    name=kind.name,
                    total=kind.total,
                    worker=f"{host.name}-w{index}",
                    queue=f"gpu.{host.name}.{index}",
                    lease_deadline_ms=FOREVER_MS,
                )
        hosts = {h.name: Host(h.name, warm_budget=h.warm_budget) for h in self.hosts}
        return Snapshot(gpus=dict(sorted(gpus.items())), deployments={}, hosts=hosts)

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary for reports."""
        factor_3 = self.footprint(3.0)
        return {
            "hosts": [
                {
                    "name": h.name,
                    "gpus_gb": [g.total / GB for g in h.gpus],
                    "warm_budget_gb": h.warm_budget / GB,
                }
                for h in self.hosts
            ],
            "gpus": sum(len(h.gpus) for h in self.hosts),
            "gpu_gb": self.gpu_bytes / GB,
            "models": len(self.models),
            "model_gb_min": min(m.size for m in self.models) / GB,
            "model_gb_max": max(m.size for m in self.models) / GB,
            "catalog_weights_gb": sum(m.size for m in self.models) / GB,
            "catalog_footprint_gb": factor_3 / GB,
            "fleet_share": self.gpu_bytes / factor_3,
        }


def gpu_id_of(host: str, index: int) -> str:
    """The id of GPU `index` on `host`."""
    return f"{host}/{index}"


def mixed_hosts(
    count: int = 2,
    gpus: Sequence[GpuType] = MIXED_HOST,
    warm_budget: int = 128 * GB,
) -> tuple[HostSpec, ...]:
    """`count` identical hosts, each with `gpus` and a `warm_budget`-byte CPU warm cache."""
    if count < 1:
        raise ConfigError("a simulated fleet needs at least one host")
    return tuple(HostSpec(f"h{i}", tuple(gpus), warm_budget) for i in range(count))


def true_peak(size: int, rng: random.Random) -> int:
    """A plausible measured peak for `size` bytes of weights.

    Weights x 1.1-1.6 (activations, buffers, allocator slack) plus a ~400 MiB CUDA
    context (seed 000). Always well under the x3 guess, which is why learning pays.
    """
    return int(size * rng.uniform(1.1, 1.6)) + 400 * 2**20


def model_mix(
    gpu_bytes: int,
    *,
    share: float = 0.3,
    factor: float = 3.0,
    smallest: int = GB // 10,
    largest: int = 30 * GB,
    seed: int = 0,
) -> tuple[SimModel, ...]:
    """Models with log-uniform sizes in [smallest, largest], drawn until the fleet's
    `gpu_bytes` are `share` of the catalog footprint (sum of `size x factor`).

    Names are `m000`, `m001`, ... in draw order; popularity is assigned later by the
    workload, independently of size.
    """
    if not 0 < share <= 1:
        raise ConfigError("the fleet's share of the catalog must be in (0, 1]")
    if not 0 < smallest <= largest:
        raise ConfigError("model sizes need 0 < smallest <= largest")
    rng = random.Random(f"models:{seed}")
    target = gpu_bytes / share
    models: list[SimModel] = []
    footprint = 0
    lo, hi = math.log(smallest), math.log(largest)
    while footprint < target:
        size = int(math.exp(rng.uniform(lo, hi)))
        models.append(SimModel(f"m{len(models):03d}", size, true_peak(size, rng)))
        footprint += scale(size, factor)
    return tuple(models)


def default_fleet(
    *, hosts: int = 2, share: float = 0.3, warm_budget: int = 128 * GB, seed: int = 0
) -> Fleet:
    """The fleet of the docs: `hosts` x (24 + 40 + 80 + 80 GB), 128 GB warm cache each,
    and a catalog it holds `share` of."""
    specs = mixed_hosts(hosts, warm_budget=warm_budget)
    gpu_bytes = sum(g.total for h in specs for g in h.gpus)
    return Fleet(specs, model_mix(gpu_bytes, share=share, seed=seed))
