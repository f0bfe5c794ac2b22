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
job of one I/O thread), not a dozen of each; and a block visit's weights (its
fetches stand together, after its issues) one `fetch_weight_many`, whatever the
number of its weights, which loads a host group's run by one copy.

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

from slcompile.vocabulary import COALESCED, FETCH_ISSUE, UNSTASH_WAIT, WAIT, dtype_name

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


def _runs(graph: torch.fx.Graph) -> list[list[torch.fx.Node]]:
    runs: list[list[torch.fx.Node]] = []
    current: list[torch.fx.Node] = []
    for node in graph.nodes:
        target = node.target if node.op == "call_function" else None
        if current and target is current[0].target and _joins(current[0], node):
            current.append(node)
            continue
        if len(current) > 1:
            runs.append(current)
        current = [node] if target in COALESCED else []
    if len(current) > 1:
        runs.append(current)
    return runs


def _joins(first: torch.fx.Node, node: torch.fx.Node) -> bool:
    return first.target is not UNSTASH_WAIT or node.args[3] == first.args[3]


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


def coalesce_transfers(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, CoalescedTransfers]:
    """Replaces each run of consecutive transfer calls of one kind in `gm` (changed
    in place) by one call of its `_many` op (see the module docstring)."""
    graph = gm.graph
    runs = _runs(graph)
    for run in runs:
        first = run[0]
        with graph.inserting_before(first):
            group = graph.call_function(COALESCED[first.target], _group_args(run))
        # Not the first member's inputs as traced: Inductor would hold the group's to them.
        group.meta.update({key: value for key, value in first.meta.items() if key not in ("val", "eager_input_vals")})
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
