"""An example policy: speedloader's order, stashing only activations whose round trip
can hide behind compute.

A stashed activation is stored after its (block, sub-batch) runs in the forward and
loaded back one (block, sub-batch) ahead of its backward. When few block steps
separate the two, the store is still running when the load is wanted, and the load
has nothing to hide behind: the backward waits, for memory that was free only
briefly. This policy keeps those activations on the device and stashes the others:
a (block, sub-batch) is stashed only if at least `min_hidden_steps` block steps run
between its forward and its backward. With the default of 2, the last block's last
sub-batch (the first the backward needs) stays, everything else goes.

Select it with `options={"schedule": "lifetime_aware"}`, or pass
`lifetime_aware_policy(min_hidden_steps=...)` as the `schedule` option.
"""

from __future__ import annotations

from slcompile.schedules.base import Schedule, ScheduleRequest, Step, add_fetches
from slcompile.schedules.policy import Policy
from slcompile.schedules.speedloader import add_stashes, add_stores, layer_major_compute

__all__ = ["lifetime_aware_policy", "LIFETIME_AWARE"]


def lifetime_aware_policy(min_hidden_steps: int = 2) -> Policy:
    """The policy, keeping activations with fewer than `min_hidden_steps` block steps
    between their forward and their backward."""

    def build(request: ScheduleRequest) -> Schedule:
        compute = layer_major_compute(request)
        # Position of each (block, sub-batch) among the block steps, per phase.
        blocks = [step for step in compute if step.region == "block"]
        position = {(step.phase, step.key): i for i, step in enumerate(blocks)}

        def keep(step: Step) -> bool:
            if step.region != "block":
                return False  # the prefix's backward is the last step: always hidden
            between = position["bwd", step.key] - position["fwd", step.key] - 1
            return between < min_hidden_steps

        steps = add_fetches(compute, request, per_subbatch=False)
        return Schedule(tuple(add_stores(add_stashes(steps, request, keep), request)))

    return Policy("lifetime_aware", build, suffix="whole")


LIFETIME_AWARE = lifetime_aware_policy()
