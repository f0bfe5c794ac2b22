"""Defaults of the options without touching the torch.compile call
(`slcompile.defaults`): set in code, patched, or from `SLC_*` environment variables;
options given to torch.compile win; explain says where each came from."""

from __future__ import annotations

import copy

import pytest
import torch

import slcompile
from models import GPTConfig, TinyGPT, make_gpt_batch
from slcompile import SpeedLoaderConfig, defaults

CFG = GPTConfig(n_layers=2)


@pytest.fixture(autouse=True)
def no_defaults_set_in_code():
    defaults.reset()
    yield
    defaults.reset()


def test_environment_variables_set_the_defaults_of_a_compile_without_options(monkeypatch):
    monkeypatch.setenv("SLC_NUM_SUBBATCHES", "4")
    monkeypatch.setenv("SLC_LOWERING", "aot_eager")
    model = TinyGPT(CFG)
    eager = copy.deepcopy(model)
    idx, targets = make_gpt_batch(CFG, 8)
    loss = torch.compile(model, backend="speedloader")(idx, targets)[1]
    loss.backward()
    expected = eager(idx, targets)[1]
    expected.backward()

    (report,) = slcompile.compile_reports()
    assert (report.config.num_subbatches, report.config.lowering) == (4, "aot_eager")
    assert "fwd blk1.sb3" in report.schedule.splitlines()
    torch.testing.assert_close(loss, expected)
    for (name, param), reference in zip(model.named_parameters(), eager.parameters()):
        torch.testing.assert_close(param.grad, reference.grad, msg=name)


def test_precedence_options_then_code_then_environment_then_the_field(monkeypatch):
    assert SpeedLoaderConfig.from_options(None).live_blocks == SpeedLoaderConfig().live_blocks == 2
    monkeypatch.setenv("SLC_LIVE_BLOCKS", "3")
    assert SpeedLoaderConfig.from_options(None).live_blocks == 3
    with defaults.patch(live_blocks=4):
        assert SpeedLoaderConfig.from_options(None).live_blocks == 4
        assert SpeedLoaderConfig.from_options({"live_blocks": 5}).live_blocks == 5
    assert defaults.live_blocks == 3


def test_patch_is_a_context_manager_and_a_decorator_and_puts_back_what_was_there():
    defaults.weights = "nvme"
    with defaults.patch("weights", "host"):
        with defaults.patch({"weights": "device", "num_subbatches": 8}):
            assert (defaults.weights, defaults.num_subbatches) == ("device", 8)
        assert (defaults.weights, defaults.num_subbatches) == ("host", 2)
    assert defaults.weights == "nvme"

    @defaults.patch(num_subbatches=4)
    def compiled_k():
        return SpeedLoaderConfig.from_options({}).num_subbatches

    assert compiled_k() == 4
    assert defaults.num_subbatches == 2
    del defaults.weights
    assert defaults.weights == "device"


def test_environment_values_by_the_option_type(monkeypatch):
    monkeypatch.setenv("SLC_MEMORY_BUDGET", "2GiB")
    monkeypatch.setenv("SLC_COMPILE_REGIONS", "0")
    monkeypatch.setenv("SLC_OFFLOAD_DIR", "none")
    monkeypatch.setenv("SLC_HOST_MEMORY", "4096")
    config = SpeedLoaderConfig.from_options(None)
    assert (config.memory_budget, config.compile_regions, config.offload_dir, config.host_memory) == \
        (2 * 2**30, False, None, 4096)


def test_unknown_names_and_bad_values_name_where_they_came_from(monkeypatch):
    with pytest.raises(AttributeError, match="no option 'num_subbatch'; did you mean 'num_subbatches'"):
        defaults.num_subbatch = 4
    with pytest.raises(slcompile.OptionError, match="'num_subbatches' must be >= 1, got 0"):
        defaults.patch(num_subbatches=0)
    monkeypatch.setenv("SLC_NUM_SUBBATCHES", "four")
    with pytest.raises(slcompile.OptionError, match="environment variable SLC_NUM_SUBBATCHES='four': expected an int"):
        SpeedLoaderConfig.from_options(None)
    monkeypatch.setenv("SLC_NUM_SUBBATCHES", "4")
    monkeypatch.setenv("SLC_WEIGHTS", "disk")
    with pytest.raises(slcompile.OptionError, match="SLC_WEIGHTS='disk': speedloader option 'weights' must be one of"):
        slcompile.options(num_subbatches=2)


def test_explain_prints_the_options_that_are_not_defaults_and_their_sources(monkeypatch):
    monkeypatch.setenv("SLC_NUM_SUBBATCHES", "4")
    monkeypatch.setenv("SLC_LIVE_BLOCKS", "2")  # the field's default: no source to show
    idx, targets = make_gpt_batch(CFG, 8)
    with defaults.patch(min_offload_bytes=0):
        explained = slcompile.explain(TinyGPT(CFG), idx, targets, lowering="aot_eager")
        listed = defaults.explain({"lowering": "aot_eager"}).splitlines()
    assert str(explained).splitlines()[0] == (
        "options: num_subbatches=4 (SLC_NUM_SUBBATCHES), lowering='aot_eager' (options), "
        "min_offload_bytes=0 (slcompile.defaults)"
    )
    assert explained.num_subbatches == 4
    assert "num_subbatches    = 4  (SLC_NUM_SUBBATCHES)" in listed
    assert "live_blocks       = 2" in listed
    # Every option of a compiled graph; generation's alone are generate's.
    assert len(listed) == len(SpeedLoaderConfig.__dataclass_fields__) - 2
    assert not any(line.startswith(("kv_cache", "prefill_subbatches")) for line in listed)
    with pytest.raises(slcompile.OptionError, match="'kv_cache' is an option of slcompile.generate alone"):
        defaults.patch(kv_cache="nvme")

