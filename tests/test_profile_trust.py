"""A measured profile says what it measured: the load beside it and the spread of its
repeats; one measured beside other work is refused where a prediction decides, and
a prediction from it carries the interval its spread gives."""

import dataclasses
import json
import subprocess
import sys
import time

import pytest
import torch

import slcompile
import slcompile.measure as measure
from slcompile.analysis.machine import MachineProfile
from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

QUIET = MachineProfile(
    name="quiet", matmul_flops=5e10, memory_bandwidth=2e10, op_overhead_seconds=5e-6, nvme_read=1e9,
    nvme_write=1e9, source="measured on a test", measured_on=measure.profile_key(), load=0.05, cores=2,
    spread=(("matmul", 0.04), ("bandwidth", 0.10), ("op", 0.5), ("nvme_read", 1.0)),
    bandwidth_curve=((1e6, 2e10),),
)
LOADED = dataclasses.replace(QUIET, name="loaded", load=1.4)


def test_the_load_of_other_processes_is_measured_and_this_ones_is_not():
    """A process spinning beside the measurement shows as about one core; the
    measuring process's own work does not."""
    spinner = subprocess.Popen([sys.executable, "-c", "import time\nend = time.time() + 3\nwhile time.time() < end: pass"])
    try:
        time.sleep(0.5)  # the interpreter started
        with measure._OtherLoad() as load:
            end = time.perf_counter() + 1.0
            while time.perf_counter() < end:  # this process busy too: not counted
                pass
    finally:
        spinner.wait()
    assert load.cores is not None and load.cores >= 0.5


def test_a_measurement_records_its_load_cores_and_each_rates_spread():
    profile = measure.measure_rates(nvme=False)
    assert profile.load is not None and profile.load >= 0 and profile.cores >= 1
    spread = dict(profile.spread)
    assert {"matmul", "bandwidth", "op", "transfer_op", "call"} <= set(spread)
    assert all(fraction >= 0 for fraction in spread.values())
    assert MachineProfile.from_json(profile.to_json()) == profile
    assert f"cores busy meanwhile" in profile.describe() and "(spread " in profile.describe()


def test_trust_problem_names_the_load_and_the_wide_spread():
    assert QUIET.trust_problem() is None
    assert "other processes kept 1.4 of 2 cores busy" in LOADED.trust_problem()
    wide = dataclasses.replace(QUIET, spread=(("matmul", 0.41), ("bandwidth", 0.1), ("nvme_read", 2.0)))
    assert wide.trust_problem() == "its repeats spread by matmul 41% (median over best)"
    # A named profile measured nothing: nothing to doubt.
    assert slcompile.analysis.machine.named_profile("h100-pcie5-nvme").trust_problem() is None


def test_at_spread_slows_each_rate_by_its_own_spread():
    slow = QUIET.at_spread()
    assert slow.matmul_flops == pytest.approx(5e10 / 1.04)
    assert slow.memory_bandwidth == pytest.approx(2e10 / 1.10)
    assert slow.bandwidth_curve == ((1e6, pytest.approx(2e10 / 1.10)),)
    assert slow.op_overhead_seconds == pytest.approx(7.5e-6)
    assert slow.nvme_read == pytest.approx(5e8) and slow.nvme_write == 1e9
    assert slow.spread == () and slow.at_spread() is slow


def test_a_loaded_cache_is_measured_anew_once_and_refused_where_a_prediction_decides(tmp_path, monkeypatch):
    measured = []

    def measure_rates(device=None, *, dtype=None, offload_dir=None, **_):
        measured.append(1)
        return LOADED

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.delenv("SLC_PROFILE", raising=False)
    monkeypatch.setattr(measure, "measure_rates", measure_rates)
    monkeypatch.setattr(measure, "_MEASURED_HERE", {})
    measure.write_profile(LOADED, measure.profile_path())
    # Used where nothing is refused, but measured anew first: the cached one was loaded.
    assert measure.machine_profile() == LOADED and measured == [1]
    # The new measurement was loaded too: this process does not measure again.
    with pytest.raises(slcompile.ProfileError, match=r"cores busy.*python -m slcompile profile"):
        measure.machine_profile(refuse_untrusted=True)
    assert measured == [1]
    # A file measured under load is refused as well; the profile itself is used as it is.
    path = tmp_path / "loaded.json"
    path.write_text(LOADED.to_json())
    with pytest.raises(slcompile.ProfileError, match="loaded.json"):
        measure.machine_profile(str(path), refuse_untrusted=True)
    assert measure.machine_profile(LOADED, refuse_untrusted=True) is LOADED
    # A quiet cache is read as it is.
    measure.write_profile(QUIET, measure.profile_path())
    assert measure.machine_profile(refuse_untrusted=True) == QUIET and measured == [1]


def _gpt():
    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, n_heads=2)
    model = TinyGPT(cfg)
    return model, make_gpt_batch(cfg, 4)


def test_explain_refuses_a_loaded_profile_file_and_gives_an_interval_from_the_spread(tmp_path):
    model, (idx, targets) = _gpt()
    path = tmp_path / "loaded.json"
    path.write_text(LOADED.to_json())
    with pytest.raises(slcompile.ProfileError, match="measure|quiet"):
        slcompile.explain(model, idx, targets, num_subbatches=2, lowering="aot_eager", profile=str(path))
    explanation = slcompile.explain(model, idx, targets, num_subbatches=2, lowering="aot_eager", profile=QUIET)
    timeline = explanation.time
    assert timeline.slow_step_seconds > timeline.step_seconds
    # The slow end is the same step predicted at the medians' rates.
    slow = slcompile.explain(model, idx, targets, num_subbatches=2, lowering="aot_eager",
                             profile=dataclasses.replace(QUIET.at_spread(), spread=()))
    assert slow.time.slow_step_seconds is None
    assert timeline.slow_step_seconds == pytest.approx(slow.time.step_seconds)
    assert "(the measured rates' best to median)" in str(explanation)


def test_the_profile_command_writes_the_measurement_and_fails_on_a_loaded_one(tmp_path, monkeypatch, capsys):
    from slcompile import cli

    for profile, code in ((QUIET, 0), (LOADED, 1)):
        monkeypatch.setattr("slcompile.profile.measure_profile", lambda **_: profile)
        out = tmp_path / f"{profile.name}.json"
        assert cli.main(["profile", "--out", str(out)]) == code
        assert MachineProfile.from_json(out.read_text()) == profile
        printed = capsys.readouterr().out
        assert f"written to {out}" in printed and "matmul" in printed
        assert ("not to be trusted" in printed) == (code == 1)
    assert json.loads((tmp_path / "loaded.json").read_text())["load"] == 1.4


def test_a_plan_made_with_a_loaded_profile_warns_once_for_that_profile(caplog, monkeypatch):
    """Every compile that plans its stashes with a profile measured under load
    could warn; the warning is given once a profile, not once a compile."""
    import logging

    from slcompile.backends import speedloader

    monkeypatch.setattr(speedloader, "_LOGGED_PROFILES", set())
    options = {"lowering": "aot_eager", "num_subbatches": 2, "activations": "nvme", "machine_profile": LOADED}
    with caplog.at_level(logging.WARNING, logger="slcompile"):
        for k in (2, 4):
            torch._dynamo.reset()
            model, (idx, targets) = _gpt()
            compiled = torch.compile(model, backend="speedloader", options={**options, "num_subbatches": k})
            compiled(idx, targets)[1].backward()
            assert slcompile.compile_reports()[-1].config.num_subbatches == k
    warned = [r.getMessage() for r in caplog.records if "activation planner decides by" in r.getMessage()]
    assert len(warned) == 1 and "1.4 of 2 cores busy" in warned[0], warned


@pytest.mark.slow
def test_the_steps_a_profile_compiles_leave_this_process_tracing_the_example_model_with_static_sizes(tmp_path):
    """`measure_profile(steps=True)` compiles the package's GPT at two sizes to fit
    the host costs; in this process, Dynamo would then trace the next compile of that
    model, at any other size, with symbolic sizes (and a different plan). The fit
    runs in a child process: a later compile here sees the sizes it is given."""
    from slcompile.profile import measure_profile

    torch._dynamo.reset()
    profile = measure_profile(offload_dir=str(tmp_path), steps=True, generation=False)
    assert profile.op_overhead_seconds > 0 and profile.transfer_op_seconds > 0
    assert {"stash@nvme", "unstash@nvme", "fetch_weight@nvme"} <= {name for name, _ in profile.transfer_op_costs}
    cfg = GPTConfig(d_model=32, seq_len=16, n_layers=2, n_heads=2)
    compiled = torch.compile(TinyGPT(cfg), backend="speedloader",
                             options={"lowering": "aot_eager", "num_subbatches": 2})
    compiled(*make_gpt_batch(cfg, 4))[1].backward()
    forward = slcompile.compile_reports()[-1].partitioned["forward"]
    assert all(isinstance(node.meta["val"], torch.Tensor) for node in forward.graph.nodes if node.op == "placeholder")


def test_a_failed_fit_of_the_compiled_steps_says_why(tmp_path):
    from slcompile.profile import _fit_in_child

    not_a_folder = tmp_path / "file"
    not_a_folder.write_text("")
    with pytest.raises(RuntimeError, match=r"(?s)measuring the compiled steps failed \(exit status 1\):.*Error"):
        _fit_in_child(QUIET, torch.device("cpu"), str(not_a_folder), nvme=True, generation=False)
