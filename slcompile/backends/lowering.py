"""Lower a (rewritten) Dynamo graph with AOTAutograd and Inductor or aot_eager.

Inductor runs with `reorder_for_peak_memory` off: that pass moves block kernels out of
layer-major order in the backward. The option is patched around every inner compile
(the backward may compile later than the forward), and it is part of Inductor's cache
key, so a cached graph compiled with other options is never served. Every AOTAutograd
graph is first put back into layer-major order (`order_layer_major`; the
partitioner moves some saved values to the end of the forward) and then recorded in
the CompileReport, so tests can read the order that is compiled.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch._inductor.custom_graph_pass import CustomGraphPass, CustomPartitionerFn, get_hash_for_files

from slcompile.analysis.memory import MemoryPrediction, predict_memory
from slcompile.errors import BudgetError
from slcompile.passes.mark_regions import mark_regions
from slcompile.passes.fuse_weight_grads import fuse_weight_grads
from slcompile.pipeline import disabled_passes
from slcompile.passes.order_layer_major import order_layer_major
from slcompile.passes import offload_activations as offload_activations_module
from slcompile.passes import stream_weights as stream_weights_module
from slcompile.passes.offload_activations import OffloadedActivations, offload_saved, tag_block_recompute
from slcompile.passes.stream_weights import plan_fetches, tag_fetch_views
from slcompile.report import CompileReport

__all__ = ["lower", "StepPlan", "INDUCTOR_PATCHES"]

log = logging.getLogger(__name__)

# reorder_for_locality would also sink compute below transfer waits.
INDUCTOR_PATCHES = {"reorder_for_peak_memory": False, "reorder_for_locality": False}


@dataclasses.dataclass(frozen=True)
class StepPlan:
    """How a rewritten graph's step is planned around AOTAutograd's partitioner.

    Attributes:
        block_positions: block index -> position in forward execution order.
        num_subbatches: K.
        streamer: the WeightStreamer when block weights rest off the device.
        stash: the ActivationStash when saved activations rest off the device.
        recompute: "auto", "none" or "blocks" (see `SpeedLoaderConfig`).
        min_offload_bytes: saved tensors smaller than this stay on the device.
        memory_budget: the device's limit in bytes, or None.
        live_blocks: the weight streamer's window.
        weights_tier, activations_tier: where each rests.
        streamed_bytes: bytes of the streamed weights (P).
        sample_major: the graphs run each sub-batch through every block before the
            next sub-batch (the grad_accumulation schedule) instead of layer-major.
    """

    block_positions: dict[int, int]
    num_subbatches: int
    streamer: Any = None
    stash: Any = None
    recompute: str = "auto"
    min_offload_bytes: int = 0
    memory_budget: int | None = None
    live_blocks: int = 1
    weights_tier: str = "device"
    activations_tier: str = "device"
    streamed_bytes: int = 0
    sample_major: bool = False


def lower(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    lowering: str,
    report: CompileReport,
    plan: StepPlan | None = None,
) -> Callable:
    """Compiles `gm` with the chosen lowering; records the AOT graphs in `report`.

    With a `plan` (a rewritten graph), the partitioner is wrapped: the joint graph's
    fetched-weight views are tagged for recomputation (`tag_fetch_views`) and, when
    the plan recomputes blocks, every block's internals (`tag_block_recompute`);
    after partitioning, the backward's per-sub-batch weight gradients are summed in
    one matmul where that moves fewer bytes (`fuse_weight_grads`; layer-major plans
    only), both graphs are put back into layer-major order (`order_layer_major`;
    sample-major for the grad_accumulation schedule), saved activations move to
    their tier (`offload_saved`), and the step's memory is predicted. With
    `recompute="auto"` and a budget the step would exceed, it partitions again
    with block recomputation; when nothing fits it raises `BudgetError` with the
    smallest budget that would. Each compiled graph's fetch order becomes the weight
    streamer's prefetch plan (`plan_fetches`).

    Raises:
        BudgetError: no plan fits `plan.memory_budget`.
    """
    partition_hook = None if plan is None else _PlannedPartition(plan, report)

    def prepare(kind: str, graph: torch.fx.GraphModule) -> None:
        if plan is not None and kind == "inference":
            _order(graph, "fwd", plan)
            report.memory = predict_memory(
                graph, graph_kind="inference", live_blocks=plan.live_blocks,
                weights_tier=plan.weights_tier, streamed_bytes=plan.streamed_bytes,
                load_granularity=_load_granularity(),
            )
        if plan is not None and plan.streamer is not None:
            phase = "bwd" if kind == "backward" else "fwd"
            plan.streamer.set_plan(phase, plan_fetches(graph.graph, phase))
            graph.recompile()
        if lowering == "aot_eager" and "mark_regions" not in disabled_passes():  # Inductor: see mark_regions
            mark_regions(graph, kind)
        report.record_graph(kind, graph)

    if lowering == "aot_eager":
        return _aot_eager(gm, example_inputs, prepare, partition_hook)
    if lowering == "inductor":
        return _inductor(gm, example_inputs, prepare, partition_hook)
    raise ValueError(f"unknown lowering {lowering!r}")


def _load_granularity() -> int:
    """On a CPU machine, loads read files straight into page-padded memory."""
    from slcompile.runtime.tiers import PAGE_BYTES

    return 1 if torch.cuda.is_available() else PAGE_BYTES


def _order(graph: torch.fx.GraphModule, phase: str, plan: StepPlan) -> None:
    if "order_layer_major" in disabled_passes():
        return
    _, moved = order_layer_major(
        graph, phase, plan.block_positions, plan.num_subbatches, sample_major=plan.sample_major
    )
    log.debug("order_layer_major moved %d nodes of the %s graph", moved, phase)


class _PlannedPartition:
    """Wraps a partitioner with the plan's joint-graph tags and post-partition passes."""

    def __init__(self, plan: StepPlan, report: CompileReport):
        self.plan = plan
        self.report = report
        # Set when a joint-graph pre-pass already tagged the graph for the first plan.
        self.pre_tagged = False

    def tag_first(self, joint: torch.fx.Graph) -> None:
        """The joint-graph tags of the first plan tried."""
        if self.plan.streamer is not None:
            tag_fetch_views(joint)
        if self.plan.recompute == "blocks":
            tag_block_recompute(joint)
        self.pre_tagged = True

    def __call__(self, partitioner, joint: torch.fx.GraphModule, joint_inputs, **kwargs):
        plan = self.plan
        num_fwd_outputs = kwargs["num_fwd_outputs"]
        candidates = ("none", "blocks") if plan.recompute == "auto" else (plan.recompute,)
        tried: list[MemoryPrediction] = []
        for attempt, recompute in enumerate(candidates):
            if plan.streamer is not None and not (self.pre_tagged and attempt == 0):
                tag_fetch_views(joint.graph)
            if recompute == "blocks" and not (self.pre_tagged and attempt == 0):
                tagged = tag_block_recompute(joint.graph)
                log.debug("recomputing %d forward nodes of the blocks in the backward", tagged)
            fw, bw = partitioner(joint, joint_inputs, **kwargs)
            offloaded = self._after_partition(fw, bw, num_fwd_outputs)
            prediction = predict_memory(
                fw, bw, live_blocks=plan.live_blocks if plan.streamer is not None else 1,
                weights_tier=plan.weights_tier, streamed_bytes=plan.streamed_bytes,
                activations_tier=plan.activations_tier, offloaded_bytes=offloaded.bytes,
                recompute=recompute, load_granularity=_load_granularity(),
            )
            tried.append(prediction)
            if plan.memory_budget is None or prediction.peak_bytes["device"] <= plan.memory_budget:
                self.report.memory = prediction
                self.report.offloaded_activations = offloaded
                log.info("speedloader: %s", prediction)
                return fw, bw
            log.info(
                "speedloader: recompute=%s needs %d bytes on the device, over the budget of %d",
                recompute, prediction.peak_bytes["device"], plan.memory_budget,
            )
        smallest = min(tried, key=lambda p: p.peak_bytes["device"])
        raise BudgetError(plan.memory_budget, smallest.peak_bytes["device"], tuple(tried))

    def _after_partition(self, fw, bw, num_fwd_outputs) -> OffloadedActivations:
        plan = self.plan
        # Sample-major, one matmul over all sub-batches would keep every sub-batch's
        # output gradients alive until the last one reaches the block: gradient
        # accumulation adds each sub-batch's gradient as soon as it is done.
        fuses = plan.num_subbatches > 1 and not plan.sample_major
        if fuses and "fuse_weight_grads" not in disabled_passes():
            _, fused = fuse_weight_grads(bw)
            self.report.fused_weight_grads = fused
        _order(fw, "fwd", plan)
        _order(bw, "bwd", plan)
        if plan.stash is None or "offload_activations" in disabled_passes():
            return OffloadedActivations()
        return offload_saved(fw, bw, num_fwd_outputs, plan.stash.graph_key, plan.min_offload_bytes)


def _aot_eager(gm, example_inputs, prepare, partition_hook):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import default_partition

    def partition(joint, joint_inputs, **kwargs):
        if partition_hook is None:
            return default_partition(joint, joint_inputs, **kwargs)
        return partition_hook(default_partition, joint, joint_inputs, **kwargs)

    def observed(kind: str):
        def compiler(graph: torch.fx.GraphModule, inputs):
            prepare(kind, graph)
            return boxed_nop(graph, inputs)

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
        # Inductor copies its config for cache keys; the plan (a streamer with its
        # locks) is shared, and the key comes from `uuid`.
        return self

    def __call__(self, gm, joint_inputs, **kwargs):
        from torch._functorch.partitioners import min_cut_rematerialization_partition

        return self.hook(min_cut_rematerialization_partition, gm, joint_inputs, **kwargs)

    def uuid(self):
        # The plan is part of the graph (fetch and stash keys), the code is in these files.
        return get_hash_for_files(
            (__file__, stream_weights_module.__file__, offload_activations_module.__file__)
        ) + repr(dataclasses.astuple(_plan_key(self.hook.plan))).encode()


def _plan_key(plan: StepPlan):
    return dataclasses.replace(plan, streamer=None, stash=None)


def _inductor(gm, example_inputs, prepare, partition_hook):
    from torch._inductor import config as inductor_config
    from torch._inductor.compile_fx import compile_fx, compile_fx_inner

    def inner(graph: torch.fx.GraphModule, inputs, **kwargs):
        if kwargs.get("is_backward"):
            kind = "backward"
        elif kwargs.get("is_inference"):
            kind = "inference"
        else:
            kind = "forward"
        prepare(kind, graph)
        with inductor_config.patch(INDUCTOR_PATCHES):
            return compile_fx_inner(graph, inputs, **kwargs)

    patches = dict(INDUCTOR_PATCHES)
    if partition_hook is not None:
        patches["custom_partitioner_fn"] = _InductorPartition(partition_hook)
        patches["joint_custom_pre_pass"] = _TagJoint(partition_hook)
    with inductor_config.patch(patches):
        return compile_fx(gm, example_inputs, inner_compile=inner)
