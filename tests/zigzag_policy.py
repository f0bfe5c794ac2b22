"""A policy module for the command-line tests (`--policy-module zigzag_policy`): its
import registers "zigzag_test" (even blocks run sub-batches 0..K-1, odd ones K-1..0), with
the suffix run as the request says (`suffix_compute`: whole, as speedloader's)."""

from slcompile.schedules import (
    Policy, Schedule, Step, add_fetches, add_stashes, add_stores, register_policy, suffix_compute,
)


def zigzag(request):
    k = request.num_subbatches
    forward = [Step("fwd", "prefix", subbatch=s) for s in range(k)]
    for position, block in enumerate(request.blocks):
        order = range(k) if position % 2 == 0 else reversed(range(k))
        forward += [Step("fwd", "block", block, s) for s in order]
    forward += suffix_compute(request)
    backward = [Step("bwd", s.region, s.block, s.subbatch) for s in reversed(forward)] if request.backward else []
    steps = add_fetches(forward + backward, request, per_subbatch=False)
    return Schedule(tuple(add_stores(add_stashes(steps, request), request)))


ZIGZAG = register_policy(Policy("zigzag_test", zigzag, suffix="whole"), replace=True)
