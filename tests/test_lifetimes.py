"""Predicted peak memory of compiled steps against what the CPU allocator did."""

import operator

import pytest
import sympy
import torch

import slcompile
from slcompile.analysis.lifetimes import analyze_lifetimes, analyze_training_step
from slcompile.analysis.memory import measured_peak_bytes
from models import GPTConfig, TinyGPT, make_gpt_batch

CFG = GPTConfig(d_model=128, seq_len=64)


def _compile(k, **options):
    model = TinyGPT(CFG)
    return model, torch.compile(model, backend="speedloader", options={"num_subbatches": k, "lowering": "aot_eager", **options})


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_inference_peak_is_predicted_exactly(k):
    idx, _ = make_gpt_batch(CFG, 8)
    model, compiled = _compile(k)
    with torch.no_grad():
        compiled(idx)
        report = slcompile.compile_reports()[-1]
        measured = measured_peak_bytes(lambda: compiled(idx))
    assert report.predicted_peak_bytes() == measured


def test_inference_peak_falls_with_k():
    idx, _ = make_gpt_batch(CFG, 8)
    peaks = []
    for k in (1, 2, 4):
        torch._dynamo.reset()
        _, compiled = _compile(k)
        with torch.no_grad():
            compiled(idx)
        peaks.append(slcompile.compile_reports()[-1].predicted_peak_bytes())
    assert peaks[0] > peaks[1] > peaks[2]


@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_training_step_peak_within_one_percent(k):
    idx, targets = make_gpt_batch(CFG, 8)
    model, compiled = _compile(k)
    compiled(idx, targets)[1].backward()
    report = slcompile.compile_reports()[-1]

    def step():
        for p in model.parameters():
            p.grad = None
        compiled(idx, targets)[1].backward()

    step()  # gradients of the last step freed above, not inside the measurement
    for p in model.parameters():
        p.grad = None
    def held_step():
        logits, loss = compiled(idx, targets)  # the caller holds the outputs, as usual
        loss.backward()

    measured = measured_peak_bytes(held_step)
    predicted = report.predicted_peak_bytes()
    assert abs(predicted - measured) <= 0.01 * measured, (predicted, measured)


def test_dynamic_batch_sizes_are_symbolic_and_agree_with_static():
    idx, targets = make_gpt_batch(CFG, 8)
    torch._dynamo.mark_dynamic(idx, 0)
    torch._dynamo.mark_dynamic(targets, 0)
    _, compiled = _compile(2)
    compiled(idx, targets)[1].backward()
    dynamic = slcompile.compile_reports()[-1]
    step = analyze_training_step(dynamic.graphs["forward"], dynamic.graphs["backward"])
    symbols = step.forward.symbols
    assert len(symbols) == 1
    batch = symbols[0]
    assert step.forward.peak_expression().has(batch)
    torch._dynamo.reset()
    idx2, targets2 = make_gpt_batch(CFG, 8)
    _, static_compiled = _compile(2)
    static_compiled(idx2, targets2)[1].backward()
    static = slcompile.compile_reports()[-1]
    def peak(batch_size):
        return dynamic.predicted_peak_bytes({batch: batch_size})

    assert peak(8) == static.predicted_peak_bytes()
    # Twice the batch: the activations grow, the prediction follows without compiling.
    assert peak(16) > peak(8)


def test_views_cost_nothing_and_keep_their_base():
    def f(x):
        y = x * 2  # 4 KiB
        v = y.t()  # a view: no bytes, keeps y alive
        z = x + 1  # 4 KiB, while y is still alive through v
        return (v + z).sum()

    gm = torch.fx.experimental.proxy_tensor.make_fx(f)(torch.randn(32, 32))
    table = analyze_lifetimes(gm, "inference")
    assert all(v.bytes != 0 for v in table.values)
    assert table.peak() == 3 * 32 * 32 * 4  # y, z and v + z at once
    assert isinstance(table.peak_expression(), sympy.Expr)


def test_saved_generator_states_are_saved_once_not_held_as_outputs():
    """A random op the partitioner recomputes in the backward saves its generator
    state: the forward returns it from `run_and_save_rng_state`, the backward takes
    it as `rng_state_output_0` (torch 2.13 does this for the CPU attention kernel)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    state = torch.zeros(5056, dtype=torch.uint8)  # a CPU generator's state
    x = torch.randn(32, 32)
    forward = make_fx(lambda x: (x * 2, x + 1))(x)
    graph = forward.graph
    mul, add = [n for n in graph.nodes if n.op == "call_function"]
    with graph.inserting_after(add):
        saving = graph.call_function(torch.ops.higher_order.run_and_save_rng_state, (torch.ops.aten.add.Tensor,))
        saved_state = graph.call_function(operator.getitem, (saving, 0))
        saved_state.meta["val"] = state
    output = next(n for n in graph.nodes if n.op == "output")
    output.args = ((mul, add, saved_state),)  # the user output, then the saved ones
    forward.recompile()

    backward = make_fx(lambda saved, rng_state, tangent: (tangent * saved * rng_state[0],))(x, state, x)
    # AOTAutograd's names: a saved tensor is named after its forward node.
    for placeholder, name in zip(backward.graph.find_nodes(op="placeholder"),
                                 [add.name, "rng_state_output_0", "tangents_1"]):
        placeholder._rename(name)
    backward.recompile()
    step = analyze_training_step(forward, backward)
    assert step.forward.user_output_bytes == 32 * 32 * 4  # mul alone
    # The state is the forward's buffer, not a second one in the backward.
    saved = {v.name: v.bytes for v in step.backward.values if v.kind == "saved"}
    assert saved == {add.name: 32 * 32 * 4, saved_state.name: 5056, "tangents_1": 32 * 32 * 4}
