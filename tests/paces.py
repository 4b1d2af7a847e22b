"""Paces for engine tests whose step's prefill must not depend on the machine's speed."""

from __future__ import annotations

from worker.generation.pacing import Allowance, Pace


class Unpaced(Pace):
    """No pacing: a step prefills up to the engine's own bound whatever decodes beside it."""

    def step(
        self, most: int, rows: int = 1, building: int = 1, *, launch_bound: bool = False
    ) -> Allowance:
        return Allowance(most, None)


class Fixed(Pace):
    """A pace that allows `tokens` prompt tokens a step beside decoding rows."""

    def __init__(self, tokens: int) -> None:
        super().__init__()
        self.tokens = tokens

    def step(
        self, most: int, rows: int = 1, building: int = 1, *, launch_bound: bool = False
    ) -> Allowance:
        return Allowance(min(most, self.tokens), None)  # counted in tokens
