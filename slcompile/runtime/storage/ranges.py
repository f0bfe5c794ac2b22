"""First-fit range allocator shared by the nvme arena and the pinned host pool.

Needs: nothing but the size of the space it manages (which may grow).
Guarantees: every returned range starts at a multiple of ``alignment`` and its
length is a multiple of ``alignment``; ranges never overlap; freed neighbours are
merged so that a long run of small allocations and frees does not fragment the
space into unusable slivers. Not thread-safe: its owners hold their own lock.
"""

from __future__ import annotations

import bisect
import logging
from typing import NamedTuple

__all__ = ["ByteRange", "RangeAllocator", "round_up"]

log = logging.getLogger(__name__)


def round_up(value: int, multiple: int) -> int:
    """Returns the smallest multiple of ``multiple`` that is >= ``value``."""
    return -(-value // multiple) * multiple


class ByteRange(NamedTuple):
    """One allocated range (a named tuple: an arena makes one per slot it hands out).

    Attributes:
        offset: First byte of the range, relative to the managed space.
        size: Length in bytes (a multiple of the allocator's alignment).
    """

    offset: int
    size: int


class RangeAllocator:
    """Hands out aligned byte ranges from a space of ``capacity`` bytes.

    Args:
        capacity: Initial size of the managed space, in bytes (rounded down to the
            alignment).
        alignment: Granularity of offsets and sizes, in bytes.
    """

    def __init__(self, capacity: int, alignment: int = 4096):
        self.alignment = alignment
        self.capacity = capacity // alignment * alignment
        # Free ranges as two parallel sorted lists so neighbours are found by bisect.
        self._free_offsets: list[int] = []
        self._free_sizes: list[int] = []
        self.used_bytes = 0
        if self.capacity:
            self._free_offsets.append(0)
            self._free_sizes.append(self.capacity)

    def allocate(self, nbytes: int) -> ByteRange | None:
        """Takes the first free range that fits.

        Args:
            nbytes: Bytes wanted (rounded up to the alignment; at least one unit).

        Returns:
            The range, or None when no free range is large enough (the caller may
            then ``grow`` the space and try again).
        """
        size = max(round_up(nbytes, self.alignment), self.alignment)
        for index, free_size in enumerate(self._free_sizes):
            if free_size >= size:
                offset = self._free_offsets[index]
                if free_size == size:
                    del self._free_offsets[index]
                    del self._free_sizes[index]
                else:
                    self._free_offsets[index] = offset + size
                    self._free_sizes[index] = free_size - size
                self.used_bytes += size
                return ByteRange(offset, size)
        return None

    def free(self, byte_range: ByteRange) -> None:
        """Returns a range to the free list, merging it with free neighbours."""
        offset, size = byte_range.offset, byte_range.size
        index = bisect.bisect_left(self._free_offsets, offset)
        if index < len(self._free_offsets) and self._free_offsets[index] == offset:
            raise ValueError(f"range at offset {offset} freed twice")
        self.used_bytes -= size
        merges_next = (
            index < len(self._free_offsets) and offset + size == self._free_offsets[index]
        )
        merges_prev = index > 0 and (
            self._free_offsets[index - 1] + self._free_sizes[index - 1] == offset
        )
        if merges_prev and merges_next:
            self._free_sizes[index - 1] += size + self._free_sizes[index]
            del self._free_offsets[index]
            del self._free_sizes[index]
        elif merges_prev:
            self._free_sizes[index - 1] += size
        elif merges_next:
            self._free_offsets[index] = offset
            self._free_sizes[index] += size
        else:
            self._free_offsets.insert(index, offset)
            self._free_sizes.insert(index, size)

    def grow(self, new_capacity: int) -> None:
        """Extends the managed space to ``new_capacity`` bytes (never shrinks)."""
        new_capacity = new_capacity // self.alignment * self.alignment
        if new_capacity <= self.capacity:
            return
        added = ByteRange(self.capacity, new_capacity - self.capacity)
        self.capacity = new_capacity
        # Counted as used for a moment so that free() can do the merging.
        self.used_bytes += added.size
        self.free(added)

    def tail_free(self) -> int:
        """Returns the size of the free range that ends at the capacity, if any."""
        if self._free_offsets and self._free_offsets[-1] + self._free_sizes[-1] == self.capacity:
            return self._free_sizes[-1]
        return 0
