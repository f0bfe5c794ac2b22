"""Find the repeated blocks of a Dynamo graph and split it into prefix, blocks, suffix.

First pass of the pipeline; needs only the Dynamo FX graph, whose nodes carry
`nn_module_stack` (`"L['self'].model.layers.3.mlp"`). A block is one child of a module
list (`layers.N`, `h.N`, `blocks.N`, `layer.N`, ...): the container with the most
numbered children that own graph nodes wins. Nodes before the first block are the
prefix, nodes after the last are the suffix, and a node with no module of its own
between two block nodes belongs to the block that is running. Blocks are grouped by
structural identity (same ops, same parameter shapes, same wiring): "repeated" means
structurally identical, not the same name pattern (T5's block 0 differs from the rest).

A container whose numbered children are each of a different class holds the parts of
one module, not repeated blocks: a graph that holds one T5 layer (`T5Block`, alone in
its graph when graph breaks split the decoder) has `layer.0`, `layer.1`, `layer.2`
(`T5LayerSelfAttention`, `T5LayerCrossAttention`, `T5LayerFF`), and running those
layer-major would claim blocks the model does not repeat. Such a container is no
stack; a graph left with no other is compiled plainly, its reason naming the parts.

A graph may hold more than one stack of blocks (an encoder's `encoder.block.N`, then
a decoder's `decoder.block.N`). Besides the container with the most block nodes, every
other container that is not inside a block of another, runs in a stretch of the graph
of its own (before or after the other stacks, never between their nodes), and has
at least two children that each read a parameter and each read what the child before
them computed (a chain of blocks; a list of heads that all read one value is no stack)
is a stack too. Blocks are then numbered in execution order across the stacks
(`Block.index`), the nodes between two stacks (the encoder's final norm, the
decoder's embedding) run with the block before them, and a later stack's blocks read
what an earlier stack computed (the encoder's output) like any other value: per
sub-batch, kept (or stashed) until its last reader. With one stack, `Block.index` is
the child's number in its container.
"""

from __future__ import annotations

import hashlib
import logging
import re
from collections import Counter, defaultdict

import torch
import torch.fx

from slcompile.analysis.blocks import Block, BlockGraph
from slcompile.analysis.inputs import GraphInput
from slcompile.errors import NoBlocksError, RefusedError
from slcompile.meta import module_path

__all__ = ["find_blocks"]

log = logging.getLogger(__name__)

_INDEXED = re.compile(r"^(.*?)(?:\.(\d+)|\[(\d+)\])$")
_CHILD = re.compile(r"\.\d+|\[\d+\]")


def find_blocks(gm: torch.fx.GraphModule, inputs: list[GraphInput]) -> BlockGraph:
    """Finds the blocks of `gm`.

    Raises:
        NoBlocksError: no repeated blocks (nothing to split).
        RefusedError: blocks whose nodes interleave.
    """
    params = {i.name for i in inputs if i.kind in ("param", "buffer")}
    calls = [n for n in gm.graph.nodes if n.op not in ("placeholder", "output")]

    # Which container's numbered children own the most call nodes.
    owners: dict[str, Counter] = defaultdict(Counter)
    kinds: dict[str, dict[int, str]] = defaultdict(dict)  # container -> index -> class name
    for node in calls:
        for container, index, kind in _indexed_modules(node):
            owners[container][index] += 1
            kinds[container].setdefault(index, kind)
    if not owners:
        raise NoBlocksError("no module list (layers.N, h.N, ...) owns graph nodes", "find_blocks")
    parts = [c for c in owners if len(kinds[c]) > 1 and len(set(kinds[c].values())) == len(kinds[c])]
    owners = {c: counts for c, counts in owners.items() if c not in parts}
    if not owners:
        raise NoBlocksError(_parts_reason(min(parts, key=len), kinds), "find_blocks")
    container = max(owners, key=lambda c: (sum(owners[c].values()), len(owners[c]), -len(c)))
    stacks = _stacks(calls, owners, container, params)

    # Node -> (container, index) of the block it runs in.
    index_of: dict[str, tuple[str, int]] = {}
    for node in calls:
        for cont, index in _indexed_paths(node):
            if cont in stacks:
                index_of[node.name] = (cont, index)
                break

    # Prefix before the first block node, suffix after the last, gaps to the running block.
    positions = [i for i, n in enumerate(calls) if n.name in index_of]
    first, last = positions[0], positions[-1]
    regions: dict[str, str] = {}
    order: list[tuple[str, int]] = []  # blocks in execution order
    node_block: dict[str, tuple[str, int]] = {}
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
                            f"block {_pretty(current[0])}.{current[1]} runs again after another block started "
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
    per_stack: dict[str, list[int]] = defaultdict(list)
    blocks = []
    for pos, (cont, index) in enumerate(order):
        group = group_ids.setdefault(signatures[pos], len(group_ids))
        groups[group].append(pos)
        per_stack[cont].append(pos)
        pretty = _pretty(cont)
        blocks.append(
            Block(
                index=index if len(stacks) == 1 else pos,
                path=f"{pretty}.{index}" if pretty else str(index),
                nodes=tuple(members[pos]),
                params=block_params[pos],
                group=group,
            )
        )
    log.debug("found %d blocks in %s (%d groups)", len(blocks), ", ".join(map(_pretty, per_stack)), len(groups))
    return BlockGraph(
        container=_pretty(container),
        blocks=tuple(blocks),
        regions=regions,
        block_of=block_of,
        groups=tuple(tuple(g) for g in groups.values()),
        stacks=tuple((_pretty(cont), tuple(positions)) for cont, positions in per_stack.items()),
    )


def _pretty(container: str) -> str:
    return module_path(container)


def _parts_reason(container: str, kinds: dict[str, dict[int, str]]) -> str:
    pretty = _pretty(container)
    children = ", ".join(f"{pretty}.{index} ({kind})" if pretty else f"{index} ({kind})"
                         for index, kind in sorted(kinds[container].items()))
    return (f"{children} are each of another class: the parts of one module, not repeated blocks "
            "(a graph that holds one layer)")


def _stacks(calls: list[torch.fx.Node], owners: dict[str, Counter], main: str, params: set[str]) -> list[str]:
    """The containers whose children are blocks, in execution order: `main` and the
    other stacks (see the module docstring)."""
    span: dict[str, list[int]] = {}
    reads: dict[str, set[int]] = defaultdict(set)
    child: dict[str, dict[str, int]] = defaultdict(dict)  # container -> node name -> index
    for i, node in enumerate(calls):
        for cont, index in _indexed_paths(node):
            span.setdefault(cont, [i, i])[1] = i
            child[cont].setdefault(node.name, index)
            if any(arg.name in params for arg in node.all_input_nodes):
                reads[cont].add(index)

    def chained(cont: str) -> bool:
        """Each child reads what the one before it computed (maybe through nodes of no
        child): a sequence of blocks, not parallel branches such as a list of heads."""
        owner = child[cont]
        indices = sorted(owners[cont])
        for before, after in zip(indices, indices[1:]):
            frontier = [n for n in calls if owner.get(n.name) == after]
            seen = {n.name for n in frontier}
            found = False
            while frontier and not found:
                node = frontier.pop()
                for arg in node.all_input_nodes:
                    if owner.get(arg.name) == before:
                        found = True
                    elif arg.name not in owner and arg.name not in seen and arg.op != "placeholder":
                        seen.add(arg.name)
                        frontier.append(arg)
            if not found:
                return False
        return True

    def nested(inner: str, outer: str) -> bool:
        """`inner` is a module list inside one block of `outer`."""
        return inner.startswith(outer) and _CHILD.match(inner[len(outer) :]) is not None

    stacks = [main]
    for cont in sorted(owners, key=lambda c: span[c][0]):
        if (
            cont == main
            or len(owners[cont]) < 2
            or reads[cont] != set(owners[cont])
            or any(nested(cont, other) for other in owners)
            or nested(main, cont)
            or any(span[cont][0] <= span[s][1] and span[s][0] <= span[cont][1] for s in stacks)
            or not chained(cont)
        ):
            continue
        stacks.append(cont)
    return sorted(stacks, key=lambda c: span[c][0])


def _indexed_paths(node: torch.fx.Node):
    """(container, index) for every numbered module the node runs inside."""
    for container, index, _kind in _indexed_modules(node):
        yield container, index


def _indexed_modules(node: torch.fx.Node):
    """(container, index, class name) for every numbered module the node runs inside."""
    stack = node.meta.get("nn_module_stack") or {}
    for path, kind in stack.values():
        match = _INDEXED.match(path)
        if match:
            name = getattr(kind, "__qualname__", None) or str(kind).rsplit(".", 1)[-1].strip("'>")
            yield match.group(1), int(match.group(2) or match.group(3)), name


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
