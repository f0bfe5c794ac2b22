"""The command line, run as a user would, in a subprocess."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

TESTS = os.path.dirname(__file__)


def _run(*args, timeout=600, pythonpath=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((TESTS, *map(str, pythonpath))))
    env.pop("SLC_DISABLE", None)
    return subprocess.run(
        [sys.executable, "-m", "slcompile", *args], capture_output=True, text=True, env=env, timeout=timeout
    )


def _written(stdout: str) -> list[pathlib.Path]:
    """The paths the command says it wrote (the lines under "pictures written to")."""
    lines = stdout.split("pictures written to", 1)[1].splitlines()[1:]
    return [pathlib.Path(p) for line in lines if line.startswith("  ") and not line.strip().startswith("(")
            for p in line.split()[1:]]


def test_demo_trains_matches_eager_and_writes_pictures(tmp_path):
    out = tmp_path / "pictures"
    result = _run("demo", "--lowering", "aot_eager", "--steps", "2", "--layers", "2", "--width", "32",
                  "--out", str(out))
    assert result.returncode == 0, result.stderr[-2000:]
    stdout = result.stdout
    assert "blocks: layers.0, layers.1" in stdout
    assert "fwd prefix.sb0-3 blk0.sb0-3 blk1.sb0-3 suffix.sb0-3" in stdout
    assert "fwd blk1.sb3" in (out / "schedule.txt").read_text()
    losses = [line for line in stdout.splitlines() if line.startswith("step ")]
    assert len(losses) == 2
    for line in losses:
        fields = line.split()
        ours, eager = float(fields[4]), float(fields[6])
        assert abs(ours - eager) < 1e-4
    assert re.search(r"forward and backward: weight nvme->device [\d.]+ KiB in \d+ transfers", stdout)
    # 2·P, plus the first block loaded ahead for the next step (dropped by gathered_weights).
    streamed = float(re.search(r"block weights streamed: P = ([\d.]+) KiB", stdout).group(1))
    loaded, ahead = map(float, re.search(r"forward and backward loaded ([\d.]+) KiB = 2 x P \+ ([\d.]+) KiB: "
                                         r"the first block", stdout).groups())
    assert abs(loaded - 2 * streamed - ahead) < 0.02 and 0 < ahead < streamed
    names = {p.name for p in _written(stdout)}
    assert {"forward.dot", "backward.dot", "trace.json", "timeline.png", "memory.png", "schedule.txt"} <= names
    assert all(path.exists() and path.stat().st_size > 0 for path in _written(stdout))
    assert "training" in result.stderr  # the progress bar


def test_explain_target():
    result = _run("explain", "cli_targets:tiny", "--num-subbatches", "2", "--lowering", "aot_eager")
    assert result.returncode == 0, result.stderr[-2000:]
    assert "blocks: 2 (layers.0, layers.1)" in result.stdout
    assert "fwd blk1.sb1" in result.stdout
    assert "pictures written" not in result.stdout


def test_explain_writes_the_pictures_it_names(tmp_path):
    result = _run("explain", "cli_targets:tiny", "--num-subbatches", "2", "--lowering", "aot_eager",
                  "--weights", "nvme", "--dot", "--plot", "--trace", "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert "fwd blk1.sb1" in result.stdout
    written = _written(result.stdout)
    assert {p.name for p in written} >= {"forward.dot", "backward.dot", "trace.json", "timeline.png", "memory.png"}
    assert all(path.parent == tmp_path and path.exists() for path in written)
    trace = json.loads((tmp_path / "trace.json").read_text())
    lanes = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert {"compute", "load"} <= lanes


def test_explain_dot_only(tmp_path):
    result = _run("explain", "cli_targets:tiny", "--lowering", "aot_eager", "--dot", "--detail", "ops",
                  "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    assert {p.name for p in _written(result.stdout)} >= {"forward.dot", "backward.dot"}
    assert not (tmp_path / "trace.json").exists() and not (tmp_path / "memory.png").exists()


def test_errors_are_one_line_and_non_zero(tmp_path):
    bad_target = _run("explain", "no_such_module:factory")
    assert bad_target.returncode != 0
    assert bad_target.stderr.strip().startswith("slcompile: error: ModuleNotFoundError")
    assert "Traceback" not in bad_target.stderr
    bad_option = _run("explain", "cli_targets:tiny", "--num-subbatches", "0")
    assert bad_option.returncode != 0
    assert "num_subbatches" in bad_option.stderr
    assert "Traceback" not in bad_option.stderr
    (tmp_path / "broken_targets.py").write_text(textwrap.dedent("""
        import torch

        def raising():
            raise RuntimeError("cannot build the model")

        def batchnorm():
            model = torch.nn.Sequential(*(torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.BatchNorm1d(8))
                                          for _ in range(3)))
            return model, (torch.randn(8, 8),)
    """))
    raising = _run("explain", "broken_targets:raising", pythonpath=[tmp_path])
    assert raising.returncode != 0
    assert raising.stderr.strip() == "slcompile: error: RuntimeError: cannot build the model"
    refused = _run("explain", "broken_targets:batchnorm", "--lowering", "aot_eager", "--on-refusal", "raise",
                   "--dot", "--out", str(tmp_path / "out"), pythonpath=[tmp_path])
    assert refused.returncode != 0
    assert "fallback: " in refused.stdout and "BatchNorm" in refused.stdout
    assert refused.stderr.strip().startswith("slcompile: error: RefusedError")
    assert len(refused.stderr.strip().splitlines()) == 1 and "Traceback" not in refused.stderr
    bad_steps = _run("demo", "--steps", "0")
    assert bad_steps.returncode != 0 and "--steps must be >= 1" in bad_steps.stderr


@pytest.mark.parametrize("command", ["demo", "explain", "tune", "compare"])
def test_help_documents_every_option(command):
    result = _run(command, "--help")
    assert result.returncode == 0
    flags = ["--num-subbatches", "--lowering", "--schedule", "--batch-dim", "--on-refusal", "--weights",
             "--live-blocks", "--offload-dir", "--memory-budget", "--policy-module"]
    flags += {"explain": ["--dot", "--plot", "--trace", "--out", "--detail"],
              "demo": ["--steps", "--layers", "--width", "--out", "--detail"], "tune": [],
              "compare": ["--policies", "--out", "--detail"]}[command]
    for flag in flags:
        assert flag in result.stdout, flag
    assert "(default:" in result.stdout
    # Each option's help names its default once, and the program's description is not
    # the module's docstring.
    options = re.split(r"\n  (?=-)", result.stdout)
    for text in options:
        assert len(re.findall(r"\bdefault\b", text)) <= 1, text
    main_help = _run("--help").stdout
    assert "demo" in main_help and "tune" in main_help and "compare" in main_help
    assert "the command line" not in main_help


def test_compare_a_registered_policy_by_name(tmp_path):
    result = _run("compare", "cli_targets:tiny", "--policy-module", "zigzag_policy", "--policies",
                  "speedloader,zigzag_test", "--lowering", "aot_eager", "--num-subbatches", "2", "--weights", "nvme",
                  "--out", str(tmp_path))
    assert result.returncode == 0, result.stderr[-2000:]
    lines = result.stdout.splitlines()
    assert lines[0].split()[:3] == ["policy", "peak", "predicted"] and "weight nvme->device" in lines[0]
    rows = [line.split() for line in lines[2:4]]
    assert [row[0] for row in rows] == ["speedloader", "zigzag_test"]
    assert rows[0][-1] == rows[1][-1]  # the same loss
    # The diff: zigzag runs block 1's sub-batch 1 first.
    assert "--- speedloader\n+++ zigzag_test" in result.stdout
    assert "+fwd blk1.sb1" in lines and "-fwd blk1.sb1" in lines
    written = _written(result.stdout)
    assert {tmp_path / "table.txt", tmp_path / "schedule.diff", tmp_path / "timelines.png",
            tmp_path / "zigzag_test" / "forward.dot", tmp_path / "speedloader" / "trace.json"} <= set(written)
    assert all(path.exists() for path in written)
    assert "sb1 · runs 1/2" in (tmp_path / "zigzag_test" / "forward.dot").read_text()
    # The schedule option is not how policies are named here.
    wrong = _run("compare", "cli_targets:tiny", "--policies", "speedloader", "--schedule", "grad_accumulation")
    assert wrong.returncode == 1 and "--policies a,b, not --schedule" in wrong.stderr


def test_explain_finds_the_target_in_the_current_folder_and_debug_goes_anywhere(tmp_path):
    (tmp_path / "mymodels.py").write_text(textwrap.dedent("""
        from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch

        def factory():
            cfg = GPTConfig(n_layers=2)
            return TinyGPT(cfg), make_gpt_batch(cfg, 4)
    """))
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "SLC_DISABLE")}
    for debug in (["--debug", "explain"], ["explain", "--debug"]):
        result = subprocess.run(
            [os.path.join(os.path.dirname(sys.executable), "slcompile"), *debug, "mymodels:factory",
             "--lowering", "aot_eager"],
            cwd=tmp_path, capture_output=True, text=True, env=env, timeout=600,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert "blocks: 2 (layers.0, layers.1)" in result.stdout
        assert "DEBUG slcompile" in result.stderr


def test_tune_prints_options_that_fit_or_the_smallest_budget():
    fits = _run("tune", "cli_targets:tiny", "--memory-budget", "1GiB", "--lowering", "aot_eager")
    assert fits.returncode == 0, fits.stderr[-2000:]
    assert "chosen options: {" in fits.stdout and "'memory_budget': 1073741824" in fits.stdout
    assert re.search(r"predicted peak: device [\d.]+ (KiB|MiB)", fits.stdout)
    too_small = _run("tune", "cli_targets:tiny", "--memory-budget", "1000", "--lowering", "aot_eager")
    assert too_small.returncode == 1
    assert too_small.stderr.startswith("slcompile: error: BudgetError: the step needs at least ")
    assert len(too_small.stderr.strip().splitlines()) == 1
    missing = _run("tune", "cli_targets:tiny")
    assert missing.returncode == 1 and "--memory-budget" in missing.stderr


def test_ready_llama_target_says_what_to_install_without_transformers():
    code = ("import sys; sys.modules['transformers'] = None; from slcompile.cli import main; "
            "sys.exit(main(['explain', 'slcompile.examples:tiny_llama']))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "slcompile: error: ModuleNotFoundError: tiny_llama needs transformers: pip install transformers "
        "(or try slcompile.examples:tiny_gpt, which needs nothing more)"
    )


@pytest.mark.parametrize("args", [("explain", "cli_targets:tiny", "--schedule", "zigzga"),
                                  ("compare", "cli_targets:tiny", "--policies", "speedloader,zigzga")])
def test_an_unknown_policy_names_the_flag_that_registers_one(args):
    result = _run(*args)
    assert result.returncode == 1
    line = result.stderr.strip()
    assert line.startswith("slcompile: error: OptionError: speedloader option 'schedule' must be a registered "
                           "policy's name") and "got 'zigzga'" in line
    assert line.endswith("on the command line, --policy-module MODULE imports a module that registers it")
