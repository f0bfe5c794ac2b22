"""The optimizer's share of a step's memory: predicted against what the CPU allocator
did over forward, backward and `opt.step()`, printed by `explain`, held to the budget."""


import pytest
import torch

import slcompile
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.memory import measured_peak_bytes, predict_memory
from slcompile.analysis.optimizer_memory import optimizer_memory
from slcompile.runtime.storage.nvme import buffers_seen_by_profiler
from slcompile.runtime.storage.tiers import PAGE_BYTES
from slcompile.runtime.weights import drain_prefetches
from slcompile.units import format_bytes

# A large vocabulary: the resident embedding and head (1 MiB) outweigh the blocks,
# so the step of the resident parameters is the largest phase of the step.
CFG = GPTConfig(n_layers=2, d_model=64, vocab_size=2048, seq_len=8)
NVME = {"lowering": "aot_eager", "weights": "nvme", "num_subbatches": 1, "live_blocks": 1}
OPTIMIZERS = [
    (torch.optim.AdamW, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
]
IDS = ["adamw", "sgd_momentum"]


@pytest.mark.parametrize("foreach", [False, True], ids=["for_loop", "foreach"])
@pytest.mark.parametrize("optimizer_class, options", [
    *OPTIMIZERS,
    (torch.optim.AdamW, {"lr": 1e-2, "amsgrad": True}),
    (torch.optim.Adam, {"lr": 1e-2, "weight_decay": 0.1}),
    (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9, "nesterov": True, "weight_decay": 0.1}),
    (torch.optim.Adagrad, {"lr": 0.1}),
], ids=[*IDS, "adamw_amsgrad", "adam_l2", "sgd_nesterov", "adagrad"])
def test_state_and_step_temporaries_cover_what_torch_allocates(optimizer_class, options, foreach):
    params = [torch.nn.Parameter(torch.randn(n)) for n in (4000, 1000, 3000)]
    for param in params:
        param.grad = torch.randn_like(param)
    opt = optimizer_class(params, foreach=foreach, **options)
    opt.step()  # makes the state
    measured = measured_peak_bytes(opt.step)
    predicted = optimizer_memory(optimizer_class, {"foreach": foreach, **options}, [params])
    state = sum(v.numel() * v.element_size() for s in opt.state.values() for v in s.values() if torch.is_tensor(v))
    assert predicted.device_state_bytes == state
    # Conservative, and close: a few scalars' bytes; a class without a model of its
    # own gets the most any of torch's optimizers takes.
    assert measured <= predicted.device_step_bytes, (measured, predicted.device_step_bytes)
    slack = 3 if optimizer_class is torch.optim.Adagrad else 1.05
    assert predicted.device_step_bytes <= slack * measured + 64, (measured, predicted.device_step_bytes)


def _measured_step(cfg, optimizer_class, options, states, gradients, compile_options=None):
    """(the CompileReport, peak bytes of forward + backward + opt.step() + zero_grad
    as the allocator saw them from the step's start, in steady state)."""
    model = TinyGPT(cfg)
    opt = slcompile.offload_optimizer(model, optimizer_class, states=states, gradients=gradients, **options)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, **(compile_options or {})})
    idx, targets = make_gpt_batch(cfg, 2)

    def step():
        logits, loss = compiled(idx, targets)  # the caller holds the outputs, as usual
        loss.backward()
        opt.step()
        opt.zero_grad()

    with buffers_seen_by_profiler():  # the weights' loads are counted with every other tensor
        for _ in range(2):  # compiles, then makes the optimizer state
            step()
        drain_prefetches()
        measured = min(measured_peak_bytes(step) for _ in range(2))
    opt.close()
    return slcompile.compile_reports()[-1], measured


@pytest.mark.parametrize("states", ["host", "nvme"])
@pytest.mark.parametrize("optimizer_class, options", OPTIMIZERS, ids=IDS)
def test_predicted_peak_of_the_whole_step_within_five_percent(optimizer_class, options, states):
    # Gradients to nvme: a copy of one sent to "host" (this machine's own memory) is
    # last dropped by the host step's thread whenever that step ends after the
    # store's wait, and the profiler sees only this thread's frees (the next test
    # measures those copies where the backward is the peak).
    report, measured = _measured_step(CFG, optimizer_class, options, states, "nvme")
    memory = report.memory
    assert memory.optimizer is not None and memory.optimizer.name == optimizer_class.__name__
    assert memory.optimizer.states_tier == states and (memory.optimizer.nvme_state_bytes > 0) == (states == "nvme")
    graphs = report.graphs["forward"], report.graphs["backward"]
    # In `buffers_seen_by_profiler` each loaded buffer carries one page of slack.
    pages = {"live_blocks": 1, "machine": MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES)}
    predicted = predict_memory(*graphs, optimizer=memory.optimizer, **pages).step_peak_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    if optimizer_class is torch.optim.AdamW:
        # The step of the resident parameters is the peak: without it the model misses.
        without = predict_memory(*graphs, **pages).step_peak_bytes
        assert without < 0.8 * measured, (without, measured)


def test_gradient_copies_to_the_host_tier_are_predicted_with_recompute_none():
    """Weight-heavy blocks, gradients to "host" on a CPU-only machine: the store
    copies each gradient, and the copy lives until the store's wait, beside the
    graph's own buffer (one block's gradients more than the graph alone holds)."""
    cfg = GPTConfig(n_layers=4, d_model=64, vocab_size=64, seq_len=8)
    report, measured = _measured_step(cfg, torch.optim.SGD, {"lr": 0.1}, "host", "host", {"recompute": "none"})
    assert report.memory.gradient_copy_bytes > 0  # the prediction the compile made has them
    graphs = report.graphs["forward"], report.graphs["backward"]
    # The host tier is the device's memory here: a gradient stored there is copied first.
    machine = MachineFacts("cpu", frozenset({"device", "host"}), load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES)
    options = {"live_blocks": 1, "optimizer": report.memory.optimizer}
    predicted = predict_memory(*graphs, gradients_tier="host", machine=machine, **options).step_peak_bytes
    assert abs(predicted - measured) <= 0.05 * measured, (predicted, measured)
    assert predict_memory(*graphs, machine=machine, **options).step_peak_bytes < 0.9 * measured
    # A tier that copies (a GPU's host memory) needs no copy on the device first.
    copying = MachineFacts(load_granularity=PAGE_BYTES, load_overhead=PAGE_BYTES)
    assert predict_memory(*graphs, gradients_tier="host", machine=copying, **options).gradient_copy_bytes == 0


def _explain(optimizer=None, **options):
    idx, targets = make_gpt_batch(CFG, 2)
    torch.manual_seed(0)
    return slcompile.explain(TinyGPT(CFG), idx, targets, optimizer=optimizer, **NVME, **options).graphs[0]


def test_explain_prints_the_optimizer_share_per_tier():
    plain = _explain()
    assert plain.memory.optimizer is None and "optimizer" not in str(plain)
    options = {"lr": 1e-2, "weight_decay": 0.1, "states": "nvme", "gradients": "nvme"}
    given = _explain(torch.optim.AdamW, optimizer_options=options)
    memory = given.memory
    opt = memory.optimizer
    text = str(given)
    assert (f"optimizer AdamW, device: resident states {format_bytes(opt.device_state_bytes)}, step phase "
            f"{format_bytes(memory.optimizer_step_bytes)} (gradients {format_bytes(memory.optimizer_gradient_bytes)}, "
            f"step temporaries {format_bytes(opt.device_step_bytes)})") in text
    assert f"nvme: states {format_bytes(opt.nvme_state_bytes)}" in text
    assert "host memory is the device's on this machine" in text
    # fp32 AdamW: two states per resident weight (and a step count each).
    resident = memory.optimizer_gradient_bytes
    assert resident < opt.device_state_bytes < 2 * resident + 64 * 8
    # The device's peak holds the resident states on top of the largest phase.
    assert memory.peak_bytes["device"] == memory.held_bytes + opt.device_state_bytes + memory.step_peak_bytes
    assert memory.step_peak_bytes == memory.optimizer_step_bytes > plain.memory.step_peak_bytes
    # The same optimizer attached to the model is found without being named.
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    attached = slcompile.offload_optimizer(model, torch.optim.AdamW, **options)
    idx, targets = make_gpt_batch(CFG, 2)
    found = slcompile.explain(model, idx, targets, **NVME).graphs[0].memory
    assert found.optimizer == opt and found.peak_bytes == memory.peak_bytes
    assert slcompile.explain(model, idx, targets, optimizer=attached, **NVME).graphs[0].memory.optimizer == opt
    attached.close()
    with pytest.raises(TypeError, match="optimizer must be a torch.optim.Optimizer class"):
        _explain(torch.optim.AdamW([torch.zeros(1, requires_grad=True)]))
    with pytest.raises(ValueError, match=r"optimizer_options\['states'\] must be one of"):
        _explain(torch.optim.AdamW, optimizer_options={"states": "disk"})
    with pytest.raises(ValueError, match="optimizer_options do not suit SGD"):
        _explain(torch.optim.SGD, optimizer_options={"betas": (0.9, 0.99)})


def test_budget_that_fits_forward_and_backward_but_not_the_step_is_refused():
    plain = _explain().memory
    stepped = _explain(torch.optim.AdamW, optimizer_options={"lr": 1e-2}).memory
    budget = (plain.peak_bytes["device"] + stepped.peak_bytes["device"]) // 2
    assert _explain(memory_budget=budget).budget_error is None
    refused = _explain(torch.optim.AdamW, optimizer_options={"lr": 1e-2}, memory_budget=budget)
    assert refused.memory is None
    assert f"needs at least {stepped.peak_bytes['device']} bytes" in refused.budget_error
    assert f"over memory_budget={budget}" in refused.budget_error
    # Compiling with the optimizer attached refuses the same budget.
    model = TinyGPT(CFG)
    opt = slcompile.offload_optimizer(model, torch.optim.AdamW, lr=1e-2)
    idx, targets = make_gpt_batch(CFG, 2)
    compiled = torch.compile(model, backend="speedloader", options={**NVME, "memory_budget": budget})
    with pytest.raises(Exception, match=f"over memory_budget={budget}") as caught:
        compiled(idx, targets)
    error = caught.value.__cause__ or getattr(caught.value, "inner_exception", None)
    assert isinstance(error, slcompile.BudgetError) and error.smallest == stepped.peak_bytes["device"]
    opt.close()


def test_tune_replans_when_the_step_does_not_fit():
    # Activations dominate: more sub-batches make room for the optimizer's state.
    cfg = GPTConfig(n_layers=2, d_model=64, vocab_size=64, seq_len=32)
    idx, targets = make_gpt_batch(cfg, 8)
    model = TinyGPT(cfg)
    fixed = {"lowering": "aot_eager", "weights": "nvme", "live_blocks": [1]}
    alone = slcompile.tune(model, idx, targets, memory_budget="64MB", **fixed)
    assert alone.options["num_subbatches"] == 1
    budget = alone.memory.peak_bytes["device"] + 1
    first = slcompile.tune(model, idx, targets, memory_budget=budget, **fixed)
    assert first.options["num_subbatches"] == 1 and first.memory.optimizer is None
    options = {"lr": 1e-2, "amsgrad": True}
    chosen = slcompile.tune(model, idx, targets, memory_budget=budget, optimizer=torch.optim.AdamW,
                            optimizer_options=options, **fixed)
    assert chosen.memory.optimizer is not None
    assert chosen.memory.peak_bytes["device"] <= budget
    # The plan without the optimizer no longer fits: more sub-batches or recomputation.
    assert (chosen.options["num_subbatches"], chosen.memory.recompute) != (1, "none")
