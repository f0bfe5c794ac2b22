"""With Inductor, each (block, sub-batch) region is a call of a subgraph, one per
distinct region (`slcompile.passes.outline_regions`), and the step is one Inductor
program: the subgraphs lowered do not grow with depth or K, the step computes what
eager does, nothing of it runs op by op outside compiled code, and its compute
regions reach the timeline."""

import collections

import pytest
import torch

import slcompile
from slcompile.runtime.stats import reset_runtime_stats, timeline
from slcompile.step_profile import profile_step
from slcompile.vocabulary import MARK
from conftest import assert_matches_eager, check_layer_major
from models import GPTConfig, TinyGPT, make_gpt_batch

_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


def _lowered_subgraphs(monkeypatch) -> collections.Counter:
    """Counts the subgraphs Inductor lowers, by module, as the step compiles."""
    from torch._inductor.graph import GraphLowering

    lowered = collections.Counter()
    make_subgraph = GraphLowering.make_subgraph

    def counting(self, gm, example_inputs, subgraph_name):
        lowered[id(gm)] += 1
        return make_subgraph(self, gm, example_inputs, subgraph_name)

    monkeypatch.setattr(GraphLowering, "make_subgraph", counting)
    return lowered


@pytest.mark.slow
def test_each_distinct_region_lowers_once_whatever_the_depth_and_k(monkeypatch):
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config

    counts = {}
    # A cached graph is not lowered again.
    caches_off = (inductor_config.patch(fx_graph_cache=False), functorch_config.patch(enable_autograd_cache=False))
    for n_layers, k in ((2, 2), (4, 2), (2, 4)):
        torch._dynamo.reset()
        lowered = _lowered_subgraphs(monkeypatch)
        cfg = GPTConfig(n_layers=n_layers)
        idx, targets = make_gpt_batch(cfg, 8)
        torch.manual_seed(0)
        with caches_off[0], caches_off[1]:
            assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), {"num_subbatches": k, "lowering": "inductor"})
        report = slcompile.compile_reports()[-1]
        assert set(report.regions) == {"forward", "backward"}
        # One lowering per distinct subgraph of each graph, whatever calls it.
        assert sum(lowered.values()) == sum(done.subgraphs for done in report.regions.values())
        assert set(lowered.values()) == {1}
        # Each forward block copy is a call of its own.
        assert report.regions["forward"].regions == n_layers * k
        counts[n_layers, k] = {kind: done.subgraphs for kind, done in report.regions.items()}
    # Deeper: the same subgraphs. More sub-batches: no more.
    assert counts[2, 2] == counts[4, 2]
    assert sum(counts[2, 4].values()) <= sum(counts[2, 2].values())


def _recording_compile_fx_inner(monkeypatch, refuse_outlined=False):
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._inductor import compile_fx

    lowered = []

    def compile_whole(graph, inputs, **kwargs):
        if refuse_outlined and any(node.target is _INVOKE_SUBGRAPH for node in graph.graph.nodes):
            raise RuntimeError("no kernel for this subgraph")
        lowered.append(graph)
        return boxed_nop(graph, inputs)

    monkeypatch.setattr(compile_fx, "compile_fx_inner", compile_whole)
    return lowered


def test_compile_regions_false_lowers_the_step_flat(monkeypatch):
    lowered = _recording_compile_fx_inner(monkeypatch)
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 4)
    assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets),
                         {"num_subbatches": 2, "lowering": "inductor", "compile_regions": False})
    assert len(lowered) == 2 and slcompile.compile_reports()[-1].regions == {}
    # No subgraph, and no region markers in a graph Inductor lowers flat (it fuses across them).
    assert not any(node.target in (MARK, _INVOKE_SUBGRAPH) for graph in lowered for node in graph.graph.nodes)
    with pytest.raises(slcompile.OptionError, match="compile_regions"):
        slcompile.options(compile_regions="yes")


def test_inductor_failing_on_the_outlined_regions_lowers_the_step_flat(monkeypatch, caplog):
    lowered = _recording_compile_fx_inner(monkeypatch, refuse_outlined=True)
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 4)
    with caplog.at_level("WARNING", logger="slcompile.backends.lowering"):
        assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets), {"num_subbatches": 2, "lowering": "inductor"})
    assert len(lowered) == 2 and slcompile.compile_reports()[-1].regions == {}
    assert not any(node.target is MARK for graph in lowered for node in graph.graph.nodes)
    assert "outlined regions (RuntimeError: no kernel for this subgraph); compiling it flat" in caplog.text


@pytest.mark.slow
def test_inductor_regions_match_eager_and_reach_the_timeline():
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 8)
    reset_runtime_stats()
    compiled = assert_matches_eager(TinyGPT(cfg), lambda m: m(idx, targets),
                                    {"num_subbatches": 2, "lowering": "inductor"})
    report = slcompile.compile_reports()[-1]
    check_layer_major(report, 2)
    assert report.regions["forward"].subgraphs < report.regions["forward"].regions
    labels = {event.label for event in timeline() if event.lane == "compute"}
    assert {f"blk{b}.sb{s} {phase}" for b in range(2) for s in range(2) for phase in ("fwd", "bwd")} <= labels
    # A second step reuses the compiled graphs.
    before = len(slcompile.compile_reports())
    compiled(idx, targets)[1].backward()
    assert len(slcompile.compile_reports()) == before


@pytest.mark.slow
def test_nothing_of_the_step_runs_eagerly(tmp_path):
    """Embeddings, head, loss and the glue between regions run inside the compiled
    programs: outside them and the transfer ops the step dispatches no prims op and
    no operator that plain Inductor's step does not dispatch as well."""
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 8)
    torch.manual_seed(0)
    model = TinyGPT(cfg)
    options = {"num_subbatches": 4, "lowering": "inductor", "weights": "nvme", "activations": "nvme",
               "min_offload_bytes": 0, "offload_dir": str(tmp_path), "on_refusal": "raise"}
    dispatched = {}
    for name, compiled in (("plain", torch.compile(model)),
                           ("speedloader", torch.compile(model, backend="speedloader", options=options))):
        def step():
            compiled(idx, targets)[1].backward()
            model.zero_grad(set_to_none=True)

        step()
        dispatched[name] = profile_step(step)
        torch._dynamo.reset()
    ours, plain = dispatched["speedloader"], dispatched["plain"]
    assert ours.compiled_calls == plain.compiled_calls == 2
    assert ours.eager_count("prims") == 0
    # A block's weight issues run as one call (`coalesce_transfers`); a unit's stashes
    # and loads too where it saves more than one tensor.
    assert set(ours.slc_host_us) >= {"slc::fetch_issue_many", "slc::fetch_weight"}
    assert set(ours.slc_host_us) & {"slc::stash", "slc::stash_many"}
    assert set(ours.slc_host_us) & {"slc::unstash_wait", "slc::unstash_wait_many"}
    assert {name: n for name, n in ours.eager.items() if n > plain.eager.get(name, 0)} == {}


def test_launches_are_counted_by_their_cuda_api_calls():
    # What a profile with CUDA activity holds beside the operators (names as the
    # profiler gives them); a launch is not an eager operator.
    from types import SimpleNamespace

    from slcompile.step_profile import classify_events

    names = ["cudaLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernelEx", "cudaGraphLaunch", "aten::mm",
             "cudaMemcpyAsync"]
    ops = classify_events([SimpleNamespace(name=name, cpu_parent=None, cpu_time_total=1.0) for name in names])
    assert ops.launches == {"cudaLaunchKernel": 1, "cuLaunchKernelEx": 2, "cudaGraphLaunch": 1}
    assert ops.eager == {"aten::mm": 1}
