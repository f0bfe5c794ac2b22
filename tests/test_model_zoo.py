"""Tiny models of every supported Hugging Face family train layer-major with eager's
numerics: loss, outputs and every parameter gradient, with `on_refusal="raise"`, the
blocks found one per layer; weights and activations on nvme for a few families. A
mixture of experts routes each sub-batch's tokens on its own; routing that couples
samples (a capacity per expert) is refused.

`python -m tests.test_model_zoo --table` prints the README's "Supported models" table
from a run of these same cases.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, os.path.dirname(__file__))

import slcompile  # noqa: E402
from conftest import assert_matches_eager  # noqa: E402
from models import Stack  # noqa: E402

BATCH, SEQ, VOCAB, LAYERS, HIDDEN = 4, 8, 64, 2, 32
OPTIONS = {"lowering": "aot_eager", "on_refusal": "raise"}


def _causal_lm(config_name, model_name, **fields):
    """A causal LM of the family (built from a tiny config) and its call with labels."""
    import transformers

    config = getattr(transformers, config_name)(**fields)
    model = getattr(transformers, model_name)(config)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def call(m):
        out = m(input_ids=ids, labels=ids)
        return out.logits, out.loss

    return model, call


def _decoder(config_name, model_name, **fields):
    """The fields most decoder configs share: two layers, hidden 32, dropout off."""
    return _causal_lm(
        config_name, model_name,
        **{"num_hidden_layers": LAYERS, "hidden_size": HIDDEN, "intermediate_size": 2 * HIDDEN,
           "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": VOCAB,
           "max_position_embeddings": 32, **fields},
    )


def _gpt2():
    """GPT-2 as it comes: with no `loss_type` set, its loss breaks the graph."""
    return _causal_lm(
        "GPT2Config", "GPT2LMHeadModel", n_layer=LAYERS, n_embd=HIDDEN, n_head=4, vocab_size=VOCAB,
        n_positions=32, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
    )


def _batched_mm_experts():
    """Mixtral with each token's experts gathered per token (`repeat_interleave`, `bmm`)."""
    model, call = _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4, num_experts_per_tok=2)
    model.set_experts_implementation("batched_mm")
    return model, call


def _bert():
    from transformers import BertConfig, BertForMaskedLM

    config = BertConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                        num_attention_heads=4, vocab_size=VOCAB, max_position_embeddings=32,
                        hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))

    def call(m):
        out = m(input_ids=ids, labels=ids)
        return out.logits, out.loss

    return BertForMaskedLM(config), call


def _vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(num_hidden_layers=LAYERS, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN,
                       num_attention_heads=4, image_size=16, patch_size=8, num_labels=5,
                       hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    pixels = torch.randn(BATCH, 3, 16, 16, generator=torch.Generator().manual_seed(0))
    labels = torch.tensor([0, 3, 1, 4])

    def call(m):
        out = m(pixel_values=pixels, labels=labels)
        return out.logits, out.loss

    return ViTForImageClassification(config), call


# Family -> builder of (model, call(m) -> (outputs, loss)). One entry per family.
FAMILIES = {
    "Llama": lambda: _decoder("LlamaConfig", "LlamaForCausalLM"),
    "Mistral": lambda: _decoder("MistralConfig", "MistralForCausalLM"),
    "Qwen2": lambda: _decoder("Qwen2Config", "Qwen2ForCausalLM"),
    "Qwen3": lambda: _decoder("Qwen3Config", "Qwen3ForCausalLM", head_dim=8),
    "Gemma2": lambda: _decoder("Gemma2Config", "Gemma2ForCausalLM", head_dim=8),
    "Gemma3": lambda: _decoder("Gemma3TextConfig", "Gemma3ForCausalLM", head_dim=8),
    "Phi3": lambda: _decoder("Phi3Config", "Phi3ForCausalLM", pad_token_id=0),
    "GPT-NeoX": lambda: _decoder("GPTNeoXConfig", "GPTNeoXForCausalLM", num_key_value_heads=None),
    "OPT": lambda: _causal_lm("OPTConfig", "OPTForCausalLM", num_hidden_layers=LAYERS, hidden_size=HIDDEN,
                              ffn_dim=2 * HIDDEN, num_attention_heads=4, vocab_size=VOCAB,
                              max_position_embeddings=32, word_embed_proj_dim=HIDDEN, dropout=0.0),
    "Falcon": lambda: _causal_lm("FalconConfig", "FalconForCausalLM", num_hidden_layers=LAYERS,
                                 hidden_size=HIDDEN, num_attention_heads=4, vocab_size=VOCAB),
    "GPT-J": lambda: _causal_lm("GPTJConfig", "GPTJForCausalLM", n_layer=LAYERS, n_embd=HIDDEN, n_head=4,
                                rotary_dim=4, vocab_size=VOCAB, n_positions=32, resid_pdrop=0.0,
                                embd_pdrop=0.0, attn_pdrop=0.0),
    "BLOOM": lambda: _causal_lm("BloomConfig", "BloomForCausalLM", n_layer=LAYERS, hidden_size=HIDDEN,
                                n_head=4, vocab_size=VOCAB),
    "GPT-2": _gpt2,
    "Mixtral": lambda: _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                num_experts_per_tok=2),
    # The loss adds a load-balancing loss over the router logits of all tokens.
    "Mixtral (router aux loss)": lambda: _decoder("MixtralConfig", "MixtralForCausalLM", num_local_experts=4,
                                                  num_experts_per_tok=2, output_router_logits=True),
    "Mixtral (batched_mm experts)": _batched_mm_experts,
    "Qwen2-MoE": lambda: _decoder("Qwen2MoeConfig", "Qwen2MoeForCausalLM", num_experts=4, num_experts_per_tok=2,
                                  moe_intermediate_size=HIDDEN, shared_expert_intermediate_size=HIDDEN),
    "T5": lambda: _causal_lm("T5Config", "T5ForConditionalGeneration", vocab_size=VOCAB, d_model=HIDDEN, d_kv=8,
                             d_ff=2 * HIDDEN, num_layers=LAYERS, num_decoder_layers=LAYERS, num_heads=4,
                             dropout_rate=0.0, decoder_start_token_id=0, pad_token_id=0),
    "BERT": _bert,
    "ViT": _vit,
}

# Families whose weights and activations rest on nvme in their test.
ON_NVME = {"Llama", "Mixtral"}
# Sub-batches per family (default 2): one sample each where routing is per token.
NUM_SUBBATCHES = {"Mixtral": 4}
# Blocks expected per family (default: LAYERS), for models with more than one stack.
BLOCKS: dict[str, int] = {"T5": 2 * LAYERS}
# Families that do not run layer-major yet: name -> reason.
KNOWN_FAILURES: dict[str, str] = {}
# Families whose case takes more than ~10 s on 2 cores.
SLOW = {"Mixtral"}


def run_family(name: str) -> slcompile.CompileReport:
    """Checks the family against eager; returns the report of its graph with blocks."""
    model, call = FAMILIES[name]()
    model.train()
    options = {**OPTIONS, "num_subbatches": NUM_SUBBATCHES.get(name, 2)}
    if name in ON_NVME:
        options.update(weights="nvme", activations="nvme", min_offload_bytes=0)
    slcompile.clear_compile_reports()
    assert_matches_eager(model, call, options, atol=2e-5, rtol=2e-5)
    reports = slcompile.compile_reports()
    with_blocks = [r for r in reports if r.blocks]
    assert len(with_blocks) == 1, [r.blocks for r in reports]
    # The loss after a graph break is a graph of its own, without blocks.
    plain = [r.fallback_reason for r in reports if r is not with_blocks[0]]
    assert with_blocks[0].fallback_reason is None
    assert all(reason.startswith("no blocks: compiled plainly") for reason in plain), plain
    report = with_blocks[0]
    assert len(report.blocks) == BLOCKS.get(name, LAYERS), report.blocks
    if name in ON_NVME:
        assert report.streamed_bytes > 0
    return report


# Families whose graphs are the same from the oldest transformers supported on: with
# older releases OPT's forward breaks the graph and the mixtures of experts route
# through ops that are refused (both then compile plainly, with eager's numerics).
SAME_ON_OLDEST = ("Llama", "Mistral", "Qwen2", "Gemma2", "GPT-2", "T5", "BERT")


def _marks(name):
    marks = [pytest.mark.slow] if name in SLOW else []
    if name in SAME_ON_OLDEST:
        marks.append(pytest.mark.oldest)
    if name in KNOWN_FAILURES:
        marks.append(pytest.mark.xfail(reason=KNOWN_FAILURES[name], strict=True))
    return marks


@pytest.mark.parametrize("name", [pytest.param(name, marks=_marks(name)) for name in FAMILIES])
def test_family_trains_layer_major_like_eager(name):
    run_family(name)


class SortedMoE(nn.Module):
    """Top-2 routing over a flattened token dimension, tokens sorted by expert and
    put back by the inverse permutation (the shape of grouped-matmul experts), or
    added back into their tokens with `index_add_`."""

    def __init__(self, width, experts=3, restore="inverse"):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.experts = nn.Parameter(torch.randn(experts, width, width) / width**0.5)
        self.restore = restore

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        weights, chosen = torch.topk(self.router(tokens).softmax(-1), 2, dim=-1)
        order = torch.argsort(chosen.reshape(-1), stable=True)
        rows = tokens[order // 2]
        mixed = torch.bmm(rows.unsqueeze(1), self.experts[chosen.reshape(-1)[order]]).squeeze(1)
        mixed = mixed * weights.reshape(-1)[order].unsqueeze(-1)
        if self.restore == "index_add":
            return x + torch.zeros_like(tokens).index_add_(0, order // 2, mixed).view_as(x)
        inverse = torch.empty_like(order)
        inverse[order] = torch.arange(order.shape[0])
        return x + mixed[inverse].view(-1, 2, x.shape[-1]).sum(1).view_as(x)


class CapacityMoE(nn.Module):
    """Top-1 routing that drops tokens past each expert's capacity: whether a token
    is kept depends on the tokens of other samples before it."""

    def __init__(self, width, experts=3, capacity=4):
        super().__init__()
        self.router = nn.Linear(width, experts)
        self.capacity = capacity

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        chosen = F.one_hot(self.router(tokens).argmax(-1), self.router.out_features)
        rank = (chosen.cumsum(0) * chosen).sum(-1)
        return (tokens * (rank <= self.capacity).unsqueeze(-1)).view_as(x)


@pytest.mark.parametrize("restore, num_subbatches, dynamic", [
    ("inverse", 2, False), ("inverse", 2, True), ("index_add", 4, False),
])
def test_tokens_sorted_by_expert_route_per_sub_batch_like_eager(restore, num_subbatches, dynamic):
    x = torch.randn(4, 3, 8)
    model = Stack(lambda width: SortedMoE(width, restore=restore), n=LAYERS)
    options = {**OPTIONS, "num_subbatches": num_subbatches}
    assert_matches_eager(model, lambda m: m(x), options, dynamic_inputs=(x,) if dynamic else ())
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None and len(report.blocks) == LAYERS


def test_gpt_oss_experts_split_each_tokens_gate_and_up_like_eager():
    """GPT-OSS's experts take each routed token's gate and up projections from one
    matmul's interleaved features (`gate_up[..., ::2]`, `gate_up[..., 1::2]`): a slice
    of every row's own features, which keeps tokens apart and splits."""
    model, call = _decoder("GptOssConfig", "GptOssForCausalLM", num_local_experts=4, num_experts_per_tok=2,
                           head_dim=8, intermediate_size=HIDDEN)
    assert_matches_eager(model.train(), call, {**OPTIONS, "num_subbatches": 2}, atol=2e-5, rtol=2e-5)
    (report,) = [r for r in slcompile.compile_reports() if r.blocks]
    assert report.fallback_reason is None and len(report.blocks) == LAYERS


class FirstRows(nn.Module):
    """Sorted tokens, of which a slice of the rows is kept: which tokens those are
    depends on the other samples' tokens."""

    def __init__(self, width):
        super().__init__()
        self.score = nn.Linear(width, 1)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        rows, _ = torch.sort(self.score(tokens).squeeze(-1))
        return x * rows[:4].sum()


class NeverRestored(nn.Module):
    """Sorts its tokens by a score and never puts them back: the order of the
    tokens it returns depends on the other samples'."""

    def __init__(self, width):
        super().__init__()
        self.score = nn.Linear(width, 1)

    def forward(self, x):
        tokens = x.reshape(-1, x.shape[-1])
        return tokens[torch.argsort(self.score(tokens).squeeze(-1))].view_as(x)


@pytest.mark.parametrize("block, words", [
    (CapacityMoE, "node cumsum .* works along the batch dimension"),
    (NeverRestored, r"\(view_as\) .* combines tokens in the order their sub-batch routed them"),
    (FirstRows, r"\(getitem\) .* picks among tokens routed by their sub-batch \(it indexes their rows, dim 0\)"),
], ids=["capacity", "never-restored", "first-rows"])
def test_routing_that_couples_samples_is_refused(block, words):
    model = torch.compile(Stack(block), backend="speedloader", options={**OPTIONS, "num_subbatches": 2})
    with pytest.raises(slcompile.CompileError, match=words):
        model(torch.randn(4, 3, 8))


def supported_models_table() -> str:
    """The README's table: one row per family, from a run of its test case."""
    rows = [
        "| Family | Blocks found | Sub-batches | Loss and every gradient equal eager | Weights and activations on nvme |",
        "|---|---|---|---|---|",
    ]
    for name in FAMILIES:
        torch._dynamo.reset()
        torch.manual_seed(0)
        blocks = ""
        try:
            report = run_family(name)
            blocks, result = str(len(report.blocks)), "yes"
        except Exception as err:  # the table reports what the test would assert
            result = "no: " + (str(err).splitlines() or [type(err).__name__])[0][:100]
        nvme = "yes" if name in ON_NVME else ""
        rows.append(f"| {name} | {blocks} | {NUM_SUBBATCHES.get(name, 2)} | {result} | {nvme} |")
    return "\n".join(rows)


if __name__ == "__main__":
    if "--table" not in sys.argv[1:]:
        sys.exit("usage: python -m tests.test_model_zoo --table")
    import logging

    logging.disable(logging.WARNING)
    print(supported_models_table())
