"""Compute-region markers in the compiled forward and backward graphs.

Runs in the lowering's `prepare` hook on each AOTAutograd graph, after partitioning
and after `order_layer_major` (so the regions are the runs of the order that is
compiled), before the graph is recorded in the CompileReport. It brackets every run
of nodes of one (block, sub-batch) tag with `slc::mark(label, True)` and
`slc::mark(label, False)`; at run time the pair records one `compute` interval on the
runtime's timeline, as `compute_region(label)` does, labelled `"blk3.sb1 fwd"`.

Needs: nodes tagged with `SlcMeta` (untagged graphs get no markers).
Guarantees:
- Markers never change results: `slc::mark` reads no tensor and returns a
  dependency token nothing reads.
- It is an ORDERED effectful op, like the transfer ops: AOTAutograd, Inductor and
  FX dead-code elimination keep it, in program order, although nothing uses it.
- Untagged nodes (gradient sums across sub-batches) and bookkeeping nodes (getitem,
  views, detach) never start a region; they join the region that is open, so a
  backward block is one region, not a dozen slivers.
- A marker costs a few microseconds (about 5 µs per call on this machine's CPU, two
  per region); `SLC_DISABLE=mark_regions` leaves graphs unmarked.

The lowering marks graphs it runs with `aot_eager`, and graphs whose regions
Inductor calls as outlined subgraphs (`compile_regions`,
`slcompile.passes.outline_regions`: the markers stay around each call), except on a
CUDA machine under Inductor, where a marker would time the host issuing a region,
not the GPU running it, at two host calls per (block, sub-batch) unit. A marker
returns a token because, when `slc::mark` returned nothing, Inductor (torch 2.13)
fused kernels of neighbouring regions across it while it freed a graph input where
the unfused order last used it: the generated code deleted `primals_3` before the
fused prefix kernel that reads it (UnboundLocalError at the first call). A graph
Inductor lowers flat (`compile_regions=False`) fuses kernels across the markers, so
they would bracket nothing: `drop_marks`, the pass after `compile_regions`, removes
them there; its transfers are still recorded.

`slcompile.runtime.ops.set_region_listener(callback)` lets the visualizer sample
other figures (resident bytes per tier) at every region boundary; with no listener, a
marker only reads the clock.
"""

from __future__ import annotations

import dataclasses
import logging
from types import MappingProxyType

import torch
import torch.fx

from slcompile.meta import get_slc_meta
from slcompile.vocabulary import MARK, fake_token, is_bookkeeping, parse_region_label, region_label

__all__ = [
    "MARK",
    "MarkedRegion",
    "RegionMarks",
    "mark_regions",
    "marked_regions",
    "drop_marks",
]

log = logging.getLogger(__name__)

PHASES = MappingProxyType({"forward": "fwd", "backward": "bwd", "inference": "fwd"})

@dataclasses.dataclass(frozen=True)
class MarkedRegion:
    """One region of a graph, between its two markers.

    Attributes:
        label: what the timeline shows, `"blk3.sb1 fwd"`.
        tag: the (block, sub-batch) tag, `"blk3.sb1"`.
        nodes: the names of the graph nodes between the markers, in order.
    """

    label: str
    tag: str
    nodes: tuple[str, ...]


@dataclasses.dataclass(frozen=True)
class RegionMarks:
    """The result of `mark_regions`.

    Attributes:
        phase: "fwd" or "bwd".
        regions: the regions marked, in program order.
    """

    phase: str
    regions: tuple[MarkedRegion, ...]


def mark_regions(gm: torch.fx.GraphModule, kind: str) -> tuple[torch.fx.GraphModule, RegionMarks]:
    """Brackets each tag run of `gm` with markers (changed in place).

    Args:
        gm: an AOTAutograd forward, backward or inference graph.
        kind: "forward", "backward" or "inference".

    Returns:
        (gm, the regions marked).
    """
    phase = PHASES[kind]
    graph = gm.graph
    runs = _tag_runs(graph)
    for tag, first, last in runs:
        label = region_label(tag, phase)
        with graph.inserting_before(first):
            begin = graph.call_function(MARK, (label, True))
        with graph.inserting_after(last):
            end = graph.call_function(MARK, (label, False))
        for node in (begin, end):
            node.meta["val"] = fake_token()
    gm.recompile()
    marks = RegionMarks(phase, marked_regions(graph))
    log.debug("mark_regions: %d regions in the %s graph", len(marks.regions), kind)
    return gm, marks


def marked_regions(graph: torch.fx.Graph) -> tuple[MarkedRegion, ...]:
    """The regions a marked graph brackets, read from its marker nodes."""
    regions = []
    label, members = None, []
    for node in graph.nodes:
        if node.op == "call_function" and node.target is MARK:
            if node.args[1]:
                label, members = node.args[0], []
            elif label is not None:
                regions.append(MarkedRegion(label, parse_region_label(label)[0], tuple(members)))
                label = None
        elif label is not None:
            members.append(node.name)
    return tuple(regions)


def drop_marks(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """Removes the markers of `gm` (changed in place), for a graph Inductor compiles
    whole (its scheduler fuses kernels across them).

    Returns:
        (gm, the number of markers removed).
    """
    marks = [node for node in gm.graph.nodes if node.op == "call_function" and node.target is MARK]
    for node in marks:
        gm.graph.erase_node(node)
    if marks:
        gm.recompile()
    return gm, len(marks)


def _tag_runs(graph: torch.fx.Graph) -> list[tuple[str, torch.fx.Node, torch.fx.Node]]:
    """(tag, first node, last node) of each run; bookkeeping nodes join the open run."""
    runs: list[list] = []
    for node in graph.nodes:
        if node.op != "call_function" or node.target is MARK:
            continue
        meta = get_slc_meta(node)
        if meta is None or is_bookkeeping(node):
            if runs:
                runs[-1][2] = node
            continue
        if runs and runs[-1][0] == meta.tag:
            runs[-1][2] = node
        else:
            runs.append([meta.tag, node, node])
    return [tuple(run) for run in runs]
