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

- skips it when the settings disable it, with one warning; a name that no stage
  declares is a ValueError listing the valid names, and a check or a pass the others
  cannot do without (`required`) cannot be disabled;
- times it and appends `"stage/name (N ms)"` to the `PassLog` of the graph Dynamo
  handed over (`CompileReport.passes_run`), so every stage's passes are listed;
- lints the graphs it declares;
- with a dump directory `d`, writes `d/NNN_name.txt` (the graphs as Python, and the
  record a later-stage pass returned), and `.dot` when the settings hold a function
  that draws a graph (`draw`: the backend, `explain` and `tune` hand in
  `slcompile.backends.dumps.draw_graph`, since this layer does not import the
  pictures), numbered by one counter per Dynamo graph that continues across stages;
- turns an unexpected exception into an error naming the pass and the passes run so
  far: a `RefusedError` in the Dynamo stage, a `PassError` later (the backend
  compiles the graph plainly on either: `slcompile.errors.as_refusal`); a
  `RefusedError` raised by a pass keeps its reason, and the errors a user acts on
  (options, budget, offload I/O: `slcompile.errors.is_user_error`) keep their type,
  with a note naming the pass, in every stage.

The settings (`PassSettings`) are scoped: `with pass_settings(disable=...,
dump_dir=..., draw=...)`, a setting not given keeping the enclosing scope's; outside
every scope they come from the environment, `SLC_DISABLE` (comma separated names)
and `SLC_DUMP_DIR`. A Dynamo graph's passes run with the settings in effect when its
first stage ran (`PassLog.settings`), so the backward that AOTAutograd compiles at
the first backward call runs with the forward's.

An `Analysis` is a record of a later stage's graphs that passes read rather than
compute by hand: a pass names the analyses it reads (`Pass.requires`), and while it
runs `state.analyses[name]` computes one on its first read (logged and timed as
`"stage/pass:analysis (N ms)"`), so one a pass may not need (the kept peak under no
memory budget) costs nothing; reading one the pass does not declare is a KeyError.

Pass functions: a "dynamo" pass takes the `PipelineState` and returns the next one;
a pass of the other stages takes the `StepState` (`slcompile.pipeline`) (the plan, the report, the graphs by
kind, the recompute choice being tried) and returns its result record (or None),
which the runner sets as the attribute `name` of `step.results`, a record with one
field per pass of those stages (`slcompile.pipeline.StepResults`), for the passes
after it and the lowering.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import logging
import os
import pathlib
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx

from slcompile.errors import OptionError, RefusedError, is_user_error

__all__ = [
    "KINDS",
    "STAGES",
    "Analysis",
    "Pass",
    "PassLog",
    "PassError",
    "PassSettings",
    "pass_settings",
    "current_pass_settings",
    "run_passes",
    "disabled_passes",
    "pass_modules",
]

log = logging.getLogger(__name__)

KINDS = ("analysis", "rewrite", "check")
STAGES = ("dynamo", "joint", "partitioned", "inference", "compiled")


@dataclasses.dataclass(frozen=True)
class Analysis:
    """A record computed from the `StepState` of a stage after Dynamo's, for the
    passes that declare it (`Pass.requires`).

    Attributes:
        name: what a pass reads it as (`state.analyses[name]`) and the log calls it.
        run: the function: the `StepState` in, the record out.
    """

    name: str
    run: Callable[[Any], Any]


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
        requires: the analyses it reads (stages after Dynamo's), computed on its
            first read of each.
    """

    name: str
    stage: str
    kind: str
    run: Callable[[Any], Any]
    graphs: tuple[str, ...] = ()
    required: bool = False
    code: tuple[Callable, ...] = ()
    requires: tuple[Analysis, ...] = ()

    def __post_init__(self):
        if self.stage not in STAGES:
            raise ValueError(f"pass {self.name}: stage must be one of {', '.join(STAGES)}, got {self.stage!r}")
        if self.kind not in KINDS:
            raise ValueError(f"pass {self.name}: kind must be one of {', '.join(KINDS)}, got {self.kind!r}")

    @property
    def can_be_disabled(self) -> bool:
        return self.kind != "check" and not self.required


@dataclasses.dataclass(frozen=True)
class PassSettings:
    """How the passes of a compilation run.

    Attributes:
        disable: the names of the passes to skip.
        dump_dir: where each pass's dump is written; None: no dumps.
        draw: `draw(graph_module, title)`, a graph as DOT source, for the dumps'
            `.dot` files; None: the dumps are text alone.
        disabled_by: what named `disable`, for the log and the errors.
    """

    disable: frozenset[str] = frozenset()
    dump_dir: pathlib.Path | None = None
    draw: Callable[[torch.fx.GraphModule, str], str] | None = None
    disabled_by: str = "SLC_DISABLE"


_SETTINGS: contextvars.ContextVar[PassSettings | None] = contextvars.ContextVar("pass_settings", default=None)
_INHERITED = object()  # a setting `pass_settings` was not given


def current_pass_settings() -> PassSettings:
    """The settings of the innermost `pass_settings` scope; outside every scope, the
    environment's: `SLC_DISABLE` and `SLC_DUMP_DIR`."""
    scoped = _SETTINGS.get()
    if scoped is not None:
        return scoped
    dump_dir = os.environ.get("SLC_DUMP_DIR")
    return PassSettings(disable=_pass_names(os.environ.get("SLC_DISABLE", "")),
                        dump_dir=pathlib.Path(dump_dir) if dump_dir else None)


@contextlib.contextmanager
def pass_settings(*, disable: str | Iterable[str] = _INHERITED, dump_dir: str | os.PathLike | None = _INHERITED,
                  draw: Callable[[torch.fx.GraphModule, str], str] | None = _INHERITED) -> Iterator[PassSettings]:
    """Compiles inside the block run their passes with these settings; one not given
    is the enclosing scope's (outside every scope, the environment's).

    Args:
        disable: the passes to skip: names, or one string of comma separated names as
            `SLC_DISABLE` takes them; empty: none.
        dump_dir: the directory each pass's dump is written to; None: no dumps.
        draw: `draw(graph_module, title)` -> DOT source, for the dumps' `.dot` files;
            None: text alone.

    Yields:
        the settings in effect inside the block.
    """
    changes: dict[str, Any] = {}
    if disable is not _INHERITED:
        changes.update(disable=_pass_names(disable), disabled_by="pass_settings(disable=...)")
    if dump_dir is not _INHERITED:
        changes["dump_dir"] = None if dump_dir is None else pathlib.Path(dump_dir)
    if draw is not _INHERITED:
        changes["draw"] = draw
    token = _SETTINGS.set(dataclasses.replace(current_pass_settings(), **changes))
    try:
        yield _SETTINGS.get()
    finally:
        _SETTINGS.reset(token)


def _pass_names(names: str | Iterable[str]) -> frozenset[str]:
    if isinstance(names, str):
        names = names.split(",")
    return frozenset(name.strip() for name in names if name.strip())


@dataclasses.dataclass
class PassLog:
    """The passes run on one Dynamo graph, across all stages, in order.

    Attributes:
        entries: `"stage/name (N ms)"` per pass run.
        dumps: the number of the next dump (continues across stages).
        settings: the settings every stage's passes run with: those in effect when
            the first stage ran.
    """

    entries: list[str] = dataclasses.field(default_factory=list)
    dumps: int = 0
    settings: PassSettings | None = None

    def ran(self) -> str:
        return ", ".join(self.entries) or "none"


def disabled_passes(declared: Iterable[Pass], settings: PassSettings | None = None) -> set[str]:
    """The pass names the settings disable.

    Args:
        declared: every declared pass of every stage (`slcompile.pipeline.all_passes()`).
        settings: default: `current_pass_settings()`.

    Raises:
        OptionError: (a ValueError) a name no stage declares (the message lists the
            valid ones), or a check or required pass.
    """
    settings = settings if settings is not None else current_pass_settings()
    names = set(settings.disable)
    if not names:
        return names
    by_name: dict[str, list[Pass]] = {}
    for step in declared:
        by_name.setdefault(step.name, []).append(step)
    unknown = sorted(names - by_name.keys())
    if unknown:
        valid = sorted(n for n, steps in by_name.items() if all(s.can_be_disabled for s in steps))
        raise OptionError(
            f"{settings.disabled_by} names unknown pass(es) {', '.join(unknown)}; passes that can be disabled: "
            f"{', '.join(valid)}"
        )
    for name in sorted(names):
        fixed = [s for s in by_name[name] if not s.can_be_disabled]
        if fixed:
            why = "a check" if fixed[0].kind == "check" else "required by the passes after it"
            raise OptionError(f"{settings.disabled_by} names {name}, which cannot be disabled ({why})")
    return names


def pass_modules(declared: Iterable[Pass]) -> tuple[str, ...]:
    """The source files of the modules the passes and their analyses live in, sorted
    (for cache keys)."""
    files = set()
    for step in declared:
        for function in (step.run, *step.code, *(analysis.run for analysis in step.requires)):
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
        passes_log: the log of the Dynamo graph being compiled (numbers the dumps;
            its `settings`, taken from the scope when they are None, say how the
            passes run).
        declared: every declared pass of every stage, which the settings may disable
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
        ValueError: the settings disable an unknown pass or one that cannot be disabled.
    """
    if passes_log.settings is None:
        passes_log.settings = current_pass_settings()
    settings = passes_log.settings
    disabled = disabled_passes(declared, settings)
    for step in passes:
        stage = f"{step.stage}[{label}]" if label else step.stage
        if step.name in disabled:
            log.warning("speedloader: pass %s skipped (%s)", step.name, settings.disabled_by)
            continue
        started = time.perf_counter()
        try:
            state = _apply(step, state, _Analyses(step, state, passes_log, stage))
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
        if settings.dump_dir is not None:
            _dump(settings, passes_log, step, state)
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


def _apply(step: Pass, state: Any, analyses: _Analyses) -> Any:
    if step.stage == "dynamo":
        return step.run(state)
    if not hasattr(state.results, step.name):
        raise TypeError(f"pass {step.name}: its stage's results record has no field {step.name!r}")
    state.analyses = analyses
    try:
        setattr(state.results, step.name, step.run(state))
    finally:
        state.analyses = None
    return state


class _Analyses:
    """What `state.analyses` is while a pass runs: the analyses it declares, each
    computed on its first read."""

    def __init__(self, step: Pass, state: Any, passes_log: PassLog, stage: str):
        self.declared = {analysis.name: analysis for analysis in step.requires}
        self.step, self.state, self.passes_log, self.stage = step, state, passes_log, stage
        self.computed: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self.computed:
            analysis = self.declared.get(name)
            if analysis is None:
                raise KeyError(f"pass {self.step.name} reads the analysis {name!r}, which it does not declare "
                               f"(requires: {', '.join(self.declared) or 'none'})")
            started = time.perf_counter()
            self.computed[name] = analysis.run(self.state)
            took = time.perf_counter() - started
            self.passes_log.entries.append(f"{self.stage}/{self.step.name}:{name} ({took * 1e3:.0f} ms)")
        return self.computed[name]


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


def _dump(settings: PassSettings, passes_log: PassLog, step: Pass, state: Any) -> None:
    settings.dump_dir.mkdir(parents=True, exist_ok=True)
    stem = settings.dump_dir / f"{passes_log.dumps:03d}_{step.name}"
    passes_log.dumps += 1
    texts, dots = [f"# after {passes_log.entries[-1]}\n"], []
    for graph in _graphs(step, state):
        module = graph.owning_module
        title = f"{step.name}: {graph_kind(step, state, graph)}"
        if isinstance(module, torch.fx.GraphModule) and module.graph is graph:
            texts.append(f"# {title}\n" + module.print_readable(print_output=False))
            if settings.draw is not None:
                dots.append(settings.draw(module, title))
        else:
            texts.append(f"# {title}\n{graph}")
    result = getattr(state.results, step.name, None) if step.stage != "dynamo" else None
    if result is not None:
        texts.append(f"# result of {step.name}\n" + (result.text() if hasattr(result, "text") else str(result)))
    stem.with_suffix(".txt").write_text("\n".join(texts))
    if settings.draw is not None:
        # Graphviz reads several graphs from one file (one page each).
        stem.with_suffix(".dot").write_text("\n".join(dots) or "digraph empty {}\n")


def graph_kind(step: Pass, state: Any, graph: torch.fx.Graph) -> str:
    if step.stage == "dynamo":
        return "dynamo"
    for kind, value in state.graphs.items():
        if value is graph or getattr(value, "graph", None) is graph:
            return kind
    return step.stage
