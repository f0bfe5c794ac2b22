"""What `propagate_batch` decides, as plain data: how each node runs over the
sub-batches (`NodeSplit`) and the graph's answer (`BatchPlan`), which
`check_splittable`, `plan_schedule` and `interleave` read."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

__all__ = ["NodeSplit", "BatchPlan", "BATCHED_INT"]

# Leaf marker in `NodeSplit.out_bdims` for an integer that scales with the batch
# (a dynamic batch size, or a size computed from it).
BATCHED_INT = "batched-int"


@dataclasses.dataclass(frozen=True)
class NodeSplit:
    """How one node is computed under sub-batching.

    Attributes:
        kind: "shared", "batched" or "combine" (a cross-sample op after the blocks,
            computed from all sub-batches).
        out_bdims: for batched nodes, a pytree shaped like the output with, per leaf,
            the batch dimension (int), None (batch-free; for a tensor, each
            sub-batch's own, such as its tokens counted per expert) or BATCHED_INT.
        args: per-sub-batch positional args (original nodes, literal batch sizes
            rewritten); for other kinds the original args.
        kwargs: as args.
        narrow: (input node name, dim) for shared inputs that a batched node consumes
            along the batch: each sub-batch reads its own slice.
        combine: for kind "combine": "sum", "mean", "cross_entropy" or "concat".
        reason: why the node mixes samples (kind "combine" or a problem).
        from_subbatch: a shared node that reads a batched input for its dtype and
            device only (`x.new_zeros(...)`): computed once from sub-batch 0.
        rebase: (input node name, dim) for shared sample indices (`arange` over the
            batch, see `sample_index.track_sample_index`) that a batched node reads
            as the index of its samples: each sub-batch reads its own slice less the
            index of its first sample, so that it indexes its own rows.
    """

    kind: str
    out_bdims: Any = None
    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    narrow: tuple[tuple[str, int], ...] = ()
    combine: str | None = None
    reason: str | None = None
    from_subbatch: bool = False
    rebase: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The result of `propagate_batch`.

    Attributes:
        num_subbatches: K.
        batch_size: the full batch size of the example inputs.
        nodes: node name -> NodeSplit, for every node but the output.
        problems: (node name, reason, kind) for what sub-batching would change; kind
            is "mixes-samples" (a cross-sample op before the suffix) or "mutation"
            (an in-place write that would repeat per sub-batch).
        output_bdims: per output leaf, its batch dimension or None.
        whole_suffix: the suffix runs once on the whole batch (`run_suffix_whole`):
            its nodes are shared, or concatenate the sub-batches they read.
    """

    num_subbatches: int
    batch_size: int
    nodes: Mapping[str, NodeSplit]
    problems: tuple[tuple[str, str, str], ...]
    output_bdims: tuple
    whole_suffix: bool = False
