"""A batch that grows or shrinks after the first call: Dynamo recompiles with a
symbolic batch, and every stage after the Dynamo graph (gradient fusion, activation
offload) keeps the sizes symbolic. Every call equals eager."""

from __future__ import annotations

import copy

import pytest
import torch

import slcompile
from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

from models import hf_llama


def _train_beside_eager(model, options, batches, call):
    """Runs `call(model, batch)` compiled and eagerly for each batch; asserts loss and
    every gradient equal; returns the report of each call's graph."""
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="speedloader", options=options)
    reports = []
    for batch in batches:
        for p in (*model.parameters(), *eager.parameters()):
            p.grad = None
        loss = call(compiled, batch)
        loss.backward()
        loss_ref = call(eager, batch)
        loss_ref.backward()
        torch.testing.assert_close(loss, loss_ref)
        for (name, p), (_, ref) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
            torch.testing.assert_close(p.grad, ref.grad, msg=name)
        reports.append(slcompile.compile_reports()[-1])
    return reports


@pytest.mark.parametrize("tier, k", [("device", 2), ("nvme", 2), ("nvme", 4)])
def test_tiny_gpt_batch_grows_and_shrinks(tier, k):
    cfg = GPTConfig(n_layers=2, d_model=64, seq_len=32, vocab_size=256)
    options = {"num_subbatches": k, "lowering": "aot_eager", "on_refusal": "raise",
               "weights": tier, "activations": tier, "min_offload_bytes": 0}
    reports = _train_beside_eager(
        TinyGPT(cfg), options, [8, 16, 4], lambda m, b: m(*make_gpt_batch(cfg, b))[1]
    )
    # The first batch, then a symbolic one, which serves sub-batches of one sample too:
    # every graph split.
    assert len(slcompile.compile_reports()) == 2
    for report in slcompile.compile_reports():
        assert report.fallback_reason is None and report.blocks == ("layers.0", "layers.1")
    dynamic = reports[1]
    assert "blk1.sb" in dynamic.schedule
    if tier == "nvme":
        # The saved activations of the symbolic graph leave the device too.
        assert dynamic.offloaded_activations.names
        assert dynamic.offloaded_activations.bytes.free_symbols


@pytest.mark.parametrize("lowering", ["aot_eager", pytest.param("inductor", marks=pytest.mark.slow)])
def test_a_batch_of_k_at_the_dynamic_compile_serves_every_batch_after_it(lowering):
    """The symbolic batch first traced at K samples, so one sample a sub-batch: the
    graph is not guarded on that (a size of 1 broadcasts), and larger batches, and K
    again, run through it."""
    cfg = GPTConfig(n_layers=2, d_model=32, seq_len=16, vocab_size=96)
    options = {"num_subbatches": 4, "lowering": lowering, "on_refusal": "raise",
               "weights": "nvme", "activations": "nvme", "min_offload_bytes": 0}
    _train_beside_eager(TinyGPT(cfg), options, [8, 4, 12, 4, 16], lambda m, b: m(*make_gpt_batch(cfg, b))[1])
    reports = slcompile.compile_reports()
    assert reports[1].fallback_reason is None and "blk1.sb3" in reports[1].schedule
    # The first batch, then a symbolic one. Inductor's lowering of a view of a
    # strided tensor (torch 2.13 to 2.15) still guards a size that may be 1, so the
    # batch after K compiles once more there.
    assert len(reports) == (2 if lowering == "aot_eager" else 3)


@pytest.mark.parametrize("tier, once", [("device", False), ("nvme", False), ("device", True)])
def test_hf_llama_batch_grows_and_shrinks(tier, once):
    """Traced flat or each unit once (`trace_units_once`): the example values the
    outlining computes for the step's own nodes (the labels joined from the
    sub-batches, padded) must not guard the symbolic batch at the size it was
    traced with, or every new size compiles again."""
    options = {"num_subbatches": 2, "lowering": "aot_eager", "on_refusal": "raise",
               "weights": tier, "activations": tier, "min_offload_bytes": 0, "trace_units_once": once}
    torch.manual_seed(0)

    def call(model, batch):
        ids = torch.randint(0, 96, (batch, 8), generator=torch.Generator().manual_seed(batch))
        return model(ids, labels=ids).loss

    reports = _train_beside_eager(hf_llama(num_hidden_layers=2), options, [8, 16, 4], call)
    assert len(slcompile.compile_reports()) == 2  # the first batch, then a symbolic one
    dynamic = reports[-1]
    assert dynamic.fallback_reason is None
    assert dynamic.blocks == ("model.layers.0", "model.layers.1")
    assert dynamic.fused_weight_grads > 0
