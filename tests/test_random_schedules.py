"""Random schedules, seeded: sub-batches interleaved through the blocks in a random
valid order (each sub-batch's regions in their order, the sub-batches mixed at random),
a random backward order, fetches per block or per sub-batch, a random set of steps
whose saved activations stay on the device (`add_stashes(keep=...)`), sometimes a
weight fetch's wait moved after the compute that needs it. A schedule `validate_schedule` accepts compiles into
graphs that make it, line for line, and match eager (loss and gradients); one it
refuses is named by its offending step."""

import dataclasses
import random

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.schedules import (
    Policy, Schedule, ScheduleRequest, Step, add_fetches, add_stashes, add_stores, validate_schedule,
)

CFG = GPTConfig(n_layers=3)
OPTIONS = {"lowering": "aot_eager", "weights": "nvme", "activations": "nvme", "num_subbatches": 3,
           "min_offload_bytes": 0}
REQUEST = ScheduleRequest(blocks=(0, 1, 2), num_subbatches=3, live_blocks=2, weights_streamed=True,
                          activations_offloaded=True)


def _interleaved(rng, request, phase, reverse):
    """Every sub-batch's regions in order (reversed for a backward), the sub-batches
    taking turns at random."""
    regions = [("prefix", None)] + [("block", b) for b in request.blocks] + [("suffix", None)]
    if reverse:
        regions.reverse()
    position = [0] * request.num_subbatches
    steps = []
    while any(p < len(regions) for p in position):
        subbatch = rng.choice([s for s, p in enumerate(position) if p < len(regions)])
        region, block = regions[position[subbatch]]
        steps.append(Step(phase, region, block, subbatch))
        position[subbatch] += 1
    return steps


def random_policy(seed):
    rng = random.Random(seed)
    forward = _interleaved(rng, REQUEST, "fwd", reverse=False)
    backward = _interleaved(rng, REQUEST, "bwd", reverse=True)
    per_subbatch = rng.random() < 0.3
    kept = {s.key for s in forward if rng.random() < 0.4}
    broken = rng.random() < 0.25
    where = rng.random()

    def build(request):
        steps = add_fetches(forward + backward, request, per_subbatch=per_subbatch)
        steps = add_stores(add_stashes(steps, request, keep=lambda step: step.key in kept), request)
        if broken:  # a weight fetch's wait moved to the end: after the compute it serves
            waits = [i for i, s in enumerate(steps) if s.kind == "fetch.wait"]
            steps.append(steps.pop(waits[int(where * len(waits))]))
        return Schedule(tuple(steps))

    return Policy(f"random{seed}", build)


@pytest.mark.parametrize("seed", range(6))
def test_a_random_schedule_compiles_as_planned_or_is_refused_at_its_step(seed):
    policy = random_policy(seed)
    try:
        validate_schedule(policy.build(REQUEST), REQUEST, policy.name)
    except slcompile.PolicyError as refused:
        assert refused.policy == policy.name and refused.step is not None
        assert str(refused).startswith(f"schedule policy {policy.name!r} at step `{refused.step}`: ")
        return
    idx, targets = make_gpt_batch(CFG, 6)
    torch.manual_seed(0)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {**OPTIONS, "schedule": policy})
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert report.schedule == report.planned_schedule.text()
