"""One entry point for the benchmarks: ``python -m bench SCENARIO [ARGS...]``.

Usage:
    python -m bench list                      # the scenarios and the command each runs
    python -m bench train [--quick] ...       # bench/train_bench.py with these arguments
    python -m bench prefill ...               # bench/prefill_bench.py
    python -m bench io ...                    # bench/io_bench.py
    python -m bench deepspeed ...             # bench/deepspeed_bench.py
    python -m bench activation ...            # bench/activation_bench.py
    python -m bench memory ...                # bench/memory_bench.py
    python -m bench optimizer ...             # bench/optimizer_bench.py
    python -m bench lora ...                  # bench/lora_bench.py
    python -m bench generate ...              # bench/generate_bench.py
    python -m bench distributed ...           # bench/distributed_bench.py
    python -m bench compile ...               # bench/compile_bench.py
    python -m bench overhead ...              # bench/overhead_bench.py
    python -m bench time ...                  # bench/time_bench.py
    python -m bench tune ...                  # bench/tune_bench.py
    python -m bench explain [--calls 200]     # bench/explain_bench.py
    python -m bench soak [--steps 1000]       # bench/soak_bench.py
    python -m bench gpu [--small|--cpu-smoke] # bench/gpu_bench.py (CUDA)
    python -m bench gpu --check [--out DIR]   # bench/gpu_check.py: the CUDA validation in one command
    python -m bench gpu --product [--only E0,E1,E2]   # bench/gpu_product.py: the product benchmark (CUDA)
    python -m bench all [--quick] [--only train,io]

A single scenario runs its script with the arguments given after its name, as
``python bench/<script>.py ARGS`` would (every script stays runnable on its own).
``all`` runs the scenarios one after another with the arguments bench/README.md
documents, writing bench/results/ (``--quick``: each script's smoke settings instead,
results in a temp dir), under a progress bar over scenarios; each script's own output
is kept in a log file and its result table printed (a script that prints one JSON
object gets it drawn as a table), then one table of every scenario's status and time;
a failed scenario does not stop the ones after it. Run from the repository root, with
the venv's python.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass

HERE = os.path.dirname(os.path.abspath(__file__))


@dataclass(frozen=True)
class Scenario:
    """A benchmark script and the arguments `all` runs it with."""

    name: str
    script: str
    full_args: tuple[str, ...]
    quick_args: tuple[str, ...]
    summary: str
    out_is_dir: bool = False  # its --out names a folder (several files), not a JSON path
    out_name: str | None = None  # the JSON's name in the results folder, if not the script's


SCENARIOS = (
    Scenario("train", "train_bench.py", ("--repeats", "3"), ("--quick", "--repeats", "1"),
             "training step, weights on nvme: speedloader vs gradient accumulation vs resident"),
    Scenario("prefill", "prefill_bench.py", ("--repeats", "3"), ("--repeats", "1"),
             "forward-only prefill: speedloader vs accelerate disk_offload"),
    Scenario("io", "io_bench.py", ("--gib", "2", "--repeats", "3"), ("--gib", "0.5", "--repeats", "1"),
             "nvme tier: transfer engine vs dd, overlap, page cache"),
    Scenario("deepspeed", "deepspeed_bench.py", ("--steps", "8", "--omp-wait-policy", "PASSIVE"),
             ("--quick", "--steps", "3"),
             "training: speedloader vs DeepSpeed ZeRO-3 offload (needs deepspeed installed)"),
    Scenario("activation", "activation_bench.py", ("--repeats", "3"),
             ("--quick", "--repeats", "1"),
             "saved activations: nvme tier and block recompute vs AOTAutograd's activation offloading"),
    Scenario("memory", "memory_bench.py", ("--d-model", "128"), ("--d-model", "64"),
             "predicted vs measured peak device memory of a training step"),
    Scenario("optimizer", "optimizer_bench.py", ("--repeats", "5"), ("--quick", "--repeats", "1"),
             "training with AdamW: offload_optimizer (host, nvme; speedloader and grad_accumulation) vs "
             "gathered_weights vs resident vs DeepSpeed ZeRO-3 (when installed)"),
    Scenario("lora", "lora_bench.py", ("--rounds", "7"), ("--quick",),
             "LoRA fine-tuning of a 2-layer Llama: the frozen base on nvme (adapters resident, or streamed with "
             "offload_optimizer) vs the base resident"),
    Scenario("generate", "generate_bench.py", ("--repeats", "1"), ("--quick",),
             "generation, weights and KV cache on nvme: slcompile.generate vs accelerate disk_offload vs resident"),
    Scenario("distributed", "distributed_bench.py", ("--steps", "5"), ("--quick", "--steps", "2"),
             "block weights sharded over 2 gloo ranks vs one process vs FSDP2 and DeepSpeed ZeRO-3 "
             "with gradient accumulation (collective bytes per step)"),
    Scenario("time", "time_bench.py", ("--rounds", "9"), ("--quick",),
             "predicted vs measured step time (the time model), and the H100 rows predicted on paper",
             out_name="time_model.json"),
    Scenario("tune", "tune_bench.py", ("--rounds", "9"), ("--quick",),
             "slcompile.tune's choice under a memory budget (with the machine's profile) vs the fastest measured "
             "plan that fits"),
    Scenario("overhead", "overhead_bench.py", ("--steps", "30"), ("--quick",),
             "host time of a launch-bound step: speedloader vs plain Inductor, ops outside compiled code, "
             "host us per slc:: op"),
    Scenario("compile", "compile_bench.py", (), ("--quick",),
             "compile seconds of a training step: speedloader + Inductor at K and depth vs plain Inductor"),
    Scenario("explain", "explain_bench.py", ("--calls", "200"), ("--calls", "20"),
             "resident memory of a sweep of explain calls on one model: capture guards released vs kept"),
    Scenario("soak", "soak_bench.py", ("--steps", "300"), ("--steps", "20", "--warmup", "5"),
             "many training steps with weights, activations and AdamW states on nvme: resident memory, open "
             "files and arena disk bytes per step (growth after warm-up)"),
    Scenario("gpu", "gpu_bench.py", (), ("--cpu-smoke",),
             "HF Llama training step on a CUDA GPU: tiers and K vs resident Inductor (needs CUDA; not in `all` "
             "unless named in --only)"),
    Scenario("gpu_check", "gpu_check.py", (), ("--cpu-smoke",),
             "the CUDA validation in one command (also `gpu --check`): cuda_check tests, then the gpu rows that "
             "decide the goals, one JSON and plot, within --budget-s (needs CUDA)", out_is_dir=True),
    Scenario("gpu_product", "gpu_product.py", (), ("--cpu-smoke",),
             "the product benchmark (also `gpu --product`): Llama layers of hidden 4096 at sequence 2048, resident "
             "Inductor vs weights on host, and 5 B parameters beyond a device cap vs FSDP2 CPU offload, with MFU "
             "(needs CUDA)"),
)
# Scenarios `all` runs unless --only names them: they need hardware this machine may lack.
NEEDS_CUDA = ("gpu", "gpu_check", "gpu_product")
BY_NAME = {scenario.name: scenario for scenario in SCENARIOS}


def command_for(scenario: Scenario, args: list[str]) -> list[str]:
    return [sys.executable, os.path.join(HERE, scenario.script), *args]


def as_table(stdout: str) -> str:
    """A script's output for people: printed as it is, unless it is one JSON object,
    which becomes a table of its leaves (sizes in 1024-based units)."""
    import io
    import json

    try:
        record = json.loads(stdout)
    except ValueError:
        return stdout
    if not isinstance(record, dict):
        return stdout
    rows = []

    def leaves(prefix: str, value) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                leaves(f"{prefix}.{key}" if prefix else str(key), inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and prefix.endswith("bytes"):
            from slcompile.units import format_bytes

            rows.append((prefix, format_bytes(value)))
        elif isinstance(value, float):
            rows.append((prefix, f"{value:.4g}"))
        else:
            rows.append((prefix, str(value)))

    leaves("", record)
    out = io.StringIO()
    print_table(("figure", "value"), rows, file=out)
    return out.getvalue()


def print_table(header: tuple[str, ...], rows: list[tuple[str, ...]], file=None) -> None:
    """Prints rows under a header: with `rich` when it is installed, else as plain
    aligned text."""
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(str(cell)) for cell in column) for column in zip(header, *rows)]
        for row in (header, tuple("-" * w for w in widths), *rows):
            print("  ".join(str(cell).ljust(w) for cell, w in zip(row, widths)).rstrip(), file=file)
        return
    table = Table(*header)
    for row in rows:
        table.add_row(*map(str, row))
    Console(file=file or sys.stdout, width=200).print(table)


def run_all(names: list[str], quick: bool, results_dir: str | None) -> int:
    """Runs the scenarios in order under one progress bar; returns the exit status."""
    from tqdm import tqdm

    log_dir = tempfile.mkdtemp(prefix="slc-bench-logs-")
    # Smoke runs must not overwrite the measured results next to the README.
    results_dir = results_dir or (log_dir if quick else os.path.join(HERE, "results"))
    failed = []
    summary: list[tuple[str, ...]] = []
    bar = tqdm(names, desc="benchmarks", unit="scenario")
    for name in bar:
        scenario = BY_NAME[name]
        args = [*(scenario.quick_args if quick else scenario.full_args)]
        if results_dir != os.path.join(HERE, "results"):
            name = scenario.out_name or scenario.script.replace(".py", "" if scenario.out_is_dir else ".json")
            args += ["--out", os.path.join(results_dir, name)]
        bar.set_postfix_str(name)
        log_path = os.path.join(log_dir, f"{name}.log")
        started = time.perf_counter()
        with open(log_path, "w") as log:
            # The scripts' own progress bars and warnings go to the log; their
            # tables (stdout) are shown once the scenario is done.
            proc = subprocess.run(command_for(scenario, args), stdout=subprocess.PIPE, stderr=log, text=True)
        seconds = time.perf_counter() - started
        shown = " ".join(["python", f"bench/{scenario.script}", *args])
        status = "ok" if proc.returncode == 0 else "FAILED"
        tqdm.write(f"== {name} ({shown}): {status} in {seconds:.0f} s")
        tqdm.write(as_table(proc.stdout).rstrip())
        summary.append((name, status, f"{seconds:.0f}", shown))
        if proc.returncode != 0:
            failed.append(name)
            with open(log_path) as log:
                tqdm.write("".join(log.readlines()[-15:]).rstrip())
    bar.close()
    print_table(("scenario", "status", "seconds", "command"), summary)
    print(f"logs: {log_dir}; results: {results_dir}")
    if failed:
        print(f"failed: {', '.join(failed)}")
        return 1
    return 0


def main() -> None:
    names = [scenario.name for scenario in SCENARIOS]
    argv = sys.argv[1:]
    if argv[:1] == ["gpu"] and "--check" in argv[1:]:
        # `gpu --check`: the whole CUDA validation (bench/gpu_check.py), not the full table.
        argv = ["gpu_check", *(arg for arg in argv[1:] if arg != "--check")]
    elif argv[:1] == ["gpu"] and "--product" in argv[1:]:
        # `gpu --product`: the product benchmark (bench/gpu_product.py).
        argv = ["gpu_product", *(arg for arg in argv[1:] if arg != "--product")]
    if argv and argv[0] in BY_NAME:
        # Everything after the scenario's name belongs to its script.
        scenario = BY_NAME[argv[0]]
        raise SystemExit(subprocess.call(command_for(scenario, argv[1:])))

    parser = argparse.ArgumentParser(
        prog="python -m bench",
        description="Runs slcompile's benchmarks: one scenario with its script's own arguments, or all of "
                    "them one after another (results in bench/results/).",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="{list,all," + ",".join(names) + "}")
    commands.add_parser("list", help="the scenarios and the commands `all` runs")
    every = commands.add_parser("all", help="run the scenarios one after another")
    every.add_argument("--quick", action="store_true", help="each script's smoke settings")
    every.add_argument("--only", default=",".join(n for n in names if n not in NEEDS_CUDA),
                       help=f"comma-separated subset of {','.join(names)}")
    every.add_argument("--results-dir", default=None,
                       help="where the JSON and PNG files go (default: bench/results; with --quick, a temp dir)")
    for scenario in SCENARIOS:
        commands.add_parser(scenario.name, help=f"{scenario.summary} (arguments go to bench/{scenario.script})")
    args = parser.parse_args(argv)
    if args.command == "list":
        for scenario in SCENARIOS:
            print(f"{scenario.name:10} {scenario.summary}")
            print(f"{'':10} full:  python bench/{scenario.script} {' '.join(scenario.full_args)}")
            print(f"{'':10} quick: python bench/{scenario.script} {' '.join(scenario.quick_args)}")
        return
    chosen = [name.strip() for name in args.only.split(",") if name.strip()]
    unknown = sorted(set(chosen) - set(names))
    if unknown:
        parser.error(f"unknown scenario(s) {', '.join(unknown)}; choose from {', '.join(names)}")
    raise SystemExit(run_all(chosen, args.quick, args.results_dir))


if __name__ == "__main__":
    main()
