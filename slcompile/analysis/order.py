"""Read the compute order (layer-major or sample-major) back from a partitioned forward
or backward graph.

Needs a graph whose nodes carry slc tags (`slcompile.meta`): the rewritten Dynamo
graph, or the AOTAutograd forward and backward graphs derived from it (AOTAutograd
copies `meta["custom"]` to the nodes it derives). Only ops that compute count
(`vocabulary.is_compute`): views (`permute` of a weight saved for the backward, say)
cost nothing and the partitioner moves them freely, and neither do size arithmetic on
SymInts, getitems, detaches and the `slc::` transfer ops.

The passes that put a graph into an order (`interleave`, `order_layer_major`) sort
its nodes with `priority_order`: a topological sort that, among the nodes ready,
takes the most urgent first.
"""

from __future__ import annotations

import dataclasses
import graphlib
from collections.abc import Callable, Hashable, Iterable, Mapping
from typing import Any, TypeVar

import torch.fx

from slcompile.meta import get_slc_meta
from slcompile.vocabulary import is_compute

__all__ = [
    "BlockOrder",
    "block_order",
    "step_order",
    "runs_suffix_whole",
    "unit_key",
    "layer_major_violations",
    "sample_major_violations",
    "grads_ready_before_next_block",
    "priority_order",
]

_Item = TypeVar("_Item", bound=Hashable)


@dataclasses.dataclass(frozen=True)
class BlockOrder:
    """The (block, sub-batch) of each computing block op, runs collapsed."""

    steps: tuple[tuple[int, int], ...]


def block_order(gm: torch.fx.GraphModule) -> BlockOrder:
    steps: list[tuple[int, int]] = []
    for node in gm.graph.nodes:
        if not is_compute(node):
            continue
        meta = get_slc_meta(node)
        if meta is None or meta.region != "block" or meta.subbatch is None:
            continue
        step = (meta.block, meta.subbatch)
        if not steps or steps[-1] != step:
            steps.append(step)
    return BlockOrder(tuple(steps))


def runs_suffix_whole(gm: torch.fx.GraphModule) -> bool:
    """Whether the graph runs the suffix once on the whole batch (`suffix="whole"`):
    it computes in the suffix, and no suffix op computes for one sub-batch."""
    suffix = [meta for node in gm.graph.nodes if is_compute(node)
              and (meta := get_slc_meta(node)) is not None and meta.region == "suffix"]
    return bool(suffix) and all(meta.subbatch is None for meta in suffix)


def unit_key(meta, whole_suffix: bool) -> tuple[str, int | None, int | None] | None:
    """The compute step (region, block, sub-batch) a node tagged `meta` runs in: its
    (region, block, sub-batch), ("suffix", None, None) for the suffix run whole
    (`whole_suffix`), None for work shared by the sub-batches or untagged."""
    if meta is None:
        return None
    if meta.subbatch is not None:
        return meta.region, meta.block if meta.region == "block" else None, meta.subbatch
    if whole_suffix and meta.region == "suffix":
        return "suffix", None, None
    return None


def step_order(gm: torch.fx.GraphModule, whole_suffix: bool | None = None) -> tuple[str, ...]:
    """The tags of the ops that compute for one sub-batch (prefix, blocks and suffix),
    runs collapsed: the steps a schedule's text lists for this graph's phase
    (`fwd blk3.sb1` -> `blk3.sb1`). Shared and combining ops are left out, but for a
    suffix run on the whole batch (`whole_suffix`; None: `runs_suffix_whole(gm)`),
    whose ops are one `suffix` step."""
    if whole_suffix is None:
        whole_suffix = runs_suffix_whole(gm)
    steps: list[str] = []
    for node in gm.graph.nodes:
        if not is_compute(node):
            continue
        meta = get_slc_meta(node)
        if unit_key(meta, whole_suffix) is None:
            continue
        if not steps or steps[-1] != meta.tag:
            steps.append(meta.tag)
    return tuple(steps)


def layer_major_violations(order: BlockOrder, blocks: list[int], num_subbatches: int, phase: str) -> list[str]:
    """Differences between `order` and layer-major order; empty when it is layer-major.

    Args:
        order: what the graph does.
        blocks: block indices in forward execution order.
        num_subbatches: K.
        phase: "fwd" (blocks in order, sub-batches 0..K-1) or "bwd" (blocks reversed,
            sub-batches K-1..0).
    """
    subbatches = list(range(num_subbatches))
    if phase == "bwd":
        blocks, subbatches = list(reversed(blocks)), list(reversed(subbatches))
    return _differences(order, [(b, s) for b in blocks for s in subbatches])


def sample_major_violations(order: BlockOrder, blocks: list[int], num_subbatches: int, phase: str) -> list[str]:
    """Differences between `order` and sample-major order (gradient accumulation's);
    empty when it is sample-major.

    Args:
        order: what the graph does.
        blocks: block indices in forward execution order.
        num_subbatches: K.
        phase: "fwd" (sub-batches 0..K-1, each through the blocks in order) or "bwd"
            (sub-batches K-1..0, each through the blocks reversed).
    """
    subbatches = list(range(num_subbatches))
    if phase == "bwd":
        blocks, subbatches = list(reversed(blocks)), list(reversed(subbatches))
    return _differences(order, [(b, s) for s in subbatches for b in blocks])


def _differences(order: BlockOrder, expected: list[tuple[int, int]]) -> list[str]:
    actual = list(order.steps)
    if actual == expected:
        return []
    problems = []
    for i, (want, got) in enumerate(zip(expected, actual)):
        if want != got:
            problems.append(f"step {i}: expected blk{want[0]}.sb{want[1]}, got blk{got[0]}.sb{got[1]}")
            break
    if len(actual) != len(expected):
        problems.append(f"{len(actual)} block steps, expected {len(expected)}")
    return problems


def grads_ready_before_next_block(
    backward: torch.fx.GraphModule, block_inputs: dict[int, tuple[int, ...]], blocks: list[int]
) -> list[str]:
    """Each block's weight gradients must be complete (summed over all sub-batches)
    before the backward starts on the block before it.

    Args:
        backward: the AOTAutograd backward graph; its outputs are the gradients of the
            forward inputs, in input order.
        block_inputs: block index -> positions of its parameters among the inputs.
        blocks: block indices in forward execution order.

    Returns:
        problems, empty when every block's gradients are ready in time.
    """
    nodes = list(backward.graph.nodes)
    position = {node: i for i, node in enumerate(nodes)}
    outputs = nodes[-1].args[0]
    first_compute: dict[int, int] = {}
    for i, node in enumerate(nodes):
        if not is_compute(node):
            continue
        meta = get_slc_meta(node)
        if meta is not None and meta.region == "block":
            first_compute.setdefault(meta.block, i)
    problems = []
    for later, earlier in zip(blocks[1:], blocks[:-1]):
        start = first_compute.get(earlier)
        if start is None:
            continue
        for index in block_inputs.get(later, ()):
            grad = outputs[index] if index < len(outputs) else None
            if isinstance(grad, torch.fx.Node) and position[grad] > start:
                problems.append(
                    f"gradient of input {index} (block {later}) is finished after block {earlier} starts"
                )
    return problems


def priority_order(items: Iterable[_Item], deps: Mapping[_Item, Iterable[_Item]],
                   key: Callable[[_Item], Any]) -> list[_Item]:
    """`items` in an order where each comes after every item it depends on: of the
    items whose dependencies have all come, the one of least `key` comes next, ties
    in the order of `items` (Kahn's sort with a priority queue, as networkx's
    `lexicographical_topological_sort` does it).

    Args:
        items: the items, in the order that breaks ties.
        deps: item -> the items it comes after (each one of `items`).
        key: an item's priority: the least comes first.

    Raises:
        graphlib.CycleError: (a ValueError) the dependencies make a cycle.
    """
    import networkx  # on the first sort, not with the package

    graph = networkx.DiGraph()
    graph.add_nodes_from(items)
    graph.add_edges_from((dep, item) for item, before in deps.items() for dep in before)
    try:
        return list(networkx.lexicographical_topological_sort(graph, key=key))
    except networkx.NetworkXUnfeasible as err:
        raise graphlib.CycleError("the dependencies make a cycle") from err
