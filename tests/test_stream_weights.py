"""Block weights on the nvme tier: exact numerics, weight traffic independent of K."""

import copy

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, hf_gpt2, make_gpt_batch
from slcompile.runtime import Tier, TransferKind, mark_step, reset_runtime_stats
from slcompile.runtime.weights import split_graph_key

CFG = GPTConfig()
NVME = {"lowering": "aot_eager", "weights": "nvme"}
LOAD = (TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)


def _fetched_bytes(graph, model):
    """Bytes of the parameters a compiled graph fetches (read from the graph itself)."""
    sizes = {}
    for node in graph.graph.nodes:
        if node.op == "call_function" and node.target is torch.ops.slc.fetch_weight.default:
            _, stored, _ = split_graph_key(node.args[1])
            sizes[stored] = node.meta["val"].numel() * node.meta["val"].element_size()
    return sum(sizes.values()), len(sizes)


@pytest.mark.parametrize("k", [1, 2, 4])
def test_tiny_gpt_weights_on_nvme_match_eager(k):
    idx, targets = make_gpt_batch(CFG, 8)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {**NVME, "num_subbatches": k})
    assert slcompile.compile_reports()[-1].fallback_reason is None


def test_hf_gpt2_weights_on_nvme_match_eager():
    idx, labels = make_gpt_batch(CFG, 8)

    def call(m):
        out = m(idx, labels=labels)
        return out.logits, out.loss

    assert_matches_eager(hf_gpt2(), call, {**NVME, "num_subbatches": 2})


def test_block_weights_leave_memory_embeddings_stay():
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    compiled(idx, targets)[1].backward()
    offloaded = dict(slcompile.offloaded_parameters(model))
    block_params = {n for n, _ in model.named_parameters() if n.startswith("layers.")}
    assert set(offloaded) == block_params
    for name, param in model.named_parameters():
        released = param.untyped_storage().nbytes() == 0
        assert released == (name in block_params), name
    assert slcompile.compile_reports()[-1].streamed_bytes == sum(
        p.numel() * p.element_size() for n, p in model.named_parameters() if n in block_params
    )


def test_weight_bytes_per_training_step_do_not_depend_on_k():
    idx, targets = make_gpt_batch(CFG, 8)
    per_step = {}
    for k in (1, 2, 4, 8):
        torch._dynamo.reset()
        model = TinyGPT(CFG)
        compiled = torch.compile(
            model, backend="speedloader", options={**NVME, "num_subbatches": k, "live_blocks": 1}
        )
        compiled(idx, targets)[1].backward()  # compiles and offloads
        report = slcompile.compile_reports()[-1]
        forward_bytes, forward_count = _fetched_bytes(report.graphs["forward"], model)
        backward_bytes, _ = _fetched_bytes(report.graphs["backward"], model)
        # Every block weight once in the forward; the backward fetches what it reads
        # (not the biases of linear layers: their gradient does not need their value).
        assert forward_bytes == report.streamed_bytes
        assert 0 < backward_bytes < forward_bytes
        assert forward_count == CFG.n_layers * 12
        mark_step()
        for _ in range(2):
            for p in model.parameters():
                p.grad = None
            compiled(idx, targets)[1].backward()
            step = mark_step()
            assert step.bytes_moved.get(LOAD, 0) == forward_bytes + backward_bytes
            assert step.bytes_moved.get((TransferKind.WEIGHT, Tier.DEVICE, Tier.NVME), 0) == 0
        per_step[k] = step.bytes_moved[LOAD]
    assert len(set(per_step.values())) == 1, per_step


def test_forward_only_loads_each_weight_once():
    model = TinyGPT(CFG)
    idx, _ = make_gpt_batch(CFG, 8)
    with torch.no_grad():
        expected, _ = copy.deepcopy(model)(idx)
        compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 4, "live_blocks": 1})
        compiled(idx)
        mark_step()
        logits, _ = compiled(idx)
        step = mark_step()
    torch.testing.assert_close(logits, expected, atol=1e-5, rtol=1e-5)
    assert step.bytes_moved[LOAD] == slcompile.compile_reports()[-1].streamed_bytes


def test_prefetch_serves_every_fetch_with_one_load():
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2, "live_blocks": 2})
    compiled(idx, targets)[1].backward()
    report = slcompile.compile_reports()[-1]
    cycle = _fetched_bytes(report.graphs["forward"], model)[0] + _fetched_bytes(report.graphs["backward"], model)[0]
    with slcompile.gathered_weights(model):  # drops what the first step prefetched
        pass
    reset_runtime_stats()
    steps = 3
    for _ in range(steps):
        compiled(idx, targets)[1].backward()
    with slcompile.gathered_weights(model):  # waits for (and drops) the last prefetch
        gathered = slcompile.runtime_stats().bytes_moved[LOAD]
    block0 = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers.0."))
    # Each fetch was served by exactly one load. Besides: the prefetch of the next
    # step's first block, issued at the end of the last backward (then dropped),
    # and the gather itself, which loads every streamed weight once.
    assert gathered == steps * cycle + block0 + report.streamed_bytes


def test_optimizer_steps_through_gathered_weights_match_eager():
    idx, targets = make_gpt_batch(CFG, 8)
    eager = TinyGPT(CFG)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 4})
    opt_eager = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for _ in range(3):
        opt_eager.zero_grad()
        eager(idx, targets)[1].backward()
        opt_eager.step()
        opt.zero_grad()
        compiled(idx, targets)[1].backward()
        with slcompile.gathered_weights(model):
            opt.step()
    with slcompile.gathered_weights(model):
        for (name, p), (_, q) in zip(eager.named_parameters(), model.named_parameters()):
            torch.testing.assert_close(q, p, atol=1e-5, rtol=1e-5, msg=name)
        state = copy.deepcopy(model.state_dict())
    assert all(t.untyped_storage().nbytes() > 0 for t in state.values())


@pytest.mark.slow
def test_weights_on_nvme_inductor_match_eager():
    idx, targets = make_gpt_batch(CFG, 8)
    assert_matches_eager(
        TinyGPT(CFG), lambda m: m(idx, targets), {"weights": "nvme", "num_subbatches": 2}
    )
