"""The host pool is sized from the compiled plan when the step's runtime starts,
before the first step: pinned memory on CUDA; on a CPU machine, where the host tier
is the device's memory and copies nothing, a host tier of its own
(`separate_host`), which takes the same path unpinned. The pool's sizing logic
itself is checked in test_tiers.py."""

from __future__ import annotations

import pytest
import torch
from devices import device_under_test, on_cuda

import slcompile
from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime import runtime_stats
from slcompile.runtime.storage.engine import TransferEngine, set_engine
from slcompile.runtime.storage.host_copier import group_layout
from slcompile.runtime.storage.tiers import PAGE_BYTES

pytestmark = pytest.mark.cuda_check

CFG = GPTConfig(n_layers=2, d_model=64)


@pytest.fixture
def engine():
    """A fresh process-wide engine, whose pool holds this test's plan alone, with a
    host tier that copies."""
    ours = TransferEngine(separate_host=not on_cuda())
    previous = set_engine(ours)
    yield ours
    set_engine(previous)
    ours.close()


def _compiled(**options):
    torch._dynamo.reset()
    model = TinyGPT(CFG).to(device_under_test())
    compiled = torch.compile(model, backend="speedloader", options=slcompile.options(
        lowering="aot_eager", num_subbatches=2, weights="host", **options))
    idx, targets = (t.to(device_under_test()) for t in make_gpt_batch(CFG, 4))
    return model, compiled, idx, targets


def test_weights_on_host_are_pinned_once_from_the_plan(engine):
    before = runtime_stats().pinned_host_bytes
    model, compiled, idx, targets = _compiled()
    blocks: dict[str, list[int]] = {}
    for name, param in model.named_parameters():
        if name.startswith("layers."):
            blocks.setdefault(name.split(".")[1], []).append(param.nbytes)
    compiled(idx, targets)[1].backward()
    pool = engine.host_pool
    assert pool is not None and pool.pinned == on_cuda()
    assert [growth.reason for growth in pool.growths] == ["plan"]  # sized once, nothing on demand
    # Each block's weights are one host group (its members aligned), taking whole pages.
    assert pool.used_bytes == sum(-(-group_layout(sizes)[1] // PAGE_BYTES) * PAGE_BYTES for sizes in blocks.values())
    assert pool.capacity_bytes >= pool.used_bytes
    assert runtime_stats().pinned_host_bytes - before == (pool.capacity_bytes if on_cuda() else 0)
    compiled(idx, targets)[1].backward()
    assert len(pool.growths) == 1  # a second step pins nothing


def test_a_host_memory_cap_below_the_plan_names_the_bytes_and_the_option(engine):
    model, compiled, idx, targets = _compiled(host_memory=4096)
    with pytest.raises(Exception, match=r"needs \d+ bytes of (pinned )?host memory.*host_memory=4096"):
        compiled(idx, targets)
    assert slcompile.offloaded_parameters(model) == []  # refused before any weight moved
