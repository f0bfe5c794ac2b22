"""Outline each (block, sub-batch) region as a call of a subgraph, one per distinct region.

A rewritten step holds K copies of every block's forward and backward, one per
sub-batch, and the blocks of a model are copies of each other. Handed to Inductor
flat, the graph is lowered, scheduled and fused copy by copy, and the scheduler fuses
copies of different sub-batches horizontally (they read the same weights), so every
combination becomes a kernel of its own: compile time grows with K x depth.

`outline_regions` cuts a partitioned graph into its block regions: each run of nodes
of one block's (block, sub-batch) tag becomes a subgraph (bookkeeping nodes join the
open run, as in `slcompile.passes.mark_regions`, and so does untagged compute inside
it: the weight gradients of all K sub-batches, summed in one matmul amid the last
sub-batch's backward). The run is replaced by one call of PyTorch's `invoke_subgraph`
higher-order op. Regions that are the same graph on inputs of the same size, stride,
dtype and alignment (the same block at another sub-batch or layer) call the same
subgraph, which Inductor lowers and generates code for once
(`GraphLowering.get_attr` keeps one `ir.Subgraph` per attribute). Everything else
stays in the graph, which Inductor compiles as one program with them: the `slc::`
transfer ops (extern calls, in program order), the glue between regions (gradient
sums across sub-batches) and the parts outside the blocks (embeddings, the head, the
loss). Nothing of the step then runs op by op in Python.

Runs last in the compiled stage, on a graph Inductor compiles (`lowering="inductor"`,
`compile_regions=True`).

Needs: a graph whose values all carry `meta["val"]` (the partitioned graphs carry
fake tensors, symbolic where the batch is); tags from `SlcMeta`.
Guarantees:
- The graph computes what it computed: a subgraph sees the same inputs, and Inductor
  gives each call's operands the strides of the subgraph's example inputs
  (`InvokeSubgraph.create` constrains them) and reads its outputs with the layout
  the subgraph's code returns.
- Program order is kept: a call sits where its region's first node was; Inductor,
  with `reorder_for_peak_memory` and `reorder_for_locality` off, keeps extern calls
  (the subgraphs, the transfers) in that order.
- A graph with symbolic sizes (a batch that changed size) is outlined as a static
  one is. A subgraph's code reads its size symbols from its inputs, so each region
  also takes an input of the graph that holds each symbol its values use (a tensor
  with a dim of that size, else the SymInt), and copies share a subgraph when their
  sizes are the same expressions. Size arithmetic (a sub-batch's size) stays in the
  step graph, read by the regions as inputs; a size of a region's own value (a
  view's `-1` dim) is computed in the region, and again after its call where the
  step graph reads it.
- A graph where a region would take or return something other than a tensor (or a
  size), or use a size symbol no input of the graph holds, is not outlined (the log
  says why) and compiles flat.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from typing import Any

import sympy
import torch
import torch.fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from slcompile.compat import graph_module
from slcompile.meta import get_slc_meta, parse_tag
from slcompile.vocabulary import is_bookkeeping, is_compute

__all__ = ["Region", "RegionOutline", "outline_regions", "find_regions", "MIN_REGION_NODES"]

log = logging.getLogger(__name__)

# Block runs with fewer compute nodes than this stay in the graph: a single op gains
# nothing from a subgraph of its own.
MIN_REGION_NODES = 2
_ALIGNMENT = 16  # bytes; torch._inductor.utils.ALIGNMENT
_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph


@dataclasses.dataclass
class Region:
    """One region cut out of a graph.

    Attributes:
        tag: the (block, sub-batch) tag.
        nodes: the graph's nodes in the region, in program order.
        inputs: nodes outside the region that it reads, in order of first use.
        outputs: nodes of the region it returns: those read after it (or returned
            by the graph), but views at a storage offset (see `_returned`).
        recomputed: views and sizes read after the region that its caller
            recomputes from its outputs, in program order.
    """

    tag: str
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    outputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    recomputed: list[torch.fx.Node] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RegionOutline:
    """What `outline_regions` did to one graph.

    Attributes:
        regions: regions outlined as subgraph calls.
        subgraphs: distinct subgraphs they call (each compiled once).
        outside_nodes: compute nodes left outside the regions (compiled with the
            step: the parts outside the blocks, the glue).
    """

    regions: int
    subgraphs: int
    outside_nodes: int


def _runs_in_region(node: torch.fx.Node) -> bool:
    """Compute, and the bookkeeping that joins it; transfers and markers end a run."""
    return is_compute(node) or is_bookkeeping(node)


def find_regions(graph: torch.fx.Graph) -> list[Region]:
    """Cuts `graph` into regions (see the module docstring); the rest stays outside."""
    runs: list[Region] = []
    open_run: Region | None = None
    owner: dict[torch.fx.Node, Region] = {}
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.meta.get("val"), torch.SymInt):
            if open_run is not None and any(owner.get(source) is open_run for source in node.all_input_nodes):
                # A size of a value of the open run (a view's `-1` dim where the
                # sub-batch is symbolic): the region computes it for its own users,
                # and the step graph again after the call, from what it returns.
                open_run.nodes.append(node)
                owner[node] = open_run
            # Other size arithmetic (a sub-batch's size from the batch's) stays in the
            # step graph without ending a run: a region reads it as an input.
            continue
        if not _runs_in_region(node):
            open_run = None
            continue
        if node.target is operator.getitem and node.args[0] in owner:
            # A multi-output op's parts go with it: a region returns tensors only.
            run = owner[node.args[0]]
            run.nodes.append(node)
            owner[node] = run
            continue
        meta = get_slc_meta(node)
        tag = "" if meta is None or meta.subbatch is None else meta.tag
        if not tag and open_run is not None:
            # Untagged compute inside an open run (the weight gradients of all K
            # sub-batches in one matmul, placed amid the last sub-batch's backward)
            # joins it, as markers bracket it: one region per (block, sub-batch).
            tag = open_run.tag
        if is_bookkeeping(node):
            if open_run is None or not any(owner.get(source) is open_run for source in node.all_input_nodes):
                # A view of values from outside (a weight's transpose that the first
                # sub-batch would otherwise compute for all): it stays in the step graph,
                # so each copy of a block reads the same inputs.
                continue
            tag = open_run.tag
        if open_run is None or open_run.tag != tag:
            open_run = Region(tag, [])
            runs.append(open_run)
        open_run.nodes.append(node)
        owner[node] = open_run

    regions = [run for run in runs if _is_block(run.tag) and _compute_count(run) >= MIN_REGION_NODES]
    for region in regions:
        members = set(region.nodes)
        for node in region.nodes:
            for source in node.all_input_nodes:
                if source not in members and source not in region.inputs:
                    region.inputs.append(source)
        region.outputs, region.recomputed = _returned(region, members)
    return regions


def _is_view(node: torch.fx.Node) -> bool:
    """A view op's result, or one part of a multi-output view op's (`split`)."""
    if node.target is operator.getitem:
        return _is_view(node.args[0])
    return isinstance(node.target, torch._ops.OpOverload) and node.target.is_view


def _at_offset(node: torch.fx.Node) -> bool:
    value = node.meta.get("val")
    # A multi-output view op's parts are at offsets.
    return not isinstance(value, torch.Tensor) or not statically_known_true(value.storage_offset() == 0)


def _returned(region: Region, members: set) -> tuple[list[torch.fx.Node], list[torch.fx.Node]]:
    """(what a region returns, what its caller recomputes after the call), in program order.

    A region returns tensors only, and no view at a storage offset (a slice of a
    fused projection): Inductor (torch 2.13) applies the offset of a subgraph's output
    again where the caller reads it. Such a view, the views it is taken of, and a size
    the region computes that is read after it are recomputed after the call from the
    values they are made of, which the region returns instead.
    """
    returned: set[torch.fx.Node] = set()
    recomputed: set[torch.fx.Node] = set()

    def needed_after(node: torch.fx.Node) -> None:
        if node in returned or node in recomputed:
            return
        if isinstance(node.meta.get("val"), torch.SymInt) or (
                _is_view(node) and _at_offset(node) and node.args[0] in members):
            recomputed.add(node)
            for source in node.all_input_nodes:
                if source in members:
                    needed_after(source)
        else:
            returned.add(node)

    for node in region.nodes:
        if any(user not in members for user in node.users):
            needed_after(node)
    return [n for n in region.nodes if n in returned], [n for n in region.nodes if n in recomputed]


def _is_block(tag: str) -> bool:
    return bool(tag) and parse_tag(tag)[0] == "block"


def _compute_count(run: Region) -> int:
    return sum(1 for node in run.nodes if is_compute(node))


def _symbols(value: Any) -> set:
    """The size symbols a value's shape, strides and offset (or a SymInt) use."""
    if isinstance(value, torch.SymInt):
        return set(value.node.expr.free_symbols)
    if not isinstance(value, torch.Tensor):
        return set()
    found = set()
    for size in (*value.shape, *value.stride(), value.storage_offset()):
        if isinstance(size, torch.SymInt):
            found |= size.node.expr.free_symbols
    return found


def _symbol_sources(gm: torch.fx.GraphModule) -> dict:
    """Size symbol -> an input of the graph that holds it: a tensor with a dim of
    that size, else the SymInt. A tensor comes first: Inductor may give a SymInt
    input a symbol of its own, which the sizes of the tensors do not use."""
    found: dict = {}
    placeholders = gm.graph.find_nodes(op="placeholder")
    for node in placeholders:
        value = node.meta.get("val")
        if isinstance(value, torch.Tensor):
            for size in value.shape:
                if isinstance(size, torch.SymInt) and isinstance(size.node.expr, sympy.Symbol):
                    found.setdefault(size.node.expr, node)
    for node in placeholders:
        value = node.meta.get("val")
        if isinstance(value, torch.SymInt) and isinstance(value.node.expr, sympy.Symbol):
            found.setdefault(value.node.expr, node)
    return found


def _lift_symbols(region: Region, sources: dict) -> str | None:
    """Makes the region take, first, an input that holds each size symbol its values
    use (Inductor binds a subgraph's symbols from its inputs); why it cannot (a
    symbol the graph holds nowhere), or None."""
    used = set()
    for node in (*region.inputs, *region.nodes):
        used |= _symbols(node.meta.get("val"))
    missing = sorted(str(symbol) for symbol in used if symbol not in sources)
    if missing:
        return f"size symbols {', '.join(missing)} are no inputs of the graph"
    holders = dict.fromkeys(sources[symbol] for symbol in sorted(used, key=str))
    region.inputs[:0] = [node for node in holders if node not in region.inputs]
    return None


def _region_module(region: Region) -> torch.fx.GraphModule:
    """The region as a graph of its own, its nodes named afresh by the new graph, so
    that copies of one block print the same code."""
    graph = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    for index, source in enumerate(region.inputs):
        placeholder = graph.placeholder(f"arg{index}")
        placeholder.meta["val"] = source.meta["val"]
        env[source] = placeholder
    for node in region.nodes:
        args, kwargs = torch.fx.map_arg((node.args, node.kwargs), lambda n: env[n])
        env[node] = graph.create_node(node.op, node.target, args, kwargs)
        env[node].meta = dict(node.meta)
    graph.output(tuple(env[node] for node in region.outputs))
    return graph_module(torch.nn.Module(), graph)


def _signature(module: torch.fx.GraphModule, region: Region) -> tuple:
    # Inductor reads an input's storage offset only through its alignment, so
    # sub-batch views at different offsets share a subgraph. Symbolic sizes are
    # compared as expressions.
    inputs = []
    for value in (source.meta["val"] for source in region.inputs):
        if isinstance(value, torch.SymInt):
            inputs.append(str(value.node.expr))
            continue
        aligned = statically_known_true(value.storage_offset() * value.element_size() % _ALIGNMENT == 0)
        inputs.append((value.dtype, value.device.type, str(tuple(value.shape)), str(tuple(value.stride())), aligned))
    return module.code, tuple(inputs)


class _OutOfOrder(Exception):
    pass


def outline_regions(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, RegionOutline] | None:
    """Replaces each region of `gm` by a call of its subgraph (see the module docstring).

    Args:
        gm: a partitioned forward, backward or inference graph (not changed).

    Returns:
        (the graph calling the subgraphs, what was done), or None when the graph is
        not outlined (no block region, symbolic sizes, non-tensor values crossing a
        region's edge, a region input computed after it starts; logged).
    """
    regions = find_regions(gm.graph)
    if not regions:
        return None
    sources = _symbol_sources(gm)
    for region in regions:
        if not all(isinstance(node.meta.get("val"), torch.Tensor) for node in region.outputs) or not all(
                isinstance(node.meta.get("val"), (torch.Tensor, torch.SymInt)) for node in region.inputs):
            log.info("speedloader: a region of the %s-node graph has non-tensor edges; compiled flat",
                     len(gm.graph.nodes))
            return None
        refused = _lift_symbols(region, sources)
        if refused is not None:
            log.info("speedloader: a region of the %s-node graph cannot be outlined (%s); compiled flat",
                     len(gm.graph.nodes), refused)
            return None

    attributes: dict[str, Any] = {}
    names: dict[tuple, str] = {}
    calls: dict[torch.fx.Node, tuple[Region, str]] = {}
    for region in regions:
        module = _region_module(region)
        key = _signature(module, region)
        if key not in names:
            names[key] = f"slc_region_{len(names)}"
            attributes[names[key]] = module
        calls[region.nodes[0]] = (region, names[key])

    step = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    subgraphs: dict[str, torch.fx.Node] = {}  # one get_attr node per subgraph
    inside = {node for region in regions for node in region.nodes}

    def emit(node: torch.fx.Node) -> torch.fx.Node:
        # Views left out of a region may come after its first node: they are emitted
        # when the region needs them (their own inputs come before them).
        if node not in env:
            if node in inside:
                raise _OutOfOrder(node)
            env[node] = step.node_copy(node, emit)
            if node.op == "get_attr":
                attributes[node.target] = operator.attrgetter(node.target)(gm)
        return env[node]

    try:
        for node in gm.graph.nodes:
            if node in calls:
                region, name = calls[node]
                operands = tuple(emit(source) for source in region.inputs)
                if name not in subgraphs:
                    subgraphs[name] = step.get_attr(name)
                call = step.call_function(_INVOKE_SUBGRAPH, (subgraphs[name], name, *operands))
                call.meta["val"] = tuple(output.meta["val"] for output in region.outputs)
                for position, output in enumerate(region.outputs):
                    env[output] = step.call_function(operator.getitem, (call, position))
                    env[output].meta = dict(output.meta)
                for node_after in region.recomputed:
                    env[node_after] = step.node_copy(node_after, lambda n: env[n])
            elif node not in inside:
                emit(node)
    except _OutOfOrder as error:
        log.info("speedloader: region input %s is computed after the region starts; compiled flat", error)
        return None
    module = graph_module(attributes, step)
    module.meta.update(gm.meta)
    outside = sum(1 for node in gm.graph.nodes if is_compute(node) and node not in inside)
    done = RegionOutline(len(regions), len(names), outside)
    log.info("speedloader: %d regions calling %d subgraphs, %d compute nodes outside them",
             *dataclasses.astuple(done))
    return module, done

