"""The pinned host pool is sized from the compiled plan, before the first step (CUDA
machines only: on a CPU machine the host tier copies nothing and nothing is pinned;
the pool's sizing logic itself is checked on any machine in test_tiers.py)."""

from __future__ import annotations

import pytest
import torch
from devices import device_under_test, on_cuda

import slcompile
from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime import configure_engine, runtime_stats
from slcompile.runtime.storage.tiers import PAGE_BYTES

pytestmark = [pytest.mark.skipif(not on_cuda(), reason="pins host memory: CUDA machines only"), pytest.mark.cuda_check]

CFG = GPTConfig(n_layers=2, d_model=64)


def _compiled(**options):
    torch._dynamo.reset()
    model = TinyGPT(CFG).to(device_under_test())
    compiled = torch.compile(model, backend="speedloader", options=slcompile.options(
        lowering="aot_eager", num_subbatches=2, weights="host", **options))
    idx, targets = (t.to(device_under_test()) for t in make_gpt_batch(CFG, 4))
    return model, compiled, idx, targets


def test_weights_on_host_are_pinned_once_from_the_plan():
    engine = configure_engine()  # a fresh pool: what it holds is this plan's
    before = runtime_stats().pinned_host_bytes
    model, compiled, idx, targets = _compiled()
    block_bytes = [p.nbytes for name, p in model.named_parameters() if name.startswith("layers.")]
    compiled(idx, targets)[1].backward()
    pool = engine.host_pool
    assert pool is not None and pool.pinned
    assert [growth.reason for growth in pool.growths] == ["plan"]  # sized once, nothing on demand
    assert pool.used_bytes == sum(-(-n // PAGE_BYTES) * PAGE_BYTES for n in block_bytes)
    assert pool.capacity_bytes >= pool.used_bytes
    assert runtime_stats().pinned_host_bytes - before == pool.capacity_bytes
    compiled(idx, targets)[1].backward()
    assert len(pool.growths) == 1  # a second step pins nothing


def test_a_host_memory_cap_below_the_plan_names_the_bytes_and_the_option():
    configure_engine()
    _, compiled, idx, targets = _compiled(host_memory=4096)
    with pytest.raises(Exception, match=r"needs \d+ bytes of pinned host memory.*host_memory=4096"):
        compiled(idx, targets)
