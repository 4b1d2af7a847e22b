"""The memory one worker process may use on each device: what the ledger reserves for it.

The ledger admits a replica onto a GPU with a reservation (and, on a single GPU, an
admission limit it may grow to); the process must stay inside the sum of what it holds
and loads there. On a real GPU that is `torch.cuda.set_per_process_memory_fraction`, so
CUDA itself refuses a byte more. A simulated GPU has no allocator behind it, so each
replica's bytes are booked here instead, and a booking past the cap raises the same
`torch.OutOfMemoryError` CUDA raises: tests and benches meet the cap exactly as a GPU
host does.

`DeviceCaps` keeps those books for a `worker.residency.ResidencyManager`: the caps of the
replicas still arriving (admitted, being loaded or restored) and, through `held`, of those
held. It shares the manager's lock, under which the keeper adds and removes replicas while
calls read the room their passes have.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Mapping

import torch

from placement.errors import PlacementError
from placement.units.memory import format_size, process_fraction
from worker.devices import Device


class DeviceCaps:
    """The caps of one process on the devices of its host (see the module)."""

    def __init__(
        self,
        devices: Mapping[str, Device],
        lock: threading.RLock,
        held: Callable[[], Iterable[dict[str, int]]],
    ) -> None:
        self.devices = devices  # ledger GPU id -> device
        self._lock = lock
        self._held = held  # the caps of the replicas held, read under the lock
        self._arriving: dict[str, dict[str, int]] = {}  # replica -> caps, while it arrives
        self._charged: dict[int, int] = {}  # simulated device index -> accounted bytes
        self._capped: set[int] = set()  # real devices whose fraction this process set

    def plan(self, slots: Mapping[str, int]) -> tuple[dict[int, int], bool]:
        """Ledger slots as {device index: bytes}, and whether those devices are simulated."""
        unknown = sorted(set(slots) - set(self.devices))
        if unknown or not slots:
            raise PlacementError(
                f"plan names GPUs {unknown or '(none)'} that this worker does not own "
                f"(it owns {sorted(self.devices)})"
            )
        chosen = [self.devices[g] for g in slots]
        kinds = {d.simulated for d in chosen}
        if len(kinds) > 1:
            raise PlacementError("a plan cannot mix simulated and real GPUs")
        return {local(self.devices[g]): int(b) for g, b in slots.items()}, kinds.pop()

    def arriving(self, replica: str, caps: dict[str, int]) -> None:
        """A load or restore begins: the ledger admitted it, so its caps count from the
        first byte it puts on a device. Call under the lock."""
        self._arriving[replica] = caps
        self.apply()

    def arrived(self, replica: str) -> None:
        """A load or restore ended (done or failed): its caps are a resident's, or none.
        Call under the lock."""
        self._arriving.pop(replica, None)
        self.apply()

    def reserved(self, index: int) -> int:
        """This process's cap on device `index`: the caps there of what it holds or loads."""
        reserved = 0
        for slots in self._all():
            for gpu_id, nbytes in slots.items():
                if local(self.devices[gpu_id]) == index:
                    reserved += nbytes
        return reserved

    def apply(self) -> None:
        """Cap each real GPU this process uses at its reservation there (1.0 once empty).

        GPUs it never used are left alone, so no CUDA context is made on them.
        """
        using = {
            local(self.devices[g])
            for slots in self._all()
            for g in slots
            if not self.devices[g].simulated
        }
        for index in sorted(using | self._capped):
            share = process_fraction(self.reserved(index), cap_total(index))
            torch.cuda.set_per_process_memory_fraction(share, index)
        self._capped = using

    def fraction(self, index: int) -> float:
        """This process's memory fraction on local device `index`, as `apply` sets it on a
        real GPU (1.0 with nothing on it)."""
        device = next(d for d in self.devices.values() if local(d) == index)
        total = device.total if device.simulated else cap_total(index)
        return process_fraction(self.reserved(index), total)

    def free(self, index: int, simulated: bool) -> int:
        """Bytes of this process's reservation on device `index` not in use now: the room
        a pass's activations have."""
        used = self._charged.get(index, 0) if simulated else allocated(index)
        return self.reserved(index) - used

    def charge(self, slots: Mapping[str, int], accounted: int, name: str) -> None:
        """Book `accounted` bytes on simulated GPUs, in proportion to the plan's slots.

        The cap on each is this process's cap there, replicas still arriving included.
        """
        plan, _ = self.plan(slots)
        shares = _split(accounted, plan)
        for index, share in shares.items():
            cap = self.reserved(index)
            used = self._charged.get(index, 0)
            if used + share > cap:
                raise torch.OutOfMemoryError(
                    f"simulated GPU {index} out of memory: {name} tried to allocate "
                    f"{format_size(share)}; this process reserved {format_size(cap)} there "
                    f"and {format_size(used)} is in use"
                )
        for index, share in shares.items():
            self._charged[index] = self._charged.get(index, 0) + share

    def uncharge(self, plan: Mapping[int, int], accounted: int) -> None:
        """Give back what `charge` booked for a replica on `plan`."""
        for index, share in _split(accounted, plan).items():
            self._charged[index] = max(0, self._charged.get(index, 0) - share)

    def check_activations(self, need: int, index: int) -> None:
        """A call whose activations (`need` bytes) would pass the reservation on simulated
        device `index` fails as on a capped GPU. Read under the lock: the keeper charges
        and gives back replicas meanwhile."""
        with self._lock:
            free = self.reserved(index) - self._charged.get(index, 0)
        if need > free:
            raise torch.OutOfMemoryError(
                f"simulated GPU {index} out of memory: the call needs about "
                f"{format_size(need)} of activations but {format_size(max(free, 0))} of this "
                f"process's reservation is free; send a smaller batch"
            )

    def _all(self) -> list[dict[str, int]]:
        """The caps of every replica held, loading or restoring here. Read under the lock:
        a call's thread asks (`free`) while the keeper adds and removes them."""
        with self._lock:
            return [*self._held(), *self._arriving.values()]


def replica_caps(slots: Mapping[str, int], limit: int) -> dict[str, int]:
    """Per-GPU caps of a replica: its reservation, or its limit on a single GPU."""
    if len(slots) == 1:
        return {gpu_id: max(nbytes, limit) for gpu_id, nbytes in slots.items()}
    return dict(slots)


def local(device: Device) -> int:
    """The index this process uses for a device: torch's CUDA index, or the simulated one."""
    if device.simulated or device.cuda_index is None:
        return device.index
    return device.cuda_index


def cap_total(index: int) -> int:
    """What torch's memory fraction on a real GPU is a fraction of: the device's whole
    memory as CUDA reports it (not NVML's total less what the driver keeps)."""
    return int(torch.cuda.get_device_properties(index).total_memory)


def allocated(index: int) -> int:
    """Bytes torch has allocated on CUDA device `index` now (`torch.cuda.memory_allocated`
    flattens and sorts every allocator counter in Python first: about 70 µs a read)."""
    return _allocated_bytes(index, "current")


def peak_allocated(index: int) -> int:
    """The most torch has had allocated on CUDA device `index` since its peaks were reset
    (`torch.cuda.max_memory_allocated`, read the same cheaper way)."""
    return _allocated_bytes(index, "peak")


def allocated_on(plan: Mapping[int, int], *, reset: bool) -> dict[int, int]:
    """Bytes allocated on each planned GPU before a load or a pass; with `reset`, the peak
    statistics start again from there (only a span that began alone may:
    `worker.measuring`)."""
    if reset:
        for index in plan:
            torch.cuda.reset_peak_memory_stats(index)
    return {index: allocated(index) for index in plan}


def _allocated_bytes(index: int, which: str) -> int:
    stats = torch.cuda.memory_stats_as_nested_dict(index)
    return int(stats.get("allocated_bytes", {}).get("all", {}).get(which, 0))


def _split(accounted: int, plan: Mapping[int, int]) -> dict[int, int]:
    total = sum(plan.values()) or 1
    return {index: accounted * nbytes // total for index, nbytes in plan.items()}


__all__ = ["DeviceCaps", "allocated", "cap_total", "local", "peak_allocated", "replica_caps"]
