"""How many prompt tokens a step of the engine prefills while rows are decoding.

A step prefills new prompts (or chunks of them), then decodes one token for every running
row, so every running stream waits for the step's prefill between two of its tokens. The
rule: **a step's prefill may add at most one decode step's time to the step.** So while a
burst of long prompts is prefilled chunk by chunk, the running streams' gap between tokens
stays within about twice its usual value, and the new prompts still go in as fast as that
allows. No constant of the rule is tuned: the engine measures both times as it runs.

The cost of a prefill pass is modelled as `fixed + a x tokens + b x token-columns` (a pass
of a few tokens costs its launches, most of them on a GPU; each token its compute, most of
it on a CPU; and each token attends to every column before it, so a late chunk of a long
prompt costs more than its first), fitted by least squares over the last `WINDOW` passes.
An allowance (`Allowance`) is spent chunk by chunk in those seconds:
- the decode step is that of **the batch being built** (its rows and the calls waiting to
  join them, the step's cost scaled by their number): while a few rows run and many calls
  wait, the prefill is not held to the short steps of the first few (paced by those, the
  fleet's 32 short calls, which reach the engine a few at a time, waited 40 to 356 ms p50
  to begin their prefill; paced by the rows running, the trace shape's calls lost a
  quarter of their tokens per second through the fleet). A step's cost does not grow in
  proportion to its rows (on the 2-core VM 2 rows took 11-14 ms and 33 rows 25 ms), but
  priced by the line through the steps measured, the trace shape's calls lost a fifth
  of their tokens per second again (docs/benchmarks.md, "the burst's slowest steps"):
  the proportion is what lets a batch fill while its first rows run;
- **a prompt that starts whole** is one that much compute holds;
- **chunks of a long prompt** take it with the pass's fixed part counted in where compute
  is what a pass costs (a CPU); where launches are (a GPU), a pass of thousands of tokens
  costs little more than its launches, which are about a decode step themselves, so only
  the compute counts and the allowance is large, as it should be;
- **a chunk after the step's first** pays a pass's fixed cost too: it may need a pass of
  its own (its prompt's length differs), and a burst's second prompt starting in the step
  that ends the first doubled those steps.
With no row running, nothing waits, and the engine's own bound (`prefill_tokens`) applies.
"""

from __future__ import annotations

import math
from collections import deque

from placement.rules.costs import fit

#: Passes the cost model is fitted over: enough to see passes of several sizes, few
#: enough to follow a machine whose load changes. Not tuned.
WINDOW = 32
#: The least a budget allows, so a long prompt always progresses: one KV block's tokens
#: (`worker.generation.kv.blocks.BLOCK_TOKENS`), the unit a prefix is shared in.
LEAST_TOKENS = 16


class Pace:
    """The measured costs of one engine's passes, and the prefill allowance they give."""

    def __init__(self) -> None:
        # (tokens, token-columns, seconds): a pass's padded tokens, those times the columns
        # each attends to (its past and its own), and its time
        self._passes: deque[tuple[int, int, float]] = deque(maxlen=WINDOW)
        self._decode_s: deque[float] = deque(maxlen=WINDOW)

    def prefilled(self, tokens: int, seconds: float, width: int = 0) -> None:
        """A prefill pass of `tokens` prompt tokens (padding included) took `seconds`, each
        token attending to `width` columns (the pass's past and its own tokens; 0: not
        told, its cost is counted by tokens alone)."""
        if tokens > 0 and seconds > 0:
            self._passes.append((tokens, tokens * width, seconds))

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

    def costs(self) -> tuple[float, float, float] | None:
        """A pass's fixed cost, the marginal cost of a prompt token, and of each column it
        attends to: the least-squares plane through the window's passes (`fixed + a x
        tokens + b x token-columns`); where the columns do not vary apart from the tokens
        enough to tell them (or noise makes a cost negative), the line through tokens alone
        (b = 0); where the sizes do not vary either (or the slope is no cost at all),
        their mean cost per token, which counts the fixed part in (fixed = 0) and so errs
        towards smaller chunks. None before the first pass."""
        if not self._passes:
            return None
        points = [(n, p) for n, p, _ in self._passes]
        return fit(points, [t for _, _, t in self._passes])

    def step(
        self, most: int, rows: int = 1, building: int = 1, *, launch_bound: bool = False
    ) -> Allowance:
        """What this step may prefill beside `rows` running rows, when the batch being
        built (those rows and the sequences waiting or being prefilled) holds `building`
        (see the module): one decode step of that batch, the rows' step scaled by
        `building / rows` (a decode step's cost is taken to grow with its rows). A prompt
        starts whole if that much compute holds it; chunks of longer ones take it with the
        pass's fixed cost counted in where compute is what a pass costs (a CPU), not where
        launches are (`launch_bound`, a GPU: there the fixed part is about a decode step
        itself, and counting it would leave chunks the least). `most` tokens, unpaced,
        until both costs are known."""
        decode_s, costs = self.decode_s, self.costs()
        if decode_s is None or costs is None:
            return Allowance(most, None)
        fixed, per_token, per_column = costs
        step_s = decode_s * max(1.0, building / max(1, rows))
        if launch_bound:  # chunks merge into one pass (`merge_prefill`): no more launches
            return Allowance(most, (per_token, per_column), step_s, step_s)
        return Allowance(most, (per_token, per_column), step_s, step_s - fixed, fixed)

    def budget(self, most: int, rows: int = 1, building: int = 1, past: int = 0) -> int:
        """The prompt tokens a step's allowance (`step`) holds of one prompt whose first
        `past` tokens are in already."""
        return self.step(most, rows, building).tokens(past)


class Allowance:
    """One step's prefill allowance, spent chunk by chunk: in seconds of compute by the
    pace's `costs` (per token, per column attended), `whole` for a prompt that starts
    whole and `chunks` for what chunks of long prompts take, a chunk after the step's first
    paying a pass's `fixed` cost too (it may need a pass of its own); or, unpaced (`costs`
    None), in tokens up to `most`."""

    def __init__(
        self, most: int, costs: tuple[float, float] | None, whole: float = 0.0,
        chunks: float = 0.0, fixed: float = 0.0,
    ) -> None:  # fmt: skip
        self.most = most
        self._costs = costs
        self._fixed = fixed
        self._whole = whole if costs is not None else float(most)
        self._left = chunks if costs is not None else float(most)
        self._first = True

    @property
    def spent(self) -> bool:
        return self._left <= 0

    def cost(self, tokens: int, past: int) -> float:
        """What `tokens` more tokens of a prompt whose first `past` are in cost of it."""
        if self._costs is None:
            return float(tokens)
        per_token, per_column = self._costs
        return tokens * per_token + tokens * (past + tokens) * per_column

    def tokens(self, past: int, left: float | None = None) -> int:
        """The most tokens of a prompt at `past` that `left` (a whole prompt's allowance
        when None) pays for, within [`LEAST_TOKENS`, `most`]."""
        left = max(0.0, self._whole if left is None else left)
        if self._costs is None:
            fits = int(left)
        else:
            a, b = self._costs
            slope = a + b * past
            if b > 0:  # b n^2 + (a + b past) n = left
                fits = int((-slope + math.sqrt(slope * slope + 4 * b * left)) / (2 * b))
            else:
                fits = int(left / slope)
        return max(min(LEAST_TOKENS, self.most), min(self.most, fits))

    def holds(self, todo: int, past: int) -> bool:
        """Whether a whole step's allowance holds `todo` tokens of a prompt at `past` (such
        a prompt starts whole)."""
        return todo <= self.tokens(past)

    def chunk(self, todo: int, past: int) -> int:
        """Tokens of a prompt at `past` (`todo` left) this step may prefill now: what is
        left pays for, and at least `LEAST_TOKENS` for the step's first chunk, so a long
        prompt always progresses; 0 once nothing more is paid for. Spend them (`spend`)."""
        if self._first:
            return min(todo, self.tokens(past, self._left))
        left = self._left - self._fixed
        granted = min(todo, self.tokens(past, left))
        return granted if self.cost(granted, past) <= left else 0

    def spend(self, tokens: int, past: int) -> None:
        """Count `tokens` of a prompt at `past` against what is left (a pass's fixed cost
        too, after the step's first)."""
        self._left -= self.cost(tokens, past) + (0.0 if self._first else self._fixed)
        self._first = False


__all__ = ["LEAST_TOKENS", "WINDOW", "Allowance", "Pace"]
