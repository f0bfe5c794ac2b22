"""Sub-batched, layer-major training equals eager: outputs, loss, every gradient."""

import pytest
import torch

from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, hf_gpt2, make_gpt_batch

# Two blocks are the fewest that interleave; every case compiles on its own (the
# dynamic-batch ones the slowest), so every model here has two.
CFG = GPTConfig(n_layers=2)


def tiny_call(idx, targets):
    return lambda m: m(idx, targets)


def hf_call(idx, labels):
    def call(m):
        out = m(idx, labels=labels)
        return out.logits, out.loss

    return call


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_tiny_gpt_matches_eager(k, dynamic):
    idx, targets = make_gpt_batch(CFG, 8)
    dyn = (idx, targets) if dynamic else ()
    assert_matches_eager(
        TinyGPT(CFG), tiny_call(idx, targets), {"num_subbatches": k, "lowering": "aot_eager"}, dynamic_inputs=dyn
    )
    report = _last_report()
    assert report.fallback_reason is None
    assert len(report.blocks) == CFG.n_layers


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
@pytest.mark.parametrize("k", [1, 2, 4])
def test_hf_gpt2_matches_eager(k, dynamic):
    idx, labels = make_gpt_batch(CFG, 8)
    dyn = (idx, labels) if dynamic else ()
    assert_matches_eager(
        hf_gpt2(n_layer=2), hf_call(idx, labels), {"num_subbatches": k, "lowering": "aot_eager"}, dynamic_inputs=dyn
    )
    report = _last_report()
    assert report.fallback_reason is None
    assert report.blocks == ("transformer.h.0", "transformer.h.1")


def test_loss_is_mean_over_real_labels_of_whole_batch():
    # Sub-batch 0 keeps every label, sub-batch 1 keeps one: a mean of per-sub-batch
    # means would weight that one label as much as all the others.
    idx, targets = make_gpt_batch(CFG, 4, ignore_fraction=0.0)
    targets[2:, 1:] = -100
    assert_matches_eager(TinyGPT(CFG), tiny_call(idx, targets), {"num_subbatches": 2, "lowering": "aot_eager"})
    assert _last_report().fallback_reason is None


def test_optimizer_state_after_steps_matches_eager():
    import copy

    idx, targets = make_gpt_batch(CFG, 8)
    eager = TinyGPT(CFG)
    compiled_model = copy.deepcopy(eager)
    compiled = torch.compile(
        compiled_model, backend="speedloader", options={"num_subbatches": 4, "lowering": "aot_eager"}
    )
    # SGD with momentum, not Adam: the key bias of attention has a gradient that is
    # exactly zero in theory (softmax ignores a shift), and Adam would turn its
    # rounding noise into full-size steps in either run.
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt_compiled = torch.optim.SGD(compiled_model.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for model, opt in ((eager, opt_eager), (compiled, opt_compiled)):
            opt.zero_grad()
            _, loss = model(idx, targets)
            loss.backward()
            opt.step()
    for (name, p), (_, q) in zip(eager.named_parameters(), compiled_model.named_parameters()):
        torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-5, msg=name)
        momentum_p = opt_eager.state[p]["momentum_buffer"]
        momentum_q = opt_compiled.state[q]["momentum_buffer"]
        torch.testing.assert_close(momentum_q, momentum_p, atol=1e-5, rtol=1e-5, msg=name)


def test_eval_mode_dropout_matches_eager():
    cfg = GPTConfig(n_layers=2, dropout=0.3)
    model = TinyGPT(cfg).eval()
    idx, targets = make_gpt_batch(cfg, 4)
    assert_matches_eager(model, tiny_call(idx, targets), {"num_subbatches": 2, "lowering": "aot_eager"})


def test_inference_no_grad_matches_eager():
    model = TinyGPT(CFG)
    idx, _ = make_gpt_batch(CFG, 4)
    with torch.no_grad():
        expected, _ = model(idx)
        compiled = torch.compile(model, backend="speedloader", options={"num_subbatches": 4, "lowering": "aot_eager"})
        logits, _ = compiled(idx)
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    report = _last_report()
    assert report.fallback_reason is None
    assert "inference" in report.graph_order


def test_dynamic_batch_not_divisible_at_run_time_falls_back_exactly(caplog):
    model = TinyGPT(CFG)
    # K=2: the check does not depend on K, and a dynamic compile's time grows with it.
    compiled = torch.compile(model, backend="speedloader", options={"num_subbatches": 2, "lowering": "aot_eager"})
    idx, targets = make_gpt_batch(CFG, 8)
    torch._dynamo.mark_dynamic(idx, 0)
    torch._dynamo.mark_dynamic(targets, 0)
    compiled(idx, targets)
    odd_idx, odd_targets = make_gpt_batch(CFG, 5, seed=1)
    with caplog.at_level("WARNING", logger="slcompile"):
        logits, loss = compiled(odd_idx, odd_targets)
    expected_logits, expected_loss = model(odd_idx, odd_targets)
    torch.testing.assert_close(logits, expected_logits, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(loss, expected_loss, atol=1e-5, rtol=1e-5)
    assert "not divisible by num_subbatches=2" in caplog.text


def _last_report():
    import slcompile

    reports = slcompile.compile_reports()
    assert reports, "the backend compiled nothing"
    return reports[-1]
