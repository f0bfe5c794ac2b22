"""The same numerics under Inductor (slow: each case compiles for tens of seconds)."""

import pytest

from conftest import assert_matches_eager, check_layer_major
from models import GPTConfig, TinyGPT, hf_gpt2, make_gpt_batch

import slcompile

# Inductor's compile time grows with the graph: two blocks, the fewest that interleave.
CFG = GPTConfig(n_layers=2)
pytestmark = pytest.mark.slow


@pytest.mark.parametrize("k, dynamic", [(1, False), (2, False), (2, True)], ids=["k1", "k2", "k2-dynamic"])
def test_tiny_gpt_inductor(k, dynamic):
    idx, targets = make_gpt_batch(CFG, 8)
    dyn = (idx, targets) if dynamic else ()
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {"num_subbatches": k}, dynamic_inputs=dyn)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    if k > 1:
        check_layer_major(report, k)
        # Symbolic sizes too: the copies of a block call one subgraph, lowered once.
        outline = report.regions["forward"]
        assert outline.regions == CFG.n_layers * k and outline.subgraphs < outline.regions


@pytest.mark.parametrize("k, dynamic", [(4, False), (2, True)], ids=["k4", "k2-dynamic"])
def test_hf_gpt2_inductor(k, dynamic):
    idx, labels = make_gpt_batch(CFG, 8)
    dyn = (idx, labels) if dynamic else ()

    def call(m):
        out = m(idx, labels=labels)
        return out.logits, out.loss

    assert_matches_eager(hf_gpt2(n_layer=2), call, {"num_subbatches": k}, dynamic_inputs=dyn)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    check_layer_major(report, k)
    # Symbolic sizes too: the copies of a block call one subgraph, lowered once.
    outline = report.regions["forward"]
    assert outline.regions == 2 * k and outline.subgraphs < outline.regions


def test_cuda_graph_settings_reach_the_backward_compiled_at_its_first_call(monkeypatch):
    # On a CPU no graph is captured; what is checked is that Inductor compiles the
    # backward, which AOTAutograd lowers only when it first runs, with CUDA graphs and
    # the graph partition on, as the forward: else it captured no graph of it.
    import torch
    import torch._inductor.compile_fx
    from torch import nn
    from torch._inductor import config as inductor_config

    import slcompile.backends.speedloader as speedloader
    from models import Stack

    seen = {}
    compile_inner = torch._inductor.compile_fx.compile_fx_inner

    def recording(graph, inputs, **kwargs):
        kind = "backward" if kwargs.get("is_backward") else "forward"
        seen[kind] = (inductor_config.triton.cudagraphs, inductor_config.graph_partition)
        return compile_inner(graph, inputs, **kwargs)

    monkeypatch.setattr(torch._inductor.compile_fx, "compile_fx_inner", recording)
    monkeypatch.setattr(speedloader, "cudagraphs_apply", lambda config, inputs, report: config.cudagraphs)
    x = torch.randn(4, 8)
    assert_matches_eager(Stack(lambda w: nn.Sequential(nn.Linear(w, w), nn.ReLU()), n=2), lambda m: m(x),
                         {"num_subbatches": 2, "cudagraphs": True, "on_refusal": "raise"})
    assert seen == {"forward": (True, True), "backward": (True, True)}
