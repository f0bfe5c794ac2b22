"""Find the repeated blocks of a Dynamo graph and split it into prefix, blocks, suffix.

First pass of the pipeline; needs only the Dynamo FX graph, whose nodes carry
`nn_module_stack` (`"L['self'].model.layers.3.mlp"`). A block is one child of a module
list (`layers.N`, `h.N`, `blocks.N`, `layer.N`, ...): the container with the most
numbered children that own graph nodes wins. Nodes before the first block are the
prefix, nodes after the last are the suffix, and a node with no module of its own
between two block nodes belongs to the block that is running. Blocks are grouped by
structural identity (same ops, same parameter shapes, same wiring): "repeated" means
structurally identical, not the same name pattern (T5's block 0 differs from the rest).
"""

from __future__ import annotations

import dataclasses
import hashlib
import logging
import re
from collections import Counter, defaultdict

import torch
import torch.fx

from slcompile.analysis.inputs import GraphInput
from slcompile.errors import RefusedError

__all__ = ["Block", "BlockGraph", "find_blocks"]

log = logging.getLogger(__name__)

_INDEXED = re.compile(r"^(.*?)(?:\.(\d+)|\[(\d+)\])$")
_DYNAMO_SELF = "L['self']"


@dataclasses.dataclass(frozen=True)
class Block:
    """One block.

    Attributes:
        index: its position in the container (`layers.3` -> 3).
        path: the module path, as the user names it (`model.layers.3`).
        nodes: names of its call nodes, in graph order.
        params: names of the parameter placeholders it reads.
        group: index of its structural-identity group.
    """

    index: int
    path: str
    nodes: tuple[str, ...]
    params: tuple[str, ...]
    group: int


@dataclasses.dataclass(frozen=True)
class BlockGraph:
    """The result of `find_blocks`.

    Attributes:
        container: the module list holding the blocks (`model.layers`).
        blocks: the blocks in execution order.
        regions: node name -> "prefix", "block" or "suffix", for every non-placeholder.
        block_of: node name -> block position in `blocks`, for block nodes.
        groups: block positions grouped by structural identity.
    """

    container: str
    blocks: tuple[Block, ...]
    regions: dict[str, str]
    block_of: dict[str, int]
    groups: tuple[tuple[int, ...], ...]


def find_blocks(gm: torch.fx.GraphModule, inputs: list[GraphInput]) -> BlockGraph:
    """Finds the blocks of `gm`.

    Raises:
        RefusedError: no repeated blocks, or blocks whose nodes interleave.
    """
    params = {i.name for i in inputs if i.kind in ("param", "buffer")}
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]

    # Which container's numbered children own the most call nodes.
    owners: dict[str, Counter] = defaultdict(Counter)
    for node in calls:
        for container, index in _indexed_paths(node):
            owners[container][index] += 1
    if not owners:
        raise RefusedError("no repeated blocks: no module list (layers.N, h.N, ...) owns graph nodes", "find_blocks")
    container = max(owners, key=lambda c: (sum(owners[c].values()), len(owners[c]), -len(c)))

    index_of: dict[str, int] = {}
    for node in calls:
        for cont, index in _indexed_paths(node):
            if cont == container:
                index_of[node.name] = index
                break

    # Prefix before the first block node, suffix after the last, gaps to the running block.
    positions = [i for i, n in enumerate(calls) if n.name in index_of]
    first, last = positions[0], positions[-1]
    regions: dict[str, str] = {}
    order: list[int] = []  # block indices in execution order
    node_block: dict[str, int] = {}
    current = None
    for i, node in enumerate(calls):
        if i < first:
            regions[node.name] = "prefix"
        elif i > last:
            regions[node.name] = "suffix"
        else:
            regions[node.name] = "block"
            if node.name in index_of:
                current = index_of[node.name]
                if not order or order[-1] != current:
                    if current in order:
                        raise RefusedError(
                            f"block {container}.{current} runs again after another block started "
                            f"(node {node.name}); blocks must run one after another",
                            "find_blocks",
                        )
                    order.append(current)
            node_block[node.name] = current

    position = {index: pos for pos, index in enumerate(order)}
    block_of = {name: position[index] for name, index in node_block.items()}
    members: dict[int, list[str]] = defaultdict(list)
    for name, pos in block_of.items():
        members[pos].append(name)

    by_name = {n.name: n for n in gm.graph.nodes}
    signatures = []
    block_params = []
    for pos in range(len(order)):
        nodes = [by_name[name] for name in members[pos]]
        used = []
        for n in nodes:
            for arg in n.all_input_nodes:
                if arg.name in params and arg.name not in used:
                    used.append(arg.name)
        block_params.append(tuple(used))
        signatures.append(_signature(nodes, params))
    group_ids: dict[str, int] = {}
    groups: dict[int, list[int]] = defaultdict(list)
    blocks = []
    pretty = container.replace(_DYNAMO_SELF + ".", "").replace(_DYNAMO_SELF, "")
    for pos, index in enumerate(order):
        group = group_ids.setdefault(signatures[pos], len(group_ids))
        groups[group].append(pos)
        blocks.append(
            Block(
                index=index,
                path=f"{pretty}.{index}" if pretty else str(index),
                nodes=tuple(members[pos]),
                params=block_params[pos],
                group=group,
            )
        )
    log.debug("found %d blocks in %s (%d groups)", len(blocks), pretty, len(groups))
    return BlockGraph(
        container=pretty,
        blocks=tuple(blocks),
        regions=regions,
        block_of=block_of,
        groups=tuple(tuple(g) for g in groups.values()),
    )


def _indexed_paths(node: torch.fx.Node):
    """(container, index) for every numbered module the node runs inside."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, _type in stack.values():
        match = _INDEXED.match(path)
        if match:
            yield match.group(1), int(match.group(2) or match.group(3))


def _signature(nodes: list[torch.fx.Node], params: set[str]) -> str:
    """A hash of the block's ops and wiring that ignores names and the block index."""
    local = {n.name: i for i, n in enumerate(nodes)}
    external: dict[str, int] = {}

    def ref(arg):
        if isinstance(arg, torch.fx.Node):
            if arg.name in local:
                return f"%{local[arg.name]}"
            if arg.name in params:
                value = arg.meta.get("example_value")
                shape = tuple(value.shape) if isinstance(value, torch.Tensor) else ()
                dtype = getattr(value, "dtype", None)
                return f"param{shape}{dtype}"
            return f"in{external.setdefault(arg.name, len(external))}"
        return repr(arg)

    parts = []
    for n in nodes:
        args = torch.fx.node.map_aggregate(n.args, ref)
        kwargs = torch.fx.node.map_aggregate(n.kwargs, ref)
        target = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", str(n.target))
        parts.append(f"{n.op}:{target}:{args}:{sorted(kwargs.items())}")
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]
