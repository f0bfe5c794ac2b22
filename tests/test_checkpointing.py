"""Gradient checkpointing (`torch.utils.checkpoint` around each layer, as a Hugging
Face model's `gradient_checkpointing_enable()` does) runs layer-major: the
checkpointed layers are inlined and recomputed per block and sub-batch
(`recompute="blocks"`); loss and every gradient equal eager. T5's decoder, whose
layers transformers' code puts in graphs of their own under checkpointing, runs
plainly, its layers' parts taken for no blocks."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.utils.checkpoint

import slcompile
import test_model_zoo as zoo
from conftest import assert_matches_eager
from models import hf_llama
from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

OPTIONS = {"num_subbatches": 2, "lowering": "aot_eager", "on_refusal": "raise"}


def _mms(graph) -> int:
    return sum(1 for n in graph.graph.nodes if n.target is torch.ops.aten.mm.default)


def test_hf_llama_with_gradient_checkpointing_trains_layer_major(caplog):
    model = hf_llama(num_hidden_layers=2)
    model.gradient_checkpointing_enable()
    model.train()
    ids = torch.randint(0, 96, (8, 8), generator=torch.Generator().manual_seed(0))
    with caplog.at_level(logging.INFO, logger="slcompile"):
        assert_matches_eager(model, lambda m: (m(ids, labels=ids).logits, m(ids, labels=ids).loss), OPTIONS)
    report = next(r for r in slcompile.compile_reports() if r.blocks)
    assert report.fallback_reason is None and len(report.blocks) == 2
    assert "blk1.sb1" in report.schedule
    assert "runs as recompute='blocks'" in caplog.text
    # The backward recomputes the blocks' matmuls: more than the same step without
    # checkpointing runs there.
    checkpointed = _mms(report.graphs["backward"])
    torch._dynamo.reset()
    slcompile.clear_compile_reports()
    plain = hf_llama(num_hidden_layers=2)
    assert_matches_eager(plain, lambda m: (m(ids, labels=ids).logits, m(ids, labels=ids).loss), OPTIONS)
    assert checkpointed > _mms(next(r for r in slcompile.compile_reports() if r.blocks).graphs["backward"])


class CheckpointedGPT(TinyGPT):
    """TinyGPT with `torch.utils.checkpoint` around each block."""

    def forward(self, idx, targets):
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.layers:
            x = torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False)
        logits = self.head(self.ln_f(x))
        return logits, torch.nn.functional.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100
        )


@pytest.mark.parametrize("recompute", ["auto", "none"])
def test_checkpointed_blocks_equal_eager_and_explain_says_how(recompute):
    cfg = GPTConfig(n_layers=2, d_model=32, seq_len=8, vocab_size=64)
    model = CheckpointedGPT(cfg)
    idx, targets = make_gpt_batch(cfg, 4)
    assert_matches_eager(model, lambda m: m(idx, targets), {**OPTIONS, "recompute": recompute})
    torch._dynamo.reset()
    explained = slcompile.explain(model, idx, targets, **{**OPTIONS, "recompute": recompute})
    assert explained.fallback_reason is None and explained.blocks == ("layers.0", "layers.1")
    expected = "runs as recompute='blocks'" if recompute == "auto" else "not applied: recompute='none'"
    assert f"note: gradient checkpointing of 2 regions (layers.0, layers.1) {expected}" in str(explained)


def test_checkpointed_blocks_with_a_growing_batch_equal_eager():
    import copy

    cfg = GPTConfig(n_layers=2, d_model=32, seq_len=8, vocab_size=64)
    model = CheckpointedGPT(cfg)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="speedloader", options=OPTIONS)
    for batch in (4, 8, 12):
        for p in (*model.parameters(), *eager.parameters()):
            p.grad = None
        idx, targets = make_gpt_batch(cfg, batch)
        loss = compiled(idx, targets)[1]
        loss.backward()
        loss_ref = eager(idx, targets)[1]
        loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref)
        for (name, p), (_, ref) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
            torch.testing.assert_close(p.grad, ref.grad, msg=name)
    assert len(slcompile.compile_reports()) == 2
    assert all(r.fallback_reason is None and len(r.blocks) == 2 for r in slcompile.compile_reports())


def test_t5_with_gradient_checkpointing_splits_its_encoder_and_runs_each_decoder_layer_plainly(caplog):
    """transformers' T5 breaks the graph in its decoder under checkpointing (a
    `logger.warning_once` in a loop, `position_bias.requires_grad = True` in the
    first layer's cross-attention), so a decoder layer lands in a graph of its own:
    its parts (self-attention, cross-attention, feed-forward) are no blocks, that
    graph compiles plainly and says why. The encoder's two layers split; loss and
    every gradient equal eager. (torch 2.15's Dynamo traces the decoder's loop
    without the break: its layers then split as well.)"""
    model, call = zoo.FAMILIES["T5"]()
    model.train()
    model.gradient_checkpointing_enable()
    with caplog.at_level(logging.INFO, logger="slcompile"):
        assert_matches_eager(model, call, OPTIONS, atol=2e-5, rtol=2e-5)
    reports = slcompile.compile_reports()
    blocks = [r.blocks for r in reports if r.blocks]
    assert all(r.fallback_reason is None for r in reports if r.blocks)
    reasons = [r.fallback_reason for r in reports if not r.blocks]
    assert all(reason.startswith("no blocks: compiled plainly") for reason in reasons), reasons
    if blocks == [("encoder.block.0", "encoder.block.1"), ("block.0", "block.1")]:
        # torch 2.15 traces the decoder's loop without the break: its layers split too.
        assert torch.__version__ >= (2, 15)
        return
    assert blocks == [("encoder.block.0", "encoder.block.1")]
    parts = ("no blocks: compiled plainly (layer.0 (T5LayerSelfAttention), layer.1 (T5LayerCrossAttention), "
             "layer.2 (T5LayerFF) are each of another class: the parts of one module, not repeated blocks")
    assert any(reason.startswith(parts) for reason in reasons), reasons
    assert parts in caplog.text


def test_t5_decoder_splits_when_its_attention_leaves_the_position_bias_alone():
    """`gradient_checkpointing = False` on each `T5Attention` (set only to make the
    zeros position bias of the first cross-attention require grad, which the
    non-reentrant checkpoint of `gradient_checkpointing_enable()` does not need; the
    layers stay checkpointed) removes the break inside the decoder's layers: the
    decoder is one graph, and encoder and decoder each split, like eager."""
    from transformers.models.t5.modeling_t5 import T5Attention

    model, call = zoo.FAMILIES["T5"]()
    model.train()
    model.gradient_checkpointing_enable()
    for module in model.modules():
        if isinstance(module, T5Attention):
            module.gradient_checkpointing = False
    assert_matches_eager(model, call, OPTIONS, atol=2e-5, rtol=2e-5)
    reports = slcompile.compile_reports()
    assert [r.blocks for r in reports if r.blocks] == [("encoder.block.0", "encoder.block.1"), ("block.0", "block.1")]
    assert all(r.fallback_reason is None for r in reports if r.blocks)
    assert all(r.fallback_reason.startswith("no blocks: compiled plainly") for r in reports if not r.blocks)
