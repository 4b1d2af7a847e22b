"""The paged KV cache (`worker.generation.kv`: `blocks`, `paged`): outputs equal to
the left-padded batch's, prefixes shared, preemption when blocks run out, every block
given back, and decode steps in the fixed shapes a CUDA graph records
(`worker.generation.kv.graphs`: on a CPU the padded step runs as it is, and must make the
tokens the unpadded step makes; the recording itself runs only on CUDA, tests/test_gpu.py)."""

from __future__ import annotations

import gc
import random
import weakref
from collections import Counter
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from placement.catalog.catalog import Catalog
from tests.logits import recorded_logits
from tests.paces import Fixed, Unpaced
from worker.generation.engine import Engine, Options, Sequence_
from worker.generation.kv import paged
from worker.generation.kv.blocks import BLOCK_TOKENS, NULL_BLOCK, BlockPool, OutOfBlocks, Table
from worker.generation.kv.graphs import DecodeGraphs, Inputs, round_up
from worker.generation.sampling import Choice
from worker.generation.serving import GenCall, Generated, run_calls
from worker.weights.synthetic import build_synthetic

CPU = torch.device("cpu")
CONFIG = {"model_type": "gpt2", "n_layer": 2, "n_head": 2, "n_embd": 32, "n_positions": 512}


@pytest.fixture(scope="module")
def model() -> tuple[Any, Any]:
    entry = {"source": "synthetic", "task": "text-generation", "memory": "64MiB"}
    entry["config"] = {**CONFIG, "vocab_size": 512}
    return build_synthetic(Catalog.from_mapping({"models": {"gen": entry}})["gen"])


def _engine(model: tuple[Any, Any], budget: int = 10**6, *, paged: bool = True) -> Engine:
    net, tokenizer = model
    return Engine(net, tokenizer, CPU, budget=budget, window=512, paged_cache=paged)


def _alone(model: tuple[Any, Any], prompt: list[int], new: int, *, paged: bool = True) -> list[int]:
    """The tokens `prompt` gets on a fresh engine of its own (greedy)."""
    engine = _engine(model, paged=paged)
    sequence = Sequence_("alone", prompt, Options(max_new_tokens=new))
    engine.add(sequence)
    engine.run()
    return sequence.tokens


def _mixed(count: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    return [
        ([2, *(rng.randrange(5, 512) for _ in range(rng.randrange(3, 90)))], rng.randrange(4, 40))
        for _ in range(count)
    ]


def _run_arriving(
    engine: Engine, prompts: Sequence[tuple[list[int], int | Options]], seed: int
) -> list[Any]:
    """Every prompt added a few at a time while the others run (each asking its tokens, or
    with its options); their sequences, ended."""
    rng = random.Random(seed)
    sequences = []
    pending = list(enumerate(prompts))
    while pending or engine.busy:
        for _ in range(rng.randrange(0, 3)):
            if pending:
                index, (prompt, new) = pending.pop(0)
                options = new if isinstance(new, Options) else Options(max_new_tokens=new)
                sequences.append(Sequence_(index, prompt, options))
                engine.add(sequences[-1])
        engine.step()
    return sequences


@pytest.mark.parametrize("working_copy", [True, False])
def test_paged_greedy_outputs_equal_the_left_padded_batch_s_as_calls_join_and_leave(
    model: tuple[Any, Any], working_copy: bool
) -> None:
    prompts = _mixed(24, seed=3)
    engine = _engine(model)
    if not working_copy:  # every decode step gathers its rows from the blocks
        engine._copy_fits = lambda tokens: False  # type: ignore[method-assign]
    copied: list[bool] = []
    step = engine.step

    def stepped() -> list[Sequence_]:
        ended = step()
        copied.append(engine._copy is not None)
        return ended

    engine.step = stepped  # type: ignore[method-assign]
    paged = _run_arriving(engine, prompts, seed=4)
    assert any(copied) == working_copy
    padded = _run_arriving(_engine(model, paged=False), prompts, seed=4)
    assert [s.tokens for s in paged] == [s.tokens for s in padded]
    assert all(s.finish in ("length", "stop") for s in paged)


def test_a_long_row_joining_short_ones_is_kept_in_a_bucket_of_its_own_with_the_same_tokens(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=512, pace=Unpaced())
    rng = random.Random(8)
    short = [
        Sequence_(
            i, [2, *(rng.randrange(5, 512) for _ in range(8 + i))], Options(max_new_tokens=30)
        )
        for i in range(6)
    ]
    for sequence in short:
        engine.add(sequence)
    engine.step()
    late = Sequence_(
        "late", [2, *(rng.randrange(5, 512) for _ in range(299))], Options(max_new_tokens=12)
    )
    engine.add(late)
    widths: list[list[int]] = []
    while engine.busy:
        engine.step()
        if engine._copy is not None:
            widths.append(sorted(bucket.width for bucket in engine._copy.buckets))
    # the short rows are not padded to the long one's 300 columns: each bucket its own width
    assert any(len(w) == 2 and w[0] < 100 < w[1] for w in widths)
    assert all(len(w) <= 2 for w in widths)
    for sequence in (*short, late):
        assert sequence.tokens == _alone(model, sequence.prompt, sequence.options.max_new_tokens)
    assert engine.kv is not None and engine.kv.pool.in_use == 0


def test_a_prompt_that_starts_with_a_cached_prefix_reads_it_and_gets_a_cold_prefill_s_tokens(
    model: tuple[Any, Any],
) -> None:
    system = [2, *range(100, 100 + 5 * BLOCK_TOKENS)]  # five whole blocks and one token
    first, second = [*system, 7, 8, 9], [*system, 40, 41]
    engine = _engine(model)
    engine.add(Sequence_("first", first, Options(max_new_tokens=12)))
    engine.run()
    assert engine.kv is not None and engine.kv.pool.cached >= 5  # kept after it ended
    warm = Sequence_("second", second, Options(max_new_tokens=12))
    engine.add(warm)
    engine.step()
    assert warm.table is not None and warm.table.reused == 5 * BLOCK_TOKENS
    engine.run()
    assert warm.tokens == _alone(model, second, 12)  # a cold prefill's
    reused, prompts = 5 * BLOCK_TOKENS, len(first) + len(second)
    stats = engine.kv_stats()
    assert (stats["reused_tokens"], stats["prompt_tokens"]) == (reused, prompts)


def test_two_tenants_with_the_same_system_prompt_never_read_each_other_s_cached_blocks(
    model: tuple[Any, Any],
) -> None:
    engine = _engine(model)
    system = "You are a careful assistant. Answer in one short sentence. " * 3

    def reused_by(key: str, tenant: str | None) -> int:
        assert engine.kv is not None
        before = engine.kv.pool.reused_tokens
        call = GenCall(key, system + key, {"max_new_tokens": 4}, owner=tenant)
        [answer] = run_calls(engine, [call], None)
        assert isinstance(answer, Generated), answer
        return engine.kv.pool.reused_tokens - before

    assert reused_by("first a", ("tenant", "a")) == 0
    assert reused_by("then b", ("tenant", "b")) == 0  # a's blocks hold the same tokens
    assert reused_by("again a", ("tenant", "a")) >= 4 * BLOCK_TOKENS  # its own are read
    assert reused_by("no tenant", None) == 0
    assert reused_by("no tenant again", None) >= 4 * BLOCK_TOKENS


def test_calls_running_together_share_a_prefix_one_of_them_prefilled(
    model: tuple[Any, Any],
) -> None:
    system = [2, *range(200, 200 + 4 * BLOCK_TOKENS)]
    engine = _engine(model)
    lead = Sequence_("lead", [*system, 5], Options(max_new_tokens=30))
    engine.add(lead)
    engine.step()
    assert engine.kv is not None
    held = engine.kv.pool.in_use
    followers = [Sequence_(i, [*system, 10 + i], Options(max_new_tokens=30)) for i in range(6)]
    for sequence in followers:
        engine.add(sequence)
    engine.step()
    # Each follower took only its own last block: the four prefix blocks are shared.
    assert engine.kv.pool.in_use == held + len(followers)
    engine.run()
    for sequence in followers:
        assert sequence.tokens == _alone(model, sequence.prompt, 30)


def test_a_budget_filled_by_long_calls_preempts_and_resumes_every_call_within_it(
    model: tuple[Any, Any],
) -> None:
    budget = 16 * BLOCK_TOKENS  # 15 blocks beside the null block
    engine = _engine(model, budget=budget)
    per_token = 2 * CONFIG["n_layer"] * CONFIG["n_embd"] * 4  # keys and values, float32
    rng = random.Random(5)
    calls = [
        Sequence_(i, [2, *(rng.randrange(5, 512) for _ in range(30))], Options(max_new_tokens=90))
        for i in range(6)
    ]  # 121 positions each at the end: 8 blocks, so at most one runs to its end alone
    for sequence in calls:
        engine.add(sequence)
    most = 0
    while engine.busy:
        engine.step()
        most = max(most, len(engine.rows))
        assert engine.kv is not None
        assert engine.capacity_tokens <= budget
        assert engine.kv.store.nbytes() <= budget * per_token
    assert engine.preemptions > 0
    assert most >= 3  # admitted by the blocks they hold, not by their whole reach
    assert all(s.finish == "length" and len(s.tokens) == 90 for s in calls)
    assert engine.kv.pool.in_use == 0


def test_preemption_takes_the_youngest_row_so_the_oldest_call_always_advances(
    model: tuple[Any, Any],
) -> None:
    engine = _engine(model, budget=12 * BLOCK_TOKENS)
    calls = [Sequence_(i, [2, 50 + i, 60], Options(max_new_tokens=80)) for i in range(5)]
    for sequence in calls:
        engine.add(sequence)
    made = []
    while engine.busy:
        before = len(calls[0].tokens)
        engine.step()
        if not calls[0].done:
            made.append(len(calls[0].tokens) - before)
    assert engine.preemptions > 0
    assert all(step == 1 for step in made[1:])  # never preempted once it ran
    assert all(s.finish == "length" for s in calls)


def test_finished_and_cancelled_sequences_give_back_every_block(model: tuple[Any, Any]) -> None:
    engine = _engine(model)
    calls = [Sequence_(i, p, Options(max_new_tokens=n)) for i, (p, n) in enumerate(_mixed(10, 7))]
    for sequence in calls:
        engine.add(sequence)
    engine.step()
    engine.step()
    engine.cancel(calls[0].key)
    engine.cancel(calls[9].key)
    engine.run()
    assert engine.kv is not None
    assert engine.kv.pool.in_use == 0
    assert calls[0].finish == "cancelled"
    pool = engine.kv.pool
    assert pool.in_use + pool.cached + pool.free == pool.budget - 1  # every block accounted


def test_cached_blocks_nobody_holds_are_taken_back_least_recently_used_first() -> None:
    pool = BlockPool(4, size=2)
    tables = []
    for tokens in ([1, 2], [3, 4], [5, 6]):
        table = Table([pool.take()], 2)
        pool.key_full_blocks(table, tokens)
        tables.append((table, tokens))
    for table, _ in tables:
        pool.release(table.blocks)
    assert (pool.cached, pool.free) == (3, 1)
    again, _ = pool.match([1, 2, 9], 3)  # the oldest is used again: now the newest
    pool.hold(again)
    pool.release(again)
    pool.take()  # the free block
    taken = pool.take()  # no room left: the least recently used cached block, [3, 4]'s
    assert taken == tables[1][0].blocks[0]
    assert pool.match([3, 4, 0], 3) == ([], b"")
    assert pool.match([1, 2, 0], 3)[0] == tables[0][0].blocks
    pool.take()
    pool.take()
    with pytest.raises(OutOfBlocks):
        pool.take()


def test_room_held_back_for_a_working_copy_is_taken_only_once_no_cached_block_is_left() -> None:
    pool = BlockPool(6, size=2)
    for tokens in ([1, 2], [3, 4]):
        table = Table([pool.take()], 2)
        pool.key_full_blocks(table, tokens)
        pool.release(table.blocks)
    pool.held_back = 3  # of the 4 blocks not yet allocated
    grown = pool.take()  # beyond what is held back
    assert (grown, pool.allocated, pool.cached) == (3, 4, 2)
    pool.take(), pool.take()  # the cached blocks, not the room held back
    assert (pool.allocated, pool.cached) == (4, 0)
    assert pool.match([1, 2, 0], 3) == ([], b"")
    assert sorted(pool.take() for _ in range(3)) == [4, 5, 6]  # then the room held back
    with pytest.raises(OutOfBlocks):
        pool.take()


def test_a_replica_s_cached_prefixes_leave_its_rows_working_copy_room_round_after_round(
    model: tuple[Any, Any],
) -> None:
    # 64 blocks; a round's 4 rows reach 61 tokens each (16 blocks), and its prompts leave
    # 12 cached blocks: by the fifth round the cache alone would fill the budget.
    engine = _engine(model, budget=64 * BLOCK_TOKENS)
    assert engine.kv is not None
    rng = random.Random(7)
    for round_ in range(8):
        prompts = [[2, *(rng.randrange(5, 512) for _ in range(40))] for _ in range(4)]
        sequences = [
            Sequence_((round_, i), prompt, Options(max_new_tokens=20))
            for i, prompt in enumerate(prompts)
        ]
        for sequence in sequences:
            engine.add(sequence)
        copied = []
        while engine.busy:
            engine.step()
            if engine.rows:
                copied.append(engine._copy is not None)
        assert all(copied), f"round {round_}: {copied.count(False)} steps gathered their rows"
    pool = engine.kv.pool
    assert pool.cached >= 3 * 12  # earlier rounds' prompts are still found
    assert pool.match(prompts[0], len(prompts[0]))[0]
    assert [s.tokens for s in sequences] == [_alone(model, p, 20) for p in prompts]


def test_rows_too_long_for_a_copy_beside_them_leave_the_next_rows_room_for_theirs(
    model: tuple[Any, Any],
) -> None:
    # a round's 4 rows reach 141 tokens each (36 blocks of 64): late in a round the copy
    # cannot fit beside their blocks, but the store must not take its room for good
    engine = _engine(model, budget=64 * BLOCK_TOKENS)
    rng = random.Random(7)
    copied = []
    for round_ in range(8):
        for i in range(4):
            prompt = [2, *(rng.randrange(5, 512) for _ in range(40))]
            engine.add(Sequence_((round_, i), prompt, Options(max_new_tokens=100)))
        steps = []
        while engine.busy:
            engine.step()
            if engine.rows:
                steps.append(engine._copy is not None)
        copied.append(sum(steps))
    assert copied[1] > 0.6 * len(steps)
    assert copied[1:] == [copied[1]] * 7, copied  # every later round as the second


def test_a_block_is_found_only_under_the_same_tokens_before_it() -> None:
    pool = BlockPool(8, size=2)
    table = Table([pool.take(), pool.take()], 4)
    pool.key_full_blocks(table, [1, 2, 3, 4])
    assert len(pool.match([1, 2, 3, 4, 5], 5)[0]) == 2
    assert pool.match([9, 9, 3, 4, 5], 5)[0] == []  # same block, other prefix
    assert len(pool.match([1, 2, 3, 4], 3)[0]) == 1  # within the limit only


@pytest.mark.parametrize(("heads", "kv_heads"), [(4, 4), (8, 2)])
def test_cascade_attention_equals_attention_over_each_row_s_whole_keys(
    heads: int, kv_heads: int
) -> None:
    torch.manual_seed(0)
    rows, dim, shared, own = 3, 16, 20, 7
    query = torch.randn(rows, heads, 1, dim)
    prefix_keys, prefix_values = (
        torch.randn(shared, kv_heads, dim),
        torch.randn(shared, kv_heads, dim),
    )
    keys, values = torch.randn(rows, kv_heads, own, dim), torch.randn(rows, kv_heads, own, dim)
    visible = torch.ones(rows, shared + own, dtype=torch.bool)
    visible[0, shared : shared + 3] = False  # row 0's own keys start later (padding)
    mask = visible[:, None, None, :]
    out = paged.cascade(query, keys, values, prefix_keys, prefix_values, mask, dim**-0.5)
    whole_keys = torch.cat([prefix_keys.transpose(0, 1).expand(rows, -1, -1, -1), keys], 2)
    whole_values = torch.cat([prefix_values.transpose(0, 1).expand(rows, -1, -1, -1), values], 2)
    group = heads // kv_heads
    expected = torch.nn.functional.scaled_dot_product_attention(
        query, whole_keys.repeat_interleave(group, 1), whole_values.repeat_interleave(group, 1),
        attn_mask=mask,
    )  # fmt: skip
    assert torch.allclose(out, expected.transpose(1, 2), atol=1e-5)


def test_rows_sharing_a_system_prompt_decode_with_cascade_and_get_their_tokens_alone(
    model: tuple[Any, Any],
) -> None:
    system = [2, *range(300, 300 + 3 * BLOCK_TOKENS)]
    engine = _engine(model)
    assert engine._cascade  # a synthetic GPT-2 on SDPA
    engine.add(Sequence_("first", [*system, 1], Options(max_new_tokens=2)))
    engine.run()
    calls = [Sequence_(i, [*system, 20 + i, 21], Options(max_new_tokens=25)) for i in range(5)]
    for sequence in calls:
        engine.add(sequence)
    engine.step()
    assert engine._shared_blocks() == 3
    engine.run()
    for sequence in calls:
        assert sequence.tokens == _alone(model, sequence.prompt, 25, paged=False)


def test_a_failed_engine_s_blocks_are_given_back_to_the_next_engine_and_prefixes_kept(
    model: tuple[Any, Any],
) -> None:
    system = [2, *range(400, 400 + 2 * BLOCK_TOKENS)]
    engine = _engine(model)
    for i in range(3):
        engine.add(Sequence_(i, [*system, 30 + i], Options(max_new_tokens=20)))
    engine.step()
    engine.step()
    assert engine.kv is not None and engine.kv.pool.in_use > 0
    # Its model failed here: the engine is dropped with its rows (`Driver.fail`).
    net, tokenizer = model
    after = Engine(net, tokenizer, CPU, budget=10**6, window=512, kv=engine.kv)
    assert after.kv is engine.kv and after.kv.pool.in_use == 0
    assert after.kv.pool.cached >= 2  # the system prompt's blocks, whole before keyed
    again = Sequence_("again", [*system, 99], Options(max_new_tokens=4))
    after.add(again)
    after.step()
    assert again.table is not None and again.table.reused == 2 * BLOCK_TOKENS


def test_prompts_that_arrive_together_and_begin_alike_prefill_their_prefix_once(
    model: tuple[Any, Any],
) -> None:
    system = [2, *range(150, 150 + 3 * BLOCK_TOKENS)]
    engine = _engine(model)
    calls = [Sequence_(i, [*system, 40 + i, 41], Options(max_new_tokens=12)) for i in range(5)]
    for sequence in calls:
        engine.add(sequence)
    engine.step()
    assert len(engine.rows) == 1  # the others wait a step to read its blocks
    engine.step()
    assert len(engine.rows) == 5
    assert engine.kv is not None and engine.kv.pool.reused_tokens == 4 * 3 * BLOCK_TOKENS
    assert engine._shared_blocks() == 3  # and their decode steps read the prefix once
    engine.run()
    assert all(s.finish == "length" for s in calls)


def test_a_kv_record_from_a_worker_before_paging_reads_as_its_tokens_held() -> None:
    from placement.ledger.figures.generation import _kv

    assert _kv("96") == {"held_tokens": 96.0}
    assert _kv('{"held_tokens": 32, "blocks_cached": 4}')["blocks_cached"] == 4


def test_a_lone_row_reads_its_own_blocks_plainly_and_two_rows_read_a_shared_prefix_once(
    model: tuple[Any, Any],
) -> None:
    # a lone row gains nothing from attention over a prefix read once: its decode step
    # stays the plain one (on this CPU a lone step took 2.4 ms with it, 2.0 ms without)
    system = [2, *range(150, 150 + 4 * BLOCK_TOKENS - 1)]
    engine = _engine(model)
    first = Sequence_(0, [*system, 40], Options(max_new_tokens=8))
    engine.add(first)
    engine.step()
    assert engine._shared_blocks() == 0
    engine.add(Sequence_(1, [*system, 41], Options(max_new_tokens=8)))
    engine.step()
    assert engine._shared_blocks() == 4
    engine.run()
    assert first.tokens == _alone(model, [*system, 40], 8)


def _call(name: str, count: int, new: int, draw: int, **options: Any) -> list[Sequence_]:
    """A call of `count` prompts (drawn with seed `draw`), each asking `new` tokens."""
    rng = random.Random(draw)
    return [
        Sequence_(
            (name, i),
            [2, *(rng.randrange(5, 512) for _ in range(rng.randrange(5, 40)))],
            Options(max_new_tokens=new, **options),
        )
        for i in range(count)
    ]


def _rows_of(engine: Engine, holder: bool = False) -> Counter[Any]:
    """The running rows per call (per holder: tenant or call, when `holder`)."""
    return Counter(s.holder if holder else s.flow for s in engine.rows)


def test_a_call_waiting_while_another_holds_every_row_gets_one_at_the_next_step(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=512, max_rows=8, pace=Unpaced())
    long = _call("long", 12, 30, draw=1)
    for sequence in long:
        engine.add(sequence)
    engine.step()
    assert _rows_of(engine) == {"long": 8}  # every row
    (short,) = _call("short", 1, 4, draw=2)
    engine.add(short)
    engine.step()
    assert _rows_of(engine) == {"long": 7, "short": 1} and engine.handovers == 1
    for _ in range(3):
        engine.step()
    assert short.finish == "length"  # 4 tokens in 4 steps: no wait for a long row to end
    engine.run()
    for sequence in long:  # the preempted row resumed with the tokens it gets alone
        assert sequence.tokens == _alone(model, sequence.prompt, 30)


def test_a_sequence_handed_a_row_it_could_not_take_at_once_stays_in_line_and_ends(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    engine = Engine(
        net, tokenizer, CPU, budget=7 * BLOCK_TOKENS, window=512, max_rows=4,
        prefill_tokens=32, pace=Unpaced(),
    )  # fmt: skip
    for i, n in enumerate([4, 14, 4, 4]):  # R1's (14 tokens) first block fills at the third step
        prompt = [2, *range(10 + 7 * i, 9 + 7 * i + n)]
        engine.add(Sequence_(("R", i), prompt, Options(max_new_tokens=60)))
    engine.step()  # call R holds every row
    x0 = Sequence_(("X", 0), [2, *range(100, 119)], Options(max_new_tokens=30))
    x1 = Sequence_(("X", 1), [2, *range(200, 219)], Options(max_new_tokens=30))
    engine.add(x0)
    engine.add(x1)
    engine.step()  # both handed a row; 20 + 20 prompt tokens > 32: x1 waits at the head
    assert x1 in engine.handed and engine.waiting[0] is x1
    engine.add(Sequence_(("T", 0), [2, 300, 301, 302], Options(max_new_tokens=5)))
    engine.step()  # x1 no longer fits its blocks, and T is handed a row ahead of it
    assert any(s is x1 for s in (*engine.waiting, *engine.prefilling, *engine.rows))
    engine.run()
    assert (x1.finish, len(x1.tokens)) == ("length", 30)
    assert engine.line.empty  # every call's queued sequences left the line


def test_rows_move_towards_equal_shares_and_are_not_taken_back(model: tuple[Any, Any]) -> None:
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=512, max_rows=8, pace=Unpaced())
    first = _call("first", 10, 40, draw=3)
    for sequence in first:
        engine.add(sequence)
    engine.step()
    second = _call("second", 10, 40, draw=4)
    for sequence in second:
        engine.add(sequence)
    shares = []
    for _ in range(6):
        engine.step()
        shares.append(_rows_of(engine))
    assert shares[-1] == {"first": 4, "second": 4}
    assert shares[-2] == shares[-1]  # settled: no row handed back and forth
    engine.run()
    assert all(s.finish == "length" for s in (*first, *second))
    assert engine.kv is not None and engine.kv.pool.in_use == 0


def test_a_preempted_row_samples_the_same_tokens_with_its_seed(model: tuple[Any, Any]) -> None:
    net, tokenizer = model
    options = {"choice": Choice(temperature=0.9, top_p=0.95), "seed": 7}
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=512, max_rows=4, pace=Unpaced())
    long = _call("long", 4, 24, draw=5, **options)
    for sequence in long:
        engine.add(sequence)
    engine.step()
    engine.add(_call("short", 1, 3, draw=6)[0])
    engine.run()
    assert engine.handovers == 1
    for sequence in long:
        alone = _engine(model)
        again = Sequence_("alone", sequence.prompt, Options(max_new_tokens=24, **options))
        alone.add(again)
        alone.run()
        assert sequence.tokens == again.tokens


def test_a_row_handed_over_is_not_the_one_taken_back_when_blocks_run_short(
    model: tuple[Any, Any],
) -> None:
    # 8 rows of one block's prompt each take their second block at once, and their third
    # 16 steps later, which a budget of 22 blocks cannot give all of: the rows preempted
    # for blocks then are the long call's, never the row handed over to the short call
    net, tokenizer = model
    engine = Engine(
        net, tokenizer, CPU, budget=22 * BLOCK_TOKENS, window=512, max_rows=8, pace=Unpaced()
    )
    long = [
        Sequence_(("long", i), [2, *range(30 + i, 45 + i)], Options(max_new_tokens=40))
        for i in range(8)
    ]
    for sequence in long:
        engine.add(sequence)
    engine.step()
    short = Sequence_(("short", 0), [2, 7, 8, 9], Options(max_new_tokens=24))
    engine.add(short)
    steps = 0
    while not short.done:
        engine.step()
        steps += 1
    # a row at once (its first step makes two tokens: its prefill's and a decode's), kept
    # to its end
    assert steps == 23 and engine.handovers == 1
    assert engine.preemptions > engine.handovers  # blocks did run short meanwhile
    engine.run()
    for sequence in long:
        assert sequence.tokens == _alone(model, sequence.prompt, 40)


def _tenant_calls(tenant: str, count: int, new: int, weight: float) -> list[Sequence_]:
    """`count` calls of one prompt each from `tenant`, whose rows they share by `weight`."""
    calls = []
    for i in range(count):
        sequence = Sequence_((f"{tenant}-{i}", 0), [2, 20 + i, 21, 22], Options(max_new_tokens=new))
        sequence.owner, sequence.weight = ("tenant", tenant), weight
        calls.append(sequence)
    return calls


def test_a_tenant_s_many_calls_share_its_rows_and_another_tenant_s_call_gets_one(
    model: tuple[Any, Any],
) -> None:
    # each of tenant a's 12 calls would hold one row: shared by call, nobody holds two
    # more than the newcomer; shared by tenant, a holds 8 and hands one to b at once
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=512, max_rows=8, pace=Unpaced())
    for sequence in _tenant_calls("a", 12, 30, 1.0):
        engine.add(sequence)
    engine.step()
    (late,) = _tenant_calls("b", 1, 3, 1.0)
    engine.add(late)
    engine.step()
    assert _rows_of(engine, holder=True) == {("tenant", "a"): 7, ("tenant", "b"): 1}
    engine.run()
    assert late.finish == "length"


def test_tenants_rows_follow_their_weights(model: tuple[Any, Any]) -> None:
    net, tokenizer = model
    engine = Engine(net, tokenizer, CPU, budget=10**6, window=512, max_rows=8, pace=Unpaced())
    for sequence in _tenant_calls("heavy", 12, 40, 3.0):
        engine.add(sequence)
    engine.step()
    for sequence in _tenant_calls("light", 12, 40, 1.0):
        engine.add(sequence)
    shares = []
    for _ in range(4):
        engine.step()
        shares.append(_rows_of(engine, holder=True))
    assert shares[-1] == {("tenant", "heavy"): 6, ("tenant", "light"): 2}  # 3:1
    assert shares[-2] == shares[-1]
    engine.run()


# --- decode steps in fixed shapes (`worker.generation.kv.graphs`) ---------------------------


def _fixed_engine(
    model: tuple[Any, Any], *, graphs: bool, budget: int = 10**6, kv: paged.Paged | None = None
) -> Engine:
    net, tokenizer = model
    # a fixed pace: the two engines compared prefill alike whatever the machine's speed
    return Engine(
        net, tokenizer, CPU, budget=budget, window=512, graphs=graphs, kv=kv, pace=Fixed(48)
    )


def _sampled_calls(seed: int, count: int = 20) -> list[tuple[list[int], Options]]:
    """Prompts of 3 to 200 tokens, greedy and seeded sampling among them."""
    rng = random.Random(seed)
    calls = []
    for index in range(count):
        prompt = [2, *(rng.randrange(5, 512) for _ in range(rng.randrange(3, 200)))]
        sampled = {"choice": Choice(temperature=0.8, top_p=0.9), "seed": index}
        options = Options(max_new_tokens=rng.randrange(4, 60), **(sampled if index % 3 else {}))
        calls.append((prompt, options))
    return calls


def _with_logits(
    engine: Engine, calls: list[tuple[list[int], Options]]
) -> tuple[list[Sequence_], list[torch.Tensor]]:
    """`calls` run on `engine` as they arrive; their sequences, and the logits of every
    step's rows that sampling was given, in order."""
    with recorded_logits() as seen:
        return _run_arriving(engine, calls, seed=9), seen


def _same_logits(these: list[torch.Tensor], those: list[torch.Tensor]) -> bool:
    """Step for step, the same logits up to float32 rounding (a padded step multiplies
    in other shapes): a key written to a slot a real row reads moves them by 1e-4 or more
    in this model, where its tokens may not change."""
    return len(these) == len(those) and all(
        a.shape == b.shape and torch.allclose(a, b, rtol=0, atol=1e-5)
        for a, b in zip(these, those, strict=True)
    )


def test_decode_steps_padded_to_their_shape_make_the_logits_of_steps_in_their_own_shape(
    model: tuple[Any, Any],
) -> None:
    calls = _sampled_calls(seed=1)
    fixed = _fixed_engine(model, graphs=True)
    assert fixed._graphs is not None and not fixed._graphs.record  # a CPU runs them as they are
    padded, padded_logits = _with_logits(fixed, calls)
    plain, plain_logits = _with_logits(_fixed_engine(model, graphs=False), calls)
    assert _same_logits(padded_logits, plain_logits)
    assert [s.tokens for s in padded] == [s.tokens for s in plain]
    assert all(s.finish in ("length", "stop") for s in padded)
    shapes = set(fixed._graphs._shapes)
    assert len({rows for rows, _ in shapes}) >= 3  # rows came and went
    assert len({width for _, width in shapes}) >= 2  # the longest row grew past a power of two
    assert fixed.kv is not None and fixed.kv.pool.in_use == 0


def test_rows_preempted_for_blocks_resume_with_their_logits_in_padded_steps(
    model: tuple[Any, Any],
) -> None:
    calls = _sampled_calls(seed=2, count=8)
    budget = 40 * BLOCK_TOKENS
    fixed = _fixed_engine(model, graphs=True, budget=budget)
    padded, padded_logits = _with_logits(fixed, calls)
    plain_engine = _fixed_engine(model, graphs=False, budget=budget)
    plain, plain_logits = _with_logits(plain_engine, calls)
    assert fixed.preemptions > 0
    assert _same_logits(padded_logits, plain_logits)
    assert [s.tokens for s in padded] == [s.tokens for s in plain]


def test_a_padded_row_writes_only_the_null_block_s_last_slot_and_reads_nothing_else() -> None:
    scratch = DecodeGraphs(CPU, BLOCK_TOKENS, rows=4, record=False).scratch
    assert scratch == NULL_BLOCK * BLOCK_TOKENS + BLOCK_TOKENS - 1  # no row's block holds it
    inputs = Inputs.empty(rows=4, width=8, device=CPU)
    wider = torch.arange(1, 33).view(4, 8)  # a step before, of every row and column
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
    assert inputs.index[3].tolist() == [0] * 7 + [scratch]  # slot 0 masked, as padding is
    assert inputs.mask[3, 0, 0].tolist() == [False] * 7 + [True]
    assert inputs.slots.tolist() == [23, 35, 42, scratch]
    assert inputs.ids[:, 0].tolist() == [7, 8, 9, 0] and inputs.positions[3, 0] == 0
    assert [round_up(n) for n in (1, 3, 4, 5, 33)] == [1, 4, 4, 8, 64]
    assert round_up(3, BLOCK_TOKENS) == BLOCK_TOKENS


def test_the_replica_s_next_engine_steps_in_the_shapes_its_last_one_made(
    model: tuple[Any, Any],
) -> None:
    calls = _sampled_calls(seed=3, count=6)
    first = _fixed_engine(model, graphs=True)
    _run_arriving(first, calls, seed=9)
    assert first.kv is not None and first._graphs is first.kv.graphs
    made = dict(first.kv.graphs._shapes)  # type: ignore[union-attr]
    second = _fixed_engine(model, graphs=True, kv=first.kv)
    again = _run_arriving(second, calls, seed=9)
    assert second._graphs is first._graphs
    assert second._graphs is not None and second._graphs._step is not None
    assert second._graphs._step() == second._graph_step  # the engine open now records
    for shape, entry in made.items():  # the same calls take the same shapes, kept
        assert second._graphs._shapes[shape] is entry
    plain = _run_arriving(_fixed_engine(model, graphs=False), calls, seed=9)
    assert [s.tokens for s in again] == [s.tokens for s in plain]


def test_a_replica_s_blocks_go_with_their_last_engine_not_when_the_garbage_collector_runs(
    model: tuple[Any, Any],
) -> None:
    engine = _fixed_engine(model, graphs=True)
    _run_arriving(engine, _sampled_calls(seed=5, count=4), seed=9)
    assert engine.kv is not None and engine.kv.graphs is not None
    blocks = weakref.ref(engine.kv)
    gc.disable()  # what a reference cycle would hold stays held
    try:
        del engine
        assert blocks() is None  # the KV store (a GPU's memory) is let go at once
    finally:
        gc.enable()


def test_rows_that_share_a_prompt_s_blocks_read_them_once_rather_than_in_a_fixed_shape(
    model: tuple[Any, Any],
) -> None:
    rng = random.Random(6)
    system = [2, *(rng.randrange(5, 512) for _ in range(4 * BLOCK_TOKENS))]
    calls = [([*system, *(rng.randrange(5, 512) for _ in range(i + 3))], 20) for i in range(5)]
    fixed = _fixed_engine(model, graphs=True)
    shared = _run_arriving(fixed, calls, seed=9)
    assert fixed._graphs is not None
    shapes = fixed._graphs._shapes
    assert shapes and all(rows == 1 for rows, _ in shapes)  # a lone row shares nothing
    plain = _run_arriving(_fixed_engine(model, graphs=False), calls, seed=9)
    assert [s.tokens for s in shared] == [s.tokens for s in plain]


class _Stepping:
    """A step that counts the rows it ran and makes no logits of note."""

    def __init__(self) -> None:
        self.ran: list[int] = []

    def step(self, inputs: Inputs) -> torch.Tensor:
        self.ran.append(inputs.ids.shape[0])
        return torch.zeros((inputs.ids.shape[0], 5))


def test_shapes_recorded_on_a_store_that_grew_since_are_dropped() -> None:
    stepping = _Stepping()
    ran = stepping.ran
    graphs = DecodeGraphs(CPU, BLOCK_TOKENS, rows=8, record=False)
    graphs.use(stepping.step)
    one = (torch.tensor([[1]]), torch.tensor([[0]]), torch.tensor([[17]]), torch.ones(1, 1))
    logits = graphs.run(*one, torch.tensor([17]), addresses=(1, 2))
    assert logits.shape == (1, 5) and ran == [1]
    kept = graphs._shapes[(1, BLOCK_TOKENS)]
    graphs.run(*one, torch.tensor([17]), addresses=(1, 2))
    assert graphs._shapes[(1, BLOCK_TOKENS)] is kept
    graphs.run(*one, torch.tensor([17]), addresses=(3, 4))  # the store's tensors moved
    assert graphs._shapes[(1, BLOCK_TOKENS)] is not kept


def test_a_shape_whose_recording_runs_out_of_memory_runs_as_it_is_and_graphs_stay_on(
    model: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = _fixed_engine(model, graphs=True)
    graphs = engine._graphs
    assert graphs is not None
    graphs.record = True
    tried: list[tuple[int, ...]] = []

    def full(entry: Any) -> None:  # a GPU with no room left for any recording
        tried.append(tuple(entry.inputs.index.shape))
        raise torch.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(graphs, "_record", full)
    calls = _sampled_calls(seed=6, count=6)
    sequences = _run_arriving(engine, calls, seed=9)
    assert engine._graphs is graphs and not graphs.failed  # not the model's fault: kept on
    assert len(tried) > 1 and len(set(tried)) == len(tried)  # each shape tried once
    assert all(entry.eager for entry in graphs._shapes.values())
    plain = _run_arriving(_fixed_engine(model, graphs=False), calls, seed=9)
    assert [s.tokens for s in sequences] == [s.tokens for s in plain]


def test_an_engine_of_more_rows_than_the_replicas_graphs_hold_gets_graphs_of_its_size(
    model: tuple[Any, Any],
) -> None:
    net, tokenizer = model
    small = Engine(net, tokenizer, CPU, budget=10**6, window=512, graphs=True, max_rows=8)
    assert small.kv is not None and small._graphs is not None and small._graphs.rows == 8
    same = Engine(net, tokenizer, CPU, budget=10**6, window=512, graphs=True, max_rows=4,
                  kv=small.kv)  # fmt: skip
    assert same._graphs is small._graphs  # fewer rows: the replica's graphs hold them
    large = Engine(net, tokenizer, CPU, budget=10**6, window=512, graphs=True, max_rows=64,
                   kv=small.kv)  # fmt: skip
    assert (
        large._graphs is not None and large._graphs.rows == 64 and small.kv.graphs is large._graphs
    )


def test_a_decode_step_whose_recording_fails_runs_as_it_is_and_the_engine_stops_recording(
    model: tuple[Any, Any], caplog: pytest.LogCaptureFixture
) -> None:
    calls = _sampled_calls(seed=4, count=6)
    engine = _fixed_engine(model, graphs=True)
    assert engine._graphs is not None
    engine._graphs.record = True  # a CPU has no CUDA graph to record: recording raises
    with caplog.at_level("WARNING", logger="worker.generation.kv.graphs"):
        sequences = _run_arriving(engine, calls, seed=9)
    assert engine._graphs is None
    assert engine.kv is not None and engine.kv.graphs is not None and engine.kv.graphs.failed
    assert "GPUFLEET_CUDA_GRAPHS=0" in caplog.text
    assert sum("CUDA graph failed" in r.getMessage() for r in caplog.records) == 1
    assert _fixed_engine(model, graphs=True, kv=engine.kv)._graphs is None  # the replica's next
    plain = _run_arriving(_fixed_engine(model, graphs=False), calls, seed=9)
    assert [s.tokens for s in sequences] == [s.tokens for s in plain]
