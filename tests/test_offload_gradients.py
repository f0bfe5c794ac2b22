"""Weight gradients leave the device where the schedule stores them: speedloader once
per block (P bytes per step at any K), grad_accumulation once per (block, micro-batch)
(K * P), and the parameters after each optimizer step equal eager `torch.optim`."""

import copy

import pytest
import torch

import slcompile
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.runtime import Tier, TransferKind, mark_step
from slcompile.schedules import schedule_of
from slcompile.vocabulary import is_gradient_store

CFG = GPTConfig(n_layers=2, d_model=32, vocab_size=64, seq_len=8)
GRADIENT_OUT = (TransferKind.GRADIENT, Tier.DEVICE, Tier.NVME)
GRADIENT_IN = (TransferKind.GRADIENT, Tier.NVME, Tier.DEVICE)


def _model():
    torch.manual_seed(0)
    return TinyGPT(CFG)


@pytest.mark.parametrize("schedule, k", [("speedloader", 1), ("speedloader", 4), ("grad_accumulation", 4)])
def test_gradient_bytes_per_step_follow_the_schedule_and_steps_match_eager(schedule, k):
    eager = _model()
    model = copy.deepcopy(eager)
    options = {"lr": 0.1, "momentum": 0.9}
    eager_opt = torch.optim.SGD(eager.parameters(), **options)
    opt = slcompile.offload_optimizer(model, torch.optim.SGD, states="host", gradients="nvme", **options)
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "weights": "nvme", "num_subbatches": k, "schedule": schedule, "live_blocks": 2,
    })
    for step in range(2):
        idx, targets = make_gpt_batch(CFG, 8, seed=step)
        mark_step()
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        moved = mark_step().bytes_moved
        expected = eager(idx, targets)[1]
        expected.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        report = slcompile.compile_reports()[-1]
        p = report.streamed_bytes
        shares = k if schedule == "grad_accumulation" else 1
        assert moved[GRADIENT_OUT] == moved[GRADIENT_IN] == shares * p, step
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
        with slcompile.gathered_weights(model):
            for (name, param), expected_param in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(param, expected_param, atol=1e-5, rtol=1e-5, msg=f"step {step}: {name}")
    opt.close()

    # The stores are the schedule's: one per block, or one per (block, micro-batch),
    # each block's (or micro-batch's) waited for just before the next one's stores.
    planned = report.planned_schedule
    blocks = sorted(report.block_inputs)
    if schedule == "speedloader":
        assert planned.gradient_stores() == tuple((b, None) for b in reversed(blocks))
    else:
        assert planned.gradient_stores() == tuple((b, s) for s in reversed(range(k)) for b in reversed(blocks))
    derived = schedule_of(report.graphs["forward"], report.graphs["backward"])
    assert derived.text() == report.schedule == planned.text()
    stores = [n for n in report.graphs["backward"].graph.nodes if is_gradient_store(n)]
    assert len(stores) == shares * len(slcompile.offloaded_parameters(model))
