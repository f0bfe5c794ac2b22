"""Plans of a graph with a symbolic batch hold at every batch size it runs at, not
only at the size it was traced with: `min_offload_bytes` compares each saved tensor
at its largest size, and under `memory_budget` the graph is guarded to the sizes
its plan fits. Losses and gradients equal eager's."""

from __future__ import annotations

import copy
import re

import torch

import slcompile
from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime.storage.tiers import Tier, TransferKind

CFG = GPTConfig(n_layers=2)  # d_model 32, 16 tokens: at 64 KiB, nothing of batch 8 leaves; much of batch 80 does


def _step_beside_eager(compiled, model, eager, batch: int) -> int:
    """One training step of `batch` samples compiled and eagerly; asserts the loss and
    every gradient equal; returns the activation bytes the step stored."""
    for p in (*model.parameters(), *eager.parameters()):
        p.grad = None
    slcompile.mark_step()
    loss = compiled(*make_gpt_batch(CFG, batch))[1]
    loss.backward()
    stored = slcompile.mark_step().bytes_moved.get((TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME), 0)
    loss_ref = eager(*make_gpt_batch(CFG, batch))[1]
    loss_ref.backward()
    torch.testing.assert_close(loss, loss_ref)
    for (name, p), (_, ref) in zip(model.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, ref.grad, msg=name)
    return stored


def test_a_batch_grown_after_a_dynamic_recompile_stashes_what_a_graph_traced_at_it_stashes():
    options = slcompile.options(num_subbatches=2, lowering="aot_eager", on_refusal="raise",
                                weights="nvme", activations="nvme")
    model = TinyGPT(CFG)
    fresh_model, dynamic_model = copy.deepcopy(model), copy.deepcopy(model)

    fresh = torch.compile(fresh_model, backend="speedloader", options=options)
    fresh_stored = _step_beside_eager(fresh, fresh_model, copy.deepcopy(model), 80)
    fresh_report = slcompile.compile_reports()[-1]
    assert not fresh_report.offloaded_activations.bytes.free_symbols
    # Per-sample tensors a graph traced at 80 keeps for their size there (the norms'
    # statistics, attention's log-sum-exp): they grow with the batch.
    small = [int(m.group(1)) for _, why in fresh_report.offloaded_activations.kept
             if (m := re.fullmatch(r"smaller than min_offload_bytes \((\d+) B\)", why))]
    assert small and fresh_stored > 0

    dynamic = torch.compile(dynamic_model, backend="speedloader", options=options)
    eager = copy.deepcopy(model)
    for batch in (4, 8):
        _step_beside_eager(dynamic, dynamic_model, eager, batch)
    dynamic_report = slcompile.compile_reports()[-1]
    assert dynamic_report.offloaded_activations.bytes.free_symbols  # the batch is symbolic
    # Every saved tensor grows with the batch, so none stays for its size.
    assert not [why for _, why in dynamic_report.offloaded_activations.kept if "min_offload_bytes" in why]
    reports = len(slcompile.compile_reports())
    dynamic_stored = _step_beside_eager(dynamic, dynamic_model, eager, 80)
    assert len(slcompile.compile_reports()) == reports  # batch 80 ran the graph traced at 8
    # What the fresh graph stores, and the growing tensors it keeps for their size.
    assert dynamic_stored == fresh_stored + sum(small)


def test_a_memory_budget_guards_a_dynamic_graph_to_the_batches_its_plan_fits():
    budget = 5_000_000  # batch 8 fits keeping every activation; batch 80 only recomputing the blocks
    options = slcompile.options(num_subbatches=2, lowering="aot_eager", on_refusal="raise", memory_budget=budget)
    model = TinyGPT(CFG)
    eager = copy.deepcopy(model)
    compiled = torch.compile(model, backend="speedloader", options=options)

    idx, targets = make_gpt_batch(CFG, 8)
    torch._dynamo.mark_dynamic(idx, 0)
    torch._dynamo.mark_dynamic(targets, 0)
    compiled(idx, targets)[1].backward()
    small = slcompile.compile_reports()[-1]
    assert small.memory.recompute == "none" and small.memory.peak_bytes["device"] <= budget
    (batch,) = [s for s in small.budget_guard.free_symbols]
    assert small.budget_guard.subs(batch, 8) and not small.budget_guard.subs(batch, 80)

    _step_beside_eager(compiled, model, eager, 80)
    reports = slcompile.compile_reports()
    assert len(reports) == 2  # the guard failed: batch 80 compiled again, planned at 80
    large = reports[-1]
    assert large.memory.recompute == "blocks" and large.memory.peak_bytes["device"] <= budget
    assert large.budget_guard.subs(batch if batch in large.budget_guard.free_symbols else
                                   next(iter(large.budget_guard.free_symbols)), 80)
