"""Text generation through the fleet, 32 callers at once, against two baselines run here.

    python -m bench.generation [--callers 32] [--gpu] [--seed 0]

Prints one JSON object. It starts a fleet (`tasks.operator.launcher`: an embedded Redis
unless GPUFLEET_REDIS_URL is set, a router and one GPU worker on a simulated 4 GiB GPU,
or on the real GPU with `--gpu`) whose catalog holds one synthetic GPT-2-shaped model:
4 layers, 256 wide, a 2,048-token vocabulary on the CPU; GPT-2 small (12 layers, 768
wide, 50,257 tokens, bfloat16) with `--gpu`. Both hold 1,024 positions.

The calls: `--callers` rows drawn (seeded) from the Azure LLM inference trace
(`../shared/data/AzureLLMInferenceTrace_conv.csv`, ContextTokens and GeneratedTokens),
scaled by one factor so that the longest prompt and the longest output together fill the
window (so that (b) runs them as one batch); `--shape short` draws 16 to 64 prompt tokens
and asks for 128 new tokens instead, the shape of issue 40's GPU table; each prompt is that many
tokens of seeded text (the synthetic tokenizer takes one byte per token), each call asks
for its GeneratedTokens, greedy.

Figures, all measured in this run:
- `fleet`: every call sent at once through the project's client, tokens per second from
  the first send to the last answer; then the same calls streamed, each by its own thread
  in one of `--processes` client processes (separate clients, as callers are; by default
  half the machine's cores, so 1 on a 2-core machine, the rest left to the fleet), and
  each call's time to its first streamed text (TTFT);
- `one_at_a_time` (a): the same calls through the same fleet one after another, which is
  what gpufleet did before continuous batching (one generating call per replica);
- `library_batch` (b): transformers' `generate` on the same model and prompts in this
  process, one left-padded batch of all calls, on the same device; each call's tokens
  are counted up to its own GeneratedTokens (and EOS), as a server using it would return;
- `library_continuous` (c), with `--gpu` only: transformers' own continuous batching (the
  manager `generate_batch` runs: paged cache, its default configuration) on the same model
  and prompts, each call with its own length, started and warmed before the clock starts;
- `served_ttft_p50_ms`: the same seen from the fleet in the plain run (the call's queue,
  which holds its wait at the worker for the job to take it, and the engine's time to its
  first token), without the client threads' share of this machine's CPUs;
  `served_parts_p50_ms` gives each part's p50 (`batch_wait` is part of `queue`);
- `lone_ttft_ms`: one streamed call alone on the fleet, the median of `--lone` calls,
  with the drawn call of median prompt length, each read to its end before the next.
`--shape tight` and `--shape chat` run the paged KV cache against the left-padded one,
engine against engine in this process, instead (`bench.kv`).

Targets: `vs_one_at_a_time` >= 3 and `vs_library_batch` >= 0.8, `ttft_ratio` (fleet
TTFT p50 / lone TTFT p50) <= 3. `outputs_equal` counts calls whose fleet tokens equal
the library's (greedy: all of them in float32; in bfloat16 a batch's different arithmetic
changes some), `streams_join_into_answers` the streamed calls whose pieces joined equal
their own answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import multiprocessing
import os
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import exit_on_sigterm, percentile
from bench.workloads import CPU_CONFIG, TRACE, WINDOW, workload

log = logging.getLogger("bench.generation")

MODEL = "bench-gpt"
GPU_CONFIG = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}
CALL_TIMEOUT_S = 600.0
TARGETS = {"vs_one_at_a_time": 3.0, "vs_library_batch": 0.8, "ttft_ratio": 3.0}


def catalog(gpu: bool) -> str:
    config = dict(GPU_CONFIG if gpu else CPU_CONFIG)
    config.update(vocab_size=50257 if gpu else 2048, n_positions=WINDOW)
    dtype = "bfloat16" if gpu else "float32"
    return (
        f"models:\n  {MODEL}:\n    source: synthetic\n    task: text-generation\n"
        f"    dtype: {dtype}\n    memory: 2GiB\n    config: {json.dumps(config)}\n"
        f"    kv_cache: {{tokens: {64 * WINDOW}}}\n"
    )


def library_batch(calls: list[tuple[str, int]], spec: Any, gpu: bool) -> dict[str, Any]:
    """(b): `generate` on one left-padded batch of every call, in this process."""
    import torch

    from worker.synthetic import build_synthetic

    model, tokenizer = build_synthetic(spec)
    device = torch.device("cuda:0" if gpu else "cpu")
    model = model.to(device)
    encoded = tokenizer([p for p, _ in calls], padding=True, padding_side="left")
    ids, mask = encoded["input_ids"].to(device), encoded["attention_mask"].to(device)
    longest = max(n for _, n in calls)
    eos = tokenizer.eos_token_id
    best = None
    tokens: list[list[int]] = []
    for _ in range(2):  # the first warms up allocators and kernels
        if gpu:
            torch.cuda.synchronize()
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids, attention_mask=mask, max_new_tokens=longest, do_sample=False,
                pad_token_id=tokenizer.pad_token_id, eos_token_id=eos,
            )  # fmt: skip
        if gpu:
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
        best = seconds if best is None else min(best, seconds)
        rows = out[:, ids.shape[1] :].cpu().tolist()
        tokens = [_cut(row[:n], eos) for row, (_, n) in zip(rows, calls, strict=True)]
    count = sum(len(t) for t in tokens)
    assert best is not None
    return {
        "seconds": round(best, 3),
        "tokens": count,
        "tokens_per_s": round(count / best, 1),
        "outputs": tokens,
    }


def library_continuous(calls: list[tuple[str, int]], spec: Any, gpu: bool) -> dict[str, Any]:
    """(c): transformers' own continuous batching (the manager `generate_batch` runs, with
    its paged cache and default configuration) on the same model and prompts, each call
    added with its own `max_new_tokens`; the manager started and warmed up before the clock
    starts, as a server's would be; the better of two runs."""
    import torch
    from transformers import GenerationConfig

    from worker.synthetic import build_synthetic

    model, tokenizer = build_synthetic(spec)
    device = torch.device("cuda:0" if gpu else "cpu")
    model = model.to(device)
    encoded = tokenizer([p for p, _ in calls], padding=True, padding_side="left")
    prompts = [  # each prompt's own tokens, without the batch's padding
        row[mask.bool()].tolist()
        for row, mask in zip(encoded["input_ids"], encoded["attention_mask"], strict=True)
    ]
    config = GenerationConfig(
        do_sample=False, max_new_tokens=max(n for _, n in calls),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
    )  # fmt: skip
    best = None
    tokens: list[list[int]] = []
    with model.continuous_batching_context_manager(generation_config=config) as manager:
        for _ in range(2):
            start = time.perf_counter()
            requests = [
                manager.add_request(prompt, max_new_tokens=n)
                for prompt, (_, n) in zip(prompts, calls, strict=True)
            ]
            results: dict[str, Any] = {}
            while len(results) < len(requests):
                out = manager.get_result(timeout=CALL_TIMEOUT_S)
                if out is None:
                    raise RuntimeError(
                        f"transformers' continuous batching stopped: "
                        f"{manager.background_thread_status.fatal_error!r}"
                    )
                if out.is_finished():
                    results[out.request_id] = out
            if gpu:
                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            best = seconds if best is None else min(best, seconds)
            tokens = [list(results[r].generated_tokens) for r in requests]
    del model, manager
    if gpu:
        torch.cuda.empty_cache()
    count = sum(len(t) for t in tokens)
    assert best is not None
    return {"seconds": round(best, 3), "tokens": count, "tokens_per_s": round(count / best, 1)}


def _cut(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def _stream_one(prompt: str, new: int, go: threading.Barrier) -> tuple[float, bool, str]:
    """One streamed call, sent once `go` opens: its TTFT (ms, from its own send), whether
    its pieces joined equal its answer, and its error ("" when none)."""
    from tasks.api import infer  # imported by `_call_threads` before any thread starts
    from tasks.app import app
    from tasks.serving import streams

    go.wait(timeout=CALL_TIMEOUT_S)
    start = time.perf_counter()
    ttft = 0.0
    try:
        call = infer.apply_async((MODEL, prompt, {"max_new_tokens": new, "stream": True}))
        pieces = []
        for _, piece in streams.read(app.backend.client, call.id, call.ready, CALL_TIMEOUT_S):
            if not ttft:
                ttft = (time.perf_counter() - start) * 1000
            pieces.append(piece)
        answer = call.get(timeout=CALL_TIMEOUT_S)
        return ttft, "".join(pieces) == answer["outputs"]["texts"][0], ""
    except Exception as exc:
        return ttft, False, f"{type(exc).__name__}: {exc}"[:200]


def _call_threads(
    calls: list[tuple[str, int]], indices: list[int], before: Callable[[], object]
) -> tuple[list[tuple[int, float, bool, str]], float]:
    """A thread per call of `indices`, all sent at once after `before()` returns: each
    one's (index, TTFT, joined right, error), and when they were let go."""
    import tasks.api  # noqa: F401 - before the threads: none may still be importing at `go`

    go = threading.Barrier(len(indices) + 1)
    done: list[tuple[int, float, bool, str]] = []

    def caller(index: int) -> None:
        done.append((index, *_stream_one(*calls[index], go)))

    threads = [threading.Thread(target=caller, args=(i,)) for i in indices]
    for thread in threads:
        thread.start()
    before()
    go.wait(timeout=CALL_TIMEOUT_S)
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return done, start


def _callers(calls: list[tuple[str, int]], indices: list[int], ready: Any, out: Any) -> None:
    """A caller process (`streamed_once`): its calls sent once every process is `ready`;
    puts each one's (index, TTFT, joined right, error) on `out`. One short call first
    opens its connections (broker, results, registry), as the parent's are open already."""
    from tasks.api import infer

    infer.delay(MODEL, "warm", {"max_new_tokens": 1}).get(timeout=CALL_TIMEOUT_S)
    done, _ = _call_threads(calls, indices, lambda: ready.wait(timeout=CALL_TIMEOUT_S))
    for row in done:
        out.put(row)


def streamed_once(calls: list[tuple[str, int]], processes: int) -> dict[str, Any]:
    """Every call at once, streamed (through the project's client and Redis), timed: each
    call's time to its first text, and whether its pieces join into its own answer. The
    callers are threads of `processes` client processes (started first, then released
    together), as separate clients are: 32 threads of one process wait for one another's
    interpreter lock, which a fleet's TTFT should not count. With 1, threads of this one."""
    ttft = [0.0] * len(calls)
    joined_right = [False] * len(calls)
    errors: list[str] = []
    if processes <= 1:
        results, start = _call_threads(calls, list(range(len(calls))), lambda: None)
    else:
        spawn = multiprocessing.get_context("spawn")  # a fresh client, not a fork of this one
        ready, out = spawn.Barrier(processes + 1), spawn.Queue()
        workers = [
            spawn.Process(
                target=_callers, args=(calls, list(range(p, len(calls), processes)), ready, out)
            )
            for p in range(processes)
        ]
        try:
            for worker in workers:
                worker.start()
            ready.wait(timeout=CALL_TIMEOUT_S)
            start = time.perf_counter()
            results = [out.get(timeout=CALL_TIMEOUT_S) for _ in calls]
        finally:
            for worker in workers:
                worker.join(timeout=CALL_TIMEOUT_S)
                if worker.is_alive():
                    worker.terminate()
    seconds = time.perf_counter() - start
    for index, first, joined, error in results:
        ttft[index], joined_right[index] = first, joined
        if error:
            errors.append(error)
    return {"seconds": seconds, "ttft_ms": ttft, "joined_right": joined_right, "errors": errors}


def plain_at_once(calls: list[tuple[str, int]]) -> dict[str, Any]:
    """Every call at once through the project's client, not streamed: the tokens."""
    from tasks.api import infer

    start = time.perf_counter()
    handles = [infer.delay(MODEL, p, {"max_new_tokens": n}) for p, n in calls]
    answers = [h.get(timeout=CALL_TIMEOUT_S) for h in handles]
    seconds = time.perf_counter() - start
    return {"seconds": seconds, "answers": answers}


def one_at_a_time(calls: list[tuple[str, int]]) -> dict[str, Any]:
    """(a): the same calls through the fleet, one after another."""
    from tasks.api import infer

    start = time.perf_counter()
    answers = [
        infer.delay(MODEL, p, {"max_new_tokens": n}).get(timeout=CALL_TIMEOUT_S) for p, n in calls
    ]
    return {"seconds": time.perf_counter() - start, "answers": answers}


def lone_ttft(prompt: str, new: int, count: int) -> float:
    """The p50 TTFT of `count` streamed calls, each read to its end before the next is
    sent, so that none shares the replica with the one before it."""
    from tasks.api import generate

    times = []
    for _ in range(count):
        start = time.perf_counter()
        first = 0.0
        for _piece in generate.stream(MODEL, prompt, max_new_tokens=new, timeout=CALL_TIMEOUT_S):
            first = first or (time.perf_counter() - start) * 1000
        if first:  # a call that streamed no text has no TTFT
            times.append(first)
    return percentile(times, 50) if times else float("nan")


def _tokens(answers: list[dict[str, Any]]) -> list[list[int]]:
    return [a["outputs"]["tokens"][0] for a in answers]


def run(  # noqa: PLR0917 - the command line's options
    callers: int,
    gpu: bool,
    seed: int,
    lone: int,
    shape: str,
    trace: Path,
    directory: Path,
    processes: int,
) -> dict[str, Any]:
    from bench.fleet import bench_launcher, fleet_machine
    from placement.catalog.catalog import Catalog

    sim = "" if gpu else "1x4GiB"
    text = catalog(gpu)
    fleet = bench_launcher(directory, text, "generation", sim, warm_cache="4GiB")
    calls = workload(callers, seed, shape, trace)
    spec = Catalog.load(directory / "models.yaml")[MODEL]
    began = time.monotonic()
    baseline = library_batch(calls, spec, gpu)
    log.info("(b) took %.1f s", time.monotonic() - began)
    continuous = library_continuous(calls, spec, gpu) if gpu else None
    log.info("starting the fleet at %.1f s", time.monotonic() - began)
    try:
        fleet.start()
        fleet.wait_ready(300.0)
        one_at_a_time(calls[:2])  # loads the model; warms the path
        log.info("fleet ready and warm at %.1f s", time.monotonic() - began)
        together = plain_at_once(calls)
        streamed = streamed_once(calls, processes)
        log.info("calls at once done at %.1f s", time.monotonic() - began)
        alone = one_at_a_time(calls)
        log.info("(a) done at %.1f s", time.monotonic() - began)
        median = sorted(calls, key=lambda c: len(c[0]))[len(calls) // 2]
        ttft_alone = lone_ttft(median[0], median[1], lone)
    finally:
        fleet.stop()
    fleet_tokens = _tokens(together["answers"])
    count = sum(len(t) for t in fleet_tokens)
    rate = count / together["seconds"]
    alone_rate = sum(len(t) for t in _tokens(alone["answers"])) / alone["seconds"]
    ttft = [t for t in streamed["ttft_ms"] if t]
    parts = ("queue", "batch_wait", "first_token")  # `queue` holds `batch_wait`
    served = [
        a["timings_ms"]["queue"] + a["timings_ms"]["first_token"] for a in together["answers"]
    ]
    ttft_p50 = percentile(ttft, 50) if ttft else float("inf")
    equal = sum(a == b for a, b in zip(fleet_tokens, baseline["outputs"], strict=True))
    streamed_equal = sum(streamed["joined_right"])
    result = {
        "callers": callers,
        "caller_processes": max(1, processes),
        "shape": shape,
        "model": {"gpu": gpu, "window": WINDOW, **(GPU_CONFIG if gpu else CPU_CONFIG)},
        "prompt_tokens_mean": round(sum(len(p) + 1 for p, _ in calls) / len(calls), 1),
        "new_tokens_mean": round(sum(n for _, n in calls) / len(calls), 1),
        "fleet": {
            "seconds": round(together["seconds"], 3),
            "tokens": count,
            "tokens_per_s": round(rate, 1),
        },
        "one_at_a_time": {
            "seconds": round(alone["seconds"], 3),
            "tokens_per_s": round(alone_rate, 1),
        },
        "library_batch": {k: v for k, v in baseline.items() if k != "outputs"},
        "vs_one_at_a_time": round(rate / alone_rate, 3),
        "vs_library_batch": round(rate / baseline["tokens_per_s"], 3),
        "library_continuous": continuous,
        "vs_library_continuous": (
            round(rate / continuous["tokens_per_s"], 3) if continuous else None
        ),
        "streamed_seconds": round(streamed["seconds"], 3),
        "ttft_p50_ms": round(ttft_p50, 2),
        "ttft_p99_ms": round(percentile(ttft, 99), 2) if ttft else None,
        "lone_ttft_ms": round(ttft_alone, 2),
        "served_ttft_p50_ms": round(percentile(served, 50), 2),
        "served_parts_p50_ms": {
            p: round(percentile([a["timings_ms"][p] for a in together["answers"]], 50), 2)
            for p in parts
        },
        "ttft_ratio": round(ttft_p50 / ttft_alone, 3),
        "outputs_equal": f"{equal}/{callers}",
        "streams_join_into_answers": f"{streamed_equal}/{callers}",
        "errors": streamed["errors"],
        "targets": TARGETS,
        "machine": fleet_machine(sim),
    }
    result["meets_targets"] = (
        result["vs_one_at_a_time"] >= TARGETS["vs_one_at_a_time"]
        and result["vs_library_batch"] >= TARGETS["vs_library_batch"]
        and result["ttft_ratio"] <= TARGETS["ttft_ratio"]
        and not streamed["errors"]
        and streamed_equal == callers
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--callers", type=int, default=32)
    parser.add_argument("--gpu", action="store_true", help="the fleet and (b) on cuda:0")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trace", type=Path, default=TRACE, help="the Azure trace's CSV")
    parser.add_argument("--lone", type=int, default=9, help="lone streamed calls for TTFT")
    parser.add_argument(
        "--processes", type=int, default=max(1, (os.cpu_count() or 2) // 2),
        help="client processes the streamed callers are spread over (1: threads of this one);"
        " half the machine's cores, the other half left to the fleet",
    )  # fmt: skip
    parser.add_argument(
        "--shape", choices=("trace", "short", "tight", "chat"), default="trace",
        help="trace lengths, or 16-64 prompt tokens x 128 new (issue 40's GPU table); tight"
        " and chat: the paged engine against the left-padded one (bench.kv)",
    )  # fmt: skip
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    if args.shape in ("tight", "chat"):
        from bench import kv

        print(json.dumps(kv.run(args.shape, args.callers, args.seed, args.trace), indent=2))
        return
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-generation-") as directory:
        result = run(
            args.callers, args.gpu, args.seed, args.lone, args.shape, args.trace,
            Path(directory), args.processes,
        )  # fmt: skip
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
