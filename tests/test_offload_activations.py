"""Saved activations on the nvme tier, block recomputation, the memory budget, and
predicted against measured peak memory."""

import copy
import dataclasses

import pytest
import torch

import slcompile
from conftest import assert_matches_eager, steady_step_peak_bytes
from models import GPTConfig, TinyGPT, hf_gpt2, make_gpt_batch
from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.memory import predict_memory
from slcompile.runtime import Tier, TransferKind, collect_garbage, get_engine, reset_runtime_stats, runtime_stats
from slcompile.runtime.storage.tiers import PAGE_BYTES
from slcompile.schedules import Policy, speedloader_schedule

CFG = GPTConfig()
STORE = (TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME)
LOAD = (TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE)
OFFLOAD = {"lowering": "aot_eager", "activations": "nvme", "min_offload_bytes": 0}


def _activation_bytes():
    moved = runtime_stats().bytes_moved
    return moved.get(STORE, 0), moved.get(LOAD, 0)


@pytest.mark.parametrize("recompute", ["none", "blocks"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_tiny_gpt_with_activations_on_nvme_matches_eager(k, recompute):
    idx, targets = make_gpt_batch(CFG, 8)
    collect_garbage()  # what earlier tests left on nvme goes now, not during the step
    reset_runtime_stats()
    nvme_before = runtime_stats().resident_bytes.get(Tier.NVME, 0)
    assert_matches_eager(
        TinyGPT(CFG), lambda m: m(idx, targets), {**OFFLOAD, "num_subbatches": k, "recompute": recompute}
    )
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    offloaded = report.offloaded_activations
    assert offloaded.names
    # Every offloaded tensor goes out once and comes back once: the bytes of the
    # lifetimes' formula, both ways.
    assert _activation_bytes() == (int(offloaded.bytes), int(offloaded.bytes))
    # The predicted nvme peak against the most bytes the runtime held there at once
    # (every store of the forward is still there when the backward starts).
    nvme_peak = runtime_stats().cumulative.peak_bytes[Tier.NVME] - nvme_before
    assert report.memory.peak_bytes["nvme"] == nvme_peak


def _recomputing(units):
    """Speedloader's schedule, recomputing the (block, sub-batch) units `units`."""
    return Policy("some_units", lambda request: dataclasses.replace(speedloader_schedule(request), recompute=units),
                  suffix="whole")


def test_block_recompute_saves_only_each_block_input():
    idx, targets = make_gpt_batch(CFG, 8)
    kept, recomputed, some = {}, {}, {}
    # The third plan: a schedule recomputing 3 of the 8 (block, sub-batch) units, its
    # choice standing for the option's.
    units = frozenset({(0, 1), (2, 0), (3, 1)})
    for options, into in (({"recompute": "none"}, kept), ({"recompute": "blocks"}, recomputed),
                          ({"recompute": "none", "schedule": _recomputing(units)}, some)):
        torch._dynamo.reset()
        compiled = torch.compile(
            TinyGPT(CFG), backend="speedloader",
            options={**OFFLOAD, "num_subbatches": 2, **options},
        )
        compiled(idx, targets)[1].backward()
        report = slcompile.compile_reports()[-1]
        into["names"] = report.offloaded_activations.names
        into["bytes"] = int(report.offloaded_activations.bytes)
        into["peak"] = report.memory.step_peak_bytes
    # One (batch/K, seq, d_model) tensor per sub-batch at each block boundary: the
    # prefix's output and every block's output but the last (the suffix, run on the
    # whole batch, saves the last outputs concatenated, on the device).
    boundary = 4 * CFG.seq_len * CFG.d_model * 4
    assert len(recomputed["names"]) == CFG.n_layers * 2
    assert recomputed["bytes"] == CFG.n_layers * 2 * boundary
    assert kept["bytes"] > 4 * recomputed["bytes"]
    assert recomputed["peak"] < kept["peak"]
    # Each unit saves what the option would make it save: the units recomputed one
    # boundary, the others all they keep.
    per_unit, rest = divmod(kept["bytes"] - recomputed["bytes"], CFG.n_layers * 2)
    assert rest == 0 and some["bytes"] == kept["bytes"] - len(units) * per_unit
    assert len(some["names"]) < len(kept["names"])
    assert recomputed["peak"] <= some["peak"] <= kept["peak"]


def test_hf_gpt2_with_weights_and_activations_on_nvme_matches_eager():
    idx, labels = make_gpt_batch(CFG, 8)

    def call(m):
        out = m(idx, labels=labels)
        return out.logits, out.loss

    options = {**OFFLOAD, "weights": "nvme", "num_subbatches": 2}
    reset_runtime_stats()
    assert_matches_eager(hf_gpt2(), call, options)
    offloaded = slcompile.compile_reports()[-1].offloaded_activations
    assert offloaded.names
    assert _activation_bytes() == (int(offloaded.bytes), int(offloaded.bytes))


def test_activations_on_host_match_eager():
    # On a CPU machine host memory is the device's: nothing moves, results agree.
    idx, targets = make_gpt_batch(CFG, 8)
    reset_runtime_stats()
    assert_matches_eager(
        TinyGPT(CFG), lambda m: m(idx, targets),
        {"lowering": "aot_eager", "activations": "host", "weights": "host", "num_subbatches": 2},
    )
    assert _activation_bytes() == (0, 0)


def test_two_forwards_before_their_backwards_keep_their_own_activations():
    model = TinyGPT(CFG)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="speedloader", options={**OFFLOAD, "num_subbatches": 2})
    first, second = make_gpt_batch(CFG, 8), make_gpt_batch(CFG, 8)
    loss_a = compiled(*first)[1]
    loss_b = compiled(*second)[1]
    (loss_a + 2 * loss_b).backward()
    (eager(*first)[1] + 2 * eager(*second)[1]).backward()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.usefixtures("without_collections")
def test_stored_activations_are_freed_after_the_backward_or_with_the_graph():
    engine = get_engine()
    compiled = torch.compile(TinyGPT(CFG), backend="speedloader", options={**OFFLOAD, "num_subbatches": 2})
    idx, targets = make_gpt_batch(CFG, 8)
    compiled(idx, targets)[1].backward()
    collect_garbage()
    before = set(engine.keys())
    offloaded = len(slcompile.compile_reports()[-1].offloaded_activations.names)
    loss = compiled(idx, targets)[1]
    assert len(set(engine.keys()) - before) == offloaded
    loss.backward()
    assert set(engine.keys()) == before
    loss = compiled(idx, targets)[1]  # a forward whose backward never runs
    assert len(set(engine.keys()) - before) == offloaded
    del loss
    assert set(engine.keys()) == before


def test_infeasible_budget_names_the_smallest_budget_and_that_budget_runs():
    idx, targets = make_gpt_batch(CFG, 8)
    options = {**OFFLOAD, "num_subbatches": 2, "memory_budget": 1000}
    with pytest.raises(Exception, match="over memory_budget=1000") as caught:
        torch.compile(TinyGPT(CFG), backend="speedloader", options=options)(idx, targets)
    # Dynamo wraps what a backend raises; the BudgetError is the cause.
    error = caught.value.__cause__ or getattr(caught.value, "inner_exception", None)
    assert isinstance(error, slcompile.BudgetError)
    assert error.budget == 1000
    assert str(error.smallest) in str(error)
    # The smallest plan recomputes the blocks; at exactly that budget it compiles,
    # runs and matches eager.
    assert {p.recompute for p in error.tried} == {"none", "blocks"}
    best = min(error.tried, key=lambda p: p.peak_bytes["device"])
    assert best.recompute == "blocks" and error.smallest == best.peak_bytes["device"]
    torch._dynamo.reset()
    assert_matches_eager(
        TinyGPT(CFG), lambda m: m(idx, targets), {**options, "memory_budget": error.smallest}
    )
    report = slcompile.compile_reports()[-1]
    assert report.memory.recompute == "blocks"
    assert report.memory.peak_bytes["device"] <= error.smallest


def test_budget_keeps_activations_when_they_fit():
    idx, targets = make_gpt_batch(CFG, 8)
    compiled = torch.compile(
        TinyGPT(CFG), backend="speedloader", options={**OFFLOAD, "num_subbatches": 2, "memory_budget": "1GiB"}
    )
    compiled(idx, targets)[1].backward()
    assert slcompile.compile_reports()[-1].memory.recompute == "none"


def test_with_a_machine_profile_the_planner_stashes_only_what_hides_and_the_step_is_predicted_faster():
    import dataclasses

    from slcompile.analysis.machine import MachineProfile

    cfg = GPTConfig(n_layers=3)
    idx, targets = make_gpt_batch(cfg, 8)
    options = {**OFFLOAD, "num_subbatches": 2}
    keep_peak = slcompile.explain(TinyGPT(cfg), idx, targets, **options, memory_budget="1GiB").memory.peak_bytes[
        "device"]
    budget = int(0.8 * keep_peak)
    cpu = MachineProfile("cpu", matmul_flops=2e10, memory_bandwidth=3e10, op_overhead_seconds=2e-6)
    slow_disk = dataclasses.replace(cpu, name="slow disk", nvme_write=1e8, nvme_read=5e7)

    def explained(machine_profile, profile):
        return slcompile.explain(TinyGPT(cfg), idx, targets, **options, memory_budget=budget,
                                 machine_profile=machine_profile, profile=profile)

    # Counting steps stashes activations whose transfers this disk cannot hide; by
    # time none hides, so the blocks are recomputed instead: no stall, a faster step.
    by_steps, by_time = explained(None, slow_disk), explained(slow_disk, slow_disk)
    assert by_steps.memory.recompute == "none" and by_steps.time.stall_seconds > 0
    assert by_time.memory.recompute == "blocks" and by_time.time.stall_seconds == 0
    assert by_time.time.step_seconds < by_steps.time.step_seconds
    assert by_time.memory.peak_bytes["device"] <= budget
    reset_runtime_stats()
    assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), {**options, "memory_budget": budget,
                                                                   "machine_profile": slow_disk})
    report = slcompile.compile_reports()[-1]
    assert report.schedule == by_time.graphs[0].schedule and _activation_bytes() == (0, 0)

    # A disk ten times faster: the same units leave, their transfers placed where the
    # compute around them covers their time, which stalls less than one step apart.
    disk = dataclasses.replace(cpu, name="disk", nvme_write=1e9, nvme_read=5e8)
    by_steps, by_time = explained(None, disk), explained(disk, disk)
    assert by_time.memory.recompute == "none"
    stashed = [[line.split(":")[0] for line in e.graphs[0].activation_plan if ": stash" in line]
               for e in (by_steps, by_time)]
    assert stashed[0] == stashed[1] and stashed[0]
    assert by_time.time.stall_seconds < by_steps.time.stall_seconds
    reset_runtime_stats()
    assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), {**options, "memory_budget": budget,
                                                                   "machine_profile": disk})
    report = slcompile.compile_reports()[-1]
    assert report.schedule == by_time.graphs[0].schedule
    offloaded = int(report.offloaded_activations.bytes)
    assert offloaded > 0 and _activation_bytes() == (offloaded, offloaded)


def test_under_a_budget_the_planner_stashes_the_longest_idle_activations_it_needs():
    from slcompile.schedules.planner import unit_lifetimes

    cfg = GPTConfig(n_layers=3)
    idx, targets = make_gpt_batch(cfg, 8)
    # The suffix whole throughout: under "auto", a budget the whole suffix misses
    # would be met with it per sub-batch before the activations' plans are told apart.
    options = {**OFFLOAD, "num_subbatches": 2, "suffix": "whole"}
    roomy = slcompile.explain(TinyGPT(cfg), idx, targets, **options, memory_budget="1GiB").graphs[0]
    # Keeping fits: nothing moves.
    assert roomy.memory.peak_bytes["nvme"] == 0 and all(": keep (" in line for line in roomy.activation_plan)
    keep_peak = roomy.memory.peak_bytes["device"]

    budget = int(0.8 * keep_peak)
    reset_runtime_stats()
    assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), {**options, "memory_budget": budget})
    report = slcompile.compile_reports()[-1]
    assert report.memory.recompute == "none" and report.memory.peak_bytes["device"] <= budget
    planned = report.planned_schedule
    units = unit_lifetimes(list(planned.steps), planned.request.saved)
    stashed = planned.stashes()
    # Some, not all: the longest idle ones, and none whose reload could not hide.
    assert 0 < len(stashed) < len(units)
    idle = sorted(units.values(), key=lambda u: -u.idle_steps)
    assert stashed == {u.unit for u in idle[:len(stashed)]}
    assert all(units[unit].hidden for unit in stashed)
    assert report.schedule == planned.text()
    offloaded = int(report.offloaded_activations.bytes)
    assert offloaded == sum(units[unit].nbytes for unit in stashed)
    assert _activation_bytes() == (offloaded, offloaded)

    # A budget below what stashing every activation reaches: "auto" recomputes the
    # blocks; "none" (the user's choice) tried every activation stashed and refuses.
    tight = int(0.55 * keep_peak)
    auto = slcompile.explain(TinyGPT(cfg), idx, targets, **options, memory_budget=tight).graphs[0]
    assert auto.memory.recompute == "blocks" and auto.memory.peak_bytes["device"] <= tight
    kept = slcompile.explain(TinyGPT(cfg), idx, targets, **options, memory_budget=tight, recompute="none").graphs[0]
    assert kept.memory is None and f"over memory_budget={tight}" in kept.budget_error


MEASURED_CFG = GPTConfig(d_model=64, seq_len=32)


@pytest.mark.parametrize("live_blocks", [1, 2])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_predicted_peak_within_five_percent_with_weights_and_activations_on_nvme(k, live_blocks):
    """Loads land in memory from torch's CPU allocator (`buffers_seen_by_profiler`),
    so the profiler sees fetched weights and reloaded activations with every other
    tensor; in that mode each loaded buffer carries one page of alignment slack,
    which the prediction is told about."""
    model = TinyGPT(MEASURED_CFG)
    idx, targets = make_gpt_batch(MEASURED_CFG, 8)
    options = {
        "lowering": "aot_eager", "num_subbatches": k, "weights": "nvme", "activations": "nvme",
        "live_blocks": live_blocks, "min_offload_bytes": 4096,
    }
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step():
        logits, loss = compiled(idx, targets)  # the caller holds the outputs, as usual
        loss.backward()

    measured = steady_step_peak_bytes(model, step)
    report = slcompile.compile_reports()[-1]
    predicted = predict_memory(
        report.graphs["forward"], report.graphs["backward"], live_blocks=live_blocks,
        machine=MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES),
    ).step_peak_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


@pytest.mark.slow
def test_inductor_with_weights_and_activations_on_nvme_and_block_recompute_matches_eager():
    # Block recompute is the Inductor-specific path (min-cut partitioner, joint-graph
    # pre-pass tags); offloading what is kept runs the same passes as under aot_eager.
    recompute = "blocks"
    idx, targets = make_gpt_batch(CFG, 8)
    reset_runtime_stats()
    options = {
        "lowering": "inductor", "weights": "nvme", "activations": "nvme", "min_offload_bytes": 0,
        "num_subbatches": 2, "recompute": recompute,
    }
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    offloaded = slcompile.compile_reports()[-1].offloaded_activations
    assert offloaded.names
    assert _activation_bytes() == (int(offloaded.bytes), int(offloaded.bytes))
