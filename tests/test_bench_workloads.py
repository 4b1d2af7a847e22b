"""The generating benches' calls: a phase's own text keeps the calls' shape and shares no
cacheable block with another phase's."""

from __future__ import annotations

from bench.workloads import respelled, workload
from worker.generation.kv.blocks import BLOCK_TOKENS


def test_a_phase_in_its_own_text_keeps_each_calls_length_and_new_tokens() -> None:
    calls = workload(32, 0, "short")
    again = respelled(calls, 2)
    assert [(len(p), n) for p, n in again] == [(len(p), n) for p, n in calls]


def test_no_prompt_of_a_phase_in_its_own_text_begins_with_a_block_of_another_phase() -> None:
    # A prefix-cache hit needs a whole first block of the same tokens (one byte a token on
    # the CPU bench model, after its BOS token): none may be shared between phases.
    calls = workload(32, 0, "short")
    phases = [calls, respelled(calls, 1), respelled(calls, 2)]
    firsts = [{p[: BLOCK_TOKENS - 1] for p, _ in phase} for phase in phases]
    assert all(len(first) == len(calls) for first in firsts)
    assert not firsts[0] & firsts[1] and not firsts[0] & firsts[2] and not firsts[1] & firsts[2]


def test_the_same_seed_respells_the_same_text() -> None:
    calls = workload(8, 0, "short")
    assert respelled(calls, 3) == respelled(calls, 3) != respelled(calls, 4)
