"""Compile each distinct (block, sub-batch) region once and call it where it runs.

A rewritten step holds K copies of every block's forward and backward, one per
sub-batch, and the blocks of a model are copies of each other. Handed to Inductor
whole, the graph is lowered, scheduled and fused copy by copy, and the scheduler
fuses copies of different sub-batches horizontally (they read the same weights), so
every combination becomes a kernel of its own: compile time grows with K x depth.

`compile_regions` cuts a partitioned graph into its block regions instead: each run
of nodes of one block's (block, sub-batch) tag becomes a graph of its own
(bookkeeping nodes join the open run, as in `slcompile.passes.mark_regions`, and so
does untagged compute inside it: the weight gradients of all K sub-batches, summed in
one matmul amid the last sub-batch's backward). Regions that are the same graph on
inputs of the same size, stride, dtype and alignment (the same block at another
sub-batch or layer) share one compiled callable. Everything else stays in the step
graph, which runs as Python code in program order, calling the compiled regions
where their nodes were: the `slc::` transfer ops, markers, the glue between regions
(gradient sums across sub-batches) and the parts outside the blocks (embeddings, the
head, the loss). Those are K small copies that differ from each other (a sub-batch's
offset into the targets, the first sub-batch's extra outputs): compiling each would
cost a compile per copy, so they run eagerly.

Needs: a graph whose values all carry static `meta["val"]` (the partitioned graphs
carry fake tensors); tags from `SlcMeta`.
Guarantees:
- The step computes what the whole graph computes: regions see the same inputs and
  return every value used after them with the strides the graph's metadata gives
  (`user_visible_output_idxs` covers every output), so the next region's compiled
  code, compiled against that metadata, reads them as it expects.
- Program order is kept: a region runs where its first node was, and a value is
  dropped after its last use (FX's code generation), so the step's memory follows
  the schedule that `slcompile.analysis.memory` predicts.
- A graph with symbolic sizes, or one where a region would return something other
  than a tensor, is not cut: `compile_regions` returns None and the caller compiles
  it whole (logged).
"""

from __future__ import annotations

import dataclasses
import logging
import operator
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from slcompile.meta import get_slc_meta, parse_tag
from slcompile.vocabulary import is_bookkeeping, is_compute

__all__ = ["Region", "RegionCompilation", "compile_regions", "find_regions", "MIN_REGION_NODES"]

log = logging.getLogger(__name__)

# Block runs with fewer compute nodes than this run eagerly in the step graph: a
# single op gains nothing from compiling.
MIN_REGION_NODES = 2
_ALIGNMENT = 16  # bytes; torch._inductor.utils.ALIGNMENT


@dataclasses.dataclass
class Region:
    """One region cut out of a graph.

    Attributes:
        tag: the (block, sub-batch) tag.
        nodes: the graph's nodes in the region, in program order.
        inputs: nodes outside the region that it reads, in order of first use.
        outputs: nodes of the region read after it (or returned by the graph).
    """

    tag: str
    nodes: list[torch.fx.Node]
    inputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)
    outputs: list[torch.fx.Node] = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class RegionCompilation:
    """What `compile_regions` did to one graph.

    Attributes:
        regions: regions cut out of the graph.
        compiled: distinct regions compiled (the rest reuse one of them).
        eager_nodes: compute nodes left in the step graph (outside the blocks, glue).
    """

    regions: int
    compiled: int
    eager_nodes: int


class _OutOfOrder(Exception):
    pass


def _runs_in_region(node: torch.fx.Node) -> bool:
    """Compute, and the bookkeeping that joins it; transfers and markers end a run."""
    return is_compute(node) or is_bookkeeping(node)


def find_regions(graph: torch.fx.Graph) -> list[Region]:
    """Cuts `graph` into regions (see the module docstring); the rest stays outside."""
    runs: list[Region] = []
    open_run: Region | None = None
    owner: dict[torch.fx.Node, Region] = {}
    for node in graph.nodes:
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
        region.outputs = [node for node in region.nodes if any(user not in members for user in node.users)]
    return regions


def _is_block(tag: str) -> bool:
    return bool(tag) and parse_tag(tag)[0] == "block"


def _compute_count(run: Region) -> int:
    return sum(1 for node in run.nodes if is_compute(node))


def _static_tensor(value: Any) -> bool:
    if not isinstance(value, torch.Tensor):
        return False
    return not any(isinstance(size, torch.SymInt) for size in (*value.shape, *value.stride(), value.storage_offset()))


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
    output = graph.output(tuple(env[node] for node in region.outputs))
    output.meta["user_visible_output_idxs"] = list(range(len(region.outputs)))
    return torch.fx.GraphModule(torch.nn.Module(), graph)


def _signature(module: torch.fx.GraphModule, region: Region) -> tuple:
    # Inductor reads an input's storage offset only through its alignment (it
    # specializes on aligned pointers and copies misaligned inputs at run time), so
    # sub-batch views at different offsets share a compiled region.
    inputs = tuple(
        (value.dtype, value.device.type, tuple(value.shape), tuple(value.stride()),
         value.storage_offset() * value.element_size() % _ALIGNMENT == 0)
        for value in (source.meta["val"] for source in region.inputs)
    )
    return module.code, inputs


def _callable(compiled: Callable, name: str) -> Callable:
    def region(*args):
        return compiled(list(args))

    region.__name__ = region.__qualname__ = name
    return region


# Views whose strides must match their input's: in the step graph they reshape.
_STRIDED_VIEWS = (torch.ops.aten.view.default, torch.ops.aten._unsafe_view.default)


def compile_regions(
    gm: torch.fx.GraphModule,
    compile_region: Callable[[torch.fx.GraphModule, Sequence[torch.Tensor]], Callable],
    cache: dict | None = None,
) -> tuple[torch.fx.GraphModule, RegionCompilation] | None:
    """Compiles each distinct region of `gm` once; returns the step graph calling them.

    Args:
        gm: a partitioned forward, backward or inference graph (not changed).
        compile_region: compiles one region module on its example inputs (fake
            tensors) to a boxed callable (`compile_fx_inner`).
        cache: signature -> compiled callable, shared across the graphs of one step
            so a forward region is not compiled again for an inference graph.

    Returns:
        (the step graph, calling the compiled regions, what was done), or None
        when the graph is not cut (no block region, symbolic sizes, non-tensor
        values crossing a region's edge, a region input computed after it starts).
    """
    regions = find_regions(gm.graph)
    if not regions:
        return None
    for region in regions:
        edge = (*region.inputs, *region.outputs)
        if not all(_static_tensor(node.meta.get("val")) for node in edge):
            log.info("speedloader: a region of the %s-node graph has symbolic or non-tensor edges; "
                     "compiled whole", len(gm.graph.nodes))
            return None

    cache = {} if cache is None else cache
    compiled_now = 0
    calls: dict[torch.fx.Node, tuple[Region, Callable]] = {}
    for index, region in enumerate(regions):
        module = _region_module(region)
        key = _signature(module, region)
        if key not in cache:
            cache[key] = compile_region(module, [source.meta["val"] for source in region.inputs])
            compiled_now += 1
        name = f"region_{region.tag.replace('.', '_')}_{index}"
        calls[region.nodes[0]] = (region, _callable(cache[key], name))

    step = torch.fx.Graph()
    env: dict[torch.fx.Node, torch.fx.Node] = {}
    inside = {node for region in regions for node in region.nodes}

    def emit(node: torch.fx.Node) -> torch.fx.Node:
        # Views left out of a region may come after its first node: they are emitted
        # when the region needs them (their own inputs come before them).
        if node not in env:
            if node in inside:
                raise _OutOfOrder(node)
            env[node] = step.node_copy(node, emit)
            if env[node].target in _STRIDED_VIEWS:
                # A compiled region may return a layout of its own (contiguous where the
                # traced value was a permuted view); the glue runs eagerly on what it gets.
                env[node].target = torch.ops.aten.reshape.default
        return env[node]

    try:
        for node in gm.graph.nodes:
            if node in calls:
                region, function = calls[node]
                call = step.call_function(function, tuple(emit(source) for source in region.inputs))
                for position, output in enumerate(region.outputs):
                    env[output] = step.call_function(operator.getitem, (call, position))
                    env[output].meta = dict(output.meta)
            elif node not in inside:
                emit(node)
    except _OutOfOrder as error:
        log.info("speedloader: region input %s is computed after the region starts; compiled whole", error)
        return None
    module = torch.fx.GraphModule(gm, step)
    eager = sum(1 for node in gm.graph.nodes if is_compute(node) and node not in inside)
    done = RegionCompilation(len(regions), compiled_now, eager)
    log.info("speedloader: %d regions, %d compiled, %d compute nodes left eager", *dataclasses.astuple(done))
    return module, done
