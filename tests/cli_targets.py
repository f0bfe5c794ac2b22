"""Factories for `slcompile explain module:factory` in the CLI tests."""

from models import GPTConfig, TinyGPT, make_gpt_batch


def tiny():
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 4)
    return TinyGPT(cfg), (idx, targets)
