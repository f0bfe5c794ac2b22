"""A node run on one sub-batch: its inputs' sub-batch values (shared values a batched
node reads along the batch narrowed to the sub-batch's slice, sample indices
rebased), its literal batch sizes rewritten (`reshape`), and its result compared with
the full batch's to find where the batch dimension went. Functions of the walk's
`PropagationState`, called by `propagate` and by `writes` (for the views of a fresh
tensor written per sample)."""

from __future__ import annotations

import torch
import torch.fx
from torch.utils import _pytree as pytree

from slcompile.analysis.batch_propagation.nodes import describe
from slcompile.analysis.batch_propagation.plan import BATCHED_INT, NodeSplit
from slcompile.analysis.batch_propagation.reshape import check_reshape, rewrite_shapes
from slcompile.analysis.batch_propagation.state import PropagationState

__all__ = ["per_subbatch", "narrowing"]


def per_subbatch(state: PropagationState, node, full_out, counts=False, narrows=True):
    """Runs the node on one sub-batch; returns (NodeSplit, None) or (None, reason).
    With `counts`, its tensors keep their full shape (counts over the sub-batch).
    Without `narrows`, shared inputs are read whole (routed rows are no slice of
    anything shared)."""
    args, kwargs = rewrite_shapes(state, node)
    narrow = narrowing(state, node) if narrows else ()
    checked, rebase = (), ()
    if node.name in state.gathers:
        # Index tensors line up by broadcasting, not with the source: the gather
        # rule placed them (`sample_index.sample_gather`).
        checked, rebase, _ = state.gathers[node.name]
        narrow = checked
    narrow_dims = dict(narrow) | dict(rebase)

    def env_sub(n: torch.fx.Node):
        value = state.sub[n.name]
        if n.name in narrow_dims:
            dim = narrow_dims[n.name]
            value = value.narrow(dim, 0, value.shape[dim] // state.num_subbatches)
        return value

    sub_args = torch.fx.node.map_arg(args, env_sub)
    sub_kwargs = torch.fx.node.map_arg(kwargs, env_sub)
    try:
        sub_out = state.execute(node, sub_args, sub_kwargs)
    except Exception as exc:  # the op's own error, at sub-batch size
        return None, (
            f"{describe(node)} fails on one sub-batch ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0] if str(exc) else ''})"
        )
    out_bdims, reason = _compare(state, node, full_out, sub_out, counts)
    if reason is not None:
        return None, reason
    reason = _check_alignment(state, node, () if checked else narrow, full_out, out_bdims)
    if reason is None:
        reason = check_reshape(state, node, full_out, out_bdims)
    if reason is not None:
        return None, reason
    state.sub[node.name] = sub_out
    return NodeSplit(
        "batched", out_bdims=out_bdims, args=args, kwargs=kwargs, narrow=narrow, rebase=rebase
    ), None


def narrowing(state: PropagationState, node) -> tuple[tuple[str, int], ...]:
    """Shared tensors a batched node reads along the batch (broadcast-aligned)."""
    batched = list(state.input_bdims(node))
    result = []
    for n in node.all_input_nodes:
        split = state.splits[n.name]
        info = state.inputs.get(n.name)
        if split.kind != "shared" or (info is not None and info.kind in ("param", "buffer")):
            continue
        value = state.full[n.name]
        if not isinstance(value, torch.Tensor) or value.dim() == 0:
            continue
        for _, full_x, bdim in batched:
            aligned = bdim - (full_x.dim() - value.dim())
            size = full_x.shape[bdim]
            if 0 <= aligned < value.dim() and value.shape[aligned] == size and size != 1:
                result.append((n.name, aligned))
                break
    return tuple(result)


def _compare(state: PropagationState, node, full_out, sub_out, counts=False):
    full_leaves, full_spec = pytree.tree_flatten(full_out)
    sub_leaves, sub_spec = pytree.tree_flatten(sub_out)
    if full_spec != sub_spec:
        return None, f"{describe(node)} returns a different structure for one sub-batch"
    k = state.num_subbatches
    bdims = []
    for full, sub in zip(full_leaves, sub_leaves):
        if isinstance(full, torch.Tensor):
            if not isinstance(sub, torch.Tensor) or full.dim() != sub.dim():
                return None, f"{describe(node)} changes rank on one sub-batch"
            differ = [d for d in range(full.dim()) if full.shape[d] != sub.shape[d]]
            if counts and not differ:
                bdims.append(None)
                continue
            if not differ:
                return None, (
                    f"{describe(node)} reduces over the batch dimension "
                    f"(its output {tuple(full.shape)} does not depend on the batch)"
                )
            if len(differ) > 1 or full.shape[differ[0]] != k * sub.shape[differ[0]]:
                return None, (
                    f"{describe(node)} has output {tuple(full.shape)} for the batch but "
                    f"{tuple(sub.shape)} for one sub-batch; its batch dimension is unclear"
                )
            bdims.append(differ[0])
        elif isinstance(full, (int, torch.SymInt)) and not isinstance(full, bool):
            if full == sub:
                bdims.append(None)
            elif full == k * sub:
                bdims.append(BATCHED_INT)
            else:
                return None, f"{describe(node)} computes a size that does not scale with the batch"
        else:
            if full != sub:
                return None, f"{describe(node)} returns a value that depends on the batch"
            bdims.append(None)
    return pytree.tree_unflatten(bdims, full_spec), None


def _check_alignment(state: PropagationState, node, narrow, full_out, out_bdims) -> str | None:
    """A narrowed shared input must line up with the output's batch dimension."""
    if not narrow:
        return None
    out_bdim = out_bdims if isinstance(out_bdims, int) else None
    if out_bdim is None or not isinstance(full_out, torch.Tensor):
        return f"{describe(node)} reads a full-batch shared value along the batch in a way that cannot be sliced"
    for name, dim in narrow:
        value = state.full[name]
        if dim - (value.dim() - full_out.dim()) != out_bdim:
            return (
                f"{describe(node)} reads {name} of shape {tuple(value.shape)} with a "
                f"dimension equal to the batch size that does not line up with the batch"
            )
    return None
