"""Generating calls on one replica: feed them to its engine as they arrive, answer each as
it ends.

A call holds one or more prompts (or one chat); each prompt is a sequence of the engine
(`worker.generation.engine`), and the call is answered when its last sequence ends. A
`Driver` does this for one engine; who steps it, and where calls come from, is its owner's:
a GPU worker's session steps every engine it holds in turn (`worker.session`), a one-shot
caller runs a fixed list to its end (`run_calls`).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Hashable, Iterable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from placement.errors import GpufleetError, PayloadError
from worker.adapters.room import RoomFull
from worker.generation.chat import prompt_ids
from worker.generation.engine import Engine, Options, Sequence_
from worker.generation.params import validate

log = logging.getLogger(__name__)


@dataclass
class GenCall:
    """One generating call: its payload, where its text streams, and when it must end."""

    key: str
    inputs: object
    params: object
    on_text: Callable[[int, str], None] | None = None  # (prompt index, new text)
    deadline: float | None = None  # time.monotonic() after which it ends "cancelled"
    replica: str = ""  # where it runs, as placed in `epoch` (0: as placed now)
    epoch: int = 0
    # when it reached this process, or its replica became ready here if it waited for that
    received: float = field(default_factory=time.monotonic)
    owner: Hashable | None = None  # who its rows are shared under: its tenant (None: itself)
    weight: float = 1.0  # the owner's weight


@dataclass(frozen=True)
class Generated:
    """A call's answer: its outputs (the handlers' result shape) and what it took."""

    outputs: dict[str, Any]
    compute_ms: float  # from reaching the engine to its end
    first_token_ms: float  # from reaching the engine to its first token
    join_ms: float  # from reaching this process to the engine's first step after it
    prefill_wait_ms: float  # from reaching the engine to the step that began its prefill
    inter_token_ms: float  # mean gap between its later tokens
    tokens: int
    cancelled: bool = False


@dataclass
class _Running:
    call: GenCall
    sequences: list[Sequence_]
    since: float = field(default_factory=time.monotonic)
    adapter: str | None = None  # the adapter slot it holds, until it ends


class Driver:
    """One engine's calls: each goes in as its prompts' sequences, and is answered by
    `finished` (its `Generated`, or the error that fails it) once its last sequence ends.
    A bad payload fails its own call at once; an error of the model itself propagates
    from `step` (the batch's state is unknown after it: `fail` answers every call left)."""

    def __init__(
        self,
        engine: Engine,
        template: str | None,
        finished: Callable[[GenCall, Generated | BaseException], None],
    ) -> None:
        self.engine = engine
        self.template = template
        self._finished = finished
        self._running: dict[str, _Running] = {}
        self._parked: list[_Running] = []  # waiting for an adapter slot, in arrival order

    @property
    def busy(self) -> bool:
        return self.engine.busy or bool(self._parked)

    @property
    def calls(self) -> int:
        """Calls added and not answered yet."""
        return len(self._running) + len(self._parked)

    def add(self, calls: Iterable[GenCall]) -> None:
        """Queue calls that arrived together, shortest prompt first (the least mean time
        to first token); none overtakes a call added before it. A call of an adapter
        whose slot is not free yet waits for one, after those that waited before it."""
        arrived = []
        for call in calls:
            try:
                arrived.append(_Running(call, _sequences(self.engine, call, self.template)))
            except Exception as exc:  # a bad payload, or its prompt's encoding failed
                self._reply(call, exc)
        self._parked += sorted(arrived, key=lambda e: sum(len(s.prompt) for s in e.sequences))
        self._unpark()

    def cancel(self, key: str) -> None:
        """Stop call `key` at the next step, if it is one of these."""
        for parked in self._parked:
            if parked.call.key == key:
                self._parked.remove(parked)
                self._reply(parked.call, _cancelled(parked))
                return
        entry = self._running.get(key)
        for sequence in entry.sequences if entry is not None else ():
            self.engine.cancel(sequence.key)

    def step(self) -> None:
        """One step of the engine (its model's error propagates: `fail`); answer the calls
        whose last sequence ended in it."""
        self._unpark()
        for sequence in self.engine.step():
            call_key, _ = cast(tuple[str, int], sequence.key)
            done = self._running.get(call_key)
            if done is not None and all(s.done for s in done.sequences):
                del self._running[call_key]
                self._let_go(done)
                self._reply(done.call, _answer(done))

    def fail(self, error: BaseException) -> None:
        """Answer every call left with `error` (the engine failed)."""
        running, self._running = self._running, {}
        parked, self._parked = self._parked, []
        for entry in running.values():
            self._let_go(entry)
            self._reply(entry.call, error)
        for entry in parked:
            self._reply(entry.call, error)

    def _start(self, entry: _Running) -> None:
        self._running[entry.call.key] = entry
        for sequence in entry.sequences:
            self.engine.add(sequence)

    def _unpark(self) -> None:
        """Start the calls waiting here, in their order, once their adapter is in a slot or
        gets one. Once one waits for a slot, later calls of adapters wait behind it (so
        calls of held adapters do not keep it out for good); calls of the base go on. A
        call past its deadline ends cancelled; one whose start fails gets that error."""
        if not self._parked:  # the common step: nothing waits for a slot
            return
        waiting: list[_Running] = []
        pending, self._parked = self._parked, []
        blocked = False
        now = time.monotonic()
        try:
            while pending:
                entry = pending.pop(0)
                if entry.call.deadline is not None and now >= entry.call.deadline:
                    self._reply(entry.call, _cancelled(entry))
                    continue
                if blocked and entry.sequences[0].adapter is not None:
                    waiting.append(entry)
                    continue
                try:
                    held = self._hold_adapter(entry)
                    if held:
                        self._start(entry)
                except Exception as exc:  # its adapter's copy, or its sequences' add
                    if self._running.pop(entry.call.key, None) is not None:
                        for sequence in entry.sequences:
                            self.engine.cancel(sequence.key)
                    self._let_go(entry)
                    self._reply(entry.call, exc)
                    continue
                if held is False:
                    waiting.append(entry)
                    blocked = True
        finally:
            self._parked = waiting + pending

    def _hold_adapter(self, entry: _Running) -> bool | None:
        """Hold the call's adapter in a slot of the replica (`worker.adapters.room`):
        True once held (or when it runs the base); False while every slot holds one in
        use; None when its adapter is unknown, bad or unfit, the call answered with why."""
        adapter = entry.sequences[0].adapter
        if adapter is None:
            return True
        room = self.engine.adapters
        try:
            if room is None:
                raise PayloadError(
                    "this model serves no adapters; call it by its own name, or ask the"
                    " fleet's operator to list adapters for it"
                )
            room.acquire(adapter)
        except RoomFull:
            return False
        except GpufleetError as exc:
            self._reply(entry.call, exc)
            return None
        entry.adapter = adapter
        for sequence in entry.sequences:
            sequence.salt += room.key_of(adapter)  # after its tenant's (`_sequences`)
        return True

    def _let_go(self, entry: _Running) -> None:
        """The call's adapter slot is free for others (the call has ended)."""
        if entry.adapter is not None and self.engine.adapters is not None:
            self.engine.adapters.release(entry.adapter)
            entry.adapter = None

    def _reply(self, call: GenCall, outcome: Generated | BaseException) -> None:
        """`finished`, whose own failure is that call's alone, never the engine's."""
        try:
            self._finished(call, outcome)
        except Exception:
            log.exception("could not answer generating call %s", call.key)


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
        own = options  # max_new_tokens null: as many as the model holds
        if params["max_new_tokens"] is None:
            own = replace(options, max_new_tokens=engine.room(len(ids)))
        sequence = Sequence_((call.key, index), ids, own, on_text, call.deadline)
        sequence.owner, sequence.weight = call.owner, call.weight
        sequence.adapter = params["adapter"]
        sequence.salt = _salt_of(call.owner)
        sequences.append(sequence)
    for index, sequence in enumerate(sequences):
        try:
            engine.check(sequence)
        except PayloadError as exc:
            if len(sequences) > 1:
                raise PayloadError(f"inputs[{index}]: {exc}") from None
            raise
    return sequences


def _salt_of(owner: Hashable | None) -> bytes:
    """Where the block keys of a call's rows start: a tenant's prompts share cached blocks
    only with the same tenant's (a hit would tell one tenant what another sent, as vLLM's
    `cache_salt` keeps apart); calls of no tenant share with each other."""
    return b"" if owner is None else repr(owner).encode() + b"\0"


def _streamer(on_text: Callable[[int, str], None], index: int) -> Callable[[str], None]:
    return lambda text: on_text(index, text)


def unstarted() -> Generated:
    """The answer of a call cancelled before it reached an engine: nothing generated."""
    return Generated(
        outputs={"texts": [], "tokens": [], "prompt_tokens": [], "finish_reasons": [], "batch": 0},
        compute_ms=0.0, first_token_ms=0.0, join_ms=0.0, prefill_wait_ms=0.0,
        inter_token_ms=0.0, tokens=0, cancelled=True,
    )  # fmt: skip


def _cancelled(entry: _Running) -> Generated:
    """The answer of a call that ended before it started (cancelled, or out of time)."""
    for sequence in entry.sequences:
        sequence.finish, sequence.cancelled = "cancelled", True
    return _answer(entry)


def _answer(entry: _Running) -> Generated:
    sequences = entry.sequences
    firsts = [s.first_token for s in sequences if s.first_token is not None]
    admitted = [s.admitted for s in sequences if s.admitted is not None]
    stepped = [s.stepped for s in sequences if s.stepped is not None]
    now = time.monotonic()
    tokens = sum(len(s.tokens) for s in sequences)
    later = max(0, len(sequences[0].tokens) - 1)
    first = sequences[0].first_token
    return Generated(
        outputs={
            "texts": [s.text.text if s.text is not None else "" for s in sequences],
            "tokens": [list(s.tokens) for s in sequences],
            "prompt_tokens": [len(s.prompt) for s in sequences],
            "finish_reasons": [s.finish for s in sequences],
            "batch": len(sequences),
        },
        compute_ms=(now - entry.since) * 1000,
        first_token_ms=(min(firsts) - entry.since) * 1000 if firsts else 0.0,
        join_ms=max(0.0, min(stepped) - entry.call.received) * 1000 if stepped else 0.0,
        prefill_wait_ms=max(0.0, min(admitted) - entry.since) * 1000 if admitted else 0.0,
        inter_token_ms=((now - first) * 1000 / later) if first is not None and later else 0.0,
        tokens=tokens,
        cancelled=any(s.finish == "cancelled" for s in sequences),
    )


def run_calls(engine: Engine, calls: list[GenCall], template: str | None) -> list[Any]:
    """Run `calls` together to their end: each one's `Generated` or error, in order."""
    outcomes: dict[str, Generated | BaseException] = {}
    driver = Driver(engine, template, lambda call, outcome: outcomes.__setitem__(call.key, outcome))
    try:
        driver.add(calls)
        while driver.busy:
            driver.step()
    except BaseException as exc:
        driver.fail(exc)  # every call left gets the error, and lets go of its adapter
        raise
    return [outcomes[call.key] for call in calls]
