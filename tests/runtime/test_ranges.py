"""RangeAllocator: alignment, first fit, merging of freed neighbours, growth."""

from __future__ import annotations

import pytest

from slcompile.runtime.storage.ranges import ByteRange, RangeAllocator


def test_allocations_are_aligned_and_disjoint():
    allocator = RangeAllocator(64 * 4096)
    ranges = [allocator.allocate(size) for size in (1, 4096, 4097, 10_000)]
    assert [r.offset for r in ranges] == [0, 4096, 8192, 16384]
    assert [r.size for r in ranges] == [4096, 4096, 8192, 12288]
    assert allocator.used_bytes == 28672


def test_free_merges_neighbours_so_a_large_range_fits_again():
    allocator = RangeAllocator(4 * 4096)
    parts = [allocator.allocate(4096) for _ in range(4)]
    assert allocator.allocate(4096) is None
    for index in (0, 2, 1, 3):
        allocator.free(parts[index])
    assert allocator.used_bytes == 0
    assert allocator.allocate(4 * 4096) == ByteRange(0, 4 * 4096)


def test_freed_range_is_reused_first_fit():
    allocator = RangeAllocator(8 * 4096)
    first = allocator.allocate(2 * 4096)
    allocator.allocate(4096)
    allocator.free(first)
    assert allocator.allocate(4096).offset == 0


def test_grow_extends_the_tail_and_merges_with_it():
    allocator = RangeAllocator(2 * 4096)
    allocator.allocate(4096)
    assert allocator.tail_free() == 4096
    allocator.grow(4 * 4096)
    assert allocator.tail_free() == 3 * 4096
    assert allocator.allocate(3 * 4096) == ByteRange(4096, 3 * 4096)


def test_double_free_is_refused():
    allocator = RangeAllocator(4 * 4096)
    taken = allocator.allocate(4096)
    allocator.free(taken)
    with pytest.raises(ValueError, match="twice"):
        allocator.free(taken)
