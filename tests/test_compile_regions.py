"""With Inductor, each distinct (block, sub-batch) region compiles once
(`slcompile.backends.outline`): the count of compiles does not grow with depth or K,
the step computes what eager does, and its compute regions reach the timeline."""

import collections

import pytest
import torch

import slcompile
from slcompile.backends import lowering
from slcompile.runtime.stats import reset_runtime_stats, timeline
from slcompile.vocabulary import MARK
from conftest import assert_matches_eager, check_layer_major
from models import GPTConfig, TinyGPT, make_gpt_batch


class _EagerRegions:
    """Stands in for Inductor's compile of one region: runs it eagerly, counting
    the compiles and the calls of each."""

    def __init__(self):
        self.compiled = collections.Counter()
        self.calls = collections.Counter()

    def __call__(self, module, inputs, kind):
        index = len(self.compiled)
        self.compiled[kind] += 1

        def run(args):
            self.calls[index] += 1
            return module(*args)

        return run


def _compile_counting(monkeypatch, n_layers, k):
    counter = _EagerRegions()
    monkeypatch.setattr(lowering, "_compile_region", counter)
    cfg = GPTConfig(n_layers=n_layers)
    idx, targets = make_gpt_batch(cfg, 8)
    torch.manual_seed(0)
    assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), {"num_subbatches": k, "lowering": "inductor"})
    report = slcompile.compile_reports()[-1]
    return counter, report


@pytest.mark.slow
def test_each_distinct_region_compiles_once_whatever_the_depth_and_k(monkeypatch):
    counts = {}
    for n_layers, k in ((2, 2), (4, 2), (2, 4)):
        counter, report = _compile_counting(monkeypatch, n_layers, k)
        assert set(report.regions) == {"forward", "backward"}
        for kind, done in report.regions.items():
            assert done.compiled == counter.compiled[kind]
        assert sum(counter.calls.values()) == sum(done.regions for done in report.regions.values())
        counts[n_layers, k] = {kind: done.compiled for kind, done in report.regions.items()}
        # Each forward block copy is a region of its own.
        assert report.regions["forward"].regions == n_layers * k
    # Deeper: the same regions. More sub-batches: no more compiles (the blocks'
    # regions are shared; the parts outside the blocks run eagerly).
    assert counts[2, 2] == counts[4, 2]
    assert sum(counts[2, 4].values()) <= sum(counts[2, 2].values())


def test_compile_regions_false_hands_the_whole_step_to_inductor(monkeypatch):
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor import compile_fx

    counter = _EagerRegions()
    monkeypatch.setattr(lowering, "_compile_region", counter)
    whole = []

    def compile_whole(graph, inputs, **kwargs):
        whole.append(graph)
        return boxed_nop(graph, inputs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", compile_whole)
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 4)
    assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets),
                         {"num_subbatches": 2, "lowering": "inductor", "compile_regions": False})
    assert not counter.compiled and len(whole) == 2 and slcompile.compile_reports()[-1].regions == {}
    # No region markers in a graph Inductor compiles whole (it fuses across them).
    assert not any(node.target is MARK for graph in whole for node in graph.graph.nodes)
    with pytest.raises(slcompile.OptionError, match="compile_regions"):
        slcompile.options(compile_regions="yes")


def test_a_region_that_fails_to_compile_leaves_the_graph_whole(monkeypatch, caplog):
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor import compile_fx

    def broken(module, inputs, kind):
        raise RuntimeError("no kernel for this region")

    whole = []
    monkeypatch.setattr(lowering, "_compile_region", broken)
    monkeypatch.setattr(compile_fx, "compile_fx_inner",
                        lambda graph, inputs, **kwargs: whole.append(graph) or boxed_nop(graph, inputs))
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 4)
    with caplog.at_level("WARNING", logger="slcompile.backends.lowering"):
        assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), {"num_subbatches": 2, "lowering": "inductor"})
    assert len(whole) == 2 and slcompile.compile_reports()[-1].regions == {}
    assert not any(node.target is MARK for graph in whole for node in graph.graph.nodes)
    assert "region by region failed (RuntimeError: no kernel for this region)" in caplog.text


@pytest.mark.slow
def test_inductor_regions_match_eager_and_reach_the_timeline():
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 8)
    reset_runtime_stats()
    compiled = assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets),
                                    {"num_subbatches": 2, "lowering": "inductor"})
    report = slcompile.compile_reports()[-1]
    check_layer_major(report, 2)
    assert report.regions["forward"].compiled < report.regions["forward"].regions
    labels = {event.label for event in timeline() if event.lane == "compute"}
    assert {f"blk{b}.sb{s} {phase}" for b in range(2) for s in range(2) for phase in ("fwd", "bwd")} <= labels
    # A second step reuses the compiled regions.
    before = len(slcompile.compile_reports())
    compiled(idx, targets)[1].backward()
    assert len(slcompile.compile_reports()) == before


def test_glue_views_take_the_layout_a_compiled_region_returns(monkeypatch, tmp_path):
    """A compiled region may return its outputs in a layout of its own (Inductor makes
    a permuted view contiguous); the eager glue of the step graph, whose views were
    traced on the partitioned graph's strides, still computes eager's step."""

    def contiguous_outputs(module, inputs, kind):
        def run(args):
            return [out.contiguous() if isinstance(out, torch.Tensor) else out for out in module(*args)]

        return run

    monkeypatch.setattr(lowering, "_compile_region", contiguous_outputs)
    cfg = GPTConfig(n_layers=2, d_model=32, seq_len=16, vocab_size=128)
    options = {"lowering": "inductor", "num_subbatches": 4, "weights": "nvme", "activations": "nvme",
               "min_offload_bytes": 0, "offload_dir": str(tmp_path), "on_refusal": "raise"}
    idx, targets = make_gpt_batch(cfg, 8)
    assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), options)
    assert slcompile.compile_reports()[-1].regions["backward"].regions > 0
