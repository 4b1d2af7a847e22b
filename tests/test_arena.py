"""The pinned arena's bookkeeping (`worker.warm.arena`), on plain host memory: what a CUDA host
pins is the same bytes, so the regions, reuse, limits, fragmentation and the pinning
thread are tested here; the pinned copies themselves run in tests/test_gpu.py."""

from __future__ import annotations

import gc
import itertools
import os
import random
import threading
from pathlib import Path

import pytest
import torch

from worker.warm import arena as arena_module
from worker.warm.arena import ALIGN, Chunk, PinnedArena, Region, align, host_mapping, layout

MiB = 2**20


def _arena(capacity: int, chunk: int = 4 * MiB) -> PinnedArena:
    return PinnedArena(capacity, lambda n: Chunk(torch.zeros(n, dtype=torch.uint8)), chunk)


def test_a_released_region_is_reused_without_pinning_more() -> None:
    arena = _arena(16 * MiB)
    first = arena.reserve(3 * MiB)
    assert first is not None and arena.pinned == 4 * MiB
    arena.release(first)
    again = arena.reserve(3 * MiB)
    assert again == first and arena.pinned == 4 * MiB


def test_the_arena_never_pins_past_its_capacity_and_has_room_again_once_copies_leave() -> None:
    arena = _arena(8 * MiB)
    held = [arena.reserve(3 * MiB) for _ in range(2)]  # one chunk each: 3 MiB + 1 MiB free
    assert all(region is not None for region in held) and arena.pinned == 8 * MiB
    assert arena.reserve(2 * MiB) is None  # no extent of 2 MiB, and no third chunk
    assert arena.reserve(MiB) is not None  # the free MiB of a chunk
    region = held[0]
    assert region is not None
    arena.release(region)
    assert arena.reserve(3 * MiB) == region


def test_a_copy_larger_than_a_chunk_gets_a_chunk_of_its_own_size() -> None:
    arena = _arena(64 * MiB, chunk=4 * MiB)
    big = arena.reserve(10 * MiB + 5)
    assert big is not None and big.size == align(10 * MiB + 5)
    assert arena.pinned == big.size and arena.free == 0  # registered memory needs no rounding
    small = arena.reserve(MiB)  # a chunk of the usual size
    assert small is not None and small.chunk != big.chunk and arena.pinned == big.size + 4 * MiB


def test_a_trimmed_region_keeps_what_its_copy_used_and_the_rest_serves_others() -> None:
    arena = _arena(16 * MiB)
    bound = arena.reserve(3 * MiB)  # reserved for the most a copy may need
    assert bound is not None
    used = arena.trim(bound, MiB + 1)  # what the copy took
    assert used == Region(bound.chunk, bound.offset, align(MiB + 1))
    assert arena.free == 4 * MiB - used.size
    other = arena.reserve(2 * MiB)  # in the trimmed tail: no chunk added
    assert other is not None and other.offset == used.offset + used.size
    assert arena.pinned == 4 * MiB
    assert arena.trim(used, 2 * MiB) == used  # nothing to give back
    arena.release(used)
    arena.release(other)
    assert arena.free == 4 * MiB


def test_a_chunk_that_would_pin_past_the_capacity_is_not_pinned() -> None:
    arena = _arena(8 * MiB, chunk=4 * MiB)
    assert arena.reserve(10 * MiB) is None
    arena.prepare(10 * MiB)
    assert arena.settle(5) and arena.pinned == 0


def test_releasing_a_region_twice_is_refused() -> None:
    arena = _arena(8 * MiB)
    region = arena.reserve(MiB)
    assert region is not None
    arena.release(region)
    with pytest.raises(ValueError, match="released twice"):
        arena.release(region)


def test_mixed_sizes_over_many_cycles_never_overlap_and_fail_only_without_room() -> None:
    rng = random.Random(7)
    capacity = 64 * MiB
    arena = _arena(capacity, chunk=8 * MiB)
    live: list[Region] = []
    refused = 0
    for _ in range(3000):
        if live and rng.random() < 0.45:
            arena.release(live.pop(rng.randrange(len(live))))
            continue
        size = rng.choice([ALIGN, 37_000, 300_000, 2 * MiB, 5 * MiB, 9 * MiB])
        region = arena.reserve(size)
        if region is None:
            refused += 1
            # refused only when no free extent holds it and no chunk may be added
            extents = [room for chunk in arena._free for _, room in chunk]
            assert max(extents, default=0) < align(size)
            assert arena.pinned + max(8 * MiB, align(size)) > capacity
            continue
        live.append(region)
        assert arena.pinned <= capacity
        spans = sorted((r.chunk, r.offset, r.offset + r.size) for r in live)
        for (c1, _, end), (c2, start, _) in itertools.pairwise(spans):
            assert c1 != c2 or end <= start, "two live regions overlap"
    assert refused > 0  # the run did press the arena
    for region in live:
        arena.release(region)
    sizes = [int(chunk.data.numel()) for chunk in arena._chunks]
    assert arena._free == [[(0, size)] for size in sizes]  # every chunk one extent again


def test_tensors_copied_into_a_region_s_slices_come_back_intact() -> None:
    arena = _arena(16 * MiB)
    tensors = [
        torch.randn(3, 5),
        torch.arange(7, dtype=torch.int64),
        torch.randn(11, dtype=torch.float64).to(torch.bfloat16),
        torch.ones(0),
    ]
    offsets, total = layout(tensors)
    assert all(offset % ALIGN == 0 for offset in offsets)
    region = arena.reserve(total)
    assert region is not None
    views = [arena.view(region, o, t.dtype, t.shape) for o, t in zip(offsets, tensors, strict=True)]
    for view, tensor in zip(views, tensors, strict=True):
        view.copy_(tensor)
    for view, tensor in zip(views, tensors, strict=True):
        assert view.dtype == tensor.dtype and torch.equal(view, tensor)
    with pytest.raises(ValueError, match="do not fit"):
        arena.view(region, total, torch.float32, torch.Size([1]))


class _Recording:
    """Makes plain chunks, noting the thread of each; `gate` holds each until set, and
    `called` is set once the first is asked for."""

    def __init__(self, fail: bool = False) -> None:
        self.threads: list[str] = []
        self.gate = threading.Event()
        self.gate.set()
        self.called = threading.Event()
        self.fail = fail

    def __call__(self, nbytes: int) -> Chunk:
        self.threads.append(threading.current_thread().name)
        self.called.set()
        self.gate.wait(10)
        if self.fail:
            raise RuntimeError("cudaHostRegister failed")
        return Chunk(torch.zeros(nbytes, dtype=torch.uint8))


def _reserving(arena: PinnedArena, nbytes: int, got: list[Region | None]) -> threading.Thread:
    thread = threading.Thread(target=lambda: got.append(arena.reserve(nbytes)))
    thread.start()
    return thread


def test_prepared_room_is_pinned_on_the_arena_s_thread_and_the_next_copy_pins_nothing() -> None:
    chunks = _Recording()
    arena = PinnedArena(64 * MiB, chunks, 4 * MiB)
    arena.prepare(3 * MiB)
    assert arena.settle(5) and arena.pinned == 4 * MiB
    region = arena.reserve(3 * MiB)
    assert region is not None and region.chunk == 0
    assert arena.settle(5) and arena.pinned == 4 * MiB  # nothing pinned while the copy runs
    arena.prepare(3 * MiB)  # as the worker asks once its offload ran: room for the next one
    assert arena.settle(5) and arena.pinned == 8 * MiB
    assert chunks.threads == ["gpufleet-pinning"] * 2


def test_a_copy_with_no_room_waits_for_the_arena_s_thread_and_never_pins_itself() -> None:
    chunks = _Recording()
    chunks.gate.clear()
    arena = PinnedArena(64 * MiB, chunks, 4 * MiB)
    got: list[Region | None] = []
    copy = _reserving(arena, 6 * MiB, got)
    assert chunks.called.wait(5)  # the arena's thread pins the copy's chunk...
    copy.join(0.2)
    assert copy.is_alive() and not got  # ...while the copy waits for it
    chunks.gate.set()
    copy.join(5)
    assert got and got[0] is not None and got[0].size == 6 * MiB
    assert chunks.threads == ["gpufleet-pinning"]


def test_a_copy_waits_for_the_prepared_chunk_being_pinned_even_when_no_other_would_fit() -> None:
    chunks = _Recording()
    chunks.gate.clear()
    arena = PinnedArena(12 * MiB, chunks, 4 * MiB)  # room for one 10 MiB chunk, not two
    arena.prepare(10 * MiB)
    assert chunks.called.wait(5)
    got: list[Region | None] = []
    copy = _reserving(arena, 10 * MiB, got)
    copy.join(0.2)
    assert copy.is_alive() and not got
    chunks.gate.set()
    copy.join(5)
    assert got == [Region(0, 0, 10 * MiB)] and arena.pinned == 10 * MiB


def test_two_copies_waiting_for_room_both_get_a_chunk() -> None:
    chunks = _Recording()
    chunks.gate.clear()
    arena = PinnedArena(64 * MiB, chunks, 4 * MiB)
    got: list[Region | None] = []
    copies = [_reserving(arena, 6 * MiB, got) for _ in range(2)]
    assert chunks.called.wait(5)
    chunks.gate.set()
    for copy in copies:
        copy.join(5)
    assert len(got) == 2 and all(region is not None for region in got)
    assert {region.chunk for region in got if region is not None} == {0, 1}


def test_a_host_that_refuses_to_pin_leaves_copies_to_be_pinned_apart_then_is_asked_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    chunks = _Recording(fail=True)
    arena = PinnedArena(64 * MiB, chunks, 4 * MiB)
    assert arena.reserve(MiB) is None  # the caller pins this copy apart
    arena.prepare(MiB)
    assert arena.settle(5)
    assert arena.reserve(MiB) is None and chunks.threads == ["gpufleet-pinning"]  # tried once
    assert arena.pinned == 0
    monkeypatch.setattr(arena_module, "RETRY_S", 0.0)  # the back-off is over
    chunks.fail = False
    region = arena.reserve(MiB)
    assert region is not None and arena.pinned == 4 * MiB and len(chunks.threads) == 2


def test_no_room_is_pinned_while_none_is_wanted_and_a_dropped_arena_ends_its_thread() -> None:
    chunks = _Recording()
    arena = PinnedArena(64 * MiB, chunks, 4 * MiB)
    arena.prepare(0)
    assert arena.settle(5) and arena.pinned == 0 and arena._thread is None
    arena.prepare(MiB)
    assert arena.settle(5) and arena.pinned == 4 * MiB
    thread = arena._thread
    assert thread is not None
    del arena
    gc.collect()
    thread.join(5)
    assert not thread.is_alive()


@pytest.mark.parametrize("shared", [False, True])
def test_a_chunks_mapping_has_every_page_present_before_anything_registers_it(
    shared: bool,
) -> None:
    nbytes = 64 * 2**20
    mapping, fd = host_mapping(nbytes, shared=shared, populate=True)
    assert (fd >= 0) is shared
    view = torch.frombuffer(mapping, dtype=torch.uint8)
    resident, untouched = _resident_bytes(view.data_ptr()), bool(view.any())
    del view  # before `close`, which refuses while a view of it lives
    mapping.close()
    if fd >= 0:
        os.close(fd)
    assert resident >= nbytes  # faulted in as it was made, not at first use
    assert not untouched  # fresh memory reads as zeros


def _resident_bytes(address: int) -> int:
    """The resident bytes of this process's mapping that holds `address`
    (`/proc/self/smaps`; the kernel may have merged it with a like neighbour)."""
    total, inside = 0, False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        first = line.split(maxsplit=1)[0]
        if "-" in first and not first.endswith(":"):
            start, end = (int(part, 16) for part in first.split("-"))
            inside = start <= address < end
        elif inside and first == "Rss:":
            total += int(line.split()[1]) * 1024
    return total
