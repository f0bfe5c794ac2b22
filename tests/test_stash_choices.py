"""A policy's choices per saved tensor and per stash unit: saved tensors kept on the
device by name (`Schedule.kept_saved`) and the tier each unit's stash goes to
(`Step.tier`). Validated, carried through text and JSON and replays, lowered
(numerics against eager, the graphs' schedule against the policy's), and counted:
the bytes each tier receives, exactly, and the predicted peaks against measured ones."""

import dataclasses
import json

import pytest
import torch

import slcompile
from conftest import assert_matches_eager, steady_step_peak_bytes
from devices import on_cuda
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.memory import predict_memory
from slcompile.runtime import Tier, TransferKind, collect_garbage, get_engine, reset_runtime_stats, runtime_stats
from slcompile.runtime.storage.tiers import PAGE_BYTES
from slcompile.schedules import (
    Policy, SavedActivation, Schedule, ScheduleRequest, Step, add_fetches, add_stashes, add_stores,
    layer_major_compute, replay, speedloader_schedule, validate_schedule,
)

CFG = GPTConfig(n_layers=2)
OPTIONS = {"lowering": "aot_eager", "activations": "nvme", "min_offload_bytes": 0, "num_subbatches": 2}
REQUEST = ScheduleRequest(blocks=(0, 1), num_subbatches=2, activations_offloaded=True)
SAVED = (
    SavedActivation("add", ("prefix", None, 0), 8192, ("block", 0, 0), ("block", 0, 0)),
    SavedActivation("mul", ("block", 0, 0), 256, ("block", 0, 0), ("block", 0, 0)),
)
# Block 1's stash on the host: on a CPU machine the host's memory is the device's,
# so those units keep their activations (a stash would move nothing).
HOST_COPIES = on_cuda()


def _small_or_read_early(activation):
    """Small tensors, and those the backward reads first (the last block's outputs,
    read by the suffix's backward)."""
    return activation.nbytes < 4096 or activation.first_backward_use[0] == "suffix"


def _tier(step):
    return {"prefix": "nvme", "block": "host" if step.block == 1 else None}[step.region]


def _choosing(keep_saved=lambda activation: False, tier=lambda step: None):
    """A policy: speedloader's order, keeping `keep_saved` tensors by name and
    sending each unit's stash to `tier(step)`."""
    def build(request):
        kept = frozenset(a.name for a in request.saved or () if a.stays is None and keep_saved(a))
        steps = add_fetches(layer_major_compute(request), request, per_subbatch=False)
        steps = add_stashes(steps, request, tier=tier, kept_saved=kept)
        return Schedule(tuple(add_stores(steps, request)), kept_saved=kept)

    return Policy("choosing", build)


def _moved(tier):
    moved = runtime_stats().bytes_moved
    return (moved.get((TransferKind.ACTIVATION, Tier.DEVICE, Tier(tier)), 0),
            moved.get((TransferKind.ACTIVATION, Tier(tier), Tier.DEVICE), 0))


def _train(policy, options=OPTIONS):
    idx, targets = make_gpt_batch(CFG, 8)
    collect_garbage()  # what earlier tests left on nvme goes now, not during the step
    reset_runtime_stats()
    nvme_before = runtime_stats().resident_bytes.get(Tier.NVME, 0)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {**options, "schedule": policy})
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    # The graphs make the policy's transfers (a difference raises), tiers included.
    assert report.schedule == Schedule(report.planned_schedule.steps).text()
    return report, runtime_stats().cumulative.peak_bytes[Tier.NVME] - nvme_before


def test_saved_tensors_kept_by_name_stay_on_the_device():
    report, nvme_peak = _train(_choosing(keep_saved=_small_or_read_early))
    planned = report.planned_schedule
    leaving = [a for a in planned.request.saved if a.stays is None]
    kept = {a.name for a in leaving if _small_or_read_early(a)}
    assert planned.kept_saved == kept and 0 < len(kept) < len(leaving)
    offloaded = report.offloaded_activations
    assert set(offloaded.names) == {a.name for a in leaving} - kept
    assert {name for name, why in offloaded.kept if why == "kept on the device by the schedule"} == kept
    # Stored once and loaded once each: the saved tensors' sizes, both ways; the
    # memory model reads the same graphs: what nvme holds is what the runtime held.
    stashed = sum(a.nbytes for a in leaving if a.name not in kept)
    assert int(offloaded.bytes) == stashed and _moved("nvme") == (stashed, stashed)
    assert report.memory.peak_bytes["nvme"] == nvme_peak == stashed


def test_each_unit_stashes_to_its_tier():
    report, nvme_peak = _train(_choosing(tier=_tier))
    planned = report.planned_schedule
    issues = [s for s in planned.steps if s.kind == "stash.issue"]
    assert {s.tier for s in issues if s.region == "prefix"} == {"nvme"}
    assert {s.tier for s in issues if s.region == "block"} == ({None, "host"} if HOST_COPIES else {None})
    assert "fwd stash.issue prefix.sb0 nvme" in report.schedule.splitlines()
    leaving = [a for a in planned.request.saved if a.stays is None]
    on_host = sum(a.nbytes for a in leaving if a.owner[:2] == ("block", 1)) if HOST_COPIES else 0
    on_nvme = sum(a.nbytes for a in leaving if a.owner[:2] != ("block", 1))
    prefix = sum(a.nbytes for a in leaving if a.owner[0] == "prefix")
    offloaded = report.offloaded_activations
    assert int(offloaded.bytes) == on_nvme + on_host
    named = {"nvme": prefix, **({"host": on_host} if on_host else {})}
    assert {tier: int(nbytes) for tier, nbytes in offloaded.tier_bytes} == named
    assert _moved("nvme") == (on_nvme, on_nvme) and report.memory.peak_bytes["nvme"] == nvme_peak == on_nvme
    assert report.memory.peak_bytes["host"] == on_host
    if HOST_COPIES:
        assert _moved("host") == (on_host, on_host)
    else:
        assert {name for name, why in offloaded.kept if why == "kept on the device by the schedule"} == \
            {a.name for a in leaving if a.owner[:2] == ("block", 1)}


def test_predicted_peak_with_kept_tensors_and_unit_tiers_as_measured():
    """As test_offload_activations' peak test measures it: loads land in torch's CPU
    allocator, each with a page of alignment slack the prediction is told about."""
    cfg = GPTConfig(d_model=64, seq_len=32)
    model = TinyGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 8)
    options = {"lowering": "aot_eager", "num_subbatches": 2, "weights": "nvme", "activations": "nvme",
               "min_offload_bytes": 4096, "schedule": _choosing(_small_or_read_early, _tier)}
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step():
        compiled(idx, targets)[1].backward()

    measured = steady_step_peak_bytes(model, step)
    report = slcompile.compile_reports()[-1]
    assert report.planned_schedule.kept_saved and report.offloaded_activations.tier_bytes
    predicted = predict_memory(
        report.graphs["forward"], report.graphs["backward"],
        machine=MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES),
    ).step_peak_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)


def _saved_request(**changes):
    return dataclasses.replace(REQUEST, saved=SAVED, **changes)


def test_choices_go_through_text_json_and_a_replay():
    request = _saved_request(stash_tiers=("host", "nvme"))
    chosen = _choosing(keep_saved=lambda a: a.name == "mul", tier=lambda s: "host" if s.region == "prefix" else None)
    schedule = chosen(request)
    assert schedule.kept_saved == {"mul"} and schedule.stash_tiers() == {("prefix", None, 0): "host"}
    text = schedule.text()
    assert "fwd stash.issue prefix.sb0 host" in text.splitlines() and text.endswith("\nkeep mul")
    for again in (Schedule.from_text(text), Schedule.from_json(schedule.to_json())):
        assert again == schedule and again.text() == text
    data = json.loads(schedule.to_json())
    assert data["kept_saved"] == ["mul"]
    assert {"phase": "fwd", "region": "prefix", "block": None, "subbatch": 0, "kind": "stash.issue",
            "serves": None, "tier": "host"} in data["steps"]
    # A schedule without choices writes the JSON it always wrote (no `tier`, no
    # `kept_saved`), and JSON without them reads as before.
    plain = speedloader_schedule(REQUEST)
    old = json.loads(plain.to_json())
    assert "kept_saved" not in old and all("tier" not in step for step in old["steps"])
    assert Schedule.from_json(plain.to_json()) == plain
    # A replay writes the kept tensors too.
    assert replay(Schedule.from_json(schedule.to_json()))(request) == schedule


def _refused(schedule, request, step, problem):
    with pytest.raises(slcompile.PolicyError) as caught:
        validate_schedule(schedule, request, "choosing")
    assert str(caught.value) == f"schedule policy 'choosing' at step `{step}`: {problem}"


def test_choices_that_cannot_be_lowered_are_refused():
    steps = speedloader_schedule(REQUEST).steps
    _refused(Schedule(steps, kept_saved={"mul", "nope"}), _saved_request(), "keep nope",
             "keeps 'nope' on the device, which is not a saved tensor of this graph (`request.saved` names "
             "them: `SavedActivation.name`)")
    # Before the saved tensors are known a name cannot be checked.
    assert validate_schedule(Schedule(steps, kept_saved={"nope"}), REQUEST)

    def tiered(tier):
        return Schedule(tuple(dataclasses.replace(s, tier=tier) if s.kind == "stash.issue" and s.region == "prefix"
                              and s.subbatch == 0 else s for s in steps))

    _refused(tiered("device"), REQUEST, "fwd stash.issue prefix.sb0 device",
             "tier 'device' is not a slower tier (a stash goes to one of host, nvme)")
    issue = steps.index(Step("fwd", "prefix", None, 0, "stash.issue"))
    waiting = Schedule(steps[:issue + 1] + (Step("fwd", "prefix", None, 0, "stash.wait", tier="host"),)
                       + steps[issue + 1:])
    _refused(waiting, REQUEST, "fwd stash.wait prefix.sb0 host",
             "tier 'host': only a `stash.issue` names the tier its unit's activations go to")
    cpu = dataclasses.replace(REQUEST, stash_tiers=("nvme",))
    _refused(tiered("host"), cpu, "fwd stash.issue prefix.sb0 host",
             "tier 'host' is the device's own memory on this machine: a stash moves nothing there (it may go "
             "to nvme)")
    assert validate_schedule(tiered("nvme"), cpu)
    # `add_stashes` keeps a unit whose tier moves nothing here on the device instead.
    kept = add_stashes(layer_major_compute(cpu), cpu, tier=lambda s: "host" if s.region == "prefix" else "nvme")
    assert {s.key for s in kept if s.kind == "stash.issue"} == {("block", b, s) for b in (0, 1) for s in (0, 1)}
    assert {s.tier for s in kept if s.kind == "stash.issue"} == {"nvme"}


@pytest.mark.parametrize("mistyped", ["disk", "NVMe"])
def test_a_mistyped_tier_is_refused_wherever_it_is_written(mistyped):
    hint = "; did you mean 'nvme'?" if mistyped == "NVMe" else ""
    problem = f"tier {mistyped!r} is not a slower tier (a stash goes to one of host, nvme){hint}"
    # Through the policy kit's helper: refused, never a unit left on the device. The
    # policy is named, and so is the first unit's stash step.
    policy = _choosing(tier=lambda s: mistyped if s.region == "block" else None)
    for request in (REQUEST, _saved_request(), dataclasses.replace(REQUEST, activations_offloaded=False)):
        with pytest.raises(slcompile.PolicyError) as caught:
            policy(request)
        assert str(caught.value) == f"schedule policy 'choosing' at step `fwd stash.issue blk0.sb0 {mistyped}`: {problem}"
    # The same step written by hand, and read from text.
    steps = speedloader_schedule(REQUEST).steps
    by_hand = Schedule(tuple(dataclasses.replace(s, tier=mistyped) if s.kind == "stash.issue" and s.block == 0
                             and s.subbatch == 0 else s for s in steps))
    _refused(by_hand, REQUEST, f"fwd stash.issue blk0.sb0 {mistyped}", problem)
    _refused(Schedule.from_text(by_hand.text()), REQUEST, f"fwd stash.issue blk0.sb0 {mistyped}", problem)


def test_a_key_naming_a_tier_stores_there():
    from slcompile.runtime.activations import ActivationStash, stash, unstash, unstash_wait

    owner = ActivationStash(get_engine(), "nvme")
    x = torch.randn(16, 16)
    for tier, rests in ((None, Tier.NVME), ("host", Tier.HOST), ("nvme", Tier.NVME)):
        token = stash(x, owner.graph_key(f"blk0.sb0.{tier}", tier))
        assert owner.engine.stored(next(k for k in owner.engine.keys() if k.startswith(f"blk0.sb0.{tier}#"))) \
            .tier is rests
        torch.testing.assert_close(unstash_wait(unstash(token), (16, 16), x.dtype, x.device), x)
