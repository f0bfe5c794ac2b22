"""`slcompile.sweep`: every policy under every combination of option values, each
compiled alone, measured and predicted, one row each, written as CSV and JSON."""

import csv
import json

import pytest
import torch

import slcompile
from models import GPTConfig, TinyGPT, make_gpt_batch
from test_profile_trust import QUIET

CFG = GPTConfig(n_layers=2, d_model=32, n_heads=2, seq_len=16)
FIXED = dict(lowering="aot_eager", weights="nvme", min_offload_bytes=0)


@pytest.fixture(scope="module")
def table():
    torch.manual_seed(0)
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    eager_loss = model(idx, targets)[1].item()
    swept = slcompile.sweep(model, idx, targets, policies=["speedloader", "grad_accumulation"],
                            options={"num_subbatches": [1, 2, 3]}, steps=3, warmup=1, profile=QUIET, **FIXED)
    return swept, eager_loss


def _row(table, policy, k):
    return next(row for row in table.rows if row.policy == policy and row.options == {"num_subbatches": k})


def test_every_configuration_has_its_row_in_order_and_the_eager_loss(table):
    swept, eager_loss = table
    assert [(row.policy, row.options["num_subbatches"]) for row in swept.rows] == [
        (policy, k) for policy in ("speedloader", "grad_accumulation") for k in (1, 2, 3)]
    for row in swept.rows:
        if row.options["num_subbatches"] == 3:
            continue
        assert row.compiled and row.error is None
        assert len(row.step_seconds) == 3 and row.min_seconds <= row.median_seconds
        assert row.loss == pytest.approx(eager_loss, rel=1e-5)


def test_a_configuration_that_does_not_compile_says_why(table):
    swept, _ = table
    for policy in ("speedloader", "grad_accumulation"):
        row = _row(swept, policy, 3)
        assert not row.compiled and row.step_seconds == () and row.measured_peak_bytes is None
        assert "num_subbatches=3" in row.error and "4" in row.error
    assert "not compiled: " in str(swept)


def test_the_weight_bytes_follow_the_policy(table):
    """Layer-major reads each block's weights once whatever K; gradient accumulation
    once per sub-batch."""
    swept, _ = table
    moved = {(row.policy, row.options["num_subbatches"]): row.measured_tier_bytes["nvme"]
             for row in swept.rows if row.compiled}
    assert moved["speedloader", 2] == moved["speedloader", 1]
    assert moved["grad_accumulation", 2] > moved["grad_accumulation", 1] == moved["speedloader", 1]
    # What a training step reads from the disk (the measurement's reloads excepted)
    # is what the time model moves.
    for row in swept.rows:
        if row.compiled:
            assert row.measured_tier_bytes["nvme"] - row.reloaded_bytes == row.predicted_bytes["fetch"] > 0, row


def test_each_row_carries_its_prediction_with_an_interval(table):
    swept, _ = table
    for row in swept.rows:
        if not row.compiled:
            assert row.predicted_step_seconds is None
            continue
        assert 0 < row.predicted_step_seconds < row.predicted_slow_step_seconds
        assert row.predicted_peak_bytes > 0 and row.predicted_bytes
        assert row.prediction_error == pytest.approx(row.predicted_step_seconds / row.median_seconds - 1)
    assert swept.profile == QUIET.source and swept.profile_load == QUIET.load
    assert swept.best().median_seconds == min(row.median_seconds for row in swept.rows if row.compiled)


def test_csv_and_json_hold_every_row(table, tmp_path):
    swept, _ = table
    with open(swept.write_csv(tmp_path / "sweep.csv")) as f:
        lines = list(csv.DictReader(f))
    assert [line["policy"] for line in lines] == [row.policy for row in swept.rows]
    assert [line["option.num_subbatches"] for line in lines] == ["1", "2", "3"] * 2
    assert [line["compiled"] for line in lines] == [str(row.compiled) for row in swept.rows]
    assert float(lines[0]["median_seconds"]) == swept.rows[0].median_seconds
    assert lines[2]["median_seconds"] == "" and lines[2]["error"] == swept.rows[2].error
    record = json.loads(swept.write_json(tmp_path / "sweep.json").read_text())
    assert record["profile"] == QUIET.source
    assert [r["step_seconds"] for r in record["rows"]] == [list(row.step_seconds) for row in swept.rows]


def test_wrong_arguments_are_refused_before_anything_compiles():
    model = TinyGPT(CFG)
    idx, targets = make_gpt_batch(CFG, 4)
    with pytest.raises(ValueError, match="policies="):
        slcompile.sweep(model, idx, targets, options={"schedule": ["speedloader"]})
    with pytest.raises(ValueError, match="both"):
        slcompile.sweep(model, idx, targets, options={"num_subbatches": [1, 2]}, num_subbatches=2)
    with pytest.raises(slcompile.OptionError, match="activations"):
        slcompile.sweep(model, idx, targets, options={"activations": ["device", "disk"]}, profile=None)
    with pytest.raises(ValueError, match="steps=0"):
        slcompile.sweep(model, idx, targets, steps=0)
    assert not slcompile.compile_reports()


def test_the_command_line_writes_the_table(tmp_path, capsys, monkeypatch):
    from slcompile import cli

    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(__import__("pathlib").Path(__file__).parent))
    code = cli.main(["sweep", "cli_targets:tiny", "--grid", "num-subbatches=2", "--grid", "activations=device",
                     "--steps", "1", "--warmup", "0", "--profile", "none", "--lowering", "aot_eager",
                     "--out", str(tmp_path / "out")])
    printed = capsys.readouterr().out
    assert code == 0, printed
    assert "no profile: nothing predicted" in printed
    with open(tmp_path / "out" / "sweep.csv") as f:
        (line,) = list(csv.DictReader(f))
    assert line["option.num_subbatches"] == "2" and line["option.activations"] == "device"
    assert line["compiled"] == "True" and line["steps"] == "1"
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["sweep"])
    assert cli.main(["sweep", "cli_targets:tiny", "--grid", "num_subbatches=2", "--num-subbatches", "2"]) == 1
    assert "fixed or swept" in capsys.readouterr().err
