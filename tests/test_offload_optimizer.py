"""The optimizer off the device: gradients leave once per block, blocks step on the host.

Numerics against eager `torch.optim` step by step; exact bytes per step.
"""

import copy

import pytest
import torch

import slcompile
from conftest import fetched_weight_bytes
from models import GPTConfig, TinyGPT, make_gpt_batch, step_beside_eager
from slcompile.runtime import OffloadError, Tier, TransferKind, collect_garbage, mark_step, reset_runtime_stats
from slcompile.vocabulary import WAIT, is_gradient_store

CFG = GPTConfig(n_layers=2, d_model=32, vocab_size=64, seq_len=8)
NVME = {"lowering": "aot_eager", "weights": "nvme"}
GRADIENT_OUT = (TransferKind.GRADIENT, Tier.DEVICE, Tier.NVME)
WEIGHT_LOAD = (TransferKind.WEIGHT, Tier.NVME, Tier.DEVICE)
WEIGHT_STORE = (TransferKind.WEIGHT, Tier.DEVICE, Tier.NVME)


def _model():
    model = TinyGPT(CFG)
    # The key part of a fused qkv bias gets an exactly-zero gradient in exact
    # arithmetic (softmax is invariant to it), so both runs see only rounding noise
    # there, which Adam scales up to steps of size lr that differ between them. No
    # qkv bias keeps the comparison about the optimizer; every other bias stays.
    for block in model.layers:
        block.attn.qkv.register_parameter("bias", None)
    return model


def _streamed_names(model):
    return [name for name, _ in slcompile.offloaded_parameters(model)]


@pytest.mark.parametrize("states", ["host", "nvme"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize(
    "optimizer_class, options",
    [(torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}), (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9})],
    ids=["adamw", "sgd_momentum"],
)
def test_every_step_matches_eager_torch_optim(optimizer_class, options, k, states):
    eager = _model()
    model = copy.deepcopy(eager)
    eager_opt = optimizer_class(eager.parameters(), **options)
    # Gradients go where the states rest: "host" is the device's own memory here.
    opt = slcompile.offload_optimizer(model, optimizer_class, states=states, gradients=states, **options)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": k})
    reset_runtime_stats()
    for step in range(5):
        idx, targets = make_gpt_batch(CFG, 4, seed=step)
        eager_loss = eager(idx, targets)[1]
        eager_loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        loss = compiled(idx, targets)[1]
        loss.backward()
        streamed = _streamed_names(model)
        grads = {name for name, p in model.named_parameters() if p.grad is not None}
        assert streamed and not grads & set(streamed), "a streamed weight's gradient came back as .grad"
        assert grads == {name for name, _ in model.named_parameters()} - set(streamed)
        opt.step()
        opt.zero_grad()
        gradient_bytes = mark_step().total_bytes(kind=TransferKind.GRADIENT)
        assert gradient_bytes == (0 if states == "host" else 2 * slcompile.compile_reports()[-1].streamed_bytes)
        torch.testing.assert_close(loss.detach(), eager_loss.detach(), atol=1e-5, rtol=1e-5)
        with slcompile.gathered_weights(model):
            for (name, param), expected in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(param, expected, atol=1e-5, rtol=1e-5, msg=f"step {step}: {name}")
    opt.close()


@pytest.mark.parametrize("k", [1, 4])
def test_gradients_leave_once_per_step_and_weights_move_as_without_optimizer(k):
    model = _model()
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-3, states="host", gradients="nvme")
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": k, "live_blocks": 1})
    idx, targets = make_gpt_batch(CFG, 8)
    compiled(idx, targets)[1].backward()
    opt.step()
    report = slcompile.compile_reports()[-1]
    streamed_bytes = report.streamed_bytes
    # What the graphs fetch is what a step loads without the optimizer (test_stream_weights).
    loads = fetched_weight_bytes(report)

    backward = report.graphs["backward"]
    stores = [node for node in backward.graph.nodes if is_gradient_store(node)]
    assert len(stores) == len(_streamed_names(model))
    # Blocks store in backward order, and each block's stores are waited for before
    # the next block's first store: at most two blocks of gradients are alive.
    order = {node: i for i, node in enumerate(backward.graph.nodes)}
    blocks = [node.meta["slc"].block for node in stores]
    assert blocks == sorted(blocks, reverse=True)
    first_of_block0 = min(order[n] for n in stores if n.meta["slc"].block == 0)
    waits = [n for n in backward.graph.nodes if n.target is WAIT and n.args[0] in stores]
    assert len(waits) == len(stores)
    assert all(order[w] < first_of_block0 for w in waits if w.meta["slc"].block == 1)

    mark_step()
    for step in range(3):
        compiled(idx, targets)[1].backward()
        opt.step()
        opt.zero_grad()
        moved = mark_step().bytes_moved
        assert moved[GRADIENT_OUT] == streamed_bytes, step
        assert moved[WEIGHT_LOAD] == loads, step
        # The only weight stores are the updated values, each weight once: no gathering.
        assert moved[WEIGHT_STORE] == streamed_bytes, step
    opt.close()


def test_prefetched_weights_are_loaded_after_their_update():
    eager = _model()
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.5)
    opt = slcompile.offload_optimizer(model, torch.optim.SGD, lr=0.5, gradients="nvme")
    # live_blocks=3: the backward issues the next forward's loads of both blocks.
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2, "live_blocks": 3})
    idx, targets = make_gpt_batch(CFG, 8)
    compiled(idx, targets)[1].backward()
    opt.step()
    opt.zero_grad()
    eager(idx, targets)[1].backward()
    eager_opt.step()
    eager_opt.zero_grad()
    report = slcompile.compile_reports()[-1]
    cycle = fetched_weight_bytes(report)
    with slcompile.gathered_weights(model):  # waits for (and drops) the first step's prefetches
        reset_runtime_stats()
    for _ in range(3):
        loss, expected = step_beside_eager(compiled, opt, eager, eager_opt, idx, targets)
        torch.testing.assert_close(loss, expected, atol=1e-5, rtol=1e-5)
    with slcompile.gathered_weights(model):  # waits for (and drops) the last prefetches
        loaded = slcompile.runtime_stats().bytes_moved[WEIGHT_LOAD]
    # Every fetch was served by exactly one load, issued after the update of its
    # weight (no stale load thrown away and issued again); besides: the gather loads
    # every streamed weight once. The last step's prefetches of the next forward
    # (every weight the forward fetches) are dropped by the gather: held for their
    # visit's first fetch, which loads a visit's issues together, they were never issued.
    assert loaded == 3 * cycle + report.streamed_bytes
    opt.close()


def test_optimizers_that_need_every_gradient_at_once_are_refused():
    model = _model()
    with pytest.raises(ValueError, match="LBFGS"):
        slcompile.offload_optimizer(model, torch.optim.LBFGS, lr=1.0)


def test_a_closure_runs_with_grad_enabled_and_step_returns_its_loss_as_torch_optimizers_do():
    eager = _model()
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-2, gradients="nvme")
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    for step in range(2):
        idx, targets = make_gpt_batch(CFG, 4, seed=step)
        losses = []
        for net, optimizer in ((compiled, opt), (eager, eager_opt)):
            def closure(net=net, optimizer=optimizer):
                optimizer.zero_grad()
                loss = net(idx, targets)[1]
                loss.backward()
                return loss
            with torch.no_grad():  # as a training loop may call it: the closure's backward needs grad
                losses.append(optimizer.step(closure))
        torch.testing.assert_close(losses[0], losses[1])
    assert slcompile.mark_step().total_bytes(kind=TransferKind.GRADIENT) > 0  # the blocks stepped off the device
    with slcompile.gathered_weights(model):
        for (name, param), expected in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(param, expected, msg=lambda text, name=name: f"{name}: {text}")
    opt.close()


def test_gradients_sent_off_the_device_without_an_optimizer_raise():
    model = _model()
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "gradients": "nvme"})
    idx, targets = make_gpt_batch(CFG, 4)
    loss = compiled(idx, targets)[1]
    with pytest.raises(OffloadError, match="no offloaded optimizer holds"):
        loss.backward()


def _train(compiled, opt, batches):
    losses = []
    for idx, targets in batches:
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_checkpoint_resume_matches_uninterrupted_run(tmp_path):
    base = _model()
    batches = [make_gpt_batch(CFG, 8, seed=seed) for seed in range(4)]
    options = {**NVME, "num_subbatches": 2}

    def start(model):
        opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-2, states="nvme", gradients="nvme")
        return torch.compile(model, backend="speedloader", options=options), opt

    model = copy.deepcopy(base)
    compiled, opt = start(model)
    uninterrupted = _train(compiled, opt, batches)
    opt.close()
    torch._dynamo.reset()

    model = copy.deepcopy(base)
    compiled, opt = start(model)
    first = _train(compiled, opt, batches[:2])
    # The model's block weights rest in nvme files and their optimizer states too:
    # both state dicts are read from there, without gathering the model.
    torch.save({"model": model.state_dict(), "optimizer": opt.state_dict()}, tmp_path / "checkpoint.pt")
    checkpoint = torch.load(tmp_path / "checkpoint.pt")

    # Resumed in a fresh model and optimizer (another initialisation), loaded before compiling.
    torch._dynamo.reset()
    fresh = _model()
    fresh.load_state_dict(checkpoint["model"])
    fresh_compiled, fresh_opt = start(fresh)
    fresh_opt.load_state_dict(checkpoint["optimizer"])
    assert first + _train(fresh_compiled, fresh_opt, batches[2:]) == uninterrupted
    fresh_opt.close()

    # Loaded into the running model and optimizer, whose weights and states are offloaded.
    torch._dynamo.reset()
    _train(compiled, opt, batches[2:3])  # moves them away from the checkpoint
    model.load_state_dict(checkpoint["model"])
    opt.load_state_dict(checkpoint["optimizer"])
    assert first + _train(compiled, opt, batches[2:]) == uninterrupted
    opt.close()


def test_bf16_model_steps_fp32_master_weights():
    eager = _model().to(torch.bfloat16)
    model = copy.deepcopy(eager)
    masters = [p.detach().float() for p in eager.parameters()]
    eager_opt = torch.optim.AdamW(masters, lr=1e-2)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-2, states="nvme", gradients="nvme")
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 1})
    for step in range(3):
        idx, targets = make_gpt_batch(CFG, 8, seed=step)
        expected = eager(idx, targets)[1]
        expected.backward()
        for master, param in zip(masters, eager.parameters()):
            master.grad = param.grad.float()
            param.grad = None
        eager_opt.step()
        with torch.no_grad():
            for master, param in zip(masters, eager.parameters()):
                param.copy_(master)
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        # K=1 runs the same bf16 ops as eager: the results agree to rounding.
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
        state = opt.state_dict()["state"]
        for (name, param), master in zip(model.named_parameters(), masters):
            # The device copy is the master rounded to bf16; the master is fp32.
            assert state[name]["fp32_master"].dtype == torch.float32
            torch.testing.assert_close(state[name]["fp32_master"], master, atol=1e-6, rtol=1e-5, msg=name)
        with slcompile.gathered_weights(model):
            for (name, param), master in zip(model.named_parameters(), masters):
                assert param.dtype == torch.bfloat16
                torch.testing.assert_close(param, master.to(torch.bfloat16), atol=0, rtol=0, msg=name)
    opt.close()


def test_predicted_peak_counts_gradients_leaving_the_device():
    cfg = GPTConfig(n_layers=4, d_model=64, vocab_size=64, seq_len=8)
    idx, targets = make_gpt_batch(cfg, 4)
    peaks = {}
    for gradients in ("device", "nvme"):
        torch._dynamo.reset()
        model = TinyGPT(cfg)
        opt = slcompile.offload_optimizer(model, torch.optim.SGD, lr=0.1, gradients="nvme")
        options = {**NVME, "num_subbatches": 2, "gradients": gradients}
        torch.compile(model, backend="speedloader", options=options)(idx, targets)[1].backward()
        peaks[gradients] = slcompile.compile_reports()[-1].memory.step_peak_bytes
        opt.close()
    # Kept, every block's gradients are alive at the end of the backward; sent away,
    # each block's are freed once the next block's are stored.
    assert peaks["nvme"] < peaks["device"]


def test_grad_accumulation_schedule_sends_gradients_per_micro_batch_and_steps_like_eager():
    eager = _model()
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-2, gradients="nvme")
    options = {**NVME, "num_subbatches": 4, "schedule": "grad_accumulation"}
    compiled = torch.compile(model, backend="speedloader", options=options)
    reset_runtime_stats()
    for step in range(3):
        idx, targets = make_gpt_batch(CFG, 8, seed=step)
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        expected = eager(idx, targets)[1]
        expected.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        # Each micro-batch's pass through a block sends that block's gradients: K x P.
        assert mark_step().bytes_moved[GRADIENT_OUT] == 4 * slcompile.compile_reports()[-1].streamed_bytes
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    with slcompile.gathered_weights(model):
        for (name, param), expected_param in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(param, expected_param, atol=1e-5, rtol=1e-5, msg=name)
    opt.close()


def test_model_compiled_before_the_optimizer_steps_from_grad():
    eager = _model()
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 2})
    idx, targets = make_gpt_batch(CFG, 8)
    compiled(idx, targets)  # compiled and offloaded with no offloaded optimizer: gradients stay
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-2)
    for step in range(3):
        idx, targets = make_gpt_batch(CFG, 8, seed=step)
        loss = compiled(idx, targets)[1]
        loss.backward()
        assert all(p.grad is not None for _, p in slcompile.offloaded_parameters(model))
        opt.step()
        opt.zero_grad()
        expected = eager(idx, targets)[1]
        expected.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    with slcompile.gathered_weights(model):
        for (name, param), expected_param in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(param, expected_param, atol=1e-5, rtol=1e-5, msg=name)
    opt.close()


def test_full_disk_for_nvme_states_is_a_named_error_and_leaves_no_partial_state(tmp_path):
    from slcompile.runtime.storage.engine import get_engine
    from slcompile.runtime import DiskFullError

    model = _model()
    opt = slcompile.offload_optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, states="nvme")
    options = {**NVME, "num_subbatches": 2, "live_blocks": 1, "offload_dir": str(tmp_path)}
    compiled = torch.compile(model, backend="speedloader", options=options)
    idx, targets = make_gpt_batch(CFG, 4)
    compiled(idx, targets)[1].backward()
    opt.step()
    engine = get_engine(str(tmp_path))
    # Fill the arena: no room is left for the next step's states (nor its weights).
    engine.arena.space.capacity_bytes = engine.arena.space.file_bytes
    fillers = []
    for floats in (1 << 18, 1 << 14, 1 << 10):  # 1 MiB, 64 KiB, then 4 KiB (a page) at a time
        with pytest.raises(DiskFullError):
            while True:
                fillers.append(engine.store(f"filler{len(fillers)}", torch.zeros(floats), "nvme", TransferKind.WEIGHT))
    compiled(idx, targets)[1].backward()
    with pytest.raises(DiskFullError):
        opt.step()
    for number in range(len(fillers)):
        engine.free(f"filler{number}")
    # No file of a failed store was kept: at most one momentum file per weight (a block
    # whose store failed keeps its state in host memory), each one readable.
    state_keys = [key for key in engine.keys() if "momentum_buffer" in key]
    assert len(state_keys) <= len(slcompile.offloaded_parameters(model))
    for key in state_keys:
        engine.wait(engine.load(key))
    state = opt.state_dict()["state"]
    for name, param in slcompile.offloaded_parameters(model):
        assert state[name]["momentum_buffer"].shape == param.shape, name
    opt.close()


def test_nvme_states_keep_no_earlier_step_in_memory(tmp_path):
    """Each step loads a block's states, updates them and stores them under fresh keys;
    what the engine holds (its entries, transfer handles, delivered bytes) must be the
    same after 20 steps as after 3, not grow by one generation of states a step."""
    import gc

    from slcompile.runtime.storage.engine import get_engine
    from slcompile.runtime import runtime_stats
    from slcompile.runtime.storage.engine import TransferHandle, _Entry

    model = _model()
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-3, states="nvme", gradients="nvme")
    options = {**NVME, "num_subbatches": 2, "offload_dir": str(tmp_path)}
    compiled = torch.compile(model, backend="speedloader", options=options)
    idx, targets = make_gpt_batch(CFG, 4)
    engine = get_engine(str(tmp_path))

    def held():
        collect_garbage()
        objects = gc.get_objects()
        return {
            "handles": sum(1 for obj in objects if type(obj) is TransferHandle),
            "entries": sum(1 for obj in objects if type(obj) is _Entry),
            "keys": len(engine.keys()),
            "device bytes": runtime_stats().resident_bytes[Tier.DEVICE],
            "nvme bytes": runtime_stats().resident_bytes[Tier.NVME],
        }

    counts = {}
    for step in range(1, 21):
        compiled(idx, targets)[1].backward()
        opt.step()
        opt.zero_grad()
        if step in (3, 20):
            counts[step] = held()
    assert counts[20] == counts[3]
    # Two AdamW states per streamed weight rest in the file, each under one key.
    state_keys = [key for key in engine.keys() if "exp_avg" in key]
    assert len(state_keys) == 2 * len(slcompile.offloaded_parameters(model))
    opt.close()


def _bytes(state):
    """Bytes of the tensors of one parameter's optimizer state (not the step count)."""
    return sum(v.numel() * v.element_size() for v in state.values() if isinstance(v, torch.Tensor) and v.dim() > 0)


def test_model_four_times_the_budget_trains_under_it():
    from slcompile.analysis.machine import MachineFacts
    from slcompile.analysis.memory import measured_peak_bytes, predict_memory
    from slcompile.runtime.storage.nvme import buffers_seen_by_profiler
    from slcompile.runtime.storage.tiers import PAGE_BYTES
    from slcompile.runtime.weights import drain_prefetches

    cfg = GPTConfig(n_layers=8, d_model=64, vocab_size=64, seq_len=8)
    eager = TinyGPT(cfg)
    for block in eager.layers:
        block.attn.qkv.register_parameter("bias", None)  # see _model
    model = copy.deepcopy(eager)
    options = {"lr": 1e-2, "weight_decay": 0.1}
    eager_opt = torch.optim.AdamW(eager.parameters(), **options)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, states="host", gradients="nvme", **options)
    # fp32 AdamW: each parameter has its weight, its gradient and two state tensors.
    model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    budget = model_bytes  # weights + gradients + states = 4 x the budget (checked below)
    compiled = torch.compile(model, backend="speedloader", options={
        **NVME, "num_subbatches": 1, "live_blocks": 2, "recompute": "blocks", "memory_budget": budget,
    })

    def step(idx, targets, losses):
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())

    losses = []
    streamed = set()
    with buffers_seen_by_profiler():  # the weights' loads are counted with every other tensor
        for seed in range(3):
            idx, targets = make_gpt_batch(cfg, 2, seed=seed)
            expected = eager(idx, targets)[1]
            expected.backward()
            eager_opt.step()
            eager_opt.zero_grad()
            if seed == 0:  # the first call compiles
                step(idx, targets, losses)
            else:
                # The last step's prefetches were allocated before the measured window.
                drain_prefetches()
                peak = measured_peak_bytes(lambda: step(idx, targets, losses))
            # K=1 runs eager's ops: tiny gradients, which Adam scales up to steps of
            # size lr, round the same way in both runs.
            torch.testing.assert_close(losses[-1], expected.detach(), atol=1e-5, rtol=1e-5)
            if seed == 0:
                streamed = set(_streamed_names(model))
                continue
            report = slcompile.compile_reports()[-1]
            # What the device holds through the step: the resident parameters, the
            # batch and the optimizer state of the resident parameters (stepped there).
            # The optimizer's host thread works in host memory (host copies, their
            # state, the gradients it reads back); the profiler records the allocations
            # of this thread only, the device's.
            state = opt.state_dict()["state"]
            resident_states = sum(_bytes(values) for name, values in state.items() if name not in streamed)
            device_peak = report.memory.held_bytes + resident_states + peak
            assert device_peak <= budget, (device_peak, budget)
            # The prediction the budget was checked with covers the optimizer's step
            # (tests/test_optimizer_memory.py measures it closely).
            # (and AdamW's step count, a 0-dim float32 tensor per parameter)
            resident_count = sum(name not in streamed for name in state)
            assert report.memory.optimizer.device_state_bytes == resident_states + 4 * resident_count
            # In `buffers_seen_by_profiler` each loaded buffer carries one page of
            # slack (two blocks' weights here, about 8% of the peak): the measurement
            # is held to the same graphs predicted with it.
            graphs = report.graphs["forward"], report.graphs["backward"]
            predicted = predict_memory(
                *graphs, live_blocks=2, machine=MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES),
                optimizer=report.memory.optimizer,
            ).peak_bytes["device"]
            assert report.memory.peak_bytes["device"] < predicted
            assert abs(predicted - device_peak) <= 0.05 * device_peak, (predicted, device_peak)
    state_bytes = sum(_bytes(values) for values in opt.state_dict()["state"].values())
    assert 2 * model_bytes + state_bytes >= 4 * budget
    with slcompile.gathered_weights(model):
        for (name, param), expected_param in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(param, expected_param, atol=1e-5, rtol=1e-5, msg=name)
    opt.close()


def _decay_groups(model):
    """Weight decay for matrices, none for norms and biases."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return [{"params": matrices, "weight_decay": 0.1}, {"params": vectors, "weight_decay": 0.0, "lr": 2e-2}]


@pytest.mark.parametrize("scheduler", [
    lambda opt: torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5),
    lambda opt: torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step)),
    lambda opt: torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=4),
], ids=["step", "lambda", "cosine"])
def test_param_groups_and_lr_schedulers_match_eager(scheduler):
    eager = _model()
    model = copy.deepcopy(eager)
    eager_groups, groups = _decay_groups(eager), _decay_groups(model)
    # One group at construction, the other added after.
    eager_opt = torch.optim.AdamW(eager_groups[:1], lr=1e-2)
    eager_opt.add_param_group(eager_groups[1])
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, params=groups[:1], lr=1e-2, gradients="nvme")
    opt.add_param_group(groups[1])
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]
    eager_scheduler, opt_scheduler = scheduler(eager_opt), scheduler(opt)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 1})
    for step in range(4):
        idx, targets = make_gpt_batch(CFG, 4, seed=step)
        expected = eager(idx, targets)[1]
        expected.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        eager_scheduler.step()
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        opt_scheduler.step()
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
        assert [g["lr"] for g in opt.param_groups] == [g["lr"] for g in eager_opt.param_groups]
    # Both groups have streamed weights: the block steps read each group's options.
    offloaded = {id(p) for _, p in slcompile.offloaded_parameters(model)}
    assert all(any(id(p) in offloaded for p in group["params"]) for group in opt.param_groups)
    with slcompile.gathered_weights(model):
        for (name, param), expected_param in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(param, expected_param, atol=1e-5, rtol=1e-5, msg=name)
    # The groups' options travel with the state: a fresh optimizer resumes the schedule.
    fresh_model = copy.deepcopy(eager)
    fresh = slcompile.offload_optimizer(fresh_model, torch.optim.AdamW, params=_decay_groups(fresh_model), lr=1.0)
    fresh.load_state_dict(opt.state_dict())
    assert [g["lr"] for g in fresh.param_groups] == [g["lr"] for g in eager_opt.param_groups]
    fresh.close()
    opt.close()


def test_max_grad_norm_clips_like_clip_grad_norm_in_two_phases():
    eager = _model()
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.AdamW(eager.parameters(), lr=1e-2)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-2, gradients="nvme", max_grad_norm=0.5)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "num_subbatches": 1})
    for step in range(4):
        idx, targets = make_gpt_batch(CFG, 4, seed=step)
        expected = eager(idx, targets)[1]
        expected.backward()
        expected_norm = torch.nn.utils.clip_grad_norm_(eager.parameters(), 0.5)
        eager_opt.step()
        eager_opt.zero_grad()
        loss = compiled(idx, targets)[1]
        loss.backward()
        opt.step()
        opt.zero_grad()
        assert expected_norm > 0.5  # the clip is active
        torch.testing.assert_close(opt.last_grad_norm, expected_norm, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(loss.detach(), expected.detach(), atol=1e-5, rtol=1e-5)
    with slcompile.gathered_weights(model):
        for (name, param), expected_param in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(param, expected_param, atol=1e-5, rtol=1e-5, msg=name)
    opt.close()
    with pytest.raises(ValueError, match="max_grad_norm must be a positive number"):
        slcompile.offload_optimizer(model, torch.optim.AdamW, max_grad_norm=0.0)


def test_full_disk_for_updated_weights_undoes_the_block_steps(tmp_path):
    from slcompile.runtime.storage.engine import get_engine
    from slcompile.runtime import DiskFullError
    from slcompile.runtime.weights import weight_home

    eager = _model()
    model = copy.deepcopy(eager)
    eager_opt = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9)
    opt = slcompile.offload_optimizer(model, torch.optim.SGD, lr=0.1, momentum=0.9, states="host")
    options = {**NVME, "num_subbatches": 2, "live_blocks": 1, "offload_dir": str(tmp_path)}
    compiled = torch.compile(model, backend="speedloader", options=options)
    batches = [make_gpt_batch(CFG, 4, seed=seed) for seed in range(3)]

    def eager_step(idx, targets):
        loss = eager(idx, targets)[1]
        loss.backward()
        eager_opt.step()
        eager_opt.zero_grad()
        return loss.detach()

    assert _train(compiled, opt, batches[:1]) == pytest.approx([eager_step(*batches[0]).item()], rel=1e-5)
    weights_before = model.state_dict()
    state_before = opt.state_dict()["state"]
    engine = get_engine(str(tmp_path))
    # Fill the arena: no room is left for the updated weights.
    engine.arena.space.capacity_bytes = engine.arena.space.file_bytes
    fillers = []
    for floats in (1 << 18, 1 << 14, 1 << 10):  # 1 MiB, 64 KiB, then 4 KiB (a page) at a time
        with pytest.raises(DiskFullError):
            while True:
                fillers.append(engine.store(f"filler{len(fillers)}", torch.zeros(floats), "nvme", TransferKind.WEIGHT))
    compiled(*batches[1])[1].backward()
    with pytest.raises(DiskFullError):
        opt.step()
    opt.zero_grad()
    for number in range(len(fillers)):
        engine.free(f"filler{number}")
    assert not [key for key in engine.keys() if key.endswith("~update")]
    # Every weight on the tier is the previous step's, whole, and so are the host
    # copies and the optimizer state: no block kept half a step.
    for name, param in slcompile.offloaded_parameters(model):
        _, key, _ = weight_home(param)
        stored = engine.wait(engine.load(key)).view(param.shape)
        assert torch.equal(stored, weights_before[name]), name
    for name, values in model.state_dict().items():
        assert torch.equal(values, weights_before[name]), name
    state = opt.state_dict()["state"]
    for name, values in state_before.items():
        assert torch.equal(state[name]["momentum_buffer"], values["momentum_buffer"]), name
    # With room again, training goes on as if that batch had not been stepped.
    assert _train(compiled, opt, batches[2:]) == pytest.approx([eager_step(*batches[2]).item()], rel=1e-5)
    with slcompile.gathered_weights(model):
        for (name, param), expected in zip(model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(param, expected, atol=1e-6, rtol=1e-6, msg=name)
    opt.close()
