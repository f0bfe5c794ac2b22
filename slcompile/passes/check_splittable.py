"""Refuse, with a reason a user understands, what sub-batching would change.

Runs after `propagate_batch`; reads its problems and never changes the graph. The
problems it reports: BatchNorm in training and any other op that mixes samples before
or inside a block (reductions over the batch, ops along the batch dimension, indexing
the batch), in-place writes to inputs, buffers or parameters, and per-sample values
written into a value shared by all sub-batches, and tokens routed in a way that
couples samples (a capacity per expert, counts of the whole batch used per token).
Cross-sample ops after the last block (the loss) are not problems: `interleave`
computes them from all sub-batches; neither is routing each sub-batch's tokens on its
own (sort by expert, gather, grouped matmul, inverse permutation), nor gathering each
sample's own rows by `arange(batch)` (padding masks), nor writing per sample into a
fresh tensor made at the batch size. Ops that compute from a tensor's values
(`.item()`) are refused by `propagate_batch` itself.
"""

from __future__ import annotations

from slcompile.analysis.batch_propagation import BatchPlan
from slcompile.errors import RefusedError

__all__ = ["check_splittable"]

_SHOWN = 2


def check_splittable(plan: BatchPlan) -> BatchPlan:
    """Returns the plan unchanged when it can run; raises RefusedError otherwise."""
    if not plan.problems:
        return plan
    # Ops that mix samples explain a refusal better than the writes that come with
    # them (BatchNorm also counts its batches in place).
    ranked = sorted(plan.problems, key=lambda p: p[2] != "mixes-samples")
    shown = [reason for _, reason, _ in ranked[:_SHOWN]]
    more = len(ranked) - len(shown)
    tail = f" (and {more} more)" if more else ""
    raise RefusedError("cannot split the batch: " + "; ".join(shown) + tail, "check_splittable")
