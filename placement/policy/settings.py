"""The knobs of the placement policy, with their defaults.

Per-model overrides of `factor`, `fractional_threshold` and `min_free_fraction`
come from the catalog (see `state.Demand`); these are the fleet-wide defaults. They are
read from `GPUFLEET_*` variables with every other setting, in `placement.config`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from placement.errors import ConfigError


class GpuChoice(str, enum.Enum):
    """How to pick among GPUs that tie on candidate level and eviction count."""

    BEST_FIT = "best-fit"  # least free memory left: keeps big holes for big models
    RANDOM = "random"  # NDIF: shuffle
    MOST_FREE = "most-free"  # Helix: the GPU with the most free memory


class VictimOrder(str, enum.Enum):
    """Which idle replicas to evict first."""

    LRU = "lru"  # least recently used first
    SMALLEST = "smallest"  # NDIF: smallest first, to evict as few bytes as possible


@dataclass(frozen=True)
class PolicySettings:
    """Fleet-wide policy defaults.

    - `factor`: a single GPU slot is `size x factor` (NDIF uses 3.0: CUDA context,
      activations, KV cache).
    - `fractional_threshold`: below `threshold x GPU memory` a model shares the GPU;
      at or above it, it takes the whole GPU.
    - `min_free_fraction`: a GPU takes a multi-GPU shard only when at least this
      share of it is free after evictions.
    - `multi_gpu_overhead`: a model split over n GPUs takes `size / n x overhead` on
      each (Helix).
    - `learned_headroom`: a measured peak is padded by this much.
    """

    factor: float = 3.0
    fractional_threshold: float = 0.8
    min_free_fraction: float = 0.3
    multi_gpu_overhead: float = 1.1
    learned_headroom: float = 1.1
    gpu_choice: GpuChoice = GpuChoice.BEST_FIT
    victim_order: VictimOrder = VictimOrder.LRU
    warm_drop_order: VictimOrder = VictimOrder.LRU

    def __post_init__(self) -> None:
        if self.factor <= 0 or self.multi_gpu_overhead < 1 or self.learned_headroom < 1:
            raise ConfigError("factor must be > 0, and both overheads >= 1")
        if not 0 < self.fractional_threshold <= 1:
            raise ConfigError("fractional_threshold must be in (0, 1]")
        if not 0 <= self.min_free_fraction < 1:
            raise ConfigError("min_free_fraction must be in [0, 1)")
