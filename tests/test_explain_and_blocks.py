"""explain(), block discovery, the schedule text, pass dumps and the entry point."""

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import slcompile
from slcompile.errors import OptionError
from conftest import assert_matches_eager
from models import EXPECTED_SCHEDULE_K2, BatchNormBlock, GPTConfig, Stack, TinyGPT, hf_llama, make_gpt_batch

CFG = GPTConfig(n_layers=2)


def test_explain_tiny_gpt():
    idx, targets = make_gpt_batch(CFG, 4)
    explanation = slcompile.explain(TinyGPT(CFG), idx, targets, num_subbatches=2)
    assert explanation.blocks == ("layers.0", "layers.1")
    assert explanation.batch_inputs == {"L['idx']": 0, "L['targets']": 0}
    assert explanation.num_subbatches == 2
    assert explanation.fallback_reason is None
    assert explanation.schedule == EXPECTED_SCHEDULE_K2
    assert len(explanation.graphs[0].block_groups) == 1
    assert "fwd blk1.sb1" in str(explanation)


def test_explain_reports_the_fallback_reason():
    explanation = slcompile.explain(Stack(BatchNormBlock), torch.randn(8, 8), num_subbatches=2)
    assert "BatchNorm in training mode" in explanation.fallback_reason
    assert explanation.blocks == ("layers.0", "layers.1", "layers.2")
    assert explanation.schedule == ""


@pytest.mark.oldest
def test_explain_llama_keyword_inputs():
    idx, labels = make_gpt_batch(CFG, 4)
    explanation = slcompile.explain(hf_llama(num_hidden_layers=3), idx, kwargs={"labels": labels}, num_subbatches=4)
    assert explanation.blocks == ("model.layers.0", "model.layers.1", "model.layers.2")
    assert explanation.fallback_reason is None


@pytest.mark.oldest
def test_llama_on_the_meta_device_with_its_default_cache_is_explained_as_without_the_cache():
    """A Llama built on the meta device with the config's default `use_cache=True`
    is explained, without weights, as when called with `use_cache=False`: the
    schedule of the same model on the CPU, the bytes of the call without a cache.
    transformers before 5.4 asks autocast about the meta device in its rotary
    embeddings, which torch refuses: that is a clear error naming the way out."""
    import transformers
    from transformers import LlamaForCausalLM

    config = hf_llama(num_hidden_layers=2).config
    assert config.use_cache
    options = dict(num_subbatches=4, weights="host", profile=None)
    with torch.device("meta"):
        on_meta = LlamaForCausalLM(config)
    ids = torch.zeros(8, 16, dtype=torch.long, device="meta")
    if tuple(int(part) for part in transformers.__version__.split(".")[:2]) < (5, 4):
        with pytest.raises(OptionError, match="upgrade transformers, or explain the model on the CPU"):
            slcompile.explain(on_meta, ids, kwargs={"labels": ids}, **options)
        return
    explained = slcompile.explain(on_meta, ids, kwargs={"labels": ids}, **options)
    without_cache = slcompile.explain(on_meta, ids, kwargs={"labels": ids, "use_cache": False}, **options)
    cpu_ids = torch.zeros(8, 16, dtype=torch.long)
    on_cpu = slcompile.explain(LlamaForCausalLM(config), cpu_ids, kwargs={"labels": cpu_ids, "use_cache": False},
                               **options)
    assert explained.blocks == ("model.layers.0", "model.layers.1") and explained.fallback_reason is None
    assert explained.schedule == on_cpu.schedule
    assert explained.predicted_peak_bytes == without_cache.predicted_peak_bytes
    assert "use_cache=False" in str(explained) and "use_cache" not in str(without_cache)


def test_structurally_different_block_gets_its_own_group():
    class Wide(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.lin = nn.Linear(width, width)
            self.extra = nn.Linear(width, width)

        def forward(self, x):
            return self.extra(torch.relu(self.lin(x)))

    model = Stack(lambda w: nn.Linear(w, w))
    model.layers[0] = Wide(8)
    explanation = slcompile.explain(model, torch.randn(4, 8), num_subbatches=2)
    assert explanation.graphs[0].block_groups == ((0,), (1, 2))


def test_dump_and_disable(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("SLC_DUMP_DIR", str(tmp_path))
    monkeypatch.setenv("SLC_DISABLE", "interleave")
    idx, targets = make_gpt_batch(CFG, 4)
    with caplog.at_level("WARNING", logger="slcompile"):
        assert_matches_eager(TinyGPT(CFG), lambda m: m(idx, targets), {"num_subbatches": 2, "lowering": "aot_eager"})
    names = sorted(p.name for p in tmp_path.iterdir())
    assert "002_find_blocks.txt" in names and "002_find_blocks.dot" in names
    assert not any("interleave" in n for n in names)
    assert "pass interleave skipped (SLC_DISABLE)" in caplog.text
    dot = (tmp_path / "004_propagate_batch.dot").read_text()
    assert dot.startswith("digraph")


def test_backend_resolves_by_entry_point_without_import():
    code = textwrap.dedent(
        """
        import sys, torch
        assert "slcompile" not in sys.modules
        lin = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(2))
        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.layers = lin
            def forward(self, x):
                for layer in self.layers:
                    x = layer(x)
                return x
        m = M()
        x = torch.randn(4, 4)
        out = torch.compile(m, backend="speedloader", options={"num_subbatches": 2, "lowering": "aot_eager"})(x)
        torch.testing.assert_close(out, m(x))
        import slcompile
        assert slcompile.compile_reports()[-1].fallback_reason is None
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("SLC_DUMP_DIR", "SLC_DISABLE")}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_explain_predicts_memory_per_tier_without_moving_weights():
    model = TinyGPT(GPTConfig())
    idx, targets = make_gpt_batch(GPTConfig(), 8)
    options = dict(lowering="aot_eager", num_subbatches=2, weights="nvme", activations="nvme", min_offload_bytes=0)
    explanation = slcompile.explain(model, idx, targets, **options)
    predicted = explanation.predicted_peak_bytes
    assert set(predicted) == {"device", "host", "nvme"}
    assert not slcompile.offloaded_parameters(model)  # explaining moves nothing
    streamed = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if n.startswith("layers."))
    assert predicted["nvme"] > streamed  # the block weights and the saved activations
    assert "predicted peak" in str(explanation)
    # The same figures as compiling the step for real.
    torch.compile(model, backend="speedloader", options=options)(idx, targets)[1].backward()
    assert slcompile.compile_reports()[-1].memory.peak_bytes == predicted


def test_explain_reports_an_infeasible_budget():
    idx, targets = make_gpt_batch(GPTConfig(), 8)
    explanation = slcompile.explain(
        TinyGPT(GPTConfig()), idx, targets, lowering="aot_eager", num_subbatches=2, memory_budget="1KiB"
    )
    assert explanation.predicted_peak_bytes is None
    assert "over memory_budget=1024" in explanation.graphs[0].budget_error


@pytest.mark.slow
def test_explain_and_tune_leave_no_recompiles_and_no_runtime_objects_behind():
    from slcompile.runtime import activations, collect_garbage, gradients, weights

    idx, targets = make_gpt_batch(CFG, 4)
    model = TinyGPT(CFG)
    expected = model(idx, targets)[1]

    def made():
        collect_garbage()  # planned objects may sit in reference cycles until a collection
        return len(weights._STREAMERS), len(activations._STASHES), len(gradients._SINKS)

    options = {"lowering": "aot_eager", "weights": "nvme", "activations": "nvme", "min_offload_bytes": 0}
    before = made()
    with torch._dynamo.config.patch(recompile_limit=2, accumulated_recompile_limit=4):
        for _ in range(3):  # past Dynamo's recompile limits for one code object (made small here)
            explanation = slcompile.explain(model, idx, targets, num_subbatches=2, **options)
            assert explanation.blocks == ("layers.0", "layers.1") and explanation.fallback_reason is None
        assert made() == before
        for _ in range(3):
            tuned = slcompile.tune(model, idx, targets, memory_budget="64MB", num_subbatches=[2], live_blocks=[2],
                                   **options)
            assert tuned.options["num_subbatches"] == 2
        assert made() == before
        # Six captures past limits of 2 and 4: had any left an entry, this would run eagerly.
        compiled = torch.compile(model, backend="speedloader", options={**options, "num_subbatches": 2})
        loss = compiled(idx, targets)[1]
    report = slcompile.compile_reports()[-1]
    assert report.fallback_reason is None and report.streamed_bytes > 0
    assert "blk1.sb1" in report.schedule
    assert {name for name, _ in slcompile.offloaded_parameters(model)} == {
        name for name, _ in model.named_parameters() if name.startswith("layers.")}
    torch.testing.assert_close(loss, expected)
