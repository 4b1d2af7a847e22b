"""A pinned arena for warm copies: host memory pinned ahead of need, in large chunks, and reused.

Pinning host memory is slow (`cudaHostAlloc`: about 0.5 s a GiB on an H200 host), and an
offload that pins a fresh block for every tensor spends most of its time there: 2.1 GB/s
against 55 GB/s for a copy into memory pinned beforehand (issue 41). So a GPU worker keeps
its warm copies in an arena: chunks of pinned memory kept for the worker's life. An offload
takes one region for the whole copy and copies each tensor into its own aligned slice of
it; a restore or a drop gives the region back. Nothing is pinned again for the next eviction.

Pinning happens off the call path, on the arena's own thread:
- `prepare(nbytes)` asks it to keep room for one copy of `nbytes` (the worker asks for the
  largest copy it holds on a GPU, so the next eviction finds its room pinned);
- `reserve` waits for that thread only when no free extent holds the copy; it never pins
  on the caller's thread.
A chunk is memory mapped by the process and registered with CUDA (`cudaHostRegister`, as
PyTorch's own checkpoint stager pins), not `cudaHostAlloc`'d: issue 41 measured 0.12 s to
register a 2 GiB mapping against 1.08 s to allocate as much pinned, with copies at the same
55 GB/s. A failed CUDA runtime call leaves its error in the calling thread's last-error
slot, which PyTorch's next kernel-launch check would read as its own; on the arena's
thread no kernel is launched. When the host refuses a chunk, the arena stops growing for
`RETRY_S`, and copies that find no room meanwhile are pinned apart.

Regions never span chunks. A chunk is `CHUNK` bytes, or the size of the one copy that
needs more; chunks stop being added at `capacity` (the worker's share of the host's warm
cache, which the ledger already charges). Free space is kept per chunk as sorted,
coalesced extents, and a region goes in the first extent it fits (first fit). When no
extent fits and no chunk may be added, `reserve` answers None, and the caller pins the
copy the old way (`worker.loading.to_cpu`): slower, never refused.

A worker whose warm copies the host's other GPU workers may read (`worker.warm.sharing`) makes
its chunks over a sealed `memfd`, which they map read-only through `/proc/<pid>/fd/<n>`
(`where`); any other worker's chunks are private. The holder still owns its copies; the
memory goes with the last process that maps it. Simulated GPUs keep published warm copies
in chunks of the same kind, unregistered (`shared_chunk`).
"""

from __future__ import annotations

import bisect
import contextlib
import fcntl
import logging
import mmap
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CHUNK = 256 * 2**20  # bytes pinned at a time at least (a default, not tuned)
ALIGN = 4096  # every region and slice starts on a page
RETRY_S = 60.0  # after the host refused a chunk, how long the arena stops growing (not tuned)
MEMFD = "gpufleet-warm"  # the name every chunk's memfd carries (`/proc/<pid>/fd/<n>` shows it)


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


@dataclass(frozen=True)
class Chunk:
    """One chunk's memory, and the memfd other processes of the host may map it by (-1:
    none, the chunk is private to this process)."""

    data: torch.Tensor
    fd: int = -1


@dataclass(frozen=True)
class Region:
    """A reserved stretch of one chunk."""

    chunk: int
    offset: int
    size: int


class PinnedArena:
    """Chunks of (pinned) host memory and their free extents (see the module).

    `allocate(nbytes)` makes one chunk: pinned memory on a CUDA host, unpinned for simulated
    GPUs, plain memory in tests;
    it runs on the arena's thread only, and may raise (the host could not map or pin it: the
    arena then stops growing for `RETRY_S`). Thread-safe: the keeper offloads and drops, a load's
    failure may drop, the worker prepares.
    """

    def __init__(self, capacity: int, allocate: Callable[[int], Chunk], chunk: int = CHUNK) -> None:
        self.capacity = capacity
        self._allocate = allocate
        self._chunk = align(chunk)
        self._chunks: list[Chunk] = []
        self._free: list[list[tuple[int, int]]] = []  # per chunk: sorted (offset, size)
        self._changed = threading.Condition()  # guards all of the below and the above
        self._wanted = 0  # the copy to keep room for (`prepare`)
        self._waiting: list[int] = []  # sizes `reserve` waits for, oldest first
        self._pinning = 0  # bytes the arena's thread pins now
        self._asked = False  # `prepare` asked for room that is not pinned yet
        self._refused_at: float | None = None  # when the host last refused a chunk
        self._thread: threading.Thread | None = None

    @property
    def pinned(self) -> int:
        """Bytes the arena holds (its chunks), used or not."""
        with self._changed:
            return sum(int(c.data.numel()) for c in self._chunks)

    @property
    def free(self) -> int:
        with self._changed:
            return sum(size for extents in self._free for _, size in extents)

    def prepare(self, nbytes: int) -> None:
        """Keep room for one copy of `nbytes` pinned ahead, on the arena's thread (0: none).
        Returns at once."""
        with self._changed:
            self._wanted = align(nbytes) if nbytes > 0 else 0
            if self._wanted:
                self._asked = True
                self._wake()

    def settle(self, timeout: float | None = None) -> bool:
        """Wait until the arena's thread has pinned what it was asked to; False on timeout."""
        with self._changed:
            return self._changed.wait_for(lambda: not self._asked and not self._pinning, timeout)

    def reserve(self, nbytes: int) -> Region | None:
        """A region of at least `nbytes`, or None when neither a free extent nor a new
        chunk within the capacity can hold it. Waits only while the arena's thread pins
        the chunk that will hold it."""
        size = align(max(nbytes, 1))
        with self._changed:
            region = self._fit(size)
            if region is not None:
                return region
            self._waiting.append(size)
            start = time.monotonic()
            try:
                # the chunk being pinned may be the room this copy needs
                while region is None and (self._pinning or self._may_grow(size)):
                    self._wake()  # again each time: another copy may have taken the chunk
                    self._changed.wait()
                    region = self._fit(size)
            finally:
                self._waiting.remove(size)
        log.info(
            "a copy of %d bytes waited %.3fs for room in the arena (%s)",
            size, time.monotonic() - start, "found" if region else "none",
        )  # fmt: skip
        return region

    def release(self, region: Region) -> None:
        """Give a region back; it joins the free extents around it."""
        with self._changed:
            extents = self._free[region.chunk]
            start, size = region.offset, region.size
            position = bisect.bisect_left(extents, (start, 0))
            if position < len(extents) and extents[position][0] < start + size:
                raise ValueError(f"region {region} overlaps free space: released twice?")
            if position > 0 and sum(extents[position - 1]) > start:
                raise ValueError(f"region {region} overlaps free space: released twice?")
            if position < len(extents) and extents[position][0] == start + size:
                size += extents[position][1]
                del extents[position]
            if position > 0 and sum(extents[position - 1]) == start:
                start, size = extents[position - 1][0], extents[position - 1][1] + size
                del extents[position - 1]
                position -= 1
            extents.insert(position, (start, size))
            self._changed.notify_all()

    def trim(self, region: Region, nbytes: int) -> Region:
        """Keep the first `nbytes` of `region` (rounded up to a page) and give the rest back:
        a copy reserves what it may need and keeps what it used."""
        keep = align(max(nbytes, 1))
        if keep >= region.size:
            return region
        self.release(Region(region.chunk, region.offset + keep, region.size - keep))
        return Region(region.chunk, region.offset, keep)

    def view(
        self, region: Region, offset: int, dtype: torch.dtype, shape: torch.Size
    ) -> torch.Tensor:
        """A tensor of `dtype` and `shape` at `offset` bytes into `region`."""
        nbytes = shape.numel() * dtype.itemsize
        if offset + nbytes > region.size:
            raise ValueError(f"{nbytes} bytes at {offset} do not fit region {region}")
        start = region.offset + offset
        raw = self._chunks[region.chunk].data[start : start + nbytes]
        return raw.view(dtype).view(shape)

    def raw(self, region: Region) -> torch.Tensor:
        """The region's bytes, as one uint8 tensor."""
        return self._chunks[region.chunk].data[region.offset : region.offset + region.size]

    def where(self, region: Region) -> tuple[int, int]:
        """Where another process of the host finds `region`: its chunk's memfd in this
        process (-1: the chunk is private), and the region's offset in it."""
        return self._chunks[region.chunk].fd, region.offset

    # --- under `_changed` -----------------------------------------------------

    def _fit(self, size: int) -> Region | None:
        """Take `size` bytes from the first free extent that holds them."""
        for index, extents in enumerate(self._free):
            for position, (offset, room) in enumerate(extents):
                if room >= size:
                    if room == size:
                        del extents[position]
                    else:
                        extents[position] = (offset + size, room - size)
                    return Region(index, offset, size)
        return None

    def _grow(self, size: int) -> int:
        return max(self._chunk, size)

    def _may_grow(self, size: int) -> bool:
        """Whether a chunk for `size` may still be added (after the one being pinned): not
        for `RETRY_S` after the host refused one, nor past the capacity."""
        if self._refused_at is not None and time.monotonic() - self._refused_at < RETRY_S:
            return False
        return self.pinned + self._pinning + self._grow(size) <= self.capacity

    def _wake(self) -> None:
        """Wake the arena's thread (started on the first call)."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=_pin_ahead,
                args=(weakref.ref(self), self._changed),
                name="gpufleet-pinning",
                daemon=True,
            )
            self._thread.start()
            weakref.finalize(self, _notify, self._changed)  # a dropped arena ends it
        self._changed.notify_all()

    def _take_due(self) -> int | None:
        """The chunk the thread should pin now, marked as being pinned, or None: for the
        oldest waiting copy that no free extent holds, else once for each `prepare` whose
        copy no free extent holds. A copy that takes the prepared room asks for nothing:
        no chunk is pinned while its copies run, and the worker prepares again after."""
        largest = max((room for extents in self._free for _, room in extents), default=0)
        grow = next(
            (self._grow(n) for n in self._waiting if n > largest and self._may_grow(n)), None
        )
        if grow is None and self._asked:
            wanted = self._wanted
            if wanted > largest and self._may_grow(wanted):
                grow = self._grow(wanted)
            self._asked = False  # this ask is served (or cannot be)
        self._pinning = grow or 0
        return grow

    def _pinned(self, grow: int, chunk: Chunk | None) -> None:
        """Add the chunk the thread pinned (None: the host refused it)."""
        self._pinning = 0
        if chunk is None:
            self._refused_at = time.monotonic()
        else:
            self._chunks.append(chunk)
            self._free.append([(0, grow)])
        self._changed.notify_all()


def _pin_ahead(ref: weakref.ref[PinnedArena], changed: threading.Condition) -> None:
    """The arena's thread: pin the chunks it is asked for, one at a time outside the lock,
    then wait for the next ask. It holds the arena only weakly while it waits, so a
    dropped arena ends it."""
    while True:
        with changed:
            arena = ref()
            if arena is None:
                return
            grow = arena._take_due()
            if grow is None:
                del arena  # may be the last reference: its finalizer then notified no one
                if ref() is None:
                    return
                changed.notify_all()  # `settle`
                changed.wait()
                continue
        chunk: Chunk | None = None
        start = time.monotonic()
        try:
            chunk = arena._allocate(grow)
            seconds = time.monotonic() - start
            log.info("added %d bytes for warm copies in %.3fs", grow, seconds)
        except Exception as exc:  # the host could not map or pin it
            log.warning("could not add %d bytes for warm copies: %s", grow, exc)
        finally:  # whatever happened, no copy waits for this chunk any more
            with changed:
                arena._pinned(grow, chunk)
        del arena, chunk


def _notify(changed: threading.Condition) -> None:
    with changed:
        changed.notify_all()


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's offset in one region, each slice page-aligned, and the region's size."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += align(tensor.numel() * tensor.element_size())
    return offsets, total


def registered_chunk(nbytes: int, *, shared: bool = False) -> Chunk:
    """One chunk of pinned host memory: a mapping (`host_mapping`, shared with the host's
    other workers when `shared`) registered with CUDA for every context
    (`cudaHostRegisterPortable`), unregistered when the chunk is collected.

    Both run on a device where the process already has a context (as PyTorch's pinned
    allocator does), so pinning never opens one on another worker's GPU; with no context
    anywhere yet it raises instead.
    """
    cudart = torch.cuda.cudart()  # type: ignore[no-untyped-call]
    device = _opened_device()
    mapping, fd = host_mapping(nbytes, shared=shared, populate=True)
    try:
        data = torch.frombuffer(mapping, dtype=torch.uint8)
        with torch.cuda.device(device):
            error = int(cudart.cudaHostRegister(data.data_ptr(), nbytes, 1))
        if error:
            raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: CUDA error {error}")
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise
    # unregistered before the mapping can go: no later mapping at the same address finds
    # it registered still
    finalizer = weakref.finalize(data, _unregister, data.data_ptr(), device)
    finalizer.atexit = False  # the CUDA context may be gone by then
    return _chunk(data, fd)  # sealed once registered: the registration maps it as it was


def shared_chunk(nbytes: int) -> Chunk:
    """One chunk of plain shared memory, for the warm copies of simulated GPUs: nothing to
    pin, and its pages are allocated as copies first write them."""
    mapping, fd = host_mapping(nbytes, shared=True, populate=False)
    return _chunk(torch.frombuffer(mapping, dtype=torch.uint8), fd)


def _chunk(data: torch.Tensor, fd: int) -> Chunk:
    """`data` as a chunk. A shared one is sealed, and its memfd closes when the chunk is
    collected; one the kernel will not seal is kept private (its memfd closed now)."""
    if fd >= 0 and not _sealed(fd):
        os.close(fd)
        fd = -1
    if fd >= 0:
        weakref.finalize(data, os.close, fd)
    return Chunk(data, fd)


def _sealed(fd: int) -> bool:
    """Seal a memfd against resizing and against any write but through the mappings made
    already (`F_SEAL_FUTURE_WRITE`, Linux 5.1): another process of the user may map it to
    read, never to write. False when the kernel refuses."""
    seals = getattr(fcntl, "F_SEAL_FUTURE_WRITE", 0x10)  # the constant is Linux's
    seals |= fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
    try:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, seals)
    except OSError as exc:
        log.warning("cannot seal a warm-copy chunk (%s): its copies stay private", exc)
        return False
    return True


def host_mapping(nbytes: int, *, shared: bool, populate: bool) -> tuple[mmap.mmap, int]:
    """A mapping of `nbytes` for warm copies, and the memfd behind it (-1: none).

    Private (anonymous) unless `shared`. A shared one maps a new `memfd` named `MEMFD`,
    which the host's other processes of the same user and PID namespace may map through
    `/proc/<pid>/fd/<n>` while this process keeps the memfd open (once `_chunk` sealed
    it, only to read). Either way its memory goes with the last process that maps it: a
    worker that dies, however it dies, gives it back, and nothing is named in `/dev/shm`
    to unlink.

    With `populate`, every page is present before this returns, in huge pages where the
    kernel gives them (for shared memory, only where `transparent_hugepage/shmem_enabled`
    allows). Why: registering a mapping whose pages are not there yet makes
    `cudaHostRegister` fault in and zero every page itself, and while it runs other
    threads' copies stall (it takes a driver lock). On an H200 host a 2.30 GB chunk took
    0.72 to 1.19 s to register that way, and a restore beside it ran at 1.9 GB/s instead
    of 52 (docs/gpu-validation.md, seventh session); issue 41 measured 0.12 s for 2 GiB.
    Faulting the pages in first, on the arena's thread and outside CUDA, leaves the
    registration only the pinning. They are faulted in by writing a byte of each page
    from torch, which releases the interpreter lock (`madvise(MADV_POPULATE_WRITE)`
    through `mmap.madvise` held it: 0.36 s of stall in the other threads per GiB on a
    2-core VM)."""
    fd = -1
    if shared:
        fd = os.memfd_create(MEMFD, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        try:
            os.ftruncate(fd, nbytes)
            mapping = mmap.mmap(fd, nbytes, flags=mmap.MAP_SHARED)
        except BaseException:
            os.close(fd)
            raise
    else:
        mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE)
    if populate:
        huge = getattr(mmap, "MADV_HUGEPAGE", None)  # Linux only
        if huge is not None:
            with contextlib.suppress(OSError):  # a hint: fewer pages to fault in and to pin
                mapping.madvise(huge)
        torch.frombuffer(mapping, dtype=torch.uint8)[:: mmap.PAGESIZE].zero_()
    return mapping, fd


def _opened_device() -> int:
    """A CUDA device on which this process has a context already."""
    opened = getattr(torch._C, "_cuda_hasPrimaryContext", None)
    if opened is not None:
        for index in range(torch.cuda.device_count()):
            if opened(index):
                return index
    raise RuntimeError("no CUDA context in this process yet: nothing to pin memory for")


def _unregister(pointer: int, device: int) -> None:
    with torch.cuda.device(device):  # the context it was registered in, not a new one
        torch.cuda.cudart().cudaHostUnregister(pointer)  # type: ignore[no-untyped-call]


__all__ = [
    "ALIGN",
    "CHUNK",
    "MEMFD",
    "Chunk",
    "PinnedArena",
    "Region",
    "align",
    "layout",
    "host_mapping",
    "registered_chunk",
    "shared_chunk",
]
