"""Tiny models for the tests: the package's GPT and Hugging Face models built from configs.

Every model here is built from a config with random weights (seeded); nothing is
downloaded. The Hugging Face factories import `transformers` lazily.
"""

from __future__ import annotations

from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

__all__ = ["GPTConfig", "TinyGPT", "make_gpt_batch", "hf_gpt2", "hf_llama"]


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
