"""Tiny models for the tests: the package's GPT, Hugging Face models built from
configs, and small stacks of blocks of any kind; with what every test file shares
about them. Test files import from here (and from conftest), never from each other.

Every model here is built from a config with random weights (seeded); nothing is
downloaded. The Hugging Face factories import `transformers` lazily.
"""

from __future__ import annotations

from torch import nn

from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

__all__ = ["GPTConfig", "TinyGPT", "make_gpt_batch", "hf_gpt2", "hf_llama", "Stack", "BatchNormBlock",
           "EXPECTED_SCHEDULE_K2", "EXPECTED_SCHEDULE_K2_PER_SUBBATCH", "step_beside_eager"]

# The schedule of any 2-block model at K=2 (speedloader's order), as explain() prints
# it: the suffix once, on the whole batch (the default), or per sub-batch.
EXPECTED_SCHEDULE_K2 = """\
fwd prefix.sb0
fwd prefix.sb1
fwd blk0.sb0
fwd blk0.sb1
fwd blk1.sb0
fwd blk1.sb1
fwd suffix
bwd suffix
bwd blk1.sb1
bwd blk1.sb0
bwd blk0.sb1
bwd blk0.sb0
bwd prefix.sb1
bwd prefix.sb0"""
EXPECTED_SCHEDULE_K2_PER_SUBBATCH = EXPECTED_SCHEDULE_K2.replace(
    "fwd suffix\nbwd suffix", "fwd suffix.sb0\nfwd suffix.sb1\nbwd suffix.sb1\nbwd suffix.sb0")


class Stack(nn.Module):
    """Blocks of any kind around a linear head; forward(x) -> (out, loss)."""

    def __init__(self, make_block, width=8, n=3):
        super().__init__()
        self.layers = nn.ModuleList(make_block(width) for _ in range(n))
        self.head = nn.Linear(width, 1)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        out = self.head(x)
        return out, out.square().mean()


class BatchNormBlock(nn.Module):
    """A linear layer and BatchNorm: mixes samples in training mode."""

    def __init__(self, width):
        super().__init__()
        self.lin = nn.Linear(width, width)
        self.norm = nn.BatchNorm1d(width)

    def forward(self, x):
        return self.norm(self.lin(x))


def hf_gpt2(n_layer: int = 4, n_embd: int = 32, vocab_size: int = 96, n_positions: int = 32):
    """A Hugging Face GPT-2 LM head model built from a small config, dropout off."""
    from transformers import GPT2Config, GPT2LMHeadModel

    config = GPT2Config(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=4,
        vocab_size=vocab_size,
        n_positions=n_positions,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    model = GPT2LMHeadModel(config)
    # Without this, GPT-2's loss path logs through a call that breaks the graph.
    model.loss_type = "ForCausalLM"
    return model


def hf_llama(num_hidden_layers: int = 4, hidden_size: int = 32, vocab_size: int = 96):
    """A Hugging Face Llama causal LM built from a small config."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        num_hidden_layers=num_hidden_layers,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=vocab_size,
        max_position_embeddings=64,
    )
    return LlamaForCausalLM(config)


def step_beside_eager(compiled, opt, eager, eager_opt, *inputs):
    """One training step of a compiled model and its optimizer, then the same step of
    the eager copy and its own; returns (loss, eager loss), detached."""
    losses = []
    for model, optimizer in ((compiled, opt), (eager, eager_opt)):
        loss = model(*inputs)[1]
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
    return tuple(losses)
