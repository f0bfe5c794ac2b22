"""Example policies that spill boundary activations: the output of a (block, sub-batch)
rests on the activations' tier while the other sub-batches run, as SpeedLoader stores
the hidden states of waiting sub-batches.

In speedloader's layer-major order every sub-batch's output waits K-1 steps for its
next block, so with K of at least 4 each one leaves and comes back (`add_spills`
spills waits of 3 steps or more): the device holds about two boundary activations
instead of K. A zigzag order (even blocks run sub-batches 0..K-1, odd ones K-1..0)
hands the turning sub-batch's output straight to the next block and the one beside
it after two steps, so those stay, and the same peak costs fewer bytes moved:
`compare_policies(model, batch, policies=["spilling", "zigzag_spilling"],
activations="nvme", num_subbatches=8)` shows both.

Select them with `options={"schedule": "spilling"}` or `"zigzag_spilling"`, with
`activations` on a tier that copies (`"nvme"`; on a CUDA machine `"host"` too).
"""

from __future__ import annotations

from slcompile.schedules.base import Schedule, ScheduleRequest, Step, add_fetches
from slcompile.schedules.policy import Policy
from slcompile.schedules.speedloader import add_spills, add_stashes, add_stores, layer_major_compute, suffix_compute

__all__ = ["spilling_policy", "zigzag_compute", "SPILLING", "ZIGZAG_SPILLING"]


def zigzag_compute(request: ScheduleRequest) -> list[Step]:
    """The compute steps in zigzag order: layer-major, with the sub-batches of every
    other block in reverse; the backward is the forward reversed."""
    k = request.num_subbatches
    forward = [Step("fwd", "prefix", subbatch=s) for s in range(k)] if request.has_prefix else []
    for position, block in enumerate(request.blocks):
        order = range(k) if position % 2 == 0 else reversed(range(k))
        forward += [Step("fwd", "block", block, s) for s in order]
    if request.has_suffix:
        forward += suffix_compute(request)
    backward = [Step("bwd", s.region, s.block, s.subbatch) for s in reversed(forward)] if request.backward else []
    return forward + backward


def spilling_policy(name: str = "spilling", *, zigzag: bool = False, min_wait: int = 3) -> Policy:
    """A policy spilling every boundary activation that waits at least `min_wait`
    compute steps, in layer-major order or, with `zigzag`, in zigzag order; weights,
    saved activations and gradients move as speedloader moves them."""

    def build(request: ScheduleRequest) -> Schedule:
        compute = zigzag_compute(request) if zigzag else layer_major_compute(request)
        steps = add_stashes(add_fetches(compute, request, per_subbatch=False), request)
        return Schedule(tuple(add_stores(add_spills(steps, request, min_wait=min_wait), request)))

    return Policy(name, build, suffix="whole")


SPILLING = spilling_policy()
ZIGZAG_SPILLING = spilling_policy("zigzag_spilling", zigzag=True)
