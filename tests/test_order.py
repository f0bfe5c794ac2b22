"""The partitioned forward and backward graphs run layer-major, and each block's
weight gradients are summed over all sub-batches before the previous block starts."""

import graphlib

import pytest
import torch

import slcompile
from slcompile.analysis.order import layer_major_violations, priority_order
from conftest import check_layer_major
from models import GPTConfig, TinyGPT, hf_llama, make_gpt_batch

CFG = GPTConfig()


def _compile_and_step(model, call, k, lowering):
    compiled = torch.compile(model, backend="speedloader", options={"num_subbatches": k, "lowering": lowering})
    loss = call(compiled)
    loss.backward()
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    return report


@pytest.mark.parametrize("k", [2, 4])
def test_tiny_gpt_aot_eager_is_layer_major(k):
    idx, targets = make_gpt_batch(CFG, 8)
    report = _compile_and_step(TinyGPT(CFG), lambda m: m(idx, targets)[1], k, "aot_eager")
    check_layer_major(report, k)


def test_llama_aot_eager_is_layer_major():
    idx, labels = make_gpt_batch(CFG, 4)
    report = _compile_and_step(hf_llama(), lambda m: m(idx, labels=labels).loss, 2, "aot_eager")
    check_layer_major(report, 2)


def test_order_checker_catches_sub_batch_major_order():
    # Gradient accumulation's order: every block for sub-batch 0, then sub-batch 1.
    from slcompile.analysis.order import BlockOrder

    grad_accumulation = BlockOrder(tuple((b, s) for s in range(2) for b in range(3)))
    assert layer_major_violations(grad_accumulation, [0, 1, 2], 2, "fwd")


@pytest.mark.slow
def test_tiny_gpt_inductor_is_layer_major_and_exact():
    from conftest import assert_matches_eager

    idx, targets = make_gpt_batch(CFG, 8)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {"num_subbatches": 4, "lowering": "inductor"})
    check_layer_major(slcompile.compile_reports()[-1], 4)


def test_priority_order_takes_the_most_urgent_ready_item_ties_in_the_given_order():
    # b and c wait for a; d is ready at once but least urgent; a and e tie.
    deps = {"a": (), "b": ("a",), "c": ("a",), "d": (), "e": ()}
    key = {"a": 1, "b": 2, "c": 0, "d": 5, "e": 1}
    assert priority_order(["a", "b", "c", "d", "e"], deps, key=key.__getitem__) == ["a", "c", "e", "b", "d"]
    assert priority_order(["e", "d", "c", "b", "a"], deps, key=key.__getitem__) == ["e", "a", "c", "b", "d"]
    with pytest.raises(graphlib.CycleError):
        priority_order(["a", "b"], {"a": ("b",), "b": ("a",)}, key=str)
