"""Pick each row's next token, every row with its own parameters, in one set of tensor ops.

transformers' logits processors take one value per batch (one temperature, one top_p), so a
batch whose calls asked for different ones would run them per call; here each parameter is a
column of per-row values instead. The rules are transformers' own, in its order: the
repetition penalty (on every token the row has seen, prompt included: a positive score is
divided by it, a negative one multiplied), then temperature, top-k and top-p (the smallest
set of tokens whose probability reaches `top_p`, never empty). A row with temperature 0
(below `MIN_TEMPERATURE`) takes the highest score (greedy). Each sampling row draws from its
own `torch.Generator`, seeded by its call, so a seed gives the same tokens whatever else
shares the batch.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

#: Temperatures below this are greedy: dividing float32 scores by less overflows them.
MIN_TEMPERATURE = 1e-4


@dataclass(frozen=True)
class Choice:
    """How one row picks its tokens."""

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    repetition_penalty: float = 1.0

    @property
    def greedy(self) -> bool:
        """Temperature 0, or one so small that float32 scores would overflow by it."""
        return self.temperature < MIN_TEMPERATURE


class Columns:
    """The per-row parameters of a batch as tensors on its device, built once per membership."""

    def __init__(self, choices: Sequence[Choice], device: torch.device) -> None:
        self.greedy = [c.greedy for c in choices]
        self.all_greedy = all(self.greedy)
        penalties = [c.repetition_penalty for c in choices]
        self.penalised = any(p != 1.0 for p in penalties)
        self.penalty = torch.tensor(penalties, dtype=torch.float32, device=device)[:, None]
        temps = [1.0 if c.greedy else c.temperature for c in choices]
        self.temperature = torch.tensor(temps, dtype=torch.float32, device=device)[:, None]
        self.top_k = [c.top_k for c in choices]
        self.filter_k = any(k > 0 for k in self.top_k)
        self.top_p = torch.tensor([c.top_p for c in choices], dtype=torch.float32, device=device)
        self.filter_p = any(c.top_p < 1.0 for c in choices)


def pick(
    logits: torch.Tensor,
    columns: Columns,
    seen: torch.Tensor,
    generators: Sequence[torch.Generator | None],
) -> list[int]:
    """The next token of each row of `logits` [rows, vocab]; `seen` [rows, vocab] marks the
    tokens each row has had (for the repetition penalty)."""
    scores = logits.float()
    if columns.penalised:
        penalised = torch.where(scores > 0, scores / columns.penalty, scores * columns.penalty)
        scores = torch.where(seen, penalised, scores)
    greedy = scores.nan_to_num(nan=float("-inf")).argmax(dim=-1)  # NaN is no one's best
    if columns.all_greedy:
        return [int(t) for t in greedy.tolist()]
    scores = scores / columns.temperature
    if columns.filter_k:
        scores = _top_k(scores, columns.top_k)
    probs = torch.softmax(scores, dim=-1)
    if columns.filter_p:
        probs = _top_p(probs, columns.top_p)
    # One draw per sampling row (its own generator), then one read back to the host; a
    # row whose probabilities overflowed keeps its best token.
    finite = torch.isfinite(probs).all(dim=-1, keepdim=True)
    best = torch.zeros_like(probs).scatter_(1, greedy[:, None], 1.0)
    probs = torch.where(finite, probs, best)
    rows = [row for row in range(len(generators)) if not columns.greedy[row]]
    chosen = greedy.clone()
    if rows:
        draws = [torch.multinomial(probs[row], 1, generator=generators[row]) for row in rows]
        chosen[torch.tensor(rows, device=greedy.device)] = torch.cat(draws)
    return [int(t) for t in chosen.tolist()]


def _top_k(scores: torch.Tensor, top_k: Sequence[int]) -> torch.Tensor:
    """Scores below each row's k-th best set to -inf (rows with k 0 untouched)."""
    vocab = scores.shape[-1]
    ks = torch.tensor([min(k, vocab) if k > 0 else vocab for k in top_k], device=scores.device)[
        :, None
    ]
    ordered = scores.sort(dim=-1, descending=True).values
    threshold = ordered.gather(-1, ks - 1)
    return scores.masked_fill(scores < threshold, float("-inf"))


def _top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Each row's smallest set of most likely tokens whose mass reaches its top_p,
    renormalised; the most likely token is always kept."""
    ordered, order = probs.sort(dim=-1, descending=True)
    before = ordered.cumsum(dim=-1) - ordered  # the mass of the tokens ahead of each one
    drop = before >= top_p[:, None]
    drop[:, 0] = False
    ordered = ordered.masked_fill(drop, 0.0)
    kept = torch.zeros_like(probs).scatter(-1, order, ordered)
    return kept / kept.sum(dim=-1, keepdim=True)


def generator_for(seed: int, device: torch.device) -> torch.Generator:
    """A generator on `device` seeded with `seed`."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator
