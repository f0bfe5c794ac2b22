"""The pass pipeline: every stage's passes, declared as data in one place.

A graph Dynamo hands the backend goes through these stages (see
`slcompile.passes.manager` for the runner, which lints, times, dumps and disables):

- `PASSES` ("dynamo"): inline checkpointed regions (as `recompute="blocks"`), classify the inputs, find the blocks and the batch dimension,
  propagate the batch, check the graph splits, plan the policy's schedule,
  interleave the sub-batches in its order, stream the block weights. `run_pipeline` runs them.
- `JOINT_PASSES` ("joint"): tag AOTAutograd's joint graph for the partitioner
  (fetched weights and, when the plan recomputes blocks, their internals: every
  block's, or those of the units the policy's schedule names).
- `PARTITIONED_PASSES` ("partitioned"): on the forward and backward graphs the
  partitioner returned: fuse the weight gradients, restore the schedule's order,
  ask the policy again with the saved activations' lifetimes (`plan_transfers`),
  offload saved activations and gradients where that schedule says, issue weight loads ahead, and predict the
  step's memory and read its schedule back from the graphs.
- `INFERENCE_PASSES` ("inference"): the same for an inference graph.
- `COMPILED_PASSES` ("compiled"): each AOT graph as it is handed to its compiler
  (the stream of each transfer, compute-region markers; with Inductor, the graph cut
  into regions compiled once each, or its markers dropped when it compiles whole).

The lowering (`slcompile.backends.lowering`) runs the stages after Dynamo's from
AOTAutograd's hooks, once per recompute choice it tries. To add a pass, write a
function of the stage's state (see `slcompile.passes.manager`) and add a `Pass` to
the stage's list (after Dynamo's stage, and a field to `StepResults` for what it
returns); the Inductor cache key covers its module.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import logging
from collections.abc import Sequence
from typing import Any

import torch
import torch.fx

from slcompile.analysis.batch_propagation import PROPAGATE_BATCH_CODE, BatchPlan, propagate_batch, run_suffix_whole
from slcompile.analysis.blocks import BlockGraph
from slcompile.analysis.inputs import GraphInput, classify_inputs
from slcompile.analysis.machine import ProcessFacts
from slcompile.analysis.memory import MemoryPrediction, predict_memory
from slcompile.analysis.time import step_seconds
from slcompile.config import SpeedLoaderConfig
from slcompile.errors import PolicyError, RefusedError
from slcompile.passes.check_splittable import check_splittable
from slcompile.passes.coalesce_transfers import CoalescedTransfers, coalesce_transfers
from slcompile.passes.find_batch_dim import BatchInfo, find_batch_dim
from slcompile.passes.find_blocks import find_blocks
from slcompile.passes.fuse_weight_grads import fuse_weight_grads
from slcompile.passes.inline_checkpoints import inline_checkpoints
from slcompile.passes.interleave import InterleaveReport, interleave
from slcompile.passes.manager import Analysis, Pass, PassLog, run_passes
from slcompile.passes.annotate_streams import StreamAnnotations, annotate_streams, stream_key
from slcompile.passes.mark_regions import RegionMarks, drop_marks, mark_regions
from slcompile.passes.outline_regions import RegionOutline, outline_regions
from slcompile.passes.offload_activations import (
    OffloadedActivations,
    offload_saved,
    saved_activations,
    tag_block_recompute,
)
from slcompile.passes.offload_gradients import GradientReport, offload_gradients
from slcompile.passes.order_layer_major import order_layer_major
from slcompile.passes.spill_boundaries import SpilledBoundaries, spill_boundaries
from slcompile.passes.stream_weights import (
    PlacedPrefetches,
    StreamedWeights,
    place_prefetches,
    resident_trainable,
    stream_weights,
    tag_fetch_views,
)
from slcompile.plans import StreamerPlan, new_name
from slcompile.schedules.base import STASH_TIERS, Schedule, recompute_text
from slcompile.schedules.derive import schedule_of
from slcompile.schedules.planner import TransferTiming
from slcompile.schedules.policies import BUILTIN_POLICIES, plan_schedule, suffix_choices
from slcompile.schedules.validate import check_agreement

__all__ = [
    "PipelineState",
    "StepResults",
    "StepState",
    "Pass",
    "PASSES",
    "JOINT_PASSES",
    "PARTITIONED_PASSES",
    "INFERENCE_PASSES",
    "COMPILED_PASSES",
    "all_passes",
    "run_pipeline",
    "run_stage",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelineState:
    """Everything the passes have produced so far.

    Attributes:
        gm: the current graph (the Dynamo graph until `interleave` rewrites it).
        example_inputs: Dynamo's example inputs, one per placeholder.
        config: the backend's options.
        inputs: placeholders classified (param, buffer, user, size).
        blocks: prefix, blocks, suffix.
        batch: the batch dimension of each input.
        plan: how each node runs over sub-batches.
        schedule: the policy's schedule for this graph, the order the rewrite emits.
        interleaved: what `interleave` emitted, if it ran.
        streamer: the weight streamer's plan (`StreamerPlan`) when weights rest off
            the device.
        streamed: which weights `stream_weights` fetches per block.
        passes_run: names of the passes run, with their time, in order.
        notes: what the passes changed of the options, in words (shown by
            `explain()` and logged).
        facts: what the passes need of the machine and the process, found by the
            caller before they run (`slcompile.facts.process_facts`).
    """

    gm: torch.fx.GraphModule
    example_inputs: Sequence[Any]
    config: SpeedLoaderConfig
    inputs: tuple[GraphInput, ...] | None = None
    blocks: BlockGraph | None = None
    batch: BatchInfo | None = None
    plan: BatchPlan | None = None
    schedule: Schedule | None = None
    interleaved: InterleaveReport | None = None
    streamer: StreamerPlan | None = None
    streamed: StreamedWeights | None = None
    passes_run: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    facts: ProcessFacts = ProcessFacts()


def _inline_checkpoints(state: PipelineState) -> PipelineState:
    gm, regions = inline_checkpoints(state.gm)
    if not regions:
        return state
    config = state.config
    shown = ", ".join(regions[:2]) + (", ..." if len(regions) > 2 else "")
    if config.recompute == "none":
        note = (f"gradient checkpointing of {len(regions)} regions ({shown}) not applied: recompute='none' "
                "keeps every block's activations")
    else:
        note = (f"gradient checkpointing of {len(regions)} regions ({shown}) runs as recompute='blocks' "
                "(each block recomputed per sub-batch in the backward)")
        config = dataclasses.replace(config, recompute="blocks")
    log.info("speedloader: %s", note)
    return dataclasses.replace(state, gm=gm, config=config, notes=state.notes + (note,))


def _classify(state: PipelineState) -> PipelineState:
    inputs = tuple(classify_inputs(state.gm, state.example_inputs))
    _refuse_fsdp(state.gm, inputs)
    return dataclasses.replace(state, inputs=inputs)


def _refuse_fsdp(gm: torch.fx.GraphModule, inputs) -> None:
    """Refuses a graph whose parameters FSDP2's `fully_shard` manages (DTensors between
    calls, all-gathered plain tensors inside them) or that holds DTensor parameters:
    speedloader streams whole block weights and shards them itself."""
    if not (torch.distributed.is_available() and torch.distributed.is_initialized()):
        return  # neither exists without a process group
    from torch.distributed.tensor import DTensor

    params = [i for i in inputs if i.kind == "param" and isinstance(i.value, torch.Tensor)]
    managed = _fsdp_managed() if params else set()
    found = [i.name for i in params if isinstance(i.value, DTensor) or id(i.value) in managed]
    if found:
        raise RefusedError(
            f"the model is sharded with FSDP2's fully_shard or holds DTensor parameters ({found[0]}): "
            "speedloader streams and shards whole block weights itself; compile the model without "
            "fully_shard, with the speedloader option shard_weights=True (and "
            "slcompile.offload_optimizer) to shard the block weights across the process group's ranks",
            "classify_inputs",
        )


def _fsdp_managed() -> set[int]:
    """The ids of the parameters FSDP2 manages in this process, sharded and unsharded
    (read from its module states: torch has no public query for it)."""
    try:
        from torch.distributed._composable_state import _module_state_mapping
        from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState
    except ImportError:
        return set()
    managed = set()
    for state_ref in list(_module_state_mapping.values()):
        state = state_ref()
        group = getattr(state, "_fsdp_param_group", None) if isinstance(state, FSDPState) else None
        for fsdp_param in getattr(group, "fsdp_params", ()):
            for name in ("_unsharded_param", "sharded_param"):
                tensor = getattr(fsdp_param, name, None)
                if tensor is not None:
                    managed.add(id(tensor))
    return managed


def _find_blocks(state: PipelineState) -> PipelineState:
    return dataclasses.replace(state, blocks=find_blocks(state.gm, list(state.inputs)))


def _find_batch_dim(state: PipelineState) -> PipelineState:
    batch = find_batch_dim(
        state.gm, list(state.inputs), state.config.batch_dim, state.config.num_subbatches
    )
    return dataclasses.replace(state, batch=batch)


def _propagate(state: PipelineState) -> PipelineState:
    plan = propagate_batch(
        state.gm,
        state.inputs,
        state.batch.batched_inputs,
        state.batch.batch_symbols,
        state.batch.batch_size,
        state.config.num_subbatches,
        state.blocks.regions,
    )
    notes = state.notes
    if suffix_choices(state.config)[0]:
        plan, reason = run_suffix_whole(state.gm, plan, state.blocks.regions)
        if reason is not None:
            log.info("speedloader: %s", reason)
            notes += (reason,)
    return dataclasses.replace(state, plan=plan, notes=notes)


def _check(state: PipelineState) -> PipelineState:
    return dataclasses.replace(state, plan=check_splittable(state.plan))


def _plan_schedule(state: PipelineState) -> PipelineState:
    config, machine = state.config, state.facts.machine
    weights_streamed = machine.copies(config.weights) or config.shard_weights
    schedule = plan_schedule(
        state.blocks, config,
        weights_streamed=weights_streamed,
        activations_offloaded=machine.copies(config.activations),
        gradients_offloaded=weights_streamed and gradients_leave(config, state.blocks, state.inputs, state.facts),
        stash_tiers=tuple(tier for tier in STASH_TIERS if machine.copies(tier)),
        whole_suffix=state.plan.whole_suffix,
    )
    notes = state.notes
    if schedule.recompute is not None and schedule.request.backward:
        chosen = recompute_text(schedule.recompute).split()[1:] if schedule.recompute else []
        units = len(schedule.request.blocks) * config.num_subbatches
        shown = f" ({', '.join(chosen[:4])}{', ...' if len(chosen) > 4 else ''})" if chosen else ""
        note = (f"the {schedule.policy.name} policy recomputes {len(schedule.recompute)} of {units} block units "
                f"in the backward{shown}, in place of recompute={config.recompute!r}")
        log.info("speedloader: %s", note)
        notes += (note,)
    return dataclasses.replace(state, schedule=schedule, notes=notes)


def gradients_leave(config: SpeedLoaderConfig, blocks: BlockGraph, inputs, facts: ProcessFacts) -> bool:
    """Whether the backward sends the block weights' gradients off the device, as
    `slcompile.plans.sink_plan` decides when the graph lowers: some
    block weight that streams has a gradient (the `trainable` option keeps none on
    the device, `resident_trainable`), and `gradients` names a tier or ("auto") an
    offloaded optimizer holds it."""
    if config.gradients == "device":
        return False
    values = {i.name: i.value for i in inputs if i.kind == "param"}
    readers = collections.Counter(name for block in blocks.blocks for name in set(block.params))
    for block in blocks.blocks:
        # What `stream_weights` may stream: the parameters no other block reads.
        params = [values[name] for name in block.params if name in values and readers[name] == 1]
        kept = resident_trainable(config.trainable, params)
        for param in params:
            if param.requires_grad and id(param) not in kept and (
                    config.gradients != "auto" or id(param) in facts.optimizer_held):
                return True
    return False


def _interleave(state: PipelineState) -> PipelineState:
    gm, report = interleave(state.gm, state.blocks, state.batch, state.plan, state.schedule)
    return dataclasses.replace(state, gm=gm, interleaved=report)


def _stream(state: PipelineState) -> PipelineState:
    config, facts = state.config, state.facts
    if state.interleaved is None or config.weights == "device":
        return state
    sharded = config.shard_weights
    if not facts.machine.copies(config.weights) and not sharded:
        log.debug("weights=%s copies nothing on this machine: weights stay resident", config.weights)
        return state
    # Sharded weights are marked as such when the step's runtime starts, before an
    # offloaded optimizer copies them (`StepRuntime.start`).
    streamer = StreamerPlan(
        new_name("w"), config.weights, config.live_blocks, offload_dir=config.offload_dir,
        world_size=facts.machine.world_size if sharded else 1, sharded=sharded, issues_in_groups=True,
    )
    gm, streamed = stream_weights(
        state.gm, state.blocks, state.inputs, functools.partial(facts.stored_key, streamer.name), streamer.graph_key,
        fetch_groups=state.schedule.fetch_groups(), trainable=config.trainable,
    )
    return dataclasses.replace(state, gm=gm, streamer=streamer, streamed=streamed)


PASSES: tuple[Pass, ...] = (
    # Checkpointed layers, traced for the whole batch, become nodes of the graph.
    Pass("inline_checkpoints", "dynamo", "rewrite", _inline_checkpoints, code=(inline_checkpoints,)),
    Pass("classify_inputs", "dynamo", "analysis", _classify, required=True, code=(classify_inputs,)),
    Pass("find_blocks", "dynamo", "analysis", _find_blocks, required=True, code=(find_blocks,)),
    Pass("find_batch_dim", "dynamo", "analysis", _find_batch_dim, required=True, code=(find_batch_dim,)),
    Pass("propagate_batch", "dynamo", "analysis", _propagate, required=True, code=(*PROPAGATE_BATCH_CODE, run_suffix_whole)),
    Pass("check_splittable", "dynamo", "check", _check, code=(check_splittable,)),
    # The schedule orders every later stage's graphs, interleaved or not.
    Pass("plan_schedule", "dynamo", "analysis", _plan_schedule, required=True, code=(plan_schedule,)),
    Pass("interleave", "dynamo", "rewrite", _interleave, code=(interleave,)),
    Pass("stream_weights", "dynamo", "rewrite", _stream, code=(stream_weights,)),
)


def run_pipeline(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: SpeedLoaderConfig,
    *,
    facts: ProcessFacts,
    passes: Sequence[Pass] = PASSES,
    stop_after: str | None = None,
    passes_log: PassLog | None = None,
) -> PipelineState:
    """Runs the Dynamo stage's passes on a Dynamo graph.

    Args:
        gm: the Dynamo graph.
        example_inputs: Dynamo's example inputs.
        config: the backend's options.
        facts: what the passes need of the machine and the process
            (`slcompile.facts.process_facts(config, example_inputs)`).
        passes: the passes to run, in order.
        stop_after: the name of the last pass to run (analysis without rewriting).
        passes_log: the log the later stages continue (`CompileReport.pass_log`);
            default: a new one.

    Returns:
        the final state; `passes_run` lists the passes run, with their time.

    Raises:
        RefusedError: a pass refused the graph; the message names the passes run and
            `err.state` holds what the passes before it produced.
        ValueError: the pass settings (`SLC_DISABLE`, `pass_settings`) disable an unknown
            pass or one that cannot be disabled.
    """
    state = PipelineState(gm=gm, example_inputs=example_inputs, config=config, facts=facts)
    return run_stage(passes, state, passes_log if passes_log is not None else PassLog(), stop_after=stop_after)


def run_stage(passes: Sequence[Pass], state: Any, passes_log: PassLog, **kwargs: Any) -> Any:
    """`run_passes` over one stage's passes, with every declared pass as the names
    the pass settings may disable."""
    return run_passes(passes, state, passes_log, declared=all_passes(), **kwargs)



# The stages after Dynamo's. Each function takes the StepState and returns its
# record, which the pass manager sets as `step.results.<pass name>`.


@dataclasses.dataclass
class StepResults:
    """What each pass after Dynamo's stage returned (None: not run, disabled, or
    nothing to do), one field per pass name of `JOINT_PASSES`, `PARTITIONED_PASSES`,
    `INFERENCE_PASSES` and `COMPILED_PASSES`."""

    tag_fetch_views: int | None = None
    tag_block_recompute: int | None = None
    fuse_weight_grads: int | None = None
    order_layer_major: dict[str, int] | None = None
    plan_transfers: Schedule | None = None
    offload_activations: OffloadedActivations | None = None
    spill_boundaries: SpilledBoundaries | None = None
    place_prefetches: PlacedPrefetches | None = None
    offload_gradients: GradientReport | None = None
    derive_schedule: Schedule | None = None
    predict_memory: MemoryPrediction | None = None
    annotate_streams: StreamAnnotations | None = None
    coalesce_transfers: CoalescedTransfers | None = None
    mark_regions: RegionMarks | None = None
    compile_regions: RegionOutline | None = None
    drop_marks: int | None = None


@dataclasses.dataclass
class StepState:
    """What the passes after Dynamo's stage work on.

    Attributes:
        plan: the `StepPlan` (`slcompile.backends.lowering`): streamer, stash,
            schedule, tiers, budget.
        report: the graph's `CompileReport` (its `config` holds the options).
        graphs: the graphs by kind ("joint", "forward", "backward", "inference").
        kind: in the "compiled" stage, the kind of the graph being compiled.
        recompute: the recompute choice being tried ("none", "blocks", or
            "policy": the units the schedule names, `Schedule.recompute`).
        num_fwd_outputs: the partitioner's count of the forward's user outputs.
        lowering: "aot_eager" or "inductor".
        results: what each pass returned, one attribute per pass name
            (`slcompile.pipeline.StepResults`), for the passes after it.
        analyses: while a pass runs, the analyses it declares by name (`Pass.requires`),
            each computed on its first read; None between passes.
    """

    plan: Any
    report: Any
    graphs: dict[str, Any] = dataclasses.field(default_factory=dict)
    kind: str = ""
    recompute: str = "none"
    num_fwd_outputs: int | None = None
    lowering: str = "aot_eager"
    results: StepResults = dataclasses.field(default_factory=StepResults)
    analyses: Any = None

    @property
    def config(self):
        return self.report.config



def _joint_graph(step: StepState) -> torch.fx.Graph:
    joint = step.graphs["joint"]
    return joint.graph if isinstance(joint, torch.fx.GraphModule) else joint


def _tag_fetch_views(step: StepState) -> int:
    if step.plan.streamer is None:
        return 0
    return tag_fetch_views(_joint_graph(step))


def _tag_block_recompute(step: StepState) -> int:
    if step.recompute not in ("blocks", "policy"):
        return 0
    # The Dynamo stage's schedule: the one asked before the partition.
    units = step.plan.schedule.recompute if step.recompute == "policy" else None
    tagged = tag_block_recompute(_joint_graph(step), units)
    log.debug("recomputing %d forward nodes of the blocks in the backward", tagged)
    return tagged


JOINT_PASSES: tuple[Pass, ...] = (
    Pass("tag_fetch_views", "joint", "rewrite", _tag_fetch_views, graphs=("joint",), code=(tag_fetch_views,)),
    Pass(
        "tag_block_recompute", "joint", "rewrite", _tag_block_recompute, graphs=("joint",),
        code=(tag_block_recompute,),
    ),
)


def _fuse_weight_grads(step: StepState) -> int:
    plan = step.plan
    # When sub-batches reach a block apart (sample-major), one matmul over all of
    # them would keep every sub-batch's output gradients alive until the last one
    # reaches the block: gradient accumulation adds each one's as soon as it is done.
    backward = plan.schedule.order("bwd")
    together = all(backward.contiguous("block", block) for block in plan.block_positions)
    if plan.num_subbatches <= 1 or not together:
        return 0
    _, fused = fuse_weight_grads(step.graphs["backward"])
    step.report.fused_weight_grads = fused
    return fused


def _order_layer_major(step: StepState) -> dict[str, int]:
    moved = {}
    for kind, phase in (("forward", "fwd"), ("backward", "bwd"), ("inference", "fwd")):
        if kind in step.graphs:
            _, moved[kind] = order_layer_major(step.graphs[kind], phase, step.plan.schedule)
            log.debug("order_layer_major moved %d nodes of the %s graph", moved[kind], kind)
    return moved


def _plan_transfers(step: StepState) -> Schedule:
    plan = step.plan
    if plan.stash is None or plan.schedule is None:
        return plan.schedule
    saved = saved_activations(
        step.graphs["forward"], step.graphs["backward"], step.num_fwd_outputs, plan.min_offload_bytes
    )
    offload_at_least = None
    if plan.memory_budget is not None:
        # What keeping every saved activation would take over the budget.
        kept_peak = step.analyses["kept_memory"].peak_bytes["device"]
        offload_at_least = max(kept_peak - plan.memory_budget, 0)
    schedule = plan.schedule.replan(
        saved=saved, offload_at_least=offload_at_least, stash_everything=plan.stash_everything,
        timing=_transfer_timing(step),
    )
    if schedule.recompute != plan.schedule.recompute and schedule.policy is not None:
        # The joint graph was tagged with the first answer, before the partition.
        raise PolicyError(schedule.policy.name, "recomputes other units once the saved activations are known "
                          f"(`{_recompute_line(plan.schedule)}` before, `{_recompute_line(schedule)}` now): "
                          "the units are chosen before the partition, when request.saved is None")
    return schedule


def _recompute_line(schedule: Schedule) -> str:
    return recompute_text(schedule.recompute) if schedule.recompute is not None else "no recompute line"


def _transfer_timing(step: StepState) -> TransferTiming | None:
    """The time model's facts the planner places stashes by, with a profile."""
    plan = step.plan
    if plan.profile is None:
        return None
    from slcompile.analysis.memory import size_hints

    graphs = (step.graphs["forward"], step.graphs["backward"])
    subs = size_hints(*graphs)
    lowering = "inductor" if step.lowering == "inductor" else "aot_eager"
    seconds = {}
    for gm, phase in zip(graphs, ("fwd", "bwd")):
        seconds.update(step_seconds(gm, phase, plan.profile, lowering, subs))
    return TransferTiming(tuple(sorted(seconds.items(), key=repr)), plan.profile, plan.activations_tier)


def step_schedule(step: StepState) -> Schedule:
    """The schedule of a partitioned step: `plan_transfers`'s, else the Dynamo stage's."""
    return step.results.plan_transfers or step.plan.schedule


def _offload_activations(step: StepState) -> OffloadedActivations:
    plan = step.plan
    if plan.stash is None:
        return OffloadedActivations()
    schedule = step_schedule(step)
    return offload_saved(
        step.graphs["forward"], step.graphs["backward"], step.num_fwd_outputs, plan.stash.graph_key,
        schedule.request.saved, schedule,
    )


def _spill_boundaries(step: StepState) -> SpilledBoundaries:
    plan = step.plan
    schedule = step_schedule(step)
    if plan.stash is None or schedule is None or schedule.request is None or not schedule.spills():
        return SpilledBoundaries()
    if "inference" in step.graphs and schedule.request.backward:
        schedule = schedule.replan(backward=False)  # as `derive_schedule` compares it
    graph = step.graphs.get("forward", step.graphs.get("inference"))
    return spill_boundaries(graph, schedule, plan.stash.graph_key, schedule.policy.name if schedule.policy else "")


def _place_prefetches(step: StepState):
    if step.plan.streamer is None:
        return None
    forward = step.graphs.get("forward", step.graphs.get("inference"))
    return place_prefetches(forward, step.graphs.get("backward"), step.plan.live_blocks)


def _offload_gradients(step: StepState):
    gradients = step.plan.gradients
    if gradients is None:
        return None
    _, stored = offload_gradients(
        step.graphs["forward"], step.graphs["backward"], gradients.graph_key, gradients.wants, step_schedule(step)
    )
    return stored


def _kept_memory(step: StepState):
    """The step's memory with every saved activation on the device, as the partition
    left it (what `plan_transfers` weighs a memory budget against)."""
    return _predict_memory(step, OffloadedActivations())


KEPT_MEMORY = Analysis("kept_memory", _kept_memory)


def _predict_memory(step: StepState, offloaded: OffloadedActivations | None = None):
    plan = step.plan
    if "inference" in step.graphs:
        return predict_memory(
            step.graphs["inference"], graph_kind="inference", live_blocks=plan.live_blocks,
            activations_tier=plan.activations_tier if plan.stash is not None else "device",
            weights_tier=plan.weights_tier, streamed_bytes=plan.streamed_bytes, machine=plan.machine,
        )
    if offloaded is None:
        offloaded = step.results.offload_activations or OffloadedActivations()
    return predict_memory(
        step.graphs["forward"], step.graphs["backward"],
        live_blocks=plan.live_blocks if plan.streamer is not None else 1,
        weights_tier=plan.weights_tier, streamed_bytes=plan.streamed_bytes,
        activations_tier=plan.activations_tier, offloaded_bytes=offloaded.bytes,
        offloaded_tiers=offloaded.bytes_by_tier(plan.activations_tier) if offloaded.tier_bytes else None,
        recompute=step.recompute, optimizer=plan.optimizer,
        gradients_tier=plan.gradients.tier if plan.gradients is not None else None, machine=plan.machine,
    )


def _derive_schedule(step: StepState) -> Schedule:
    planned = step_schedule(step)
    whole_suffix = planned is not None and planned.request is not None and planned.request.whole_suffix
    if "inference" in step.graphs:
        derived = schedule_of(step.graphs["inference"], whole_suffix=whole_suffix)
    else:
        derived = schedule_of(step.graphs["forward"], step.graphs["backward"], whole_suffix=whole_suffix)
    if planned is not None and planned.policy is not None:
        if "inference" in step.graphs and planned.request.backward:
            # The Dynamo stage plans a training step; AOTAutograd found nothing to
            # differentiate (an evaluation under no_grad): the policy's forward alone.
            planned = planned.replan(backward=False)
        try:
            check_agreement(planned, derived, planned.policy.name)
        except PolicyError as err:
            if planned.policy.name not in BUILTIN_POLICIES:
                err.derived_schedule = derived  # the lowering puts it in the report beside the plan
                raise
            # The built-in planners do not yet predict every transfer the passes
            # place (the gradient stores `offload_gradients` adds for an offloaded
            # optimizer; unstashes a mixture of experts reads in another block): the
            # compiled graphs, which `report.schedule` shows, are what runs.
            log.info("speedloader: the compiled transfers differ from the %s plan: %s",
                     planned.policy.name, err)
    return derived


PARTITIONED_PASSES: tuple[Pass, ...] = (
    Pass(
        "fuse_weight_grads", "partitioned", "rewrite", _fuse_weight_grads, graphs=("backward",),
        code=(fuse_weight_grads,),
    ),
    Pass(
        "order_layer_major", "partitioned", "rewrite", _order_layer_major, graphs=("forward", "backward"),
        code=(order_layer_major,),
    ),
    # The policy places the activations' transfers from their lifetimes.
    Pass("plan_transfers", "partitioned", "analysis", _plan_transfers, required=True, code=(saved_activations,),
         requires=(KEPT_MEMORY,)),
    Pass(
        "offload_activations", "partitioned", "rewrite", _offload_activations, graphs=("forward", "backward"),
        code=(offload_saved,),
    ),
    # The boundary activations a policy spills (`spill.*`, `fill.*` steps).
    Pass(
        "spill_boundaries", "partitioned", "rewrite", _spill_boundaries, graphs=("forward",),
        code=(spill_boundaries,),
    ),
    # Marks each fetch with its phase: the runtime needs it to find the weights.
    Pass(
        "place_prefetches", "partitioned", "rewrite", _place_prefetches, graphs=("forward", "backward"),
        required=True, code=(place_prefetches,),
    ),
    Pass(
        "offload_gradients", "partitioned", "rewrite", _offload_gradients, graphs=("forward", "backward"),
        code=(offload_gradients,),
    ),
    Pass("derive_schedule", "partitioned", "analysis", _derive_schedule, code=(schedule_of,)),
    # The recompute search reads its figure.
    Pass("predict_memory", "partitioned", "analysis", _predict_memory, required=True, code=(predict_memory,)),
)

INFERENCE_PASSES: tuple[Pass, ...] = (
    Pass(
        "order_layer_major", "inference", "rewrite", _order_layer_major, graphs=("inference",),
        code=(order_layer_major,),
    ),
    Pass(
        "spill_boundaries", "inference", "rewrite", _spill_boundaries, graphs=("inference",),
        code=(spill_boundaries,),
    ),
    Pass(
        "place_prefetches", "inference", "rewrite", _place_prefetches, graphs=("inference",),
        required=True, code=(place_prefetches,),
    ),
    Pass("derive_schedule", "inference", "analysis", _derive_schedule, code=(schedule_of,)),
    Pass("predict_memory", "inference", "analysis", _predict_memory, required=True, code=(predict_memory,)),
)


def _annotate_streams(step: StepState):
    plan = step.plan
    streamer = plan.streamer if plan is not None else None
    gradients = plan.gradients if plan is not None else None
    return annotate_streams(
        step.graphs[step.kind], key=stream_key(step.lowering),
        sharded_weights=streamer is not None and streamer.sharded,
        sharded_gradients=gradients is not None and gradients.sharded,
    )


def _coalesce_transfers(step: StepState) -> CoalescedTransfers | None:
    if step.lowering != "inductor":
        return None
    streamer = step.plan.streamer if step.plan is not None else None
    # Whole weights on a host tier that copies load straight into a visit's packed tensors.
    fetches = streamer is not None and streamer.tier == "host" and not streamer.sharded
    step.graphs[step.kind], done = coalesce_transfers(step.graphs[step.kind], fetches=fetches)
    return done


def _mark_regions(step: StepState):
    # Inductor fuses kernels across markers (see `mark_regions`), unless the regions
    # are outlined subgraphs (`compile_regions`): the markers then bracket the calls.
    if step.lowering != "aot_eager" and (step.plan is None or not step.plan.compile_regions):
        return None
    if step.plan is not None and step.plan.cudagraphs:
        return None  # a CUDA graph's replay runs no host code, markers included
    if step.lowering == "inductor" and step.plan is not None and step.plan.machine.device == "cuda":
        # On a GPU a marker times when the host issued a region, not when it ran, and
        # costs each (block, sub-batch) unit two host calls: the step's host time,
        # which a launch-bound step is made of.
        return None
    _, marks = mark_regions(step.graphs[step.kind], step.kind)
    return marks


def _compile_regions(step: StepState):
    plan = step.plan
    if step.lowering != "inductor" or plan is None or not plan.compile_regions:
        return None
    outlined = outline_regions(step.graphs[step.kind])
    if outlined is None:
        return None
    step.graphs[step.kind], done = outlined
    step.report.regions[step.kind] = done
    return done


def _drop_marks(step: StepState) -> int:
    if step.lowering != "inductor" or step.results.compile_regions is not None:
        return 0
    _, dropped = drop_marks(step.graphs[step.kind])
    return dropped


COMPILED_PASSES: tuple[Pass, ...] = (
    # Names the stream each transfer runs on (Inductor never acts on it).
    Pass(
        "annotate_streams", "compiled", "rewrite", _annotate_streams, graphs=("compiled",),
        code=(annotate_streams,),
    ),
    # With Inductor: a run of stashes, of waits, of loads or of weight issues is one op call.
    Pass(
        "coalesce_transfers", "compiled", "rewrite", _coalesce_transfers, graphs=("compiled",),
        code=(coalesce_transfers,),
    ),
    Pass("mark_regions", "compiled", "rewrite", _mark_regions, graphs=("compiled",), code=(mark_regions,)),
    # With Inductor: each (block, sub-batch) region a call of its subgraph, one per
    # distinct region, which Inductor lowers once.
    Pass(
        "compile_regions", "compiled", "rewrite", _compile_regions, graphs=("compiled",),
        code=(outline_regions,),
    ),
    # Inductor fuses kernels across markers (see `mark_regions`): a graph it lowers
    # flat keeps none.
    Pass("drop_marks", "compiled", "rewrite", _drop_marks, graphs=("compiled",), required=True, code=(drop_marks,)),
)


def all_passes() -> tuple[Pass, ...]:
    """Every declared pass of every stage, in stage order."""
    return (*PASSES, *JOINT_PASSES, *PARTITIONED_PASSES, *INFERENCE_PASSES, *COMPILED_PASSES)
