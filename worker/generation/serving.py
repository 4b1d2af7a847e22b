"""Generating calls on one replica: feed them to its engine as they arrive, answer each as
it ends.

A call holds one or more prompts (or one chat); each prompt is a sequence of the engine
(`worker.generation.engine`), and the call is answered when its last sequence ends. Where
calls come from, and where answers and streamed text go, is the caller's `Feed`: the Celery
side feeds calls that reach the worker while the batch runs (`tasks.serving.batching`), a
one-shot caller feeds a fixed list (`run_calls`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Protocol, cast

from placement.errors import PayloadError
from worker.generation.chat import prompt_ids
from worker.generation.engine import Engine, Options, Sequence_
from worker.generation.params import validate

log = logging.getLogger(__name__)

#: How long an idle engine waits for a new call before asking its feed whether to go on.
IDLE_WAIT_S = 0.005


@dataclass
class GenCall:
    """One generating call: its payload, where its text streams, and when it must end."""

    key: str
    inputs: object
    params: object
    on_text: Callable[[int, str], None] | None = None  # (prompt index, new text)
    deadline: float | None = None  # time.monotonic() after which it ends "cancelled"


@dataclass(frozen=True)
class Generated:
    """A call's answer: its outputs (the handlers' result shape) and what it took."""

    outputs: dict[str, Any]
    compute_ms: float  # from reaching the engine to its end
    first_token_ms: float  # from reaching the engine to its first token
    inter_token_ms: float  # mean gap between its later tokens
    tokens: int
    cancelled: bool = False


class Feed(Protocol):
    """Where an engine's calls come from and its answers go."""

    def take(self, wait: float) -> list[GenCall]:
        """Calls that arrived since the last take (waiting up to `wait` s when none)."""
        ...

    def cancelled(self) -> Iterable[str]:
        """Keys of calls to stop now."""
        ...

    def finished(self, call: GenCall, outcome: Generated | BaseException) -> None:
        """A call ended: its answer, or the error that fails it."""
        ...

    def more(self) -> bool:
        """Whether calls may still come (False: end once the engine is idle)."""
        ...

    def holding(self, tokens: int) -> None:
        """After each step: the KV-cache tokens the batch holds now."""
        ...

    def streamed(self) -> None:
        """Mid-step, after new prompts' first tokens: send the streamed text so far."""
        ...


@dataclass
class _Running:
    call: GenCall
    sequences: list[Sequence_]
    since: float = field(default_factory=time.monotonic)


def serve(engine: Engine, feed: Feed, template: str | None) -> None:
    """Run calls from `feed` on `engine` until the feed has no more and the engine is idle.

    A bad payload fails its own call at once; an error of the model itself propagates, and
    the feed's owner fails the calls it fed (the batch's state is unknown after it).
    """
    running: dict[str, _Running] = {}
    engine.after_prefill = feed.streamed
    while True:
        arrived = []
        for call in feed.take(0.0 if engine.busy else IDLE_WAIT_S):
            try:
                arrived.append(_Running(call, _sequences(engine, call, template)))
            except PayloadError as exc:
                feed.finished(call, exc)
        # Calls that arrived together queue shortest prompt first (the least mean time to
        # first token); none overtakes a call that arrived before it.
        for entry in sorted(arrived, key=lambda e: sum(len(s.prompt) for s in e.sequences)):
            running[entry.call.key] = entry
            for sequence in entry.sequences:
                engine.add(sequence)
        for key in feed.cancelled():
            for sequence in running[key].sequences if key in running else ():
                engine.cancel(sequence.key)
        if not engine.busy:
            if not feed.more():
                return
            continue
        ended = engine.step()  # an error of the model propagates: the caller fails the
        # calls it fed (after checking for a fatal CUDA error, which restarts the process)
        feed.holding(engine.held_tokens)
        for sequence in ended:
            call_key, _ = cast(tuple[str, int], sequence.key)
            done = running.get(call_key)
            if done is not None and all(s.done for s in done.sequences):
                del running[call_key]
                feed.finished(done.call, _answer(done))


def _sequences(engine: Engine, call: GenCall, template: str | None) -> list[Sequence_]:
    """The call's prompts as sequences, checked against the engine (all or none)."""
    prompts, params = validate(call.inputs, call.params)
    options = Options.from_params(params)
    sequences = []
    for index, prompt in enumerate(prompts):
        on_text = None
        if call.on_text is not None:
            on_text = _streamer(call.on_text, index)
        ids = prompt_ids(engine.tokenizer, prompt, template)
        sequences.append(Sequence_((call.key, index), ids, options, on_text, call.deadline))
    for index, sequence in enumerate(sequences):
        try:
            engine.check(sequence)
        except PayloadError as exc:
            if len(sequences) > 1:
                raise PayloadError(f"inputs[{index}]: {exc}") from None
            raise
    return sequences


def _streamer(on_text: Callable[[int, str], None], index: int) -> Callable[[str], None]:
    return lambda text: on_text(index, text)


def _answer(entry: _Running) -> Generated:
    sequences = entry.sequences
    firsts = [s.first_token for s in sequences if s.first_token is not None]
    now = time.monotonic()
    tokens = sum(len(s.tokens) for s in sequences)
    later = max(0, len(sequences[0].tokens) - 1)
    first = sequences[0].first_token
    return Generated(
        outputs={
            "texts": [s.text.text if s.text is not None else "" for s in sequences],
            "tokens": [list(s.tokens) for s in sequences],
            "finish_reasons": [s.finish for s in sequences],
            "batch": len(sequences),
        },
        compute_ms=(now - entry.since) * 1000,
        first_token_ms=(min(firsts) - entry.since) * 1000 if firsts else 0.0,
        inter_token_ms=((now - first) * 1000 / later) if first is not None and later else 0.0,
        tokens=tokens,
        cancelled=any(s.finish == "cancelled" for s in sequences),
    )


class Fixed:
    """A feed of a fixed list of calls: a one-shot batch (`run_calls`)."""

    def __init__(self, calls: list[GenCall]) -> None:
        self._calls = calls
        self.outcomes: dict[str, Generated | BaseException] = {}

    def take(self, wait: float) -> list[GenCall]:
        calls, self._calls = self._calls, []
        return calls

    def cancelled(self) -> Iterable[str]:
        return ()

    def finished(self, call: GenCall, outcome: Generated | BaseException) -> None:
        self.outcomes[call.key] = outcome

    def more(self) -> bool:
        return bool(self._calls)

    def holding(self, tokens: int) -> None:
        pass

    def streamed(self) -> None:
        pass


def run_calls(engine: Engine, calls: list[GenCall], template: str | None) -> list[Any]:
    """Run `calls` together to their end: each one's `Generated` or error, in order."""
    feed = Fixed(calls)
    serve(engine, feed, template)
    return [feed.outcomes[call.key] for call in calls]
