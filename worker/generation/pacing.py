"""How many prompt tokens a step of the engine prefills while rows are decoding.

A step prefills new prompts (or chunks of them), then decodes one token for every running
row, so every running stream waits for the step's prefill between two of its tokens. The
rule: **a step's prefill may add at most one decode step's time to the step** beyond what
any pass costs however small it is. So while a burst of long prompts is prefilled chunk by
chunk, the running streams' gap between tokens stays within about twice its usual value,
and the new prompts still go in as fast as that allows. No constant of the rule is tuned:
the engine measures both times as it runs.

The cost of a prefill pass is modelled as `fixed + per_token x tokens` (a pass of a few
tokens costs its launches, most of them on a GPU; each token its compute, most of it on a
CPU), fitted by least squares over the last `WINDOW` passes. The step's budget is then the
tokens whose compute costs one decode step: `decode_s / per_token`, the decode step being
that of the batch under way (its rows and the calls waiting to join them, the step's cost
scaled by their number): while a few rows run and many calls wait, the prefill is paced by
the steps those calls will share, not by the short steps of the first few (paced by
those, the fleet's 32 short calls, which reach the engine a few at a time, waited 40 to
356 ms p50 to begin their prefill). On a CPU, where
`fixed` is small, that bounds the whole prefill; on a GPU, where a pass of thousands of
tokens costs little more than its launches, the budget is large, as it should be. With no
row running, nothing waits, and the engine's own bound (`prefill_tokens`) applies.
"""

from __future__ import annotations

from collections import deque

#: Passes the cost model is fitted over: enough to see passes of several sizes, few
#: enough to follow a machine whose load changes. Not tuned.
WINDOW = 32
#: The least a budget allows, so a long prompt always progresses: one KV block's tokens
#: (`worker.generation.blocks.BLOCK_TOKENS`), the unit a prefix is shared in.
LEAST_TOKENS = 16


class Pace:
    """The measured costs of one engine's passes, and the prefill budget they give."""

    def __init__(self) -> None:
        self._passes: deque[tuple[int, float]] = deque(maxlen=WINDOW)  # (tokens, seconds)
        self._decode_s: deque[float] = deque(maxlen=WINDOW)

    def prefilled(self, tokens: int, seconds: float) -> None:
        """A prefill pass of `tokens` prompt tokens (padding included) took `seconds`."""
        if tokens > 0 and seconds > 0:
            self._passes.append((tokens, seconds))

    def decoded(self, seconds: float) -> None:
        """A decode step took `seconds`."""
        if seconds > 0:
            self._decode_s.append(seconds)

    @property
    def decode_s(self) -> float | None:
        """The median decode step of the window (None before the first)."""
        if not self._decode_s:
            return None
        ordered = sorted(self._decode_s)
        return ordered[len(ordered) // 2]

    def per_token_s(self) -> float | None:
        """The marginal cost of one prompt token: the slope of the least-squares line
        through the window's passes; where their sizes do not vary enough to give one
        (or noise makes it no cost at all), their mean cost per token, which counts the
        fixed part too and so errs towards smaller chunks. None before the first pass."""
        if not self._passes:
            return None
        count = len(self._passes)
        mean_n = sum(n for n, _ in self._passes) / count
        mean_t = sum(t for _, t in self._passes) / count
        spread = sum((n - mean_n) ** 2 for n, _ in self._passes)
        if spread > 0:
            slope = sum((n - mean_n) * (t - mean_t) for n, t in self._passes) / spread
            if slope > 0:
                return slope
        return mean_t / mean_n

    def budget(self, most: int, rows: int = 1, building: int = 1) -> int:
        """Prompt tokens this step may prefill beside `rows` running rows, when the batch
        being built (those rows and the sequences waiting or being prefilled) holds
        `building`: those whose compute costs one decode step of that batch, within
        [`LEAST_TOKENS`, `most`]; `most` until both costs are known. A decode step's cost
        is taken to grow with its rows (a pass's compute), so while few rows run and many
        calls wait, as when a burst of calls reaches an idle engine a few at a time, the
        prefill is not held to the short steps of the first few."""
        decode_s, per_token = self.decode_s, self.per_token_s()
        if decode_s is None or per_token is None:
            return most
        step_s = decode_s * max(1.0, building / max(1, rows))
        return max(min(LEAST_TOKENS, most), min(most, int(step_s / per_token)))


__all__ = ["LEAST_TOKENS", "WINDOW", "Pace"]
