"""The torch compatibility layer: the 2.11 fallbacks answer what newer torch answers,
and the installed torch has every internal slcompile uses."""

from __future__ import annotations

import torch
from torch.fx.experimental.symbolic_shapes import ShapeEnv

from slcompile import compat


def _symint(env: ShapeEnv, name: str, hint: int) -> torch.SymInt:
    from torch._dynamo.source import ConstantSource

    return env.create_symintnode(env.create_symbol(hint, source=ConstantSource(name)), hint=hint)


def test_shape_env_hint_matches_torch_optimization_hint():
    env = ShapeEnv()
    batch, seq = _symint(env, "batch", 6), _symint(env, "seq", 40)
    numel = batch * seq * 64
    assert compat.shape_env_optimization_hint(numel) == 6 * 40 * 64 == compat.optimization_hint(numel)
    assert compat.shape_env_optimization_hint(7) == 7


def test_an_unbacked_size_uses_the_fallback():
    env = ShapeEnv()
    unbacked = env.create_unbacked_symint()
    assert compat.shape_env_optimization_hint(unbacked * 2, fallback=5) == 5


def test_version_range_and_internals():
    assert compat.torch_is_supported((2, 11)) and compat.torch_is_supported((2, 15))
    assert not compat.torch_is_supported((2, 10)) and not compat.torch_is_supported((2, 16))
    assert compat.torch_is_supported()  # CI's torch
    assert compat.missing_internals() == []


def test_torch_without_optimization_hint_gets_the_shape_env_one(monkeypatch):
    import importlib

    from torch.fx.experimental import symbolic_shapes

    monkeypatch.delattr(symbolic_shapes, "optimization_hint", raising=False)  # as on torch 2.11
    try:
        reloaded = importlib.reload(compat)
        assert reloaded.optimization_hint is reloaded.shape_env_optimization_hint
        env = ShapeEnv()
        assert reloaded.optimization_hint(_symint(env, "batch", 3) * 5) == 15
    finally:
        monkeypatch.undo()
        importlib.reload(compat)
    assert compat.optimization_hint is getattr(symbolic_shapes, "optimization_hint",
                                               compat.shape_env_optimization_hint)
