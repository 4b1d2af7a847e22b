"""A generated sequence's text as its tokens come: stop strings, and the part safe to stream.

A token's text depends on its neighbours (a multi-byte character split over tokens, spaces
a tokenizer merges), so each new token is decoded with the few tokens before it, as vLLM
and transformers' streamers do: the text of `tokens[prefix:]` less that of
`tokens[prefix:read]` is the new piece, taken once it does not end in an incomplete
character (U+FFFD), or after 4 tokens without one (bytes that never make a character). A
step thus decodes a handful of tokens, not the whole tail (which cost 6 ms a step at 64
rows of 511 tokens with a 32k BPE tokenizer). The text is the pieces joined, so what was
streamed is always a prefix of it; a sequence's last piece is decoded whatever it ends in
(`finish`). A stop string ends the text before it (OpenAI's rule; transformers'
`stop_strings` keeps it); the tokens end with the one that completed it. Text that could
still grow into a stop string is held back from the stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

_REPLACEMENT = "\ufffd"
#: A character's rest comes within this many tokens (UTF-8 takes at most 4 bytes, and a
#: byte-level tokenizer at worst one token a byte); past it, U+FFFD is the text.
_MAX_CHAR_TOKENS = 4


class Detokenizer:
    """The text of one sequence's generated tokens, checked for stops as it grows."""

    def __init__(self, tokenizer: Any, stops: Sequence[str]) -> None:
        self._tokenizer = tokenizer
        self._stops = tuple(stops)
        self._longest = max((len(s) for s in self._stops), default=0)
        self.text = ""  # the pieces so far (cut at a stop once one is seen)
        self.streamed = 0  # characters of `text` handed out by `delta`
        self.stopped = False
        self._prefix = 0  # tokens[_prefix:_read] decode to the text's last piece
        self._read = 0  # tokens before this are in `text`

    def update(self, tokens: Sequence[int]) -> None:
        """Take the new tokens at the end of `tokens` (the whole generated tail) into the
        text, unless they end in an incomplete character; look for a stop string."""
        self._take(tokens, last=False)

    def finish(self, tokens: Sequence[int]) -> None:
        """Take whatever is left, complete or not: the sequence ended."""
        self._take(tokens, last=True)

    def _take(self, tokens: Sequence[int], last: bool) -> None:
        if self.stopped or len(tokens) <= self._read:
            return
        decode = self._tokenizer.decode
        known = decode(list(tokens[self._prefix : self._read]), skip_special_tokens=True)
        fresh = decode(list(tokens[self._prefix :]), skip_special_tokens=True)
        waited = len(tokens) - self._read
        incomplete = fresh.endswith(_REPLACEMENT) and waited < _MAX_CHAR_TOKENS
        if len(fresh) <= len(known) or (incomplete and not last):
            return  # nothing new yet, or the rest of a character is still to come
        self._prefix, self._read = self._read, len(tokens)
        previous = len(self.text)
        text = self.text + fresh[len(known) :]
        if self._stops:
            start = max(0, previous - self._longest)
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
        """Where the text may be streamed to: short of a tail that may grow into a stop."""
        end = len(self.text)
        for stop in self._stops:
            for size in range(min(len(stop) - 1, end), 0, -1):
                if self.text.endswith(stop[:size], 0, end):
                    end -= size
                    break
        return max(end, self.streamed)
