"""A sequence of the engine (`worker.generation.engine`): one prompt being continued, and
its generation parameters."""

from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

import torch

from worker.generation import sampling
from worker.generation.kv import blocks
from worker.generation.text import Detokenizer


@dataclass(frozen=True)
class Options:
    """A sequence's generation parameters (`worker.generation.params`), checked."""

    max_new_tokens: int = 16
    choice: sampling.Choice = field(default_factory=sampling.Choice)
    stop: tuple[str, ...] = ()
    seed: int | None = None

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> Options:
        return cls(
            max_new_tokens=params["max_new_tokens"],
            choice=sampling.Choice(
                temperature=params["temperature"],
                top_k=params["top_k"],
                top_p=params["top_p"],
                repetition_penalty=params["repetition_penalty"],
            ),
            stop=tuple(params["stop"]),
            seed=params["seed"],
        )


@dataclass(eq=False)
class Sequence_:
    """One prompt being continued. `on_text` gets the streamable text as it grows."""

    key: Hashable
    prompt: list[int]
    options: Options
    on_text: Callable[[str], None] | None = None
    deadline: float | None = None  # time.monotonic() after which it is cancelled
    tokens: list[int] = field(default_factory=list)
    finish: str = ""  # "stop", "length" or "cancelled" once done
    cancelled: bool = False
    stepped: float | None = None  # when the engine's first step after its add began
    admitted: float | None = None  # when it first left the queue, its prefill begun
    first_token: float | None = None  # when its first token was made
    text: Detokenizer | None = None
    generator: torch.Generator | None = None
    tag: tuple[float, int] = (0.0, 0)  # its place in the fair queue: start tag, then order
    inner: tuple[float, int] = (0.0, 0)  # a tenant's: its place among the tenant's calls
    table: blocks.Table | None = None  # its KV blocks, while admitted (a paged engine)
    resumed: bool = False  # preempted, to be prefilled again with the tokens it made
    owner: Hashable | None = None  # who its rows are shared under (None: its call)
    weight: float = 1.0  # that owner's weight in the share of rows (`worker.generation.turns`)
    adapter: str | None = None  # the LoRA adapter its rows run (`worker.adapters.room`)
    # where its cached blocks' key chain starts: rows of different adapters (or versions
    # of one) compute other keys and values from the same tokens, and tenants' prompts
    # are kept apart, so they share no block (`worker.generation.serving`)
    salt: bytes = b""

    def context(self) -> list[int]:
        """The tokens whose keys and values it holds once admitted (the last token made
        is fed by the next decode step)."""
        return self.prompt + self.tokens[:-1] if self.tokens else self.prompt

    @property
    def flow(self) -> Hashable:
        """The call the sequence belongs to (fairness is between calls)."""
        return self.key[0] if isinstance(self.key, tuple) and self.key else self.key

    @property
    def holder(self) -> Hashable:
        """Who holds its row in the share of rows: its owner (a tenant), else its call."""
        return self.owner if self.owner is not None else self.flow

    @property
    def reach(self) -> int:
        """The most cache positions it can take: its prompt and every token it may make."""
        return len(self.prompt) + self.options.max_new_tokens

    @property
    def done(self) -> bool:
        return bool(self.finish)


__all__ = ["Options", "Sequence_"]
