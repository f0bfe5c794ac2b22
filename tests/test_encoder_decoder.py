"""Encoder-decoder models: both stacks of blocks run layer-major with their own weights
streamed, the encoder's output read by every decoder block per sub-batch, and the
decoder inputs that T5 builds from the labels with in-place writes split per sample."""

import pytest
import torch
from torch import nn

import slcompile
from conftest import assert_matches_eager
from slcompile.analysis.order import block_order, grads_ready_before_next_block, layer_major_violations
from slcompile.meta import get_slc_meta
from slcompile.runtime import Tier, TransferKind, mark_step
from slcompile.vocabulary import STASH, UNSTASH_WAIT, WeightKey, is_fetch

AOT = {"lowering": "aot_eager", "on_refusal": "raise", "num_subbatches": 2}
LOAD = (TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)


def _t5():
    """A tiny T5 (2 encoder and 2 decoder blocks, d_model 32), its inputs and labels."""
    from transformers import T5Config, T5ForConditionalGeneration

    config = T5Config(vocab_size=64, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                      num_heads=4, dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0)
    model = T5ForConditionalGeneration(config)
    ids = torch.randint(1, 64, (4, 8), generator=torch.Generator().manual_seed(0))
    labels = torch.randint(1, 64, (4, 6), generator=torch.Generator().manual_seed(1))
    labels[1, 4:] = -100  # ignored positions, replaced by the pad token in the decoder inputs
    return model, ids, labels


def _fetched(graph) -> dict[str, int]:
    """Stored key -> bytes of every weight a compiled graph fetches."""
    return {
        WeightKey.parse(n.args[1]).stored: n.meta["val"].numel() * n.meta["val"].element_size()
        for n in graph.graph.nodes if is_fetch(n)
    }


def test_t5_with_labels_streams_encoder_and_decoder_weights():
    model, ids, labels = _t5()

    def call(m):
        out = m(input_ids=ids, labels=labels)
        return out.logits, out.loss

    options = {**AOT, "weights": "nvme", "live_blocks": 1, "activations": "nvme", "min_offload_bytes": 0}
    compiled = assert_matches_eager(model, call, options)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert report.blocks == ("encoder.block.0", "encoder.block.1", "decoder.block.0", "decoder.block.1")
    # Layer-major over both stacks; each block's streamed weights have their gradient
    # complete before the block before it starts (not the shared embedding, which the
    # decoder's embedding, between the stacks, reads with the last encoder block).
    forward_graph, backward_graph = report.graphs["forward"], report.graphs["backward"]
    blocks = sorted(report.block_inputs)
    assert blocks == [0, 1, 2, 3]
    computed = [line for line in report.schedule.splitlines() if line.startswith("fwd blk")]
    assert computed == [f"fwd blk{b}.sb{k}" for b in range(4) for k in range(2)]
    assert layer_major_violations(block_order(forward_graph), blocks, 2, "fwd") == []
    assert layer_major_violations(block_order(backward_graph), blocks, 2, "bwd") == []
    placeholders = [n for n in forward_graph.graph.nodes if n.op == "placeholder"]
    fetched_inputs = {placeholders.index(n.args[0]) for n in forward_graph.graph.nodes if is_fetch(n)}
    own = {b: tuple(i for i in inputs if i in fetched_inputs) for b, inputs in report.block_inputs.items()}
    assert all(own.values())
    assert grads_ready_before_next_block(backward_graph, own, blocks) == []

    # Every block's weights are streamed, the encoder's too, with the encoder's final
    # norm (between the stacks: it runs with the last encoder block); the shared
    # embedding (encoder, decoder and head) and the decoder's final norm stay resident.
    trained = compiled._orig_mod
    sizes = {name: p.numel() * p.element_size() for name, p in trained.named_parameters()}
    streamed = {n for n in sizes if ".block." in n} | {"encoder.final_layer_norm.weight"}
    assert set(dict(slcompile.offloaded_parameters(trained))) == streamed
    assert any(n.startswith("encoder.block.") for n in streamed)
    assert report.streamed_bytes == sum(sizes[n] for n in streamed)
    forward, backward = _fetched(forward_graph), _fetched(backward_graph)
    assert sum(forward.values()) == report.streamed_bytes
    # The backward needs every streamed weight but the relative position embeddings
    # (an embedding's gradient does not read its weight).
    bias = sum(sizes[n] for n in streamed if "relative_attention_bias" in n)
    assert bias > 0 and sum(backward.values()) == report.streamed_bytes - bias

    # One more step: each weight loaded once per pass for both sub-batches.
    mark_step()
    for p in trained.parameters():
        p.grad = None
    call(compiled)[1].backward()
    assert mark_step().bytes_moved[LOAD] == 2 * report.streamed_bytes - bias

    # The encoder's output (saved by the last encoder block, per sub-batch) is stashed
    # and loaded back for the decoder blocks' backward.
    stashed_by = {n.name: get_slc_meta(n).block for n in report.graphs["forward"].graph.nodes if n.target is STASH}
    readers = {
        get_slc_meta(n).block
        for wait in report.graphs["backward"].graph.nodes if wait.target is UNSTASH_WAIT
        and stashed_by.get(wait.args[0].args[0].name) == 1
        for n in wait.users
    }
    assert readers & {2, 3}, readers


class _Shift(nn.Module):
    """Decoder inputs made from the labels by in-place writes into a fresh tensor,
    as T5 does, then two blocks."""

    def __init__(self, start_sample=None):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(2))
        self.start_sample = start_sample

    def forward(self, labels):
        shifted = labels.new_zeros(labels.shape)
        shifted[..., 1:] = labels[..., :-1].clone()
        if self.start_sample is None:
            shifted[..., 0] = 3
        else:  # one sample's row only: not a per-sample write
            shifted[self.start_sample] = 3
        shifted.masked_fill_(shifted == -100, 0)
        x = self.embed(shifted)
        for layer in self.layers:
            x = torch.relu(layer(x))
        return x, x.square().mean()


@pytest.mark.parametrize("dynamic", [False, True])
def test_per_sample_writes_into_a_fresh_tensor_are_split(dynamic):
    labels = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    labels[2, 3:] = -100
    model = _Shift()
    compiled = assert_matches_eager(model, lambda m: m(labels), AOT, dynamic_inputs=(labels,) if dynamic else ())
    assert slcompile.compile_reports()[-1].fallback_reason is None
    if dynamic:  # the fresh tensor is made at each call's sub-batch size
        other = torch.randint(0, 16, (6, 6), generator=torch.Generator().manual_seed(1))
        torch.testing.assert_close(compiled(other)[0], model(other)[0])


def test_a_write_into_one_sample_of_a_fresh_tensor_is_refused():
    labels = torch.randint(0, 16, (4, 6), generator=torch.Generator().manual_seed(0))
    explanation = slcompile.explain(_Shift(start_sample=0), labels, **AOT)
    assert "writes in place into some samples of shifted (it indexes the batch dimension)" in (
        explanation.fallback_reason
    )
