"""Text generation through the fleet, 32 callers at once, against the fleet's own engine
alone and the library, all run here on the same calls.

    python -m bench.generation [--callers 32] [--shape trace|short] [--gpu] [--seed 0]

Prints one JSON object. It starts a fleet (`tasks.operator.launcher`: an embedded Redis
unless GPUFLEET_REDIS_URL is set, a router and one GPU worker on a simulated 4 GiB GPU,
or on the real GPU with `--gpu`) whose catalog holds one synthetic GPT-2-shaped model:
4 layers, 256 wide, a 2,048-token vocabulary on the CPU; GPT-2 small (12 layers, 768
wide, 50,257 tokens, bfloat16) with `--gpu`. Both hold 1,024 positions.

The calls: `--callers` rows drawn (seeded) from the Azure LLM inference trace
(`../shared/data/AzureLLMInferenceTrace_conv.csv`, ContextTokens and GeneratedTokens),
scaled by one factor so that the longest prompt and the longest output together fill the
window (so that (b) runs them as one batch); `--shape short` draws 16 to 64 prompt tokens
and asks for 128 new tokens instead, the shape of issue 40's GPU table; each prompt is
that many tokens of seeded text (the synthetic tokenizer takes one byte per token), each
call asks for its GeneratedTokens, greedy. The plain clients send these calls; every other
phase through the fleet sends the same lengths in text of its own (`respelled`), or it
would find the earlier phases' prompts in the replica's prefix cache and skip most of
their prefill (before 2026-12-02 the project client's and the streamed phase's did).

Figures, all measured in this run (clients run on this machine, as a user's would, and
their CPU counts):
- `engine_alone`: the fleet's own engine in this process, every call added at once and
  stepped to the end (`bench.engine.alone`): the fleet's ceiling (at libgomp's own
  barrier spin, where it runs faster than at the fleet's: `_at_libgomps_spin`);
- `plain_clients`: every call at once from `--processes` plain Celery clients configured
  by what `gpufleet url --json` prints, through the router as a caller's URL goes
  (`bench.generation_clients`); tokens per second from their release to the last answer;
- `fleet`: every call at once through the project's client (the fast path to the worker);
- `one_at_a_time` (a): the same calls through the same fleet one after another, which is
  what gpufleet did before continuous batching;
- `library_batch` (b): transformers' `generate` on one left-padded batch of every call
  (`bench.library`); `library_continuous` (c), with `--gpu` only: transformers' own
  continuous batching;
- `vs_*`: the plain clients' tokens per second over each of the others';
- `ttft_split_p50_ms`: the plain clients' calls' time to first token in parts, each a p50:
  `client_send` (the client's `send_task`), `queue` (from the send to the worker process
  that runs the engine: the router's hop, the worker's hand-over, `batch_wait` among
  them), `join` (from there to the engine's next step), `admission` (to the step that
  begins its prefill: other calls' prompts ahead of it), `first_token` (from that step to
  its first token); `join_p99_ms` against `inter_token_p50_ms`, the calls' mean gap
  between tokens (a decode step under that load);
- `inter_token_vs_engine_alone`: that gap over the engine alone's
  (`engine_alone.inter_token_p50_ms`): above 1, the fleet's decode steps themselves are
  slower (the worker's process and the machine it shares), not only the time around them
  (sending, routing, handing over, calls arriving in waves); docs/benchmarks.md splits
  the plain clients' shortfall so;
- `ttft_p50_ms`: the same calls streamed, a thread each, spread over `--processes` client
  processes, each from its own send to its first text; `lone_ttft_ms`: one streamed call
  alone, the median of `--lone`, with the call of median prompt length; `ttft_ratio` their
  ratio;
- `decode_step`: one decode step of a lone sequence in the paged engine and in the
  left-padded one (`bench.engine.decode_steps`);
- `burst`: the running calls' inter-token p99 while 16 prompts of 1,000 tokens arrive at
  once, in the engine alone (`bench.engine.burst`), against the same tokens' gaps in a run
  without the burst (`itl_ratio`) and against the steps before it (`itl_ratio_to_before`).
`--shape tight` and `--shape chat` run the paged KV cache against the left-padded one,
engine against engine in this process, instead (`bench.kv`).

Targets (issue 72): `vs_engine_alone` >= 0.85; `join_p99_ms` <= `inter_token_p50_ms` +
10; `burst.itl_ratio` <= 2; (issue 40) `vs_one_at_a_time` >= 3, `vs_library_batch` >= 0.8,
`ttft_ratio` <= 3. `outputs_equal_engine` and `outputs_equal_library` count calls whose
fleet tokens equal the engine's alone and the library's (greedy: all of them in float32; in
bfloat16 a batch's different arithmetic changes some); `streams_join_into_answers` the
streamed calls whose pieces joined equal their own answer.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench.harness import exit_on_sigterm, percentile
from bench.workloads import CPU_CONFIG, MODEL, TRACE, WINDOW, respelled, workload

log = logging.getLogger("bench.generation")

GPU_CONFIG = {"model_type": "gpt2", "n_layer": 12, "n_head": 12, "n_embd": 768}
CALL_TIMEOUT_S = 600.0
#: libgomp's barrier spin when GOMP_SPINCOUNT is unset (its documentation's default).
LIBGOMP_SPINS = "300000"
#: The caller's own GOMP_SPINCOUNT, read before anything imports `worker`, which sets
#: its own (`worker.OPENMP_SPINS`) in every process that imports it.
CALLERS_SPINS = os.environ.get("GOMP_SPINCOUNT")
#: Each phase's own text for the same calls (`respelled`): the fleet's prefix cache holds
#: what an earlier phase sent. The plain clients send `calls` themselves, whose outputs
#: are compared with the engine alone's and the library's.
WARM_TEXT, PROJECT_TEXT, STREAMED_TEXT, ONE_AT_A_TIME_TEXT, LONE_TEXTS = 1, 2, 3, 4, 100
TARGETS = {
    "vs_engine_alone": 0.85,
    "join_over_step_ms": 10.0,
    "burst_itl_ratio": 2.0,
    "vs_one_at_a_time": 3.0,
    "vs_library_batch": 0.8,
    "ttft_ratio": 3.0,
}


def catalog(gpu: bool) -> str:
    config = dict(GPU_CONFIG if gpu else CPU_CONFIG)
    config.update(vocab_size=50257 if gpu else 2048, n_positions=WINDOW)
    dtype = "bfloat16" if gpu else "float32"
    return (
        f"models:\n  {MODEL}:\n    source: synthetic\n    task: text-generation\n"
        f"    dtype: {dtype}\n    memory: 2GiB\n    config: {json.dumps(config)}\n"
        f"    kv_cache: {{tokens: {64 * WINDOW}}}\n"
    )


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
    """The p50 TTFT of `count` streamed calls of `prompt`'s length, each in its own text
    (`respelled`: none finds the one before it cached) and read to its end before the next
    is sent, so that none shares the replica with the one before it."""
    from tasks.api import generate

    times = []
    for turn in range(count):
        ((prompt, new),) = respelled([(prompt, new)], LONE_TEXTS + turn)
        start = time.perf_counter()
        first = 0.0
        for _piece in generate.stream(MODEL, prompt, max_new_tokens=new, timeout=CALL_TIMEOUT_S):
            first = first or (time.perf_counter() - start) * 1000
        if first:  # a call that streamed no text has no TTFT
            times.append(first)
    return percentile(times, 50) if times else float("nan")


def _tokens(answers: list[dict[str, Any]]) -> list[list[int]]:
    return [a["outputs"]["tokens"][0] for a in answers]


def _rate(answers: list[Any], seconds: float) -> float:
    return sum(len(t) for t in _tokens(answers)) / seconds


def _split(plain: dict[str, Any]) -> dict[str, Any]:
    """The plain clients' time to first token in its parts (see the module), p50s."""
    answers = [a for a in plain["answers"] if isinstance(a, dict)]
    timings = [a["timings_ms"] for a in answers]
    joins = [t.get("join", 0.0) for t in timings]
    waits = [t.get("prefill_wait", 0.0) for t in timings]
    parts = {
        "client_send": plain["send_ms"],
        "queue": [t["queue"] for t in timings],
        "batch_wait": [t["batch_wait"] for t in timings],
        "join": joins,
        "admission": [max(0.0, w - j) for w, j in zip(waits, joins, strict=True)],
        "first_token": [t["first_token"] - w for t, w in zip(timings, waits, strict=True)],
    }
    return {
        "ttft_split_p50_ms": {k: round(percentile(v, 50), 2) for k, v in parts.items()},
        "join_p99_ms": round(percentile(joins, 99), 2),
        "inter_token_p50_ms": round(percentile([t["inter_token"] for t in timings], 50), 2),
    }


def _same(a: list[list[int]], b: list[list[int]]) -> str:
    return f"{sum(x == y for x, y in zip(a, b, strict=True))}/{len(a)}"


@contextmanager
def _at_libgomps_spin() -> Iterator[None]:
    """Inside, this process's torch loads (it runs the baselines: the engine alone, the
    library) with libgomp's own barrier spin (`LIBGOMP_SPINS`), not the shorter one the
    `worker` package sets for the fleet's processes (`worker.OPENMP_SPINS`), which cost the
    engine alone about 6% on this machine: a baseline with its process to itself at its
    best. After it, the environment is the caller's, for the fleet's processes (which
    then set their own); a caller's own value stays for both (`CALLERS_SPINS`)."""
    os.environ["GOMP_SPINCOUNT"] = CALLERS_SPINS or LIBGOMP_SPINS
    try:
        yield
    finally:
        if CALLERS_SPINS is None:
            os.environ.pop("GOMP_SPINCOUNT", None)
        else:
            os.environ["GOMP_SPINCOUNT"] = CALLERS_SPINS


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
    from bench import engine, library
    from bench.fleet import bench_launcher, fleet_machine
    from bench.generation_clients import plain_clients, streamed_once
    from placement.catalog.catalog import Catalog
    from tasks.config import caller_conf

    sim = "" if gpu else "1x4GiB"
    text = catalog(gpu)
    fleet = bench_launcher(directory, text, "generation", sim, warm_cache="4GiB")
    calls = workload(callers, seed, shape, trace)
    spec = Catalog.load(directory / "models.yaml")[MODEL]
    median = sorted(calls, key=lambda c: len(c[0]))[len(calls) // 2]
    began = time.monotonic()
    with _at_libgomps_spin():
        alone_engine = engine.alone(calls, spec, gpu)
        decode = engine.decode_steps(spec, gpu, len(median[0]) + 1)
        burst = engine.burst(calls, spec, gpu)
        baseline = library.batch(calls, spec, gpu)
        continuous = library.continuous(calls, spec, gpu) if gpu else None
    log.info("baselines took %.1f s", time.monotonic() - began)
    try:
        fleet.start()
        fleet.wait_ready(300.0)
        one_at_a_time(respelled(calls[:2], WARM_TEXT))  # loads the model; warms the path
        log.info("fleet ready and warm at %.1f s", time.monotonic() - began)
        plain = plain_clients(calls, processes, caller_conf(fleet.caller_url))
        together = plain_at_once(respelled(calls, PROJECT_TEXT))
        streamed = streamed_once(respelled(calls, STREAMED_TEXT), processes)
        log.info("calls at once done at %.1f s", time.monotonic() - began)
        alone = one_at_a_time(respelled(calls, ONE_AT_A_TIME_TEXT))
        log.info("(a) done at %.1f s", time.monotonic() - began)
        ttft_alone = lone_ttft(median[0], median[1], lone)
    finally:
        fleet.stop()
    if plain["errors"]:
        raise RuntimeError(f"plain clients' calls failed: {plain['errors'][:3]}")
    rate = _rate(plain["answers"], plain["seconds"])
    project_rate = _rate(together["answers"], together["seconds"])
    alone_rate = _rate(alone["answers"], alone["seconds"])
    ttft = [t for t in streamed["ttft_ms"] if t]
    ttft_p50 = percentile(ttft, 50) if ttft else float("inf")
    fleet_tokens = _tokens(plain["answers"])
    streamed_equal = sum(streamed["joined_right"])
    engine_rate = alone_engine["tokens_per_s"]
    result = {
        "callers": callers,
        "caller_processes": max(1, processes),
        "shape": shape,
        "model": {"gpu": gpu, "window": WINDOW, **(GPU_CONFIG if gpu else CPU_CONFIG)},
        "prompt_tokens_mean": round(sum(len(p) + 1 for p, _ in calls) / len(calls), 1),
        "new_tokens_mean": round(sum(n for _, n in calls) / len(calls), 1),
        "engine_alone": {k: v for k, v in alone_engine.items() if k != "outputs"},
        "plain_clients": {
            "seconds": round(plain["seconds"], 3),
            "tokens": sum(len(t) for t in fleet_tokens),
            "tokens_per_s": round(rate, 1),
        },
        "fleet": {
            "seconds": round(together["seconds"], 3),
            "tokens_per_s": round(project_rate, 1),
        },
        "one_at_a_time": {
            "seconds": round(alone["seconds"], 3),
            "tokens_per_s": round(alone_rate, 1),
        },
        "library_batch": {k: v for k, v in baseline.items() if k != "outputs"},
        "library_continuous": continuous,
        "vs_engine_alone": round(rate / engine_rate, 3),
        "fleet_vs_engine_alone": round(project_rate / engine_rate, 3),
        "vs_one_at_a_time": round(rate / alone_rate, 3),
        "vs_library_batch": round(rate / baseline["tokens_per_s"], 3),
        "vs_library_continuous": (
            round(rate / continuous["tokens_per_s"], 3) if continuous else None
        ),
        **_split(plain),
        "streamed_seconds": round(streamed["seconds"], 3),
        "ttft_p50_ms": round(ttft_p50, 2),
        "ttft_p99_ms": round(percentile(ttft, 99), 2) if ttft else None,
        "lone_ttft_ms": round(ttft_alone, 2),
        "ttft_ratio": round(ttft_p50 / ttft_alone, 3),
        "decode_step": decode,
        "burst": burst,
        "outputs_equal_engine": _same(fleet_tokens, alone_engine["outputs"]),
        "outputs_equal_library": _same(fleet_tokens, baseline["outputs"]),
        "streams_join_into_answers": f"{streamed_equal}/{callers}",
        "errors": streamed["errors"],
        "targets": TARGETS,
        "machine": fleet_machine(sim),
    }
    alone_gap = alone_engine["inter_token_p50_ms"]
    result["inter_token_vs_engine_alone"] = (
        round(result["inter_token_p50_ms"] / alone_gap, 3) if alone_gap else None
    )
    result["meets_targets"] = (
        result["vs_engine_alone"] >= TARGETS["vs_engine_alone"]
        and result["join_p99_ms"] <= result["inter_token_p50_ms"] + TARGETS["join_over_step_ms"]
        and burst["itl_ratio"] <= TARGETS["burst_itl_ratio"]
        and result["vs_one_at_a_time"] >= TARGETS["vs_one_at_a_time"]
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
