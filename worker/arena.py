"""A pinned arena for warm copies: host memory pinned once, in large chunks, and reused.

Pinning host memory (`cudaHostAlloc`) is slow, about 0.5 s a GiB on an H200 host, and an
offload that pins a fresh block for every tensor spends most of its time there: 2.1 GB/s
against 55 GB/s for a copy into memory pinned beforehand (issue 41). So a GPU worker keeps
its warm copies in an arena: chunks of pinned memory allocated when the arena first needs
them and kept for the worker's life. An offload takes one region for the whole copy and
copies each tensor into its own aligned slice of it; a restore or a drop gives the region
back. Nothing is pinned again for the next eviction.

Regions never span chunks. A chunk is `CHUNK` bytes, or the power of two that holds one
copy that needs more (what PyTorch's pinned allocator would pin for it anyway; the rest of
that chunk is room for other copies); chunks stop being added at `capacity` (the worker's
share of the host's warm cache, which the ledger already charges). Free space is kept per
chunk as sorted, coalesced extents, and a region goes in the first extent it fits (first
fit). When no extent fits and no chunk may be added, `reserve` answers None, and the
caller pins the copy the old way (`worker.loading.to_cpu`): slower, never refused.

The arena is per process: warm copies live where the process that offloaded them can see
them. A host-wide arena shared by the GPU workers of a host (memory registered with CUDA in
each) would let another worker restore a copy onto its own GPU; it is not built yet.
"""

from __future__ import annotations

import bisect
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

CHUNK = 256 * 2**20  # bytes pinned at a time (a default, not tuned: 0.1-0.2 s of pinning)
ALIGN = 4096  # every region and slice starts on a page


def align(nbytes: int) -> int:
    return -(-nbytes // ALIGN) * ALIGN


def _power_of_two(nbytes: int) -> int:
    """PyTorch's pinned allocator rounds every block up to a power of two: a chunk of any
    other size would pin more than the arena counts."""
    return 1 << (nbytes - 1).bit_length()


@dataclass(frozen=True)
class Region:
    """A reserved stretch of one chunk."""

    chunk: int
    offset: int
    size: int


class PinnedArena:
    """Chunks of (pinned) host memory and their free extents (see the module).

    `allocate(nbytes)` makes one chunk: pinned memory on a CUDA host, plain memory in tests.
    Thread-safe: the keeper offloads and drops, a load's failure may drop.
    """

    def __init__(
        self, capacity: int, allocate: Callable[[int], torch.Tensor], chunk: int = CHUNK
    ) -> None:
        self.capacity = capacity
        self._allocate = allocate
        self._chunk = _power_of_two(align(chunk))
        self._chunks: list[torch.Tensor] = []
        self._free: list[list[tuple[int, int]]] = []  # per chunk: sorted (offset, size)
        self._lock = threading.Lock()

    @property
    def pinned(self) -> int:
        """Bytes the arena holds (its chunks), used or not."""
        return sum(int(c.numel()) for c in self._chunks)

    @property
    def free(self) -> int:
        with self._lock:
            return sum(size for extents in self._free for _, size in extents)

    def reserve(self, nbytes: int) -> Region | None:
        """A region of at least `nbytes`, or None when neither a free extent nor a new
        chunk within the capacity can hold it."""
        size = align(max(nbytes, 1))
        with self._lock:
            for index, extents in enumerate(self._free):
                for position, (offset, room) in enumerate(extents):
                    if room >= size:
                        if room == size:
                            del extents[position]
                        else:
                            extents[position] = (offset + size, room - size)
                        return Region(index, offset, size)
            grow = _power_of_two(max(self._chunk, size))
            if self.pinned + grow > self.capacity:
                return None
            try:
                chunk = self._allocate(grow)
            except (RuntimeError, torch.OutOfMemoryError) as exc:  # the host could not pin it
                log.warning("could not pin %d more bytes for warm copies: %s", grow, exc)
                return None
            self._chunks.append(chunk)
            self._free.append([(size, grow - size)] if grow > size else [])
            return Region(len(self._chunks) - 1, 0, size)

    def release(self, region: Region) -> None:
        """Give a region back; it joins the free extents around it."""
        with self._lock:
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
        raw = self._chunks[region.chunk][start : start + nbytes]
        return raw.view(dtype).view(shape)


def layout(tensors: list[torch.Tensor]) -> tuple[list[int], int]:
    """Each tensor's offset in one region, each slice page-aligned, and the region's size."""
    offsets, total = [], 0
    for tensor in tensors:
        offsets.append(total)
        total += align(tensor.numel() * tensor.element_size())
    return offsets, total


def pinned_chunk(nbytes: int) -> torch.Tensor:
    """One chunk of pinned host memory."""
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)


__all__ = ["ALIGN", "CHUNK", "PinnedArena", "Region", "align", "layout", "pinned_chunk"]
