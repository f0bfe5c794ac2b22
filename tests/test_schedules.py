"""The three schedules: same results as eager, each in its own order, with the weight
traffic its order implies (grad_accumulation: K times speedloader's; no_offload: none)."""

import pytest
import torch

import slcompile
from conftest import assert_matches_eager
from models import GPTConfig, TinyGPT, hf_llama, make_gpt_batch
from slcompile.analysis.order import block_order, layer_major_violations, sample_major_violations, step_order
from slcompile.config import SCHEDULES
from slcompile.meta import get_slc_meta
from slcompile.passes.mark_regions import is_bookkeeping
from slcompile.runtime import Tier, TransferKind, mark_step, reset_runtime_stats
from slcompile.runtime.weights import split_graph_key
from slcompile.schedules import POLICIES

CFG = GPTConfig()
LOAD = (TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)
STORE = (TransferKind.WEIGHT, Tier.DEVICE, Tier.NVME)
WEIGHTS = {"speedloader": "nvme", "grad_accumulation": "nvme", "no_offload": "device"}


def _options(schedule, k, **extra):
    return {"lowering": "aot_eager", "schedule": schedule, "weights": WEIGHTS[schedule], "num_subbatches": k, **extra}


def _fetches(gm):
    return [n for n in gm.graph.nodes if n.op == "call_function" and n.target is torch.ops.slc.fetch_weight.default]


def _fetched_bytes(gm):
    """Bytes of every fetch a compiled graph makes (each fetch counted)."""
    return sum(n.meta["val"].numel() * n.meta["val"].element_size() for n in _fetches(gm))


def _block_bytes(model, position):
    prefix = f"layers.{position}."
    return sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith(prefix))


def _train_step(compiled, model, idx, targets):
    for p in model.parameters():
        p.grad = None
    compiled(idx, targets)[1].backward()


def test_every_schedule_option_has_a_policy():
    assert set(POLICIES) == set(SCHEDULES)
    assert [name for name, policy in POLICIES.items() if policy.sample_major] == ["grad_accumulation"]


@pytest.mark.parametrize("k", [1, 2, 4])
@pytest.mark.parametrize("schedule", SCHEDULES)
def test_tiny_gpt_matches_eager(schedule, k):
    idx, targets = make_gpt_batch(CFG, 8)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), _options(schedule, k))
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert report.config.schedule == schedule
    assert (report.streamed_bytes > 0) == (WEIGHTS[schedule] == "nvme")


@pytest.mark.parametrize("k", [2, 4])
def test_grad_accumulation_with_resident_weights_matches_eager(k):
    idx, targets = make_gpt_batch(CFG, 8)
    options = {**_options("grad_accumulation", k), "weights": "device"}
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)


@pytest.mark.parametrize("k", [2, 4])
def test_grad_accumulation_with_a_dynamic_batch_matches_eager_sample_major(k):
    idx, targets = make_gpt_batch(CFG, 8)
    options = _options("grad_accumulation", k)
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options, dynamic_inputs=(idx, targets))
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    blocks = sorted(report.block_inputs)
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        assert sample_major_violations(block_order(report.graphs[kind]), blocks, k, phase) == [], kind


def test_grad_accumulation_schedule_text():
    cfg = GPTConfig(n_layers=2)
    idx, targets = make_gpt_batch(cfg, 4)
    expected = """\
fwd prefix.sb0
fwd blk0.sb0
fwd blk1.sb0
fwd suffix.sb0
fwd prefix.sb1
fwd blk0.sb1
fwd blk1.sb1
fwd suffix.sb1
bwd suffix.sb1
bwd blk1.sb1
bwd blk0.sb1
bwd prefix.sb1
bwd suffix.sb0
bwd blk1.sb0
bwd blk0.sb0
bwd prefix.sb0"""
    explanation = slcompile.explain(TinyGPT(cfg), idx, targets, schedule="grad_accumulation", num_subbatches=2)
    assert explanation.schedule == expected
    model = TinyGPT(cfg)
    torch.compile(model, backend="speedloader", options=_options("grad_accumulation", 2))(idx, targets)[1].backward()
    assert slcompile.compile_reports()[-1].schedule == expected


@pytest.mark.parametrize("k", [2, 4])
@pytest.mark.parametrize("schedule", ["grad_accumulation", "speedloader"])
def test_compiled_graphs_run_in_the_schedule_order(schedule, k):
    idx, targets = make_gpt_batch(CFG, 8)
    model = TinyGPT(CFG)
    torch.compile(model, backend="speedloader", options=_options(schedule, k))(idx, targets)[1].backward()
    report = slcompile.compile_reports()[-1]
    blocks = sorted(report.block_inputs)
    violations = sample_major_violations if schedule == "grad_accumulation" else layer_major_violations
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        assert violations(block_order(report.graphs[kind]), blocks, k, phase) == [], kind
    # Every step of the text, prefix and suffix included. (Speedloader's backward
    # runs its prefix as two passes over the sub-batches, the position embedding's
    # gradient and then the token embedding's, which its text writes as one.)
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        if schedule == "grad_accumulation" or phase == "fwd":
            expected = [line.split()[-1] for line in report.schedule.splitlines() if line.startswith(phase)]
            assert list(step_order(report.graphs[kind])) == expected, kind


def test_grad_accumulation_on_llama_matches_eager_sample_major():
    idx, labels = make_gpt_batch(CFG, 4)

    def call(m):
        out = m(idx, labels=labels)
        return out.logits, out.loss

    assert_matches_eager(hf_llama(), call, _options("grad_accumulation", 2))
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        runs = list(step_order(report.graphs[kind]))
        # Sub-batch by sub-batch: the embedding included, not only the blocks.
        assert runs[:6] == (
            ["prefix.sb0", "blk0.sb0", "blk1.sb0", "blk2.sb0", "blk3.sb0", "suffix.sb0"]
            if phase == "fwd"
            else ["suffix.sb1", "blk3.sb1", "blk2.sb1", "blk1.sb1", "blk0.sb1", "prefix.sb1"]
        ), kind


def test_grad_accumulation_fetches_each_block_once_per_subbatch():
    idx, targets = make_gpt_batch(CFG, 8)
    k = 4
    model = TinyGPT(CFG)
    torch.compile(model, backend="speedloader", options=_options("grad_accumulation", k))(idx, targets)[1].backward()
    report = slcompile.compile_reports()[-1]
    for kind in ("forward", "backward"):
        seen = {}
        for node in _fetches(report.graphs[kind]):
            meta = get_slc_meta(node)
            _, stored, _ = split_graph_key(node.args[1])
            seen.setdefault(stored, []).append(meta.subbatch)
            # Read by its own sub-batch only.
            assert {get_slc_meta(user).subbatch for user in node.users} == {meta.subbatch}
        assert seen and all(sorted(subs) == list(range(k)) for subs in seen.values()), kind
        keys = [node.args[1] for node in _fetches(report.graphs[kind])]
        assert len(set(keys)) == len(keys), "fetches a CSE pass could merge"
        # A sub-batch's fetches open its run of the block, before anything computes.
        started = set()
        for node in report.graphs[kind].graph.nodes:
            meta = get_slc_meta(node) if node.op == "call_function" else None
            if meta is None or meta.region != "block" or is_bookkeeping(node):
                continue
            if node.target is torch.ops.slc.fetch_weight.default:
                assert (meta.block, meta.subbatch) not in started, (kind, node.name)
            else:
                started.add((meta.block, meta.subbatch))


def test_grad_accumulation_loads_k_times_the_weight_bytes_of_speedloader():
    idx, targets = make_gpt_batch(CFG, 8)
    per_step = {}
    for k in (1, 2, 4):
        for schedule in ("speedloader", "grad_accumulation"):
            torch._dynamo.reset()
            model = TinyGPT(CFG)
            compiled = torch.compile(
                model, backend="speedloader", options=_options(schedule, k, live_blocks=1)
            )
            _train_step(compiled, model, idx, targets)  # compiles and offloads
            report = slcompile.compile_reports()[-1]
            fetched = _fetched_bytes(report.graphs["forward"]) + _fetched_bytes(report.graphs["backward"])
            mark_step()
            _train_step(compiled, model, idx, targets)
            step = mark_step()
            # Without prefetch, every fetch is one load of its bytes, and nothing is stored.
            assert step.bytes_moved[LOAD] == fetched, (schedule, k)
            assert step.bytes_moved.get(STORE, 0) == 0
            per_step[schedule, k] = step.bytes_moved[LOAD]
    speedloader = per_step["speedloader", 1]
    for k in (1, 2, 4):
        assert per_step["speedloader", k] == speedloader
        assert per_step["grad_accumulation", k] == k * speedloader


@pytest.mark.parametrize("k, live_blocks", [(2, 2), (4, 3)])
def test_grad_accumulation_prefetch_serves_every_fetch_with_one_load(k, live_blocks):
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)
    options = _options("grad_accumulation", k, live_blocks=live_blocks)
    compiled = torch.compile(model, backend="speedloader", options=options)
    _train_step(compiled, model, idx, targets)
    report = slcompile.compile_reports()[-1]
    cycle = _fetched_bytes(report.graphs["forward"]) + _fetched_bytes(report.graphs["backward"])
    with slcompile.gathered_weights(model):  # drops what the first step prefetched
        pass
    reset_runtime_stats()
    steps = 3
    for _ in range(steps):
        _train_step(compiled, model, idx, targets)
    with slcompile.gathered_weights(model):  # waits for (and drops) the last prefetch
        gathered = slcompile.runtime_stats().bytes_moved[LOAD]
    # Each fetch was served by exactly one load. Besides: the next step's first
    # `live_blocks - 1` block visits (sub-batch 0 through blocks 0, 1, ...),
    # prefetched at the end of the last backward and dropped, and the gather itself.
    ahead = sum(_block_bytes(model, position) for position in range(live_blocks - 1))
    assert gathered == steps * cycle + ahead + report.streamed_bytes


@pytest.mark.parametrize("recompute", ["none", "blocks"])
def test_grad_accumulation_with_activations_on_nvme_matches_eager(recompute):
    idx, targets = make_gpt_batch(CFG, 8)
    options = _options("grad_accumulation", 2, activations="nvme", min_offload_bytes=0, recompute=recompute)
    reset_runtime_stats()
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    offloaded = int(report.offloaded_activations.bytes)
    assert offloaded > 0
    moved = slcompile.runtime_stats().bytes_moved
    stored = moved[TransferKind.ACTIVATION, Tier.DEVICE, Tier.NVME]
    loaded = moved[TransferKind.ACTIVATION, Tier.NVME, Tier.DEVICE]
    assert stored == loaded == offloaded


def test_no_offload_moves_no_bytes():
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 8)
    compiled = torch.compile(model, backend="speedloader", options=_options("no_offload", 4))
    _train_step(compiled, model, idx, targets)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    assert not _fetches(report.graphs["forward"]) and not _fetches(report.graphs["backward"])
    assert slcompile.offloaded_parameters(model) == []
    blocks = sorted(report.block_inputs)
    assert layer_major_violations(block_order(report.graphs["forward"]), blocks, 4, "fwd") == []
    mark_step()
    _train_step(compiled, model, idx, targets)
    step = mark_step()
    assert sum(step.bytes_moved.values()) == 0


@pytest.mark.parametrize("key", ["weights", "activations"])
@pytest.mark.parametrize("tier", ["host", "nvme"])
def test_no_offload_with_anything_off_the_device_is_refused(key, tier):
    options = {"schedule": "no_offload", key: tier}
    with pytest.raises(ValueError, match=rf"'schedule' and '{key}' conflict.*{key}='device'"):
        slcompile.SpeedLoaderConfig.from_options(options)
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled = torch.compile(model, backend="speedloader", options=options)
    conflict = f"ValueError: .*'schedule' and '{key}' conflict"
    with pytest.raises(torch._dynamo.exc.BackendCompilerFailed, match=conflict):
        compiled(idx, targets)


@pytest.mark.slow
def test_grad_accumulation_inductor_matches_eager_and_keeps_every_fetch():
    idx, targets = make_gpt_batch(CFG, 8)
    k = 2
    options = {"schedule": "grad_accumulation", "weights": "nvme", "num_subbatches": k}
    assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), options)
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None
    # 12 weights per TinyGPT block, each fetched once per sub-batch in the forward.
    assert len(_fetches(report.graphs["forward"])) == k * CFG.n_layers * 12
    blocks = sorted(report.block_inputs)
    for kind, phase in (("forward", "fwd"), ("backward", "bwd")):
        assert sample_major_violations(block_order(report.graphs[kind]), blocks, k, phase) == [], kind
