"""The `gpufleet` command line: look at a fleet's registry and its model catalog."""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, TypeVar

import typer
from rich.console import Console
from rich.table import Table

from placement.catalog import Catalog
from placement.errors import GpufleetError
from placement.memory import format_size
from placement.registry import Registry
from placement.report import status_report

app = typer.Typer(help="gpufleet: many models sharing GPUs by memory.", no_args_is_help=True)
console = Console()
err = Console(stderr=True, soft_wrap=True)  # errors stay on one line

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
T = TypeVar("T")

RedisUrl = Annotated[
    str,
    typer.Option(envvar="GPUFLEET_REDIS_URL", help="Registry URL (redis:// or rediss://)."),
]
Fleet = Annotated[str, typer.Option(envvar="GPUFLEET_FLEET", help="Fleet name in the registry.")]


@app.callback()
def _setup(verbose: Annotated[bool, typer.Option("--verbose", "-v")] = False) -> None:
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.WARNING,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )


@app.command()
def status(
    as_json: Annotated[bool, typer.Option("--json", help="Print the status object.")] = False,
    redis_url: RedisUrl = DEFAULT_REDIS_URL,
    fleet: Fleet = "default",
) -> None:
    """Show every GPU, what it holds, and the warm caches."""
    report = _guard(lambda: status_report(Registry.from_url(redis_url, fleet).snapshot()))
    if as_json:
        typer.echo(json.dumps(report, indent=2))
        return
    console.print(_gpu_table(report))
    for host in report["hosts"]:
        warm = [
            d["model"]
            for d in report["deployments"]
            if d["level"] == "WARM" and d["host"] == host["name"]
        ]
        console.print(
            f"[bold]{host['name']}[/] warm cache {format_size(host['warm_used_bytes'])}"
            f" / {format_size(host['warm_budget_bytes'])}: {', '.join(warm) or '-'}"
        )
    for problem in report["problems"]:
        err.print(f"[red]ledger problem:[/] {problem}")


@app.command()
def catalog(
    path: Annotated[
        Path | None, typer.Argument(help="models.yaml (default: $GPUFLEET_MODELS).")
    ] = None,
) -> None:
    """Validate a model catalog and list its models."""
    models = _guard(lambda: Catalog.load(path or Catalog.default_path()))
    table = Table(title=f"{models.origin}: {len(models)} models")
    for column in ("model", "task", "source", "memory", "dedicated", "replicas"):
        table.add_column(column)
    for spec in models.values():
        if spec.request is not None:
            memory = (
                f"{format_size(spec.request)} (limit {format_size(spec.limit or spec.request)})"
            )
        elif spec.memory is not None:
            memory = format_size(spec.memory)
        elif spec.gpus is not None:
            memory = f"{spec.gpus:g} GPU"
        else:
            memory = "estimated"
        table.add_row(
            spec.name, spec.task, spec.source, memory, str(spec.dedicated), str(spec.replicas)
        )
    console.print(table)


def _gpu_table(report: dict[str, Any]) -> Table:
    summary = report["summary"]
    table = Table(title=f"gpufleet: {summary['gpus_alive']} of {summary['gpus']} GPUs alive")
    for column in ("GPU", "name", "memory", "use", "worker", "models"):
        table.add_column(column)
    for g in report["gpus"]:
        share = g["reserved_bytes"] / g["total_bytes"] if g["total_bytes"] else 0.0
        on_it = [
            f"{d['model']} [dim]{d['level']} {format_size(d['gpus'][g['id']])}[/]"
            for d in report["deployments"]
            if g["id"] in d["gpus"]
        ]
        table.add_row(
            f"{g['host']}:{g['index']}"
            if g["alive"]
            else f"[red]{g['host']}:{g['index']} (dead)[/]",
            g["name"],
            f"{format_size(g['reserved_bytes'])} / {format_size(g['total_bytes'])}",
            f"{share:.0%}",
            g["worker"] or "-",
            "\n".join(on_it) or "-",
        )
    return table


def _guard(action: Callable[[], T]) -> T:
    """Run `action`; a gpufleet error becomes one red line and exit code 1."""
    try:
        return action()
    except GpufleetError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc


def main() -> None:
    """Console entry point."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # gpufleet never downloads models
    app()
