"""Weight gradients summed over sub-batches in one matmul: same gradients, fewer adds."""

import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.analysis.order import block_order, grads_ready_before_next_block, layer_major_violations

CFG = GPTConfig()


def _weight_sized_adds(graph) -> int:
    return sum(
        1
        for n in graph.graph.nodes
        if n.op == "call_function" and n.target is torch.ops.aten.add.Tensor and n.meta["val"].dim() == 2
    )


def test_fused_gradients_match_eager_and_remove_the_adds(monkeypatch):
    idx, targets = make_gpt_batch(CFG, 8)
    options = {"num_subbatches": 4, "lowering": "aot_eager"}
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    fused = slcompile.compile_reports()[-1]
    assert fused.fused_weight_grads > 0

    torch._dynamo.reset()
    monkeypatch.setenv("SLC_DISABLE", "fuse_weight_grads")
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    plain = slcompile.compile_reports()[-1]
    assert plain.fused_weight_grads == 0
    # Each fused sum removes K - 1 weight-sized adds.
    removed = _weight_sized_adds(plain.graphs["backward"]) - _weight_sized_adds(fused.graphs["backward"])
    assert removed == fused.fused_weight_grads * (4 - 1)

    blocks = sorted(fused.block_inputs)
    assert layer_major_violations(block_order(fused.graphs["backward"]), blocks, 4, "bwd") == []
    assert grads_ready_before_next_block(fused.graphs["backward"], fused.block_inputs, blocks) == []
