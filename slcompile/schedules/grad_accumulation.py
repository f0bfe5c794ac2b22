"""The grad_accumulation policy: sample-major, the baseline speedloader is compared with.

Forward: sub-batch (micro-batch) 0 runs the prefix, every block and the suffix, then
micro-batch 1 does the same, and so on; the loss is combined over all of them at the
end (with `suffix="whole"`, the suffix runs once, after the last micro-batch's
blocks). Backward: micro-batch K-1 runs the suffix, the blocks from last to first and the
prefix, then micro-batch K-2, and so on down to 0 (the autograd engine runs the
ready work with the highest sequence number first, and micro-batch K-1 ran last).
A block's weight gradients are summed over the micro-batches as each one finishes it.
Streamed weights are fetched once per (block, micro-batch) per pass, as gradient
accumulation loads them: K times speedloader's weight traffic. Weight gradients, when
an offloaded optimizer takes them, leave once per (block, micro-batch), as each
micro-batch's backward of the block ends (the optimizer's tier sums them): K times
speedloader's gradient traffic.
"""

from __future__ import annotations

from slcompile.schedules.base import Schedule, ScheduleRequest, Step, add_fetches, add_gradient_stores
from slcompile.schedules.policy import Policy
from slcompile.schedules.speedloader import add_stashes

__all__ = ["grad_accumulation_schedule", "GRAD_ACCUMULATION"]


def grad_accumulation_schedule(request: ScheduleRequest) -> Schedule:
    """The grad_accumulation schedule for a request."""
    steps: list[Step] = []
    for s in range(request.num_subbatches):
        steps += _micro_batch("fwd", request, s)
    # A suffix run once on the whole batch (`suffix="whole"` asked of this policy)
    # waits for every micro-batch's blocks; its backward comes first.
    whole = [Step("fwd", "suffix")] if request.has_suffix and request.whole_suffix else []
    steps += whole
    if request.backward:
        steps += [Step("bwd", "suffix") for _ in whole]
        for s in reversed(range(request.num_subbatches)):
            steps += _micro_batch("bwd", request, s)
    steps = add_stashes(add_fetches(steps, request, per_subbatch=True), request)
    if request.gradients_offloaded and request.weights_streamed and request.backward:
        steps = add_gradient_stores(steps, per_subbatch=True)
    return Schedule(tuple(steps))


def _micro_batch(phase: str, request: ScheduleRequest, subbatch: int) -> list[Step]:
    """One micro-batch through the whole model, in the phase's direction."""
    steps: list[Step] = []
    if request.has_prefix:
        steps.append(Step(phase, "prefix", subbatch=subbatch))
    steps += [Step(phase, "block", block, subbatch) for block in request.blocks]
    if request.has_suffix and not request.whole_suffix:
        steps.append(Step(phase, "suffix", subbatch=subbatch))
    return steps if phase == "fwd" else steps[::-1]


GRAD_ACCUMULATION = Policy("grad_accumulation", grad_accumulation_schedule)
