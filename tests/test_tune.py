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
    assert all(peak is None or peak > budget for *_, peak in tight.tried[:-1])
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
