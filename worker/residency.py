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
drops replicas; calls run from others, through `calls` (`worker.calls`: how calls reach
what this process holds). Each replica has a lock that a call holds while it computes,
so a replica is never moved under a running call.
"""

from __future__ import annotations

import functools
import gc
import logging
import threading
import time
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from placement.catalog.catalog import ModelSpec
from placement.errors import EvictedError, PlacementError
from placement.ledger.registry import Registry
from placement.policy.state import Holding, Level
from placement.units.memory import format_size
from worker import loading
from worker.calls import Calls, activation_bytes
from worker.caps import DeviceCaps, allocated, allocated_on, local, peak_allocated, replica_caps
from worker.devices import Device
from worker.measuring import Learned, Span, Spans, kv_bytes
from worker.resident import Resident
from worker.warm import sharing
from worker.warm.arena import PinnedArena, registered_chunk, shared_chunk

log = logging.getLogger(__name__)


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
        graphs: bool = True,
        arena_bytes: int = 0,
        publish: bool = False,
    ) -> None:
        self.host = host
        self.devices = {d.gpu_id(host): d for d in devices}
        self.registry = registry
        self.warmup = warmup
        self.residents: dict[str, Resident] = {}
        self.lock = threading.RLock()  # guards the books below and `residents`
        # What the process may use on each device: the caps of what it holds and of what
        # it is loading or restoring (`worker.caps`).
        self.device_caps = DeviceCaps(
            self.devices, self.lock, lambda: [r.caps for r in self.residents.values()]
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
        # learned memory. A call that needs more reports more (`worker.measuring.Learned`).
        self.learned = Learned(registry)
        self._warmed: set[tuple[str, str, int]] = set()  # (model, via, GPUs) warmed up here
        # Loads, moves and passes, so that a CUDA figure counts only when it was alone
        # (`worker.measuring`).
        self.spans = Spans()
        # How calls reach what this process holds (`worker.calls`).
        self.calls = Calls(
            self, threads=threads, graphs=graphs, whole_pass_errors=whole_pass_errors
        )

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
        with self.spans.span() as span:
            with self.lock:
                self.device_caps.arriving(replica, caps)
                if simulated and accounted:
                    try:
                        # before building, as CUDA would
                        self.device_caps.charge(slots, accounted, spec.name)
                    except torch.OutOfMemoryError:
                        self.device_caps.arrived(replica)
                        raise
            baseline = {} if simulated else allocated_on(plan, reset=span.alone)
            start = time.perf_counter()
            try:
                built = loading.build(spec, plan, simulated, source)
            except BaseException:
                with self.lock:
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
            with self.lock:
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
        resident = self.hot_resident(replica)
        with resident.lock, self.spans.span():
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
            with self.lock:
                resident.slots = {}
                resident.leave_device()  # its KV blocks (prefixes too) and adapters' slots
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
        with resident.lock, self.spans.span():
            with self.lock:
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
                with self.lock:
                    if simulated:
                        self.device_caps.uncharge(plan, resident.accounted)
                    self.device_caps.arrived(replica)
                raise
            seconds = time.perf_counter() - start
            moved = not simulated or resident.region is not None
            self._give_back(resident)  # `place` waited for its copies: the region is free
            with self.lock:
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
        with self.lock:
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
        with self.spans.span():
            self._forget(replica)
            gc.collect()  # a failed build's half-made modules are nobody's: free their cycles
            self._release()

    def _forget(self, replica: str) -> bool:
        """Take a replica out of this process's books (after its running call); False if it
        held none."""
        resident = self.residents.get(replica)
        if resident is None:
            return False
        with resident.lock, self.spans.span(), self.lock:  # a span once its call is done
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
            resident.leave_device()
        self._keep_room()
        return True

    def _release(self) -> None:
        """Give freed tensors back to the device and reset the caps to what is left.

        No `gc.collect()`: `_forget` already freed the weights (a full collection costs
        about 165 ms with torch and transformers loaded, on the miss's critical path)."""
        with self.lock:
            self._free_cuda()
            self.device_caps.apply()
        self.trim_host_cache()  # a dropped warm copy's pinned blocks

    def drop_all(self) -> None:
        """Forget every replica, e.g. after the worker lost its lease."""
        for replica in list(self.residents):
            self.drop(replica)

    def hot(self, replica: str, epoch: int = 0) -> bool:
        """True when this process holds `replica` on its GPUs (in placement `epoch`, if given)."""
        resident = self.residents.get(replica)
        return resident is not None and not resident.warm and (not epoch or resident.epoch == epoch)

    def hot_resident(self, replica: str) -> Resident:
        """The HOT replica `replica`, else `EvictedError` (the call is routed again)."""
        resident = self.residents.get(replica)
        if resident is None or resident.warm:
            raise EvictedError(
                f"replica {replica} is not on this worker's GPUs (it was evicted or never "
                f"loaded here); route the request again"
            )
        return resident

    def holdings(self) -> list[Holding]:
        """What this process holds, as its heartbeat reports it to the registry."""
        with self.lock:  # `_forget` clears a resident's model under it
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
        with self.lock:  # as in `holdings`
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
        if simulated or self.spans.clean(span):
            self.learned.weights[name] = weights
        known = self.learned.reported.get(name)
        # a read of a neighbour's warm copy builds the model as gpufleet's reader does
        built_as = (name, "safetensors" if via == "warm copy" else via, len(plan))
        if known is not None and built_as in self._warmed:
            return known
        # The load's own peak on CUDA, read now (the warm-up pass adds its own to it).
        loaded = 0 if simulated else sum(peak_allocated(i) - baseline.get(i, 0) for i in plan)
        if self.warmup:
            self.calls.warm_up(resident.replica, _warmup_input(resident))
        if simulated:
            peak = weights + activation_bytes(resident.dims, _warmup_input(resident))
        else:
            for index in plan:  # every planned device, not only the current one
                torch.cuda.synchronize(index)
            warm = sum(peak_allocated(i) - baseline.get(i, 0) for i in plan)
            peak = max(loaded, warm)
            if not self.spans.clean(span):
                log.info(
                    "%s's peak not measured: another load, move or call used the GPUs "
                    "meanwhile; its next load measures it",
                    name,
                )
                return peak
        self._warmed.add(built_as)
        peak += kv_bytes(resident.spec)  # learned memory holds the KV-cache budget too
        self.learned.report(resident.spec, peak)
        return peak

    @staticmethod
    def _free_cuda() -> None:
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


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
