"""The `speedloader` Dynamo backend.

Registered through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="speedloader", options={...})` works after
`pip install` with no import of slcompile. Dynamo hands over each captured graph and
its example inputs; the backend runs the pass pipeline on it and lowers the rewritten
graph, or, when the pipeline refuses, lowers the original graph and logs one warning
with the reason (`on_refusal="raise"` raises instead). A graph without blocks has
nothing to split: it is lowered plainly, its report says so, and it is no refusal.
Results are never silently different: a dynamic batch that turns out not divisible by
K at run time runs the plain graph, compiled on first need. Nor does a model run
eagerly unnoticed: when Dynamo hits its recompile limit on a frame it would compile
with this backend (a sweep of configurations in one process, without
`torch._dynamo.reset()` between them), a `RecompileLimitWarning` says so at every
call that runs eagerly, in each configuration past the limit, names the fix, and the
newest report is that configuration's, saying it ran eagerly (`compiled` False).
"""

from __future__ import annotations

import dataclasses
import inspect
import logging
import threading
import warnings
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from slcompile.analysis.inputs import classify_inputs
from slcompile.backends.dumps import drawing_dumps
from slcompile.backends.lowering import StepPlan, failed_stage, lower
from slcompile.config import SpeedLoaderConfig, batch_split_problem, options_of_mode
from slcompile.compat import watch_recompile_limit
from slcompile.errors import (
    BudgetError, NoBlocksError, OffloadError, OptionError, RecompileLimitWarning, RefusedError, as_refusal,
    compile_error, passes_through_fallback,
)
from slcompile.passes.stream_weights import weight_placement
from slcompile.pipeline import run_pipeline
from slcompile.schedules.policies import plan_suffix
from slcompile.facts import open_tiers, process_facts
from slcompile.plans import HostPoolPlan, StashPlan, new_name, sink_plan
from slcompile.report import CompileReport, add_report, compile_reports, discard_report
from slcompile.runtime.step import StepRuntime
from slcompile.runtime.gathering import loading_released_weights
from slcompile.runtime.weights import parameter_name
from slcompile.units import format_bytes

__all__ = ["speedloader_backend", "compile_plainly"]

log = logging.getLogger("slcompile")


def speedloader_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None, mode: str | None = None
) -> Callable:
    """The backend: `torch.compile(model, backend="speedloader", options=options)`.
    Options not given take their defaults from `slcompile.defaults`. `mode=` (which
    torch hands to a custom backend, and allows only without options) means what it
    means to Inductor where the speedloader has its counterpart: "default", and
    "reduce-overhead" (the `cudagraphs` option); another mode is refused with a
    `CompileError` saying what to write instead.

    Raises:
        CompileError: what the user can fix, its message first: an unknown option
            or a bad value (then also a ValueError; the message names the key), an
            unusable `offload_dir` or a full disk (`OffloadError`), a
            `memory_budget` no plan meets (`BudgetError` as `inner_exception`), or
            with `on_refusal="raise"` a graph that cannot be split or whose
            compilation failed at any stage (`RefusedError`, its cause chained).
    """
    try:
        if mode is not None:
            options = options_of_mode(mode, instead=(
                "torch.compile passes either mode or options to a backend, and the speedloader's other choices "
                "are options: torch.compile(model, backend='speedloader', options=slcompile.options("
                "lowering='inductor', ...)), or defaults set with slcompile.defaults or SLC_* environment "
                "variables"))
        return _compile_graph(gm, example_inputs, options)
    except (ValueError, BudgetError, RefusedError, OffloadError) as err:
        if isinstance(err, ValueError) and not isinstance(err, OptionError):
            raise  # not the options: a bug, for Dynamo's report
        # Dynamo re-raises a BackendCompilerFailed subclass as it is, with the
        # traceback cut to start here.
        raise compile_error(err, inspect.currentframe()).with_traceback(err.__traceback__) from None


def cudagraphs_apply(config: SpeedLoaderConfig, example_inputs: Sequence[Any], report: CompileReport) -> bool:
    """Whether the step's compute is replayed as CUDA graphs: the `cudagraphs` option
    asked for it, the lowering is Inductor's and the step runs on CUDA. When asked
    for but not possible, the reason goes to `report.cudagraphs_skipped` and the log."""
    if not config.cudagraphs:
        return False
    devices = sorted({value.device.type for value in example_inputs if isinstance(value, torch.Tensor)})
    reason = None
    if config.lowering != "inductor":
        reason = f"lowering={config.lowering!r} compiles no kernels to capture; CUDA graphs need lowering='inductor'"
    elif "cuda" not in devices:
        reason = f"the step's tensors are on {' and '.join(devices) or 'no device'}, and CUDA graphs need CUDA"
    if reason is None:
        return True
    if report.cudagraphs_skipped is None:
        log.info("speedloader: no CUDA graphs: %s", reason)
    report.cudagraphs_skipped = reason
    return False


def _compile_graph(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None) -> Callable:
    config = SpeedLoaderConfig.from_options(options)
    # Held until the step's runtime holds them: the tiers the facts are read of are
    # the ones the step uses, and an unusable offload_dir fails before the passes.
    with open_tiers(config):
        return _compile(gm, example_inputs, config)


def _compile(gm: torch.fx.GraphModule, example_inputs: Sequence[Any], config: SpeedLoaderConfig) -> Callable:
    report = CompileReport(config=config)
    add_report(report)
    original = gm
    facts = None  # read of the runtime once per compile: every plan tried reads the same record

    # One boundary around every stage: the Dynamo passes, and the lowering (AOTAutograd,
    # the joint, partitioned and compiled passes, the compiler, region outlining). What
    # fails there, unless it is the user's to fix, compiles the graph plainly instead.
    def attempt(planned: SpeedLoaderConfig):
        nonlocal facts
        if facts is None:
            facts = process_facts(planned, example_inputs)
        state = run_pipeline(gm, example_inputs, planned, facts=facts, passes_log=report.pass_log)
        plan = dataclasses.replace(step_plan(state), cudagraphs=cudagraphs_apply(planned, example_inputs, report))
        runtime = StepRuntime(plan.streamer, plan.stash, plan.gradients)
        return state, runtime, lower(state.gm, example_inputs, planned.lowering, report, plan, runtime)

    try:
        with drawing_dumps():  # the backward, compiled at its first call, draws its dumps too (`PassLog.settings`)
            _, (state, runtime, compiled) = plan_suffix(config, attempt)
    except Exception as err:  # noqa: BLE001  (any failure: see `as_refusal`)
        if passes_through_fallback(err):
            if isinstance(err, torch._dynamo.exc.RestartAnalysis):
                # Dynamo traces the frame again and hands over another graph: this
                # attempt compiled nothing, and its report would be an empty one.
                discard_report(report)
            raise
        refusal = as_refusal(err, failed_stage(report.pass_log, config.lowering))
        if refusal is not err:
            log.debug("speedloader: the failure behind the fallback", exc_info=err)
        return _refused(refusal, gm, example_inputs, config, report)

    report.blocks = tuple(b.path for b in state.blocks.blocks)
    report.batch_size = state.batch.batch_size
    if state.streamed is not None:
        report.weights = weight_placement(state.streamed, state.inputs, state.streamer.tier)
    report.block_inputs = {
        b.index: tuple(state.batch.input_index[name] for name in b.params) for b in state.blocks.blocks
    }
    if report.planned_schedule is None:  # the lowering's, with the transfers placed, comes first
        report.planned_schedule = state.schedule
    # Until the lowering reads it from the graphs; none when `interleave` was disabled.
    if not report.schedule:
        report.schedule = state.schedule.text() if state.schedule is not None else ""
    # Past this point nothing falls back: the streamed weights leave the device.
    _start(runtime, state, report)
    if not state.batch.dynamic or config.num_subbatches == 1:
        return compiled
    return _DivisibleBatchGuard(compiled, original, state, report)


_LOGGED_PROFILES: set[str] = set()  # the warnings given of untrusted machine profiles
_LOGGED_EAGERLY: set[str] = set()  # the messages of the configurations logged as run eagerly


def _ran_eagerly(limit_name: str, limit, compiler_fn, code) -> bool:
    """Dynamo hit a recompile limit on a frame it would compile with this backend:
    this call runs eagerly. Called for every such call (`watch_recompile_limit`:
    this backend claims the frame), so each configuration past the limit warns
    (Python shows a warning once per message unless its filters say otherwise) and
    logs an error once, and the newest report is one that says it ran eagerly
    (`compiled` False), never an earlier configuration's.

    Returns:
        whether the frame is this backend's (claimed: watched at every call).
    """
    from torch._dynamo.eval_frame import innermost_backend

    backend = innermost_backend(compiler_fn) if compiler_fn is not None else None
    if backend is not speedloader_backend and getattr(backend, "compiler_fn", None) is not speedloader_backend:
        return False
    options = dict(getattr(backend, "kwargs", {}).get("options") or {})
    try:
        config = SpeedLoaderConfig.from_options(options)
    except ValueError:
        config = options
    where = f"'{code.co_name}' ({code.co_filename}:{code.co_firstlineno})" if code is not None else "a frame"
    message = (
        f"speedloader: torch._dynamo hit config.{limit_name} ({limit}) on {where}, so this call with "
        f"options={options!r} runs eagerly, not compiled by speedloader, and so does every later torch.compile "
        f"of that code in this process. A sweep over configurations calls torch._dynamo.reset() before "
        f"compiling each one (or raises torch._dynamo.config.{limit_name}), or uses slcompile.explain, "
        f"slcompile.compare_policies or slcompile.tune"
    )
    newest = compile_reports()[-1:]
    if not (newest and not newest[0].compiled and newest[0].fallback_reason == message):
        add_report(CompileReport(config=config, fallback_reason=message, compiled=False))
    if message not in _LOGGED_EAGERLY:
        _LOGGED_EAGERLY.add(message)
        log.error("%s", message)
    warnings.warn(message, RecompileLimitWarning, stacklevel=2)
    return True


watch_recompile_limit(_ran_eagerly)


def _refused(err: RefusedError, gm, example_inputs, config: SpeedLoaderConfig, report: CompileReport) -> Callable:
    """A graph the pipeline refused or failed on: its reason logged once (or raised
    with `on_refusal="raise"`), the graph compiled plainly."""
    report.fallback_reason = str(err)
    if isinstance(err, NoBlocksError):
        # Nothing to split (the loss graph after a graph break): not a refusal. A
        # graph that holds parameters keeps them on the device: say so out loud.
        held = sum(
            i.value.numel() * i.value.element_size() for i in classify_inputs(gm, example_inputs)
            if i.kind == "param" and isinstance(i.value, torch.Tensor)
        )
        if held:
            log.warning("speedloader: %s with %s; its %s of parameters stay on the device",
                        err, config.lowering, format_bytes(held))
        else:
            log.info("speedloader: %s with %s", err, config.lowering)
    elif config.on_refusal == "raise":
        raise err
    else:
        log.warning("speedloader: compiling this graph with plain %s instead: %s", config.lowering, err)
    return compile_plainly(gm, example_inputs, config, report)


def compile_plainly(gm, example_inputs, config: SpeedLoaderConfig, report: CompileReport) -> Callable:
    """The graph Dynamo handed over, compiled with the plain lowering: the one way
    every fallback (a refusal, a failed stage, a batch K does not divide) compiles."""
    # What a failed attempt recorded (its graphs, schedule, memory) is not what runs.
    kept = {"config", "fallback_reason", "pass_log", "cudagraphs_skipped"}
    for field in dataclasses.fields(report):
        if field.name not in kept:
            default = field.default_factory() if field.default_factory is not dataclasses.MISSING else field.default
            setattr(report, field.name, default)
    # Parameters another graph of the model released (weights="nvme") are loaded for each call.
    return loading_released_weights(lower(gm, example_inputs, config.lowering, report,
                                          cudagraphs=cudagraphs_apply(config, example_inputs, report)))


def step_plan(state) -> StepPlan:
    """The StepPlan of a pipeline state that ran through `interleave`."""
    config = state.config
    machine = dataclasses.replace(
        state.facts.machine, world_size=state.streamer.world_size if state.streamer is not None else 1)
    return StepPlan(
        block_positions={block.index: pos for pos, block in enumerate(state.blocks.blocks)},
        config=config,
        streamer=state.streamer,
        stash=_stash_plan(config, machine),
        streamed_bytes=state.streamed.streamed_bytes if state.streamed is not None else 0,
        schedule=state.schedule,
        gradients=sink_plan(config.gradients, state.streamer, state.streamed, state.inputs,
                            state.facts.optimizer_held, config.offload_dir),
        optimizer=_optimizer_memory(state, machine),
        profile=_profile(config),
        machine=machine,
    )


def _profile(config):
    if config.machine_profile is None:
        return None
    from slcompile.measure import machine_profile

    machine = machine_profile(config.machine_profile, offload_dir=config.offload_dir)
    problem = machine.trust_problem()
    if problem is not None:
        message = (f"the machine profile the activation planner decides by ({machine.source or machine.name}) was "
                   f"measured beside other work ({problem}): its choices may not be this machine's best; "
                   "`python -m slcompile profile` remeasures it")
        if message not in _LOGGED_PROFILES:  # once a profile, not once a compile
            _LOGGED_PROFILES.add(message)
            log.warning(message)
    return machine


def _optimizer_memory(state, machine):
    """The share of the offloaded optimizer holding the graph's parameters, or None."""
    from slcompile.optim import attached_optimizer_memory

    values = {i.name: i.value for i in state.inputs}
    streamed = [[values[name] for name, _ in block] for block in state.streamed.blocks] if state.streamed else []
    return attached_optimizer_memory((i.value for i in state.inputs if i.kind == "param"), streamed, machine)


def _stash_plan(config: SpeedLoaderConfig, machine) -> StashPlan | None:
    """The activation stash on the configured tier, or None when activations stay
    (on the device, or on a tier that is the device's memory on this `machine`)."""
    if config.activations == "device":
        return None
    if not machine.copies(config.activations):
        log.debug("activations=%s copies nothing on this machine: they stay on the device", config.activations)
        return None
    return StashPlan(new_name("a"), config.activations, offload_dir=config.offload_dir)


def _host_pool_plan(state, report) -> HostPoolPlan | None:
    """What the plan will hold on the host tier, for the step's runtime to pin before
    its first step: the predicted host peak less what already rests there, plus up to
    a page per tensor (each takes whole pages). None when the plan holds nothing on
    the host or the host is the device's own memory (a CPU machine)."""
    if report.memory is None or not report.memory.peak_bytes.get("host"):
        return None
    if not state.facts.machine.copies("host"):
        return None
    on_host = state.config.weights == "host" and state.streamed is not None
    streamed = [pair for block in state.streamed.blocks for pair in block] if on_host else []
    values = {i.name: i.value for i in state.inputs}
    offloaded = report.offloaded_activations
    activations = [name for name, tier in zip(offloaded.names, offloaded.tiers)
                   if (tier or state.config.activations) == "host"] if offloaded is not None else []
    return HostPoolPlan(
        peak_bytes=report.memory.peak_bytes["host"],
        resting=tuple(key for _, key in streamed),
        tensors=len(streamed) + len(activations),
        largest=max((values[name].nbytes for name, _ in streamed), default=0),
        host_memory=state.config.host_memory,
        offload_dir=state.config.offload_dir,
    )


def _start(runtime: StepRuntime, state, report: CompileReport) -> None:
    """After lowering (which traced with the real values), makes the step's runtime
    objects: the streamed weights move to their tier and release the parameters'
    memory."""
    blocks = []
    if state.streamed is not None:
        values = {i.name: i.value for i in state.inputs}
        sources = {i.name: parameter_name(i.source) for i in state.inputs}
        blocks = [[(key, values[name], sources[name] or name) for name, key in block]
                  for block in state.streamed.blocks]
        report.streamed_bytes = state.streamed.streamed_bytes
    runtime.start(blocks, report.offloaded_gradients, host_pool=_host_pool_plan(state, report))
    if any(blocks):
        log.info("speedloader: %d bytes of block weights now rest on %s", report.streamed_bytes,
                 state.streamer.tier)


class _DivisibleBatchGuard:
    """Checks a dynamic batch against K on every call; runs the plain graph if it
    does not divide, or if the batched inputs (each with a batch size symbol of its
    own, which nothing in the graph relates) disagree on the batch size (lowered once
    per such call's sizes, on first need, with one warning), with released weights
    loaded for the call."""

    def __init__(self, compiled, original, state, report):
        self.compiled = compiled
        self.original = original
        self.config = state.config
        self.report = report
        self.batched = tuple(
            (state.batch.input_index[name], dim) for name, dim in state.batch.batched_inputs.items()
        )
        self.plain: dict[tuple[int, ...], Callable] = {}  # batch sizes -> the plain graph lowered for them
        self.lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        sizes = tuple(dict.fromkeys(int(args[position].shape[dim]) for position, dim in self.batched))
        if len(sizes) == 1:
            reason = batch_split_problem(sizes[0], self.config.num_subbatches)
        else:
            reason = f"the batched inputs disagree on the batch size ({', '.join(map(str, sizes))})"
        if reason is None:
            return self.compiled(*args)
        with self.lock:
            if sizes not in self.plain:
                log.warning("speedloader: %s; running this call with plain %s", reason, self.config.lowering)
                plain_report = CompileReport(config=self.config, fallback_reason=reason)
                # Lowered for this call's inputs: the compile of the split graph specialized
                # the batch in the shape environment the example inputs share.
                self.plain[sizes] = compile_plainly(self.original, list(args), self.config, plain_report)
        return self.plain[sizes](*args)
