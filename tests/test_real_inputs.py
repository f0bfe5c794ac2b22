"""The inputs real training passes: padding masks, a batch whose size changes, fresh
buffers filled per sample. Each family of the model zoo trains layer-major with a
padding mask whose zeros differ per sample, with eager's loss and every gradient;
a dynamic batch splits; a buffer made at the batch's size and written per sample
(DeepSeek-V3's keys) splits like any batched value; writes and gathers that mix
samples are still refused. Every zoo family with a padding mask, gradient
checkpointing and a batch of 4 then of 6, all three at once, splits like eager, or is
an expected failure with its reason.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

import slcompile  # noqa: E402
import test_model_zoo as zoo  # noqa: E402
from conftest import assert_matches_eager  # noqa: E402
from models import Stack  # noqa: E402

BATCH, SEQ, VOCAB, LAYERS = zoo.BATCH, zoo.SEQ, zoo.VOCAB, zoo.LAYERS
OPTIONS = {"lowering": "aot_eager", "on_refusal": "raise", "num_subbatches": 2}


def padded_batch(batch=BATCH, seed=0):
    """Token ids, a padding mask (sample 0 whole, then right padding of 2 and 5 tokens
    and left padding of 3, repeated) and labels ignoring the padding."""
    ids = torch.randint(0, VOCAB, (batch, SEQ), generator=torch.Generator().manual_seed(seed))
    mask = torch.ones(batch, SEQ, dtype=torch.long)
    for row in range(batch):
        pad = (0, 2, -3, 5)[row % 4]
        if pad > 0:
            mask[row, SEQ - pad:] = 0
        elif pad < 0:
            mask[row, :-pad] = 0
    return ids, mask, ids.masked_fill(mask == 0, -100)


def _bart():
    return zoo._causal_lm(
        "BartConfig", "BartForConditionalGeneration", vocab_size=VOCAB, d_model=zoo.HIDDEN,
        encoder_layers=LAYERS, decoder_layers=LAYERS, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=2 * zoo.HIDDEN, decoder_ffn_dim=2 * zoo.HIDDEN, max_position_embeddings=32,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=1, decoder_start_token_id=2,
    )


# Family -> builder of the model (the zoo's tiny configs; sliding windows shorter
# than the sequence, so that the local layers' masks differ from the global ones).
FAMILIES = {
    "Llama": zoo.FAMILIES["Llama"],
    "Mistral (sliding window)": lambda: zoo._decoder("MistralConfig", "MistralForCausalLM", sliding_window=4),
    "Qwen2": zoo.FAMILIES["Qwen2"],
    "Gemma2 (sliding window)": lambda: zoo._decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=8,
                                                   sliding_window=4),
    "GPT-2": zoo.FAMILIES["GPT-2"],
    "BERT": zoo.FAMILIES["BERT"],
    "OPT": zoo.FAMILIES["OPT"],
    "GPT-NeoX": zoo.FAMILIES["GPT-NeoX"],
    "Falcon": zoo.FAMILIES["Falcon"],
    "BLOOM (alibi from the mask)": zoo.FAMILIES["BLOOM"],
    "T5": zoo.FAMILIES["T5"],
    "BART": _bart,
}
def _llama_eager_attention():
    """Eager attention turns the boolean mask into additive biases with `torch.where`."""
    model, call = zoo.FAMILIES["Llama"]()
    model.set_attn_implementation("eager")
    return model, call


FAMILIES["Llama (eager attention)"] = _llama_eager_attention
# DeepSeek-V3 with dense layers only: its keys are a fresh tensor filled per sample.
FAMILIES["DeepSeek-V3"] = lambda: zoo._decoder(
    "DeepseekV3Config", "DeepseekV3ForCausalLM", num_key_value_heads=4, kv_lora_rank=16, q_lora_rank=16,
    qk_rope_head_dim=4, qk_nope_head_dim=4, v_head_dim=8, first_k_dense_replace=LAYERS,
)
SLOW = {"DeepSeek-V3"}
BLOCKS = {"T5": 2 * LAYERS, "BART": 2 * LAYERS}
ENCODER_DECODER = {"T5", "BART"}


def _padded_call(name):
    ids, mask, labels = padded_batch()
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if name in ENCODER_DECODER:
        kwargs["decoder_attention_mask"] = mask

    def call(m):
        out = m(**kwargs)
        return out.logits, out.loss

    return kwargs, call


@pytest.mark.parametrize("name", [
    pytest.param(name, marks=[pytest.mark.slow] if name in SLOW else []) for name in FAMILIES
])
def test_padding_mask_splits_and_trains_like_eager(name):
    model = FAMILIES[name]()[0].train()
    kwargs, call = _padded_call(name)
    explained = slcompile.explain(model, kwargs=kwargs, **OPTIONS)
    with_blocks = [g for g in explained.graphs if g.blocks]
    assert len(with_blocks) == 1
    assert with_blocks[0].fallback_reason is None
    assert "attention_mask" in " ".join(with_blocks[0].batch_inputs)
    torch._dynamo.reset()
    assert_matches_eager(model, call, OPTIONS, atol=2e-5, rtol=2e-5)
    reports = [r for r in slcompile.compile_reports() if r.blocks]
    assert len(reports) == 1 and reports[0].fallback_reason is None
    assert len(reports[0].blocks) == BLOCKS.get(name, LAYERS)


def test_padding_mask_and_a_pooled_last_token_split_like_eager():
    """Sequence classification pools each sample's last token with
    `logits[arange(batch), last_token]`: a gather by sample index after the blocks."""
    import transformers

    config = transformers.LlamaConfig(num_hidden_layers=LAYERS, hidden_size=zoo.HIDDEN,
                                      intermediate_size=2 * zoo.HIDDEN, num_attention_heads=4,
                                      num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=32,
                                      num_labels=3, pad_token_id=0)
    model = transformers.LlamaForSequenceClassification(config)
    ids, mask, _ = padded_batch()
    ids = ids.masked_fill(mask == 0, 0).clamp(min=0)
    ids[:, 0].clamp_(min=1)
    classes = torch.tensor([0, 2, 1, 2])

    def call(m):
        out = m(input_ids=ids, attention_mask=mask, labels=classes)
        return out.logits, out.loss

    assert_matches_eager(model, call, OPTIONS)
    report = [r for r in slcompile.compile_reports() if r.blocks][-1]
    assert report.fallback_reason is None


def test_dynamic_batch_of_llama_with_a_padding_mask_splits_like_eager():
    model = zoo.FAMILIES["Llama"]()[0].train()
    ids, mask, labels = padded_batch()

    def call(m):
        out = m(input_ids=ids, attention_mask=mask, labels=labels)
        return out.logits, out.loss

    assert_matches_eager(model, call, OPTIONS, dynamic_inputs=(ids, mask, labels))
    report = [r for r in slcompile.compile_reports() if r.blocks][-1]
    assert report.fallback_reason is None and len(report.blocks) == LAYERS
    assert report.graphs  # compiled layer-major, not plainly


@pytest.mark.slow
@pytest.mark.parametrize("how", ["automatic", "dynamic=True"])
def test_a_second_batch_size_splits_like_eager(how):
    """Dynamo recompiles for a batch of another size with the batch as a symbol
    (automatically, or from the start with `dynamic=True`)."""
    import copy

    model = zoo.FAMILIES["Llama"]()[0].train()
    eager, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="speedloader", options=OPTIONS,
                             dynamic=True if how == "dynamic=True" else None)
    for batch in (4, 6):
        ids, mask, labels = padded_batch(batch, seed=batch)
        for m in (eager, compiled_model):
            m.zero_grad(set_to_none=True)
        ref = eager(input_ids=ids, attention_mask=mask, labels=labels)
        ref.loss.backward()
        out = compiled(input_ids=ids, attention_mask=mask, labels=labels)
        out.loss.backward()
        torch.testing.assert_close(out.logits, ref.logits, atol=2e-5, rtol=2e-5)
        torch.testing.assert_close(out.loss, ref.loss, atol=2e-5, rtol=2e-5)
        for (name, p), (_, q) in zip(eager.named_parameters(), compiled_model.named_parameters()):
            torch.testing.assert_close(q.grad, p.grad, atol=2e-5, rtol=2e-5, msg=name)
    reports = [r for r in slcompile.compile_reports() if r.blocks]
    assert reports and all(r.fallback_reason is None for r in reports), [r.fallback_reason for r in reports]


class FreshKeys(nn.Module):
    """DeepSeek-V3's keys: a fresh tensor made at the batch's size, its halves filled
    in place per sample (`new_empty`, then `k[..., :d].copy_(...)`), or `torch.zeros`
    with the batch size filled by `setitem` and `+=`."""

    def __init__(self, width, make="new_empty"):
        super().__init__()
        self.nope = nn.Linear(width, width // 2)
        self.rope = nn.Linear(width, width // 2)
        self.out = nn.Linear(width, width)
        self.make = make

    def forward(self, x):
        nope, rope = self.nope(x), self.rope(x)
        half = nope.shape[-1]
        if self.make == "new_empty":
            keys = nope.new_empty(*nope.shape[:-1], half + rope.shape[-1])
            keys[..., :half].copy_(nope)
            keys[..., half:].copy_(rope)
        else:
            keys = torch.zeros(x.shape[0], x.shape[1], 2 * half)
            keys[:, :, :half] = nope
            keys[:, :, half:] += rope
        return x + self.out(keys)


class WriteIntoFirstSample(FreshKeys):
    """Like FreshKeys, then overwrites sample 0 of the fresh tensor: a literal index
    into the batch."""

    def forward(self, x):
        nope = self.nope(x)
        keys = nope.new_zeros(*nope.shape[:-1], 2 * nope.shape[-1])
        keys[..., : nope.shape[-1]].copy_(nope)
        keys[0] = 1.0
        return x + self.out(keys)


@pytest.mark.parametrize("make", ["new_empty", "zeros"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_fresh_buffer_written_per_sample_splits_like_eager(make, dynamic):
    x = torch.randn(4, 3, 8)
    model = Stack(lambda width: FreshKeys(width, make), n=LAYERS)
    assert_matches_eager(model, lambda m: m(x), OPTIONS, dynamic_inputs=(x,) if dynamic else ())
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None and len(report.blocks) == LAYERS


def test_write_into_one_sample_of_a_fresh_buffer_is_refused():
    model = torch.compile(Stack(WriteIntoFirstSample, n=LAYERS), backend="speedloader", options=OPTIONS)
    with pytest.raises(slcompile.CompileError, match="writes in place into some samples of"):
        model(torch.randn(4, 3, 8))


class RoutedBlock(nn.Module):
    """A layer and a router over `bins` experts whose logits (per token, in token
    order) the model collects; with `count_here`, the layer itself scales its output
    by the tokens each expert gets over the whole batch (a cross-sample count)."""

    def __init__(self, width, bins=4, count_here=False):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.router = nn.Linear(width, bins)
        self.count_here = count_here

    def forward(self, x):
        h = torch.relu(self.lin(x))
        logits = self.router(h).reshape(-1, self.router.out_features)
        if self.count_here:
            chosen = logits.argmax(-1)
            counts = torch.zeros(logits.shape[-1]).scatter_add_(0, chosen, torch.ones(chosen.shape))
            h = h * counts.max()
        return h, logits


class LoadBalancedStack(nn.Module):
    """Routed layers and, after them, a load-balancing loss over the router logits of
    all tokens (Mixtral's): tokens per expert counted by `torch.zeros(bins)
    .scatter_add_(...)` of each token's chosen experts weighted by the padding mask,
    and mean router probabilities per expert."""

    def __init__(self, width, count_here=False):
        super().__init__()
        self.layers = nn.ModuleList(RoutedBlock(width, count_here=count_here) for _ in range(LAYERS))
        self.head = nn.Linear(width, 1)

    def forward(self, x, mask):
        all_logits = []
        for layer in self.layers:
            x, logits = layer(x)
            all_logits.append(logits)
        flat_mask = mask.reshape(-1).float()
        bins = all_logits[0].shape[-1]
        counts, probs = torch.zeros(bins), torch.zeros(bins)
        for logits in all_logits:
            weights = torch.softmax(logits, dim=-1)
            _, chosen = torch.topk(weights, 2, dim=-1)
            counts = counts + torch.zeros(bins).scatter_add_(0, chosen.reshape(-1), flat_mask.repeat_interleave(2))
            probs = probs + (weights * flat_mask.unsqueeze(-1)).sum(dim=0)
        aux = torch.sum(counts / flat_mask.sum() * probs / flat_mask.sum()) * bins
        out = self.head(x)
        return out, out.square().mean() + 0.01 * aux


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_load_balancing_loss_after_the_blocks_splits_like_eager(dynamic):
    """The counts per expert write in place into a fresh tensor that nothing else
    reads: after the blocks they are computed once from all sub-batches."""
    x = torch.randn(4, 3, 8)
    _, mask, _ = padded_batch(4)
    mask = mask[:, :3]
    assert_matches_eager(LoadBalancedStack(8), lambda m: m(x, mask), OPTIONS,
                         dynamic_inputs=(x, mask) if dynamic else ())
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None and len(report.blocks) == LAYERS


def test_counts_over_the_batch_inside_a_block_are_refused():
    model = torch.compile(LoadBalancedStack(8, count_here=True), backend="speedloader", options=OPTIONS)
    _, mask, _ = padded_batch(4)
    with pytest.raises(slcompile.CompileError, match=r"scatter_add_\) in model.layers.0 reduces over the batch dimension"):
        model(torch.randn(4, 3, 8), mask[:, :3])


class AddSampleIndex(nn.Module):
    """Adds each sample's index in the batch: `arange(batch)` used as a value, not to
    gather; each sub-batch must see its own samples' indices (2, 3 for the second
    of two sub-batches of 4), not 0, 1 again."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)

    def forward(self, x):
        return self.lin(x) + torch.arange(x.shape[0])[:, None, None]


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_sample_index_used_as_a_value_reads_the_batch_positions(dynamic):
    x = torch.randn(4, 3, 8)
    assert_matches_eager(Stack(AddSampleIndex, n=LAYERS), lambda m: m(x), OPTIONS,
                         dynamic_inputs=(x,) if dynamic else ())
    assert slcompile.compile_reports()[-1].fallback_reason is None


class GatherSamples(nn.Module):
    """Gathers rows of the batch by an index made from `arange(batch)`."""

    def __init__(self, width, order):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.order = order

    def forward(self, x):
        index = torch.arange(x.shape[0])
        index = index.flip(0) if self.order == "reversed" else index.roll(1)
        return self.lin(x)[index]


@pytest.mark.parametrize("order", ["reversed", "rolled"])
def test_gather_that_reorders_samples_is_refused(order):
    model = torch.compile(Stack(lambda width: GatherSamples(width, order), n=LAYERS),
                          backend="speedloader", options=OPTIONS)
    with pytest.raises(slcompile.CompileError, match="indexes the batch dimension"):
        model(torch.randn(4, 3, 8))


# Families of the zoo that do not yet train with a padding mask, a second batch size
# and gradient checkpointing together: name -> (the exception, the refusal or failure).
ALL_THREE_FAILURES: dict[str, tuple[type[BaseException], str]] = {
    "Mixtral (router aux loss)": (
        AssertionError,
        "with gradient checkpointing no graph holds blocks: the router logits the loss reads are recorded by "
        "a hook that appends to a list, a side effect Dynamo does not trace inside a checkpointed layer, so "
        "the layers run in graphs without blocks, compiled plainly ('no blocks'; with "
        "torch._dynamo.config.skip_fwd_side_effects_in_bwd_under_checkpoint=True they split). Without "
        "checkpointing the family splits (test_router_aux_loss_without_checkpointing_splits_like_eager)"),
}


def _zoo_batch(name, batch):
    """The zoo family's call inputs for `batch` samples: a padding mask whose zeros
    differ per sample (ViT: images, no mask)."""
    if name == "ViT":
        generator = torch.Generator().manual_seed(batch)
        return {"pixel_values": torch.randn(batch, 3, 16, 16, generator=generator),
                "labels": torch.randint(0, 5, (batch,), generator=generator)}
    ids, mask, labels = padded_batch(batch, seed=batch)
    kwargs = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    if name == "T5":
        kwargs["decoder_attention_mask"] = mask
    return kwargs


def _all_three_marks(name):
    marks = [pytest.mark.slow]
    if name in ALL_THREE_FAILURES:
        raises, reason = ALL_THREE_FAILURES[name]
        marks.append(pytest.mark.xfail(raises=raises, reason=reason, strict=True))
    return marks


@pytest.mark.parametrize("name", [pytest.param(name, marks=_all_three_marks(name)) for name in zoo.FAMILIES])
def test_family_with_mask_second_batch_size_and_checkpointing(name, caplog):
    """Each zoo family with a padding mask, gradient checkpointing where the family
    supports it, and a batch of 4 then of 6 (Dynamo recompiles with a symbolic batch):
    both calls split, with eager's outputs, loss and every gradient."""
    _train_with_mask_and_two_batch_sizes(name, caplog, checkpointing=True)


@pytest.mark.slow
def test_router_aux_loss_without_checkpointing_splits_like_eager(caplog):
    """Mixtral's load-balancing loss sums over the router logits of all tokens after
    the blocks: with a padding mask and a batch of 4 then 6 it splits like eager."""
    _train_with_mask_and_two_batch_sizes("Mixtral (router aux loss)", caplog, checkpointing=False)


def _train_with_mask_and_two_batch_sizes(name, caplog, checkpointing):
    import copy
    import logging

    model = zoo.FAMILIES[name]()[0].train()
    checkpointed = checkpointing and model.supports_gradient_checkpointing
    if checkpointed:
        model.gradient_checkpointing_enable()
    eager, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    compiled = torch.compile(compiled_model, backend="speedloader", options=OPTIONS)
    with caplog.at_level(logging.INFO, logger="slcompile"):
        for batch in (4, 6):
            kwargs = _zoo_batch(name, batch)
            for m in (eager, compiled_model):
                m.zero_grad(set_to_none=True)
            ref = eager(**kwargs)
            ref.loss.backward()
            out = compiled(**kwargs)
            out.loss.backward()
            torch.testing.assert_close(out.logits, ref.logits, atol=2e-5, rtol=2e-5)
            torch.testing.assert_close(out.loss, ref.loss, atol=2e-5, rtol=2e-5)
            pairs = list(zip(eager.named_parameters(), compiled_model.named_parameters(), strict=True))
            assert [n for (n, p), _ in pairs if p.grad is not None] == [n for _, (n, q) in pairs if q.grad is not None]
            for (param, p), (_, q) in pairs:
                if p.grad is not None:
                    torch.testing.assert_close(q.grad, p.grad, atol=2e-5, rtol=2e-5, msg=param)
    reports = slcompile.compile_reports()
    with_blocks = [r for r in reports if r.blocks]
    assert all(r.fallback_reason is None for r in with_blocks), [r.fallback_reason for r in with_blocks]
    assert {r.batch_size for r in with_blocks} == {4, 6}
    plain = [r.fallback_reason for r in reports if not r.blocks]
    assert all(reason.startswith("no blocks: compiled plainly") for reason in plain), plain
    if checkpointed:
        assert "runs as recompute='blocks'" in caplog.text


@pytest.mark.slow
@pytest.mark.parametrize("name, dynamic", [("BLOOM", False), ("T5", False), ("GPT-NeoX", True)])
def test_explain_says_a_family_with_mask_and_checkpointing_splits(name, dynamic):
    """`explain` of a checkpointed family with a padding mask (BLOOM's layers hold an
    autograd.Function; T5 shifts its labels in place; GPT-NeoX's mask and token ids
    reach the graph with a batch symbol each): its blocks split, no fallback."""
    model = zoo.FAMILIES[name]()[0].train()
    model.gradient_checkpointing_enable()
    kwargs = _zoo_batch(name, 4)
    if dynamic:
        for key in ("input_ids", "attention_mask"):
            torch._dynamo.maybe_mark_dynamic(kwargs[key], 0)
    explanation = slcompile.explain(model, kwargs=kwargs, num_subbatches=2, lowering="aot_eager")
    split = [graph for graph in explanation.graphs if graph.blocks]
    assert split and all(graph.fallback_reason is None and "blk1.sb1" in graph.schedule for graph in split)
    assert "attention_mask" in " ".join(split[0].batch_inputs)
