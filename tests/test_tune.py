"""`slcompile.tune`: the fastest options whose predicted step fits a budget."""

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, make_gpt_batch

CFG = GPTConfig()
FIXED = {"lowering": "aot_eager", "activations": "nvme", "min_offload_bytes": 0}


def test_tune_picks_the_first_candidate_that_fits_and_it_runs_under_the_budget():
    idx, targets = make_gpt_batch(CFG, 8)
    model = TinyGPT(CFG)
    roomy = slcompile.tune(model, idx, targets, memory_budget="64MB", **FIXED)
    assert (roomy.options["num_subbatches"], roomy.options["live_blocks"]) == (1, 2)
    assert roomy.memory.recompute == "none"
    # A budget below what K=1 keeping its activations needs: recompute or more sub-batches.
    budget = roomy.memory.peak_bytes["device"] - 1
    tight = slcompile.tune(model, idx, targets, memory_budget=budget, **FIXED)
    assert tight.memory.peak_bytes["device"] <= budget
    assert tight.tried[-1].fits and tight.tried[-1].options == tight.options
    assert not any(c.fits for c in tight.tried[:-1])
    assert all(c.peak_bytes is None or c.peak_bytes > budget for c in tight.tried[:-1])
    torch._dynamo.reset()
    assert_matches_eager(model, lambda m: m(idx, targets), tight.options)
    assert slcompile.compile_reports()[-1].memory.peak_bytes["device"] <= budget


def test_tune_names_the_smallest_budget_when_nothing_fits():
    idx, targets = make_gpt_batch(CFG, 8)
    with pytest.raises(slcompile.BudgetError) as caught:
        slcompile.tune(TinyGPT(CFG), idx, targets, memory_budget=1000, num_subbatches=[1, 2, 4], **FIXED)
    smallest = caught.value.smallest
    result = slcompile.tune(TinyGPT(CFG), idx, targets, memory_budget=smallest, num_subbatches=[1, 2, 4], **FIXED)
    assert result.memory.peak_bytes["device"] == smallest


def test_tune_chooses_the_tiers_resident_first_and_streams_the_weights_when_they_do_not_fit():
    idx, targets = make_gpt_batch(CFG, 8)
    model = TinyGPT(CFG)
    options = {"lowering": "aot_eager", "min_offload_bytes": 0, "num_subbatches": [1, 2], "live_blocks": (2,)}
    tiers = {"weights": ["device", "nvme"], "activations": ["device", "nvme"]}
    roomy = slcompile.tune(model, idx, targets, memory_budget="1GiB", **tiers, **options)
    assert (roomy.options["weights"], roomy.options["activations"]) == ("device", "device")
    # The least any plan with resident weights needs, less one byte.
    with pytest.raises(slcompile.BudgetError) as caught:
        slcompile.tune(model, idx, targets, memory_budget=1000, weights="device", activations=["device", "nvme"],
                       **options)
    budget = caught.value.smallest - 1
    tight = slcompile.tune(model, idx, targets, memory_budget=budget, **tiers, **options)
    assert tight.options["weights"] == "nvme" and tight.memory.peak_bytes["device"] <= budget
    assert not any(c.fits for c in tight.tried if c.weights == "device")
    assert {(c.weights, c.activations) for c in tight.tried} >= {("device", "device"), ("device", "nvme")}
    torch._dynamo.reset()
    assert_matches_eager(model, lambda m: m(idx, targets), tight.options)
    assert slcompile.compile_reports()[-1].memory.peak_bytes["device"] <= budget
    with pytest.raises(slcompile.OptionError, match="tune: weights must be a tier or a list of tiers"):
        slcompile.tune(model, idx, targets, memory_budget="1GiB", weights=["device", "disk"], **options)


def test_tune_with_a_profile_times_every_tier_and_chooses_the_fastest():
    idx, targets = make_gpt_batch(CFG, 8)
    result = slcompile.tune(TinyGPT(CFG), idx, targets, memory_budget="1GiB", num_subbatches=[2], live_blocks=(2,),
                            weights=["nvme", "device"], activations=["nvme", "device"], profile="h100-pcie5-nvme",
                            lowering="aot_eager", min_offload_bytes=0)
    assert {(c.weights, c.activations) for c in result.fitting} == {
        ("nvme", "nvme"), ("nvme", "device"), ("device", "nvme"), ("device", "device")}
    fastest = min(result.fitting, key=lambda c: c.seconds)
    assert result.options == fastest.options and result.time.step_seconds == fastest.seconds
    # Resident weights are fastest, whatever the order given; under a budget this
    # roomy nothing is stashed, so the activations' tier makes no difference.
    by_tiers = {(c.weights, c.activations): c.seconds for c in result.fitting}
    assert fastest.weights == "device"
    assert by_tiers["device", "nvme"] == by_tiers["device", "device"] == fastest.seconds
    assert min(by_tiers["nvme", "nvme"], by_tiers["nvme", "device"]) > fastest.seconds


def test_tune_searches_the_policies_listed_and_chooses_the_one_predicted_fastest():
    tiny = GPTConfig(n_layers=2, d_model=32)
    idx, targets = make_gpt_batch(tiny, 4)
    model = TinyGPT(tiny)
    searched = {"num_subbatches": [2], "live_blocks": (2,), "lowering": "aot_eager", "min_offload_bytes": 0}
    # grad_accumulation listed first: without a profile it wins, being first to fit.
    policies = ["grad_accumulation", "speedloader"]
    first = slcompile.tune(model, idx, targets, memory_budget="1GiB", weights="nvme", schedule=policies, **searched)
    assert first.options["schedule"] == "grad_accumulation"
    assert [c.policy for c in first.tried] == ["grad_accumulation"]
    # With a profile both are timed; speedloader fetches each block's weights once
    # a pass rather than once per sub-batch, so it is predicted faster on nvme.
    timed = slcompile.tune(model, idx, targets, memory_budget="1GiB", weights="nvme", schedule=policies,
                           profile="h100-pcie5-nvme", **searched)
    assert {c.policy for c in timed.fitting} == {"grad_accumulation", "speedloader"}
    fastest = min(timed.fitting, key=lambda c: c.seconds)
    assert timed.options == fastest.options and timed.options["schedule"] == "speedloader"
    assert timed.time.step_seconds == fastest.seconds
    assert ["schedule=grad_accumulation" in c.describe() for c in timed.tried] == [True, False]
    assert "policies grad_accumulation, speedloader" in timed.why
    # A policy that cannot take a plan's tiers is refused for it alone.
    mixed = slcompile.tune(model, idx, targets, memory_budget="1GiB", weights=["nvme", "device"],
                           schedule=["no_offload", "speedloader"], **searched)
    assert mixed.tried[0].policy == "no_offload" and "conflict" in mixed.tried[0].refused
    assert mixed.options["schedule"] == "no_offload" and mixed.options["weights"] == "device"
    # One name still works as before.
    single = slcompile.tune(model, idx, targets, memory_budget="1GiB", schedule="grad_accumulation", **searched)
    assert single.options["schedule"] == "grad_accumulation" and [c.policy for c in single.tried] == [
        "grad_accumulation"]
    with pytest.raises(slcompile.OptionError, match="tune: schedule must be a policy or a list of policies"):
        slcompile.tune(model, idx, targets, memory_budget="1GiB", schedule=["speedloader", "zigzag?"], **searched)


def test_every_option_takes_a_value_or_a_sequence_and_is_checked_before_the_capture(monkeypatch):
    tiny = GPTConfig(n_layers=2, d_model=32)
    idx, targets = make_gpt_batch(tiny, 4)
    model = TinyGPT(tiny)
    fixed = {"lowering": "aot_eager", "weights": "nvme", "min_offload_bytes": 0}
    one = slcompile.tune(model, idx, targets, memory_budget="1GiB", num_subbatches=2, live_blocks=2, **fixed)
    listed = slcompile.tune(model, idx, targets, memory_budget="1GiB", num_subbatches=[2], live_blocks=[2],
                            **{**fixed, "lowering": ["aot_eager"], "weights": ("nvme",)})
    assert one.options == listed.options and one.options["live_blocks"] == 2
    assert [c.options for c in one.tried] == [c.options for c in listed.tried]
    # explain and compare_policies read options by the same rule: one value, or a sequence of one.
    assert slcompile.explain(model, idx, targets, profile=None, live_blocks=[2], **fixed).graphs[0].schedule \
        == slcompile.explain(model, idx, targets, profile=None, live_blocks=2, **fixed).graphs[0].schedule
    compared = slcompile.compare_policies(model, idx, targets, policies="speedloader", run=False, profile=None,
                                          live_blocks=[2], **fixed)
    assert [row.policy for row in compared.rows] == ["speedloader"]

    # A bad type or value fails at once, naming the option: nothing is captured.
    def captured(*args, **kwargs):
        raise AssertionError("the model was captured before the options were checked")

    monkeypatch.setattr(slcompile.compat, "capture_graphs", captured)
    reports = len(slcompile.compile_reports())
    for bad, message in (
        ({"live_blocks": "2"}, "tune: live_blocks='2': speedloader option 'live_blocks' must be an int"),
        ({"live_blocks": [2, 0]}, "tune: live_blocks=0: speedloader option 'live_blocks' must be >= 1"),
        ({"num_subbatches": []}, "tune: option 'num_subbatches' needs a value or a non-empty list"),
        ({"lowering": ["aot_eager", "inductor"]}, "tune: option 'lowering' takes one value here, got 2"),
        ({"weights": "disk"}, "tune: weights must be a tier or a list of tiers"),
        ({"schedule": "no_offload"}, "speedloader options 'schedule' and 'weights' conflict"),
        ({"recompte": "none"}, "unknown speedloader option 'recompte'; did you mean 'recompute'?"),
    ):
        with pytest.raises(slcompile.OptionError) as caught:
            slcompile.tune(model, idx, targets, memory_budget="1GiB", **{**fixed, **bad})
        assert message in str(caught.value)
    with pytest.raises(slcompile.OptionError, match="explain: option 'live_blocks' takes one value here, got 2"):
        slcompile.explain(model, idx, targets, profile=None, live_blocks=[1, 2], **fixed)
    with pytest.raises(slcompile.OptionError, match="compare_policies: option 'live_blocks' takes one value here"):
        slcompile.compare_policies(model, idx, targets, policies=["speedloader"], run=False, live_blocks=(1, 2))
    assert len(slcompile.compile_reports()) == reports
