"""The speedloader policy: layer-major over sub-batches, forward and backward.

Forward: the prefix for each sub-batch, then every block for sub-batches 0..K-1 before
the next block, then the suffix per sub-batch and the loss combined over all of them.
Backward mirrors it: the loss, the suffix for sub-batches K-1..0, blocks from last to
first with sub-batches K-1..0 (the order in which the autograd engine runs ready work:
highest sequence number first), then the prefix.
"""

from __future__ import annotations

from slcompile.passes.find_blocks import BlockGraph
from slcompile.schedules.base import Schedule, Step

__all__ = ["speedloader_schedule"]


def speedloader_schedule(
    blocks: BlockGraph, num_subbatches: int, *, backward: bool = True, has_prefix: bool = True,
    has_suffix: bool = True,
) -> Schedule:
    """The speedloader schedule for `blocks` and K sub-batches."""
    k = num_subbatches
    steps: list[Step] = []
    if has_prefix:
        steps += [Step("fwd", "prefix", subbatch=s) for s in range(k)]
    for block in blocks.blocks:
        steps += [Step("fwd", "block", block.index, s) for s in range(k)]
    if has_suffix:
        steps += [Step("fwd", "suffix", subbatch=s) for s in range(k)]
    if not backward:
        return Schedule(tuple(steps))
    if has_suffix:
        steps += [Step("bwd", "suffix", subbatch=s) for s in reversed(range(k))]
    for block in reversed(blocks.blocks):
        steps += [Step("bwd", "block", block.index, s) for s in reversed(range(k))]
    if has_prefix:
        steps += [Step("bwd", "prefix", subbatch=s) for s in reversed(range(k))]
    return Schedule(tuple(steps))
