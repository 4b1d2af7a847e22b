"""The simulator: replay request traces through gpufleet's own placement policy.

It compares gpufleet's default policy with the seeds' policies (NDIF, Helix, Ray's
static fractions) and with an offline Belady oracle, on synthetic and real (Azure)
workloads, in memory (`ledger.apply_plan`) or on the real Lua registry. Pure Python:
no Celery, no torch; matplotlib only when a plot is drawn.

Modules, one concept each: `fleet` (GPUs, hosts, model mix), `workloads` (traces),
`policies` (what each compared policy feeds `plan_replica`), `backends` (the ledgers),
`engine` (the event-driven replay and its time model), `report` (metrics, JSON, plot),
`compare` (the API: run several policies, collect a report).
"""

from placement.simulator.backends import MemoryLedger, RedisLedger, SimulationError
from placement.simulator.compare import SimulationReport, compare_scaling, scenario, simulate
from placement.simulator.engine import Replay, TimeModel
from placement.simulator.fleet import Fleet, GpuType, HostSpec, SimModel, default_fleet
from placement.simulator.policies import DEFAULT_POLICIES, POLICIES, SimPolicy, get_policy
from placement.simulator.report import RunResult
from placement.simulator.workloads import WORKLOADS, Trace, make_workload

__all__ = [
    "DEFAULT_POLICIES",
    "POLICIES",
    "WORKLOADS",
    "Fleet",
    "GpuType",
    "HostSpec",
    "MemoryLedger",
    "RedisLedger",
    "Replay",
    "RunResult",
    "SimModel",
    "SimPolicy",
    "SimulationError",
    "SimulationReport",
    "TimeModel",
    "Trace",
    "compare_scaling",
    "default_fleet",
    "get_policy",
    "make_workload",
    "scenario",
    "simulate",
]
