"""Put the partitioned forward and backward graphs back into the schedule's order.

Runs on each AOTAutograd graph just before the lowering compiles it (so the compile
caches key on the reordered graph). AOTAutograd's partitioner places some values saved
for the backward (LayerNorm's `rstd`, say) at the end of the forward, in the order the
backward consumes them; that keeps every block's activations alive until the forward
ends. This pass is a stable topological sort by the rank of each node's
(region, block, sub-batch) among the schedule's compute steps of the graph's phase
(`Schedule.order(phase)`), and it never breaks a dependency. Untagged nodes (gradient
sums across sub-batches) take the rank of their latest input, so a block's weight
gradients are summed as soon as its last sub-batch is done; every node then inherits
the rank of its most urgent user, so what an early step waits for is not stuck behind
work of a later step. Seeded random ops keep their relative order, so random draws
are unchanged.

Work a region (the prefix, a block, the suffix) shares among its sub-batches ranks by
the region's place in the schedule:
- when the region's sub-batches run one after the other (speedloader's layer-major
  order), shared work (a block's weight fetches, say) runs before the first of them,
  or after its latest input when it reads theirs, and combining work after the last;
- when they run apart (grad_accumulation: each sub-batch through every block before
  the next), shared work runs with the first sub-batch to reach the region, or after
  its latest input: ranked before its inputs, it would pull a whole sub-batch's pass
  ahead of the one before it. A sub-batch's own weight fetches open its run of the
  block; a fetch per run of sub-batches (`Schedule.fetch_groups`) opens the run of the
  first of them in the phase's order.
The graphs AOTAutograd hands over already run the blocks in the schedule's order
(TinyGPT, GPT-2, Llama at K=2 and 4), but not always the rest: sample-major on Llama,
sub-batch 1's embedding comes before sub-batch 0's blocks (`interleave` keeps it
ahead of the rotary embedding's autocast switch) and its backward comes last; this
pass moves both next to their sub-batch's blocks.
"""

from __future__ import annotations

import graphlib
import logging

import torch
import torch.fx

from slcompile.analysis.order import priority_order
from slcompile.meta import get_slc_meta
from slcompile.schedules.base import Schedule
from slcompile.vocabulary import is_fetch

__all__ = ["order_layer_major"]

log = logging.getLogger(__name__)


def order_layer_major(
    gm: torch.fx.GraphModule, phase: str, schedule: Schedule
) -> tuple[torch.fx.GraphModule, int]:
    """Reorders `gm`'s nodes in place into the schedule's order for `phase`.

    Args:
        gm: an AOTAutograd forward, backward or inference graph with slc tags.
        phase: "fwd" or "bwd".
        schedule: the schedule whose compute steps give the order.

    Returns:
        (gm, number of nodes that moved).
    """
    order = schedule.order(phase)
    nodes = list(gm.graph.nodes)
    rank: dict[torch.fx.Node, tuple[int, ...]] = {}
    # The sub-batches that read each fetch named by a sub-batch (a run's fetch serves
    # several, and in the backward they may run in another order than forward).
    readers: dict[tuple[int, int], list[int]] = {}
    for (block, subbatch), group in schedule.fetch_groups().items():
        if group is not None:
            readers.setdefault((block, group), []).append(subbatch)

    def tag_rank(node):
        meta = get_slc_meta(node)
        if meta is None:
            return None
        block = meta.block if meta.region == "block" else None
        first = order.first(meta.region, block)
        if first is None:
            return None  # a region the schedule does not run in this phase
        if meta.subbatch is not None:
            if is_fetch(node):
                # A sub-batch's own weight fetches open its run of the region; a run's,
                # the first of its sub-batches to run in this phase.
                steps = [order.step(meta.region, block, sb) for sb in readers.get((block, meta.subbatch),
                                                                                   [meta.subbatch])]
                steps = [step for step in steps if step is not None]
                return (min(steps) if steps else first, 0)
            position = order.step(meta.region, block, meta.subbatch)
            return (first if position is None else position, 1)
        if order.contiguous(meta.region, block):
            if meta.role == "combine":
                return order.last(meta.region, block), 2  # after the last sub-batch
            # Before the first sub-batch, unless it reads what several of them compute
            # (the position embedding's gradient, summed over the sub-batches): then
            # after those, without pulling their work ahead of the sub-batch before
            # them, which would split the region into two passes over its sub-batches.
            if order.last(meta.region, block) == first:
                return first, -1
            return max([(first, -1), *(rank[i] for i in node.all_input_nodes)])
        # A fetch shared by sub-batches that run apart opens the first run of the
        # region, as a sub-batch's own fetch opens its run: ranked with the first
        # sub-batch's compute, each weight would arrive at its first use inside it,
        # between that sub-batch's stash steps, and not where the schedule waits.
        if is_fetch(node):
            return first, 0
        # Shared by sub-batches that run apart: with the first to reach the region, or
        # after the latest input (the loss summed over sub-batches, whose "combine"
        # role AOTAutograd's graphs do not carry).
        return max([(first, 1), *(rank[i] for i in node.all_input_nodes)])

    for node in nodes:
        if node.op == "placeholder":
            rank[node] = (-1, -1)
        elif node.op == "output":
            rank[node] = (len(order.position) + 1, 0)
        else:
            own = tag_rank(node)
            if own is None:
                own = max((rank[i] for i in node.all_input_nodes), default=(-1, -1))
            rank[node] = own

    # A node is as urgent as its most urgent user: whatever an early block waits for
    # runs early, recomputation for a late block waits for that block.
    for node in reversed(nodes):
        for user in node.users:
            if rank[user] < rank[node]:
                rank[node] = rank[user]

    deps = {node: set(node.all_input_nodes) for node in nodes}
    previous_random = None
    for node in nodes:
        target = node.target
        if node.op == "call_function" and torch.Tag.nondeterministic_seeded in getattr(target, "tags", ()):
            if previous_random is not None:
                deps[node].add(previous_random)
            previous_random = node
        if node.op == "output":
            deps[node].update(n for n in nodes if n is not node and not n.users and n.op != "placeholder")

    try:
        order = priority_order(nodes, deps, key=rank.__getitem__)  # ties: the graph's order
    except graphlib.CycleError:
        raise RuntimeError("order_layer_major: dependency cycle") from None
    moved = sum(1 for a, b in zip(order, nodes) if a is not b)
    if moved:
        anchor = order[0]
        for node in order[1:]:
            anchor.append(node)
            anchor = node
        gm.graph.lint()
        gm.recompile()
    return gm, moved
