"""How a KV cache resting on a tier that copies is cut into stored segments: the
rules `slcompile.runtime.kv.KVStore` follows and the models that predict its
bytes (`slcompile.inference.explain`, `slcompile.analysis.pass_memory`) count with.
Plain arithmetic on positions and bytes; nothing here moves data."""

from __future__ import annotations

from collections.abc import Sequence

__all__ = ["KV_STORES_IN_FLIGHT", "forgettable_segments", "merged_segments", "reads_in_place"]

# Stores of (block, sub-batch) caches whose source tensors may be alive at once.
KV_STORES_IN_FLIGHT = 4


def forgettable_segments(positions: Sequence[int], length: int) -> int:
    """How many leading segments of a cache hold none of its last `length` positions.

    Args:
        positions: the positions each segment holds, oldest first.
        length: the positions the cache keeps (the last ones).

    Returns:
        The number of segments, from the front, that can be forgotten.
    """
    dropped, later = 0, sum(positions)
    for size in positions[:-1]:
        if later - size < length:
            break
        later -= size
        dropped += 1
    return dropped


def merged_segments(positions: Sequence[int], new: int, length: int) -> tuple[int, int]:
    """How a store of `new` positions joins a cache's stored segments: the run of
    new positions takes in the last segment as long as that is not longer than the
    run (as a binary counter carries), and is written as one segment.

    Args:
        positions: the positions each stored segment holds, oldest first.
        new: the positions the store adds (at most `length`).
        length: the positions the cache keeps.

    Returns:
        How many segments, from the end, the written one replaces, and the
        positions it holds (the run's last `length` at most).
    """
    run, replaced = new, 0
    for size in reversed(positions):
        if size > run:
            break
        run += size
        replaced += 1
    return replaced, min(run, length)


def reads_in_place(row_bytes: int, granularity: int) -> bool:
    """Whether the segments of a cache whose rows (one position's keys and values)
    take `row_bytes` are read straight into their rows of one buffer: where every
    segment starts and ends on the loads' `granularity` (the page on a CPU machine,
    whose loads read whole pages; 1 on a GPU)."""
    return row_bytes % granularity == 0
