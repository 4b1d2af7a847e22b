"""A forward pass's size: its threads (a share of the host's cores, one for a small pass), and
how a batch is cut into CPU passes."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from worker.passes import Dims, cpu_passes, dims_of, for_pass, share


def encoder(hidden: int, layers: int) -> Dims:
    config = SimpleNamespace(hidden_size=hidden, num_hidden_layers=layers)
    return dims_of(SimpleNamespace(config=config, parameters=lambda: iter([torch.zeros(1)])))


def test_each_gpu_worker_takes_an_equal_share_of_the_cores_unless_told() -> None:
    assert share(None, gpus=1, cores=2) == 2
    assert share(None, gpus=8, cores=64) == 8
    assert share(None, gpus=4, cores=2) == 1  # never none
    assert share(3, gpus=8, cores=64) == 3


def test_a_small_pass_runs_on_one_thread_and_a_large_one_on_the_workers_share() -> None:
    tiny, minilm = encoder(32, 2), encoder(384, 6)
    assert for_pass(4, tiny, ["a short sentence"]) == 1
    assert for_pass(4, minilm, ["a short sentence"]) == 4
    assert for_pass(4, tiny, ["x" * 500] * 32) == 4  # a tiny model's big batch
    nameless = dims_of(SimpleNamespace(parameters=lambda: iter(())))
    assert for_pass(4, nameless, ["x"]) == 4  # a model that says nothing is not guessed small
    # 514 tokens at most (512 and two specials) x 2 layers x 12 x 32^2: 12.6M a row
    assert for_pass(4, tiny, ["x" * 600] * 3) == 1  # 37.9M
    assert for_pass(4, tiny, ["x" * 600] * 4) == 4  # 50.5M, past SMALL_PASS


def _anywhere(rows: int, longest: int) -> bool:
    return True


def test_a_cpu_batch_of_like_lengths_runs_as_one_pass() -> None:
    minilm = encoder(384, 6)
    calls = [[f"caller {i} asks about the weather"] for i in range(24)]
    assert cpu_passes(minilm, calls, _anywhere) == [list(range(24))]


def test_a_cpu_batch_of_short_and_long_calls_is_cut_so_short_calls_are_not_padded() -> None:
    minilm = encoder(384, 6)
    short, long = ["a cat"], ["a long question about " + "rates and rain " * 20]
    calls = [short if i % 2 else long for i in range(16)]  # interleaved
    plan = cpu_passes(minilm, calls, _anywhere)
    assert sorted(map(sorted, plan)) == [list(range(0, 16, 2)), list(range(1, 16, 2))]
    assert plan[0] == sorted(plan[0], key=lambda i: len(calls[i][0]))  # shortest first


def test_a_cpu_pass_never_holds_more_than_memory_allows_but_a_lone_call_always_runs() -> None:
    minilm = encoder(384, 6)
    calls = [["same length text"]] * 10 + [["x" * 900]]
    plan = cpu_passes(minilm, calls, lambda rows, longest: rows * longest <= 3 * 18)
    assert sorted(i for p in plan for i in p) == list(range(11))  # every call, once
    assert max(len(p) for p in plan) == 3
    assert [10] in plan  # fits in no pass: it runs alone
