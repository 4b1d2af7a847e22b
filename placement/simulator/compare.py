"""Compare policies on one workload and fleet: the Python API behind `gpufleet simulate`.

    from placement.simulator import scenario, simulate
    trace, fleet = scenario("zipf", alpha=1.0, requests=100_000, seed=0)
    report = simulate(trace, fleet, ["default", "oracle"])
    report.to_json()["policies"]["default"]["hit_rate"]
    report.plot(Path("zipf.png"))

Every policy replays the same trace on the same fleet from an empty ledger, with the
same seed for the policy's random draws. `registry="redis"` drives the real Lua
registry instead of the in-memory ledger: on `redis_url`, or on a private
`RedisServer` started for the run.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from placement.errors import ConfigError
from placement.rules.scaling import Scaler
from placement.server.redis_server import RedisServer
from placement.simulator.backends import Ledger, MemoryLedger, RedisLedger
from placement.simulator.engine import Replay, TimeModel
from placement.simulator.fleet import Fleet, default_fleet
from placement.simulator.policies import DEFAULT_POLICIES, SimPolicy, get_policy
from placement.simulator.report import RunResult, plot
from placement.simulator.serving import ServingReplay
from placement.simulator.workloads import Trace, make_workload

REGISTRIES = ("memory", "redis")


@dataclass
class SimulationReport:
    """The results of every policy on one trace and fleet."""

    trace: Trace
    fleet: Fleet
    time_model: TimeModel
    registry: str
    seed: int
    results: dict[str, RunResult]
    policies: dict[str, SimPolicy]
    latency: bool = False  # plot p95 latency over time too (service-time replays)

    def to_json(self) -> dict[str, Any]:
        """The report object: `policies` keyed by name, plus what was simulated."""
        return {
            "workload": self.trace.describe(),
            "fleet": self.fleet.describe(),
            "time_model": self.time_model.describe(),
            "registry": self.registry,
            "seed": self.seed,
            "policies": {name: r.summary() for name, r in self.results.items()},
            "policy_settings": {name: p.describe() for name, p in self.policies.items()},
        }

    def plot(self, path: Path) -> Path:
        """Write the hit-rate and utilisation PNG (needs matplotlib)."""
        params = self.trace.params
        detail = f" alpha={params['alpha']}" if "alpha" in params else ""
        title = (
            f"{self.trace.name}{detail}: {len(self.trace):,} requests, "
            f"{len(self.fleet.models)} models, {self.fleet.describe()['gpus']} GPUs, "
            f"seed {self.seed}"
        )
        return plot(self.results, path, title, latency=self.latency)


def scenario(
    workload: str = "zipf",
    *,
    alpha: float = 1.0,
    requests: int | None = None,
    seed: int = 0,
    hosts: int = 2,
    share: float = 0.3,
    data_dir: Path | None = None,
) -> tuple[Trace, Fleet]:
    """The standard trace and fleet: `hosts` mixed hosts holding `share` of a catalog."""
    fleet = default_fleet(hosts=hosts, share=share, seed=seed)
    trace = make_workload(
        workload, len(fleet.models), requests, alpha=alpha, seed=seed, data_dir=data_dir
    )
    return trace, fleet


@contextlib.contextmanager
def _redis(url: str | None) -> Iterator[str]:
    if url:
        yield url
        return
    with RedisServer() as server:
        yield server.url


def simulate(
    trace: Trace,
    fleet: Fleet,
    policies: Sequence[str | SimPolicy] = DEFAULT_POLICIES,
    *,
    time_model: TimeModel | None = None,
    seed: int = 0,
    registry: str = "memory",
    redis_url: str | None = None,
    buckets: int = 100,
) -> SimulationReport:
    """Replay `trace` on `fleet` once per policy and collect the results."""
    if registry not in REGISTRIES:
        raise ConfigError(f"unknown registry {registry!r}: use one of {', '.join(REGISTRIES)}")
    chosen = [get_policy(p) if isinstance(p, str) else p for p in policies]
    if not chosen:
        raise ConfigError("name at least one policy")
    tm = time_model or TimeModel()
    results: dict[str, RunResult] = {}
    with contextlib.ExitStack() as stack:
        url = stack.enter_context(_redis(redis_url)) if registry == "redis" else ""
        for policy in chosen:
            ledger: Ledger = (
                RedisLedger(url, fleet) if registry == "redis" else MemoryLedger(fleet.snapshot())
            )
            replay = Replay(trace, fleet, policy, ledger, time_model=tm, seed=seed, buckets=buckets)
            results[policy.name] = replay.run()
    return SimulationReport(trace, fleet, tm, registry, seed, results, {p.name: p for p in chosen})


def compare_scaling(
    trace: Trace,
    fleet: Fleet,
    policy: str | SimPolicy = "default",
    *,
    time_model: TimeModel | None = None,
    seed: int = 0,
    buckets: int = 100,
) -> SimulationReport:
    """Replay `trace` with service time (`serving.ServingReplay`) twice: `fixed` single
    replicas, and `scaling`, replicas that follow load by the routers' rule."""
    chosen = get_policy(policy) if isinstance(policy, str) else policy
    tm = time_model or TimeModel()
    results = {
        label: ServingReplay(
            trace, fleet, chosen, scaler=scaler, time_model=tm, seed=seed, buckets=buckets
        ).run()
        for label, scaler in (("fixed", None), ("scaling", Scaler()))
    }
    policies = {"fixed": chosen, "scaling": chosen}
    return SimulationReport(trace, fleet, tm, "memory", seed, results, policies, latency=True)
