"""The models one worker process holds: on its GPUs (HOT) or in its CPU memory (WARM).

The registry decides; this manager does what the ledger says and keeps the process
inside it:
- load a replica onto the GPUs of its plan, warm it up, measure its real peak and
  report it as the model's learned memory;
- offload it to CPU (pinned, so the restore is a fast copy), restore it onto whatever
  GPUs a later plan gives, or drop it;
- cap the process on each device at the bytes the ledger reserves for it there:
  `torch.cuda.set_per_process_memory_fraction` on CUDA, exact byte accounting on
  simulated GPUs, which raise the same `torch.OutOfMemoryError` CUDA raises.

Threads: the worker's keeper (`worker.keeper`) is the only thread that loads, moves or
drops replicas; calls run `infer` from another thread. Each replica has a lock that a
call holds while it computes, so a replica is never moved under a running call.
"""

from __future__ import annotations

import functools
import gc
import json
import logging
import threading
import time
import traceback
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, ExitStack, nullcontext
from dataclasses import dataclass, field
from typing import Any

import torch

from placement.catalog.catalog import ModelSpec
from placement.errors import EvictedError, GpufleetError, PayloadError, PlacementError
from placement.ledger.registry import Registry
from placement.policy.state import Holding, Level
from placement.rules.batching import UNBATCHED_TASKS
from placement.units.memory import format_size
from worker import handlers, loading
from worker.caps import DeviceCaps, allocated, local, peak_allocated, replica_caps
from worker.devices import Device
from worker.generation import serving as generation
from worker.generation.engine import Engine
from worker.generation.paged import Paged
from worker.generation.replica import replica_engine
from worker.generation.serving import GenCall
from worker.lifecycle import exit_for_restart, is_fatal_cuda_error
from worker.measuring import Span, Spans
from worker.passes import Dims, dims_of, for_pass, longest_tokens, token_bound
from worker.warm import sharing
from worker.warm.arena import PinnedArena, Region, registered_chunk, shared_chunk
from worker.warm.sharing import Locator

log = logging.getLogger(__name__)


@dataclass
class Resident:
    """One replica held by this process."""

    replica: str
    spec: ModelSpec
    model: Any
    tokenizer: Any
    slots: dict[str, int]  # ledger GPU id -> reserved bytes; empty while WARM
    accounted: int  # bytes charged on simulated GPUs (a synthetic model's declared size)
    nbytes: int  # its tensors' bytes, measured once at load: moves do not change them
    host_bytes: int  # what its copy takes in host memory once offloaded (pinned: rounded up)
    limit: int = 0  # the ledger's admission limit, when above the reservation
    epoch: int = 0  # the ledger placement it was loaded or restored for
    via: str = ""  # where its load read the weights (`Report.via`)
    header: int = 0  # of `host_bytes`, the room its copy keeps for `worker.warm.sharing`'s header
    region: Region | None = None  # where its warm copy lies in the arena
    shared: Locator | None = None  # where the host's other workers may read its warm copy
    kv: Paged | None = None  # its paged KV cache while HOT: cached prefixes outlive an engine
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    @property
    def warm(self) -> bool:
        return not self.slots

    @functools.cached_property
    def dims(self) -> Dims:
        """What its passes scale with (`worker.passes`), read once."""
        return dims_of(self.model)

    @property
    def caps(self) -> dict[str, int]:
        return replica_caps(self.slots, self.limit)


@dataclass(frozen=True)
class Ran:
    """One call's part in a batch: its outputs, or the error that fails it alone."""

    outputs: dict[str, Any]  # empty when it failed
    error: BaseException | None
    batch: int  # calls that shared its forward pass
    compute_ms: float


_Member = tuple[int, list[str]]  # a call's position in its batch, and its texts


@dataclass(frozen=True)
class Report:
    """What one load, offload or restore took."""

    replica: str
    action: str
    seconds: float
    nbytes: int
    peak_bytes: int | None = None
    devices: list[str] = field(default_factory=list)
    # a load's source: "safetensors", "warm copy", "transformers" or "synthetic"
    via: str | None = None

    @property
    def gbps(self) -> float:
        return self.nbytes / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass
class OpenEngine:
    """A generation replica held for its calls (`ResidencyManager.open_engine`): its engine,
    its chat template and GPUs; `close` (or leaving a `with`) gives the replica back."""

    replica: str
    epoch: int
    engine: Engine
    template: str | None
    gpus: list[str]
    _held: ExitStack = field(repr=False)

    def close(self) -> None:
        self._held.close()

    def __enter__(self) -> OpenEngine:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()


def fail_for(exc: BaseException) -> None:
    """What an error of a model's pass means for the process: a fatal CUDA error restarts
    it (the context is lost); any other leaves the error to its calls, its frames freed
    (they hold the pass's tensors)."""
    if is_fatal_cuda_error(exc):
        exit_for_restart(exc)
    traceback.clear_frames(exc.__traceback__)


class ResidencyManager:
    """Loads, offloads, restores and drops the replicas of one worker process.

    Device indices in plans are local: torch's CUDA index inside this process (which
    differs from the NVML index under CUDA_VISIBLE_DEVICES), or a simulated GPU's index.
    """

    def __init__(
        self,
        devices: list[Device],
        host: str,
        *,
        registry: Registry | None = None,
        warmup: bool = True,
        whole_pass_errors: tuple[type[BaseException], ...] = (),
        threads: int = 0,
        arena_bytes: int = 0,
        publish: bool = False,
    ) -> None:
        self.host = host
        self.threads = threads  # torch's CPU threads for a pass (`worker.passes`); 0: as is
        self.devices = {d.gpu_id(host): d for d in devices}
        self.registry = registry
        self.warmup = warmup
        self.residents: dict[str, Resident] = {}
        self._lock = threading.RLock()  # guards the books below and `residents`
        # What the process may use on each device: the caps of what it holds and of what
        # it is loading or restoring (`worker.caps`).
        self.device_caps = DeviceCaps(
            self.devices, self._lock, lambda: [r.caps for r in self.residents.values()]
        )
        self._pin = torch.cuda.is_available() and not all(d.simulated for d in devices)
        # Warm copies go to host memory pinned ahead of need and reused (`worker.warm.arena`):
        # this process's share of the host's warm cache. Simulated GPUs keep theirs in
        # unpinned chunks of the same kind, so that a neighbour can read them too.
        # Whether warm copies are published to the host's other workers (`worker.warm.sharing`):
        # only where there are some to read them, since a simulated GPU's copy is then
        # copied where it would not move at all, and a published chunk is shared memory.
        self.publish = publish
        self.arena: PinnedArena | None = None
        if arena_bytes and self._pin:
            pin = functools.partial(registered_chunk, shared=publish)
            self.arena = PinnedArena(arena_bytes, pin)
        elif arena_bytes and publish:
            self.arena = PinnedArena(arena_bytes, shared_chunk)
        # Per model: its weights' bytes on the device, and the peak last reported as its
        # learned memory. A call that needs more reports more (`_learn_from`).
        self._weights: dict[str, int] = {}
        self._reported: dict[str, int] = {}
        self._warmed: set[tuple[str, str, int]] = set()  # (model, via, GPUs) warmed up here
        # Loads, moves and passes, so that a CUDA figure counts only when it was alone
        # (`worker.measuring`); `_warming.load` marks a load's own warm-up pass.
        self._spans = Spans()
        self._warming = threading.local()
        # Errors that concern a whole pass, not one of its calls (a time limit): they fail
        # every call of the pass at once instead of a retry one call at a time.
        self.whole_pass_errors = whole_pass_errors

    def contexts(self) -> list[str]:
        """Ledger ids of the GPUs on which this process holds a CUDA context, read without
        opening one: what it declares when it registers again after losing its lease
        (`WorkerLease`), since the ledger then forgot the contexts it keeps on GPUs of
        other workers."""
        opened = getattr(torch._C, "_cuda_hasPrimaryContext", None)
        if opened is None or not torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
            return []
        return [
            gpu_id
            for gpu_id, d in self.devices.items()
            if d.cuda_index is not None and opened(d.cuda_index)
        ]

    # --- the ledger's orders ------------------------------------------------

    def load(
        self,
        spec: ModelSpec,
        replica: str,
        slots: Mapping[str, int],
        limit: int = 0,
        epoch: int = 0,
        *,
        source: str = "",
    ) -> Report:
        """Load a replica onto the GPUs of `slots`, warm it up and measure its peak.

        `limit` is the ledger's admission limit of a one-GPU replica: the process may
        grow to it (admission guaranteed it fits), not only to the reservation. `epoch`
        is the ledger placement it is loaded for. `source` locates a neighbour's warm copy
        to read the weights from instead of the disk (`worker.warm.sharing`; '' for none).
        """
        if replica in self.residents:
            raise PlacementError(f"replica {replica} is already held by this worker")
        plan, simulated = self.device_caps.plan(slots)
        caps = replica_caps(slots, limit)
        accounted = _declared(spec) if spec.synthetic else 0
        with self._spans.span() as span:
            with self._lock:
                self.device_caps.arriving(replica, caps)
                if simulated and accounted:
                    try:
                        # before building, as CUDA would
                        self.device_caps.charge(slots, accounted, spec.name)
                    except torch.OutOfMemoryError:
                        self.device_caps.arrived(replica)
                        raise
            baseline = {} if simulated else self._cuda_allocated(plan, reset=span.alone)
            start = time.perf_counter()
            try:
                built = loading.build(spec, plan, simulated, source)
            except BaseException:
                with self._lock:
                    self.device_caps.uncharge(plan, accounted)
                    self.device_caps.arrived(replica)
                raise
            seconds = time.perf_counter() - start
            nbytes = loading.tensor_bytes(built.model)
            header = sharing.header_room(built.model) if self._shares(built.via) else 0
            if header or (self._pin and not simulated):  # pinned, or a published copy
                host_bytes = loading.pinned_bytes(built.model, self.arena is not None) + header
            else:  # a simulated GPU's copy stays where it is
                host_bytes = nbytes
            with self._lock:
                if simulated and not accounted:
                    accounted = nbytes
                    try:
                        self.device_caps.charge(slots, accounted, spec.name)
                    except torch.OutOfMemoryError:
                        self.device_caps.arrived(replica)
                        raise
                resident = Resident(
                    replica, spec, built.model, built.tokenizer, dict(slots), accounted, nbytes,
                    host_bytes, limit, epoch, built.via, header,
                )  # fmt: skip
                self.residents[replica] = resident
                self.device_caps.arrived(replica)
            peak = self._measure(resident, plan, simulated, baseline, built.via, span)
        self._keep_room()
        log.info(
            "loaded %s (%s) in %.2fs via %s, peak %s",
            spec.name, replica, seconds, built.via, format_size(peak),
        )  # fmt: skip
        return Report(replica, "load", seconds, nbytes, peak, _names(plan, simulated), built.via)

    def offload(self, replica: str) -> Report:
        """Move a HOT replica to CPU memory (WARM) and give its GPU memory back."""
        resident = self._hot(replica)
        with resident.lock, self._spans.span():
            plan, simulated = self.device_caps.plan(resident.slots)
            start = time.perf_counter()
            # a simulated GPU's copy is in CPU memory already: it goes into the arena only
            # to be shared
            if not simulated or resident.header:
                resident.model, resident.region = loading.to_cpu(
                    resident.model, pin=self._pin and not simulated, arena=self.arena,
                    size=resident.host_bytes - resident.header, tail=resident.header,
                )  # fmt: skip
            seconds = time.perf_counter() - start
            if resident.region is not None and self.arena is not None and resident.header:
                resident.shared = sharing.publish(self.arena, resident.region, resident.model)
            with self._lock:
                resident.slots = {}
                resident.kv = None  # its blocks leave the device with it (prefixes too)
                if simulated:
                    self.device_caps.uncharge(plan, resident.accounted)
                self._free_cuda()
                self.device_caps.apply()
        self._keep_room()
        return _logged(
            Report(replica, "offload", seconds, resident.nbytes, devices=["cpu"]),
            resident.spec.name, moved=not simulated or resident.region is not None,
        )  # fmt: skip

    def restore(
        self, replica: str, slots: Mapping[str, int], limit: int = 0, epoch: int = 0
    ) -> Report:
        """Bring a WARM replica back onto the GPUs of a new plan (ledger placement `epoch`)."""
        resident = self.residents.get(replica)
        if resident is None or not resident.warm:
            raise PlacementError(f"replica {replica} is not warm on this worker; load it instead")
        plan, simulated = self.device_caps.plan(slots)
        caps = replica_caps(slots, limit)
        with resident.lock, self._spans.span():
            with self._lock:
                self.device_caps.arriving(replica, caps)
                if simulated:
                    try:
                        self.device_caps.charge(slots, resident.accounted, resident.spec.name)
                    except torch.OutOfMemoryError:
                        self.device_caps.arrived(replica)
                        raise
            start = time.perf_counter()
            try:
                resident.model = loading.place(resident.model, plan, simulated)
                if simulated and resident.region is not None and self.arena is not None:
                    # out of the region given back below
                    loading.own_memory(resident.model, self.arena.raw(resident.region))
            except BaseException:
                with self._lock:
                    if simulated:
                        self.device_caps.uncharge(plan, resident.accounted)
                    self.device_caps.arrived(replica)
                raise
            seconds = time.perf_counter() - start
            moved = not simulated or resident.region is not None
            self._give_back(resident)  # `place` waited for its copies: the region is free
            with self._lock:
                resident.slots, resident.limit, resident.epoch = dict(slots), limit, epoch
                self.device_caps.arrived(replica)
        self._keep_room()
        devices = _names(plan, simulated)
        return _logged(
            Report(replica, "restore", seconds, resident.nbytes, devices=devices),
            resident.spec.name, moved=moved,
        )  # fmt: skip

    def _give_back(self, resident: Resident) -> None:
        """Return a warm copy's arena region (its tensors are elsewhere, or dropped),
        withdrawn first from the neighbours that may read it."""
        if resident.region is not None and self.arena is not None:
            if resident.shared is not None:
                sharing.withdraw(self.arena, resident.region, resident.shared)
            self.arena.release(resident.region)
        resident.region, resident.shared = None, None

    def _shares(self, via: str) -> bool:
        """Whether the copy of a model built `via` is published to the host's other workers
        once offloaded here (`worker.warm.sharing`), and so keeps room for a header: when this
        process publishes, a copy of a model gpufleet's reader built, which a neighbour's
        reader can build again from the copy ("safetensors" or "warm copy"). Anything else
        (remote code, conversions, several GPUs, a synthetic stand-in) it could not, and
        its holder restoring it beats the neighbour's load from disk."""
        return self.publish and self.arena is not None and via in ("safetensors", "warm copy")

    def locator(self, replica: str) -> str:
        """Where the host's other workers may read a replica's warm copy ('' nowhere)."""
        resident = self.residents.get(replica)
        shared = resident.shared if resident is not None and resident.warm else None
        return str(shared) if shared is not None else ""

    def _keep_room(self) -> None:
        """Have the arena keep room pinned ahead for the next eviction: the largest copy
        this process holds on a real GPU. One eviction then pins nothing on its path; the
        arena pins again for the next one once it took that room (docs/worker.md)."""
        if self.arena is None:
            return
        with self._lock:
            largest = max(
                (
                    r.host_bytes
                    for r in self.residents.values()
                    if not r.warm and not self.device_caps.plan(r.slots)[1]
                ),
                default=0,
            )
        self.arena.prepare(largest)

    def copy_bytes(self, replica: str) -> int:
        """Bytes a replica's copy takes in host memory once offloaded; 0 when not known.

        A pinned copy (a real GPU's) counts what it pins: in the arena, its tensors each
        rounded up to a page; pinned apart, PyTorch's blocks, each rounded up to a power of
        two. A synthetic stand-in counts as its declared size, as on the
        device, so it reports 0 and the ledger keeps charging that size.
        """
        resident = self.residents.get(replica)
        if resident is None or resident.spec.synthetic:
            return 0
        return resident.host_bytes

    def trim_host_cache(self) -> None:
        """Give the pinned blocks no copy uses any more back to the OS. PyTorch's pinned
        allocator keeps freed blocks cached for reuse, while the ledger has already given
        their bytes back to the host's warm cache: without this, the process would hold
        the most pinned memory it ever used."""
        if self._pin:
            loading.empty_host_cache()

    def drop(self, replica: str) -> None:
        """Forget a replica wherever it is (COLD)."""
        if self._forget(replica):
            self._release()

    def abandon(self, replica: str, failure: BaseException) -> None:
        """Forget a replica whose load, restore or warm-up raised `failure`, and free the
        device memory the failed attempt left behind.

        The failure's traceback keeps the failed frames alive, and with them every tensor
        they had already put on the GPU; a partly moved model would otherwise stay
        allocated (outside the ledger) for as long as Celery holds the exception.
        """
        seen: set[int] = set()
        current: BaseException | None = failure
        while current is not None and id(current) not in seen:
            seen.add(id(current))
            traceback.clear_frames(current.__traceback__)
            current = current.__cause__ or current.__context__
        with self._spans.span():
            self._forget(replica)
            gc.collect()  # a failed build's half-made modules are nobody's: free their cycles
            self._release()

    def _forget(self, replica: str) -> bool:
        """Take a replica out of this process's books (after its running call); False if it
        held none."""
        resident = self.residents.get(replica)
        if resident is None:
            return False
        with resident.lock, self._spans.span(), self._lock:  # a span once its call is done
            self.residents.pop(replica, None)
            if not resident.warm:
                plan, simulated = self.device_caps.plan(resident.slots)
                if simulated:
                    self.device_caps.uncharge(plan, resident.accounted)
            if resident.model is not None:
                loading.release(resident.model)  # freed now, cycles or not
            self._give_back(resident)
            resident.slots = {}  # a call that still holds it finds it gone...
            resident.model = None  # ...and cannot keep its tensors on the device
            resident.kv = None
        self._keep_room()
        return True

    def _release(self) -> None:
        """Give freed tensors back to the device and reset the caps to what is left.

        No `gc.collect()`: `_forget` already freed the weights (a full collection costs
        about 165 ms with torch and transformers loaded, on the miss's critical path)."""
        with self._lock:
            self._free_cuda()
            self.device_caps.apply()
        self.trim_host_cache()  # a dropped warm copy's pinned blocks

    def drop_all(self) -> None:
        """Forget every replica, e.g. after the worker lost its lease."""
        for replica in list(self.residents):
            self.drop(replica)

    # --- serving ------------------------------------------------------------

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

    def gpus_of(self, replica: str) -> list[str]:
        """The ledger GPU ids a HOT replica is on here (EvictedError when it is not)."""
        return sorted(self._hot(replica).slots)

    def open_engine(self, replica: str, epoch: int = 0, *, wait: bool = True) -> OpenEngine | None:
        """Hold a HOT replica of a generation model for its calls: its lock (so the keeper
        moves it only once its generations end: drain before evict) and one span, until
        the `OpenEngine` is closed; with it, its engine. Raises `EvictedError` as `run`
        does. Without `wait`, None while the keeper holds the lock (it is moving the
        replica): a session does not stall its other engines for that."""
        resident = self._hot(replica)
        if not resident.lock.acquire(blocking=wait):
            return None
        held = ExitStack()
        held.callback(resident.lock.release)
        try:
            # One span for the whole generation: its KV cache and activations come and go
            # while it runs, so no load or pass beside it may keep a figure (`measuring`).
            held.enter_context(self._spans.span())
            plan, simulated = self._serving(resident, epoch)
            if self.threads and torch.get_num_threads() != self.threads:
                torch.set_num_threads(self.threads)
            engine = replica_engine(
                resident.model, resident.tokenizer, resident.spec,
                loading.torch_device(min(plan), simulated), resident.kv,
            )  # fmt: skip
            resident.kv = engine.kv
        except BaseException:
            held.close()
            raise
        return OpenEngine(
            replica, resident.epoch, engine, resident.spec.chat_template, sorted(resident.slots),
            held,
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
        resident = self._hot(replica)
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
            free = self.device_caps.free(min(plan), simulated) if batched else 0
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
        plan, simulated = self.device_caps.plan(resident.slots)
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
        with self._pass_span(outer) as span:
            texts = [member[1] for member in chunk]
            flat = [text for call in texts for text in call]
            start = time.perf_counter()
            try:
                if simulated:
                    with self._lock:
                        need = _activation_bytes(resident.dims, flat)
                        self.device_caps.check_activations(need, min(plan))
                # On CUDA, read the memory statistics only for a pass that may report a
                # learned figure: each read builds a dict of every allocator counter.
                learning = span is not None and not simulated and self._learns(resident)
                before = {}
                if learning and span is not None:
                    # reset the peaks only while nothing else runs
                    before = self._cuda_allocated(plan, reset=self._spans.clean(span))
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
                self._learn_from(resident, _activation_bytes(resident.dims, flat))
            elif learning and span is not None and self._spans.clean(span):  # its own peak
                self._learn_from(resident, sum(peak_allocated(i) - before[i] for i in plan))
            for (index, _), result in zip(chunk, results, strict=True):
                ran[index] = Ran(result, None, len(chunk), compute_ms)

    def _set_threads(self, resident: Resident, texts: list[str]) -> None:
        """Give this thread's torch the threads the pass should run on (`worker.passes`)."""
        if not self.threads:
            return
        wanted = for_pass(self.threads, resident.dims, texts)
        if wanted != torch.get_num_threads():
            torch.set_num_threads(wanted)

    def _learns(self, resident: Resident) -> bool:
        """Whether a pass of this replica may report a learned peak: a catalog model whose
        load this process reported."""
        return (
            self.registry is not None
            and not resident.spec.synthetic
            and resident.spec.name in self._reported
        )

    def _learn_from(self, resident: Resident, extra: int) -> None:
        """Report a larger learned peak when a call needed more than the last report: a
        replica placed later (scaled out, or loaded again) is sized for the calls seen,
        not only for the warm-up call the load was measured with."""
        if self.registry is None or not self._learns(resident):
            return
        name = resident.spec.name
        reported = self._reported[name]
        peak = self._weights.get(name, 0) + extra + _kv_bytes(resident.spec)
        if peak > reported:
            self._reported[name] = peak
            try:
                self.registry.record_measurement(name, peak)
            except GpufleetError:
                log.warning("could not report %s's larger peak", name, exc_info=True)

    def hot(self, replica: str, epoch: int = 0) -> bool:
        """True when this process holds `replica` on its GPUs (in placement `epoch`, if given)."""
        resident = self.residents.get(replica)
        return resident is not None and not resident.warm and (not epoch or resident.epoch == epoch)

    def holdings(self) -> list[Holding]:
        """What this process holds, as its heartbeat reports it to the registry."""
        with self._lock:  # `_forget` clears a resident's model under it
            return [
                Holding(
                    replica=r.replica,
                    epoch=r.epoch,
                    level=Level.WARM if r.warm else Level.HOT,
                    gpus=dict(r.slots),
                    device_bytes=self._device_bytes(r),
                )
                for r in self.residents.values()
            ]

    def pinned_bytes(self) -> int:
        """Host memory this process keeps pinned: its arena's chunks (registered with CUDA,
        outside PyTorch's pinned allocator) and what that allocator holds: any copy pinned
        apart (each rounded up to a power of two), cached blocks included. 0 with no CUDA."""
        arena = self.arena.pinned if self.arena is not None and self._pin else 0
        stats = getattr(torch.cuda, "host_memory_stats", None)  # torch >= 2.7
        if not self._pin or stats is None:
            return arena
        # a figure that cannot be read leaves the last one standing (`WorkerLease._pinned`)
        return arena + int(stats().get("allocated_bytes.current", 0))

    def fraction(self, index: int) -> float:
        """This process's memory fraction on local device `index` (`DeviceCaps.fraction`)."""
        return self.device_caps.fraction(index)

    def summary(self) -> list[dict[str, Any]]:
        """What this process holds, for status and logs."""
        with self._lock:  # as in `holdings`
            return [
                {
                    "replica": r.replica,
                    "model": r.spec.name,
                    "level": "WARM" if r.warm else "HOT",
                    "gpus": dict(r.slots),
                    "accounted_bytes": r.accounted,
                    "device_bytes": self._device_bytes(r),
                    "epoch": r.epoch,
                }
                for r in self.residents.values()
            ]

    def _device_bytes(self, resident: Resident) -> int:
        """Bytes of the replica's weights that sit on a real GPU now (0 when WARM)."""
        real = [d for d in self.devices.values() if not d.simulated]
        if not real:
            return 0
        return loading.tensor_bytes(resident.model, [torch.device("cuda", local(d)) for d in real])

    # --- internals ----------------------------------------------------------

    def _hot(self, replica: str) -> Resident:
        resident = self.residents.get(replica)
        if resident is None or resident.warm:
            raise EvictedError(
                f"replica {replica} is not on this worker's GPUs (it was evicted or never "
                f"loaded here); route the request again"
            )
        return resident

    @staticmethod
    def _cuda_allocated(plan: Mapping[int, int], *, reset: bool) -> dict[int, int]:
        """Bytes allocated on each planned GPU before a load or a pass; with `reset`, the
        peak statistics start again from there (only a span that began alone may)."""
        if reset:
            for index in plan:
                torch.cuda.reset_peak_memory_stats(index)
        return {index: allocated(index) for index in plan}

    def _pass_span(self, outer: Span | None) -> AbstractContextManager[Span | None]:
        """A pass's span: a new one, or `outer`, the failed pass's that a retry runs in;
        none for a load's warm-up pass, which runs in the load's."""
        if outer is not None or getattr(self._warming, "load", False):
            return nullcontext(outer)
        return self._spans.span()

    def _measure(  # noqa: PLR0917 - a load's whole context
        self,
        resident: Resident,
        plan: Mapping[int, int],
        simulated: bool,
        baseline: dict[int, int],
        via: str,
        span: Span,
    ) -> int:
        """Peak bytes of the load plus a warm-up call; reported as learned memory.

        A model this process measured before, built the same way (`via`, on as many GPUs),
        is not warmed up again: its peak is known, its calls since raised it as they
        needed, and a warm-up would delay the miss. Built another way, it is: the warm-up
        is also the first check of a build path. On CUDA, figures are kept only when the
        load had the devices to itself (`span`); otherwise the next load measures again.
        """
        name = resident.spec.name
        if simulated:
            weights = resident.accounted
        else:
            for index in plan:  # every planned device, not only the current one
                torch.cuda.synchronize(index)
            weights = sum(allocated(i) - baseline.get(i, 0) for i in plan)
        if simulated or self._spans.clean(span):
            self._weights[name] = weights
        known = self._reported.get(name)
        # a read of a neighbour's warm copy builds the model as gpufleet's reader does
        built_as = (name, "safetensors" if via == "warm copy" else via, len(plan))
        if known is not None and built_as in self._warmed:
            return known
        # The load's own peak on CUDA, read now (the warm-up pass adds its own to it).
        loaded = 0 if simulated else sum(peak_allocated(i) - baseline.get(i, 0) for i in plan)
        if self.warmup:
            self._warming.load = True  # its pass runs in this load's span
            try:
                self.infer(resident.replica, _warmup_input(resident), None)
            finally:
                self._warming.load = False
        if simulated:
            peak = weights + _activation_bytes(resident.dims, _warmup_input(resident))
        else:
            for index in plan:  # every planned device, not only the current one
                torch.cuda.synchronize(index)
            warm = sum(peak_allocated(i) - baseline.get(i, 0) for i in plan)
            peak = max(loaded, warm)
            if not self._spans.clean(span):
                log.info(
                    "%s's peak not measured: another load, move or call used the GPUs "
                    "meanwhile; its next load measures it",
                    name,
                )
                return peak
        self._warmed.add(built_as)
        peak += _kv_bytes(resident.spec)  # learned memory holds the KV-cache budget too
        if self.registry is not None and not resident.spec.synthetic:
            self.registry.record_measurement(name, peak)
            self._reported[name] = max(peak, known or 0)  # the ledger's figure only grows
        return peak

    @staticmethod
    def _free_cuda() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _kv_bytes(spec: ModelSpec) -> int:
    """A generation model's KV-cache budget, in bytes (0 for other models)."""
    budget = spec.kv_budget()
    return budget.bytes if budget is not None else 0


def _declared(spec: ModelSpec) -> int:
    return spec.memory or spec.request or 0


def _logged(report: Report, model: str, *, moved: bool) -> Report:
    """`report`, logged: one line per offload or restore, rare next to calls, and their
    speed is what a miss waits for. A simulated GPU's copy that is not published stays
    where it is: nothing `moved`, and no speed is logged."""
    speed = f"{report.gbps:.1f} GB/s" if moved else "simulated GPU"
    log.info(
        "%s %s (%s, %s) in %.3fs (%s)",
        report.action, model, report.replica, format_size(report.nbytes), report.seconds, speed,
    )  # fmt: skip
    return report


def _names(plan: Mapping[int, int], simulated: bool) -> list[str]:
    return [str(loading.torch_device(i, simulated)) for i in sorted(plan)]


def _warmup_input(resident: Resident) -> str:
    mask = getattr(resident.tokenizer, "mask_token", None)
    if resident.spec.task == "fill-mask" and mask:
        return f"The capital of France is {mask}."
    return "gpufleet warms this model up."


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


def _activation_bytes(dims: Dims, inputs: object) -> int:
    """The worker's estimate of a pass's activation memory for `inputs` (`worker.passes`)."""
    texts = [inputs] if isinstance(inputs, str) else inputs if isinstance(inputs, list) else []
    texts = [t for t in texts if isinstance(t, str)]
    return dims.activation_bytes(len(texts), longest_tokens(texts))
