"""`gpufleet simulate`: a workload replayed through the placement policy, offline
(`placement.simulator`), against the compared policies and an oracle; no fleet needed."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from tasks.operator.console import console, guard


def simulate(
    *,
    workload: Annotated[
        str, typer.Option(help="zipf, bursty, hotspot, azure-conv or azure-code.")
    ] = "zipf",
    alpha: Annotated[float, typer.Option(help="Zipf exponent of model popularity.")] = 1.0,
    requests: Annotated[
        int | None, typer.Option(help="Requests (default 100,000; Azure: the whole trace).")
    ] = None,
    seed: Annotated[int, typer.Option(help="Seed of the fleet, trace and policies.")] = 0,
    policy: Annotated[
        list[str] | None, typer.Option(help="Repeatable (default: all five compared policies).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report object.")] = False,
    plot: Annotated[Path | None, typer.Option(help="Write a PNG of hit rate and use.")] = None,
    registry: Annotated[str, typer.Option(help="memory, or redis (the Lua registry).")] = "memory",
    redis_url: Annotated[
        str | None, typer.Option(help="Redis for --registry redis (default: a private one).")
    ] = None,
    data_dir: Annotated[Path | None, typer.Option(help="Folder of the Azure CSVs.")] = None,
    scaling: Annotated[
        bool,
        typer.Option(
            "--scaling",
            help="Replicas serve one call at a time; compare fixed single replicas with "
            "replicas that follow load (the first --policy, default `default`).",
        ),
    ] = False,
) -> None:
    """Replay a workload through the placement policy; compare it with the seeds and an oracle."""
    from placement import simulator as sim

    def run() -> sim.SimulationReport:
        trace, fleet = sim.scenario(
            workload, alpha=alpha, requests=requests, seed=seed, data_dir=data_dir
        )
        if scaling:
            return sim.compare_scaling(trace, fleet, (policy or ["default"])[0], seed=seed)
        chosen = policy or list(sim.DEFAULT_POLICIES)
        return sim.simulate(trace, fleet, chosen, seed=seed, registry=registry, redis_url=redis_url)

    report = guard(run)
    if plot is not None:
        guard(lambda: report.plot(plot))
    data = report.to_json()
    if as_json:
        typer.echo(json.dumps(data, indent=2))
        return
    table = Table(title=f"{workload}: {data['workload']['requests']:,} requests")
    columns = {"hit_rate": "hit", "reload_rate": "reload", "utilization": "use"}
    columns |= {"p50_ms": "p50 ms", "p95_ms": "p95 ms", "p99_ms": "p99 ms", "wall_s": "wall s"}
    if scaling:
        columns |= {"memory_gib_s": "GiB\u00b7s", "scale_outs": "outs", "scale_ins": "ins"}
    for header in ("policy", *columns.values()):
        table.add_column(header, justify="right")
    for name, row in data["policies"].items():
        cells = (
            f"{row[c]:.3f}"
            if c in ("hit_rate", "reload_rate", "utilization")
            else f"{row[c]:,.0f}"
            if c.endswith("_ms") or c in ("memory_gib_s", "scale_outs", "scale_ins")
            else f"{row[c]:.1f}"
            for c in columns
        )
        table.add_row(name, *cells)
    console.print(table)
