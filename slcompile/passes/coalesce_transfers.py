"""Runs of consecutive transfer calls as one call each.

Runs on each graph Inductor compiles, after `annotate_streams` and before the
markers and the outlined regions: every run of two or more consecutive calls of
`slc::stash`, `slc::wait`, `slc::unstash`, `slc::unstash_wait`, `slc::fetch_issue`
or `slc::fetch_weight` becomes one call of that op's `_many` form
(`vocabulary.COALESCED`), taking the
members' arguments in order and handing back their results in order (`getitem`s; the
waits' and the weight issues' one dependency token), so that what reads them is
unchanged. The offloading passes place a unit's transfers together (its stashes
after its compute, its waits and loads before the compute step they serve), so a
(block, sub-batch) unit's dozen saved tensors cost the step one op call per kind,
and their nvme I/O one submission (`runtime/nvme_io.batched`: one `io_submit`, or one
job of one I/O thread), not a dozen of each. A block visit's fetches (they stand
together, after its issues) become one `fetch_weight_many` where the weights rest on
a host tier that copies (`fetches=True`): its members in packing order
(`vocabulary.packing_order`), its results one tensor per dtype
(`vocabulary.weight_layout`), and each weight a slice of one of them, viewed in its
shape (views Inductor folds into the kernels that read them): a visit is one op call,
one allocation and one copy per dtype, whatever the number of its weights.

Needs: the graph as the partitioned stage left it (the schedule, the memory model and
the pictures read the single ops there; nothing after this pass reads transfers).
Guarantees:
- Program order is kept: the group call stands where its first member stood, and
  nothing ran between the members.
- A `wait_many` keeps alive the union of its members' `keepalive` tensors; every
  reader of a member's dependency token (a wait's, a weight issue's) reads the
  group's.
- `unstash_wait_many` groups only loads onto one device.
- Each group call carries its first member's slc meta and stream annotation.
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import torch
import torch.fx

from slcompile.vocabulary import (
    COALESCED,
    FETCH_ISSUE,
    FETCH_WEIGHT,
    FETCH_WEIGHT_MANY,
    UNSTASH_WAIT,
    WAIT,
    WeightKey,
    dtype_name,
    packing_order,
    weight_layout,
)

__all__ = ["CoalescedTransfers", "coalesce_transfers"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class CoalescedTransfers:
    """What `coalesce_transfers` did.

    Attributes:
        groups: the group calls made.
        members: the single calls they replaced.
    """

    groups: int = 0
    members: int = 0


_ONE_RESULT = frozenset({WAIT, FETCH_ISSUE})  # dependency tokens: the run's one serves every reader


def _runs(graph: torch.fx.Graph, fetches: bool) -> list[list[torch.fx.Node]]:
    runs: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    for node in graph.nodes:
        target = node.target if node.op == "call_function" else None
        if current and target is current[0].target and _joins(current[0], node):
            current.append(node)
            continue
        if len(current) > 1 or current and current[0].target is FETCH_WEIGHT:
            runs.append(current)
        current = [node] if target in COALESCED and (fetches or target is not FETCH_WEIGHT) else []
    if len(current) > 1 or current and current[0].target is FETCH_WEIGHT:
        runs.append(current)
    return runs


def _joins(first: torch.fx.Node, node: torch.fx.Node) -> bool:
    if first.target is FETCH_WEIGHT:  # one visit's: one streamer, sub-batch and phase
        a, b = WeightKey.parse(first.args[1]), WeightKey.parse(node.args[1])
        return (a.streamer, a.subbatch, a.phase) == (b.streamer, b.subbatch, b.phase)
    return first.target is not UNSTASH_WAIT or node.args[3] == first.args[3]


def _pack_fetches(graph: torch.fx.Graph, run: list[torch.fx.Node]) -> None:
    """A visit's fetches as one `fetch_weight_many`, each weight a view of its
    packed tensor."""
    vals = [node.meta["val"] for node in run]
    order = packing_order([(WeightKey.parse(node.args[1]).stored, val.dtype) for node, val in zip(run, vals)])
    run, vals = [run[i] for i in order], [vals[i] for i in order]
    layout = weight_layout([(val.shape, val.dtype) for val in vals])
    first = run[0]
    with graph.inserting_before(first):
        group = graph.call_function(FETCH_WEIGHT_MANY, ([node.args[0] for node in run], [node.args[1] for node in run]))
        group.meta.update(_group_meta(first))
        # In the traced values' fake mode: a real tensor here would be device memory the
        # size of the block, held by the graph for as long as it lives.
        group.meta["val"] = [vals[0].new_empty((n,), dtype=dtype) for dtype, n in layout.sections]
        packed = []
        for index, (dtype, n) in enumerate(layout.sections):
            part = graph.call_function(operator.getitem, (group, index))
            part.meta.update(_group_meta(first))
            part.meta["val"] = group.meta["val"][index]
            packed.append(part)
        for node, val, (section, offset) in zip(run, vals, layout.places):
            numel = val.numel()
            piece = graph.call_function(torch.ops.aten.slice.Tensor, (packed[section], 0, offset, offset + numel))
            piece.meta.update(node.meta)
            piece.meta["val"] = group.meta["val"][section][offset:offset + numel]
            weight = graph.call_function(torch.ops.aten.view.default, (piece, list(val.shape)))
            weight.meta.update(node.meta)
            node.replace_all_uses_with(weight)
    for node in run:
        graph.erase_node(node)


def _group_meta(first: torch.fx.Node) -> dict:
    # Not the first member's inputs as traced: Inductor would hold the group's to them.
    return {key: value for key, value in first.meta.items() if key not in ("val", "eager_input_vals")}


def _group_args(run: list[torch.fx.Node]) -> tuple:
    target = run[0].target
    if target is WAIT:
        keepalive = list(dict.fromkeys(value for node in run for value in node.args[1]))
        return [node.args[0] for node in run], keepalive
    if target is UNSTASH_WAIT:
        sizes = [size for node in run for size in node.args[1]]
        return ([node.args[0] for node in run], sizes, [len(node.args[1]) for node in run],
                [dtype_name(node.args[2]) for node in run], run[0].args[3])
    # stash (x, key) and unstash (stash_token): one list per argument.
    return tuple(list(values) for values in zip(*(node.args for node in run)))


def coalesce_transfers(gm: torch.fx.GraphModule, fetches: bool = False
                       ) -> tuple[torch.fx.GraphModule, CoalescedTransfers]:
    """Replaces each run of consecutive transfer calls of one kind in `gm` (changed
    in place) by one call of its `_many` op (see the module docstring); a visit's
    fetches too with `fetches`, a lone one included (its weight packed the same way)."""
    graph = gm.graph
    runs = _runs(graph, fetches)
    for run in runs:
        first = run[0]
        if first.target is FETCH_WEIGHT:
            _pack_fetches(graph, run)
            continue
        with graph.inserting_before(first):
            group = graph.call_function(COALESCED[first.target], _group_args(run))
        group.meta.update(_group_meta(first))
        if first.target in _ONE_RESULT:
            group.meta["val"] = first.meta.get("val")
            for node in run:
                node.replace_all_uses_with(group)
        else:
            group.meta["val"] = [node.meta.get("val") for node in run]
            anchor = group
            for index, node in enumerate(run):
                with graph.inserting_after(anchor):
                    part = graph.call_function(operator.getitem, (group, index))
                part.meta.update(node.meta)
                node.replace_all_uses_with(part)
                anchor = part
        for node in run:
            graph.erase_node(node)
    if runs:
        graph.lint()
        gm.recompile()
    done = CoalescedTransfers(len(runs), sum(len(run) for run in runs))
    log.debug("coalesce_transfers: %d calls in %d groups", done.members, done.groups)
    return gm, done
