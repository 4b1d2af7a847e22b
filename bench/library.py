"""transformers' own generation on the fleet's bench model and calls: the library
baselines `bench.generation` compares the fleet with.

- `batch`: `generate` on one left-padded batch of every call, in this process, on the
  same device; each call's tokens are counted up to its own new tokens (and EOS), as a
  server using it would return;
- `continuous` (on a GPU): transformers' own continuous batching (the manager
  `generate_batch` runs: paged cache, its default configuration), each call with its own
  length, started and warmed before the clock starts.
"""

from __future__ import annotations

import time
from typing import Any

CALL_TIMEOUT_S = 600.0


def batch(calls: list[tuple[str, int]], spec: Any, gpu: bool) -> dict[str, Any]:
    """(b): `generate` on one left-padded batch of every call, in this process."""
    import torch

    from worker.weights.synthetic import build_synthetic

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


def continuous(calls: list[tuple[str, int]], spec: Any, gpu: bool) -> dict[str, Any]:
    """(c): transformers' own continuous batching (the manager `generate_batch` runs, with
    its paged cache and default configuration) on the same model and prompts, each call
    added with its own `max_new_tokens`; the manager started and warmed up before the clock
    starts, as a server's would be; the better of two runs."""
    import torch
    from transformers import GenerationConfig

    from worker.weights.synthetic import build_synthetic

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
