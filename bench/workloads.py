"""The generating workloads `bench.generation` and `bench.kv` share: the CPU bench model's
shape, and calls drawn from the Azure LLM inference trace (see `bench.generation`)."""

from __future__ import annotations

import csv
import random
from pathlib import Path

from bench.harness import REPO

TRACE = REPO.parent / "shared" / "data" / "AzureLLMInferenceTrace_conv.csv"
MODEL = "bench-gpt"  # the generation benchmarks' catalog name for their model
WINDOW = 1024
CPU_CONFIG = {"model_type": "gpt2", "n_layer": 4, "n_head": 4, "n_embd": 256}
ALPHABET = "abcdefghijklmnopqrstuvwxyz      "


def workload(
    count: int, seed: int, shape: str = "trace", trace: Path = TRACE
) -> list[tuple[str, int]]:
    """`count` (prompt, new tokens) pairs: trace rows scaled to the window (see the module),
    or with `shape` "short", prompts of 16 to 64 tokens and 128 new tokens each."""
    if shape == "short":
        rng = random.Random(seed)
        lengths = [rng.randint(16, 64) for _ in range(count)]
        return [("".join(rng.choice(ALPHABET) for _ in range(n - 1)), 128) for n in lengths]
    with trace.open() as handle:
        rows = [
            (int(r["ContextTokens"]), int(r["GeneratedTokens"])) for r in csv.DictReader(handle)
        ]
    rng = random.Random(seed)
    drawn = rng.sample(rows, count)
    # One left-padded batch (b) holds the longest prompt and the longest output at once;
    # the BOS token takes one position more.
    factor = (WINDOW - 2) / (max(c for c, _ in drawn) + max(g for _, g in drawn))
    calls = []
    for context, generated in drawn:
        prompt_tokens = max(1, int(context * factor))
        new = max(1, int(generated * factor))
        prompt = "".join(rng.choice(ALPHABET) for _ in range(prompt_tokens - 1))
        calls.append((prompt or "a", new))
    return calls


def respelled(calls: list[tuple[str, int]], seed: int) -> list[tuple[str, int]]:
    """The same calls' shape in new text: each prompt as long, each asking as many tokens.
    A fleet's replica keeps the blocks of prompts it has seen (its prefix cache), so a
    phase that sent the same prompts again would skip most of their prefill: each phase of
    a bench that sends calls to one fleet draws its own text (on the CPU model's tokenizer,
    a byte a token, the token counts are the same too; on GPT-2's, with `--gpu`, they may
    differ a little)."""
    rng = random.Random(f"respelled-{seed}")
    return [("".join(rng.choice(ALPHABET) for _ in prompt) or "a", new) for prompt, new in calls]
