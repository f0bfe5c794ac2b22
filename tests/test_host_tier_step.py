"""Training steps with the block weights on a host tier that copies, as on a GPU
machine, run on the CPU through the engine's `separate_host`:
numerics against eager torch.optim, the bytes of each step, each block's weights one
host group loaded by one copy a visit, and weights the optimizer updates in place at
the addresses they were first stored at."""

from __future__ import annotations

import copy
import tempfile

import pytest
import torch
from conftest import fetched_weight_bytes
from models import GPTConfig, TinyGPT, make_gpt_batch

import slcompile
from slcompile.runtime import Tier, TransferKind, mark_step, reset_runtime_stats
from slcompile.runtime.storage.engine import TransferEngine, get_engine, set_engine
from slcompile.runtime.weights import weight_home

CFG = GPTConfig(n_layers=2, d_model=32, vocab_size=64, seq_len=8)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA machine's host tier copies anyway")


def _host_addresses(model) -> dict[str, int]:
    addresses = {}
    for name, param in slcompile.offloaded_parameters(model):
        engine, key, tier = weight_home(param)
        assert tier is Tier.HOST
        addresses[name] = engine._ledger.entries[key].host_block.buffer.data_ptr()
    return addresses


@pytest.fixture
def separate_host():
    """The process-wide engine, for this test, one whose host tier copies."""
    engine = TransferEngine(offload_dir=tempfile.mkdtemp(prefix="slc-host-tier-"), separate_host=True)
    previous = set_engine(engine)
    yield engine
    set_engine(previous)
    engine.close()


def test_weights_on_a_copying_host_step_like_eager_and_stay_where_they_were_stored(separate_host):
    assert get_engine() is separate_host and not separate_host.copies_nothing(Tier.HOST, Tier.DEVICE)
    eager = TinyGPT(CFG)
    for block in eager.layers:
        # Its key part gets an exactly-zero gradient, whose rounding noise AdamW scales
        # up differently in two runs (tests/test_offload_optimizer.py says more).
        block.attn.qkv.register_parameter("bias", None)
    model = copy.deepcopy(eager)
    options = {"lr": 1e-2, "weight_decay": 0.1}
    eager_opt = torch.optim.AdamW(eager.parameters(), **options)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, states="host", gradients="host", **options)
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "weights": "host", "num_subbatches": 2, "live_blocks": 1})
    addresses = None
    for step in range(3):
        idx, targets = make_gpt_batch(CFG, 4, seed=step)
        expected = eager(idx, targets)[1]
        expected.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        mark_step()
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        window = mark_step()
        report = slcompile.compile_reports()[-1]
        assert report.fallback_reason is None
        if addresses is None:
            addresses = _host_addresses(model)
        # Each block fetched once a forward and once a backward (what the backward
        # reads of it; no prefetch with one live block), its gradient sent once, its
        # update written in place.
        streamed = report.streamed_bytes
        assert window.bytes_moved[TransferKind.WEIGHT, Tier.HOST, Tier.DEVICE] == fetched_weight_bytes(report)
        assert window.bytes_moved[TransferKind.GRADIENT, Tier.DEVICE, Tier.HOST] == streamed
        # The optimizer reads the gradients where they rest: none comes back.
        assert window.total_bytes(kind=TransferKind.GRADIENT) == streamed
        # The first step also offloads the weights.
        written = sum(n for (kind, _, destination), n in window.bytes_moved.items()
                      if kind is TransferKind.WEIGHT and destination is Tier.HOST)
        assert written == streamed * (2 if step == 0 else 1)
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
        assert _host_addresses(model) == addresses
        with slcompile.gathered_weights(model):
            for (name, param), want in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(param, want, atol=1e-5, rtol=1e-5, msg=f"step {step}: {name}")
        assert _host_addresses(model) == addresses
    engine = weight_home(next(p for _, p in slcompile.offloaded_parameters(model)))[0]
    assert not [key for key in engine.keys() if key.endswith("~update")]
    # One host group a block: a block's weights in one range of the pool.
    groups = {id(engine._ledger.entries[weight_home(p)[1]].host_group) for _, p in slcompile.offloaded_parameters(model)}
    assert len(groups) == CFG.n_layers
    opt.close()
    reset_runtime_stats()
