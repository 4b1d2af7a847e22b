"""Paged decode steps in fixed shapes (`worker.generation.graphs`): on a CPU the padded step a
CUDA graph would record runs as it is, and must make the tokens the unpadded step makes.
The recording itself runs only on CUDA (`tests/test_gpu.py`)."""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch

from placement.catalog.catalog import Catalog
from tests.paces import Fixed
from worker.generation.blocks import BLOCK_TOKENS
from worker.generation.engine import Engine, Options, Sequence_
from worker.generation.graphs import DecodeGraphs, Inputs, bucket
from worker.generation.paged import Paged
from worker.generation.sampling import Choice
from worker.weights.synthetic import build_synthetic

CPU = torch.device("cpu")
CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 512}


@pytest.fixture(scope="module")
def model() -> tuple[Any, Any]:
    entry = {"source": "synthetic", "task": "text-generation", "memory": "64MiB"}
    entry["config"] = {**CONFIG, "vocab_size": 512}
    return build_synthetic(Catalog.from_mapping({"models": {"gen": entry}})["gen"])


def _engine(
    model: tuple[Any, Any], *, graphs: bool, budget: int = 10**6, kv: Paged | None = None
) -> Engine:
    net, tokenizer = model
    # a fixed pace: the two engines compared prefill alike whatever the machine's speed
    return Engine(
        net, tokenizer, CPU, budget=budget, window=512, graphs=graphs, kv=kv, pace=Fixed(48)
    )


def _calls(seed: int, count: int = 20) -> list[tuple[list[int], Options]]:
    """Prompts of 3 to 200 tokens, greedy and seeded sampling among them."""
    rng = random.Random(seed)
    calls = []
    for index in range(count):
        prompt = [2, *(rng.randrange(5, 512) for _ in range(rng.randrange(3, 200)))]
        sampled = {"choice": Choice(temperature=0.8, top_p=0.9), "seed": index}
        options = Options(max_new_tokens=rng.randrange(4, 60), **(sampled if index % 3 else {}))
        calls.append((prompt, options))
    return calls


def _run_arriving(engine: Engine, calls: list[tuple[list[int], Options]]) -> list[Sequence_]:
    """Every call added a few at a time while the others run; their sequences, ended."""
    rng = random.Random(9)
    sequences: list[Sequence_] = []
    pending = list(enumerate(calls))
    while pending or engine.busy:
        for _ in range(rng.randrange(0, 4)):
            if pending:
                index, (prompt, options) = pending.pop(0)
                sequences.append(Sequence_(index, prompt, options))
                engine.add(sequences[-1])
        engine.step()
    return sequences


def test_decode_steps_padded_to_their_bucket_make_the_tokens_of_steps_in_their_own_shape(
    model: tuple[Any, Any],
) -> None:
    calls = _calls(seed=1)
    fixed = _engine(model, graphs=True)
    assert fixed._graphs is not None and not fixed._graphs.record  # a CPU runs them as they are
    padded = _run_arriving(fixed, calls)
    plain = _run_arriving(_engine(model, graphs=False), calls)
    assert [s.tokens for s in padded] == [s.tokens for s in plain]
    assert all(s.finish in ("length", "stop") for s in padded)
    shapes = set(fixed._graphs._buckets)
    assert len({rows for rows, _ in shapes}) >= 3  # rows came and went
    assert len({width for _, width in shapes}) >= 2  # the longest row grew past a power of two
    assert fixed.kv is not None and fixed.kv.pool.in_use == 0


def test_rows_preempted_for_blocks_resume_with_their_tokens_in_padded_steps(
    model: tuple[Any, Any],
) -> None:
    calls = _calls(seed=2, count=8)
    fixed = _engine(model, graphs=True, budget=40 * BLOCK_TOKENS)
    padded = _run_arriving(fixed, calls)
    plain = _run_arriving(_engine(model, graphs=False, budget=40 * BLOCK_TOKENS), calls)
    assert fixed.preemptions > 0
    assert [s.tokens for s in padded] == [s.tokens for s in plain]


def test_a_padded_row_reads_and_writes_only_the_null_block_s_last_slot() -> None:
    inputs = Inputs.empty(rows=4, width=8, device=CPU)
    wider = torch.arange(1, 33).view(4, 8)  # a step before, of every row and column
    scratch = BLOCK_TOKENS - 1
    inputs.fill(wider[:, :1], wider[:, :1], wider, torch.ones(4, 8), wider[:, -1], scratch)
    index = torch.tensor([[0, 0, 21, 22, 23], [31, 32, 33, 34, 35], [0, 0, 0, 41, 42]])
    mask = (index > 0).long()
    ids, positions = torch.tensor([[7], [8], [9]]), torch.tensor([[3], [5], [2]])
    slots = index[:, -1]
    inputs.fill(ids, positions, index, mask, slots, scratch)
    assert inputs.index[:3, 3:].tolist() == index.tolist()  # right-aligned
    assert not inputs.index[:3, :3].any()
    assert not inputs.mask[:3, 0, 0, :3].any()  # the columns added on the left are hidden
    assert inputs.mask[:3, 0, 0, 3:].long().tolist() == mask.tolist()
    assert inputs.index[3].tolist() == [0] * 7 + [scratch]
    assert inputs.mask[3, 0, 0].tolist() == [False] * 7 + [True]
    assert inputs.slots.tolist() == [23, 35, 42, scratch]
    assert inputs.ids[:, 0].tolist() == [7, 8, 9, 0] and inputs.positions[3, 0] == 0
    assert [bucket(n) for n in (1, 3, 4, 5, 33)] == [1, 4, 4, 8, 64]
    assert bucket(3, BLOCK_TOKENS) == BLOCK_TOKENS


def test_the_replica_s_next_engine_steps_in_the_buckets_its_last_one_made(
    model: tuple[Any, Any],
) -> None:
    calls = _calls(seed=3, count=6)
    first = _engine(model, graphs=True)
    _run_arriving(first, calls)
    assert first.kv is not None and first._graphs is first.kv.graphs
    made = dict(first.kv.graphs._buckets)  # type: ignore[union-attr]
    second = _engine(model, graphs=True, kv=first.kv)
    again = _run_arriving(second, calls)
    assert second._graphs is first._graphs
    assert second._graphs is not None and second._graphs.step == second._graph_step
    for shape, entry in made.items():  # the same calls take the same buckets, kept
        assert second._graphs._buckets[shape] is entry
    assert [s.tokens for s in again] == [s.tokens for s in _run_arriving(first, calls)]


def test_buckets_made_on_a_store_that_grew_since_are_dropped() -> None:
    ran: list[int] = []

    def step(inputs: Inputs) -> torch.Tensor:
        ran.append(inputs.ids.shape[0])
        return torch.zeros((inputs.ids.shape[0], 5))

    graphs = DecodeGraphs(step, CPU, BLOCK_TOKENS, rows=8, record=False)
    one = (torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([[17]]), torch.ones(1, 1))
    logits = graphs.run(*one, torch.tensor([17]), store=(1, 2))
    assert logits.shape == (1, 5) and ran == [1]
    kept = graphs._buckets[(1, BLOCK_TOKENS)]
    graphs.run(*one, torch.tensor([17]), store=(1, 2))
    assert graphs._buckets[(1, BLOCK_TOKENS)] is kept
    graphs.run(*one, torch.tensor([17]), store=(3, 4))  # the store's tensors moved
    assert graphs._buckets[(1, BLOCK_TOKENS)] is not kept


def test_a_decode_step_whose_recording_fails_runs_as_it_is_and_the_engine_stops_recording(
    model: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    calls = _calls(seed=4, count=6)
    engine = _engine(model, graphs=True)
    assert engine._graphs is not None
    engine._graphs.record = True  # a CPU has no CUDA graph to record: recording raises
    with caplog.at_level("WARNING", logger="worker.generation.graphs"):
        sequences = _run_arriving(engine, calls)
    assert engine._graphs is None
    assert engine.kv is not None and engine.kv.graphs is not None and engine.kv.graphs.failed
    assert "GPUFLEET_CUDA_GRAPHS=0" in caplog.text
    assert sum("CUDA graph failed" in r.getMessage() for r in caplog.records) == 1
    assert _engine(model, graphs=True, kv=engine.kv)._graphs is None  # the replica's next
    plain = _run_arriving(_engine(model, graphs=False), calls)
    assert [s.tokens for s in sequences] == [s.tokens for s in plain]
