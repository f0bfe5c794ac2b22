"""Reshapes under sub-batching: literal batch sizes in `view`, `reshape` and
`expand` arguments are rewritten for one sub-batch, and a merge of dimensions keeps
each sub-batch one contiguous chunk only when the batch is the outermost dimension
merged; anything else is refused."""

from __future__ import annotations

import math

import torch
import torch.fx

from slcompile.analysis.batch_propagation.nodes import describe, target_name
from slcompile.analysis.batch_propagation.state import PropagationState

__all__ = ["rewrite_shapes", "check_reshape"]

# Ops that merge or split dimensions: sub-batches stay contiguous chunks only when the
# batch is the outermost dimension of what is merged.
_RESHAPES = frozenset({"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"})


def rewrite_shapes(state: PropagationState, node):
    """Literal batch sizes in view/reshape/expand args, rewritten for one sub-batch."""
    name = target_name(node)
    if name not in ("view", "reshape", "expand") or node.op not in ("call_method", "call_function"):
        return node.args, node.kwargs
    source = node.args[0]
    if not isinstance(source, torch.fx.Node) or not state.batched(source.name):
        return node.args, node.kwargs
    in_bdim = state.splits[source.name].out_bdims
    full_in = state.full[source.name]
    full_out = state.full[node.name]
    if not isinstance(in_bdim, int) or not isinstance(full_out, torch.Tensor):
        return node.args, node.kwargs
    if len(node.args) == 2 and isinstance(node.args[1], (list, tuple)):
        sizes, packed = list(node.args[1]), True
    else:
        sizes, packed = list(node.args[1:]), False
    if len(sizes) != full_out.dim() or not all(isinstance(s, (int, torch.fx.Node)) for s in sizes):
        return node.args, node.kwargs
    if name == "expand":
        out_bdim = in_bdim + full_out.dim() - full_in.dim()
    else:
        out_bdim = _reshaped_batch_dim(full_in.shape, in_bdim, full_out.shape, state.num_subbatches)
        if out_bdim is None:
            return node.args, node.kwargs
    target = list(full_out.shape)
    target[out_bdim] //= state.num_subbatches
    new_sizes = [
        target[i] if isinstance(s, int) and s != -1 and s != target[i] else s
        for i, s in enumerate(sizes)
    ]
    rest = (tuple(new_sizes),) if packed else tuple(new_sizes)
    return (node.args[0], *rest), node.kwargs


def check_reshape(state: PropagationState, node, full_out, out_bdims) -> str | None:
    """Merging dims keeps sub-batches contiguous only if the batch is outermost."""
    if target_name(node) not in _RESHAPES:
        return None
    source = node.args[0]
    in_bdim = state.splits[source.name].out_bdims
    if not isinstance(in_bdim, int) or not isinstance(out_bdims, int):
        return None
    before_in = math.prod(state.full[source.name].shape[:in_bdim])
    before_out = math.prod(full_out.shape[:out_bdims])
    if before_in != before_out:
        return f"{describe(node)} merges the batch dimension with an outer dimension"
    return None


def _reshaped_batch_dim(in_shape, in_bdim, out_shape, k) -> int | None:
    """Where the batch lands after a row-major reshape, if sub-batches stay contiguous."""
    before = math.prod(in_shape[:in_bdim])
    for j in range(len(out_shape)):
        if math.prod(out_shape[:j]) == before and out_shape[j] % k == 0 and out_shape[j] >= k:
            if out_shape[j] * math.prod(out_shape[j + 1 :]) == math.prod(in_shape[in_bdim:]):
                return j
    return None
