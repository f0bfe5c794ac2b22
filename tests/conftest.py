"""Shared fixtures: a clean Dynamo state per test, the eager-vs-compiled comparison
and the layer-major order check of a compiled step."""

from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(__file__))

import slcompile  # noqa: E402

# An option's default set in the environment (SLC_WEIGHTS=nvme, ...) would change what
# every test compiles; the tests that read one set it themselves.
for _option in slcompile.SpeedLoaderConfig.__dataclass_fields__:
    os.environ.pop(slcompile.defaults.environment_variable(_option), None)

# "current" is this machine as measured quietly, written beside the tests: measured
# again here it would be measured beside the other worker and refused
# (`MachineProfile.trust_problem`), and predictions would change from run to run. The
# tests of measuring set or remove it themselves.
os.environ["SLC_PROFILE"] = os.path.join(os.path.dirname(__file__), "data", "cpu-profile.json")

if os.environ.get("PYTEST_XDIST_WORKER"):
    # One intra-op thread per worker: `-n 2` on two cores runs two tests at once
    # instead of four threads fighting over them.
    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    slcompile.clear_compile_reports()
    torch.manual_seed(0)
    settings = _settings_in_environment()
    yield
    torch._dynamo.reset()
    # A setting left in the environment changes every later test of the worker and the
    # processes they start: the test that leaves it fails, not a later one.
    assert _settings_in_environment() == settings, "the test changed SLC_* variables of the process"


@pytest.fixture
def without_collections():
    """No garbage collection while the test runs: what it sees released went when its
    last use (or its last reference) went, not when a collection happened to run."""
    import gc

    gc.collect()  # what earlier tests left in cycles goes now, not during the test
    enabled = gc.isenabled()
    gc.disable()
    yield
    if enabled:
        gc.enable()


def _settings_in_environment() -> dict[str, str]:
    return {key: value for key, value in os.environ.items() if key.startswith("SLC_")}


def run_train_step(model, call, params_of=None):
    """Runs `call(model)`, backprops its loss; returns (outputs, loss, grads by name)."""
    outputs, loss = call(model)
    loss.backward()
    named = (params_of or model).named_parameters()
    grads = {name: p.grad.detach().clone() for name, p in named if p.grad is not None}
    return outputs, loss.detach(), grads


def assert_matches_eager(model, call, options=None, *, mode=None, dynamic_inputs=(), atol=1e-5, rtol=1e-5):
    """Compiles a copy of `model` with speedloader and checks outputs, loss and every
    parameter gradient against eager on the same inputs.

    Args:
        model: the model (left untouched; eager and compiled run on deep copies).
        call: `call(m) -> (outputs, loss)`.
        options: backend options.
        mode: torch.compile's mode (which it takes only without options).
        dynamic_inputs: tensors whose dim 0 is marked dynamic before compiling.
    """
    eager = copy.deepcopy(model)
    compiled_model = copy.deepcopy(model)
    out_ref, loss_ref, grads_ref = run_train_step(eager, call)
    for tensor in dynamic_inputs:
        torch._dynamo.mark_dynamic(tensor, 0)
    compiled = torch.compile(compiled_model, backend="speedloader", options=options, mode=mode)
    out, loss, grads = run_train_step(compiled, call, params_of=compiled_model)
    torch.testing.assert_close(out, out_ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(loss, loss_ref, atol=atol, rtol=rtol)
    assert grads.keys() == grads_ref.keys()
    assert len(grads) == len(list(model.parameters()))
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], atol=atol, rtol=rtol, msg=name)
    return compiled


def fetched_weights(graph) -> dict[str, int]:
    """Stored key -> bytes of every weight a compiled graph fetches (read from the graph
    itself; a weight fetched once per sub-batch counts once)."""
    from slcompile.vocabulary import WeightKey, is_fetch

    return {
        WeightKey.parse(node.args[1]).stored: node.meta["val"].numel() * node.meta["val"].element_size()
        for node in graph.graph.nodes if is_fetch(node)
    }


def fetched_weight_bytes(report) -> int:
    """Bytes of the weights a compiled step's forward and backward fetch (read from the
    graphs as planned: under Inductor a visit's fetches are one call once compiled)."""
    graphs = report.partitioned or report.graphs
    return sum(sum(fetched_weights(graphs[kind]).values()) for kind in ("forward", "backward"))


def check_layer_major(report, k):
    """Asserts that the report's forward and backward run layer-major over `k`
    sub-batches and that each block's weight gradients are complete before the
    previous block's backward starts."""
    from slcompile.analysis.order import block_order, grads_ready_before_next_block, layer_major_violations

    blocks = sorted(report.block_inputs)
    assert layer_major_violations(block_order(report.graphs["forward"]), blocks, k, "fwd") == []
    assert layer_major_violations(block_order(report.graphs["backward"]), blocks, k, "bwd") == []
    assert grads_ready_before_next_block(report.graphs["backward"], report.block_inputs, blocks) == []


def steady_step_peak_bytes(model, step) -> int:
    """The measured device peak of `step()` (a training step of `model`) once steady:
    two steps first (the prefetch plan has gone round once), then the smaller of two
    profiled steps (one can include one-time allocations of the profiler and the
    runtime). Before each, gradients are dropped and the weights gathered and
    released again, as a training loop's update does, which drops prefetched loads:
    every allocation of the step is then made inside the profiled window."""
    from slcompile.analysis.memory import measured_peak_bytes
    from slcompile.runtime.storage.nvme import buffers_seen_by_profiler

    def measured_step():
        for p in model.parameters():
            p.grad = None
        with slcompile.gathered_weights(model):
            pass
        return measured_peak_bytes(step)

    with buffers_seen_by_profiler():
        for _ in range(2):
            step()
            for p in model.parameters():
                p.grad = None
        return min(measured_step(), measured_step())
