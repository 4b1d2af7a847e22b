"""The fleet's own generation engine, alone in this process: what `bench.generation`
compares the fleet with.

- `alone`: the engine the fleet's worker builds for the bench model
  (`worker.generation.replica.replica_engine`, the same KV budget), every call added at
  once and stepped to the end, through the worker's own call driver
  (`worker.generation.serving.run_calls`: the same tokenization); the better of two runs,
  the first warming allocators and kernels. What the fleet would reach if calls cost
  nothing to send, route, hand over and answer.
- `decode_steps`: one decode step of a lone sequence, in the paged engine and in the
  left-padded one (`paged_cache=False`), the median of `STEPS` steps after its prefill: what
  a step costs beside the model's own pass.
- `burst`: the calls running, and `BURST_AFTER` steps after the last of their prompts is
  in, `BURST` new prompts of `BURST_TOKENS` tokens added at once: the running calls' gaps
  between tokens, p99, from the burst's arrival until every burst prompt has its first
  token (during), against **the same tokens' gaps in a run without the burst** (the
  issue's "its value without the burst": the calls' own contexts grow meanwhile, and a
  step of longer rows costs more with or without a burst) and, as before, against the
  `BURST_AFTER` steps before it arrived; and the burst prompts' time to first token.

Greedy throughout; `torch`'s threads as the process has them; decode steps from CUDA
graphs on a GPU unless `GPUFLEET_CUDA_GRAPHS=0`, as the fleet's workers.
"""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from bench.harness import percentile

STEPS = 32  # decode steps timed for `decode_steps`
BURST = 16  # prompts of a burst
BURST_TOKENS = 1000  # tokens each
BURST_NEW = 16  # tokens each burst prompt asks for (1,016 positions fit the window of 1,024)
BURST_AFTER = 20  # steps the calls decode, every prompt in, before the burst arrives


def _build(spec: Any, gpu: bool) -> tuple[Any, Any, Any]:
    import torch

    from worker.weights.synthetic import build_synthetic

    model, tokenizer = build_synthetic(spec)
    device = torch.device("cuda:0" if gpu else "cpu")
    return model.to(device), tokenizer, device


def _sync(device: Any) -> None:
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _graphs() -> bool | None:
    """The engines' CUDA graphs as the fleet's workers have them (`GPUFLEET_CUDA_GRAPHS`):
    None (on CUDA) unless turned off."""
    from placement.config import Settings

    return None if Settings.from_env().cuda_graphs else False


def alone(calls: list[tuple[str, int]], spec: Any, gpu: bool) -> dict[str, Any]:
    """(engine): every call added at once to a fresh engine, stepped to the end."""
    from worker.generation.replica import replica_engine
    from worker.generation.serving import GenCall, Generated, run_calls

    model, tokenizer, device = _build(spec, gpu)
    best: dict[str, Any] | None = None
    for _ in range(2):
        engine = replica_engine(model, tokenizer, spec, device, graphs=_graphs())
        gen = [GenCall(f"c{i}", p, {"max_new_tokens": n}) for i, (p, n) in enumerate(calls)]
        _sync(device)
        start = time.perf_counter()
        outcomes = run_calls(engine, gen, None)
        _sync(device)
        seconds = time.perf_counter() - start
        answers = [o for o in outcomes if isinstance(o, Generated)]
        if len(answers) != len(calls):
            failed = [o for o in outcomes if not isinstance(o, Generated)]
            raise RuntimeError(f"the engine failed {len(failed)} calls: {failed[:3]}")
        tokens = sum(a.tokens for a in answers)
        run = {
            "seconds": round(seconds, 3),
            "tokens": tokens,
            "tokens_per_s": round(tokens / seconds, 1),
            "ttft_p50_ms": round(percentile([a.first_token_ms for a in answers], 50), 2),
            "inter_token_p50_ms": round(percentile([a.inter_token_ms for a in answers], 50), 2),
            "outputs": [a.outputs["tokens"][0] for a in answers],
        }
        if best is None or run["seconds"] < best["seconds"]:
            best = run
    assert best is not None
    return best


def decode_steps(spec: Any, gpu: bool, prompt_tokens: int) -> dict[str, Any]:
    """A lone decode step's median milliseconds, paged and left-padded, and their ratio."""
    import torch

    from worker.generation.engine import Engine, Options, Sequence_
    from worker.passes import max_positions

    model, tokenizer, device = _build(spec, gpu)
    window = max_positions(model.config) or 1024
    budget = spec.kv_budget().tokens
    prompt = random.Random(0).choices(range(5, 200), k=prompt_tokens)
    found: dict[str, float] = {}
    for kind in ("paged", "padded"):
        engine = Engine(
            model, tokenizer, device, budget=budget, window=window,
            paged_cache=kind == "paged", graphs=_graphs(),
        )  # fmt: skip  # no EOS: the sequence runs every step
        engine.add(Sequence_(kind, prompt, Options(max_new_tokens=STEPS + 2)))
        engine.step()  # its prefill and a first decode step
        times = []
        for _ in range(STEPS):
            _sync(device)
            start = time.perf_counter()
            engine.step()
            _sync(device)
            times.append((time.perf_counter() - start) * 1000)
        found[kind] = statistics.median(times)
        del engine
        if gpu:
            torch.cuda.empty_cache()
    return {
        "paged_ms": round(found["paged"], 3),
        "padded_ms": round(found["padded"], 3),
        "paged_vs_padded": round(found["paged"] / found["padded"], 3),
    }


def burst(calls: list[tuple[str, int]], spec: Any, gpu: bool) -> dict[str, Any]:
    """The running calls' inter-token p99 while a burst of long prompts is prefilled,
    against the same tokens' gaps in a run without the burst, and against the gaps before
    it arrived."""
    built = _build(spec, gpu)  # one model for both runs
    without, _, _ = _stream_gaps(calls, spec, built, arrive=False)
    gaps, before, first = _stream_gaps(calls, spec, built, arrive=True)
    during = list(gaps.values())
    same = [without[token] for token in gaps if token in without]
    p99_during = percentile(during, 99) * 1000 if during else float("nan")
    p99_without = percentile(same, 99) * 1000 if same else float("nan")
    p99_before = percentile(before, 99) * 1000 if before else float("nan")
    return {
        "prompts": BURST,
        "prompt_tokens": BURST_TOKENS,
        "itl_p99_ms_without": round(p99_without, 2),
        "itl_p99_ms_before": round(p99_before, 2),
        "itl_p99_ms_during": round(p99_during, 2),
        "itl_ratio": round(p99_during / p99_without, 3),
        "itl_ratio_to_before": round(p99_during / p99_before, 3),
        "burst_ttft_p50_ms": round(percentile(first, 50), 1),
        "gaps_during": len(during),
    }


def _stream_gaps(
    calls: list[tuple[str, int]], spec: Any, built: tuple[Any, Any, Any], *, arrive: bool
) -> tuple[dict[tuple[Any, int], float], list[float], list[float]]:
    """One run of `burst`: the calls running and, `BURST_AFTER` steps after every prompt is
    in, the burst added (with `arrive`). Returns the running calls' gaps before each token
    made while the burst is prefilled (every token after the burst's step when there is no
    burst), by (call, token index); their gaps in the steps before it; and the burst
    prompts' times to first token (ms). `built`: the model, its tokenizer and device
    (`_build`)."""
    from worker.generation.engine import Options, Sequence_
    from worker.generation.replica import replica_engine

    model, tokenizer, device = built
    engine = replica_engine(model, tokenizer, spec, device, graphs=_graphs())
    vocab = int(model.get_output_embeddings().weight.shape[0])
    running = []
    for index, (prompt, new) in enumerate(calls):
        ids = [int(t) for t in tokenizer(prompt)["input_ids"].reshape(-1).tolist()]
        running.append(Sequence_(("call", index), ids, Options(max_new_tokens=new)))
        engine.add(running[-1])
    rng = random.Random(1)
    arrivals = [
        Sequence_(("burst", i), rng.choices(range(5, vocab), k=BURST_TOKENS),
                  Options(max_new_tokens=BURST_NEW))
        for i in range(BURST)
    ]  # fmt: skip
    last: dict[Any, tuple[int, float]] = {}
    gaps: dict[tuple[Any, int], float] = {}
    before: list[float] = []
    arrived = 0.0
    steady = -1  # steps since every call's prompt was in (-1: not yet)
    while engine.busy:
        if steady < 0 and not engine.waiting and all(s.first_token for s in running):
            steady = 0
        if steady == BURST_AFTER:
            arrived = time.monotonic()
            for sequence in arrivals if arrive else ():
                engine.add(sequence)
        engine.step()
        _sync(device)
        now = time.monotonic()
        bursting = arrived and (not arrive or any(s.first_token is None for s in arrivals))
        for sequence in running:
            made = len(sequence.tokens)
            seen = last.get(sequence.key)
            if seen is not None and made > seen[0] and not sequence.done:
                if bursting:
                    gaps[(sequence.key, made)] = now - seen[1]
                elif steady >= 0 and not arrived:
                    before.append(now - seen[1])
            if seen is None or made > seen[0]:
                last[sequence.key] = (made, now)
        if steady >= 0:
            steady += 1
        if arrived and not bursting:
            break
    first = [((s.first_token or arrived) - arrived) * 1000 for s in arrivals] if arrive else []
    return gaps, before, first


__all__ = ["alone", "burst", "decode_steps"]
