"""The pass manager: one runner for the passes of every stage of a compilation.

A graph Dynamo hands the backend goes through five stages, each a list of passes
declared as data in `slcompile.pipeline`:

- "dynamo": the Dynamo graph (`PipelineState` in, `PipelineState` out);
- "joint": AOTAutograd's joint forward-backward graph, before the partitioner;
- "partitioned": the forward and backward graphs the partitioner returned;
- "inference": the inference graph of a step without gradients;
- "compiled": each AOT graph as it is handed to its compiler (forward, backward or
  inference; `StepState.kind` says which).

A `Pass` is declared once per stage with its name and kind: "analysis" (reads the
graphs, returns a record), "rewrite" (changes them) or "check" (refuses what the
later passes cannot handle correctly). `run_passes` runs one stage's passes in order
and, for each one:

- skips it when `SLC_DISABLE` (comma separated) names it, with one warning; a name
  that no stage declares is a ValueError listing the valid names, and a check or a
  pass the others cannot do without (`required`) cannot be disabled;
- times it and appends `"stage/name (N ms)"` to the `PassLog` of the graph Dynamo
  handed over (`CompileReport.passes_run`), so every stage's passes are listed;
- lints the graphs it declares;
- with `SLC_DUMP_DIR=d`, writes `d/NNN_name.txt` (the graphs as Python, and the
  record a later-stage pass returned) and `.dot`, numbered by one counter per Dynamo
  graph that continues across stages;
- turns an unexpected exception into an error naming the pass and the passes run so
  far: a `RefusedError` in the Dynamo stage, a `PassError` later (the backend
  compiles the graph plainly on either: `slcompile.errors.as_refusal`); a
  `RefusedError` raised by a pass keeps its reason, and the errors a user acts on
  (options, budget, offload I/O: `slcompile.errors.is_user_error`) keep their type,
  with a note naming the pass, in every stage.

Pass functions: a "dynamo" pass takes the `PipelineState` and returns the next one;
a pass of the other stages takes the `StepState` (`slcompile.pipeline`) (the plan, the report, the graphs by
kind, the recompute choice being tried) and returns its result record (or None),
which the runner sets as the attribute `name` of `step.results`, a record with one
field per pass of those stages (`slcompile.pipeline.StepResults`), for the passes
after it and the lowering.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch
import torch.fx

from slcompile.errors import OptionError, RefusedError, is_user_error

__all__ = [
    "KINDS",
    "STAGES",
    "Pass",
    "PassLog",
    "PassError",
    "run_passes",
    "disabled_passes",
    "pass_modules",
]

log = logging.getLogger(__name__)

KINDS = ("analysis", "rewrite", "check")
STAGES = ("dynamo", "joint", "partitioned", "inference", "compiled")


@dataclasses.dataclass(frozen=True)
class Pass:
    """One pass of one stage.

    Attributes:
        name: what `SLC_DISABLE`, the dumps and `passes_run` call it.
        stage: one of `STAGES`.
        kind: one of `KINDS`.
        run: the function (see the module docstring for its signature per stage).
        graphs: for the stages after Dynamo's, the kinds of the graphs it reads or
            changes ("joint", "forward", "backward", "inference", or "compiled": the
            graph of `StepState.kind`): linted and dumped after it.
        required: the passes after it cannot run without it (checks always are).
        code: the functions that do its work, when `run` only adapts them to the
            stage; the Inductor cache key hashes their modules and `run`'s.
    """

    name: str
    stage: str
    kind: str
    run: Callable[[Any], Any]
    graphs: tuple[str, ...] = ()
    required: bool = False
    code: tuple[Callable, ...] = ()

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"pass {self.name}: stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        if self.kind not in KINDS:
            raise ValueError(f"pass {self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def can_be_disabled(self) -> bool:
        return self.kind != "check" and not self.required


@dataclasses.dataclass
class PassLog:
    """The passes run on one Dynamo graph, across all stages, in order.

    Attributes:
        entries: `"stage/name (N ms)"` per pass run.
        dumps: the number of the next dump (continues across stages).
    """

    entries: list[str] = dataclasses.field(default_factory=list)
    dumps: int = 0

    def ran(self) -> str:
        return ", ".join(self.entries) or "none"


def disabled_passes(declared: Iterable[Pass]) -> set[str]:
    """The pass names listed in `SLC_DISABLE` (comma separated).

    Args:
        declared: every declared pass of every stage (`slcompile.pipeline.all_passes()`).

    Raises:
        OptionError: (a ValueError) a name no stage declares (the message lists the
            valid ones), or a check or required pass.
    """
    names = {p.strip() for p in os.environ.get("SLC_DISABLE", "").split(",") if p.strip()}
    if not names:
        return names
    by_name: dict[str, list[Pass]] = {}
    for step in declared:
        by_name.setdefault(step.name, []).append(step)
    unknown = sorted(names - by_name.keys())
    if unknown:
        valid = sorted(n for n, steps in by_name.items() if all(s.can_be_disabled for s in steps))
        raise OptionError(
            f"SLC_DISABLE names unknown pass(es) {', '.join(unknown)}; passes that can be disabled: "
            f"{', '.join(valid)}"
        )
    for name in sorted(names):
        fixed = [s for s in by_name[name] if not s.can_be_disabled]
        if fixed:
            why = "a check" if fixed[0].kind == "check" else "required by the passes after it"
            raise OptionError(f"SLC_DISABLE names {name}, which cannot be disabled ({why})")
    return names


def pass_modules(declared: Iterable[Pass]) -> tuple[str, ...]:
    """The source files of the modules the passes live in, sorted (for cache keys)."""
    files = set()
    for step in declared:
        for function in (step.run, *step.code):
            module = sys.modules.get(function.__module__)
            if module is not None and getattr(module, "__file__", None):
                files.add(module.__file__)
    return tuple(sorted(files))


def run_passes(
    passes: Sequence[Pass],
    state: Any,
    passes_log: PassLog,
    *,
    declared: Iterable[Pass],
    label: str = "",
    stop_after: str | None = None,
) -> Any:
    """Runs one stage's passes on `state`.

    Args:
        passes: the stage's passes, in order (all of one stage).
        state: a `PipelineState` for the "dynamo" stage, else a `StepState`
            (changed in place).
        passes_log: the log of the Dynamo graph being compiled (numbers the dumps).
        declared: every declared pass of every stage, which `SLC_DISABLE` may name
            (`slcompile.pipeline.run_stage` passes them).
        label: added to the stage in the log, e.g. "recompute=blocks".
        stop_after: the name of the last pass to run.

    Returns:
        the state after the passes.

    Raises:
        RefusedError: a pass refused the graph, or a Dynamo-stage pass failed; the
            message names the passes run so far and `err.state` holds the state
            before the pass.
        PassError: a pass of a later stage failed (same message and `state`).
        ValueError: `SLC_DISABLE` names an unknown pass or one that cannot be disabled.
    """
    disabled = disabled_passes(declared)
    dump_dir = os.environ.get("SLC_DUMP_DIR")
    for step in passes:
        stage = f"{step.stage}[{label}]" if label else step.stage
        if step.name in disabled:
            log.warning("speedloader: pass %s skipped (SLC_DISABLE)", step.name)
            continue
        started = time.perf_counter()
        try:
            state = _apply(step, state)
            for graph in _graphs(step, state):
                graph.lint()
        except RefusedError as err:
            err.pass_name = err.pass_name or step.name
            if err.state is None:
                err.state = state
            raise
        except Exception as exc:
            where = f"pass {step.name} ({stage} stage); passes run: {passes_log.ran()}"
            if is_user_error(exc):
                # The user's problem (a full disk, a bad directory, a policy's bad
                # schedule): its own type and message, with where it happened. A bad
                # schedule is no refusal: compiling the graph unchanged would hide it.
                exc.add_note(f"raised in {where}")
                raise
            message = (
                f"internal error in pass {step.name} ({stage} stage; {type(exc).__name__}: {exc}); "
                f"passes run: {passes_log.ran()}"
            )
            # Either way the backend compiles the graph Dynamo handed over plainly; a
            # PassError tells a failed later stage (AOTAutograd's) from a refusal.
            err = RefusedError(message, step.name) if step.stage == "dynamo" else PassError(message, step.name)
            err.state = state
            raise err from exc
        took = time.perf_counter() - started
        passes_log.entries.append(f"{stage}/{step.name} ({took * 1e3:.0f} ms)")
        if step.stage == "dynamo":
            state = dataclasses.replace(state, passes_run=tuple(passes_log.entries))
        if dump_dir:
            _dump(pathlib.Path(dump_dir), passes_log, step, state)
        if step.name == stop_after:
            break
    return state


class PassError(RuntimeError):
    """A pass after the Dynamo stage failed unexpectedly.

    Attributes:
        pass_name: the pass.
        state: the `StepState` before it.
    """

    def __init__(self, message: str, pass_name: str):
        super().__init__(message)
        self.pass_name = pass_name
        self.state = None


def _apply(step: Pass, state: Any) -> Any:
    if step.stage == "dynamo":
        return step.run(state)
    if not hasattr(state.results, step.name):
        raise TypeError(f"pass {step.name}: its stage's results record has no field {step.name!r}")
    setattr(state.results, step.name, step.run(state))
    return state


def _graphs(step: Pass, state: Any) -> list[torch.fx.Graph]:
    """The fx Graphs the pass declares, as they are now."""
    if step.stage == "dynamo":
        return [state.gm.graph]
    graphs = []
    for kind in step.graphs:
        value = state.graphs.get(state.kind if kind == "compiled" else kind)
        if value is not None:
            graphs.append(value.graph if isinstance(value, torch.fx.GraphModule) else value)
    return graphs


def _dump(directory: pathlib.Path, passes_log: PassLog, step: Pass, state: Any) -> None:
    from slcompile.viz.dot import graph_to_dot

    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"{passes_log.dumps:03d}_{step.name}"
    passes_log.dumps += 1
    texts, dots = [f"# after {passes_log.entries[-1]}\n"], []
    for graph in _graphs(step, state):
        module = graph.owning_module
        title = f"{step.name}: {graph_kind(step, state, graph)}"
        if isinstance(module, torch.fx.GraphModule) and module.graph is graph:
            texts.append(f"# {title}\n" + module.print_readable(print_output=False))
            dots.append(graph_to_dot(module, title=title, detail="auto"))
        else:
            texts.append(f"# {title}\n{graph}")
    result = getattr(state.results, step.name, None) if step.stage != "dynamo" else None
    if result is not None:
        texts.append(f"# result of {step.name}\n" + (result.text() if hasattr(result, "text") else str(result)))
    stem.with_suffix(".txt").write_text("\n".join(texts))
    # Graphviz reads several graphs from one file (one page each).
    stem.with_suffix(".dot").write_text("\n".join(dots) or "digraph empty {}\n")


def graph_kind(step: Pass, state: Any, graph: torch.fx.Graph) -> str:
    if step.stage == "dynamo":
        return "dynamo"
    for kind, value in state.graphs.items():
        if value is graph or getattr(value, "graph", None) is graph:
            return kind
    return step.stage
