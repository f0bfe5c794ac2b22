"""The value of the `schedule` option, as what the passes need to know about it.

`policy_for(config.schedule)` returns the Policy the pipeline and the lowering read:
whether compute runs sample-major (each sub-batch through every block before the next
sub-batch) or layer-major (each block over every sub-batch before the next block),
and the function that writes the schedule's text form. Which tiers a schedule allows
is checked by `SpeedLoaderConfig`, where the options are documented.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from slcompile.passes.find_blocks import BlockGraph
from slcompile.schedules.base import Schedule
from slcompile.schedules.grad_accumulation import grad_accumulation_schedule
from slcompile.schedules.speedloader import speedloader_schedule

__all__ = ["Policy", "POLICIES", "policy_for"]


@dataclasses.dataclass(frozen=True)
class Policy:
    """What one `schedule` option value means for the passes.

    Attributes:
        name: the option value.
        sample_major: compute is ordered by (sub-batch, block), gradient
            accumulation's order, instead of by (block, sub-batch). Streamed weights
            are then fetched once per (block, sub-batch) instead of once per block.
        build: `build(blocks, num_subbatches) -> Schedule`, the text form's source.
    """

    name: str
    sample_major: bool
    build: Callable[[BlockGraph, int], Schedule]


POLICIES: dict[str, Policy] = {
    policy.name: policy
    for policy in (
        Policy("speedloader", sample_major=False, build=speedloader_schedule),
        Policy("grad_accumulation", sample_major=True, build=grad_accumulation_schedule),
        Policy("no_offload", sample_major=False, build=speedloader_schedule),
    )
}


def policy_for(schedule: str) -> Policy:
    """The Policy of a `schedule` option value (already validated by the config)."""
    return POLICIES[schedule]
