"""Refuse, with a reason a user understands, what sub-batching would change.

Runs after `propagate_batch`; reads its problems and never changes the graph. The
problems it reports: BatchNorm in training and any other op that mixes samples before
or inside a block (reductions over the batch, ops along the batch dimension, indexing
the batch), in-place writes to inputs, buffers or parameters, and per-sample values
written into a value shared by all sub-batches. Cross-sample ops after the last block
(the loss) are not problems: `interleave` computes them from all sub-batches.
"""

from __future__ import annotations

from slcompile.analysis.batch_propagation import BatchPlan
from slcompile.errors import RefusedError

__all__ = ["check_splittable"]


def check_splittable(plan: BatchPlan) -> BatchPlan:
    """Returns the plan unchanged when it can run; raises RefusedError otherwise."""
    if plan.problems:
        name, reason = plan.problems[0]
        more = len(plan.problems) - 1
        suffix = f" (and {more} more problem{'s' if more > 1 else ''})" if more else ""
        raise RefusedError(f"cannot split the batch: {reason}{suffix}", "check_splittable")
    return plan
