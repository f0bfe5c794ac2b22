"""The pass manager: every stage's passes listed, dumped with one numbering, disabled by
name, in a scope or from the environment; unknown names and checks refused; errors
name the passes run."""

import copy
import dataclasses
import re
import types

import pytest
import torch
from expecttest import assert_expected_inline

import slcompile
from slcompile.errors import RefusedError
from slcompile.passes.manager import (
    Analysis, Pass, PassError, PassLog, PassSettings, current_pass_settings, disabled_passes, pass_modules, pass_settings,
    run_passes,
)
from slcompile.pipeline import StepResults, StepState, all_passes

OPTIONS = {"num_subbatches": 2, "lowering": "aot_eager"}


def _train_step(mlp, options=OPTIONS):
    """Compiles the MLP, runs one step; checks loss and gradients against eager."""
    model, x = mlp
    eager, compiled_model = copy.deepcopy(model), copy.deepcopy(model)
    eager(x).backward()
    compiled = torch.compile(compiled_model, backend="speedloader", options=options)
    loss = compiled(x)
    loss.backward()
    torch.testing.assert_close(loss, eager(x))
    for (name, got), (_, want) in zip(compiled_model.named_parameters(), eager.named_parameters()):
        torch.testing.assert_close(got.grad, want.grad, msg=name)
    return slcompile.compile_reports()[-1]


def _names(entries) -> str:
    return "\n".join(re.sub(r" \(\d+ ms\)$", "", entry) for entry in entries)


def test_passes_run_lists_every_stage(mlp, monkeypatch):
    monkeypatch.delenv("SLC_DISABLE", raising=False)
    monkeypatch.delenv("SLC_DUMP_DIR", raising=False)
    report = _train_step(mlp)
    assert report.fallback_reason is None
    assert all(re.search(r" \(\d+ ms\)$", entry) for entry in report.passes_run)
    assert_expected_inline(_names(report.passes_run), """\
dynamo/inline_checkpoints
dynamo/classify_inputs
dynamo/find_blocks
dynamo/find_batch_dim
dynamo/propagate_batch
dynamo/check_splittable
dynamo/plan_schedule
dynamo/interleave
dynamo/stream_weights
joint/tag_fetch_views
joint/tag_block_recompute
partitioned/fuse_weight_grads
partitioned/order_layer_major
partitioned/plan_transfers
partitioned/offload_activations
partitioned/spill_boundaries
partitioned/place_prefetches
partitioned/offload_gradients
partitioned/derive_schedule
partitioned/predict_memory
compiled[forward]/annotate_streams
compiled[forward]/coalesce_transfers
compiled[forward]/mark_regions
compiled[forward]/compile_regions
compiled[forward]/drop_marks
compiled[backward]/annotate_streams
compiled[backward]/coalesce_transfers
compiled[backward]/mark_regions
compiled[backward]/compile_regions
compiled[backward]/drop_marks""")


def test_recompute_search_lists_each_attempt(mlp, monkeypatch):
    monkeypatch.delenv("SLC_DISABLE", raising=False)
    # A budget no plan meets: both attempts run, then the BudgetError.
    options = {**OPTIONS, "recompute": "auto", "memory_budget": 1}
    with pytest.raises(Exception, match="over memory_budget=1"):
        _train_step(mlp, options)
    entries = slcompile.compile_reports()[-1].passes_run
    stages = list(dict.fromkeys(entry.split("/")[0] for entry in entries))
    assert_expected_inline("\n".join(stages), """\
dynamo
joint[recompute=none]
partitioned[recompute=none]
joint[recompute=blocks]
partitioned[recompute=blocks]""")


def test_dumps_are_numbered_across_stages(mlp, monkeypatch, tmp_path):
    monkeypatch.delenv("SLC_DISABLE", raising=False)
    monkeypatch.setenv("SLC_DUMP_DIR", str(tmp_path))
    report = _train_step(mlp)
    texts = sorted(p.name for p in tmp_path.glob("*.txt"))
    assert sorted(p.stem for p in tmp_path.glob("*.dot")) == [name[:-4] for name in texts]
    assert len(texts) == len(report.passes_run)
    assert_expected_inline("\n".join(texts), """\
000_inline_checkpoints.txt
001_classify_inputs.txt
002_find_blocks.txt
003_find_batch_dim.txt
004_propagate_batch.txt
005_check_splittable.txt
006_plan_schedule.txt
007_interleave.txt
008_stream_weights.txt
009_tag_fetch_views.txt
010_tag_block_recompute.txt
011_fuse_weight_grads.txt
012_order_layer_major.txt
013_plan_transfers.txt
014_offload_activations.txt
015_spill_boundaries.txt
016_place_prefetches.txt
017_offload_gradients.txt
018_derive_schedule.txt
019_predict_memory.txt
020_annotate_streams.txt
021_coalesce_transfers.txt
022_mark_regions.txt
023_compile_regions.txt
024_drop_marks.txt
025_annotate_streams.txt
026_coalesce_transfers.txt
027_mark_regions.txt
028_compile_regions.txt
029_drop_marks.txt""")
    backward = (tmp_path / [t for t in texts if t.endswith("_fuse_weight_grads.txt")][0]).read_text()
    assert backward.startswith("# after partitioned/fuse_weight_grads (")
    assert "def forward(self" in backward


def test_disabled_pass_is_skipped_and_logged(mlp, monkeypatch, caplog):
    monkeypatch.setenv("SLC_DISABLE", "fuse_weight_grads,mark_regions")
    with caplog.at_level("WARNING", logger="slcompile"):
        report = _train_step(mlp)
    assert "pass fuse_weight_grads skipped (SLC_DISABLE)" in caplog.text
    assert report.fused_weight_grads == 0
    assert not any("fuse_weight_grads" in entry or "mark_regions" in entry for entry in report.passes_run)


def test_pass_settings_scope_the_disabled_passes_and_the_dumps(mlp, monkeypatch, tmp_path):
    """Inside `pass_settings` a compile skips the pass it names and dumps where it says,
    the backward too, which AOTAutograd compiles at the first backward call, here
    outside the block; outside, the environment's settings (none) hold again."""
    monkeypatch.delenv("SLC_DISABLE", raising=False)
    monkeypatch.delenv("SLC_DUMP_DIR", raising=False)
    model, x = mlp
    compiled = torch.compile(copy.deepcopy(model), backend="speedloader", options=OPTIONS)
    with slcompile.pass_settings(disable=["fuse_weight_grads"], dump_dir=tmp_path) as settings:
        assert current_pass_settings() is settings
        loss = compiled(x)
    loss.backward()
    inside = slcompile.compile_reports()[-1]
    assert "compiled[backward]/drop_marks" in _names(inside.passes_run).splitlines()
    assert not any("fuse_weight_grads" in entry for entry in inside.passes_run)
    texts = sorted(p.name for p in tmp_path.glob("*.txt"))
    assert len(texts) == len(inside.passes_run) and texts[-1] == f"{len(texts) - 1:03d}_drop_marks.txt"
    assert sorted(p.stem for p in tmp_path.glob("*.dot")) == [name[:-4] for name in texts]

    assert current_pass_settings() == PassSettings()
    torch._dynamo.reset()  # compiled again, not served from Dynamo's cache
    outside = _train_step(mlp)
    assert "partitioned/fuse_weight_grads" in _names(outside.passes_run).splitlines()
    assert sorted(p.name for p in tmp_path.glob("*.txt")) == texts


def test_pass_settings_nest_over_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("SLC_DISABLE", "mark_regions")
    monkeypatch.setenv("SLC_DUMP_DIR", str(tmp_path))
    assert current_pass_settings() == PassSettings(disable=frozenset({"mark_regions"}), dump_dir=tmp_path)
    with pass_settings(dump_dir=None) as outer:
        assert (outer.disable, outer.dump_dir) == ({"mark_regions"}, None)
        with pass_settings(disable="interleave, fuse_weight_grads") as inner:
            assert (inner.disable, inner.dump_dir) == ({"interleave", "fuse_weight_grads"}, None)
            assert disabled_passes(all_passes()) == {"interleave", "fuse_weight_grads"}
        assert current_pass_settings() is outer
        with pass_settings(disable=["interleav"]), pytest.raises(
                ValueError, match=r"^pass_settings\(disable=\.\.\.\) names unknown pass\(es\) interleav;"):
            disabled_passes(all_passes())
    assert current_pass_settings().dump_dir == tmp_path


def test_unknown_name_in_slc_disable_lists_the_valid_names(monkeypatch):
    monkeypatch.setenv("SLC_DISABLE", "interleave,fuse_weight_grad")
    with pytest.raises(ValueError, match="unknown pass\\(es\\) fuse_weight_grad; passes that can be disabled: ") as caught:
        disabled_passes(all_passes())
    valid = str(caught.value).split("disabled: ")[1].split(", ")
    assert "fuse_weight_grads" in valid and "interleave" in valid and "check_splittable" not in valid


def test_unknown_name_in_slc_disable_stops_the_compile(mlp, monkeypatch):
    monkeypatch.setenv("SLC_DISABLE", "interleav")
    model, x = mlp
    compiled = torch.compile(model, backend="speedloader", options=OPTIONS)
    with pytest.raises(Exception, match="SLC_DISABLE names unknown pass\\(es\\) interleav; passes that can be"):
        compiled(x)


@pytest.mark.parametrize("name", ["check_splittable", "find_blocks", "predict_memory"])
def test_checks_and_required_passes_cannot_be_disabled(monkeypatch, name):
    monkeypatch.setenv("SLC_DISABLE", name)
    with pytest.raises(ValueError, match=f"SLC_DISABLE names {name}, which cannot be disabled"):
        disabled_passes(all_passes())


def test_pass_error_names_the_passes_run_so_far(monkeypatch):
    monkeypatch.delenv("SLC_DISABLE", raising=False)

    def tag(step):
        return 1

    def broken(step):
        raise KeyError("boom")

    passes = (
        Pass("tag_joint", "joint", "rewrite", tag),
        Pass("broken_rewrite", "joint", "rewrite", broken),
    )
    log = PassLog(entries=["dynamo/find_blocks (1 ms)"])
    step = StepState(plan=None, report=None, graphs={"joint": torch.fx.Graph()},
                     results=types.SimpleNamespace(tag_joint=None, broken_rewrite=None))
    with pytest.raises(PassError) as caught:
        run_passes(passes, step, log, declared=passes)
    message = str(caught.value)
    assert "internal error in pass broken_rewrite (joint stage; KeyError: 'boom')" in message
    assert "passes run: dynamo/find_blocks (1 ms), joint/tag_joint (" in message
    assert (step.results.tag_joint, step.results.broken_rewrite) == (1, None)


def test_a_pass_reads_the_analyses_it_declares_each_computed_once_on_first_read(monkeypatch):
    monkeypatch.delenv("SLC_DISABLE", raising=False)
    computed = []
    peak = Analysis("peak", lambda step: computed.append(step.kind) or 42)

    def reads_twice(step):
        return step.analyses["peak"] + step.analyses["peak"]

    passes = (
        Pass("skips_it", "partitioned", "analysis", lambda step: None, requires=(peak,)),
        Pass("reads_twice", "partitioned", "analysis", reads_twice, requires=(peak,)),
        Pass("undeclared", "partitioned", "analysis", lambda step: step.analyses["peak"]),
    )
    step = StepState(plan=None, report=None, kind="forward",
                     results=types.SimpleNamespace(skips_it=None, reads_twice=None, undeclared=None))
    log = PassLog()
    with pytest.raises(PassError, match="pass undeclared reads the analysis 'peak', which it does not declare"):
        run_passes(passes, step, log, declared=passes)
    assert step.results.reads_twice == 84 and computed == ["forward"]  # not for the pass that did not read it
    assert _names(log.entries) == "partitioned/skips_it\npartitioned/reads_twice:peak\npartitioned/reads_twice"
    assert step.analyses is None  # nothing to read between passes


def test_plan_transfers_weighs_a_budget_against_the_kept_peak_and_computes_it_only_then(mlp, monkeypatch):
    monkeypatch.delenv("SLC_DISABLE", raising=False)
    options = {**OPTIONS, "activations": "nvme", "min_offload_bytes": 0}
    unbudgeted = _train_step(mlp, options)
    assert not [entry for entry in unbudgeted.passes_run if ":kept_memory" in entry]
    budgeted = _train_step(mlp, {**options, "memory_budget": 1 << 30})
    assert _names(entry for entry in budgeted.passes_run if ":" in entry) == "partitioned[recompute=none]/plan_transfers:kept_memory"


def test_the_results_record_has_a_field_for_each_pass_after_dynamos_stage():
    """A pass of the later stages sets its field of `StepResults`; one without a
    field is refused before it runs."""
    names = {p.name for p in all_passes() if p.stage != "dynamo"}
    assert {field.name for field in dataclasses.fields(StepResults)} == names
    ran = []
    passes = (Pass("unrecorded", "joint", "rewrite", lambda step: ran.append(step)),)
    with pytest.raises(PassError, match="has no field 'unrecorded'"):
        run_passes(passes, StepState(plan=None, report=None), PassLog(), declared=passes)
    assert ran == []


def test_a_refusal_in_the_dynamo_stage_keeps_its_reason(dynamo_graph, monkeypatch):
    monkeypatch.delenv("SLC_DISABLE", raising=False)
    from slcompile.config import SpeedLoaderConfig
    from slcompile.pipeline import PASSES, run_pipeline
    from slcompile.facts import process_facts

    def refuse(state):
        raise RefusedError("this graph has no batch")

    passes = (*PASSES[:PASSES.index(next(p for p in PASSES if p.name == "find_blocks")) + 1],
              Pass("refuse", "dynamo", "check", refuse))
    gm, example_inputs = dynamo_graph
    with pytest.raises(RefusedError, match=r"this graph has no batch \[refuse\]") as caught:
        config = SpeedLoaderConfig.from_options({"num_subbatches": 2})
        run_pipeline(gm, example_inputs, config, facts=process_facts(config, example_inputs), passes=passes)
    assert caught.value.state.blocks is not None  # what find_blocks produced


def test_pass_declarations_are_checked_and_hashed():
    with pytest.raises(ValueError, match="kind must be one of analysis, rewrite, check"):
        Pass("x", "joint", "transform", lambda step: None)
    with pytest.raises(ValueError, match="stage must be one of"):
        Pass("x", "lowering", "rewrite", lambda step: None)
    files = pass_modules(all_passes())
    for module in ("fuse_weight_grads", "order_layer_major", "offload_activations", "stream_weights",
                   "annotate_streams", "mark_regions", "outline_regions", "find_blocks", "interleave", "memory", "derive",
                   "batch_propagation/propagate", "batch_propagation/routing", "batch_propagation/writes"):
        assert any(f.endswith(f"/{module}.py") for f in files), module


def test_the_inductor_cache_key_names_the_passes_skipped(monkeypatch):
    # A graph compiled with a pass skipped is another graph: Inductor's caches must not
    # serve it for the same plan compiled with every pass.
    from slcompile.backends.lowering import StepPlan, partition_key
    from slcompile.config import SpeedLoaderConfig

    plan = StepPlan(block_positions={0: 0}, config=SpeedLoaderConfig(num_subbatches=2))
    monkeypatch.setenv("SLC_DISABLE", "")
    every = partition_key(plan)
    monkeypatch.setenv("SLC_DISABLE", "coalesce_transfers")
    assert partition_key(plan) != every
    monkeypatch.setenv("SLC_DISABLE", "")
    assert partition_key(plan) == every
