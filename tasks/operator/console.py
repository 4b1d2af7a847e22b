"""What every `gpufleet` command shares: its two consoles, the settings with the command
line's overrides, and the guard that turns a gpufleet error into one red line."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TypeVar

import typer
from rich.console import Console

from placement.config import Settings
from placement.errors import GpufleetError

console = Console(soft_wrap=True)
err = Console(stderr=True, soft_wrap=True)  # errors stay on one line
T = TypeVar("T")


def guard(action: Callable[[], T]) -> T:
    """Run `action`; a gpufleet error becomes one red line and exit code 1."""
    try:
        return action()
    except GpufleetError as exc:
        err.print(f"[red]error:[/] {exc}")
        raise typer.Exit(1) from exc


def settings(redis_url: str | None = None, fleet: str | None = None) -> Settings:
    """The settings, with the command line's overrides of the fleet and its URL."""
    env = dict(os.environ)
    if fleet:
        env["GPUFLEET_FLEET"] = fleet
    if redis_url:
        env["GPUFLEET_REDIS_URL"] = redis_url
    return guard(lambda: Settings.from_env(env))
