"""A small GPT for the demo, the benchmarks and the tests, and ready targets for
the command line.

`TinyGPT(GPTConfig(...))` is a decoder-only transformer whose blocks live in
`model.layers`; `forward(idx, targets=None)` returns (logits, loss) with a
cross-entropy loss that ignores -100 targets, the layout of most language models.

`tiny_gpt()` and `tiny_llama()` build a model and a batch in the form
`slcompile explain` and `slcompile tune` take (`slcompile explain
slcompile.examples:tiny_gpt`); `tiny_llama` needs `transformers`.
"""

from __future__ import annotations

import dataclasses
import math

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["GPTConfig", "TinyGPT", "make_gpt_batch", "tiny_gpt", "tiny_llama"]


@dataclasses.dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 96
    seq_len: int = 16
    d_model: int = 32
    n_heads: int = 4
    n_layers: int = 4
    dropout: float = 0.0


class Attention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        q, k, v = self.qkv(x).split(d_model, dim=-1)
        head_dim = d_model // self.n_heads
        q = q.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        k = k.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        v = v.view(batch, seq, self.n_heads, head_dim).transpose(1, 2)
        y = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, dropout_p=self.dropout if self.training else 0.0
        )
        return self.proj(y.transpose(1, 2).reshape(batch, seq, d_model))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.drop(self.out(F.gelu(self.fc(x))))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer; `forward(idx, targets=None)` returns (logits, loss)."""

    def __init__(self, cfg: GPTConfig = GPTConfig()):
        super().__init__()
        self.cfg = cfg
        self.tok = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=1 / math.sqrt(p.shape[-1]))

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None):
        seq = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(seq, device=idx.device))
        for layer in self.layers:
            x = layer(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(
            logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-100
        )
        return logits, loss


def make_gpt_batch(
    cfg: GPTConfig, batch: int, *, seed: int = 0, ignore_fraction: float = 0.25
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and targets; a fraction of targets is -100 so that sub-batches hold
    different numbers of real labels (the case a per-sub-batch mean gets wrong)."""
    gen = torch.Generator().manual_seed(seed)
    idx = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    targets = torch.randint(0, cfg.vocab_size, (batch, cfg.seq_len), generator=gen)
    # Uneven masking: later samples lose more labels.
    for row in range(batch):
        cut = int(cfg.seq_len * ignore_fraction * (row + 1) / batch * 2)
        targets[row, : min(cut, cfg.seq_len - 1)] = -100
    return idx, targets


def tiny_gpt(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """A 4-block TinyGPT (d_model 64) and a batch: `model(*args)` returns (logits, loss)."""
    torch.manual_seed(0)
    cfg = GPTConfig(n_layers=4, d_model=64, seq_len=32, vocab_size=256)
    return TinyGPT(cfg), make_gpt_batch(cfg, batch)


def tiny_llama(batch: int = 8) -> tuple[nn.Module, tuple[torch.Tensor], dict[str, torch.Tensor]]:
    """A 4-block Hugging Face Llama (hidden size 64) built from a config, no download,
    and a batch: `model(input_ids, labels=labels).loss`.

    Raises:
        ModuleNotFoundError: `transformers` is not installed (the message says how).
    """
    try:
        from transformers import LlamaConfig, LlamaForCausalLM
    except ModuleNotFoundError as error:
        raise ModuleNotFoundError(
            "tiny_llama needs transformers: pip install transformers "
            "(or try slcompile.examples:tiny_gpt, which needs nothing more)"
        ) from error
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(num_hidden_layers=4, hidden_size=64, intermediate_size=128,
                                         num_attention_heads=4, num_key_value_heads=4, vocab_size=1000))
    input_ids = torch.randint(0, 1000, (batch, 32))
    return model, (input_ids,), {"labels": input_ids.clone()}
