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
