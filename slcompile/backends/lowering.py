"""Lower a (rewritten) Dynamo graph with AOTAutograd and Inductor or aot_eager.

Inductor runs with `reorder_for_peak_memory` off: that pass moves block kernels out of
layer-major order in the backward. The option is patched around every inner compile
(the backward may compile later than the forward), and it is part of Inductor's cache
key, so a cached graph compiled with other options is never served.

With a `StepPlan`, the stages after Dynamo's run from AOTAutograd's hooks through the
pass manager (`slcompile.passes.manager`; the passes are declared in
`slcompile.pipeline`): the joint graph's before the partitioner, the partitioned
forward and backward's after it (among them `order_layer_major`: the partitioner
moves some saved values to the end of the forward), and every graph's just before it
is compiled (with Inductor, `compile_regions` there outlines each (block, sub-batch)
region as a call of a subgraph, one per distinct region, and Inductor compiles the
step as one program). Each graph is then recorded in the CompileReport, so tests can
read the order that is compiled. The Inductor cache key
of the wrapped partitioner hashes every module a declared pass lives in
(`partition_key`).

A plan is plain data: its weight streamer, activation stash and gradient sink are
named by their plans (`slcompile.plans`), which the passes write into the graphs'
keys. The objects themselves are made from those plans by a `StepRuntime`
(`slcompile.runtime.step`) once the lowering has succeeded, and live as long as the
compiled graphs that call them: the registries their `slc::` ops look them up in
hold them weakly, and every compiled graph, as well as the callable `lower` returns,
holds the `StepRuntime` (`hold_runtime`). A step compiled again, a model deleted or
`torch._dynamo.reset()` lets them go. Lowered without one (`explain`, `tune`), a
step makes no runtime object.

A graph with symbolic sizes (a dynamic batch or sequence) is planned at the sizes it
was traced with, and Dynamo runs it at every size its guards admit. Under a
`memory_budget` the plan chosen is held to the budget at every size: the lowering
adds a guard that its predicted device peak, a sympy expression of the size
symbols, is within the budget (`guard_budget`), so a size at which it is not makes
Dynamo compile the graph again, planned at that size (or raising `BudgetError`, as a
graph traced at that size would).
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import functools
import logging
from collections.abc import Callable, Sequence
from types import MappingProxyType
from typing import Any

import sympy
import torch
import torch.fx
from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn, get_hash_for_files

from slcompile import pipeline
from slcompile.analysis.machine import MachineFacts
from slcompile.compat import backed_value, graph_module, lazy_graph_modules
from slcompile.config import SpeedLoaderConfig
from slcompile.errors import BudgetError, OptionError, PolicyError, RefusedError, is_user_error
from slcompile.passes import manager as pass_manager
from slcompile.passes import trace_units
from slcompile.passes.manager import pass_modules
from slcompile.passes.mark_regions import drop_marks
from slcompile.passes.offload_activations import OffloadedActivations
from slcompile.passes.trace_units import (
    UnitCalls,
    has_unit_calls,
    inline_units,
    outline_units,
    tracing_calls,
    unit_variants,
)
from slcompile.pipeline import (
    COMPILED_PASSES,
    INFERENCE_PASSES,
    JOINT_PASSES,
    PARTITIONED_PASSES,
    StepState,
    all_passes,
    run_stage,
)
from slcompile.plans import SinkPlan, StashPlan, StreamerPlan
from slcompile.report import CompileReport
from slcompile.runtime.step import StepRuntime
from slcompile.schedules.base import Schedule
from slcompile.schedules.planner import kept_bytes

__all__ = ["lower", "StepPlan", "INDUCTOR_PATCHES", "failed_stage", "hold_runtime", "guard_budget"]

log = logging.getLogger(__name__)

# reorder_for_locality would also sink compute below transfer waits.
INDUCTOR_PATCHES = MappingProxyType({"reorder_for_peak_memory": False, "reorder_for_locality": False})


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How a rewritten graph's step is planned around AOTAutograd's partitioner.

    The options are the `config`'s alone: K, the tiers, the budget and the other
    choices the user made are read from it (the properties below), never copied.

    Attributes:
        block_positions: block index -> position in forward execution order.
        config: the graph's `SpeedLoaderConfig`.
        streamer: the weight streamer's `StreamerPlan` when block weights rest off
            the device.
        stash: the activation stash's `StashPlan` when saved activations rest off
            the device.
        streamed_bytes: bytes of the streamed weights (P).
        schedule: the policy's Schedule: the order of the graphs, which saved
            activations leave the device.
        gradients: the gradient sink's `SinkPlan` when streamed weights' gradients
            leave the device (`offload_gradients`), else None.
        stash_everything: stash every saved activation that may leave, instead of
            what the planner chooses under the budget (the last resort).
        optimizer: the optimizer step's share of the memory (`OptimizerMemory`), or
            None: the budget then covers the forward and backward only.
        cudagraphs: with Inductor on CUDA, the compute between `slc::` ops is
            replayed as CUDA graphs (the `cudagraphs` option, where it applies); the
            compute markers then go, since a replayed graph runs none of its host code.
        profile: the `MachineProfile` the activation planner places stashes by
            (the `machine_profile` option), or None: by counting steps.
        machine: the machine's facts (`MachineFacts`) the memory model predicts with.
    """

    block_positions: dict[int, int]
    config: SpeedLoaderConfig = dataclasses.field(default_factory=SpeedLoaderConfig)
    streamer: StreamerPlan | None = None
    stash: StashPlan | None = None
    streamed_bytes: int = 0
    schedule: Any = None
    gradients: SinkPlan | None = None
    stash_everything: bool = False
    optimizer: Any = None
    cudagraphs: bool = False
    profile: Any = None
    machine: MachineFacts = MachineFacts()

    @property
    def num_subbatches(self) -> int:
        """K."""
        return self.config.num_subbatches

    @property
    def recompute(self) -> str:
        """"auto", "none" or "blocks" (the option), or "policy" when the schedule
        names the units it recomputes (`Schedule.recompute`), whatever the option said."""
        if self.schedule is not None and self.schedule.recompute is not None:
            return "policy"
        return self.config.recompute

    @property
    def min_offload_bytes(self) -> int:
        """Saved tensors smaller than this stay on the device."""
        return self.config.min_offload_bytes

    @property
    def memory_budget(self) -> int | None:
        """The device's limit in bytes, or None."""
        return self.config.memory_budget

    @property
    def live_blocks(self) -> int:
        """The weight streamer's window."""
        return self.config.live_blocks

    @property
    def weights_tier(self) -> str:
        """Where the block weights rest: the `weights` option, "device" when none streams."""
        return self.config.weights if self.streamer is not None else "device"

    @property
    def activations_tier(self) -> str:
        """Where offloaded saved activations rest (the `activations` option)."""
        return self.config.activations

    @property
    def compile_regions(self) -> bool:
        """With Inductor, outline each distinct region as a subgraph compiled once
        (`slcompile.passes.outline_regions`) instead of lowering every copy."""
        return self.config.compile_regions


def lower(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    lowering: str,
    report: CompileReport,
    plan: StepPlan | None = None,
    runtime: StepRuntime | None = None,
    *,
    cudagraphs: bool = False,
) -> Callable:
    """Compiles `gm` with the chosen lowering; records the AOT graphs in `report`.

    With a `plan` (a rewritten graph), the partitioner is wrapped: the joint graph
    goes through `JOINT_PASSES` (tags for the partitioner), the partitioned forward
    and backward through `PARTITIONED_PASSES` (gradient fusion, the schedule's order,
    activation and gradient offload, weight prefetch, then the step's schedule and
    memory), and an inference graph through `INFERENCE_PASSES` (all declared in
    `slcompile.pipeline`). Under a budget the step would exceed, it runs the joint
    and partitioned stages again with the next plan (`_PlannedPartition`: block
    recomputation with `recompute="auto"`, then every activation stashed); when
    nothing fits it raises `BudgetError` with the smallest budget that would. Every
    graph handed to a compiler goes through `COMPILED_PASSES` first. Each stage's
    passes are listed in `report.passes_run`. Every compiled graph and the returned
    callable hold `runtime`, the `StepRuntime` of `plan`'s runtime objects, when
    one is given (the caller starts it). With `cudagraphs` (or a plan's), Inductor
    replays the compute between `slc::` ops as CUDA graphs (its graph partition and
    cudagraph trees, as for mode="reduce-overhead"). With the plan's
    `trace_units_once`, AOTAutograd traces a copy of `gm` whose (block, sub-batch)
    units are calls of one subgraph per distinct unit (`slcompile.passes.trace_units`),
    put back in place before the joint stage reads the graph; where that copy fails
    to trace, partition or compile for any reason but the plan's own errors
    (`BudgetError`, `OptionError`, `RefusedError`) and the user's
    (`slcompile.errors.is_user_error`: an offload directory, a full disk), `gm`
    itself (logged), with `report` as it was before.

    Raises:
        BudgetError: no plan fits `plan.memory_budget`.
    """
    if lowering not in ("aot_eager", "inductor"):
        raise ValueError(f"unknown lowering {lowering!r}")
    units = None
    once = plan is not None and _traces_units_once(plan)
    if once and not _layer_major(plan):
        log.info("speedloader: the schedule runs a block's sub-batches apart (sample-major); the step is traced flat")
    elif once:
        try:
            with _sizes_of_any_batch(plan):  # it computes the values of the step's own nodes
                units = outline_units(gm)
        except Exception as error:  # noqa: BLE001 - the step is traced flat, as without the option
            log.warning("speedloader: cutting the step's units out as subgraph calls failed (%s: %s); tracing it "
                        "flat", type(error).__name__, error)
    if units is None:
        return _lower(gm, example_inputs, lowering, report, plan, runtime, cudagraphs, _Inliner(None))
    inliner = _Inliner(units, report)
    before = _report_state(report)
    report.traced_units = units.traced
    try:
        with tracing_calls():
            return _lower(units.graph, example_inputs, lowering, report, plan, runtime, cudagraphs, inliner)
    except (BudgetError, OptionError, RefusedError):
        raise  # the plan's own verdict, which a flat trace of the same step reaches too
    except Exception as error:  # noqa: BLE001 - the step is traced flat; a fault of its own raises there
        if is_user_error(error):  # an offload directory or a disk, which a flat trace uses too
            raise
        for field, value in before.items():
            setattr(report, field, value)
        failure = (f"tracing the step with its {units.traced.calls} units as calls of {units.traced.subgraphs} "
                   f"subgraphs failed ({type(error).__name__}: {error})")
    try:
        compiled = _lower(gm, example_inputs, lowering, report, plan, runtime, cudagraphs, _Inliner(None))
    except Exception:
        # The flat trace's error is the step's (the caller's fallback says it once).
        log.info("speedloader: %s; traced flat, the step failed too", failure)
        raise
    log.warning("speedloader: %s; traced it flat", failure)
    return compiled


UNITS_ONCE_MIN_BLOCKS = 8
"""The blocks from which `trace_units_once="auto"` traces each distinct unit once:
the package's GPT at K=4 and 8 compiled 5-8% slower so at 4 blocks, 10-22% faster at
8 and 29-34% at 16 (aot_eager, `bench/README.md`)."""


def _traces_units_once(plan: StepPlan) -> bool:
    """Whether the plan's option asks for each distinct unit to be traced once."""
    option = plan.config.trace_units_once
    return len(plan.block_positions) >= UNITS_ONCE_MIN_BLOCKS if option == "auto" else bool(option)


def _layer_major(plan: StepPlan) -> bool:
    """Whether each block's sub-batches run one after the other in both phases, the
    order in which a step's units are traced as calls of their subgraphs (units of a
    block that stand apart, between other blocks' units, are not put back in place)."""
    schedule = plan.schedule
    return schedule is None or all(schedule.order(phase).contiguous("block", block)
                                   for phase in ("fwd", "bwd") for block in plan.block_positions)


class _Inliner:
    """Puts the unit calls of an outlined step (`outline_units`) back in place in the
    first graph of each kind that AOTAutograd hands over (`inline_units`), and tells
    apart the subgraphs AOTAutograd partitions on its own, which no pass reads."""

    def __init__(self, units: UnitCalls | None, report: CompileReport | None = None):
        self.units = units
        self.report = report
        self.inlined = False

    def is_subgraph(self, graph: torch.fx.Graph, joint_inputs: Any = None) -> bool:
        """A unit's joint subgraph, which AOTAutograd partitions before the step's
        joint graph: handed to the partitioner with no inputs listed, or (to a
        joint-graph pass, which is not told) a graph that calls no unit."""
        if self.units is None or self.inlined:
            return False
        if joint_inputs is not None:
            return isinstance(joint_inputs, list) and not joint_inputs
        return not has_unit_calls(graph)

    def __call__(self, graph: torch.fx.Graph) -> None:
        if self.units is None or self.inlined and not has_unit_calls(graph):
            return
        if not self.inlined:
            if not has_unit_calls(graph):
                # A torch that renamed or rewrote the calls: the passes would read a
                # step whose units they cannot see (`lower` traces it flat instead).
                raise RuntimeError("AOTAutograd's first graph of the step calls none of the units' subgraphs")
            if self.report is not None:
                self.report.traced_units = dataclasses.replace(self.units.traced, variants=unit_variants(graph))
        inline_units(graph, self.units.origins)
        self.inlined = True


def _report_state(report: CompileReport) -> dict[str, Any]:
    """What `report` holds before a lowering, to put back before a second one: its
    fields, with their own copies of what a lowering adds to in place."""
    state = {field.name: getattr(report, field.name) for field in dataclasses.fields(report)}
    return {name: copy.copy(value) if isinstance(value, (dict, list)) else value for name, value in state.items()} | {
        "pass_log": dataclasses.replace(report.pass_log, entries=list(report.pass_log.entries))}


def _lower(gm, example_inputs, lowering, report, plan, runtime, cudagraphs, inliner: _Inliner) -> Callable:
    partition_hook = None if plan is None else _PlannedPartition(plan, report, lowering, inliner)

    def hold(compiled: Callable) -> Callable:
        return compiled if runtime is None else hold_runtime(compiled, runtime)

    def prepare(kind: str, graph: torch.fx.GraphModule) -> StepState:
        """Runs the compiled stage on `graph`; its `graphs[kind]` is what to compile."""
        inliner(graph.graph)  # an inference graph calls the units' subgraphs still
        if plan is not None and kind == "inference":
            step = run_stage(
                INFERENCE_PASSES, StepState(plan, report, {"inference": graph}, lowering=lowering), report.pass_log
            )
            if step.results.derive_schedule is not None:
                report.schedule = step.results.derive_schedule.text()
            report.memory = step.results.predict_memory
            report.spilled_boundaries = step.results.spill_boundaries

        step = StepState(plan, report, {kind: graph}, kind=kind, lowering=lowering)
        run_stage(COMPILED_PASSES, step, report.pass_log, label=kind)
        report.record_graph(kind, graph)
        return step

    # The passes rewrite each graph several times and most graphs are only analysed
    # (every plan `tune` weighs): a graph's Python code is written when it first runs.
    sizes = functools.partial(_sizes_of_any_batch, plan)
    with lazy_graph_modules(), sizes():
        if lowering == "aot_eager":
            return hold(_aot_eager(gm, example_inputs, prepare, partition_hook, hold, sizes))
        cudagraphs = cudagraphs or (plan is not None and plan.cudagraphs)
        return hold(_inductor(gm, example_inputs, prepare, partition_hook, hold, sizes, cudagraphs))


def hold_runtime(compiled: Callable, runtime: StepRuntime) -> Callable:
    """`compiled`, made to keep `runtime`'s objects alive while it lives.

    A compiled forward or backward graph calls `slc::` ops that find the streamer,
    stash or sink by the name in their key; the registries only point at them, so
    each graph holds what it may call (a backward can outlive the step's callable).

    Returns:
        `compiled` itself, or a function calling it when it takes no attributes.
    """
    try:
        compiled._slc_runtime = runtime
    except (AttributeError, TypeError):
        inner = compiled

        @functools.wraps(inner)
        def compiled(*args, **kwargs):
            return inner(*args, **kwargs)

        compiled._slc_runtime = runtime
    return compiled


def guard_budget(peak: sympy.Expr, budget: int, graph: torch.fx.GraphModule) -> sympy.Expr | None:
    """Makes the graph being compiled run only at sizes where `peak` fits `budget`.

    `peak` is a plan's predicted device peak (`MemoryPrediction.expressions
    ["peak_device"]`), chosen because it fits at the sizes the graph was traced with.
    Where it depends on the sizes of the graph's inputs, the condition becomes a
    guard of the shape environment, which Dynamo checks before every call of the
    compiled frame: a size that breaks it compiles the frame again. A symbol no input
    carries (the length of an RNG state the backward recomputes with, which does not
    follow the batch) is taken at its traced value: Dynamo cannot check it.

    Args:
        peak: the predicted device peak in bytes, of the size symbols.
        budget: the device's limit in bytes.
        graph: the step's forward (its placeholders carry the inputs' symbols).

    Returns:
        the condition guarded, or None for a peak that does not depend on an input's size.
    """
    shape_env, carried = None, set()
    for node in graph.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        for size in (value.shape if isinstance(value, torch.Tensor) else (value,)):
            if isinstance(size, torch.SymInt):
                shape_env = size.node.shape_env
                carried |= size.node.expr.free_symbols
    if shape_env is None or not peak.free_symbols & carried:
        return None
    traced = {symbol: backed_value(shape_env, symbol) for symbol in peak.free_symbols - carried}
    if any(value is None for value in traced.values()):
        log.warning("speedloader: the plan fits the memory budget at the traced sizes only: its peak %s depends "
                    "on a size known only when the step runs", peak)
        return None
    condition = sympy.Le(peak.subs(traced), budget)
    try:
        # At the traced sizes (where the plan fits) it holds, and the shape
        # environment records it as a guard of the frame.
        holds = shape_env.evaluate_expr(condition)
    except Exception as err:  # noqa: BLE001 - the plan stands; only its guard is lost
        log.warning("speedloader: the plan fits the memory budget at the traced sizes only: guarding %s "
                    "failed (%s: %s)", condition, type(err).__name__, err)
        return None
    if not holds:
        raise AssertionError(f"the plan chosen under the budget does not fit it at the traced sizes: {condition}")
    log.info("speedloader: the plan holds the memory budget at sizes where %s", condition)
    return condition


def failed_stage(pass_log, lowering: str) -> str:
    """Where a compilation that failed outside a pass was, in words, from the stage
    of the last pass that ran (`PassLog`): a pass's own failure names its pass."""
    last = pass_log.entries[-1].split("/")[0].split("[")[0] if pass_log.entries else ""
    return {
        "": "the Dynamo stage",
        "dynamo": "AOTAutograd tracing the interleaved graph",
        "joint": "AOTAutograd's partitioner",
        "partitioned": "AOTAutograd after the partitioned passes",
    }.get(last, f"the {lowering} lowering")


class _PlannedPartition:
    """Wraps a partitioner with the joint and partitioned stages, tried per plan
    until one fits the budget.

    The plans, in order: for each recompute choice (`recompute="auto"`: none, then
    blocks; a schedule that names its units: those alone), the saved activations
    the planner moves off the device under the budget
    (`slcompile.schedules.planner`: only transfers that hide); then, when
    activations may leave, for each recompute choice every one of them, unless the
    planned attempt showed that even shedding all it kept would not fit.
    """

    def __init__(self, plan: StepPlan, report: CompileReport, lowering: str, inliner: _Inliner):
        self.plan = plan
        self.report = report
        self.lowering = lowering
        self.inliner = inliner
        # Set when a joint-graph pre-pass already tagged the graph for the first plan.
        self.pre_tagged = False

    def candidates(self) -> tuple[str, ...]:
        return ("none", "blocks") if self.plan.recompute == "auto" else (self.plan.recompute,)

    def attempts(self) -> list[tuple[str, bool]]:
        """(recompute, stash everything) of each plan to try."""
        planned = [(recompute, False) for recompute in self.candidates()]
        if self.plan.stash is None or self.plan.memory_budget is None:
            return planned
        return planned + [(recompute, True) for recompute in self.candidates()]

    def _label(self, recompute: str, everything: bool = False) -> str:
        # When a budget may make it try several plans, each attempt's passes are told
        # apart in the log.
        if self.plan.memory_budget is None or len(self.attempts()) == 1:
            return ""
        return f"recompute={recompute}" + (",stash=all" if everything else "")

    def _keep_schedules(self, step: StepState, derived: Schedule | None) -> None:
        if step.results.plan_transfers is not None:
            self.report.planned_schedule = step.results.plan_transfers
        if derived is not None:
            self.report.schedule = derived.text()

    def tag_first(self, joint: torch.fx.Graph) -> None:
        """The joint-graph stage of the first plan tried."""
        if self.inliner.is_subgraph(joint):
            return
        self.inliner(joint)
        recompute, _ = self.attempts()[0]
        step = StepState(self.plan, self.report, {"joint": joint}, recompute=recompute, lowering=self.lowering)
        run_stage(JOINT_PASSES, step, self.report.pass_log, label=self._label(recompute))
        self.pre_tagged = True

    def __call__(self, partitioner, joint: torch.fx.GraphModule, joint_inputs, **kwargs):
        if self.inliner.is_subgraph(joint.graph, joint_inputs):
            # Partitioned as it was traced, each value its forward makes saved for its
            # backward: once inlined, the step's own partitioner chooses what the
            # backward recomputes, over the whole step as a flat trace's would.
            from torch._functorch.partitioners import default_partition

            return default_partition(joint, joint_inputs, num_fwd_outputs=kwargs["num_fwd_outputs"])
        self.inliner(joint.graph)
        tried = []
        hopeless: set[str] = set()  # recompute choices that stashing everything cannot bring under the budget
        for attempt, (recompute, everything) in enumerate(self.attempts()):
            if everything and recompute in hopeless:
                continue
            plan = dataclasses.replace(self.plan, stash_everything=everything)
            label = self._label(recompute, everything)
            if not (self.pre_tagged and attempt == 0):
                step = StepState(plan, self.report, {"joint": joint}, recompute=recompute, lowering=self.lowering)
                run_stage(JOINT_PASSES, step, self.report.pass_log, label=label)
            # The partitioner's own graph modules write their code at every pass's
            # `recompile()`; these write it when they first run.
            fw, bw = (_lazy(module) for module in partitioner(joint, joint_inputs, **kwargs))
            step = StepState(
                plan, self.report, {"forward": fw, "backward": bw}, recompute=recompute,
                num_fwd_outputs=kwargs["num_fwd_outputs"], lowering=self.lowering,
            )
            try:
                run_stage(PARTITIONED_PASSES, step, self.report.pass_log, label=label)
            except PolicyError as err:
                # What the policy planned and what the graphs make, for the message's
                # "compare report.planned_schedule.text() with report.schedule".
                self._keep_schedules(step, getattr(err, "derived_schedule", None))
                raise
            prediction = step.results.predict_memory
            tried.append(prediction)
            offloaded = step.results.offload_activations
            schedule = step.results.plan_transfers
            if plan.memory_budget is not None and schedule is not None and \
                    prediction.peak_bytes["device"] - kept_bytes(schedule) > plan.memory_budget:
                hopeless.add(recompute)  # or nothing more to stash: the same plan again
            if plan.memory_budget is None or prediction.peak_bytes["device"] <= plan.memory_budget:
                if plan.memory_budget is not None:
                    self.report.budget_guard = guard_budget(
                        prediction.expressions["peak_device"], plan.memory_budget, fw)
                self.report.memory = prediction
                self.report.offloaded_activations = offloaded if offloaded is not None else OffloadedActivations()
                self.report.spilled_boundaries = step.results.spill_boundaries
                self.report.offloaded_gradients = step.results.offload_gradients
                if step.results.derive_schedule is not None:
                    self.report.schedule = step.results.derive_schedule.text()
                if step.results.plan_transfers is not None:
                    self.report.planned_schedule = step.results.plan_transfers
                # The graphs as planned, which the time and memory models read: the
                # compiled stage rewrites them in place (runs of transfers become `_many`
                # calls, regions subgraph calls), and AOTAutograd, where it keeps a
                # backward for its cache when it first compiles it, clears every node's
                # meta (`serialize_graph_module`: a step traced with subgraph calls).
                self.report.partitioned = {"forward": _snapshot(fw), "backward": _snapshot(bw)}
                log.info("speedloader: %s", prediction)
                return fw, bw
            log.info(
                "speedloader: recompute=%s%s needs %d bytes on the device, over the budget of %d",
                recompute, ", every activation stashed" if everything else "", prediction.peak_bytes["device"],
                plan.memory_budget,
            )
        smallest = min(tried, key=lambda p: p.peak_bytes["device"])
        raise BudgetError(self.plan.memory_budget, smallest.peak_bytes["device"], tuple(tried))


def _snapshot(module: torch.fx.GraphModule) -> torch.fx.GraphModule:
    """A copy of `module` whose graph the compiled stage's rewrites of `module` leave
    alone (nodes and their meta dicts copied; the values in them shared)."""
    return _lazy(module, copy.deepcopy(module.graph))


def _lazy(module: torch.fx.GraphModule, graph: torch.fx.Graph | None = None) -> torch.fx.GraphModule:
    """`module` (its attributes and meta) on `graph` (default: its own) as a graph
    module that writes its code when it first runs (`compat.graph_module`)."""
    lazy = graph_module(module, module.graph if graph is None else graph)
    lazy.meta.update(module.meta)
    return lazy


def _aot_eager(gm, example_inputs, prepare, partition_hook, hold, sizes):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import default_partition

    def partition(joint, joint_inputs, **kwargs):
        if partition_hook is None:
            return default_partition(joint, joint_inputs, num_fwd_outputs=kwargs["num_fwd_outputs"])
        return partition_hook(default_partition, joint, joint_inputs, **kwargs)

    def observed(kind: str):
        def compiler(graph: torch.fx.GraphModule, inputs):
            with sizes():  # a backward is compiled at its first call
                prepare(kind, graph)
            return hold(boxed_nop(graph, inputs))

        return compiler

    backend = aot_autograd(
        fw_compiler=observed("forward"),
        bw_compiler=observed("backward"),
        inference_compiler=observed("inference"),
        partition_fn=partition,
    )
    return backend(gm, example_inputs)


class _TagJoint(CustomGraphPass):
    """Inductor joint-graph pre-pass: the first plan's tags, before Inductor's own
    joint-graph rewrites (tagging after them makes the min-cut partitioner fail on
    fetched weights)."""

    def __init__(self, hook: _PlannedPartition):
        self.hook = hook

    def __deepcopy__(self, memo):
        return self

    def __call__(self, graph: torch.fx.Graph) -> None:
        self.hook.tag_first(graph)

    def uuid(self):
        return _InductorPartition(self.hook).uuid()


class _InductorPartition(CustomPartitionerFn):
    """Inductor's partitioner (min-cut) wrapped with the step plan."""

    def __init__(self, hook: _PlannedPartition):
        self.hook = hook

    def __deepcopy__(self, memo):
        # Inductor copies its config for cache keys; the partition hook (with the
        # report it records into) is shared, and the key comes from `uuid`.
        return self

    def __call__(self, gm, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return self.hook(min_cut_rematerialization_partition, gm, joint_inputs, **kwargs)

    def uuid(self):
        return partition_key(self.hook.plan)


def partition_key(plan: StepPlan) -> bytes:
    """The Inductor cache key of the partitioner and joint pass wrapped with `plan`.

    The plan is part of the graphs (fetch and stash keys); the code is this module,
    the pass manager, the units' inlining (`trace_units`) and every module a declared
    pass of any stage lives in; the
    passes the pass settings skip (`SLC_DISABLE`, `pass_settings`) change the graphs
    Inductor compiles too.
    """
    files = (__file__, pass_manager.__file__, pipeline.__file__, trace_units.__file__, *pass_modules(all_passes()))
    disabled = sorted(pass_manager.disabled_passes(all_passes()))
    return get_hash_for_files(tuple(sorted(set(files)))) + repr((dataclasses.astuple(_plan_key(plan)),
                                                                 disabled)).encode()


def _plan_key(plan: StepPlan):
    # The schedule by its policy's name and its text: a function's repr names its
    # address. The holders without their names, which the graphs' keys carry.
    schedule = plan.schedule
    if schedule is not None:
        schedule = (schedule.policy.name if schedule.policy is not None else None, schedule.text())
    return dataclasses.replace(
        plan, schedule=schedule,
        **{field: dataclasses.replace(holder, name="") for field in ("streamer", "stash", "gradients")
           if (holder := getattr(plan, field)) is not None},
    )


def _inductor(gm, example_inputs, prepare, partition_hook, hold, sizes, cudagraphs=False):
    from torch._functorch import config as functorch_config
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    compiling = dict(INDUCTOR_PATCHES)
    if cudagraphs:
        # What mode="reduce-overhead" sets, and the partition at every op tagged
        # cudagraph_unsafe (all of `slc::`) that keeps the transfers out of the graphs.
        compiling.update({"triton.cudagraphs": True, "graph_partition": True})

    def inner(graph: torch.fx.GraphModule, inputs, **kwargs):
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        # Again here: a backward compiles at its first call, after compile_fx returned.
        with inductor_config.patch(compiling), sizes():
            step = prepare(kind, graph)
            if step.results.compile_regions is None:
                return hold(compile_fx_inner(graph, inputs, **kwargs))
            try:
                return hold(compile_fx_inner(step.graphs[kind], inputs, **kwargs))
            except Exception as error:  # noqa: BLE001  (any failure: the flat graph still compiles)
                log.warning("speedloader: Inductor failed on the %s graph's outlined regions (%s: %s); "
                            "compiling it flat", kind, type(error).__name__, error)
                step.report.regions.pop(kind, None)
                drop_marks(graph)
                return hold(compile_fx_inner(graph, inputs, **kwargs))

    patches = dict(compiling)
    if partition_hook is not None:
        patches["custom_partitioner_fn"] = _InductorPartition(partition_hook)
        patches["joint_custom_pre_pass"] = _TagJoint(partition_hook)
    # A backward may reuse the memory of a saved tensor once it is dead ("donated
    # buffers"); Inductor (torch 2.13) counts a read by an outlined region's call
    # too late and overwrote a saved input a later region still read.
    with inductor_config.patch(patches), functorch_config.patch(donated_buffer=False):
        return compile_fx(gm, example_inputs, inner_compile=inner)


def _sizes_of_any_batch(plan: StepPlan | None):
    """While AOTAutograd traces a rewritten step, a size it cannot decide from the
    sizes' ranges alone is decided as for a large batch, unguarded: a sub-batch of
    one sample (a batch of K at a dynamic compile) would otherwise guard the graph on
    `batch // K == 1` (broadcasting's test of a size 1), and the next batch compile
    again, where the same graph serves every batch."""
    from torch.fx.experimental import _config as shapes_config

    return shapes_config.patch(backed_size_oblivious=True) if plan is not None else contextlib.nullcontext()
