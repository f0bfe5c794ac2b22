"""The command line, run as a user would: in a subprocess, or by `main(argv)` in this process."""

import json
import os
import pathlib
import re
import subprocess
import sys
import textwrap

import pytest

import fresh_process

TESTS = os.path.dirname(__file__)


def _run(*args, timeout=600, pythonpath=()):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join((TESTS, *map(str, pythonpath))))
    env.pop("SLC_DISABLE", None)
    return fresh_process.run_module("slcompile", list(args), os.getcwd(), env, timeout=timeout)


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
    assert "fwd prefix.sb0-3 blk0.sb0-3 blk1.sb0-3 suffix" in stdout
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
    flags += {"explain": ["--dot", "--plot", "--trace", "--out", "--detail", "--profile", "--predicted-trace",
                          "--schedule-file", "--write-schedule"],
              "demo": ["--steps", "--layers", "--width", "--out", "--detail"],
              "tune": ["--profile", "--schedule-file"],
              "compare": ["--policies", "--out", "--detail", "--no-run", "--profile", "--schedule-file"]}[command]
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
    assert rows[0][-4] == rows[1][-4]  # the same loss (before the predicted step, "12.34 ms", and its bound)
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


def _main(capsys, *args) -> tuple[int, str, str]:
    """`slcompile ARGS` run in this process: (exit status, stdout, stderr)."""
    from slcompile.cli import main

    status = main([str(arg) for arg in args])
    captured = capsys.readouterr()
    return status, captured.out, captured.err


TINY = ("cli_targets:tiny", "--lowering", "aot_eager", "--num-subbatches", "2", "--weights", "nvme")


def test_tune_searches_the_listed_policies_and_says_which_won(capsys):
    status, out, err = _main(capsys, "tune", *TINY, "--live-blocks", "2", "--memory-budget", "1GiB",
                             "--schedule", "no_offload,grad_accumulation,speedloader", "--profile", "h100-pcie5-nvme")
    assert status == 0, err
    # Listed before it, grad_accumulation loses on the predicted time; no_offload cannot take nvme weights.
    assert "'schedule': 'speedloader'" in out and "'machine_profile': 'h100-pcie5-nvme'" in out
    assert "chosen policy: speedloader (of no_offload, grad_accumulation, speedloader)" in out
    assert re.search(r"why: predicted fastest on h100-pcie5-nvme of 2 plans that fit \(policies no_offload, "
                     r"grad_accumulation, speedloader\): [\d.]+ ms a step", out)
    tried = out.split("candidates tried (predicted device peak, step time):\n")[1].splitlines()
    assert "schedule=no_offload: refused (speedloader options 'schedule' and 'weights' conflict" in tried[0]
    assert [line.split("schedule=")[1].split(":")[0] for line in tried[1:]] == ["grad_accumulation", "speedloader"]
    status, _, err = _main(capsys, "explain", *TINY, "--schedule", "speedloader,grad_accumulation")
    assert status == 1 and "--schedule names one policy for explain" in err and "list is for tune" in err


def test_compare_no_run_ranks_predictions_without_a_step(capsys, tmp_path):
    import slcompile

    status, out, err = _main(capsys, "compare", *TINY, "--policies", "grad_accumulation,speedloader", "--no-run",
                             "--profile", "h100-pcie5-nvme", "--out", tmp_path)
    assert status == 0, err
    assert out.startswith("no step ran (--no-run): every figure is predicted, the step time on h100-pcie5-nvme")
    lines = out.splitlines()
    assert lines[1].split()[:3] == ["policy", "peak", "(plan)"] and "step predicted" in lines[1]
    assert "measured" not in lines[1] and "loss" not in lines[1]
    # Best first: speedloader fetches each block once for both sub-batches.
    assert [line.split()[0] for line in lines[3:5]] == ["speedloader", "grad_accumulation"]
    assert all(re.search(r"[\d.]+ ms\s+\w+$", line) for line in lines[3:5])
    assert slcompile.compile_reports() == []
    assert {p.name for p in _written(out)} == {"table.txt", "schedule.diff"}


def test_explain_predicts_on_a_named_profile_and_draws_it_without_a_step(capsys, tmp_path):
    import slcompile

    status, out, err = _main(capsys, "explain", *TINY, "--profile", "h100-pcie5-nvme", "--predicted-trace",
                             "--out", tmp_path)
    assert status == 0, err
    assert re.search(r"predicted time \(speedloader, K=\d+, on h100-pcie5-nvme; a prediction, not a measurement\):\n"
                     r"\s+step [\d.]+ ms, bound by", out)
    assert set(_written(out)) == {tmp_path / "predicted_trace.json", tmp_path / "predicted_timeline.png"}
    trace = json.loads((tmp_path / "predicted_trace.json").read_text())
    assert any(event.get("ph") == "X" for event in trace["traceEvents"])
    assert slcompile.compile_reports() == []
    status, _, err = _main(capsys, "explain", *TINY, "--profile", "h200-nowhere")
    assert status == 1 and err.startswith("slcompile: error: OptionError: --profile h200-nowhere: no machine profile")
    status, _, err = _main(capsys, "explain", *TINY, "--profile", "none", "--predicted-trace", "--out", tmp_path)
    assert status == 1 and "--predicted-trace" in err and "--profile none" in err


def test_explain_writes_the_schedule_that_schedule_file_replays(capsys, tmp_path):
    solver = tmp_path / "solver.json"
    status, written, err = _main(capsys, "explain", *TINY, "--schedule", "grad_accumulation", "--profile", "none",
                                 "--write-schedule", solver)
    assert status == 0, err
    assert f"schedule written to {solver} (32 steps, policy grad_accumulation)" in written
    assert json.loads(solver.read_text())["request"]["num_subbatches"] == 2
    status, replayed, err = _main(capsys, "explain", *TINY, "--profile", "none", "--schedule-file", solver)
    assert status == 0, err
    # grad_accumulation's suffix runs per micro-batch, and so does the replay's.
    assert "schedule=Policy(name='solver', build=_Replay(name='solver'), suffix='subbatches') (options)" in replayed
    assert replayed.split("schedule:\n")[1] == written.split("schedule:\n")[1].split("schedule written")[0]
    (tmp_path / "broken.json").write_text("{}")
    status, _, err = _main(capsys, "explain", *TINY, "--schedule-file", tmp_path / "broken.json")
    assert status == 1 and err.startswith(f"slcompile: error: OptionError: --schedule-file {tmp_path / 'broken.json'}: "
                                          "not a schedule's JSON")


def test_compare_and_tune_take_a_schedule_file(capsys, tmp_path):
    import slcompile
    from cli_targets import tiny

    model, inputs = tiny()
    explanation = slcompile.explain(model, *inputs, profile=None, schedule="grad_accumulation",
                                    **slcompile.options(lowering="aot_eager", num_subbatches=2, weights="nvme"))
    (tmp_path / "solver.json").write_text(explanation.planned_schedule.to_json())
    status, out, err = _main(capsys, "compare", *TINY, "--schedule-file", tmp_path / "solver.json", "--no-run",
                             "--profile", "none", "--out", tmp_path / "compare")
    assert status == 0, err
    assert out.splitlines()[3].split()[0] == "solver"
    status, out, err = _main(capsys, "tune", *TINY[:3], "--weights", "nvme", "--memory-budget", "1GiB",
                             "--schedule-file", tmp_path / "solver.json")
    assert status == 0, err
    assert "'schedule': 'solver'" in out and "'num_subbatches': 2" in out
    # Written for K=2: tune's K=1 candidates are refused, naming what differs.
    assert "schedule=solver: refused (schedule policy 'solver': replays a schedule written for another request: " \
           "num_subbatches=2 (the request has 1)" in out
