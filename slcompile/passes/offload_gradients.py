"""Weight gradients leave the device once per block, when they are final.

Runs on the partitioned backward graph, after `fuse_weight_grads` and
`order_layer_major` (and after `offload_saved` and the prefetch placement, whose
nodes it leaves alone or moves, see below). It needs the fetches `stream_weights`
inserted: a streamed weight is recognised by its `slc::fetch_weight(primals_i, key)`
in the forward graph.

For every streamed weight whose gradient an offloaded optimizer takes (`wanted`):

1. Right after the node that computes its final gradient (summed over the K
   sub-batches), it inserts `slc::offload_grad(grad, key)`, which issues the store of
   the gradient to the optimizer's tier and hands it to the optimizer.
2. The backward returns None for that parameter instead of the gradient, so autograd
   never materialises a full-size `.grad` (AOTAutograd's runtime and autograd take a
   None for an input that requires grad: the parameter's `.grad` stays None).
3. It inserts `slc::wait(token, [grad])` for each store of a block just before the
   first store of the next block the backward visits (before the output for the
   last one): the store overlaps the next block's backward, and the wait is the
   gradient's last use, so its memory is freed there (Inductor reuses a buffer
   right after its last use; naming it in `keepalive` keeps it intact while the
   I/O threads read it).
4. `slc::fetch_issue` nodes of the backward that prefetch a weight of the *next*
   forward (phase `fwd`) whose gradient leaves are removed and returned in
   `GradientReport.deferred_issues`: that weight changes in the optimizer step, so
   the runtime issues these loads right after the step rewrote the weight (a load
   issued earlier would read the old values).

Guarantees: the graph computes the same values; every gradient it no longer returns
is stored exactly once per backward; `GradientReport.bytes` is what leaves the
device per step.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable

import torch
import torch.fx

from slcompile.meta import SlcMeta, get_slc_meta, set_slc_meta
from slcompile.vocabulary import OFFLOAD_GRAD, WAIT, WeightKey, fake_token, is_fetch, is_fetch_issue

__all__ = ["GradientReport", "offload_gradients"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GradientReport:
    """What `offload_gradients` did.

    Attributes:
        stores: (block, stored weight key, bytes) of each gradient stored, in the
            order the backward stores them.
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

    def blocks(self) -> dict[int | None, tuple[str, ...]]:
        """block -> the stored keys whose gradients that block's backward stores."""
        grouped: dict[int | None, list[str]] = {}
        for block, stored, _ in self.stores:
            grouped.setdefault(block, []).append(stored)
        return {block: tuple(keys) for block, keys in grouped.items()}


def offload_gradients(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    graph_key_for: Callable[[str], str],
    wanted: Callable[[str], bool],
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

    Returns:
        (bw, what was stored).
    """
    graph = bw.graph
    forward_inputs = [node.name for node in fw.graph.find_nodes(op="placeholder")]
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

    stores: list[tuple[int | None, str, int, torch.fx.Node]] = []
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
        value = grad.meta["val"]
        nbytes = int(value.numel()) * value.element_size()
        stores.append((block, stored, nbytes, grad))
        outputs[index] = None

    # Step 1: the stores, right after each final gradient.
    placed = []
    for block, stored, nbytes, grad in sorted(stores, key=lambda s: order[s[3]]):
        anchor = grad
        if grad.op == "placeholder":  # a gradient passed through: store it once inputs are bound
            anchor = max((n for n in graph.nodes if n.op == "placeholder"), key=order.__getitem__)
        with graph.inserting_after(anchor):
            token = graph.call_function(OFFLOAD_GRAD, (grad, graph_key_for(stored)))
        token.meta["val"] = fake_token()
        set_slc_meta(token, SlcMeta(region="block", block=block, role="store"))
        placed.append((block, stored, nbytes, grad, token))

    # Step 2: no gradient output for them.
    output.args = (tuple(outputs),) + tuple(output.args[1:])

    # Step 3: each block's waits before the next block's first store.
    groups: list[list[tuple]] = []
    for entry in placed:
        if groups and groups[-1][0][0] == entry[0]:
            groups[-1].append(entry)
        else:
            groups.append([entry])
    for number, group in enumerate(groups):
        before = groups[number + 1][0][4] if number + 1 < len(groups) else output
        for block, _, _, grad, token in group:
            with graph.inserting_before(before):
                wait = graph.call_function(WAIT, (token, [grad]))
            wait.meta["val"] = fake_token()
            set_slc_meta(wait, SlcMeta(region="block", block=block, role="store"))

    # Step 4: prefetches of the next forward wait for the update.
    leaving = {stored for _, stored, _, _, _ in placed}
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
        stores=tuple((block, stored, nbytes) for block, stored, nbytes, _, _ in placed),
        bytes=sum(nbytes for _, _, nbytes, _, _ in placed),
        kept=tuple(kept),
        deferred_issues={stored: tuple(keys) for stored, keys in deferred.items()},
    )
    log.debug("offload_gradients: %d gradients (%d bytes) leave the backward; %d kept",
              len(placed), report.bytes, len(kept))
    return bw, report
