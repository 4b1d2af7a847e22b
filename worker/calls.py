"""How calls reach the replicas a GPU worker process holds (`worker.residency`).

Encoder calls for one replica share forward passes: a bad payload fails its own call
before any pass; calls with equal params share a pass, cut so that the activations each
is estimated to need fit in what the reservation leaves free (`worker.passes`); a pass
that fails runs again one call at a time, so an error reaches only the calls it concerns.
A generation replica is held for its calls as an `OpenEngine` (its lock, so the keeper
moves it only once its generations end, and its paged KV cache), stepped by a session
(`worker.session`) or, for a batch, here to its end.

Every pass runs inside a measuring span (`worker.measuring`) and may report a larger
learned peak; a load's warm-up pass runs inside the load's own span (`warm_up`).
"""

from __future__ import annotations

import json
import logging
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from placement.errors import EvictedError, PayloadError
from placement.rules.batching import UNBATCHED_TASKS
from worker import handlers, loading
from worker.caps import DeviceCaps, allocated_on, peak_allocated
from worker.generation import serving as generation
from worker.generation.engine import Engine
from worker.generation.replica import adapter_room, replica_engine
from worker.generation.serving import GenCall
from worker.lifecycle import exit_for_restart, is_fatal_cuda_error
from worker.measuring import Learned, Span, Spans
from worker.passes import Dims, for_pass, longest_tokens, threads_here, token_bound, use_threads
from worker.resident import Resident

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Ran:
    """One call's part in a batch: its outputs, or the error that fails it alone."""

    outputs: dict[str, Any]  # empty when it failed
    error: BaseException | None
    batch: int  # calls that shared its forward pass
    compute_ms: float


_Member = tuple[int, list[str]]  # a call's position in its batch, and its texts


@dataclass
class OpenEngine:
    """A generation replica held for its calls (`Calls.open_engine`): its engine,
    its chat template and GPUs, and the CPU threads its steps run on (0: as they are);
    `close` (or leaving a `with`) gives the replica back."""

    replica: str
    epoch: int
    engine: Engine
    template: str | None
    gpus: list[str]
    threads: int
    _held: ExitStack = field(repr=False)

    def own_threads(self) -> None:
        """Give this thread's torch the engine's threads before a step: a one-shot pass
        between two steps sets the threads its own size wants (`worker.passes.for_pass`)."""
        use_threads(self.threads)

    def close(self) -> None:
        self._held.close()

    def __enter__(self) -> OpenEngine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


class Holder(Protocol):
    """What `Calls` needs of the replicas a process holds (`worker.residency`)."""

    @property
    def device_caps(self) -> DeviceCaps: ...

    @property
    def spans(self) -> Spans: ...

    @property
    def learned(self) -> Learned: ...

    def hot_resident(self, replica: str) -> Resident:
        """The HOT replica `replica`, else `EvictedError`."""


def fail_for(exc: BaseException) -> None:
    """What an error of a model's pass means for the process: a fatal CUDA error restarts
    it (the context is lost); any other leaves the error to its calls, its frames freed
    (they hold the pass's tensors)."""
    if is_fatal_cuda_error(exc):
        exit_for_restart(exc)
    traceback.clear_frames(exc.__traceback__)


class Calls:
    """Runs calls on the HOT replicas `held` keeps, each under the replica's lock (so a
    replica never moves under a running call).

    `threads` is torch's CPU threads for a pass (`worker.passes`; 0: as is); `graphs`
    False keeps generation models' decode steps out of CUDA graphs
    (`worker.generation.kv.graphs`, on by default on CUDA);
    `whole_pass_errors` concern a whole pass, not one of its calls (a time limit): they
    fail every call of the pass at once instead of a retry one call at a time.
    """

    def __init__(
        self,
        held: Holder,
        *,
        threads: int = 0,
        graphs: bool = True,
        whole_pass_errors: tuple[type[BaseException], ...] = (),
    ) -> None:
        self.held = held
        self.threads = threads
        self.graphs = graphs
        self.whole_pass_errors = whole_pass_errors
        self._warming = threading.local()  # `.load`: a load's warm-up pass runs now

    def warm_up(self, replica: str, inputs: str) -> None:
        """Run a load's warm-up call, its pass inside the load's span rather than its own
        (the load measures the two together)."""
        self._warming.load = True
        try:
            self.infer(replica, inputs)
        finally:
            self._warming.load = False

    def infer(
        self, replica: str, inputs: object, params: object | None = None, epoch: int = 0
    ) -> dict[str, Any]:
        """Run one request on a HOT replica; see `run`."""
        return self.run(replica, inputs, params, epoch)[0]

    def run(
        self, replica: str, inputs: object, params: object | None = None, epoch: int = 0
    ) -> tuple[dict[str, Any], list[str]]:
        """Run one request on a HOT replica: its outputs and the GPUs it ran on.

        A replica that is not HOT here, or not in placement `epoch` (when given), raises
        `EvictedError`: the call is routed again rather than served from a stale copy.
        """
        ran, gpus = self.run_batch(replica, [(inputs, params)], epoch)
        if ran[0].error is not None:
            raise ran[0].error
        return ran[0].outputs, gpus

    def open_engine(self, replica: str, epoch: int = 0, *, wait: bool = True) -> OpenEngine | None:
        """Hold a HOT replica of a generation model for its calls: its lock (so the keeper
        moves it only once its generations end: drain before evict) and one span, until
        the `OpenEngine` is closed; with it, its engine. Raises `EvictedError` as `run`
        does. Without `wait`, None while the keeper holds the lock (it is moving the
        replica): a session does not stall its other engines for that."""
        resident = self.held.hot_resident(replica)
        if not resident.lock.acquire(blocking=wait):
            return None
        held = ExitStack()
        held.callback(resident.lock.release)
        try:
            # One span for the whole generation: its KV cache and activations come and go
            # while it runs, so no load or pass beside it may keep a figure (`measuring`).
            held.enter_context(self.held.spans.span())
            plan, simulated = self._serving(resident, epoch)
            threads = threads_here(self.threads)
            use_threads(threads)
            device = loading.torch_device(min(plan), simulated)
            engine = replica_engine(
                resident.model, resident.tokenizer, resident.spec, device, resident.kv,
                graphs=None if self.graphs else False,
            )  # fmt: skip
            resident.kv = engine.kv
            if resident.adapters is None:
                resident.adapters = adapter_room(resident.model, resident.spec)
            else:
                # no other engine holds it now (the replica's lock): calls of one that
                # failed mid-step may have left their pins
                resident.adapters.unpin_all()
            engine.adapters = resident.adapters
        except BaseException:
            held.close()
            raise
        return OpenEngine(
            replica, resident.epoch, engine, resident.spec.chat_template, sorted(resident.slots),
            threads, held,
        )  # fmt: skip

    def run_batch(
        self, replica: str, requests: Sequence[tuple[object, object | None]], epoch: int = 0
    ) -> tuple[list[Ran], list[str]]:
        """Run several requests on a HOT replica, sharing forward passes: each one's outcome,
        in order, and the GPUs they ran on.

        A bad payload fails its own call before any pass. Calls with equal params share a
        pass, split so that the activations each pass is estimated to need fit in what the
        reservation leaves free; a pass that fails is run again one call at a time, so an
        error reaches only the calls it concerns (but `whole_pass_errors` fail the pass's
        calls at once). Raises `EvictedError` as `run` does.
        """
        resident = self.held.hot_resident(replica)
        if resident.spec.task == "text-generation":
            return self._generate_batch(replica, requests, epoch)
        with resident.lock:
            plan, simulated = self._serving(resident, epoch)
            task = resident.spec.task
            ran: list[Ran | None] = [None] * len(requests)
            groups: dict[str, tuple[dict[str, Any], list[_Member]]] = {}
            for index, (inputs, params) in enumerate(requests):
                try:
                    texts, options = handlers.validate(task, inputs, params)
                    handlers.check_texts(task, resident.tokenizer, texts)
                except PayloadError as exc:
                    ran[index] = Ran({}, exc, 1, 0.0)
                    continue
                key = json.dumps(options, sort_keys=True)
                groups.setdefault(key, (options, []))[1].append((index, texts))
            # The room for activations sizes batches only: one call runs alone anyway.
            batched = sum(len(members) for _, members in groups.values()) > 1
            free = self.held.device_caps.free(min(plan), simulated) if batched else 0
            for options, members in groups.values():
                for chunk in _chunks(resident, members, free):
                    self._run_chunk(resident, plan, simulated, chunk, options, ran)
            return [r for r in ran if r is not None], sorted(resident.slots)

    def _serving(self, resident: Resident, epoch: int) -> tuple[dict[int, int], bool]:
        """Under the replica's lock: its plan, once it is still HOT here in placement `epoch`
        (else `EvictedError`), with this thread's kernels on its first GPU."""
        if resident.warm or (epoch and resident.epoch != epoch):
            raise EvictedError(
                f"replica {resident.replica} left this worker's GPUs (or was placed again) "
                f"before the request reached it; route the request again"
            )
        plan, simulated = self.held.device_caps.plan(resident.slots)
        if not simulated:
            torch.cuda.set_device(min(plan))
        return plan, simulated

    def _generate_batch(
        self, replica: str, requests: Sequence[tuple[object, object | None]], epoch: int
    ) -> tuple[list[Ran], list[str]]:
        """`run_batch` for a generation model: the calls as one continuous batch."""
        calls = [GenCall(str(i), inputs, params) for i, (inputs, params) in enumerate(requests)]
        start = time.perf_counter()
        opened = self.open_engine(replica, epoch)
        assert opened is not None  # it waited for the lock
        with opened:
            try:
                outcomes = generation.run_calls(opened.engine, calls, opened.template)
            except Exception as exc:
                fail_for(exc)
                raise
        ms = (time.perf_counter() - start) * 1000
        ran = []
        for outcome in outcomes:
            if isinstance(outcome, BaseException):
                ran.append(Ran({}, outcome, len(calls), ms))
            else:
                ran.append(Ran(dict(outcome.outputs), None, len(calls), ms))
        return ran, opened.gpus

    def _run_chunk(  # noqa: PLR0917 - one pass's whole context
        self,
        resident: Resident,
        plan: Mapping[int, int],
        simulated: bool,
        chunk: list[_Member],
        options: dict[str, Any],
        ran: list[Ran | None],
        outer: Span | None = None,
    ) -> None:
        """One forward pass for `chunk`; on failure, each of its calls alone (in the
        failed pass's span, `outer`)."""
        learned = self.held.learned
        with self._pass_span(outer) as span:
            texts = [member[1] for member in chunk]
            flat = [text for call in texts for text in call]
            need = activation_bytes(resident.dims, flat) if simulated else 0
            start = time.perf_counter()
            try:
                if simulated:
                    self.held.device_caps.check_activations(need, min(plan))
                # On CUDA, read the memory statistics only for a pass that may report a
                # learned figure: each read builds a dict of every allocator counter.
                learning = span is not None and not simulated and learned.learns(resident.spec)
                before = {}
                if learning and span is not None:
                    # reset the peaks only while nothing else runs
                    before = allocated_on(plan, reset=self.held.spans.clean(span))
                self._set_threads(resident, flat)
                start = time.perf_counter()  # the pass's own time, not its admission's
                results = handlers.run_many(
                    resident.spec.task,
                    resident.model,
                    resident.tokenizer,
                    texts,
                    options,
                    loading.torch_device(min(plan), simulated),
                )
            except Exception as exc:
                # The pass's frames hold its activations (on the GPU) for as long as the error
                # lives, which is until Celery has answered every call it fails.
                fail_for(exc)
                if len(chunk) == 1 or isinstance(exc, self.whole_pass_errors):
                    ms = (time.perf_counter() - start) * 1000
                    for index, _ in chunk:
                        ran[index] = Ran({}, exc, len(chunk), ms)
                    return
                log.info(
                    "a pass of %d calls on %s failed (%s: %s); running them one at a time",
                    len(chunk), resident.replica, type(exc).__name__, exc,
                )  # fmt: skip
                for member in chunk:
                    self._run_chunk(resident, plan, simulated, [member], options, ran, span)
                return
            compute_ms = (time.perf_counter() - start) * 1000
            if simulated:
                learned.learn_from(resident.spec, need)
            elif learning and span is not None and self.held.spans.clean(span):  # its own peak
                learned.learn_from(resident.spec, sum(peak_allocated(i) - before[i] for i in plan))
            for (index, _), result in zip(chunk, results, strict=True):
                ran[index] = Ran(result, None, len(chunk), compute_ms)

    def _set_threads(self, resident: Resident, texts: list[str]) -> None:
        """Give this thread's torch the threads the pass should run on (`worker.passes`)."""
        if self.threads:
            use_threads(for_pass(self.threads, resident.dims, texts))

    def _pass_span(self, outer: Span | None) -> AbstractContextManager[Span | None]:
        """A pass's span: a new one, or `outer`, the failed pass's that a retry runs in;
        none for a load's warm-up pass, which runs in the load's."""
        if outer is not None or getattr(self._warming, "load", False):
            return nullcontext(outer)
        return self.held.spans.span()


def _chunks(resident: Resident, members: list[_Member], free: int) -> Iterator[list[_Member]]:
    """`members` in order, cut into passes whose estimated activations fit in `free` bytes
    (a call that alone does not fit runs alone); one call per pass for unbatched tasks."""
    alone = resident.spec.task in UNBATCHED_TASKS
    chunk: list[_Member] = []
    rows = longest = 0
    for member in members:
        lengths = [token_bound(text) for text in member[1]]
        more_rows, more_longest = rows + len(lengths), max([longest, *lengths])
        if chunk and (alone or resident.dims.activation_bytes(more_rows, more_longest) > free):
            yield chunk
            chunk, more_rows, more_longest = [], len(lengths), max(lengths, default=0)
        chunk.append(member)
        rows, longest = more_rows, more_longest
    if chunk:
        yield chunk


def activation_bytes(dims: Dims, inputs: object) -> int:
    """The worker's estimate of a pass's activation memory for `inputs` (`worker.passes`)."""
    texts = [inputs] if isinstance(inputs, str) else inputs if isinstance(inputs, list) else []
    texts = [t for t in texts if isinstance(t, str)]
    return dims.activation_bytes(len(texts), longest_tokens(texts))
