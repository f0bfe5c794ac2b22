import pathlib

import pytest

import slcompile
from slcompile import SpeedLoaderConfig


def test_defaults_and_options_round_trip():
    config = SpeedLoaderConfig.from_options({"num_subbatches": 4, "lowering": "aot_eager"})
    assert config.num_subbatches == 4
    assert config.lowering == "aot_eager"
    assert SpeedLoaderConfig.from_options(None) == SpeedLoaderConfig()


def test_unknown_key_names_the_key_and_suggests():
    with pytest.raises(ValueError, match=r"'num_subbatch'.*did you mean 'num_subbatches'"):
        SpeedLoaderConfig.from_options({"num_subbatch": 4})


@pytest.mark.parametrize(
    "options, key",
    [
        ({"num_subbatches": 0}, "num_subbatches"),
        ({"num_subbatches": 2.5}, "num_subbatches"),
        ({"num_subbatches": True}, "num_subbatches"),
        ({"lowering": "tvm"}, "lowering"),
        ({"on_refusal": "ignore"}, "on_refusal"),
        ({"batch_dim": -1}, "batch_dim"),
    ],
)
def test_bad_values_name_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        SpeedLoaderConfig.from_options(options)


def test_config_is_frozen():
    config = SpeedLoaderConfig()
    with pytest.raises(Exception):
        config.num_subbatches = 3


def test_options_are_checked_where_they_are_set():
    assert slcompile.options(num_subbatches=4, weights="nvme") == {"num_subbatches": 4, "weights": "nvme"}
    with pytest.raises(ValueError, match=r"^unknown speedloader option 'num_subbatch'; did you mean 'num_subbatches'"):
        slcompile.options(num_subbatch=4)
    with pytest.raises(ValueError, match=r"^speedloader option 'weights' must be one of"):
        slcompile.options(weights="disk")


def test_host_memory_is_bytes_or_none():
    assert SpeedLoaderConfig().host_memory is None  # sized from the compiled plan
    assert SpeedLoaderConfig(host_memory="24GiB").host_memory == 24 * 2**30
    assert SpeedLoaderConfig(host_memory=4096).host_memory == 4096
    for bad in ("lots", 0, True):
        with pytest.raises(ValueError, match="'host_memory'"):
            SpeedLoaderConfig(host_memory=bad)


def test_machine_profile_takes_a_profile_a_name_or_a_file_and_nothing_else(tmp_path, monkeypatch):
    from slcompile.analysis.machine import named_profile
    from slcompile.backends.speedloader import _profile

    h100 = named_profile("h100-pcie5-nvme")
    path = tmp_path / "profile.json"
    path.write_text(h100.to_json())
    for value in ("h100-pcie5-nvme", str(path), h100):
        assert _profile(SpeedLoaderConfig(machine_profile=value)) == h100
    assert _profile(SpeedLoaderConfig()) is None
    with pytest.raises(slcompile.OptionError, match="'machine_profile' must be 'current', a named profile"):
        slcompile.options(machine_profile="h200")
    monkeypatch.setenv("SLC_MACHINE_PROFILE", "h100-pcie5-nvme")
    assert SpeedLoaderConfig.from_options({}).machine_profile == "h100-pcie5-nvme"


def test_the_schedule_option_describes_every_built_in_policy():
    from slcompile.cli import _field_doc
    from slcompile.schedules.policies import BUILTIN_POLICIES

    text = _field_doc(SpeedLoaderConfig.__doc__, "schedule")
    for name in BUILTIN_POLICIES:
        assert f'"{name}"' in text, name
    assert "the three" not in text


@pytest.mark.parametrize("path", ["od\x00b", pathlib.Path("od\x00b")])
def test_an_offload_dir_with_a_null_byte_is_refused_where_it_is_set(path):
    with pytest.raises(slcompile.OptionError, match=r"^speedloader option 'offload_dir': .* holds a null byte"):
        slcompile.options(weights="nvme", offload_dir=path)
    with pytest.raises(slcompile.OptionError, match="'offload_dir'"):
        SpeedLoaderConfig(offload_dir=path)


def test_k_divides_the_batch_in_one_rule_with_one_message():
    from slcompile.config import batch_divisors, batch_split_problem

    assert batch_split_problem(8, 4) is None and batch_split_problem(5, 1) is None
    assert batch_split_problem(6, 4) == "batch size 6 is not divisible by num_subbatches=4"
    assert batch_split_problem(2, 4, "(dim 0 of input x)") == (
        "batch size 2 (dim 0 of input x) is not divisible by num_subbatches=4")
    assert batch_split_problem(0, 2) is not None  # no empty sub-batches
    assert batch_divisors(12) == [1, 2, 3, 4, 6, 12] and batch_divisors(1) == [1]
