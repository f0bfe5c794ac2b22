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

import logging
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from torch._inductor.custom_graph_pass import CustomGraphPass, get_hash_for_files

from slcompile.passes.mark_regions import mark_regions
from slcompile.passes.fuse_weight_grads import fuse_weight_grads
from slcompile.pipeline import disabled_passes
from slcompile.passes.order_layer_major import order_layer_major
from slcompile.passes.stream_weights import __file__ as stream_weights_file
from slcompile.passes.stream_weights import plan_fetches, tag_fetch_views
from slcompile.report import CompileReport

__all__ = ["lower", "INDUCTOR_PATCHES"]

log = logging.getLogger(__name__)

# reorder_for_locality would also sink compute below transfer waits.
INDUCTOR_PATCHES = {"reorder_for_peak_memory": False, "reorder_for_locality": False}


def lower(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    lowering: str,
    report: CompileReport,
    block_positions: dict[int, int] | None = None,
    num_subbatches: int = 1,
    streamer=None,
) -> Callable:
    """Compiles `gm` with the chosen lowering; records the AOT graphs in `report`.

    With `block_positions` (a rewritten graph), each AOT graph is put back into
    layer-major order (`order_layer_major`) before it is compiled; in the backward,
    each weight's per-sub-batch gradients are first summed in one matmul
    (`fuse_weight_grads`) where that moves fewer bytes. With a weight
    `streamer`, the joint graph's fetched-weight views are tagged for recomputation
    before partitioning (`tag_fetch_views`), and each compiled graph's fetch order
    becomes the streamer's prefetch plan (`plan_fetches`).
    """
    streams_weights = streamer is not None

    def prepare(kind: str, graph: torch.fx.GraphModule) -> None:
        if kind == "backward" and num_subbatches > 1 and "fuse_weight_grads" not in disabled_passes():
            _, fused = fuse_weight_grads(graph)
            report.fused_weight_grads = fused
        if block_positions is not None and "order_layer_major" not in disabled_passes():
            phase = "bwd" if kind == "backward" else "fwd"
            _, moved = order_layer_major(graph, phase, block_positions, num_subbatches)
            log.debug("order_layer_major moved %d nodes of the %s graph", moved, kind)
        if streams_weights:
            phase = "bwd" if kind == "backward" else "fwd"
            streamer.set_plan(phase, plan_fetches(graph.graph, phase))
            graph.recompile()
        if lowering == "aot_eager" and "mark_regions" not in disabled_passes():  # Inductor: see mark_regions
            mark_regions(graph, kind)
        report.record_graph(kind, graph)

    if lowering == "aot_eager":
        return _aot_eager(gm, example_inputs, prepare, streams_weights)
    if lowering == "inductor":
        return _inductor(gm, example_inputs, prepare, streams_weights)
    raise ValueError(f"unknown lowering {lowering!r}")



def _aot_eager(gm, example_inputs, prepare, streams_weights):
    from torch._dynamo.backends.common import aot_autograd
    from torch._dynamo.backends.debugging import boxed_nop
    from torch._functorch.partitioners import default_partition

    def partition(joint, joint_inputs, **kwargs):
        if streams_weights:
            tag_fetch_views(joint.graph)
        return default_partition(joint, joint_inputs, **kwargs)

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


class _TagFetchViews(CustomGraphPass):
    """Inductor joint-graph pre-pass: `tag_fetch_views`, with a cache key."""

    def __call__(self, graph: torch.fx.Graph) -> None:
        tag_fetch_views(graph)

    def uuid(self):
        return get_hash_for_files((stream_weights_file,))


def _inductor(gm, example_inputs, prepare, streams_weights):
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
    if streams_weights:
        patches["joint_custom_pre_pass"] = _TagFetchViews()
    with inductor_config.patch(patches):
        return compile_fx(gm, example_inputs, inner_compile=inner)
