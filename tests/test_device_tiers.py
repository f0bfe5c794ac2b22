"""A training step on the device the tests run on (``SLC_TEST_DEVICE``): model, inputs
and eager reference all live there, so on a CUDA machine every tier really copies
across the link. Each tier combination equals eager, moves exactly the bytes the
compiled graphs fetch and store, and (CUDA only) peaks where the memory model says.

These tests are the numerics half of ``python -m bench gpu --check`` (marker
``cuda_check``); on a CPU machine they run as any other test (the host tier is the
device's memory there and moves nothing)."""

from __future__ import annotations

import copy
import operator

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensor
from conftest import assert_matches_eager, fetched_weight_bytes
from devices import device_under_test, on_cuda
from models import GPTConfig, TinyGPT, make_gpt_batch

import slcompile
from slcompile.runtime import Tier, TransferKind, collect_garbage, reset_runtime_stats, runtime_stats
from slcompile.runtime.storage.engine import get_engine
from slcompile.vocabulary import FETCH_WEIGHT_MANY, is_slc_op

pytestmark = pytest.mark.cuda_check

CFG = GPTConfig(n_layers=2)


def _moved(kind: TransferKind, destination: Tier) -> int:
    """Bytes of `kind` that arrived at `destination` (from any tier) since the reset."""
    return sum(n for (k, _, dst), n in runtime_stats().bytes_moved.items() if k is kind and dst is destination)


def _copies(tier: str) -> bool:
    """Whether a tensor resting on `tier` crosses a link: the host tier is the device's
    own memory on a CPU machine."""
    return tier == "nvme" or (tier == "host" and on_cuda())


@pytest.mark.parametrize("weights,activations,live_blocks", [("host", "device", 1), ("host", "host", 2),
                                                             ("nvme", "nvme", 1)])
def test_every_tier_combination_equals_eager_and_moves_the_bytes_of_its_graphs(weights, activations, live_blocks):
    device = device_under_test()
    idx, targets = (t.to(device) for t in make_gpt_batch(CFG, 4))
    collect_garbage()  # what earlier tests left on a tier goes now, not during the step
    reset_runtime_stats()
    options = {"lowering": "aot_eager", "num_subbatches": 2, "weights": weights, "activations": activations,
               "live_blocks": live_blocks, "min_offload_bytes": 0}
    assert_matches_eager(TinyGPT(CFG).to(device), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    # Each block's weights are fetched once per forward and once per backward,
    # shared by both sub-batches: the fetches of the graphs, byte for byte. With a
    # prefetch window (live_blocks=2) the backward also loads the next forward's
    # first block, which may still be in flight when the step returns.
    weight_loads = _moved(TransferKind.WEIGHT, Tier.DEVICE)
    fetched = fetched_weight_bytes(report) if _copies(weights) else 0
    if live_blocks == 1:
        assert weight_loads == fetched
    else:
        assert fetched <= weight_loads <= fetched + (report.streamed_bytes if fetched else 0)
    # Every offloaded activation goes out once and comes back once.
    stored = sum(n for (k, src, _), n in runtime_stats().bytes_moved.items()
                 if k is TransferKind.ACTIVATION and src is Tier.DEVICE)
    loaded = _moved(TransferKind.ACTIVATION, Tier.DEVICE)
    expected = int(report.offloaded_activations.bytes) if _copies(activations) else 0
    assert (stored, loaded) == (expected, expected)


@pytest.mark.slow
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_strided_saved_activations_and_packed_weights_come_back_where_inductor_code_expects_them(
        tier, tmp_path, monkeypatch):
    """Under Inductor, what attention saves for its backward may be strided (the
    output of cuDNN attention: (B, S, H, D) memory seen as (B, H, S, D)) or a view at
    an offset into a fused projection. Stored on a tier and loaded back, each must
    reach the compiled backward with the layout its code was compiled for. A block
    visit's weights on a host tier that copies come packed (one `fetch_weight_many`,
    each weight a view of one tensor per dtype), and read as such. On a CPU machine
    this test's engine keeps a host tier of its own (`SLC_SEPARATE_HOST`), as a GPU's."""
    get_engine()  # the process-wide engine, as the environment made it: not this test's
    monkeypatch.setenv("SLC_SEPARATE_HOST", "1")
    device = device_under_test()
    idx, targets = (t.to(device) for t in make_gpt_batch(CFG, 4))
    options = {"lowering": "inductor", "num_subbatches": 2, "activations": tier, "weights": tier,
               "live_blocks": 1, "recompute": "none", "min_offload_bytes": 0, "offload_dir": str(tmp_path),
               "on_refusal": "raise"}
    reset_runtime_stats()
    assert_matches_eager(TinyGPT(CFG).to(device), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    assert [node for node in report.graphs["forward"].graph.nodes if node.target is torch.ops.slc.stash_many.default]
    visits = {kind: [node for node in report.graphs[kind].graph.nodes if node.target is FETCH_WEIGHT_MANY]
              for kind in ("forward", "backward")}
    assert [len(visits["forward"]), len(visits["backward"])] == ([CFG.n_layers] * 2 if tier == "host" else [0, 0])
    # Every traced value of data is fake (the packed visits' too): a real one would be
    # memory (on a GPU, device memory) that the compiled graph holds while it lives.
    for kind in ("forward", "backward"):
        for node in report.graphs[kind].graph.nodes:
            values = torch.utils._pytree.tree_leaves(node.meta.get("val"))
            real = [v for v in values if isinstance(v, torch.Tensor) and v.numel() > 1
                    and not isinstance(v, FakeTensor) and not v.is_meta]
            assert not real, (kind, node, [(v.shape, v.dtype) for v in real])
    # Each block fetched once a forward and once a backward, byte for byte.
    assert _moved(TransferKind.WEIGHT, Tier.DEVICE) == fetched_weight_bytes(report) > 0
    # No transfer's token reaches a kernel (a CPU tensor there would cut a CUDA graph):
    # tokens go from one slc:: op to another; what compute reads of a transfer is data.
    for kind in ("forward", "backward"):
        for node in report.graphs[kind].graph.nodes:
            if node.op != "call_function" or is_slc_op(node) or node.target is operator.getitem:
                continue
            for source in node.all_input_nodes:
                while source.target is operator.getitem:
                    source = source.args[0]
                if is_slc_op(source):
                    values = source.meta["val"] if isinstance(source.meta["val"], (list, tuple)) \
                        else [source.meta["val"]]
                    assert all(v.dim() > 0 or v.dtype is not torch.int64 for v in values), (kind, node, source)


@pytest.mark.skipif(not on_cuda(), reason="the CUDA caching allocator's peak (the CPU one: test_offload_activations)")
@pytest.mark.parametrize("activations,recompute", [("device", "none"), ("host", "none"), ("host", "blocks")])
def test_predicted_step_peak_within_ten_percent_of_the_cuda_allocators(activations, recompute):
    """The plan's step peak (bytes above what was allocated before the step) against
    `torch.cuda.max_memory_allocated` above the same baseline, weights on pinned host
    memory; the CUDA allocator rounds each block to 512 bytes, which the prediction is
    told about."""
    from slcompile.analysis.machine import MachineFacts
    from slcompile.analysis.memory import predict_memory

    device = device_under_test()
    cfg = GPTConfig(n_layers=4, d_model=256, seq_len=64, vocab_size=512)
    model = TinyGPT(cfg).to(device)
    idx, targets = (t.to(device) for t in make_gpt_batch(cfg, 8))
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "aot_eager", "num_subbatches": 4, "weights": "host", "activations": activations,
        "recompute": recompute, "live_blocks": 2, "min_offload_bytes": 4096})

    def step():
        for p in model.parameters():
            p.grad = None
        with slcompile.gathered_weights(model):  # where an optimizer step goes: drops prefetched loads
            pass
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
        logits, loss = compiled(idx, targets)
        loss.backward()
        torch.cuda.synchronize(device)
        return torch.cuda.max_memory_allocated(device) - before

    for _ in range(2):  # steady state: the prefetch plan has gone round once
        step()
    measured = min(step(), step())
    report = slcompile.compile_reports()[-1]
    predicted = predict_memory(report.graphs["forward"], report.graphs["backward"], live_blocks=2,
                               machine=MachineFacts(load_granularity=512)).step_peak_bytes
    assert abs(predicted - measured) <= 0.10 * measured, (predicted, measured, report.memory.step_peak_bytes)


@pytest.mark.slow
@pytest.mark.skipif(not on_cuda(), reason="CUDA graphs need CUDA (on a CPU: "
                                          "test_reduce_overhead_asks_for_cuda_graphs_and_says_why_there_are_none)")
@pytest.mark.parametrize("activations", ["device", "host"])
def test_cuda_graphs_replay_the_compute_between_transfers_and_equal_eager(activations):
    """With the cudagraphs option, Inductor partitions the step at its transfers and
    replays the rest as CUDA graphs: the first steps warm up and record, the later ones
    replay, and every one equals eager's, with the weights changing in between."""
    from torch._dynamo.utils import counters

    device = device_under_test()
    idx, targets = (t.to(device) for t in make_gpt_batch(CFG, 4))
    eager = TinyGPT(CFG).to(device)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="speedloader", options={
        "lowering": "inductor", "num_subbatches": 2, "weights": "host", "activations": activations,
        "recompute": "none", "min_offload_bytes": 0, "cudagraphs": True, "on_refusal": "raise"})
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (eager, model)]
    counters.clear()
    for step in range(4):  # warm-up, recording, replays
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        _, expected = eager(idx, targets)
        expected.backward()
        _, loss = compiled(idx, targets)
        loss.backward()
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-4, rtol=1e-4, msg=f"step {step}")
        for (name, p), q in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad.to(q.device), q.grad, atol=1e-4, rtol=1e-4, msg=f"{name}, step {step}")
        optimizers[0].step()
        with slcompile.gathered_weights(model):
            optimizers[1].step()
    assert slcompile.compile_reports()[-1].cudagraphs_skipped is None
    assert counters["inductor"]["cudagraph_partitions"] > 0
    assert counters["inductor"]["cudagraph_skips"] == 0
