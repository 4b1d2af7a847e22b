"""Many fine-tunes of one base: LoRA adapters over one resident replica, against the base
alone and against each fine-tune as a model of its own.

    python -m bench.adapters [--adapters 200] [--calls 256] [--callers 16] [--new-tokens 8] \
        [--gpu] > bench/out/adapters.json

Prints one JSON object. It starts a fleet (`gpufleet up`'s launcher: its bundled Redis,
one simulated 8 GiB GPU) whose catalog holds a synthetic GPT-2 base (8 layers, 512 wide)
listing `--adapters` adapters of rank 8 on its attention projections (`attn.c_attn`,
`attn.c_proj`; written here in peft's format, random factors), and as many synthetic
models of the base's own size (`ft-NNN`): today's way, each fine-tune a merged copy of its
own. `--callers` plain Celery clients with the fleet's `caller` URL then send `--calls`
calls in all (each `--new-tokens` new tokens, greedy), in three phases under the same load, measured
in this one run:

- `base_alone` (the baseline): every call names the base;
- `adapters`: every call names `base:ad-NNN`, every adapter once in a random order and
  the rest at random;
- `merged_models`: every call names `ft-NNN`, each once and the rest at random, as for
  the adapters.

Reported: each phase's seconds, calls and tokens per second and latency p50 and p99; the
ratios of the adapters' tokens per second to the base alone's and to the merged models';
the adapters answered; the median load of an adapter into its replica's slot from the
worker's shelf in host memory and from disk (`gpufleet status`); and whether the ledger
audit found a problem. Targets (issue 76): `vs_base_alone` >= 0.6, `vs_merged_models` >=
5, shelf load p50 <= 20 ms, every adapter answered, no ledger problem. With `--gpu` the
fleet runs on this host's real GPUs instead of the simulated one (target there:
`vs_base_alone` >= 0.5).
"""

from __future__ import annotations

import argparse
import json
import logging
import random
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

from celery import Celery

from bench.harness import all_at_once, percentile

log = logging.getLogger("bench.adapters")

SIM_GPUS = "1x8GiB"
CONFIG = (
    "{model_type: gpt2, n_layer: 8, n_head: 8, n_embd: 512, vocab_size: 2048, n_positions: 512}"
)
SIZE = "110MiB"  # the synthetic model's weights: 26.5M float32 parameters
RANK = 8
TARGETS = ("attn.c_attn", "attn.c_proj")
ADAPTER_MEMORY = "96MiB"  # about 125 slots of 786 KiB: fewer than the adapters, so they swap
TIMEOUT_S = 600.0
TARGETS_OF_ISSUE = {"vs_base_alone": 0.6, "vs_merged_models": 5.0, "shelf_load_p50_ms": 20.0}


def catalog(adapters: int) -> str:
    """The base with its adapters' directory, and `adapters` models of the base's size."""
    lines = [
        "models:",
        "  base:",
        "    source: synthetic",
        "    task: text-generation",
        f"    memory: {SIZE}",
        f"    config: {CONFIG}",
        "    adapters: ./adapters",
        f"    adapter_memory: {ADAPTER_MEMORY}",
        f"    adapter_rank: {RANK}",
    ]
    for n in range(adapters):
        lines += [
            f"  ft-{n:03d}:",
            "    source: synthetic",
            "    task: text-generation",
            f"    memory: {SIZE}",
            f"    config: {CONFIG}",
        ]
    return "\n".join(lines) + "\n"


def write_adapters(directory: Path, count: int, layers: int = 8, width: int = 512) -> None:
    """`count` rank-`RANK` LoRA adapters on the base's attention projections, as peft
    saves them: its own config file, and random factors (small, so the text stays text)."""
    import peft
    import torch
    from safetensors.torch import save_file

    shapes = {"attn.c_attn": (width, 3 * width), "attn.c_proj": (width, width)}
    generator = torch.Generator().manual_seed(0)
    for n in range(count):
        where = directory / f"ad-{n:03d}"
        config = peft.LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=list(TARGETS))
        config.save_pretrained(str(where))
        factors = {}
        for layer in range(layers):
            for module, (fan_in, fan_out) in shapes.items():
                key = f"base_model.model.transformer.h.{layer}.{module}"
                a = torch.randn(RANK, fan_in, generator=generator) / fan_in**0.5
                b = torch.randn(fan_out, RANK, generator=generator) * 0.02
                factors[f"{key}.lora_A.weight"] = a
                factors[f"{key}.lora_B.weight"] = b
        save_file(factors, str(where / "adapter_model.safetensors"))


def names_for(prefix: str, count: int, calls: int, seed: int) -> list[str]:
    """`calls` model names: each of `count` once in a random order, the rest at random."""
    pick = random.Random(seed)
    names = [f"{prefix}{n:03d}" for n in range(count)]
    pick.shuffle(names)
    names += [f"{prefix}{pick.randrange(count):03d}" for _ in range(max(0, calls - count))]
    return names[:calls] if calls < count else names


def phase(clients: list[Celery], models: list[str], new_tokens: int) -> dict[str, Any]:
    """`models` called by the clients at once, each taking the next name when its call is
    answered: seconds, calls and tokens per second, latency p50 and p99, and failures."""
    todo = list(enumerate(models))
    lock = threading.Lock()
    waits: list[float] = []
    tokens = [0]
    failed: dict[str, str] = {}

    def caller(client: Celery) -> None:
        while True:
            with lock:
                if not todo:
                    return
                index, model = todo.pop(0)
            sent = time.monotonic()
            call = client.send_task(
                "gpufleet.infer",
                args=(model, f"call {index} of the bench", {"max_new_tokens": new_tokens}),
            )
            try:
                answer = call.get(timeout=TIMEOUT_S)
            except Exception as exc:  # a failed call is reported, not fatal to the run
                with lock:
                    failed[model] = f"{type(exc).__name__}: {exc}"[:200]
                continue
            with lock:
                waits.append(time.monotonic() - sent)
                tokens[0] += sum(len(t) for t in answer["outputs"]["tokens"])

    seconds = all_at_once(clients, caller)
    return {
        "seconds": round(seconds, 2),
        "calls": len(waits),
        "calls_per_s": round(len(waits) / seconds, 2),
        "tokens_per_s": round(tokens[0] / seconds, 1),
        "latency_p50_s": round(percentile(waits, 50), 3) if waits else None,
        "latency_p99_s": round(percentile(waits, 99), 3) if waits else None,
        "failed": len(failed),
        "failures": dict(list(failed.items())[:5]),
    }


def run(  # noqa: PLR0917 - the run's own numbers
    adapters: int, calls: int, callers: int, new_tokens: int, directory: Path, gpu: bool = False
) -> dict[str, Any]:
    from bench.fleet import bench_launcher, fleet_machine
    from tasks.config import caller_conf

    write_adapters(directory / "adapters", adapters)
    sim = "" if gpu else SIM_GPUS
    fleet = bench_launcher(directory, catalog(adapters), "adapters", sim, warm_cache="2GiB")
    clients: list[Celery] = []
    try:
        fleet.start()
        fleet.wait_ready(300.0)
        for _ in range(callers):
            made = Celery(set_as_current=False)
            made.conf.update(**caller_conf(fleet.caller_url))
            clients.append(made)
        warm = {"max_new_tokens": 2}
        clients[0].send_task("gpufleet.infer", args=("base", "warm", warm)).get(timeout=TIMEOUT_S)
        base = phase(clients, ["base"] * calls, new_tokens)
        with_adapters = phase(clients, names_for("base:ad-", adapters, calls, 1), new_tokens)
        report = clients[0].send_task("gpufleet.status").get(timeout=60)
        merged = phase(clients, names_for("ft-", adapters, calls, 2), new_tokens)
        problems = clients[0].send_task("gpufleet.status").get(timeout=60)["problems"]
    finally:
        for made in clients:
            made.close()
        fleet.stop()
    gen = report["generation"].get("base", {})
    result: dict[str, Any] = {
        "adapters": adapters,
        "calls_per_phase": calls,
        "callers": callers,
        "new_tokens": new_tokens,
        "base_alone": base,
        "adapters_phase": with_adapters,
        "merged_models": merged,
        "vs_base_alone": round(with_adapters["tokens_per_s"] / base["tokens_per_s"], 3),
        "vs_merged_models": round(with_adapters["tokens_per_s"] / merged["tokens_per_s"], 2),
        "adapter_room": {
            "held_by_replica": gen.get("adapters_by_replica"),
            "hits": gen.get("adapter_hits"),
            "loads": gen.get("adapter_loads"),
            "evictions": gen.get("adapter_evictions"),
            "load_p50_ms": gen.get("adapter_load_p50_ms"),
            "problems": gen.get("adapter_problems"),
        },
        "ledger_problems_after_adapters": report["problems"],
        "ledger_problems_at_end": problems,
        "targets": TARGETS_OF_ISSUE,
    }
    shelf = (gen.get("adapter_load_p50_ms") or {}).get("shelf") or 0.0
    result["meets_targets"] = (
        result["vs_base_alone"] >= (0.5 if gpu else TARGETS_OF_ISSUE["vs_base_alone"])
        and result["vs_merged_models"] >= TARGETS_OF_ISSUE["vs_merged_models"]
        and 0 < shelf <= TARGETS_OF_ISSUE["shelf_load_p50_ms"]
        and with_adapters["failed"] == 0
        and len(gen.get("adapters_by_replica") or {}) == 1
        and not report["problems"]
    )
    result["machine"] = fleet_machine(sim)
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--adapters", type=int, default=200)
    parser.add_argument("--calls", type=int, default=256, help="calls in each phase")
    parser.add_argument("--callers", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=8, help="of each call")
    parser.add_argument("--gpu", action="store_true", help="on this host's real GPUs")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, stream=sys.stderr, format="%(name)s: %(message)s")
    with tempfile.TemporaryDirectory(prefix="gpufleet-adapters-") as tmp:
        result = run(args.adapters, args.calls, args.callers, args.new_tokens, Path(tmp), args.gpu)
    json.dump(result, sys.stdout, indent=2)
    print()


if __name__ == "__main__":
    main()
