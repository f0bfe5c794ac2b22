"""Fetch each block's weights from their tier once per pass, shared by all sub-batches.

Runs after `interleave`, when the `weights` option names a tier that copies (nvme; on
a GPU machine also host). For every parameter that only one block reads, it inserts
`slc::fetch_weight(param, key)` before the block's first sub-batch and makes all K
sub-batches read the fetched tensor, so the block's weights are loaded once per
forward. The fetch is tagged for recomputation (`meta["recompute"]`, which AOTAutograd
carries to the joint graph), so the backward fetches again instead of keeping the
forward's copy alive: weight traffic per training step is 2·P whatever K is.
Parameters read by the prefix, the suffix or several blocks (tied embeddings) stay
resident. `tag_fetch_views` finishes the job on the joint graph: views of a fetched
weight (`t` for a matmul) are recomputed with it, else the partitioner would save the
view and with it the whole weight.

With `per_subbatch=True` (the grad_accumulation schedule, whose graph is
sample-major) each sub-batch gets its own fetch of the block's weights, inserted
before that sub-batch's first use and read by it alone, tagged with the sub-batch:
K fetches per block per pass, as gradient accumulation loads them. Ops of the block
shared by all sub-batches run with sub-batch 0 and read its fetch. The fetches' graph
keys differ by sub-batch (`...#sb1`): with equal keys, Inductor's
common-subexpression elimination merges the K fetches of a weight into one.
"""

from __future__ import annotations

import dataclasses
import logging
from collections import defaultdict

import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from slcompile.analysis.inputs import GraphInput
from slcompile.meta import SlcMeta, get_slc_meta, set_slc_meta
from slcompile.passes.find_blocks import BlockGraph

__all__ = ["StreamedWeights", "stream_weights", "tag_fetch_views", "plan_fetches"]

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class StreamedWeights:
    """The result of `stream_weights`.

    Attributes:
        blocks: per block (forward order), the (placeholder name, stored key) of its
            streamed weights.
        resident: parameter placeholders that stay on the device, with the reason.
        streamed_bytes: bytes of all streamed weights (P).
    """

    blocks: tuple[tuple[tuple[str, str], ...], ...]
    resident: tuple[tuple[str, str], ...]
    streamed_bytes: int


def stream_weights(
    gm: torch.fx.GraphModule,
    blocks: BlockGraph,
    inputs: tuple[GraphInput, ...],
    key_for,
    graph_key_for,
    *,
    per_subbatch: bool = False,
) -> tuple[torch.fx.GraphModule, StreamedWeights]:
    """Inserts the fetches into the interleaved graph `gm` (changed in place).

    Args:
        gm: the interleaved graph.
        blocks: the block graph.
        inputs: the classified placeholders (parameters carry their real values).
        key_for: `key_for(placeholder name, parameter) -> stored key`.
        graph_key_for: `graph_key_for(stored key) -> the key the fetch op carries`.
        per_subbatch: one fetch per (block, sub-batch) instead of one per block.

    Returns:
        (gm, what was streamed).
    """
    from slcompile.runtime.weights import copy_suffix  # also registers slc::fetch_weight

    fetch_op = torch.ops.slc.fetch_weight.default
    params = {i.name: i for i in inputs if i.kind == "param"}
    position = {block.index: pos for pos, block in enumerate(blocks.blocks)}
    per_block: dict[int, list[tuple[str, str]]] = defaultdict(list)
    resident = []
    streamed_bytes = 0
    order_of = _order_of(gm)
    for node in list(gm.graph.nodes):
        if node.op != "placeholder" or node.name not in params:
            continue
        readers = {_block_of(user) for user in node.users}
        if len(readers) != 1 or None in readers:
            where = "several blocks" if len(readers) > 1 else "the prefix or suffix"
            resident.append((node.name, f"read by {where}"))
            continue
        block = readers.pop()
        key = key_for(node.name, params[node.name].value)
        value = params[node.name].value
        for subbatch, users in _user_groups(node, per_subbatch, order_of):
            graph_key = graph_key_for(key) if subbatch is None else graph_key_for(key) + copy_suffix(subbatch)
            with gm.graph.inserting_before(users[0]):
                fetch = gm.graph.call_function(fetch_op, (node, graph_key))
            for user in users:
                user.replace_input_with(node, fetch)
            set_slc_meta(fetch, SlcMeta(region="block", block=block, subbatch=subbatch, role="load"))
            fetch.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            fetch.meta["val"] = torch.empty_like(value, device="meta")
        per_block[position[block]].append((node.name, key))
        streamed_bytes += value.numel() * value.element_size()
    gm.graph.lint()
    gm.recompile()
    result = StreamedWeights(
        blocks=tuple(tuple(per_block[pos]) for pos in range(len(blocks.blocks))),
        resident=tuple(resident),
        streamed_bytes=streamed_bytes,
    )
    log.debug("streaming %d bytes of block weights; %d parameters stay resident", streamed_bytes, len(resident))
    return gm, result


def _user_groups(param: torch.fx.Node, per_subbatch: bool, order_of) -> list[tuple[int | None, list]]:
    """(sub-batch or None, the users that read one fetch, first user first)."""
    users = sorted(param.users, key=order_of)
    if not per_subbatch:
        return [(None, users)]
    groups: dict[int, list] = defaultdict(list)
    for user in users:
        meta = get_slc_meta(user)
        groups[meta.subbatch if meta.subbatch is not None else 0].append(user)
    return sorted(groups.items(), key=lambda group: order_of(group[1][0]))


def _block_of(node: torch.fx.Node) -> int | None:
    meta = get_slc_meta(node)
    return meta.block if meta is not None and meta.region == "block" else None


def _order_of(gm: torch.fx.GraphModule):
    index = {node: i for i, node in enumerate(gm.graph.nodes)}
    return index.__getitem__


def tag_fetch_views(graph: torch.fx.Graph) -> int:
    """On a joint graph: views of fetched weights are recomputed with the fetch.

    Returns:
        the number of nodes tagged.
    """
    from slcompile.runtime import weights as _weights  # noqa: F401  registers the op

    fetch_op = torch.ops.slc.fetch_weight.default
    tagged = 0
    frontier = [n for n in graph.nodes if n.op == "call_function" and n.target is fetch_op]
    for node in frontier:
        node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    while frontier:
        node = frontier.pop()
        for user in node.users:
            if user.op == "call_function" and getattr(user.target, "is_view", False):
                if user.meta.get("recompute") != CheckpointPolicy.MUST_RECOMPUTE:
                    user.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
                    tagged += 1
                    frontier.append(user)
    return tagged


def plan_fetches(graph: torch.fx.Graph, phase: str) -> list[tuple[int, str]]:
    """Marks each fetch of a partitioned graph with its phase and returns the
    (block, stored key) fetches in order, for the runtime's prefetch plan.

    AOTAutograd copies the forward's fetch into the backward unchanged; the phase in
    the key tells the runtime which of the two a call is.
    """
    from slcompile.runtime.weights import split_graph_key

    fetch_op = torch.ops.slc.fetch_weight.default
    fetches = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is not fetch_op:
            continue
        _, stored, _ = split_graph_key(node.args[1])
        node.args = (node.args[0], f"{node.args[1].partition('@')[0]}@{phase}")
        meta = get_slc_meta(node)
        fetches.append((meta.block if meta is not None else -1, stored))
    return fetches
