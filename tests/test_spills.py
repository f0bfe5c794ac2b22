"""Boundary activations spilled while they wait for their sub-batch's next region:
the `spill.*` / `fill.*` steps a policy places, their validation, the spilling
policies, exact bytes moved, numerics against eager, and predicted against measured
memory."""

import copy

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, hf_llama, make_gpt_batch
from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.memory import measured_peak_bytes, predict_memory
from slcompile.runtime import Tier, TransferKind, collect_garbage, reset_runtime_stats, runtime_stats
from slcompile.runtime.storage.nvme import buffers_seen_by_profiler
from slcompile.runtime.storage.tiers import PAGE_BYTES
from slcompile.schedules import POLICIES, Policy, Schedule, ScheduleRequest, Step, validate_schedule

CFG = GPTConfig(vocab_size=32, seq_len=32, d_model=64, n_heads=2, n_layers=4)
BATCH, K = 32, 8
BOUNDARY = BATCH // K * CFG.seq_len * CFG.d_model * 4  # one sub-batch's hidden state, float32
SPILL = {"lowering": "aot_eager", "activations": "nvme", "min_offload_bytes": 0, "num_subbatches": K,
         "on_refusal": "raise"}
STORE = (TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME)
LOAD = (TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE)
REQUEST = ScheduleRequest(blocks=(0, 1, 2), num_subbatches=4, activations_offloaded=True, backward=False)


def _as_written(name: str) -> Policy:
    """The built-in policy under another name: the compiled graphs must then make
    exactly its transfers (a built-in policy's disagreement is only logged)."""
    return Policy(f"{name}_checked", POLICIES[name].build)


def _spilled(schedule: Schedule) -> set[str]:
    return {Step("fwd", *key).tag for key in schedule.spills()}


def test_layer_major_spills_every_output_that_waits_three_steps():
    # K=4: every output waits K-1 = 3 steps for its sub-batch's next region.
    schedule = POLICIES["spilling"](REQUEST)
    assert _spilled(schedule) == {f"{unit}.sb{s}" for unit in ("prefix", "blk0", "blk1", "blk2") for s in range(4)}
    # The store overlaps one step, the load the step before its reader.
    lines = schedule.text().splitlines()
    assert lines[lines.index("fwd blk0.sb0") + 1] == "fwd spill.issue blk0.sb0"
    assert lines.index("fwd blk0.sb1") < lines.index("fwd spill.wait blk0.sb0") < lines.index("fwd blk0.sb2")
    assert lines.index("fwd fill.issue blk0.sb0") < lines.index("fwd blk0.sb3") < \
        lines.index("fwd fill.wait blk0.sb0") < lines.index("fwd blk1.sb0")


def test_zigzag_keeps_the_outputs_its_turns_hand_straight_on():
    # Odd blocks run sub-batches 3..0: block 0's sb3 output is read at once, sb2's
    # after two steps; both stay. Block 1's sb1 and sb0 wait as little for block 2.
    schedule = POLICIES["zigzag_spilling"](REQUEST)
    assert _spilled(schedule) == {
        *(f"prefix.sb{s}" for s in range(4)), "blk0.sb0", "blk0.sb1", "blk1.sb3", "blk1.sb2",
        *(f"blk2.sb{s}" for s in range(4)),
    }


def _without(steps, text):
    return [s for s in steps if s.text() != text]


def _moved(steps, text, before):
    step = next(s for s in steps if s.text() == text)
    steps = [s for s in steps if s is not step]
    at = next(i for i, s in enumerate(steps) if s.text() == before)
    return steps[:at] + [step] + steps[at:]


@pytest.mark.parametrize("change, message", [
    (lambda steps: _without(steps, "fwd fill.issue blk0.sb1"), "comes before its `fwd fill.issue blk0.sb1`"),
    (lambda steps: [s for s in steps if s.kind in ("compute", "spill.issue") or s.tag != "blk0.sb1"],
     "computes before its input arrives: no `fwd fill.wait blk0.sb1`"),
    (lambda steps: _moved(steps, "fwd fill.wait blk0.sb1", "fwd spill.issue blk1.sb1"),
     "computes before its input arrives: no `fwd fill.wait blk0.sb1`"),
    (lambda steps: _moved(steps, "fwd spill.issue blk0.sb1", "fwd spill.wait blk0.sb1"),
     "right after `fwd blk0.sb1`"),
    (lambda steps: _moved(steps, "fwd fill.issue blk0.sb1", "fwd spill.wait blk0.sb1"),
     "comes before its `fwd spill.wait blk0.sb1`"),
    (lambda steps: steps + [Step("fwd", "suffix", None, 0, "spill.issue")], "the prefix or a block"),
])
def test_a_spill_out_of_order_names_its_step(change, message):
    steps = list(POLICIES["spilling"](REQUEST).steps)
    with pytest.raises(slcompile.PolicyError, match=message):
        validate_schedule(Schedule(tuple(change(steps))), REQUEST, "broken")


def test_a_spill_with_activations_on_the_device_is_an_error():
    steps = POLICIES["spilling"](REQUEST).steps
    on_device = ScheduleRequest(blocks=(0, 1, 2), num_subbatches=4, backward=False)
    with pytest.raises(slcompile.PolicyError, match="activations stay on the device"):
        validate_schedule(Schedule(steps), on_device, "broken")


def _activation_bytes():
    moved = runtime_stats().bytes_moved
    return moved.get(STORE, 0), moved.get(LOAD, 0)


def _evaluate(model, idx, targets, schedule):
    """(logits, predicted step peak, measured step peak, report, bytes stored and
    loaded, nvme tier peak) of one evaluation step under `schedule`."""
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="speedloader", options={**SPILL, "schedule": schedule})

    def step():
        with torch.no_grad():
            return compiled(idx, targets)

    with buffers_seen_by_profiler():
        step()
        collect_garbage()
        reset_runtime_stats()
        nvme_before = runtime_stats().resident_bytes.get(Tier.NVME, 0)
        measured = measured_peak_bytes(step)
        nvme_peak = runtime_stats().cumulative.peak_bytes.get(Tier.NVME, 0) - nvme_before
        moved = _activation_bytes()
    report = slcompile.compile_reports()[-1]
    pages = MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES)
    predicted = predict_memory(report.graphs["inference"], graph_kind="inference", machine=pages).step_peak_bytes
    return step()[0], predicted, measured, report, moved, nvme_peak


@pytest.mark.parametrize("policy, spilled", [("spilling", 5 * K), ("zigzag_spilling", K + 4 * (K - 2))])
def test_an_evaluation_spills_exactly_its_boundaries_and_its_peak_drops_as_predicted(policy, spilled):
    """Layer-major: each of the prefix's and the 4 blocks' outputs waits K-1 steps and
    leaves. Zigzag: the prefix's all leave; of each block's, the 2 read within two
    steps stay."""
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, BATCH)
    eager = model(idx, targets)[0]
    logits, predicted, measured, report, moved, nvme_peak = _evaluate(model, idx, targets, _as_written(policy))
    torch.testing.assert_close(logits, eager)
    assert len(report.spilled_boundaries.names) == spilled
    assert int(report.spilled_boundaries.bytes) == int(report.spilled_boundaries.stored_bytes) == spilled * BOUNDARY
    assert moved == (spilled * BOUNDARY, spilled * BOUNDARY)
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    # The tier holds the outputs in flight: at most one more than measured (a load
    # may end before or after the next store starts).
    assert nvme_peak <= report.memory.peak_bytes["nvme"] <= nvme_peak + BOUNDARY
    _, kept_predicted, kept_measured, kept, kept_moved, _ = _evaluate(model, idx, targets, _as_written("speedloader"))
    assert kept_moved == (0, 0) and not kept.spilled_boundaries.names
    # The K boundary activations waiting on the device are most of an evaluation's peak.
    assert measured < 0.8 * kept_measured and predicted < 0.8 * kept_predicted, (measured, kept_measured)


@pytest.mark.parametrize("min_offload_bytes", [0, 10**9], ids=["stashed", "kept"])
def test_a_training_step_spills_and_matches_eager(min_offload_bytes):
    """Stashed for the backward: the stash's store is the spill's, so the spill adds
    only its load. Kept on the device (too small to stash): the spill stores and
    loads it, and the backward reads the loaded copy."""
    torch.manual_seed(0)
    idx, targets = make_gpt_batch(CFG, BATCH)
    reset_runtime_stats()
    options = {**SPILL, "recompute": "blocks", "min_offload_bytes": min_offload_bytes,
               "schedule": _as_written("spilling")}
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    spilled = report.spilled_boundaries
    assert int(spilled.bytes) == 5 * K * BOUNDARY
    stashed = int(report.offloaded_activations.bytes)
    if min_offload_bytes:
        assert stashed == 0 and int(spilled.stored_bytes) == int(spilled.bytes)
    else:
        # Block recomputation saves exactly the boundaries (and the last block's output).
        assert stashed == 5 * K * BOUNDARY and int(spilled.stored_bytes) == 0
    assert _activation_bytes() == (stashed + int(spilled.stored_bytes), stashed + int(spilled.bytes))
    assert "fwd spill.issue blk2.sb0" in report.schedule and "fwd fill.wait blk2.sb0" in report.schedule


def test_hf_llama_with_a_padding_mask_spills_in_zigzag_order_and_matches_eager():
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (8, 16))
    mask = torch.ones(8, 16, dtype=torch.long)
    mask[1, :5] = 0
    options = {**SPILL, "num_subbatches": 4, "schedule": _as_written("zigzag_spilling")}

    def call(m):
        out = m(input_ids=ids, attention_mask=mask, labels=ids)
        return out.logits, out.loss

    model = hf_llama()
    assert_matches_eager(model, call, options, atol=1e-4, rtol=1e-4)
    assert slcompile.compile_reports()[-1].spilled_boundaries.names
    torch._dynamo.reset()
    compiled = torch.compile(copy.deepcopy(model), backend="speedloader", options=options)
    with torch.no_grad():
        torch.testing.assert_close(compiled(input_ids=ids, attention_mask=mask).logits,
                                   model(input_ids=ids, attention_mask=mask).logits, atol=1e-4, rtol=1e-4)
    assert slcompile.compile_reports()[-1].spilled_boundaries.names


@pytest.mark.slow
def test_inductor_evaluation_spills_and_matches_eager():
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, BATCH)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="speedloader",
                             options={**SPILL, "lowering": "inductor", "schedule": _as_written("spilling")})
    with torch.no_grad():
        reset_runtime_stats()
        torch.testing.assert_close(compiled(idx, targets)[0], model(idx, targets)[0], atol=1e-5, rtol=1e-5)
    assert _activation_bytes() == (5 * K * BOUNDARY, 5 * K * BOUNDARY)


def test_the_traces_name_spills_fills_and_each_units_sub_batch():
    """Measured and predicted, a boundary activation's store and load are drawn as a
    spill and a fill (not as a saved activation's stash), and each unit's compute is
    named by its block and sub-batch."""
    from collections import Counter

    from slcompile.analysis.machine import named_profile
    from slcompile.analysis.time import predict_time
    from slcompile.viz.pictures import record_step
    from slcompile.viz.trace import chrome_trace, predicted_chrome_trace

    torch.manual_seed(0)
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, BATCH)
    compiled = torch.compile(model, backend="speedloader", options={**SPILL, "schedule": _as_written("spilling")})

    def step():
        with torch.no_grad():
            compiled(idx, targets)

    step()
    recorded = record_step(step)
    report = slcompile.compile_reports()[-1]
    spilled = len(report.spilled_boundaries.names)
    measured = Counter(event["name"].split()[0] for event in chrome_trace(recorded.events)["traceEvents"]
                       if event.get("ph") == "X" and event["cat"] in ("load", "store"))
    assert measured["spill"] == measured["fill"] == spilled == 5 * K
    assert measured["activation"] == 0
    predicted = predict_time(report.graphs["inference"], profile=named_profile("h100-pcie5-nvme"),
                             tiers={"stash": "nvme", "unstash": "nvme"}, phase="inference")
    kinds = Counter(event.kind for event in predicted.events)
    assert kinds["spill"] == kinds["fill"] == spilled and not kinds["stash"] and not kinds["unstash"]
    slices = [event for event in predicted_chrome_trace(predicted)["traceEvents"] if event.get("ph") == "X"]
    units = {(event["args"]["region"], event["args"]["subbatch"]) for event in slices if event["cat"] == "compute"}
    assert {(f"blk{block}", k) for block in range(CFG.n_layers) for k in range(K)} <= units
    assert "blk2.sb3 inference" in {event["name"] for event in slices}
    assert any(event["name"].startswith("spill blk1.sb0 inference") for event in slices)
