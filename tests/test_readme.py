"""The README's code blocks run as written, as a new user would run them.

Each Python block runs alone in a fresh interpreter (a reader copies one block, not
the page; `fresh_process` forks it from a server that has imported torch and
transformers), with `lowering="aot_eager"` added to each `slcompile.options(...)`. The cheap shell lines (`slcompile ...`) run in a scratch folder; the
set-up commands, which create a virtual environment, are what CI itself runs.
"""

import os
import pathlib
import re

import pytest

import fresh_process

README = pathlib.Path(__file__).resolve().parent.parent / "README.md"


def _blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README.read_text(), flags=re.S)


def _env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("SLC_DISABLE", "PYTHONPATH")}


def _check_explain_output(stdout: str) -> None:
    assert "blocks: 2 (model.layers.0, model.layers.1)" in stdout
    assert "num_subbatches: 4" in stdout and "fallback: none" in stdout


def _check_step_output(stdout: str) -> None:
    last_step = next(line for line in stdout.splitlines() if line.startswith("moved "))
    # 2 steps closed by mark_step; the last one loaded block weights from nvme.
    assert re.match(r"moved .*weight nvme->device [\d.]+ (KiB|MiB) \(\d+\)", last_step), last_step


def _quick(code: str) -> str:
    """The block as written but for the lowering: Inductor's code generation of these
    graphs takes minutes on 2 cores, and tests/test_inductor.py checks it on the same
    passes."""
    quick = code.replace("slcompile.options(", 'slcompile.options(lowering="aot_eager", ')
    # Every compile takes its options from slcompile.options (SpeedLoaderTrainer compiles too).
    compiles = code.count("torch.compile(") + code.count("SpeedLoaderTrainer(")
    assert quick.count('lowering="aot_eager"') == code.count("slcompile.options(") >= compiles
    return quick


@pytest.mark.parametrize("index", range(len(_blocks("python"))))
def test_each_python_block_runs_alone_with_aot_eager(tmp_path, index):
    code = _blocks("python")[index]
    result = fresh_process.run_code(_quick(code), tmp_path, _env(), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    if "slcompile.explain(" in code:
        _check_explain_output(result.stdout)
    if "runtime_stats().last_step" in code:
        _check_step_output(result.stdout)


def test_the_blocks_show_explain_and_the_bytes_of_a_step():
    code = _blocks("python")
    assert any("slcompile.explain(" in block for block in code)
    assert any("runtime_stats().last_step" in block for block in code)


def _cli_lines() -> list[str]:
    lines = [line.split("#")[0].strip() for block in _blocks("sh") for line in block.splitlines()]
    return [line for line in lines if line.startswith("slcompile ")]


def _flag(command: list[str], flag: str) -> str | None:
    return command[command.index(flag) + 1] if flag in command else None


def _cli_examples() -> list[list[str]]:
    """The command lines but the demo, one example each, except that a line reading a
    schedule (`--schedule-file PATH`) runs after the line writing it
    (`--write-schedule PATH`), in the same folder."""
    examples: list[list[str]] = []
    for line in _cli_lines():
        read = _flag(line.split(), "--schedule-file")
        if line.startswith("slcompile demo"):
            continue
        if read is None:
            examples.append([line])
        else:
            next(e for e in examples if _flag(e[0].split(), "--write-schedule") == read).append(line)
    return examples


@pytest.mark.parametrize("lines", _cli_examples(), ids=lambda lines: lines[-1])
def test_command_line_examples_run_as_written(tmp_path, lines):
    for line in lines:
        _check_command_line(line.split(), tmp_path)


def _check_command_line(command: list[str], tmp_path: pathlib.Path) -> None:
    result = fresh_process.run_module("slcompile", command[1:], tmp_path, _env(), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / (_flag(command, "--out") or "slcompile-out")
    read = _flag(command, "--schedule-file")
    if read is not None:
        assert f"build=_Replay(name='{pathlib.Path(read).stem}')" in result.stdout or \
            f"\n{pathlib.Path(read).stem} " in result.stdout
    if command[1] == "explain":
        assert "fallback: none" in result.stdout
        for flag, name in (("--plot", "memory.png"), ("--predicted-trace", "predicted_timeline.png")):
            assert flag not in command or (out / name).stat().st_size > 0, name
        written = _flag(command, "--write-schedule")
        assert written is None or '"request": {' in (tmp_path / written).read_text()
    elif command[1] == "tune":
        assert "chosen options: {" in result.stdout
        assert "--schedule" not in command or "chosen policy: " in result.stdout
    else:
        assert command[1] == "compare" and "--no-run" in command, "a compare example that trains: keep it cheap"
        assert result.stdout.startswith("no step ran (--no-run)")
        assert (out / "table.txt").read_text().startswith("policy ")


def test_readme_set_up_commands_are_the_ones_ci_runs():
    set_up = [line for block in _blocks("sh") for line in block.splitlines() if line.startswith("python3 -m venv")]
    assert len(set_up) == 2
    demo, tests = set_up
    assert demo.endswith(".venv/bin/slcompile demo") and "-e '.[hf]'" in demo
    ci = (README.parent / ".ci" / "run").read_text()
    assert tests in ci
    # The example's import is installed by both set-up commands.
    extras = (README.parent / "pyproject.toml").read_text()
    assert re.search(r'^hf = \["transformers[>=<,.\d]*"', extras, flags=re.M)
    assert re.search(r'^test = \[[^]]*"transformers==', extras, flags=re.M)
