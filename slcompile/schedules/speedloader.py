"""The speedloader policy: layer-major over sub-batches, forward and backward.

Forward: the prefix for each sub-batch, then every block for sub-batches 0..K-1 before
the next block, then the suffix per sub-batch and the loss combined over all of them.
Backward mirrors it: the loss, the suffix for sub-batches K-1..0, blocks from last to
first with sub-batches K-1..0 (the order in which the autograd engine runs ready work:
highest sequence number first), then the prefix. Streamed weights are fetched once per
block per pass, shared by the K sub-batches; saved activations, when they rest off the
device, are stashed for every (block, sub-batch) of the prefix and the blocks.
"""

from __future__ import annotations

import dataclasses

from slcompile.schedules.base import Policy, Schedule, ScheduleRequest, Step, add_fetches

__all__ = ["speedloader_schedule", "layer_major_compute", "add_stashes", "SPEEDLOADER", "NO_OFFLOAD"]


def layer_major_compute(request: ScheduleRequest) -> list[Step]:
    """The compute steps in layer-major order, forward then (if any) backward."""
    k = request.num_subbatches
    forward: list[Step] = []
    if request.has_prefix:
        forward += [Step("fwd", "prefix", subbatch=s) for s in range(k)]
    for block in request.blocks:
        forward += [Step("fwd", "block", block, s) for s in range(k)]
    if request.has_suffix:
        forward += [Step("fwd", "suffix", subbatch=s) for s in range(k)]
    if not request.backward:
        return forward
    return forward + [dataclasses.replace(step, phase="bwd") for step in reversed(forward)]


def add_stashes(steps: list[Step], request: ScheduleRequest, keep=lambda step: False) -> list[Step]:
    """Marks the activations of every forward (prefix or block, sub-batch) step for
    the stash, except those `keep(step)` keeps on the device.

    The stash issue follows the step's compute; where its wait and the backward's
    unstash land is the `offload_activations` pass's rule (after the last forward use;
    one (block, sub-batch) ahead of the backward use), read back by `schedule_of`.
    """
    if not (request.activations_offloaded and request.backward):
        return steps
    out: list[Step] = []
    for step in steps:
        out.append(step)
        if step.phase == "fwd" and step.kind == "compute" and step.region != "suffix" and not keep(step):
            out.append(Step("fwd", step.region, step.block, step.subbatch, "stash.issue"))
    return out


def speedloader_schedule(request: ScheduleRequest) -> Schedule:
    """The speedloader schedule for a request."""
    steps = add_fetches(layer_major_compute(request), request, per_subbatch=False)
    return Schedule(tuple(add_stashes(steps, request)))


SPEEDLOADER = Policy("speedloader", speedloader_schedule)
NO_OFFLOAD = Policy("no_offload", speedloader_schedule)
