"""How many bytes one replica takes on a GPU: its slot on one GPU, or its shard on several.

Sizing a replica on one GPU (NDIF, seed 000):
- `required = size x factor` (or the learned peak x headroom, or the catalog's
  explicit request/limit), plus what a generation model keeps beside its weights
  (`Demand.beside`: its KV-cache budget and its adapters' room; a learned peak was
  measured with them, `placement.catalog.kvcache`, `placement.catalog.adapters`);
- below `fractional_threshold x GPU memory` it gets a fractional slot of
  `required` bytes; otherwise, if `size` fits the GPU, it gets the whole GPU;
- otherwise it is split over the GPUs of one host (Helix, seed 004):
  `size x multi_gpu_overhead / n` on each of the fewest GPUs `n` that fit.
A GPU admits a slot when `limit + sum(requests already there) <= memory` (seed 003).

Rounding happens here and only here, to whole bytes: sizes scaled by a factor round
up (a replica never gets less than it asked for), and a share of a GPU (`gpus: 0.47`)
rounds down, so shares that add up to one GPU fit on it exactly.
"""

from __future__ import annotations

import functools
from fractions import Fraction

from placement.policy.settings import PolicySettings
from placement.policy.state import Demand


def scale(nbytes: int, factor: float, divisor: int = 1) -> int:
    """`nbytes x factor / divisor` rounded up to whole bytes, without float noise."""
    num, den = _exact(factor)
    return -(-nbytes * num // (den * divisor))  # integer ceiling division


def portion(total: int, share: float) -> int:
    """`share` of `total` bytes, rounded down: shares adding up to 1 add up to `total`."""
    num, den = _exact(share)
    return total * num // den


@functools.lru_cache(maxsize=1024)
def _exact(factor: float) -> tuple[int, int]:
    """The decimal a setting was written as (1.1 -> 11/10), not its binary float."""
    exact = Fraction(str(factor))
    return exact.numerator, exact.denominator


def knobs(demand: Demand, settings: PolicySettings) -> tuple[float, float, float]:
    """The demand's factor, fractional threshold and minimum free share, or the fleet's."""
    factor = demand.factor if demand.factor is not None else settings.factor
    threshold = (
        demand.fractional_threshold
        if demand.fractional_threshold is not None
        else settings.fractional_threshold
    )
    min_free = (
        demand.min_free_fraction
        if demand.min_free_fraction is not None
        else settings.min_free_fraction
    )
    return factor, threshold, min_free


def splittable(demand: Demand) -> bool:
    """Size-based demands may go multi-GPU; so may a static count of 2+ GPUs."""
    if demand.gpus is not None:
        return demand.gpus >= 2
    return demand.request is None


def single_gpu_slot(demand: Demand, total: int, settings: PolicySettings) -> tuple[int, int] | None:
    """(request, limit) bytes of one replica alone on a GPU of `total` bytes, or None
    when it cannot fit one such GPU."""
    factor, threshold, _ = knobs(demand, settings)
    if demand.gpus is not None:
        if demand.gpus < 1:
            share = portion(total, demand.gpus)
            return share, share
        return (total, total) if demand.gpus == 1 else None
    kv = demand.beside
    if demand.request is not None:
        request, limit = demand.request + kv, (demand.limit or demand.request) + kv
        base = limit
    elif demand.learned:
        request = limit = scale(demand.learned, settings.learned_headroom)
        base = demand.learned
    else:
        request = limit = scale(demand.size, factor) + kv
        base = demand.size + kv
    if base > total:
        return None
    if limit < threshold * total:
        return request, limit
    return total, total


def shard(demand: Demand, total: int, n: int, settings: PolicySettings) -> tuple[int, int]:
    """(request, admission need) of one of `n` shards on a GPU of `total` bytes."""
    if demand.gpus is not None:
        return total, total
    _, _, min_free = knobs(demand, settings)
    share = scale(demand.learned or demand.size, settings.multi_gpu_overhead, n)
    if not demand.learned:
        share += -(-demand.beside // n)  # each shard holds its layers' part of the cache
    return share, max(share, scale(total, min_free))


def spread_need(demand: Demand, settings: PolicySettings) -> int:
    """Bytes a size-based demand takes over all of its shards together."""
    need = scale(demand.learned or demand.size, settings.multi_gpu_overhead)
    return need if demand.learned else need + demand.beside
