"""Schedules that `validate_schedule` accepts compile into graphs that make them: a
block whose sub-batches run apart ("pairs": sub-batches 0 and 1 through every block,
then 2 and 3), stashes kept by `add_stashes(keep=...)` under a machine profile whose
loads need more than one step to hide, and `tune` over a policy the passes refuse for
some plans. Each compiled step matches eager, and the schedule read back from the
graphs is the planned one, line for line; the memory model counts the prefetch
cycle's visits as the streamer does."""

import dataclasses
import re

import pytest
import torch

import slcompile
from slcompile.analysis.machine import MachineProfile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.schedules import (
    Policy, Schedule, Step, add_fetches, add_stashes, add_stores, layer_major_compute, speedloader_schedule,
)

CFG = GPTConfig(n_layers=6, d_model=64, seq_len=32, vocab_size=256)
SMALL = GPTConfig(n_layers=2)
OPTIONS = {"lowering": "aot_eager", "weights": "nvme", "activations": "nvme", "num_subbatches": 4}


def pairs(request):
    """Sub-batches (0, 1) through every block, then (2, 3); one weight fetch per block
    per phase, shared by both visits."""
    k = request.num_subbatches
    forward = [Step("fwd", "prefix", subbatch=s) for s in range(k)]
    for group in [tuple(range(g, min(g + 2, k))) for g in range(0, k, 2)]:
        for block in request.blocks:
            forward += [Step("fwd", "block", block, s) for s in group]
    forward += [Step("fwd", "suffix", subbatch=s) for s in range(k)]
    backward = [Step("bwd", s.region, s.block, s.subbatch) for s in reversed(forward)]
    steps = add_fetches(forward + backward, request, per_subbatch=False)
    return Schedule(tuple(add_stores(add_stashes(steps, request), request)))


def _compiled_as_planned(policy, **options):
    idx, targets = make_gpt_batch(CFG, 8)
    torch.manual_seed(0)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {**OPTIONS, "schedule": policy, **options})
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert report.schedule == report.planned_schedule.text()
    return report


@pytest.mark.parametrize("activations", ["nvme", "device"])
def test_a_block_whose_sub_batches_run_apart_waits_for_its_weights_where_the_schedule_does(activations):
    report = _compiled_as_planned(Policy("pairs", pairs), activations=activations)
    forward = report.schedule.splitlines()[:12]
    assert forward[4:8] == ["fwd fetch.issue blk1", "fwd fetch.wait blk0", "fwd blk0.sb0",
                            "fwd stash.issue blk0.sb0" if activations == "nvme" else "fwd blk0.sb1"]
    # One wait per block and phase: the second visit reads the weights of the first.
    assert report.schedule.count("fwd fetch.wait blk0") == 1 and report.schedule.count("bwd fetch.wait blk0") == 1


def no_issues(request):
    """Speedloader's schedule without its fetch issues: valid (a wait may load the
    weights itself), and what the graphs make when no load is issued ahead
    (`live_blocks=1`), but not otherwise."""
    return Schedule(tuple(s for s in speedloader_schedule(request).steps if s.kind != "fetch.issue"))


def test_a_refused_policy_leaves_both_schedules_in_the_report():
    # The graphs issue each load a visit ahead: the report keeps the plan and what the
    # graphs make, as the message says to compare them.
    idx, targets = make_gpt_batch(CFG, 8)
    compiled = torch.compile(TinyGPT(CFG), backend="speedloader",
                             options={**OPTIONS, "schedule": Policy("bare", no_issues)})
    with pytest.raises(slcompile.CompileError, match=re.escape("`fwd fetch.wait blk0`: the compiled graphs make "
                                                               "`fwd fetch.issue blk1` instead")):
        compiled(idx, targets)
    report = slcompile.compile_reports()[-1]
    assert "fetch.issue" not in report.planned_schedule.text()
    assert report.schedule.splitlines()[4:6] == ["fwd fetch.issue blk1", "fwd fetch.wait blk0"]


# A CPU-like machine whose disk reads at 100 MB/s: a stashed tensor's load needs
# several steps of compute ahead of its use, a larger one more than a smaller one.
SLOW_READS = MachineProfile("slow-reads", matmul_flops=1e11, memory_bandwidth=8e10, op_overhead_seconds=2e-6,
                            nvme_read=1e8, nvme_write=3e9)


def keeping(kept):
    """Speedloader's order, keeping the saved activations of the (block, sub-batch)
    steps in `kept` on the device."""
    def build(request):
        steps = add_fetches(layer_major_compute(request), request, per_subbatch=False)
        keep = lambda step: (step.block, step.subbatch) in kept  # noqa: E731
        return Schedule(tuple(add_stores(add_stashes(steps, request, keep), request)))

    return Policy("keeping", build)


def test_with_a_machine_profile_kept_stashes_load_where_the_schedule_issues_them():
    report = _compiled_as_planned(keeping({(0, 3), (3, 1)}), machine_profile=SLOW_READS)
    # The profile placed the loads: counting steps would issue them elsewhere.
    planned = report.planned_schedule
    assert planned.phase("bwd") != planned.replan(timing=None).phase("bwd")


TUNED = {**OPTIONS, "num_subbatches": [4], "schedule": Policy("bare", no_issues)}


def test_tune_skips_a_candidate_whose_schedule_is_refused_and_says_why():
    idx, targets = make_gpt_batch(SMALL, 8)
    result = slcompile.tune(TinyGPT(SMALL), idx, targets, memory_budget="1GiB", live_blocks=(2, 1),
                            profile=SLOW_READS, **TUNED)
    refused, fitting = result.tried
    assert refused.live_blocks == 2 and not refused.fits and refused.peak_bytes is None
    assert refused.refused.startswith("schedule policy 'bare' at step `fwd fetch.wait blk0`: the compiled graphs "
                                      "make `fwd fetch.issue blk1` instead")
    assert refused.describe().startswith("K=4 live_blocks=2 weights=nvme activations=nvme schedule=bare: refused "
                                         "(schedule policy")
    assert fitting.fits and result.options == fitting.options and result.options["live_blocks"] == 1
    # Refused for every plan, the policy's error is raised.
    with pytest.raises(slcompile.PolicyError, match="^schedule policy 'bare' at step `fwd fetch.wait blk0`"):
        slcompile.tune(TinyGPT(SMALL), idx, targets, memory_budget="1GiB", live_blocks=(2,),
                       profile=SLOW_READS, **TUNED)


def test_the_memory_model_counts_a_fetch_per_sub_batch_as_a_visit_of_its_own():
    # Pairs with a fetch per sub-batch: blk0.sb0 and blk0.sb1 fetch one after the
    # other, two visits of the prefetch cycle, as the streamer issues them.
    def pairs_fetching_per_subbatch(request):
        compute = [s for s in pairs(request).steps if s.kind == "compute"]
        steps = add_fetches(compute, request, per_subbatch=True)
        return Schedule(tuple(add_stores(add_stashes(steps, request), request)))

    idx, targets = make_gpt_batch(CFG, 8)
    comparison = slcompile.compare_policies(
        TinyGPT(CFG), idx, targets, policies=[Policy("pairs_per_subbatch", pairs_fetching_per_subbatch)], **OPTIONS)
    row, = comparison.rows
    assert row.report.planned_schedule.fetches_per_subbatch()
    assert abs(row.predicted_peak_bytes - row.measured_peak_bytes) <= 8, (row.predicted_peak_bytes,
                                                                         row.measured_peak_bytes)


def test_a_fetch_per_run_loads_each_block_once_per_pair_and_matches_eager():
    """Pairs with a fetch per run (`add_fetches(per_run=True)`): each block's weights
    are fetched once for sub-batches (0, 1) and once for (2, 3) in each phase, the
    backward reading the runs of the forward; eager's numbers, the planned transfers,
    more weight bytes than one fetch per phase, and the predicted peak as measured."""
    def fetching(**how):
        def policy(request):
            compute = [s for s in pairs(request).steps if s.kind == "compute"]
            return Schedule(tuple(add_stores(add_stashes(add_fetches(compute, request, **how), request), request)))
        return policy

    policies = [Policy(name, fetching(**how)) for name, how in (
        ("per_phase", dict(per_subbatch=False)), ("per_run", dict(per_subbatch=False, per_run=True)))]
    report = _compiled_as_planned(policies[1], activations="device")
    assert [line for line in report.schedule.splitlines() if "fetch.wait blk0" in line] == [
        "fwd fetch.wait blk0.sb0", "fwd fetch.wait blk0.sb2", "bwd fetch.wait blk0.sb2", "bwd fetch.wait blk0.sb0"]
    comparison = slcompile.compare_policies(TinyGPT(CFG), *make_gpt_batch(CFG, 8), policies=policies,
                                            **{**OPTIONS, "activations": "device"})
    fetched = [sum(n for (kind, _, _), n in row.bytes_moved.items() if str(getattr(kind, "value", kind)) == "weight")
               for row in comparison.rows]
    assert 0 < fetched[0] < fetched[1], fetched
    run = comparison.rows[1]
    assert abs(run.predicted_peak_bytes - run.measured_peak_bytes) <= 8, (run.predicted_peak_bytes,
                                                                         run.measured_peak_bytes)


def recomputing(name, units):
    """Speedloader's schedule, the backward recomputing the (block, sub-batch) units
    `units(request)` names (`Schedule.recompute`)."""
    def build(request):
        return dataclasses.replace(speedloader_schedule(request), recompute=units(request))

    return Policy(name, build)


def test_a_policy_recomputing_some_units_matches_eager_and_peaks_as_predicted():
    """A schedule recomputing block 1 alone, with recompute="none" in the options
    (the schedule's choice stands for it): eager's numbers, the planned transfers,
    block 1's units saving their output alone, the time model counting block 1's
    forward matmuls once more (it reads the recomputation from the graphs), and
    the predicted peak as measured."""
    options = {**OPTIONS, "num_subbatches": 2, "min_offload_bytes": 0, "recompute": "none"}
    block_1 = recomputing("block_1", lambda request: {(request.blocks[1], s) for s in range(2)})
    idx, targets = make_gpt_batch(SMALL, 8)
    assert_matches_eager(TinyGPT(SMALL), lambda m: m(idx, targets), {**options, "schedule": block_1})
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None and report.memory.recompute == "policy"
    planned = report.planned_schedule
    assert planned.text().splitlines()[0] == "recompute blk1.sb0 blk1.sb1"
    assert report.schedule == dataclasses.replace(planned, recompute=None).text()
    saved = {}
    for activation in planned.request.saved:
        if activation.stays is None:
            saved.setdefault(activation.owner, []).append(activation.nbytes)
    boundary = 4 * SMALL.seq_len * SMALL.d_model * 4  # one sub-batch's block output
    assert saved[("block", 1, 0)] == saved[("block", 1, 1)] == [boundary]
    assert sum(saved[("block", 0, 0)]) == sum(saved[("block", 0, 1)]) > 4 * boundary

    row, = slcompile.compare_policies(TinyGPT(SMALL), idx, targets, policies=[block_1], profile="h100-pcie5-nvme",
                                      **options).rows
    assert abs(row.predicted_peak_bytes - row.measured_peak_bytes) <= 8, (row.predicted_peak_bytes,
                                                                         row.measured_peak_bytes)
    flops = {block.region: block.flops for block in row.time.blocks}
    # The backward runs block 1's matmuls whose outputs it reads once more: qkv and
    # fc, d_model -> 7 * d_model for each of the batch's 8 * seq_len tokens.
    tokens, d_model = 8 * SMALL.seq_len, SMALL.d_model
    assert flops["blk1"] - flops["blk0"] == 2 * tokens * d_model * 7 * d_model, flops
