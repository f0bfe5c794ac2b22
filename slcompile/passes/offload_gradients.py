"""Weight gradients leave the device where the schedule stores them.

Runs on the partitioned backward graph, after `fuse_weight_grads` and
`order_layer_major` (and after `offload_saved` and the prefetch placement, whose
nodes it leaves alone or moves, see below). It needs the fetches `stream_weights`
inserted: a streamed weight is recognised by its `slc::fetch_weight(primals_i, key)`
in the forward graph.

For every streamed weight whose gradient an offloaded optimizer takes (`wanted`):

1. Right after the node that computes its final gradient (summed over the K
   sub-batches), it inserts `slc::offload_grad(grad, key)`, which issues the store of
   the gradient to the optimizer's tier and hands it to the optimizer. When the
   schedule stores per (block, sub-batch) (`store_grad.issue blk2.sb1`, the
   grad_accumulation policy), each sub-batch's share of the gradient (the terms
   the final gradient adds up) is stored right after it is computed, the sum is
   no longer computed on the device, and the optimizer's tier adds the K shares.
2. The backward returns None for that parameter instead of the gradient, so autograd
   never materialises a full-size `.grad` (AOTAutograd's runtime and autograd take a
   None for an input that requires grad: the parameter's `.grad` stays None).
3. It inserts `slc::wait(token, [grad])` for each store where the schedule's
   `store_grad.wait` step is: before the step after it that the graph places by
   itself (the first node of a compute step, or the first store of the next
   unit), before the output when none follows. The policies wait for a block's
   stores just before the next block's first store, so a store overlaps the next
   block's backward; the wait is the gradient's last use, so its memory is freed
   there (Inductor reuses a buffer right after its last use; naming it in
   `keepalive` keeps it intact while the I/O threads read it).
4. `slc::fetch_issue` nodes of the backward that prefetch a weight of the *next*
   forward (phase `fwd`) whose gradient leaves are removed and returned in
   `GradientReport.deferred_issues`: that weight changes in the optimizer step, so
   the runtime issues these loads right after the step rewrote the weight (a load
   issued earlier would read the old values).

Guarantees: the graph computes the same values; every gradient it no longer returns
is stored once per backward (or, per sub-batch, once per share); `GradientReport.bytes`
is what leaves the device per step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.fx

from slcompile.meta import SlcMeta, get_slc_meta, set_slc_meta
from slcompile.schedules.base import Schedule
from slcompile.vocabulary import OFFLOAD_GRAD, WAIT, WeightKey, fake_token, is_compute, is_fetch, is_fetch_issue

__all__ = ["GradientReport", "offload_gradients"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GradientReport:
    """What `offload_gradients` did.

    Attributes:
        stores: (block, stored weight key, bytes) of each gradient stored, in the
            order the backward stores them (a key stored per sub-batch appears once
            per share).
        bytes: total bytes of gradients that leave the device per backward.
        kept: (stored weight key, reason) of streamed weights whose gradient stays
            a graph output (no gradient, or no offloaded optimizer takes it).
        deferred_issues: stored weight key -> the graph keys of the next forward's
            prefetches of it, taken out of the backward; issue them after the
            weight's update.
        refused: why nothing was done, or None.
    """

    stores: tuple[tuple[int | None, str, int], ...] = ()
    bytes: int = 0
    kept: tuple[tuple[str, str], ...] = ()
    deferred_issues: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    refused: str | None = None

    def shares(self) -> dict[str, int]:
        """stored key -> how many stores make up its gradient (1, or one per sub-batch)."""
        counts: dict[str, int] = {}
        for _, stored, _ in self.stores:
            counts[stored] = counts.get(stored, 0) + 1
        return counts

    def blocks(self) -> dict[int | None, tuple[str, ...]]:
        """block -> the stored keys whose gradients that block's backward stores."""
        grouped: dict[int | None, list[str]] = {}
        for block, stored, _ in self.stores:
            if stored not in grouped.get(block, ()):
                grouped.setdefault(block, []).append(stored)
        return {block: tuple(keys) for block, keys in grouped.items()}


def offload_gradients(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    graph_key_for: Callable[[str], str],
    wanted: Callable[[str], bool],
    schedule: Schedule | None = None,
) -> tuple[torch.fx.GraphModule, GradientReport]:
    """Stores the final gradients of streamed weights from the backward `bw` (changed
    in place) and stops returning them.

    Args:
        fw: the partitioned forward graph (read only): its placeholders, in order,
            are what the backward returns a gradient (or None) for, and its fetches
            name every streamed weight (the backward does not fetch those whose
            value its gradient does not need, such as linear biases).
        bw: the partitioned backward graph, in its final compute order.
        graph_key_for: `graph_key_for(stored weight key) -> key of slc::offload_grad`.
        wanted: `wanted(stored weight key)`: whether that weight's gradient leaves.
        schedule: the policy's schedule: its `store_grad` steps say whether each
            block's gradients leave once or each sub-batch's share leaves on its own,
            and where each store is waited for. None: once per block, each block's
            stores waited for before the next block's first store.

    Returns:
        (bw, what was stored).
    """
    graph = bw.graph
    # A recomputed random op (CUDA's flash attention, dropout) adds a generator input
    # to the forward after the others (AOTAutograd's graph-safe RNG functionalization,
    # `fwd_rng_state_<n>`); the backward returns no gradient for it.
    forward_inputs = [node.name for node in fw.graph.find_nodes(op="placeholder")
                      if not isinstance(node.meta.get("val"), torch.Generator)]
    output = graph.output_node()
    outputs = list(output.args[0])
    if len(outputs) != len(forward_inputs):
        reason = (f"the backward returns {len(outputs)} values for {len(forward_inputs)} forward inputs; "
                  "gradients stay graph outputs")
        log.warning("offload_gradients: %s", reason)
        return bw, GradientReport(refused=reason)
    position = {name: index for index, name in enumerate(forward_inputs)}
    order = {node: index for index, node in enumerate(graph.nodes)}

    streamed: dict[str, tuple[str, int | None]] = {}  # stored key -> (placeholder, block)
    for node in (*fw.graph.nodes, *graph.nodes):
        if is_fetch(node) and node.args[0].op == "placeholder":
            stored = WeightKey.parse(node.args[1]).stored
            meta = get_slc_meta(node)
            streamed.setdefault(stored, (node.args[0].name, meta.block if meta is not None else None))

    per_subbatch = schedule is not None and any(sb is not None for _, sb in schedule.gradient_stores())
    stores: list[tuple[int | None, int | None, str, int, torch.fx.Node]] = []
    chains: list[torch.fx.Node] = []  # the sums of per-sub-batch shares no longer computed
    kept: list[tuple[str, str]] = []
    for stored, (placeholder, block) in streamed.items():
        index = position.get(placeholder)
        grad = outputs[index] if index is not None else None
        if not isinstance(grad, torch.fx.Node):
            kept.append((stored, "no gradient"))
            continue
        if not wanted(stored):
            kept.append((stored, "no offloaded optimizer takes it"))
            continue
        outputs[index] = None
        shares = _shares(grad) if per_subbatch else None
        if shares is None:
            if per_subbatch:
                log.info("offload_gradients: the gradient of %s is not a sum of one share per sub-batch; "
                         "it leaves once, summed", stored)
            shares, sums = {None: grad}, []
        else:
            shares, sums = shares
        chains += sums
        for subbatch, share in shares.items():
            value = share.meta["val"]
            stores.append((block, subbatch, stored, int(value.numel()) * value.element_size(), share))

    # Step 1: the stores, right after each gradient (or share of one).
    placed = []
    for block, subbatch, stored, nbytes, grad in sorted(stores, key=lambda s: order[s[4]]):
        anchor = grad
        if grad.op == "placeholder":  # a gradient passed through: store it once inputs are bound
            anchor = max((n for n in graph.nodes if n.op == "placeholder"), key=order.__getitem__)
        with graph.inserting_after(anchor):
            token = graph.call_function(OFFLOAD_GRAD, (grad, graph_key_for(stored)))
        token.meta["val"] = fake_token()
        set_slc_meta(token, SlcMeta(region="block", block=block, subbatch=subbatch, role="store"))
        placed.append((block, subbatch, stored, nbytes, grad, token))

    # Step 2: no gradient output for them, and no sum of their shares.
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    for node in sorted(chains, key=order.__getitem__, reverse=True):
        if not node.users:
            graph.erase_node(node)

    # Step 3: the waits, where the schedule puts them.
    units: dict[tuple[int | None, int | None], list[tuple]] = {}
    for entry in placed:
        units.setdefault((entry[0], entry[1]), []).append(entry)
    for unit, before in _wait_positions(graph, schedule, units).items():
        for block, subbatch, _, _, grad, token in units[unit]:
            with graph.inserting_before(before):
                wait = graph.call_function(WAIT, (token, [grad]))
            wait.meta["val"] = fake_token()
            set_slc_meta(wait, SlcMeta(region="block", block=block, subbatch=subbatch, role="store"))

    # Step 4: prefetches of the next forward wait for the update.
    leaving = {entry[2] for entry in placed}
    deferred: dict[str, list[str]] = {}
    for node in list(graph.nodes):
        if not is_fetch_issue(node):
            continue
        key = WeightKey.parse(node.args[0])
        if key.phase == "fwd" and key.stored in leaving:
            deferred.setdefault(key.stored, []).append(node.args[0])
            graph.erase_node(node)

    graph.lint()
    bw.recompile()
    report = GradientReport(
        stores=tuple((block, stored, nbytes) for block, _, stored, nbytes, _, _ in placed),
        bytes=sum(entry[3] for entry in placed),
        kept=tuple(kept),
        deferred_issues={stored: tuple(keys) for stored, keys in deferred.items()},
    )
    log.debug("offload_gradients: %d gradients (%d bytes) leave the backward; %d kept",
              len(placed), report.bytes, len(kept))
    return bw, report


def _shares(grad: torch.fx.Node):
    """A gradient summed over sub-batches as ({sub-batch: its share}, [the sums]),
    or None when it is not one share per sub-batch added up by untagged adds."""
    shares: dict[int, torch.fx.Node] = {}
    sums: list[torch.fx.Node] = []
    pending = [grad]
    while pending:
        node = pending.pop()
        meta = get_slc_meta(node)
        if (node.op == "call_function" and node.target is torch.ops.aten.add.Tensor and len(node.args) == 2
                and all(isinstance(a, torch.fx.Node) for a in node.args) and not node.kwargs
                and (meta is None or meta.subbatch is None) and (node is grad or len(node.users) == 1)):
            sums.append(node)
            pending += node.args
            continue
        if meta is None or meta.subbatch is None or meta.subbatch in shares:
            return None
        shares[meta.subbatch] = node
    return shares, sums


def _wait_positions(graph: torch.fx.Graph, schedule, units) -> dict[tuple, torch.fx.Node]:
    """(block, sub-batch) of each store unit -> the node its waits go before.

    A wait step of the schedule's backward goes before the step after it that the
    graph places by itself (a compute step: its first node; a store issue: the
    unit's first store), or before the output when none follows. A unit the
    schedule gives no wait (a policy that writes no gradient stores) waits just
    before the next unit's first store, the last one before the output.
    """
    output = graph.output_node()
    first_store = {unit: entries[0][5] for unit, entries in units.items()}
    first_compute: dict[tuple, torch.fx.Node] = {}
    for node in graph.nodes:
        meta = get_slc_meta(node)
        if meta is not None and is_compute(node):
            first_compute.setdefault((meta.region, meta.block if meta.region == "block" else None, meta.subbatch), node)
    steps = list(schedule.phase("bwd").steps) if schedule is not None else []
    positions: dict[tuple, torch.fx.Node] = {}
    for index, step in enumerate(steps):
        unit = (step.block, step.subbatch)
        if step.kind != "store_grad.wait" or unit not in units:
            continue
        before = output
        for later in steps[index + 1:]:
            if later.kind == "compute" and later.key in first_compute:
                before = first_compute[later.key]
                break
            if later.kind == "store_grad.issue" and (later.block, later.subbatch) in first_store:
                before = first_store[later.block, later.subbatch]
                break
        positions[unit] = before
    missing = [unit for unit in units if unit not in positions]
    if missing and steps:
        log.info("offload_gradients: the schedule waits for no store of %s; each waits before the next store",
                 missing)
    ordered = list(units)  # in store order
    for number, unit in enumerate(ordered):
        if unit not in positions:
            positions[unit] = first_store[ordered[number + 1]] if number + 1 < len(ordered) else output
    return positions
