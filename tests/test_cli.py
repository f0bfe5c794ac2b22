"""The command line, run as a user would, in a subprocess."""

import os
import subprocess
import sys

TESTS = os.path.dirname(__file__)


def _run(*args, timeout=600):
    env = dict(os.environ, PYTHONPATH=TESTS)
    return subprocess.run(
        [sys.executable, "-m", "slcompile", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def test_demo_trains_and_matches_eager():
    result = _run("demo", "--lowering", "aot_eager", "--steps", "2", "--layers", "2", "--width", "32")
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "fwd blk1.sb3" in out
    losses = [line for line in out.splitlines() if line.startswith("step ")]
    assert len(losses) == 2
    for line in losses:
        fields = line.split()
        ours, eager = float(fields[4]), float(fields[6])
        assert abs(ours - eager) < 1e-4


def test_explain_target():
    result = _run("explain", "cli_targets:tiny", "--num-subbatches", "2", "--lowering", "aot_eager")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "blocks: 2 (layers.0, layers.1)" in result.stdout
    assert "fwd blk1.sb1" in result.stdout


def test_errors_are_one_line_and_non_zero():
    bad_target = _run("explain", "no_such_module:factory")
    assert bad_target.returncode != 0
    assert bad_target.stderr.strip().startswith("slcompile: error: ModuleNotFoundError")
    assert "Traceback" not in bad_target.stderr
    bad_option = _run("explain", "cli_targets:tiny", "--num-subbatches", "0")
    assert bad_option.returncode != 0
    assert "num_subbatches" in bad_option.stderr
    assert "Traceback" not in bad_option.stderr


def test_help_documents_every_option():
    result = _run("demo", "--help")
    assert result.returncode == 0
    for flag in ("--num-subbatches", "--lowering", "--schedule", "--batch-dim", "--on-refusal"):
        assert flag in result.stdout
