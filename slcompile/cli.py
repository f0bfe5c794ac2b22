"""`slcompile demo | explain | tune | compare`: the command line.

`slcompile demo` trains a small GPT for a few steps with the speedloader backend next
to eager PyTorch, prints the schedule, the bytes moved and both losses, and writes the
pictures (graphs, timeline, memory) into an output folder. `slcompile explain
module:factory` prints what the backend would do with a model (`factory()` returns
`(model, args)` or `(model, args, kwargs)`; the module is looked up in the current
folder too, and `slcompile.examples:tiny_gpt` is ready to try); with `--dot`,
`--plot` or `--trace` it also compiles the model, runs one training step and writes
those pictures; `--profile` names the machine its step time is predicted for and
`--predicted-trace` draws that prediction, with no step run. `slcompile tune
module:factory --memory-budget 2GiB` chooses the options that fit a budget
(`--schedule a,b` searches over policies too). `slcompile compare module:factory
--policies a,b` trains one step per policy and prints their figures side by side,
the schedule diff, and writes the pictures of each (`slcompile.compare_policies`;
`--no-run` ranks the policies from predictions alone). A schedule goes out as JSON
with `explain --write-schedule PATH` and comes back, replayed as the policy
(`slcompile.schedules.replay`), with `--schedule-file PATH`. Errors print one line
and exit non-zero; `--debug` (before or after the command) shows the traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import importlib
import itertools
import logging
import pathlib
import re
import sys
import time
from types import MappingProxyType

import torch

from slcompile.config import GENERATION_ONLY, SpeedLoaderConfig
from slcompile.errors import OptionError, ProfileError
from slcompile.units import format_bytes
from slcompile.viz.dot import AUTO_SUMMARY_NODES

__all__ = ["main"]

log = logging.getLogger(__name__)

DEFAULT_OUT = "slcompile-out"


def _add_config_flags(parser: argparse.ArgumentParser, defaults: dict | None = None,
                      helps: dict | None = None) -> None:
    """One flag per config option (`--num-subbatches 4`), documented from the dataclass
    (or by `helps[name]`, where the command reads the flag its own way)."""
    doc = SpeedLoaderConfig.__doc__ or ""
    group = parser.add_argument_group("backend options (as in torch.compile(..., options={...}))")
    for field in dataclasses.fields(SpeedLoaderConfig):
        if field.name in GENERATION_ONLY:
            continue
        flag = "--" + field.name.replace("_", "-")
        help_text = (helps or {}).get(field.name) or _field_doc(doc, field.name)
        kind = str if field.default is None else type(field.default)
        if defaults and field.name in defaults:  # this command's own default
            help_text = f"{_without_default(help_text)} (default here: {defaults[field.name]})"
        elif "default" not in help_text:  # the docstring states most defaults itself
            help_text = f"{help_text} (default: {field.default})"
        group.add_argument(flag, dest=field.name, type=kind, default=None, metavar=field.name.upper(),
                           help=help_text)
    group.add_argument("--policy-module", dest="policy_modules", action="append", default=[], metavar="MODULE",
                       help="import MODULE first (repeatable), so the policies it registers with "
                            "slcompile.schedules.register_policy can be named by --schedule")


def _without_default(text: str) -> str:
    """The option's documentation without the sentence part naming its default."""
    return re.sub(r"\s*\(default[^)]*\)", "", text)


def _field_doc(doc: str, name: str) -> str:
    lines = doc.splitlines()
    for i, line in enumerate(lines):
        if line.strip().startswith(f"{name}:"):
            text = [line.strip()[len(name) + 1 :].strip()]
            for follow in lines[i + 1 :]:
                if not follow.startswith(" " * 12):
                    break
                text.append(follow.strip())
            return " ".join(text).replace("%", "%%")
    return ""


def _add_picture_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                        help=f"folder the pictures are written to (default: ./{DEFAULT_OUT})")
    parser.add_argument("--detail", choices=("auto", "ops", "summary"), default="auto",
                        help="graph pictures: one box per op (ops), one box per (block, sub-batch) "
                             f"(summary), or ops up to {AUTO_SUMMARY_NODES} nodes and summary above "
                             "(auto; default)")


def _add_schedule_file_flag(parser: argparse.ArgumentParser, help_text: str, repeat: bool = False) -> None:
    dest = "schedule_files" if repeat else "schedule_file"
    parser.add_argument("--schedule-file", dest=dest, metavar="PATH", help=help_text,
                        **({"action": "append", "default": []} if repeat else {}))


def _options(args: argparse.Namespace, **defaults) -> dict:
    _import_policy_modules(args)
    options = dict(defaults)
    for field in dataclasses.fields(SpeedLoaderConfig):
        if field.name in GENERATION_ONLY:
            continue
        value = getattr(args, field.name)
        if value is not None:
            options[field.name] = value
    if "schedule" in options:
        names = _policy_names(options["schedule"], "--schedule")
        if len(names) > 1 and args.command != "tune":
            compare = " (compare takes its policies as --policies A,B)" if args.command == "compare" else ""
            raise OptionError(f"--schedule names one policy for {args.command}, got {options['schedule']!r}; a "
                              f"comma-separated list is for tune{compare}")
        options["schedule"] = names if len(names) > 1 else names[0]
    return options


def _policy_names(text: str, flag: str) -> list[str]:
    """The policy names of a comma-separated flag value, each checked."""
    names = [name.strip() for name in text.split(",") if name.strip()]
    if not names:
        raise OptionError(f"{flag} needs a policy name (or several, comma-separated), got {text!r}")
    for name in names:
        _check_policy_name(name)
    return names


def _check_policy_name(name) -> None:
    """Refuses a `--schedule` no policy is registered under, saying how the command
    line registers one."""
    from slcompile.schedules.policies import unknown_policy

    problem = unknown_policy(name) if name is not None else None
    if problem:
        raise OptionError(f"{problem}; on the command line, --policy-module MODULE imports a module that "
                          "registers it")


def _replayed(path: str):
    """The policy that replays the schedule of a `--schedule-file` (the JSON of
    `Schedule.to_json()`), named after the file."""
    from slcompile.schedules import Schedule, replay

    file = pathlib.Path(path)
    try:
        text = file.read_text()
    except OSError as err:
        raise OptionError(f"--schedule-file {path}: cannot read it ({err.strerror or err})") from None
    try:
        schedule = Schedule.from_json(text)
    except (ValueError, TypeError) as err:
        raise OptionError(f"--schedule-file {path}: {err}; give the JSON of Schedule.to_json(), as "
                          "`slcompile explain TARGET --write-schedule PATH` writes it") from None
    return replay(schedule, name=file.stem)


def _machine(args: argparse.Namespace, options: dict):
    """The `MachineProfile` of `--profile` (None for "none")."""
    from slcompile.measure import machine_profile

    if args.profile is None or args.profile.lower() == "none":
        return None
    try:
        return machine_profile(args.profile, offload_dir=options.get("offload_dir"), refuse_untrusted=True)
    except ProfileError as err:
        raise OptionError(f"--profile {args.profile}: {err}") from None
    except (ValueError, TypeError, OSError) as err:
        raise OptionError(f"--profile {args.profile}: {err}; --profile takes current, none, a named profile or "
                          "a profile's JSON file") from None


def _named_profiles() -> str:
    from slcompile.analysis.machine import NAMED_PROFILES

    return ", ".join(NAMED_PROFILES)


def _import_policy_modules(args: argparse.Namespace) -> None:
    """Imports the `--policy-module`s (from the current folder too, as `python -m`
    does), whose import registers the policies `--schedule` names."""
    modules = getattr(args, "policy_modules", None) or []
    if modules and "" not in sys.path and str(pathlib.Path.cwd()) not in sys.path:
        sys.path.insert(0, str(pathlib.Path.cwd()))
    for name in modules:
        importlib.import_module(name)


def _note_whole_graphs(config, report) -> None:
    """Says why the timeline has no compute regions: Inductor compiled the graphs whole."""
    if config.lowering != "aot_eager" and not report.regions:
        print("note: Inductor compiled the graphs whole (compile_regions=False, or Inductor failed on its "
              "regions), so the timeline has no compute regions; --lowering aot_eager or compile_regions=True "
              "records them")


def _print_written(out: pathlib.Path, written: dict) -> None:
    from slcompile.viz.dot import dot_available

    print(f"pictures written to {out}/:")
    for name, paths in written.items():
        print(f"  {name:9s} " + "  ".join(str(p) for p in paths))
    if any(name.rsplit("/", 1)[-1] in ("forward", "backward") for name in written) and not dot_available():
        print("  (Graphviz `dot` is not installed: the graphs are DOT text; apt-get install graphviz to render)")


# -- demo ----------------------------------------------------------------------

DEMO_DEFAULTS = MappingProxyType({"num_subbatches": 4, "weights": "nvme"})


def _demo(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from slcompile.examples import GPTConfig, TinyGPT, make_gpt_batch
    from slcompile.report import compile_reports
    from slcompile.runtime.stats import mark_step, runtime_stats
    from slcompile.runtime.weights import drain_prefetches
    from slcompile.viz.pictures import record_step, write_pictures
    from slcompile.viz.summary import summarize_bytes, summarize_schedule

    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")
    defaults = dict(DEMO_DEFAULTS)
    if args.schedule == "no_offload":
        defaults["weights"] = "device"  # the demo's nvme default; an explicit --weights still conflicts
    options = _options(args, **defaults)
    config = SpeedLoaderConfig.from_options(options)
    out = pathlib.Path(args.out)
    torch.manual_seed(0)
    model_config = GPTConfig(n_layers=args.layers, d_model=args.width, seq_len=args.seq_len, vocab_size=256)
    eager = TinyGPT(model_config)
    model = copy.deepcopy(eager)
    compiled = torch.compile(model, backend="speedloader", options=options)
    optimizers = [torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9) for m in (eager, model)]
    print(
        f"slcompile demo: GPT with {args.layers} blocks, d_model {args.width}, batch {args.batch}, "
        f"K={config.num_subbatches}, schedule {config.schedule}, lowering {config.lowering}, "
        f"weights on {config.weights}"
    )
    recorded = None
    losses: list[float] = []
    progress = tqdm(range(args.steps), desc="training", unit="step", file=sys.stderr, dynamic_ncols=True)
    for step in progress:
        idx, targets = make_gpt_batch(model_config, args.batch, seed=step)
        started = time.perf_counter()
        eager_loss = _train_step(eager, optimizers[0], idx, targets)

        def compiled_step():
            losses.append(_train_step(compiled, optimizers[1], idx, targets, model, after_backward))

        def after_backward():
            # The loads issued ahead at the end of the backward finish before the count
            # is read, so the figures do not depend on how fast the disk answered.
            drain_prefetches()
            after_backward.stats = runtime_stats().current_step

        if step == args.steps - 1 and step > 0:  # a step after the compile: what it costs each time
            recorded = record_step(compiled_step, _sample_interval(config))
        else:
            compiled_step()
            mark_step()
        took = time.perf_counter() - started
        if step == 0:
            progress.set_description("training (compiled)")
            report = compile_reports()[-1]
            _print_report(report, config, out, summarize_schedule, progress)
        ours = losses[-1]
        progress.write(
            f"step {step}: loss speedloader {ours:.6f}  eager {eager_loss:.6f}  "
            f"|diff| {abs(ours - eager_loss):.2e}  ({took:.1f} s)",
            file=sys.stdout,
        )
    progress.close()
    report = compile_reports()[-1]
    if recorded is not None:
        passes = after_backward.stats
        update = {key: n - passes.bytes_moved.get(key, 0) for key, n in recorded.stats.bytes_moved.items()}
        update_count = {key: n - passes.transfers.get(key, 0) for key, n in recorded.stats.transfers.items()}
        print(f"bytes moved in step {args.steps - 1}:")
        print(f"  forward and backward: {summarize_bytes(passes.bytes_moved, passes.transfers)}")
        print(f"  optimizer step:       {summarize_bytes({k: n for k, n in update.items() if n}, update_count)}")
        if report.streamed_bytes:
            groups = report.planned_schedule.fetch_groups() if report.planned_schedule is not None else {}
            block = min((b for b, _ in groups), default=None)
            visits = len({group for (b, _), group in groups.items() if b == block}) or 1
            fetches = 2 * visits
            if visits == config.num_subbatches > 1:
                how = f"fetched once per sub-batch: {config.num_subbatches} times in the forward and in the backward"
            elif visits > 1:
                how = f"fetched once per run of sub-batches: {visits} times in the forward and in the backward"
            else:
                how = f"forward and backward each fetch every block once, for all {config.num_subbatches} sub-batches"
            print(f"block weights streamed: P = {format_bytes(report.streamed_bytes)} ({how})")
            _explain_weight_loads(passes.bytes_moved, report.streamed_bytes, fetches)
    written = write_pictures(out, report, recorded, detail=args.detail)
    _print_written(out, written)
    _note_whole_graphs(config, report)
    return 0


def _explain_weight_loads(bytes_moved, streamed_bytes: int, fetches: int) -> None:
    """Says what the forward and backward's weight loads are made of: `fetches` times
    P, and what the backward loaded ahead for the next step."""
    loads = sum(n for (kind, _, destination), n in bytes_moved.items()
                if getattr(kind, "value", kind) == "weight" and getattr(destination, "value", destination) == "device")
    ahead = loads - fetches * streamed_bytes
    line = f"  forward and backward loaded {format_bytes(loads)} = {fetches} x P"
    if ahead > 0:
        line += (f" + {format_bytes(ahead)}: the first block(s), loaded ahead after the backward for the next "
                 "step's forward; gathered_weights drops that load before the optimizer step, whose own loads "
                 "and stores of P are counted above")
    print(line)


def _sample_interval(config: SpeedLoaderConfig) -> float | None:
    """Resident bytes are sampled at region markers; graphs without them (Inductor)
    are sampled on a 2 ms timer instead."""
    return None if config.lowering == "aot_eager" else 0.002


def _train_step(runner, optimizer, idx, targets, offloaded_model=None, after_backward=None) -> float:
    import slcompile

    optimizer.zero_grad()
    _, loss = runner(idx, targets)
    loss.backward()
    if after_backward is not None:
        after_backward()
    gathered = slcompile.gathered_weights(offloaded_model) if offloaded_model is not None else contextlib.nullcontext()
    with gathered:  # parameters that rest on nvme are read and written back around the update
        optimizer.step()
    return loss.item()


def _print_report(report, config, out: pathlib.Path, summarize_schedule, progress) -> None:
    lines = []
    if report.fallback_reason:
        lines.append(f"fallback: {report.fallback_reason}")
    else:
        steps = len(report.schedule.splitlines())
        lines.append(f"blocks: {', '.join(report.blocks)}")
        lines.append(f"schedule: {steps} steps, K={config.num_subbatches} (one line per step in {out / 'schedule.txt'})")
        lines += ["  " + line for line in summarize_schedule(report.schedule).splitlines()]
    for line in lines:
        progress.write(line, file=sys.stdout)


# -- explain -------------------------------------------------------------------

def _load_target(target: str):
    if ":" not in target:
        raise ValueError(f"TARGET must be module:factory, got {target!r}")
    module_name, factory_name = target.split(":", 1)
    if "" not in sys.path and str(pathlib.Path.cwd()) not in sys.path:
        # As `python -m` does: a module in the current folder is found (`slcompile`
        # runs as a script, whose sys.path starts at the script's own folder).
        sys.path.insert(0, str(pathlib.Path.cwd()))
    module = importlib.import_module(module_name)
    factory = getattr(module, factory_name, None)
    if factory is None:
        raise ValueError(f"{module_name} has no attribute {factory_name!r}")
    made = factory()
    if not isinstance(made, tuple) or len(made) not in (2, 3):
        raise ValueError(f"{target}() must return (model, args) or (model, args, kwargs)")
    model, call_args = made[0], tuple(made[1])
    call_kwargs = dict(made[2]) if len(made) == 3 else {}
    return model, call_args, call_kwargs


def _explain(args: argparse.Namespace) -> int:
    from slcompile.explain import explain

    model, call_args, call_kwargs = _load_target(args.target)
    options = _options(args)
    if args.schedule_file is not None:
        if "schedule" in options:
            raise OptionError("--schedule and --schedule-file both choose the policy: give one of them")
        options["schedule"] = _replayed(args.schedule_file)
    machine = _machine(args, options)
    if args.predicted_trace and machine is None:
        raise OptionError("--predicted-trace draws the step predicted on --profile, and --profile none predicts "
                          "none: give --profile current or a named profile")
    pictures = [name for name in ("dot", "trace", "plot") if getattr(args, name)]
    # explain() runs the model once; the pictures compile and run a copy.
    copied = copy.deepcopy(model) if pictures else None
    explanation = explain(model, *call_args, kwargs=call_kwargs, profile=machine, **options)
    print(explanation)
    if args.write_schedule is not None:
        _write_schedule(explanation, pathlib.Path(args.write_schedule))
    out = pathlib.Path(args.out)
    written = {}
    if args.predicted_trace:
        if explanation.time is None:
            raise OptionError("--predicted-trace: the first graph would compile plainly (its fallback is printed "
                              "above), so there is no predicted step to draw")
        written.update(explanation.write_predicted_timeline(out))
    recorded_report = None
    if pictures:
        drawn, recorded_report = _explain_pictures(copied, call_args, call_kwargs, options, pictures, args)
        written.update(drawn)
    if written:
        _print_written(out, written)
    if recorded_report is not None:
        _note_whole_graphs(recorded_report.config, recorded_report)
    return 0


def _write_schedule(explanation, path: pathlib.Path) -> None:
    """Writes the first graph's schedule as JSON (`Schedule.to_json()`), which
    `--schedule-file` replays."""
    schedule = explanation.planned_schedule
    if schedule is None:
        raise OptionError(f"--write-schedule {path}: the first graph would compile plainly (its fallback is printed "
                          "above), so it has no schedule to write")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(schedule.to_json())
    others = len(explanation.graphs) - 1
    policy = getattr(schedule.policy, "name", None)
    print(f"schedule written to {path} ({len(schedule.steps)} steps"
          + (f", policy {policy}" if policy else "")
          + (f"; graph 0's, of {others + 1} graphs" if others else "")
          + f"); --schedule-file {path} replays it")


def _explain_pictures(model, call_args, call_kwargs, options, pictures, args):
    """Compiles `model`, runs a training step and writes `pictures`; returns the paths
    by picture and the compile report when a step was recorded (else None)."""
    from slcompile.report import compile_reports
    from slcompile.viz.pictures import record_step, write_pictures

    torch._dynamo.reset()
    compiled = torch.compile(model, backend="speedloader", options=options)

    def step():
        loss = _loss_of(compiled(*call_args, **call_kwargs))
        if loss is not None:
            loss.backward()

    step()  # compiles the forward and (on backward) the backward
    config = SpeedLoaderConfig.from_options(options)
    recorded = (record_step(step, _sample_interval(config), allocations="plot" in pictures)
                if {"trace", "plot"} & set(pictures) else None)
    report = compile_reports()[-1]
    written = write_pictures(pathlib.Path(args.out), report, recorded, pictures, detail=args.detail)
    return written, report if recorded is not None else None


def _tune(args: argparse.Namespace) -> int:
    from slcompile.tune import tune

    model, call_args, call_kwargs = _load_target(args.target)
    options = _options(args)
    if "memory_budget" not in options:
        raise ValueError("tune needs --memory-budget (bytes or a size like 2GiB)")
    budget = options.pop("memory_budget")
    for fixed in ("num_subbatches", "live_blocks"):  # tune chooses these
        if fixed in options:
            options[fixed] = [options[fixed]]
    if args.schedule_files:
        named = options.get("schedule", [])
        named = named if isinstance(named, list) else [named]
        options["schedule"] = [*named, *map(_replayed, args.schedule_files)]
    machine = _machine(args, options)
    result = tune(model, *call_args, kwargs=call_kwargs, memory_budget=budget, profile=machine, **options)
    chosen = dict(result.options)
    if machine is not None:  # the profile as the option names it, not its object
        chosen["machine_profile"] = args.profile
    policy = chosen.get("schedule")
    if policy is not None and not isinstance(policy, str):  # a replayed schedule: its file
        chosen["schedule"] = policy.name
    print(f"chosen options: {chosen}")
    if isinstance(options.get("schedule"), list):
        policies = [getattr(p, "name", p) for p in options["schedule"]]
        print(f"chosen policy: {getattr(policy, 'name', policy)} (of {', '.join(policies)})")
    print(result.memory)
    if result.why:
        print(f"why: {result.why}")
    print("candidates tried (predicted device peak" + (", step time" if machine is not None else "") + "):")
    for line in _candidate_lines(result.tried):
        print(f"  {line}")
    return 0


def _candidate_lines(tried) -> list[str]:
    """One line per candidate, but a run of candidates refused for one reason under one
    policy (`no_offload` with weights off the device) is its first line and a count."""
    lines: list[str] = []
    for (policy, refused), run in itertools.groupby(
            tried, key=lambda c: (c.policy, c.refused) if c.refused is not None else (id(c), None)):
        run = list(run)
        lines.append(run[0].describe())
        if len(run) > 1:
            lines.append(f"  ({len(run) - 1} more candidates of schedule={policy} refused the same way)")
    return lines


def _loss_of(output) -> torch.Tensor | None:
    from slcompile.compare import loss_of

    return loss_of(output)


def _compare(args: argparse.Namespace) -> int:
    from slcompile.compare import compare_policies

    model, call_args, call_kwargs = _load_target(args.target)
    options = _options(args)
    if "schedule" in options:
        raise ValueError("compare takes the policies to compare as --policies a,b, not --schedule")
    if args.policies is None and not args.schedule_files:
        raise ValueError("compare needs the policies to compare: --policies a,b and/or --schedule-file PATH")
    policies = _policy_names(args.policies, "--policies") if args.policies is not None else []
    for replayed in map(_replayed, args.schedule_files):
        if replayed.name in [getattr(p, "name", p) for p in policies]:
            raise OptionError(f"--schedule-file: two policies named {replayed.name!r} (a file is replayed under "
                              "its name without .json): rename the file")
        policies.append(replayed)
    machine = _machine(args, options)
    comparison = compare_policies(model, *call_args, policies=policies, kwargs=call_kwargs, profile=machine,
                                  run=not args.no_run, **options)
    if args.no_run:
        print("no step ran (--no-run): every figure is predicted"
              + (f", the step time on {machine.name}" if machine is not None else "")
              + "; best first (lowest peak, then bytes moved, then step time)")
    print(comparison)
    out = pathlib.Path(args.out)
    written = comparison.write(out, detail=args.detail)
    _print_written(out, written)
    return 0


def _grid(entries: list[str]) -> dict[str, list]:
    """`--grid OPTION=V1,V2` entries as {option: [values]}, each value parsed as the
    option's own flag parses it."""
    fields = {f.name: f for f in dataclasses.fields(SpeedLoaderConfig) if f.name not in GENERATION_ONLY}
    grid: dict[str, list] = {}
    for entry in entries:
        name, _, text = entry.partition("=")
        name = name.strip().replace("-", "_")
        if name not in fields or not text:
            raise OptionError(f"--grid {entry!r}: expected OPTION=V1,V2,... with OPTION one of the backend options "
                              f"(num_subbatches, activations, ...)")
        if name == "schedule":
            raise OptionError("--grid schedule=...: the policies are swept by --policies A,B")
        default = fields[name].default
        kind = str if default is None else type(default)
        parse = (lambda word: word.lower() in ("1", "true", "yes")) if kind is bool else kind
        try:
            grid[name] = [parse(word.strip()) for word in text.split(",")]
        except ValueError as err:
            raise OptionError(f"--grid {entry!r}: {err}") from None
    return grid


def _sweep(args: argparse.Namespace) -> int:
    from slcompile.sweep import sweep

    model, call_args, call_kwargs = _load_target(args.target)
    options = _options(args)
    if "schedule" in options:
        raise OptionError("sweep takes its policies as --policies A,B, not --schedule")
    grid = _grid(args.grid)
    both = sorted(set(grid) & set(options))
    if both:
        raise OptionError(f"--{both[0].replace('_', '-')} and --grid {both[0]}=...: an option is fixed or swept, "
                          "not both")
    policies = _policy_names(args.policies, "--policies") if args.policies is not None else ["speedloader"]
    machine = _machine(args, options)
    table = sweep(model, *call_args, kwargs=call_kwargs, policies=policies, options=grid, steps=args.steps,
                  warmup=args.warmup, profile=machine, **options)
    print(table)
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    print(f"written: {table.write_csv(out / 'sweep.csv')}, {table.write_json(out / 'sweep.json')}")
    return 0 if any(row.compiled for row in table.rows) else 1


# -- entry point ---------------------------------------------------------------

def _profile(args: argparse.Namespace) -> int:
    from slcompile.measure import profile_path, write_profile
    from slcompile.profile import measure_profile

    measured = measure_profile(offload_dir=args.offload_dir, steps=args.steps)
    path = args.out or profile_path()
    write_profile(measured, path)
    print(measured.describe())
    print(f"written to {path}")
    problem = measured.trust_problem()
    if problem is not None:
        print(f"not to be trusted: {problem}; explain, tune and compare refuse it: measure again while the "
              "machine is quiet")
        return 1
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="slcompile",
        description="Runs block-structured models layer-major over sub-batches under torch.compile "
                    "(backend=\"speedloader\"): try it on a small GPT (demo), see what it would do with "
                    "your model (explain), choose options that fit a memory budget (tune), compare "
                    "scheduling policies on it (compare), measure policies and options in a grid (sweep), or "
                    "measure this machine's rates for the time model (profile).",
    )
    parser.add_argument("--debug", action="store_true", help="show tracebacks and debug logs")
    commands = parser.add_subparsers(dest="command", required=True, metavar="{demo,explain,tune,compare,sweep,profile}")
    # --debug after the command too; SUPPRESS keeps the one given before it.
    debug = argparse.ArgumentParser(add_help=False)
    debug.add_argument("--debug", action="store_true", default=argparse.SUPPRESS,
                       help="show tracebacks and debug logs")

    demo = commands.add_parser(
        "demo", parents=[debug], help="train a small GPT a few steps next to eager and draw what happened",
        description="Trains a small GPT for a few steps with the speedloader backend next to eager PyTorch "
                    "(SGD, same seed), prints the schedule, the bytes moved and both losses, and writes the "
                    "graph pictures, the timeline (Chrome trace) and the memory plot of the last step into "
                    "--out. The model's block weights rest on nvme by default.",
    )
    demo.add_argument("--steps", type=int, default=3, help="training steps (default: 3)")
    demo.add_argument("--layers", type=int, default=4, help="transformer blocks (default: 4)")
    demo.add_argument("--width", type=int, default=64, help="d_model (default: 64)")
    demo.add_argument("--batch", type=int, default=8, help="batch size (default: 8)")
    demo.add_argument("--seq-len", type=int, default=32, help="tokens per sample (default: 32)")
    _add_picture_flags(demo)
    _add_config_flags(demo, DEMO_DEFAULTS)
    demo.set_defaults(run=_demo)

    explain = commands.add_parser(
        "explain", parents=[debug],
        help="what the backend would do with a model, its predicted peak and step time; --dot/--plot/--trace draw it",
        description="Prints the blocks, the batch dimension, K, the fallback reason, the predicted peak "
                    "memory and step time (on --profile) and the schedule of the model factory() builds. "
                    "--predicted-trace writes the predicted step's timeline into --out without running one; "
                    "--write-schedule writes the schedule as JSON, which --schedule-file replays. With --dot, "
                    "--plot or --trace it then compiles a copy of the model with these options, runs one "
                    "training step (backward on the loss) and writes the pictures into --out.",
    )
    target_help = ("module:factory, the module found in the current folder or installed; factory() returns "
                   "(model, args) or (model, args, kwargs). Ready to try: slcompile.examples:tiny_gpt, "
                   "slcompile.examples:tiny_llama (needs transformers)")
    explain.add_argument("target", help=target_help)
    explain.add_argument("--dot", action="store_true",
                         help="write the compiled forward and backward graphs (DOT, and SVG/PNG when the "
                              "Graphviz dot program is installed)")
    explain.add_argument("--plot", action="store_true",
                         help="write memory.png: measured resident bytes per tier and predicted live bytes "
                              "over one recorded training step")
    explain.add_argument("--trace", action="store_true",
                         help="run one training step and write its timeline: trace.json (Chrome trace, open "
                              "in https://ui.perfetto.dev or chrome://tracing) and timeline.png")
    explain.add_argument("--profile", default="current", metavar="PROFILE",
                         help="the machine the step's time is predicted for (printed under the peak): current "
                              f"(this machine, measured once and cached; the default), a named profile "
                              f"({_named_profiles()}), a profile's JSON file, or none")
    explain.add_argument("--predicted-trace", action="store_true",
                         help="write the predicted step on --profile into --out, without running a step: "
                              "predicted_trace.json (Chrome trace) and predicted_timeline.png")
    _add_schedule_file_flag(explain, "replay the schedule in PATH (the JSON of Schedule.to_json()) as the "
                                     "policy, named after the file; instead of --schedule")
    explain.add_argument("--write-schedule", metavar="PATH",
                         help="write the explained schedule (the first graph's) to PATH as JSON, with the "
                              "request it was written for; --schedule-file PATH replays it")
    _add_picture_flags(explain)
    _add_config_flags(explain)
    explain.set_defaults(run=_explain)

    tune = commands.add_parser(
        "tune", parents=[debug], help="choose K, live blocks, recomputation and policy that fit a memory budget",
        description="Captures the model factory() builds once and evaluates candidate plans on that graph "
                    "without running a step (fewer sub-batches first, then more live blocks, keeping "
                    "activations before recomputing); prints the first plan whose predicted device peak fits "
                    "--memory-budget, as options for torch.compile, or with --profile the fitting plan "
                    "predicted fastest on that machine. --num-subbatches and --live-blocks fix those instead "
                    "of trying them; --schedule A,B tries each policy in turn; the other options are fixed as "
                    "given.",
    )
    tune.add_argument("target", help=target_help)
    tune.add_argument("--profile", metavar="PROFILE",
                      help="time every plan that fits on this machine and choose the fastest: current (this "
                           f"machine, measured once and cached), a named profile ({_named_profiles()}) or a "
                           "profile's JSON file; the planner then decides by it too (machine_profile). Without "
                           "it, the first plan that fits wins")
    _add_schedule_file_flag(tune, "replay the schedule in PATH (the JSON of Schedule.to_json()) as one more "
                                  "policy to try, after those of --schedule, named after the file; repeatable",
                            repeat=True)
    _add_config_flags(tune, helps={"schedule": (
        "the policy, or several comma-separated (speedloader,grad_accumulation): each is tried with every tier, "
        "K and window before the next, so without --profile the first listed that fits wins; the output says "
        "which won and why (default: speedloader)")})
    tune.set_defaults(run=_tune)

    compare = commands.add_parser(
        "compare", parents=[debug], help="scheduling policies side by side: peaks, bytes, schedule diff, pictures",
        description="Compiles the model factory() builds once per policy (a copy each, with the same options), "
                    "trains a step of each and prints one line per policy (predicted and measured peak, bytes "
                    "moved per kind and tiers, transfers, loss, predicted step time on --profile) and the diff "
                    "of the first two schedules; writes the table, every schedule's diff against the first, "
                    "each policy's graphs (DOT, in the order the sub-batches run, with the bytes of every "
                    "transfer) and timeline, and timelines.png into --out (slcompile.compare_policies). With "
                    "--no-run nothing compiles to code and no step runs: the policies are ranked from "
                    "predictions alone.",
    )
    compare.add_argument("target", help=target_help)
    compare.add_argument("--policies", metavar="A,B,...",
                         help="the policies to compare, comma-separated: built-in names (speedloader, "
                              "grad_accumulation, no_offload, lifetime_aware, spilling, zigzag_spilling) or names registered by a "
                              "--policy-module")
    _add_schedule_file_flag(compare, "compare the schedule in PATH (the JSON of Schedule.to_json()) too, "
                                     "replayed as a policy named after the file, after --policies; repeatable",
                            repeat=True)
    compare.add_argument("--no-run", action="store_true",
                         help="compile nothing and run no step: each policy's row holds explain's predictions "
                              "(the plan's peaks, the bytes each kind of transfer moves, the step time on "
                              "--profile), best first; the table and the schedule diffs are written")
    compare.add_argument("--profile", default="current", metavar="PROFILE",
                         help="the machine each step's time is predicted for: current (this machine, measured "
                              f"once and cached; the default), a named profile ({_named_profiles()}), a "
                              "profile's JSON file, or none")
    _add_picture_flags(compare)
    _add_config_flags(compare)
    compare.set_defaults(run=_compare)

    sweep = commands.add_parser(
        "sweep", parents=[debug], help="measure and predict every policy under every combination of options",
        description="Compiles a copy of the model factory() builds under each policy of --policies and each "
                    "combination of the --grid values (Dynamo reset between them), times --steps training steps "
                    "of each after the measured ones, and prints one row per configuration: the median, fastest "
                    "and spread of the steps, the measured and planned peaks, the bytes moved, and the step "
                    "time predicted on --profile with its interval; a configuration that does not compile says "
                    "why. Writes sweep.csv and sweep.json into --out (slcompile.sweep).",
    )
    sweep.add_argument("target", help=target_help)
    sweep.add_argument("--policies", metavar="A,B,...", help="the policies to sweep (default: speedloader)")
    sweep.add_argument("--grid", action="append", default=[], metavar="OPTION=V1,V2",
                       help="an option swept over these values (repeatable: every combination is run), as "
                            "--grid num_subbatches=1,2,4 --grid activations=device,nvme")
    sweep.add_argument("--steps", type=int, default=5, help="timed steps per configuration (default: 5)")
    sweep.add_argument("--warmup", type=int, default=1, help="untimed steps before them (default: 1)")
    sweep.add_argument("--profile", default="current", metavar="PROFILE",
                       help="the machine each step's time is predicted for: current (the default), a named "
                            f"profile ({_named_profiles()}), a profile's JSON file, or none")
    sweep.add_argument("--out", default=DEFAULT_OUT, metavar="DIR",
                       help=f"folder sweep.csv and sweep.json are written to (default: ./{DEFAULT_OUT})")
    _add_config_flags(sweep)
    sweep.set_defaults(run=_sweep)

    profile = commands.add_parser(
        "profile", parents=[debug], help="measure this machine's rates for the time model and cache them",
        description="Measures this machine's rates (matmul, memory bandwidth, op and call overheads, the "
                    "links, the disk: a few seconds), with the cores other processes kept busy meanwhile and "
                    "how far each rate's repeats spread, and caches them where --profile current reads them "
                    "(replacing the cached one). A measurement made beside other work is refused by explain, "
                    "tune and compare: run this while the machine is quiet. --steps also fits the compute "
                    "thread's fixed costs from compiled steps (about 10 s more).",
    )
    profile.add_argument("--steps", action="store_true",
                         help="also fit the per-op, per-transfer-op and generation costs from compiled steps")
    profile.add_argument("--offload-dir", help="the directory whose disk the nvme tier uses (default: the temp dir)")
    profile.add_argument("--out", metavar="PATH",
                         help="write the profile's JSON here instead of the cache (--profile PATH reads it)")
    profile.set_defaults(run=_profile)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.debug else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.debug:
        return args.run(args)
    try:
        return args.run(args)
    except Exception as exc:  # one clear line; --debug for the traceback
        exc = _reported_error(exc)
        print(f"slcompile: error: {type(exc).__name__}: {exc}".splitlines()[0], file=sys.stderr)
        return 1


def _reported_error(exc: BaseException) -> BaseException:
    """The error worth one line: Dynamo wraps what our backend raised in
    BackendCompilerFailed, whose own first line names only the backend."""
    while getattr(exc, "inner_exception", None) is not None:
        exc = exc.inner_exception
    return exc


if __name__ == "__main__":
    sys.exit(main())
