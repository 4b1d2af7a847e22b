"""The policies the simulator compares, each a set of inputs to the one real policy.

Every policy here is gpufleet's own `plan_replica` fed differently: other
`PolicySettings`, other `Demand`s, or (for the oracle) another view of recency. None
re-implements placement.

| name | settings | demand | learns the peak |
| --- | --- | --- | --- |
| `default` | `PolicySettings()`: x3, best fit, LRU victims, LRU warm drops | bytes | yes |
| `ndif` | x3, random GPU, smallest victims first, smallest warm copies dropped first | bytes | no |
| `helix` | x3, the GPU with the most free memory, LRU | bytes | no |
| `static` | `PolicySettings()` | Ray's `num_gpus`: a static fraction (see `static_demand`) | no |
| `oracle` | `PolicySettings()` on a Belady view (see `belady_view`) | bytes | yes |

`default-nolearn` and `oracle-nolearn` are ablations: the same without learned peaks,
to separate what the policy earns from what measuring memory earns.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from placement.errors import ConfigError
from placement.policy.settings import GpuChoice, PolicySettings, VictimOrder
from placement.policy.sizing import scale
from placement.policy.state import Demand, Level, Snapshot
from placement.simulator.fleet import Fleet, GpuType, SimModel
from placement.units import accelerators

#: The policies a run compares when none are named.
DEFAULT_POLICIES = ("default", "ndif", "helix", "static", "oracle")

#: The recency given to a model that is never requested again: older than any other.
NEVER = 2**62


@dataclass(frozen=True)
class SimPolicy:
    """One policy under test.

    - `settings`: the `PolicySettings` handed to `plan_replica`.
    - `learns`: after a model's first load the worker's measured peak is recorded and
      later demands carry it as `Demand.learned` (gpufleet's learned memory).
    - `belady`: plan on `belady_view` of the snapshot (the offline oracle).
    - `static`: size replicas with Ray-style static GPU fractions (`static_demand`).
    """

    name: str
    settings: PolicySettings
    learns: bool = False
    belady: bool = False
    static: bool = False
    summary: str = ""

    def demands(self, fleet: Fleet) -> dict[str, Demand]:
        """The base demand of every catalog model under this policy."""
        if self.static:
            types = fleet.gpu_types()
            return {m.name: static_demand(m, types, self.settings) for m in fleet.models}
        return {m.name: Demand(m.name, size=m.size) for m in fleet.models}

    def describe(self) -> dict[str, object]:
        """A JSON-ready summary for reports."""
        s = self.settings
        return {
            "summary": self.summary,
            "factor": s.factor,
            "gpu_choice": s.gpu_choice.value,
            "victim_order": s.victim_order.value,
            "warm_drop_order": s.warm_drop_order.value,
            "learns": self.learns,
            "belady": self.belady,
            "static_fractions": self.static,
        }


def _registry() -> dict[str, SimPolicy]:
    ndif = PolicySettings(
        factor=3.0,
        gpu_choice=GpuChoice.RANDOM,
        victim_order=VictimOrder.SMALLEST,
        warm_drop_order=VictimOrder.SMALLEST,
    )
    policies = [
        SimPolicy("default", PolicySettings(), learns=True, summary="gpufleet: best fit, LRU"),
        SimPolicy("ndif", ndif, summary="NDIF: x3, random GPU, fewest evictions smallest first"),
        SimPolicy(
            "helix",
            PolicySettings(gpu_choice=GpuChoice.MOST_FREE),
            summary="Helix: the single GPU with the most free memory",
        ),
        SimPolicy(
            "static", PolicySettings(), static=True, summary="Ray num_gpus: static GPU fractions"
        ),
        SimPolicy(
            "oracle",
            PolicySettings(),
            learns=True,
            belady=True,
            summary="offline Belady: evict the model needed farthest in the future",
        ),
        SimPolicy("default-nolearn", PolicySettings(), summary="ablation: default, no learning"),
        SimPolicy(
            "oracle-nolearn",
            PolicySettings(),
            belady=True,
            summary="ablation: oracle, no learning",
        ),
    ]
    return {p.name: p for p in policies}


POLICIES: Mapping[str, SimPolicy] = _registry()


def get_policy(name: str) -> SimPolicy:
    """The policy called `name`, or a `ConfigError` listing the known ones."""
    try:
        return POLICIES[name]
    except KeyError:
        raise ConfigError(f"unknown policy {name!r}: use one of {', '.join(POLICIES)}") from None


def with_learned(demand: Demand, learned: Mapping[str, int]) -> Demand:
    """`demand` carrying the model's measured peak, as `Registry.place` does."""
    peak = learned.get(demand.model)
    if peak is None or demand.learned is not None:
        return demand
    return replace(demand, learned=peak)


# --- Ray's static fractions ---------------------------------------------------


def static_demand(model: SimModel, types: Sequence[GpuType], settings: PolicySettings) -> Demand:
    """A Ray-style `num_gpus` demand, as a careful Ray user would write it.

    Ray's fraction is of *whichever* GPU the actor lands on, so a user sizes it on the
    smallest GPU kind it may land on and pins it to kinds at least that large with an
    accelerator type (seed 002):

    - `need = size x factor` (the same x3 guess);
    - the smallest kind `T` with `need < fractional_threshold x T` gives
      `gpus = need / T` rounded up to 0.01, on kinds of at least `T`'s memory;
    - else the smallest kind that holds the weights gives `gpus = 1` (a whole GPU);
    - else NDIF's `ceil(size / largest) + 1` whole GPUs.

    On a larger GPU the same fraction reserves more bytes than needed: that waste is
    what the baseline measures.
    """
    tiers = sorted(types, key=lambda t: (t.total, t.name))
    need = scale(model.size, settings.factor)
    for i, tier in enumerate(tiers):
        if need < settings.fractional_threshold * tier.total:
            fraction = -(-need * 100 // tier.total) / 100
            return Demand(
                model.name, size=model.size, gpus=fraction, accelerator=_at_least(tiers, i)
            )
    for i, tier in enumerate(tiers):
        if model.size <= tier.total:
            return Demand(model.name, size=model.size, gpus=1.0, accelerator=_at_least(tiers, i))
    count = math.ceil(model.size / tiers[-1].total) + 1
    return Demand(model.name, size=model.size, gpus=float(count))


def _at_least(tiers: Sequence[GpuType], i: int) -> tuple[str, ...] | None:
    """Accelerator alternatives naming the GPU kinds `tiers[i:]` and none of `tiers[:i]`."""
    if i == 0:
        return None
    names = tuple(dict.fromkeys(kind.name for kind in tiers[i:]))
    if any(accelerators.matches(kind.name, names) for kind in tiers[:i]):
        raise ConfigError(f"no accelerator type selects {tiers[i].name} without smaller GPUs")
    return names


# --- the oracle -----------------------------------------------------------------


def belady_view(snap: Snapshot, next_use: Callable[[str], int]) -> Snapshot:
    """The snapshot with every HOT and WARM replica's recency replaced by Belady's key.

    `next_use(model)` is the index of the model's next request in the trace. Setting
    `last_used_ms = -next_use` makes LRU order Belady's order: the model needed
    farthest in the future looks least recently used, so `plan_replica` under LRU
    evicts it first, prefers the GPU whose victims are needed latest, and drops the
    warm copies needed latest (never one needed sooner than the victim). A model never
    requested again gets `-NEVER`.
    """
    deps = {
        r: (
            replace(d, last_used_ms=-next_use(d.model))
            if d.level is Level.HOT or d.level is Level.WARM
            else d
        )
        for r, d in snap.deployments.items()
    }
    return replace(snap, deployments=deps)
