"""The policies the `schedule` option names, and the schedule of a compiled graph.

`policy_for(config.schedule)` returns the `Policy` of an option value (a name, or a
`Policy` object passed as the option); `plan_schedule(blocks, config, ...)` asks it for
the schedule of one graph. Which tiers a schedule allows is checked by
`SpeedLoaderConfig`, where the options are documented.
"""

from __future__ import annotations

from slcompile.passes.find_blocks import BlockGraph
from slcompile.schedules.base import Policy, Schedule, ScheduleRequest
from slcompile.schedules.examples.lifetime_aware import LIFETIME_AWARE
from slcompile.schedules.grad_accumulation import GRAD_ACCUMULATION
from slcompile.schedules.speedloader import NO_OFFLOAD, SPEEDLOADER

__all__ = ["POLICIES", "policy_for", "plan_schedule"]

POLICIES: dict[str, Policy] = {
    policy.name: policy for policy in (SPEEDLOADER, GRAD_ACCUMULATION, NO_OFFLOAD, LIFETIME_AWARE)
}


def policy_for(schedule: str | Policy) -> Policy:
    """The Policy of a `schedule` option value (already validated by the config)."""
    if isinstance(schedule, Policy):
        return schedule
    return POLICIES[schedule]


def plan_schedule(
    blocks: BlockGraph,
    config,
    *,
    weights_streamed: bool = False,
    activations_offloaded: bool = False,
    backward: bool = True,
    gradients_offloaded: bool = False,
) -> Schedule:
    """The schedule the configured policy writes for one graph's blocks.

    Args:
        blocks: the block graph.
        config: the backend's options (`SpeedLoaderConfig`).
        weights_streamed: block weights rest off the device (a tier that copies).
        activations_offloaded: saved activations rest off the device.
        backward: the graph is trained (a forward and a backward).
        gradients_offloaded: the streamed weights' gradients leave the device.
    """
    request = ScheduleRequest(
        blocks=tuple(block.index for block in blocks.blocks),
        num_subbatches=config.num_subbatches,
        live_blocks=config.live_blocks,
        weights_streamed=weights_streamed,
        activations_offloaded=activations_offloaded,
        backward=backward,
        gradients_offloaded=gradients_offloaded,
    )
    return policy_for(config.schedule)(request)
