"""The pinned arena's bookkeeping (`worker.arena`), on plain host memory: what a CUDA host
pins is the same bytes, so the regions, reuse, limits and fragmentation are tested here;
the pinned copies themselves run in tests/test_gpu.py."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from worker.arena import ALIGN, PinnedArena, Region, align, layout

MiB = 2**20


def _arena(capacity: int, chunk: int = 4 * MiB) -> PinnedArena:
    return PinnedArena(capacity, lambda n: torch.zeros(n, dtype=torch.uint8), chunk)


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


def test_a_copy_larger_than_a_chunk_gets_a_power_of_two_chunk_whose_rest_serves_others() -> None:
    arena = _arena(64 * MiB, chunk=4 * MiB)
    big = arena.reserve(10 * MiB + 5)
    assert big is not None and big.size == align(10 * MiB + 5)
    assert arena.pinned == 16 * MiB  # what PyTorch's pinned allocator pins for 10 MiB
    assert arena.free == 16 * MiB - big.size
    rest = arena.reserve(5 * MiB)  # fits in the big chunk's rest: no chunk added
    assert rest is not None and rest.chunk == big.chunk and arena.pinned == 16 * MiB


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
    arena = _arena(12 * MiB, chunk=4 * MiB)
    assert arena.reserve(10 * MiB) is None  # its chunk would be 16 MiB
    assert arena.pinned == 0


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
    sizes = [int(chunk.numel()) for chunk in arena._chunks]
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
