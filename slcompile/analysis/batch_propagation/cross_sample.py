"""Cross-sample ops: what the shapes alone cannot show mixes samples (an op along the
batch dimension, BatchNorm in training, an index into the batch dimension), and how
such an op after the last block is computed from all sub-batches (`combine`): sums
and means of sums and cross entropy exactly, anything else once on the sub-batches
concatenated back. Functions of the walk's `PropagationState`, called by
`propagate`, and by `routing` and `writes` for what they index."""

from __future__ import annotations

import torch
import torch.fx
import torch.nn.functional as F

from slcompile.analysis.batch_propagation.nodes import describe, named_args, target_name
from slcompile.analysis.batch_propagation.sample_index import NOT_A_GATHER, sample_gather
from slcompile.analysis.batch_propagation.state import PropagationState

__all__ = ["mixes_samples", "combine_kind", "getitem_touches_batch"]

# Ops whose `dim` may equal the batch dimension without mixing samples.
_DIM_SAFE = frozenset({"unsqueeze", "stack", "squeeze", "size", "movedim", "transpose", "swapaxes"})
_CROSS_ENTROPY = frozenset({F.cross_entropy, F.nll_loss})
_SUM = frozenset({torch.sum, "sum"})
_MEAN = frozenset({torch.mean, "mean"})


def mixes_samples(state: PropagationState, node, args, kwargs, full_out) -> str | None:
    """Reasons that the shapes alone cannot see: ops along the batch dimension."""
    name = target_name(node)
    bdims = list(state.input_bdims(node))
    if node.target in (F.batch_norm, torch.batch_norm) or name == "batch_norm":
        named = named_args(node, args, kwargs) or {}
        if named.get("training", False):
            return f"{describe(node)} is BatchNorm in training mode: its statistics span the whole batch"
    if not bdims:
        return None
    first_tensor = bdims[0]
    if name == "getitem":
        gather = sample_gather(state, node)
        if gather is not NOT_A_GATHER:
            return gather
    if name in ("getitem",) and isinstance(first_tensor[1], torch.Tensor) and node.args[0] is first_tensor[0]:
        return getitem_touches_batch(node, args[1], first_tensor[1], first_tensor[2])
    if name == "layer_norm":
        named = named_args(node, args, kwargs) or {}
        shape = named.get("normalized_shape", ())
        tensor, bdim = first_tensor[1], first_tensor[2]
        if bdim >= tensor.dim() - len(tuple(shape)):
            return f"{describe(node)} normalizes over the batch dimension"
        return None
    if name in _DIM_SAFE:
        return None
    named = named_args(node, args, kwargs)
    if named is None:
        return None
    if name == "repeat_interleave" and isinstance(named.get("repeats"), int):
        # Each row repeated in place (a token per expert it is routed to).
        return None
    dims = [named[key] for key in ("dim", "dims") if key in named and named[key] is not None]
    if not dims:
        return None
    flat_dims = [d for entry in dims for d in (entry if isinstance(entry, (list, tuple)) else [entry])]
    if name == "cat":
        # cat's dim indexes its first tensor; batched tensors share the batch dim.
        tensor, bdim = first_tensor[1], first_tensor[2]
    else:
        n0 = node.args[0] if node.args else None
        match = [b for b in bdims if b[0] is n0] or bdims
        tensor, bdim = match[0][1], match[0][2]
    for d in flat_dims:
        if isinstance(d, int) and tensor.dim() > 0 and d % tensor.dim() == bdim:
            return f"{describe(node)} works along the batch dimension (dim={d})"
    return None


def combine_kind(state: PropagationState, node, full_args, full_kwargs) -> str:
    """How a cross-sample op after the blocks is computed from the sub-batches."""
    named = named_args(node, full_args, full_kwargs) or {}
    if node.target in _CROSS_ENTROPY:
        if (
            named.get("weight") is None
            and named.get("reduction", "mean") in ("mean", "sum")
            and not named.get("label_smoothing", 0.0)
            and named.get("size_average") is None
            and named.get("reduce") is None
            and all(state.batched(n.name) for n in node.all_input_nodes)
        ):
            return "cross_entropy"
        return "concat"
    target = node.target
    if target in _SUM or target in _MEAN:
        extra = {k: v for k, v in named.items() if k not in ("input", "self") and v is not None}
        if not extra and len(node.args) == 1 and not node.kwargs:
            return "sum" if target in _SUM else "mean"
    return "concat"


def getitem_touches_batch(node, index, tensor, bdim) -> str | None:
    """x[...] keeps samples apart only if the batch dimension is indexed with `:`."""
    items = index if isinstance(index, tuple) else (index,)
    dim = 0
    for pos, item in enumerate(items):
        if item is Ellipsis:
            remaining = sum(1 for it in items[pos + 1 :] if it is not None)
            dim = tensor.dim() - remaining
            continue
        if item is None:
            continue
        if dim == bdim:
            if isinstance(item, slice) and item == slice(None, None, None):
                return None
            return f"{describe(node)} indexes the batch dimension"
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            dim += item.dim()
            if dim > bdim:
                return f"{describe(node)} indexes the batch dimension with a mask"
            continue
        dim += 1
    return None
