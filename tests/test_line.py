"""The engine's waiting line (`worker.generation.line`), on its own: who is admitted next."""

from __future__ import annotations

from typing import Any

from worker.generation.line import FairLine
from worker.generation.sequence import Options, Sequence_


def _sequence(call: str, index: int, tenant: str | None = None) -> Sequence_:
    """A prompt of 4 tokens asking 6: a reach of 10."""
    sequence = Sequence_((call, index), [2, 7, 8, 9], Options(max_new_tokens=6))
    sequence.owner = None if tenant is None else ("tenant", tenant)
    return sequence


def _admit_all(line: FairLine, waiting: list[Sequence_]) -> list[Any]:
    """Admit the line's head, in turn, until none waits: the keys in that order."""
    order = []
    while waiting:
        line.settle(waiting, set())
        head = waiting.pop(0)
        line.leave(head, in_turn=True)
        order.append(head.key)
    return order


def test_a_call_handed_a_turn_costs_its_tenant_that_turn_only() -> None:
    line, waiting = FairLine(), []
    for index in range(3):  # a call of no tenant, and a tenant's call, of three prompts each
        line.add(waiting, _sequence("f", index))
    for index in range(3):
        line.add(waiting, _sequence("t", index, tenant="t"))
    late = _sequence("b", 0)  # another call of no tenant: second in the default's line
    line.add(waiting, late)
    line.settle(waiting, set())
    waiting.remove(late)  # handed a row, out of its turn
    line.leave(late, in_turn=False)
    # it took one turn of the default tenant's, so f's first prompt comes one turn later
    # (beside t's second), not after the turn its own place in line had counted too
    assert _admit_all(line, waiting) == [
        ("t", 0), ("f", 0), ("t", 1), ("f", 1), ("t", 2), ("f", 2),
    ]  # fmt: skip
    assert line.empty


def test_without_tenants_calls_take_turns_by_call_as_one_level_did() -> None:
    line, waiting = FairLine(), []
    for index in range(3):
        line.add(waiting, _sequence("many", index))
    first = waiting[0]
    line.settle(waiting, set())
    assert waiting.pop(0) is first
    line.leave(first, in_turn=True)
    line.add(waiting, _sequence("later", 0))  # its first prompt starts at the virtual time
    assert _admit_all(line, waiting) == [("later", 0), ("many", 1), ("many", 2)]


def test_a_preempted_sequence_goes_back_ahead_of_what_came_after_it() -> None:
    line, waiting = FairLine(), []
    for index in range(2):
        line.add(waiting, _sequence("a", index, tenant="t"))
    line.settle(waiting, set())
    admitted = waiting.pop(0)
    line.leave(admitted, in_turn=True)
    line.add(waiting, _sequence("b", 0, tenant="u"))
    line.add(waiting, _sequence("c", 0, tenant="t"))
    line.requeue(waiting, admitted)  # preempted: its cost was counted when admitted
    assert _admit_all(line, waiting)[0] == ("a", 0)
    assert line.empty
