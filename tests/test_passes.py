"""A forward pass's size: its threads (a share of the host's cores, one for a small pass)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from worker.passes import Dims, dims_of, for_pass, share


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
