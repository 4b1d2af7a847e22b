"""A generated sequence's text as its tokens come: stop strings, and the part safe to stream.

Each new token decodes the whole generated tail again (at most MAX_NEW_TOKENS tokens, fast
next to a decode step), because a token's own text depends on its neighbours (multi-byte
characters split over tokens, spaces a tokenizer merges). Text is streamed only once it
cannot change: not the U+FFFD an incomplete character decodes to while it ends the text
(at most three: a UTF-8 character's bytes before its last), and not the part that could
still become the start of a stop string. So the chunks joined equal the final
text. A stop string ends the text before it (OpenAI's rule; transformers' `stop_strings`
keeps it); the tokens end with the one that completed it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
_PENDING = 3


class Detokenizer:
    """The text of one sequence's generated tokens, checked for stops as it grows."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""  # everything decoded so far (cut at a stop once one is seen)
        self.streamed = 0  # characters of `text` handed out by `delta`
        self.stopped = False

    def update(self, tokens: Sequence[int]) -> None:
        """Decode `tokens` (the whole generated tail) and look for a stop string."""
        previous = len(self.text)
        text = self._tokenizer.decode(list(tokens), skip_special_tokens=True)
        if self._stops:
            start = max(0, min(previous, len(text)) - self._longest)
            found = [i for i in (text.find(s, start) for s in self._stops) if i >= 0]
            if found:
                text = text[: min(found)]
                self.stopped = True
        self.text = text

    def delta(self, final: bool = False) -> str:
        """The text not handed out yet that can no longer change (all of it when `final`)."""
        safe = len(self.text) if final or self.stopped else self._stable_end()
        if safe <= self.streamed:
            return ""
        chunk = self.text[self.streamed : safe]
        self.streamed = safe
        return chunk

    def _stable_end(self) -> int:
        text = self.text
        end = len(text)
        # An incomplete character decodes as U+FFFD until its last byte comes; one UTF-8
        # character has at most 3 bytes before its last, so at most 3 are held back.
        while end > max(self.streamed, len(text) - _PENDING) and text[end - 1] == _REPLACEMENT:
            end -= 1
        for stop in self._stops:  # hold back a tail that may grow into a stop
            for size in range(min(len(stop) - 1, end), 0, -1):
                if text.endswith(stop[:size], 0, end):
                    end -= size
                    break
        return max(end, self.streamed)
