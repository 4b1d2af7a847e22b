"""The `gpufleet` command line against a real registry."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from rich.console import Console
from typer.testing import CliRunner

from placement.ledger.registry import Registry
from placement.policy.state import Demand, Gpu
from tasks.operator import call_cli
from tasks.operator.cli import app
from tests.fleets import GiB

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def populate(reg: Registry) -> str:
    for i in range(2):
        gpu = Gpu(id=f"h0:{i}", host="h0", index=i, name="Sim 8GiB", total=8 * GiB)
        reg.register_worker(f"w{i}", "h0", f"q{i}", [gpu], warm_budget=2 * GiB)
    plan = reg.place(Demand("sim-1g", size=GiB), rng=random.Random(0))
    reg.confirm(plan.replica, plan.worker, plan.epoch)
    return plan.replica


def test_status_json_lists_gpus_and_deployments_as_the_registry_holds_them(
    redis_url: str, fleet: str
) -> None:
    reg = Registry.from_url(redis_url, fleet)
    replica = populate(reg)
    result = runner.invoke(app, ["status", "--json", "--redis-url", redis_url, "--fleet", fleet])
    assert result.exit_code == 0, result.output
    report = json.loads(result.output)
    snap = reg.snapshot()
    assert [g["id"] for g in report["gpus"]] == ["h0:0", "h0:1"]
    for g in report["gpus"]:
        ledger = snap.gpus[g["id"]]
        assert g["reserved_bytes"] == ledger.reserved
        assert g["free_bytes"] == ledger.total - ledger.reserved
        assert g["alive"] is True
    (dep,) = report["deployments"]
    assert (dep["model"], dep["replica"], dep["level"]) == ("sim-1g", replica, "HOT")
    assert sum(dep["gpus"].values()) == sum(g["reserved_bytes"] for g in report["gpus"])
    assert report["problems"] == []


def test_plain_status_shows_each_gpu_with_the_models_on_it(redis_url: str, fleet: str) -> None:
    populate(Registry.from_url(redis_url, fleet))
    result = runner.invoke(app, ["status", "--redis-url", redis_url, "--fleet", fleet])
    assert result.exit_code == 0, result.output
    assert "2 of 2 GPUs alive" in result.output
    assert "sim-1g" in result.output and "HOT" in result.output


def test_status_of_an_unreachable_registry_fails_with_a_hint() -> None:
    result = runner.invoke(app, ["status", "--redis-url", "redis://127.0.0.1:1/0"])
    assert result.exit_code == 1
    assert "GPUFLEET_REDIS_URL" in result.output


def test_the_demo_catalog_is_valid_and_lists_every_model() -> None:
    result = runner.invoke(app, ["catalog", str(REPO / "models.yaml")])
    assert result.exit_code == 0, result.output
    for name in ("minilm", "tiny-gpt", "sim-1g", "pinned"):
        assert name in result.output


def test_without_a_file_the_catalog_command_reads_gpufleet_models(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "fleet.yaml"
    path.write_text("models:\n  only-this: {source: w, task: forward}\n")
    monkeypatch.setenv("GPUFLEET_MODELS", str(path))
    result = runner.invoke(app, ["catalog"])
    assert result.exit_code == 0, result.output
    assert "only-this" in result.output and "1 models" in result.output


def test_a_bad_catalog_is_refused_naming_the_model_and_field(tmp_path: Path) -> None:
    bad = tmp_path / "models.yaml"
    bad.write_text(
        "models:\n  m:\n    source: synthetic\n    task: forward\n    memory: 8 parsecs\n"
    )
    result = runner.invoke(app, ["catalog", str(bad)])
    assert result.exit_code == 1
    assert "model 'm'" in result.output and "memory" in result.output


def test_the_gpufleet_console_entry_is_installed_and_runs(redis_url: str, fleet: str) -> None:
    exe = shutil.which("gpufleet")
    assert exe is not None, "pip install -e . installs the gpufleet entry point"
    env = {**os.environ, "GPUFLEET_REDIS_URL": redis_url, "GPUFLEET_FLEET": fleet}
    done = subprocess.run(
        [exe, "status", "--json"], check=False, env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["gpus"] == []


def test_up_stops_on_sigint_sigterm_and_a_closed_terminal_but_not_under_nohup() -> None:
    from tasks.operator.cli import stop_on_signals

    signals = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        for sig in signals:  # as `nohup cmd &` leaves them: SIGINT and SIGHUP ignored
            signal.signal(sig, signal.SIG_IGN if sig != signal.SIGTERM else signal.SIG_DFL)
        stop_on_signals()
        assert signal.getsignal(signal.SIGHUP) is signal.SIG_IGN  # nohup keeps it running
        for sig in (signal.SIGINT, signal.SIGTERM):
            with pytest.raises(KeyboardInterrupt):  # the fleet's orderly stop
                signal.raise_signal(sig)
        signal.signal(signal.SIGHUP, signal.SIG_DFL)  # in a terminal
        stop_on_signals()
        with pytest.raises(KeyboardInterrupt):
            signal.raise_signal(signal.SIGHUP)
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)


def test_streamed_text_cannot_drive_the_terminal_but_keeps_its_lines() -> None:
    text = "red \x1b[31mtext\x1b]0;title\x07 over\rwritten \x9b2J\nnext\tline é"
    shown = call_cli.printable(text)
    assert not any((ord(c) < 0x20 and c not in "\n\t") or 0x7F <= ord(c) < 0xA0 for c in shown)
    assert shown == "red \\x1b[31mtext\\x1b]0;title\\x07 over\\x0dwritten \\x9b2J\nnext\tline é"


def test_a_generated_answer_that_looks_like_markup_prints_as_text() -> None:
    result = {
        "model": "tiny-gpt",
        "gpus": ["h:0"],
        "cache": "hot",
        "outputs": {"texts": [["[/] [bold]not bold"]]},
        "timings_ms": {"queue": 1, "load": 0, "compute": 2.0},
    }
    console = Console(record=True, width=200)
    console.print(call_cli.summary(result))  # rich raised MarkupError on "[/]" before
    assert "[/] [bold]not bold" in console.export_text()
