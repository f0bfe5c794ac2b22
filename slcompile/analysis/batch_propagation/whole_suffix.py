"""The suffix on the whole batch: what runs after the last block computed once from
the K sub-batches concatenated back, rather than once per sub-batch.

A suffix node that reads a per-sub-batch value becomes a `combine="concat"` node
(`interleave` concatenates those inputs along their batch dimension, each once, and
adds up a batch size given as an input); a suffix node that read only such nodes'
results is shared: it runs once. `interleave` emits the suffix's ops in the graph's
order, so an in-place write keeps its place among the ops that read its tensor.

The values are the same as per sub-batch (and the loss is the whole batch's, with
no partial sums to add); the head's weight is read once and each of its kernels
runs once.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import torch.fx

from slcompile.analysis.batch_propagation.plan import BATCHED_INT, BatchPlan, NodeSplit

__all__ = ["run_suffix_whole"]

_REASON = "the suffix runs once on the whole batch (suffix='whole')"


def run_suffix_whole(gm: torch.fx.GraphModule, plan: BatchPlan, regions: Mapping[str, str]) -> tuple[BatchPlan, str | None]:
    """The plan with the suffix run once on the whole batch, or the plan unchanged
    and why it cannot be.

    A per-sub-batch value the suffix reads must come back whole: a tensor with one
    batch dimension is concatenated, a batch size given as an input is the sum of
    the sub-batches'. A size computed from the sub-batch's inside the model has no
    such inverse: then the suffix stays per sub-batch.
    """
    if plan.num_subbatches == 1:
        return plan, None
    splits = dict(plan.nodes)
    for node in gm.graph.nodes:
        if node.op in ("placeholder", "output") or regions.get(node.name) != "suffix":
            continue
        split = splits[node.name]
        if split.kind == "shared":
            continue
        batched = [n for n in node.all_input_nodes if splits[n.name].kind == "batched"]
        for n in batched:
            bdim = splits[n.name].out_bdims
            if not isinstance(bdim, int) and not (n.op == "placeholder" and bdim == BATCHED_INT):
                return plan, (f"the suffix stays per sub-batch: {node.name} reads {n.name}, a value per "
                              f"sub-batch that no concatenation gives back whole")
        if batched:
            splits[node.name] = NodeSplit("combine", args=node.args, kwargs=node.kwargs, combine="concat",
                                          reason=_REASON)
        else:
            splits[node.name] = NodeSplit("shared", args=node.args, kwargs=node.kwargs)
    return dataclasses.replace(plan, nodes=splits, whole_suffix=True), None
