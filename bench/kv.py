"""The paged KV cache against the left-padded batch, engine against engine, in one run.

    python -m bench.generation --shape tight [--callers 32] [--seed 0]
    python -m bench.generation --shape chat [--callers 32] [--seed 0]

Both shapes run one replica's engine (`worker.generation.engine`) in this process, on the
CPU bench model of `bench.generation` (a synthetic GPT-2: 4 layers, 256 wide, float32), as
the paged engine the fleet runs now and as the left-padded engine it ran before (its
`paged_cache=False`), with the same model, prompts and budget; greedy.

- `tight`: `--callers` calls of the Azure trace's shape (`bench.workloads.workload`),
  all added at once, with a KV budget of a quarter of their reaches added up (each call's
  prompt and new tokens). Tokens per second from the first step to the last, the mean
  number of rows a decode step ran, and the paged engine's preemptions.
- `chat`: a 1,000-token system prompt (seeded text) before each call's own user turn, the
  turns' lengths and outputs drawn from the trace's rows and scaled so that the longest
  turn and the longest output are 128 tokens each (short turns), on a model of 2,048
  positions. One call with the system prompt runs first, untimed (a chat service's system
  prompt is in its cache after its first call); then every call is added at once. Time
  to first token (from the add) p50 and p99 and tokens per second, for the paged engine
  with prefix sharing, without it (`share=False`), and the left-padded engine.

Targets (issue 58): tight tokens/s >= 1.5x and mean rows per step >= 2x the left-padded
engine's; chat TTFT p50 <= 0.3x and tokens/s >= 2x the left-padded engine's (the same calls
without prefix reuse).
"""

from __future__ import annotations

import csv
import random
import time
from pathlib import Path
from typing import Any

from bench.harness import percentile
from bench.workloads import ALPHABET, CPU_CONFIG, WINDOW, workload

SYSTEM_TOKENS = 1000
TURN_TOKENS = 128  # the longest user turn and the longest output, after scaling
CHAT_WINDOW = 2048
TARGETS = {
    "tight_tokens_ratio": 1.5,
    "tight_rows_ratio": 2.0,
    "chat_ttft_ratio": 0.3,
    "chat_tokens_ratio": 2.0,
}


def _model(window: int) -> tuple[Any, Any]:
    from placement.catalog.catalog import Catalog
    from worker.weights.synthetic import build_synthetic

    config = {**CPU_CONFIG, "vocab_size": 2048, "n_positions": window}
    entry = {"source": "synthetic", "task": "text-generation", "memory": "2GiB"}
    spec = Catalog.from_mapping({"models": {"m": {**entry, "config": config}}})["m"]
    return build_synthetic(spec)


def _engine(model: tuple[Any, Any], budget: int, window: int, kind: str) -> Any:
    import torch

    from worker.generation.engine import Engine, eos_ids
    from worker.generation.kv.paged import Paged

    net, tokenizer = model
    kv = Paged.for_model(net, budget, share=kind == "paged") if kind != "padded" else None
    return Engine(
        net, tokenizer, torch.device("cpu"), budget=budget, window=window,
        eos=eos_ids(net, tokenizer), kv=kv, paged_cache=kind != "padded",
    )  # fmt: skip


def _ids(tokenizer: Any, text: str) -> list[int]:
    return [int(t) for t in tokenizer(text)["input_ids"].reshape(-1).tolist()]


def _run(engine: Any, calls: list[tuple[list[int], int]]) -> dict[str, Any]:
    """Every call added at once, stepped to the end: tokens/s, TTFT, rows per step."""
    from worker.generation.engine import Options, Sequence_

    sequences = [
        Sequence_(i, prompt, Options(max_new_tokens=new)) for i, (prompt, new) in enumerate(calls)
    ]
    start = time.monotonic()
    for sequence in sequences:
        engine.add(sequence)
    engine.run()
    seconds = time.monotonic() - start
    ttft = [((s.first_token or start) - start) * 1000 for s in sequences]
    tokens = sum(len(s.tokens) for s in sequences)
    return {
        "seconds": round(seconds, 3),
        "tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "ttft_p50_ms": round(percentile(ttft, 50), 1),
        "ttft_p99_ms": round(percentile(ttft, 99), 1),
        "rows_per_step": round(engine.decoded_rows / max(1, engine.decode_steps), 2),
        "preemptions": engine.preemptions,
        "outputs": [s.tokens for s in sequences],
    }


def _equal(a: dict[str, Any], b: dict[str, Any]) -> str:
    same = sum(x == y for x, y in zip(a["outputs"], b["outputs"], strict=True))
    return f"{same}/{len(a['outputs'])}"


def _public(run: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in run.items() if k != "outputs"}


def tight(callers: int, seed: int, trace: Path) -> dict[str, Any]:
    """The trace's shape within a quarter of its calls' reach (the module)."""
    model = _model(WINDOW)
    texts = workload(callers, seed, "trace", trace)
    calls = [(_ids(model[1], prompt), new) for prompt, new in texts]
    budget = sum(len(p) + n for p, n in calls) // 4
    runs = {kind: _run(_engine(model, budget, WINDOW, kind), calls) for kind in ("paged", "padded")}
    paged, padded = runs["paged"], runs["padded"]
    return {
        "shape": "tight",
        "callers": callers,
        "kv_budget_tokens": budget,
        "paged": _public(paged),
        "padded": _public(padded),
        "tokens_ratio": round(paged["tokens_per_s"] / padded["tokens_per_s"], 3),
        "rows_ratio": round(paged["rows_per_step"] / padded["rows_per_step"], 3),
        "outputs_equal": _equal(paged, padded),
    }


def chat_calls(
    count: int, seed: int, tokenizer: Any, trace: Path
) -> tuple[list[int], list[tuple[list[int], int]]]:
    """A system prompt of `SYSTEM_TOKENS` tokens, and `count` calls: it, then a user turn."""
    rng = random.Random(seed)
    with trace.open() as handle:
        rows = [
            (int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(handle)
        ]
    drawn = rng.sample(rows, count)
    turn_factor = TURN_TOKENS / max(c for c, _ in drawn)
    out_factor = TURN_TOKENS / max(g for _, g in drawn)
    system = _ids(tokenizer, "".join(rng.choice(ALPHABET) for _ in range(SYSTEM_TOKENS - 1)))
    calls = []
    for context, generated in drawn:
        turn = "".join(rng.choice(ALPHABET) for _ in range(max(1, int(context * turn_factor))))
        calls.append((system + _ids(tokenizer, turn)[1:], max(1, int(generated * out_factor))))
    return system, calls


def chat(callers: int, seed: int, trace: Path) -> dict[str, Any]:
    """Short turns after a shared system prompt (the module)."""
    model = _model(CHAT_WINDOW)
    system, calls = chat_calls(callers, seed, model[1], trace)
    budget = callers * CHAT_WINDOW  # room for every call at once: this shape is not tight
    runs = {}
    for kind in ("paged", "unshared", "padded"):
        engine = _engine(model, budget, CHAT_WINDOW, kind)
        _run(engine, [(system + calls[0][0][len(system) : len(system) + 4], 1)])  # untimed
        engine.decoded_rows = engine.decode_steps = engine.preemptions = 0
        runs[kind] = _run(engine, calls)
        if kind == "paged":
            assert engine.kv is not None
            runs[kind]["prefix_hit_rate"] = round(engine.kv.pool.hit_rate(), 3)
    paged, padded = runs["paged"], runs["padded"]
    return {
        "shape": "chat",
        "callers": callers,
        "system_tokens": len(system),
        "prompt_tokens_mean": round(sum(len(p) for p, _ in calls) / len(calls), 1),
        "new_tokens_mean": round(sum(n for _, n in calls) / len(calls), 1),
        "paged": _public(paged),
        "paged_unshared": _public(runs["unshared"]),
        "padded": _public(padded),
        "ttft_ratio": round(paged["ttft_p50_ms"] / padded["ttft_p50_ms"], 3),
        "tokens_ratio": round(paged["tokens_per_s"] / padded["tokens_per_s"], 3),
        "outputs_equal": _equal(paged, padded),
    }


def run(shape: str, callers: int, seed: int, trace: Path) -> dict[str, Any]:
    """One of the two shapes, with its targets and this machine."""
    from bench.fleet import fleet_machine

    if shape == "tight":
        result = tight(callers, seed, trace)
        met = (
            result["tokens_ratio"] >= TARGETS["tight_tokens_ratio"]
            and result["rows_ratio"] >= TARGETS["tight_rows_ratio"]
        )
    else:
        result = chat(callers, seed, trace)
        met = (
            result["ttft_ratio"] <= TARGETS["chat_ttft_ratio"]
            and result["tokens_ratio"] >= TARGETS["chat_tokens_ratio"]
        )
    return {**result, "targets": TARGETS, "meets_targets": met, "machine": fleet_machine("")}
