"""GPU probes run in a fresh process each (`python -m tests.gpu_probe NAME [ARG]`).

A per-process memory fraction and a CUDA context cannot be undone inside one process,
so every GPU test runs its probe in a child and reads one JSON line from it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from placement.catalog.catalog import Catalog
from worker.devices import Device, nvml_devices
from worker.residency import ResidencyManager

GiB = 2**30
MiB = 2**20
HOST = "probe"
REPO = Path(__file__).resolve().parents[1]


def _devices() -> list[Device]:
    found = nvml_devices()
    if not found:
        raise SystemExit("no NVML GPU")
    return found


def _nvml_used(index: int) -> int:
    import pynvml

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        return int(pynvml.nvmlDeviceGetMemoryInfo(handle).used)
    finally:
        pynvml.nvmlShutdown()


def fraction_cap(arg: str) -> dict[str, Any]:
    """Cap at `arg` of device 0, then allocate under and past it."""
    share = float(arg)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(share, 0)
    under = torch.empty(int(total * share * 0.5), dtype=torch.uint8, device="cuda:0")
    try:
        torch.empty(int(total * share * 0.6), dtype=torch.uint8, device="cuda:0")
        past = "allocated"
    except torch.OutOfMemoryError:
        past = "oom"
    del under
    return {"past": past, "max_reserved": torch.cuda.max_memory_reserved(0), "cap": total * share}


def fill_to_cap(arg: str) -> dict[str, Any]:
    """Allocate 64 MiB blocks until OOM under a cap of `arg`; report the peak reservation."""
    share = float(arg)
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.set_per_process_memory_fraction(share, 0)
    blocks = []
    try:
        while True:
            blocks.append(torch.empty(64 * MiB, dtype=torch.uint8, device="cuda:0"))
    except torch.OutOfMemoryError:
        pass
    return {"max_reserved": torch.cuda.max_memory_reserved(0), "cap": total * share}


def load_on(arg: str) -> dict[str, Any]:
    """Load MiniLM on local device `arg`; report where the context and weights landed."""
    devices = _devices()
    target = devices[int(arg)]
    manager = ResidencyManager(devices, HOST)
    spec = Catalog.load(REPO / "models.yaml").get("minilm")
    before = manager.contexts()
    manager.load(spec, "r1", {target.gpu_id(HOST): GiB})
    model = manager.residents["r1"].model
    return {
        "target": target.gpu_id(HOST),
        "contexts_before": before,
        "contexts": manager.contexts(),  # what it would declare registering again
        "current_device": torch.cuda.current_device(),
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "fraction": manager.fraction(target.cuda_index or 0),
        "embedding_dim": manager.calls.infer("r1", "hello")["dim"],
    }


def offload_restore(arg: str) -> dict[str, Any]:
    """Load, offload and restore MiniLM, then offload it again; report device memory by
    torch and NVML, and what the pinned arena held at each step (before the load, once it
    pinned ahead after the load, after each offload)."""
    devices = _devices()
    first, second = devices[0], devices[int(arg)]
    manager = ResidencyManager(devices, HOST, arena_bytes=GiB)
    assert manager.arena is not None
    spec = Catalog.load(REPO / "models.yaml").get("minilm")
    arena = [manager.arena.pinned]
    manager.load(spec, "r1", {first.gpu_id(HOST): GiB})
    before = manager.calls.infer("r1", "same input")
    loaded = (torch.cuda.memory_reserved(0), _nvml_used(first.index))
    assert manager.arena.settle(30)  # room for its copy, pinned ahead on the arena's thread
    arena.append(manager.arena.pinned)
    offload = manager.offload("r1")
    offloaded = (torch.cuda.memory_reserved(0), _nvml_used(first.index))
    arena.append(manager.arena.pinned)
    copy_bytes = manager.copy_bytes("r1")
    warm_pinned = all(p.is_pinned() for p in manager.residents["r1"].model.parameters())
    restore = manager.restore("r1", {second.gpu_id(HOST): GiB})
    manager.trim_host_cache()  # as the keeper does once the restore is confirmed
    free_after_restore = manager.arena.free
    model = manager.residents["r1"].model
    result = {
        "copy_bytes": copy_bytes,
        "reserved": [loaded[0], offloaded[0]],
        "nvml_used": [loaded[1], offloaded[1]],
        "pinned": warm_pinned,
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "same_output": manager.calls.infer("r1", "same input") == before,
        "offload_gbps": offload.gbps,
        "restore_gbps": restore.gbps,
        "arena_free_after_restore": free_after_restore,
    }
    again = manager.offload("r1")  # into the region the first copy gave back
    arena.append(manager.arena.pinned)
    result["arena_pinned"] = arena
    result["offload_again_gbps"] = again.gbps
    return result


def cross_worker_read(arg: str) -> dict[str, Any]:
    """Worker A (this process) loads MiniLM on the first GPU and offloads it into its
    arena; worker B (a child process, `read_warm_copy`) loads it onto local device `arg`
    from A's copy. Reports how B loaded it, where, and whether it answers as A did."""
    devices = _devices()
    holder = ResidencyManager(devices[:1], HOST, arena_bytes=GiB, publish=True)
    minilm = Catalog.load(REPO / "models.yaml").get("minilm")
    holder.load(minilm, "a", {devices[0].gpu_id(HOST): GiB})
    before = holder.calls.infer("a", "same input")
    holder.offload("a")
    locator = holder.locator("a")
    done = subprocess.run(
        [sys.executable, "-m", "tests.gpu_probe", "read_warm_copy", f"{locator},{arg}"],
        cwd=REPO, capture_output=True, text=True, timeout=300, check=False,
    )  # fmt: skip
    if done.returncode:
        raise SystemExit(done.stderr[-3000:])
    read = json.loads(done.stdout.strip().splitlines()[-1])
    return {
        "published": bool(locator),
        "via": read["via"],
        "param_devices": read["param_devices"],
        "same_output": read["output"] == before,
        "read_gbps": read["gbps"],
    }


def read_warm_copy(arg: str) -> dict[str, Any]:
    """Worker B of `cross_worker_read`: `arg` is "<locator>,<local device>"."""
    locator, target = arg.rsplit(",", 1)
    devices = _devices()
    reader = ResidencyManager(devices, HOST, warmup=False)
    minilm = Catalog.load(REPO / "models.yaml").get("minilm")
    slots = {devices[int(target)].gpu_id(HOST): GiB}
    report = reader.load(minilm, "b", slots, source=locator)
    model = reader.residents["b"].model
    return {
        "via": report.via,
        "param_devices": sorted({str(p.device) for p in model.parameters()}),
        "output": reader.calls.infer("b", "same input"),
        "gbps": report.gbps,
    }


def read_vs_transformers(arg: str) -> dict[str, Any]:
    """Load MiniLM on local device `arg` by gpufleet's reader and by transformers; compare."""
    devices = _devices()
    target = devices[int(arg)]
    manager = ResidencyManager(devices, HOST, warmup=False)
    minilm = Catalog.load(REPO / "models.yaml").get("minilm")
    slots = {target.gpu_id(HOST): GiB}
    device = target.cuda_index or 0
    ours = manager.load(minilm, "ours", slots)
    allocated = torch.cuda.memory_allocated(device)
    theirs = manager.load(replace(minilm, loader="transformers"), "theirs", slots)
    models = [manager.residents[r].model for r in ("ours", "theirs")]
    same = all(
        torch.equal(a, b) for a, b in zip(*(m.state_dict().values() for m in models), strict=True)
    )
    text = ["the same input", "and another"]
    return {
        "via": [ours.via, theirs.via],
        "param_devices": sorted({str(p.device) for p in models[0].parameters()}),
        "same_weights": same,
        "same_output": manager.calls.infer("ours", text) == manager.calls.infer("theirs", text),
        "allocated_after_read": allocated,
        "weight_bytes": ours.nbytes,
        "gbps": [ours.gbps, theirs.gbps],
    }


def _small_gpt(arg: str) -> tuple[Any, Any, Any]:
    """A synthetic GPT-2 (4 layers, 256 wide, 512 positions, float32) on local device
    `arg`: the model, its tokenizer and the device."""
    from worker.weights.synthetic import build_synthetic

    config = {"model_type": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 256,
              "vocab_size": 2048, "n_positions": 512}  # fmt: skip
    entry = {"source": "synthetic", "task": "text-generation", "memory": "64MiB"}
    spec = Catalog.from_mapping({"models": {"g": {**entry, "config": config}}})["g"]
    model, tokenizer = build_synthetic(spec)
    device = torch.device(f"cuda:{int(arg)}")
    return model.to(device), tokenizer, device


def _random_calls(
    seed: int, count: int, longest: int, most_new: int
) -> list[tuple[list[int], int]]:
    """`count` seeded calls for `_small_gpt`: a BOS token and 4 to `longest` - 1 random
    tokens, asking 8 to `most_new` - 1 new tokens each."""
    import random

    rng = random.Random(seed)
    return [
        ([2, *(rng.randrange(5, 2048) for _ in range(rng.randrange(4, longest)))],
         rng.randrange(8, most_new))
        for _ in range(count)
    ]  # fmt: skip


def generate_on(arg: str) -> dict[str, Any]:
    """Run 16 greedy calls of mixed lengths as one continuous batch on local device `arg`,
    and each alone; report how many agree and where the cache lives (dtype float32)."""

    from worker.generation.engine import Engine, Options, Sequence_

    model, tokenizer, device = _small_gpt(arg)
    calls = _random_calls(0, 16, longest=200, most_new=120)

    def engine() -> Engine:
        return Engine(model, tokenizer, device, budget=10**6, window=512)

    together = engine()
    sequences = [Sequence_(i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(calls)]
    for sequence in sequences[:8]:
        together.add(sequence)
    together.step()
    for sequence in sequences[8:]:  # these join a running batch
        together.add(sequence)
    together.run()
    alone = []
    for prompt, new in calls:
        one = engine()
        sequence = Sequence_(0, prompt, Options(max_new_tokens=new))
        one.add(sequence)
        one.run()
        alone.append(sequence.tokens)
    return {
        "equal": sum(s.tokens == a for s, a in zip(sequences, alone, strict=True)),
        "calls": len(calls),
        "steps": together.steps,
        "peak_tokens": together.peak_tokens,
    }


def chunked_on(arg: str) -> dict[str, Any]:
    """On local device `arg`: four rows decoding while four prompts of 300 tokens join,
    prefilled 48 tokens a step (a pace held there: `worker.generation.pacing`), and each
    call alone; report how many agree, the steps that prefilled a chunk, and whether every
    running row got a token at each of them (dtype float32)."""
    import random

    from tests.paces import Fixed
    from worker.generation.engine import Engine, Options, Sequence_

    model, tokenizer, device = _small_gpt(arg)
    rng = random.Random(1)
    running = [([2, *(rng.randrange(5, 2048) for _ in range(20))], 60) for _ in range(4)]
    joining = [([2, *(rng.randrange(5, 2048) for _ in range(299))], 12) for _ in range(4)]
    together = Engine(model, tokenizer, device, budget=10**6, window=512, pace=Fixed(48))
    sequences = [Sequence_(i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(running)]
    for sequence in sequences:
        together.add(sequence)
    together.step()
    late = [Sequence_(4 + i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(joining)]
    for sequence in late:
        together.add(sequence)
    chunked_steps, every_row_decoded = 0, True
    while any(s.first_token is None for s in late):
        before = [len(s.tokens) for s in sequences]
        together.step()
        chunked_steps += 1
        every_row_decoded &= all(
            len(s.tokens) == n + 1 for s, n in zip(sequences, before, strict=True) if not s.done
        )
    together.run()
    alone = []
    for prompt, new in [*running, *joining]:
        one = Engine(model, tokenizer, device, budget=10**6, window=512)
        sequence = Sequence_(0, prompt, Options(max_new_tokens=new))
        one.add(sequence)
        one.run()
        alone.append(sequence.tokens)
    every = [*sequences, *late]
    return {
        "equal": sum(s.tokens == a for s, a in zip(every, alone, strict=True)),
        "calls": len(every),
        "chunked_steps": chunked_steps,
        "every_row_decoded": every_row_decoded,
    }


def graphs_on(arg: str) -> dict[str, Any]:
    """On local device `arg`: 16 greedy calls joining and leaving a batch whose decode steps
    replay CUDA graphs (the default on CUDA), against the same calls without graphs; report
    how many agree, the largest difference of any step's logits, the graphs recorded and
    replayed, and a lone row's decode step p50 each way after its warm-up (float32)."""
    import time

    from tests.logits import recorded_logits
    from tests.paces import Fixed
    from worker.generation.engine import Engine, Options, Sequence_

    model, tokenizer, device = _small_gpt(arg)
    calls = _random_calls(2, 16, longest=300, most_new=150)

    def run(graphs: bool | None) -> tuple[list[list[int]], list[torch.Tensor], Engine]:
        with recorded_logits() as seen:
            # a fixed pace: both runs prefill alike, so their steps pair up
            engine = Engine(
                model, tokenizer, device, budget=10**6, window=512, graphs=graphs,
                pace=Fixed(64),
            )  # fmt: skip
            sequences = [
                Sequence_(i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(calls)
            ]
            for index, sequence in enumerate(sequences):
                engine.add(sequence)
                if index % 4 == 3:
                    engine.step()
            engine.run()
        return [s.tokens for s in sequences], seen, engine

    def lone_step_ms(graphs: bool | None) -> float:
        engine = Engine(model, tokenizer, device, budget=10**6, window=512, graphs=graphs)
        engine.add(Sequence_(0, calls[0][0], Options(max_new_tokens=120)))
        times = []
        while engine.busy:
            began = time.perf_counter()
            engine.step()
            torch.cuda.synchronize(device)
            times.append((time.perf_counter() - began) * 1000)
        steady = sorted(times[20:])  # past the prefill and the first buckets' recording
        return round(steady[len(steady) // 2], 3)

    graphed, graphed_logits, engine = run(None)
    eager, eager_logits, _ = run(False)
    kept = engine._graphs
    pairs = list(zip(graphed_logits, eager_logits, strict=False))
    same_steps = len(graphed_logits) == len(eager_logits) and all(
        a.shape == b.shape for a, b in pairs
    )
    return {
        "equal": sum(a == b for a, b in zip(graphed, eager, strict=True)),
        "calls": len(calls),
        "logits_max_diff": (
            max(float((a - b).abs().max()) for a, b in pairs) if same_steps else None
        ),
        "graphs_on": kept is not None,
        "recorded": kept.recorded if kept is not None else 0,
        "replayed": kept.replayed if kept is not None else 0,
        "lone_step_ms_graphs": lone_step_ms(None),
        "lone_step_ms_eager": lone_step_ms(False),
    }


def graphs_fail_on(arg: str) -> dict[str, Any]:
    """On local device `arg`: the small GPT with a forward hook that reads a value back to
    the host (as a model with dynamic rotary scaling does), so recording its decode steps
    fails; 6 greedy calls with graphs on (the default on CUDA) against the same calls
    without. Report how many agree, whether the engine stopped recording, and whether the
    stepping thread's stream is its default one again afterwards (float32)."""

    from worker.generation.engine import Engine, Options, Sequence_

    model, tokenizer, device = _small_gpt(arg)

    def read_back(_module: Any, _args: Any, output: torch.Tensor) -> None:
        float(output.sum())  # a host read inside a CUDA graph's capture invalidates it

    model.transformer.h[0].register_forward_hook(read_back)  # returns None: output kept
    calls = _random_calls(3, 6, longest=100, most_new=40)

    def run(graphs: bool | None) -> tuple[list[list[int]], Engine]:
        engine = Engine(model, tokenizer, device, budget=10**6, window=512, graphs=graphs)
        sequences = [Sequence_(i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(calls)]
        for sequence in sequences:
            engine.add(sequence)
        engine.run()
        return [s.tokens for s in sequences], engine

    tried, engine = run(None)
    kept = engine.kv.graphs if engine.kv is not None else None
    on_default = torch.cuda.current_stream(device) == torch.cuda.default_stream(device)
    eager, _ = run(False)
    return {
        "equal": sum(a == b for a, b in zip(tried, eager, strict=True)),
        "calls": len(calls),
        "recording_failed": kept is not None and kept.failed,
        "stream_is_default_after": bool(on_default),
    }


PROBES: dict[str, Callable[[str], dict[str, Any]]] = {
    "graphs_on": graphs_on,
    "graphs_fail_on": graphs_fail_on,
    "generate_on": generate_on,
    "chunked_on": chunked_on,
    "fraction_cap": fraction_cap,
    "fill_to_cap": fill_to_cap,
    "load_on": load_on,
    "offload_restore": offload_restore,
    "read_vs_transformers": read_vs_transformers,
    "cross_worker_read": cross_worker_read,
    "read_warm_copy": read_warm_copy,
}

if __name__ == "__main__":
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    name, arg = sys.argv[1], (sys.argv[2] if len(sys.argv) > 2 else "0")
    print(json.dumps(PROBES[name](arg)))
