"""One fallback boundary around every stage: whatever fails while a graph compiles
(a pass of any stage, AOTAutograd tracing the interleaved graph, the lowering)
compiles it plainly with one warning naming the stage and the error, raises a
CompileError with `on_refusal="raise"`, and `explain()` reports it; the errors a user
acts on (a full disk) stay errors."""

from __future__ import annotations

import copy
import dataclasses
import logging

import pytest
import torch

import slcompile
from slcompile.backends import lowering
from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

CFG = GPTConfig(n_layers=2, d_model=32, seq_len=8, vocab_size=64)
OPTIONS = {"num_subbatches": 2, "lowering": "aot_eager"}


def _train_step(model, call, params_of=None):
    loss = call(model)
    loss.backward()
    return loss.detach(), {name: p.grad.clone() for name, p in (params_of or model).named_parameters()}


def _assert_plain_equals_eager(model, call, options, caplog):
    """Compiles a copy of `model`, trains one step beside eager; returns the warnings."""
    eager, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    loss_ref, grads_ref = _train_step(eager, call)
    compiled = torch.compile(compiled_model, backend="speedloader", options=options)
    with caplog.at_level(logging.WARNING, logger="slcompile"):
        loss, grads = _train_step(compiled, call, compiled_model)
    torch.testing.assert_close(loss, loss_ref)
    assert grads.keys() == grads_ref.keys()
    for name in grads_ref:
        torch.testing.assert_close(grads[name], grads_ref[name], msg=name)
    return [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]


def _tiny_mamba():
    transformers = pytest.importorskip("transformers")
    config = transformers.MambaConfig(
        vocab_size=64, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4,
        use_mambapy=False,
    )
    torch.manual_seed(0)
    return transformers.MambaForCausalLM(config), torch.randint(0, 64, (4, 8))


MAMBA_REASON = "AOTAutograd tracing the interleaved graph failed (RuntimeError: "


def test_mamba_whose_interleaved_graph_fails_to_trace_falls_back(caplog):
    model, ids = _tiny_mamba()
    warnings = _assert_plain_equals_eager(model, lambda m: m(ids, labels=ids).loss, OPTIONS, caplog)
    ours = [w for w in warnings if w.startswith("speedloader:")]
    assert len(ours) == 1 and MAMBA_REASON in ours[0] and "vmap" in ours[0]
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason.startswith(MAMBA_REASON)
    assert report.graphs  # the plain graphs, recorded as they compiled


def test_mamba_raises_the_reason_with_on_refusal_raise_and_explain_shows_it():
    model, ids = _tiny_mamba()
    compiled = torch.compile(model, backend="speedloader", options={**OPTIONS, "on_refusal": "raise"})
    with pytest.raises(slcompile.CompileError) as info:
        compiled(ids, labels=ids)
    assert str(info.value).startswith(MAMBA_REASON)
    assert isinstance(info.value.inner_exception, slcompile.RefusedError)
    torch._dynamo.reset()
    explained = slcompile.explain(model, ids, kwargs={"labels": ids}, **OPTIONS)
    assert explained.blocks == ("backbone.layers.0", "backbone.layers.1")
    assert explained.fallback_reason.startswith(MAMBA_REASON)
    assert f"fallback: {MAMBA_REASON}" in str(explained)


def _broken(passes, name):
    """`passes` with the pass `name` raising an unexpected error on a rewritten graph
    (the compiled stage's passes run on plain graphs too)."""
    def fail(state):
        if getattr(state, "plan", True) is None:
            return next(p for p in passes if p.name == name).run(state)
        raise KeyError("a bug in the pass")

    assert name in {p.name for p in passes}
    return tuple(dataclasses.replace(p, run=fail) if p.name == name else p for p in passes)


@pytest.mark.parametrize("table, name, stage", [
    ("PASSES", "interleave", "dynamo"),
    ("JOINT_PASSES", "tag_fetch_views", "joint"),
    ("PARTITIONED_PASSES", "order_layer_major", "partitioned"),
    ("COMPILED_PASSES", "mark_regions", "compiled[forward]"),
])
def test_a_failing_pass_of_any_stage_falls_back_with_one_warning(monkeypatch, caplog, table, name, stage):
    from slcompile import pipeline
    from slcompile.backends import speedloader

    module = speedloader if table == "PASSES" else lowering
    if table == "PASSES":
        monkeypatch.setattr(speedloader, "run_pipeline", lambda *a, **k: pipeline.run_pipeline(
            *a, passes=_broken(pipeline.PASSES, name), **k))
    else:
        monkeypatch.setattr(module, table, _broken(getattr(pipeline, table), name))
    idx, targets = make_gpt_batch(CFG, 4)
    warnings = _assert_plain_equals_eager(TinyGPT(CFG), lambda m: m(idx, targets)[1], OPTIONS, caplog)
    expected = f"internal error in pass {name} ({stage} stage; KeyError: 'a bug in the pass')"
    assert len(warnings) == 1 and expected in warnings[0]
    assert slcompile.compile_reports()[-1].fallback_reason.startswith(expected)

    torch._dynamo.reset()
    compiled = torch.compile(TinyGPT(CFG), backend="speedloader", options={**OPTIONS, "on_refusal": "raise"})
    with pytest.raises(slcompile.CompileError) as info:
        compiled(idx, targets)
    assert str(info.value).startswith(expected)


def test_explain_reports_a_later_stage_failure(monkeypatch):
    from slcompile import pipeline

    monkeypatch.setattr(lowering, "PARTITIONED_PASSES", _broken(pipeline.PARTITIONED_PASSES, "order_layer_major"))
    explained = slcompile.explain(TinyGPT(CFG), *make_gpt_batch(CFG, 4), **OPTIONS)
    assert explained.fallback_reason.startswith("internal error in pass order_layer_major (partitioned stage; ")
    assert explained.blocks == ("layers.0", "layers.1")


def test_disk_full_while_compiling_is_a_compile_error_with_our_message(tmp_path, monkeypatch, caplog):
    from slcompile.runtime.storage import engine as engines
    from slcompile.runtime.storage.engine import TransferEngine
    from slcompile.runtime.errors import DiskFullError

    engine = TransferEngine(offload_dir=str(tmp_path), capacity_bytes=4096)
    monkeypatch.setitem(engines._ENGINES, str(tmp_path), engine)
    try:
        compiled = torch.compile(TinyGPT(CFG), backend="speedloader",
                                 options={**OPTIONS, "weights": "nvme", "offload_dir": str(tmp_path)})
        with caplog.at_level(logging.WARNING, logger="slcompile"), \
                pytest.raises(slcompile.CompileError) as info:
            compiled(*make_gpt_batch(CFG, 4))
    finally:
        engine.close()
    assert isinstance(info.value.inner_exception, DiskFullError)
    assert str(info.value).startswith("arena capacity of 4096 bytes reached")
    assert "compiling this graph with plain" not in caplog.text  # no fallback


def test_a_failure_at_run_time_is_not_swallowed(monkeypatch):
    from slcompile.runtime import weights

    compiled = torch.compile(TinyGPT(CFG), backend="speedloader", options={**OPTIONS, "weights": "nvme"})
    idx, targets = make_gpt_batch(CFG, 4)
    compiled(idx, targets)[1].backward()

    def broken_fetch(*args, **kwargs):
        raise RuntimeError("a transfer broke")

    monkeypatch.setattr(weights.WeightStreamer, "fetch", broken_fetch)
    with pytest.raises(RuntimeError, match="a transfer broke"):
        compiled(idx, targets)
    assert len(slcompile.compile_reports()) == 1


@pytest.mark.parametrize("table, name, once", [("PASSES", "find_blocks", False),
                                               ("PARTITIONED_PASSES", "order_layer_major", False),
                                               ("PARTITIONED_PASSES", "order_layer_major", True)])
def test_a_user_error_in_a_pass_of_any_stage_is_raised_not_a_fallback(monkeypatch, caplog, table, name, once):
    """Also from a step traced with each unit once (`trace_units_once`), which is
    traced flat again after its other failures: not after the user's."""
    from slcompile import pipeline
    from slcompile.backends import speedloader
    from slcompile.runtime.errors import DiskFullError

    def full(state):
        raise DiskFullError("no room for the stash", path="/offload")

    full_passes = tuple(dataclasses.replace(p, run=full) if p.name == name else p for p in getattr(pipeline, table))
    if table == "PASSES":
        monkeypatch.setattr(speedloader, "run_pipeline", lambda *a, **k: pipeline.run_pipeline(
            *a, passes=full_passes, **k))
    else:
        monkeypatch.setattr(lowering, table, full_passes)
    compiled = torch.compile(TinyGPT(CFG), backend="speedloader", options={**OPTIONS, "trace_units_once": once})
    with caplog.at_level(logging.WARNING, logger="slcompile"), pytest.raises(slcompile.CompileError) as info:
        compiled(*make_gpt_batch(CFG, 4))
    assert str(info.value).startswith("no room for the stash; path '/offload'")
    assert isinstance(info.value.inner_exception, DiskFullError)
    assert caplog.text == ""
