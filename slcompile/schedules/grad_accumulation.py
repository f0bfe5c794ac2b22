"""The grad_accumulation policy: sample-major, the baseline speedloader is compared with.

Forward: sub-batch (micro-batch) 0 runs the prefix, every block and the suffix, then
micro-batch 1 does the same, and so on; the loss is combined over all of them at the
end. Backward: micro-batch K-1 runs the suffix, the blocks from last to first and the
prefix, then micro-batch K-2, and so on down to 0 (the autograd engine runs the
ready work with the highest sequence number first, and micro-batch K-1 ran last).
A block's weight gradients are summed over the micro-batches as each one finishes it.
"""

from __future__ import annotations

from slcompile.passes.find_blocks import BlockGraph
from slcompile.schedules.base import Schedule, Step

__all__ = ["grad_accumulation_schedule"]


def grad_accumulation_schedule(
    blocks: BlockGraph, num_subbatches: int, *, backward: bool = True, has_prefix: bool = True,
    has_suffix: bool = True,
) -> Schedule:
    """The grad_accumulation schedule for `blocks` and K micro-batches."""
    steps: list[Step] = []
    for s in range(num_subbatches):
        steps += _micro_batch("fwd", blocks, s, has_prefix, has_suffix)
    if not backward:
        return Schedule(tuple(steps))
    for s in reversed(range(num_subbatches)):
        steps += _micro_batch("bwd", blocks, s, has_prefix, has_suffix)
    return Schedule(tuple(steps))


def _micro_batch(phase: str, blocks: BlockGraph, subbatch: int, has_prefix: bool, has_suffix: bool) -> list[Step]:
    """One micro-batch through the whole model, in the phase's direction."""
    steps: list[Step] = []
    if has_prefix:
        steps.append(Step(phase, "prefix", subbatch=subbatch))
    steps += [Step(phase, "block", block.index, subbatch) for block in blocks.blocks]
    if has_suffix:
        steps.append(Step(phase, "suffix", subbatch=subbatch))
    return steps if phase == "fwd" else steps[::-1]
