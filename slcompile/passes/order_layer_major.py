"""Restore layer-major order in the partitioned forward and backward graphs.

Runs on each AOTAutograd graph just before the lowering compiles it (so the compile
caches key on the reordered graph). AOTAutograd's partitioner places some values saved
for the backward (LayerNorm's `rstd`, say) at the end of the forward, in the order the
backward consumes them; that keeps every block's activations alive until the forward
ends. This pass is a stable topological sort by (block, sub-batch) rank that never
breaks a dependency. Untagged nodes (gradient sums across sub-batches) take the rank
of their latest input, so a block's weight gradients are summed as soon as its last
sub-batch is done; every node then inherits the rank of its most urgent user, so what
an early step waits for is not stuck behind work of a later block. Seeded
random ops keep their relative order, so random draws are unchanged.

With `sample_major=True` (the grad_accumulation schedule) the rank is (sub-batch,
block) instead: the forward runs sub-batch 0 through every block, then sub-batch 1;
the backward runs sub-batch K-1 through every block in reverse, then K-2, and each
weight gradient is added up as each sub-batch finishes its block. Work shared by the
sub-batches ranks with the first sub-batch of the phase, or after its latest input;
a sub-batch's weight fetches open its run of each block.
The graphs AOTAutograd hands over already run the blocks sample-major (TinyGPT, GPT-2,
Llama at K=2 and 4), but not always the rest: on Llama, sub-batch 1's embedding comes
before sub-batch 0's blocks (`interleave` keeps it ahead of the rotary embedding's
autocast switch) and its backward comes last; this pass moves both next to their
sub-batch's blocks.
"""

from __future__ import annotations

import heapq
import logging

import torch
import torch.fx

from slcompile.meta import get_slc_meta

__all__ = ["order_layer_major"]

log = logging.getLogger(__name__)


def order_layer_major(
    gm: torch.fx.GraphModule,
    phase: str,
    block_positions: dict[int, int],
    num_subbatches: int,
    *,
    sample_major: bool = False,
) -> tuple[torch.fx.GraphModule, int]:
    """Reorders `gm`'s nodes in place into layer-major (or sample-major) order.

    Args:
        gm: an AOTAutograd forward, backward or inference graph with slc tags.
        phase: "fwd" or "bwd".
        block_positions: block index -> position in forward execution order.
        num_subbatches: K.
        sample_major: rank by (sub-batch, block) instead of (block, sub-batch).

    Returns:
        (gm, number of nodes that moved).
    """
    from slcompile.runtime import weights as _weights  # noqa: F401  registers slc::fetch_weight

    fetch_op = torch.ops.slc.fetch_weight.default
    nodes = list(gm.graph.nodes)
    regions = len(block_positions) + 2
    rank: dict[torch.fx.Node, tuple[int, ...]] = {}

    def region_of(meta):
        region = {"prefix": 0, "suffix": regions - 1}.get(meta.region)
        if region is None:
            region = 1 + block_positions.get(meta.block, 0)
        return regions - 1 - region if phase == "bwd" else region

    def tag_rank(node):
        meta = get_slc_meta(node)
        if meta is None:
            return None
        if sample_major:
            return sample_major_rank(node, meta)
        region = region_of(meta)
        if meta.subbatch is not None:
            sub = meta.subbatch if phase == "fwd" else num_subbatches - 1 - meta.subbatch
        elif meta.role == "combine":
            sub = num_subbatches  # joins the sub-batches: after the last of them
        else:
            sub = -1  # shared by the sub-batches: before the first
        return region, sub

    def sample_major_rank(node, meta):
        region = region_of(meta)
        if meta.subbatch is None:
            # Shared by the sub-batches: with the first to reach the region, or after
            # the latest input (the loss summed over sub-batches, whose "combine"
            # role AOTAutograd's graphs do not carry); ranked before its inputs, it
            # would pull a whole sub-batch's pass ahead of the one before it.
            return max([(0, region, 1), *(rank[i] for i in node.all_input_nodes)])
        sub = meta.subbatch if phase == "fwd" else num_subbatches - 1 - meta.subbatch
        # A sub-batch's weight fetches open its run of the block, as a block's
        # shared fetches open the block in layer-major order.
        return sub, region, 0 if node.target is fetch_op else 1

    for node in nodes:
        if node.op == "placeholder":
            rank[node] = (-1, -1)
        elif node.op == "output":
            rank[node] = (regions + num_subbatches + 1, 0)
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

    index = {node: i for i, node in enumerate(nodes)}
    users: dict[torch.fx.Node, list] = {node: [] for node in nodes}
    for node, ds in deps.items():
        for d in ds:
            users[d].append(node)
    waiting = {node: len(ds) for node, ds in deps.items()}
    ready = [(rank[n], index[n], n.name) for n in nodes if waiting[n] == 0]
    heapq.heapify(ready)
    by_name = {n.name: n for n in nodes}
    order = []
    while ready:
        _, _, name = heapq.heappop(ready)
        node = by_name[name]
        order.append(node)
        for user in users[node]:
            waiting[user] -= 1
            if waiting[user] == 0:
                heapq.heappush(ready, (rank[user], index[user], user.name))
    if len(order) != len(nodes):
        raise RuntimeError("order_layer_major: dependency cycle")
    moved = sum(1 for a, b in zip(order, nodes) if a is not b)
    if moved:
        anchor = order[0]
        for node in order[1:]:
            anchor.append(node)
            anchor = node
        gm.graph.lint()
        gm.recompile()
    return gm, moved
