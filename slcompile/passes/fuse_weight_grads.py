"""Sum each weight's gradient over the sub-batches in one matmul.

Runs on the partitioned backward graph, before `order_layer_major`. Layer-major
backward computes a weight's gradient once per sub-batch, `dW_k = A_k @ B_k` (A_k the
output gradient transposed, B_k the input, contracted over the sub-batch's tokens),
and sums the K results with weight-sized adds. The sum of those products is one
product over the concatenated tokens: `cat(A_k, dim=1) @ cat(B_k, dim=0)`. Where the
device is memory-bandwidth bound (a CPU) and sub-batches are small, K skinny matmuls
that each write a weight-sized result, plus K - 1 weight-sized adds, cost far more than
copying the sub-batches' activations once; the rewrite is applied only when the
copies move fewer bytes than the adds it removes.

The rewrite needs every term of the sum to be an `mm` seen through the same chain of
views (`t`, `permute`, `view`), each used only by the sum; anything else is left alone.
"""

from __future__ import annotations

import logging

import torch
import torch.fx

from slcompile.compat import optimization_hint
from slcompile.meta import SlcMeta, get_slc_meta, set_slc_meta

__all__ = ["fuse_weight_grads"]

log = logging.getLogger(__name__)

_aten = torch.ops.aten


def fuse_weight_grads(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, int]:
    """Rewrites `gm` in place; returns (gm, number of gradient sums fused)."""
    fused = 0
    for root in list(gm.graph.nodes):
        if not _is_add(root) or any(_is_add(user) and _single_user(root) for user in root.users):
            continue  # not the root of an add tree
        terms = _leaves(root)
        if len(terms) < 2:
            continue
        chains = [_view_chain(term) for term in terms]
        if any(chain is None for chain in chains):
            continue
        signatures = {tuple((n.target, tuple(n.args[1:])) for n in chain[1]) for chain in chains}
        if len(signatures) != 1:
            continue
        mms = [chain[0] for chain in chains]
        if not _worth_it(mms):
            continue
        _rewrite(gm, root, mms, chains[0][1])
        fused += 1
    if fused:
        gm.graph.eliminate_dead_code()
        gm.graph.lint()
        gm.recompile()
    log.debug("fused %d weight-gradient sums", fused)
    return gm, fused


def _is_add(node: torch.fx.Node) -> bool:
    return (
        node.op == "call_function"
        and node.target is _aten.add.Tensor
        and len(node.args) == 2
        and not node.kwargs
        and all(isinstance(a, torch.fx.Node) for a in node.args)
    )


def _single_user(node: torch.fx.Node) -> bool:
    return len(node.users) == 1


def _leaves(root: torch.fx.Node) -> list[torch.fx.Node]:
    """The terms of an add tree whose inner adds are used only inside it."""
    leaves, stack = [], [root]
    while stack:
        node = stack.pop()
        for arg in node.args:
            if _is_add(arg) and _single_user(arg):
                stack.append(arg)
            else:
                leaves.append(arg)
    return leaves


_VIEWS = frozenset({_aten.t.default, _aten.permute.default, _aten.view.default, _aten._unsafe_view.default})


def _view_chain(term: torch.fx.Node):
    """(mm node, views from the mm up to the term) if the term is a view chain of an
    mm used only along that chain, else None."""
    chain = []
    node = term
    while node.op == "call_function" and node.target in _VIEWS:
        if not _single_user(node):
            return None
        chain.append(node)
        node = node.args[0]
    if node.op != "call_function" or node.target is not _aten.mm.default or not _single_user(node):
        return None
    return node, list(reversed(chain))


def _worth_it(mms: list[torch.fx.Node]) -> bool:
    """Copies of the operands (cat) against the weight-sized writes and adds removed."""
    rows, cols = mms[0].meta["val"].shape
    for mm in mms:
        if tuple(mm.meta["val"].shape) != (rows, cols):
            return False
    # Hints, not int(): int() of a symbolic size would specialize the graph to it.
    tokens = sum(optimization_hint(mm.args[0].meta["val"].shape[1]) for mm in mms)
    rows, cols = optimization_hint(rows), optimization_hint(cols)
    copied = tokens * (rows + cols)
    removed = (len(mms) - 1) * 2 * rows * cols
    return copied < removed


def _rewrite(gm, root, mms, views) -> None:
    graph = gm.graph
    meta = get_slc_meta(mms[-1])
    tag = SlcMeta(region=meta.region, block=meta.block, role="combine") if meta is not None else None
    with graph.inserting_before(root):
        left = graph.call_function(_aten.cat.default, ([m.args[0] for m in mms], 1))
        right = graph.call_function(_aten.cat.default, ([m.args[1] for m in mms], 0))
        value = graph.call_function(_aten.mm.default, (left, right))
        for view in views:
            value = graph.call_function(view.target, (value, *view.args[1:]), dict(view.kwargs))
    for node in (left, right, value):
        if tag is not None:
            set_slc_meta(node, tag)
    _set_vals(left, right, mms, views, value)
    root.replace_all_uses_with(value)


def _set_vals(left, right, mms, views, value) -> None:
    """meta["val"] for the new nodes, from the old ones (shapes only change along
    the concatenated dimension)."""
    with _fake_mode(mms[0]):
        left.meta["val"] = torch.cat([m.args[0].meta["val"] for m in mms], 1)
        right.meta["val"] = torch.cat([m.args[1].meta["val"] for m in mms], 0)
        current = torch.mm(left.meta["val"], right.meta["val"])
        node = value
        chain = []
        while node is not left and node.op == "call_function" and node.target is not _aten.mm.default:
            chain.append(node)
            node = node.args[0]
        node.meta["val"] = current
        for view in reversed(chain):
            # A symbolic size in a view's arguments is a node: compute with its value.
            args, kwargs = torch.fx.node.map_arg((view.args[1:], view.kwargs), lambda arg: arg.meta["val"])
            current = view.target(current, *args, **kwargs)
            view.meta["val"] = current


def _fake_mode(node):
    from torch._guards import detect_fake_mode

    mode = detect_fake_mode([node.meta["val"]])
    if mode is None:
        import contextlib

        return contextlib.nullcontext()
    return mode
