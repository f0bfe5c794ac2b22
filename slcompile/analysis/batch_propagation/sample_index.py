"""Sample indices: an `arange` over the batch, and the shape-only ops of it checked
on real values, is a shared value that holds each sample's index. A gather that
indexes the batch dimension with one (`mask[batch_arange[:, None, None, None],
kv_idx]`, Hugging Face's padding masks) keeps each sample's rows its own: each
sub-batch reads its slice of the index less its first sample's (`rebase`). With a
dynamic batch, values made from the batch size symbol are computed once, shared.
Functions of the walk's `PropagationState`, called by `propagate` (and
`cross_sample`, for gathers); they keep its `sample_indices` and `gathers`."""

from __future__ import annotations

import torch
import torch.fx

from slcompile.analysis.batch_propagation.nodes import CREATION_METHODS, describe, run_real, target_name
from slcompile.analysis.batch_propagation.state import PropagationState

__all__ = ["NOT_A_GATHER", "shared_at_batch_size", "track_sample_index", "counts_from_batch_size", "sample_gather"]

# What `sample_gather` returns for an op that no sample index indexes.
NOT_A_GATHER = object()
# Ops that can keep a sample index a sample index (checked on real values).
_INDEX_PRESERVING = frozenset({"getitem", "unsqueeze", "view", "reshape", "expand", "to", "contiguous", "clone",
                               "detach", "long", "int", "squeeze", "add", "sub", "permute", "transpose"})
# Largest sample index (elements) checked on real values.
_REAL_CHECK_LIMIT = 1 << 22


def shared_at_batch_size(state: PropagationState, node, batched_inputs) -> bool:
    """With a dynamic batch, shared values made at the batch size read the batch
    size symbol: `arange(batch)`, and a shared mask expanded to it
    (`mask.expand(batch, -1, q, kv)`). They are computed once, shared, from the full
    batch size (the symbol itself, not a sub-batch's), and sliced where per-sample
    values read them."""
    if not all(n.name in state.batch_symbols and n.op == "placeholder" for n in batched_inputs):
        return False
    if node.op == "call_method" and node.target in CREATION_METHODS:
        return False
    if node.target is torch.arange:
        return _sample_index_axis(state, node) == 0
    return any(
        isinstance(value := state.full[n.name], torch.Tensor) and state.batch_size in value.shape
        for n in node.all_input_nodes if not state.batched(n.name)
    )


def track_sample_index(state: PropagationState, node) -> None:
    """Records a shared node that holds each sample's index (`torch.arange(batch)`,
    and shape-only ops of it such as `[:, None, None, None]` or `expand`).

    Such a value is shared like any other: its uses as values read slices of it.
    Only a gather that indexes the batch dimension with it (`sample_gather`)
    reads it as a sample's own index."""
    axis = _sample_index_axis(state, node)
    if axis is not None:
        state.sample_indices[node.name] = axis


def _sample_index_axis(state: PropagationState, node) -> int | None:
    name = target_name(node)
    sources = [n for n in node.all_input_nodes if isinstance(state.full[n.name], torch.Tensor)]
    if name == "arange" and not sources:
        symbols = [n.name in state.batch_symbols for n in node.all_input_nodes]
        if (not any(symbols)) if state.dynamic else bool(symbols):
            # Dynamic: a literal equal to the example batch is not the batch.
            # Static: a symbol (a dynamic length) is not the batch either.
            return None
    elif name not in _INDEX_PRESERVING or len(sources) != 1 or sources[0].name not in state.sample_indices:
        return None
    out = state.full[node.name]
    if not isinstance(out, torch.Tensor) or out.dtype.is_floating_point or out.is_complex():
        return None
    if state.batch_size not in out.shape or out.numel() > _REAL_CHECK_LIMIT:
        return None  # a materialized copy too large to check: an ordinary value
    replace = {n.name: _real_sample_index(state, n.name) for n in sources}
    real = run_real(node, state.full, replace)
    return None if real is None else _sample_axis(real, state.batch_size)


def _real_sample_index(state: PropagationState, name: str) -> torch.Tensor:
    value = state.full[name]
    return _iota(state.batch_size, state.sample_indices[name], value.dim()).expand(value.shape).to(value.dtype)


def counts_from_batch_size(state: PropagationState, node, batched_inputs) -> str | None:
    """`arange` of a size that scales with the batch would count from 0 in every
    sub-batch: not a slice of the full batch's values."""
    if node.target is torch.arange and batched_inputs:
        return (
            f"{describe(node)} counts up to a size that scales with the batch; each sub-batch "
            "would count from 0"
        )
    return None


def sample_gather(state: PropagationState, node):
    """`x[sample_index, ...]` (how Hugging Face masks take each sample's padding
    row: `mask[batch_arange[:, None, None, None], kv_arange]`): the dimension of
    `x` of the batch is indexed by the index of each sample. Each sub-batch then
    gathers its own rows with its slice of the index, less its first sample's
    (`rebase`); a shared `x` is narrowed to the sub-batch's rows. The other index
    tensors must broadcast along the samples (size 1 there) or be per sample with
    their batch on the same broadcast dimension. Returns `NOT_A_GATHER` when no
    sample index indexes `x`, None when accepted (recorded in `gathers`), else the
    reason for refusing."""
    source, index = node.args[0], node.args[1]
    items = index if isinstance(index, tuple) else (index,)
    if not isinstance(source, torch.fx.Node) or not any(
        isinstance(i, torch.fx.Node) and i.name in state.sample_indices for i in items
    ):
        return NOT_A_GATHER
    x = state.full[source.name]
    what = f"{describe(node)} gathers along the batch dimension"
    dims = _index_dims(items, state.full, x.dim())
    if dims is None:
        return f"{what} with a boolean mask"
    split = state.splits[source.name]
    narrow = ()
    if split.kind == "batched":
        bdim = split.out_bdims
        samples = [pos for pos, d in enumerate(dims) if d == bdim]
        if not isinstance(bdim, int) or not samples or not _is_node_in(items[samples[0]], state.sample_indices):
            return NOT_A_GATHER
        position = samples[0]
    else:
        info = state.inputs.get(source.name)
        candidates = [
            pos for pos, (item, d) in enumerate(zip(items, dims))
            if _is_node_in(item, state.sample_indices) and d is not None and x.shape[d] == state.batch_size
        ]
        if not candidates or (info is not None and info.kind in ("param", "buffer")):
            return NOT_A_GATHER
        position, bdim = candidates[0], dims[candidates[0]]
        narrow = ((source.name, bdim),)
    sample = items[position]
    tensors = [(pos, item) for pos, item in enumerate(items)
               if isinstance(item, torch.fx.Node) and isinstance(state.full[item.name], torch.Tensor)]
    width = max(state.full[item.name].dim() for _, item in tensors)
    # The samples' dimension among the broadcast index dimensions.
    along = state.sample_indices[sample.name] + width - state.full[sample.name].dim()
    replace = {sample.name: _real_sample_index(state, sample.name)}
    for pos, item in tensors:
        if pos == position:
            continue
        value = state.full[item.name]
        at = along - (width - value.dim())
        item_split = state.splits[item.name]
        if item_split.kind == "batched":
            if item_split.out_bdims != at:
                return f"{what} with per-sample indices {item.name} not lined up with the samples"
        elif 0 <= at < value.dim() and value.shape[at] != 1:
            return f"{what} with indices {item.name} shared by all samples that vary along the samples"
        replace[item.name] = torch.zeros(value.shape, dtype=torch.long)
    # Which output dimension holds the samples: gather the sample ids themselves.
    shape = [
        state.batch_size if d == bdim else (1 if d not in dims or _is_full_slice(items[dims.index(d)]) else x.shape[d])
        for d in range(x.dim())
    ]
    replace[source.name] = _iota(state.batch_size, bdim, x.dim()).expand(shape)
    real = run_real(node, state.full, replace)
    axis = None if real is None else _sample_axis(real, state.batch_size)
    if axis is None:
        return f"{what} in a way that does not keep each sample's rows its own"
    state.gathers[node.name] = (narrow, ((sample.name, state.sample_indices[sample.name]),), axis)
    return None


def _is_node_in(item, names) -> bool:
    return isinstance(item, torch.fx.Node) and item.name in names


def _is_full_slice(item) -> bool:
    return isinstance(item, slice) and item == slice(None, None, None)


def _iota(size: int, axis: int, ndim: int) -> torch.Tensor:
    """arange(size) along `axis` of an `ndim`-dimensional tensor, 1 elsewhere."""
    return torch.arange(size).view([size if d == axis else 1 for d in range(ndim)])


def _sample_axis(value: torch.Tensor, batch_size: int) -> int | None:
    """The one axis along which `value` is 0, 1, ..., batch_size - 1 (constant along
    every other axis), or None."""
    if value.dtype == torch.bool or value.is_floating_point() or value.is_complex():
        return None
    for d in range(value.dim()):
        if value.stride(d) == 0:  # broadcast: the same values along d
            value = value.narrow(d, 0, min(1, value.shape[d]))
    axes = [
        d for d in range(value.dim())
        if value.shape[d] == batch_size and torch.equal(value, _iota(batch_size, d, value.dim()).expand(value.shape))
    ]
    return axes[0] if len(axes) == 1 else None


def _index_dims(items, full, ndim) -> list | None:
    """For each index item, the dimension of the indexed tensor it indexes (None for
    `None`, Ellipsis); None if a boolean mask is among them."""
    dims, dim = [], 0
    for pos, item in enumerate(items):
        value = full.get(item.name) if isinstance(item, torch.fx.Node) else item
        if isinstance(value, torch.Tensor) and value.dtype == torch.bool:
            return None
        if item is Ellipsis:
            dim = ndim - sum(1 for it in items[pos + 1:] if it is not None)
            dims.append(None)
        elif item is None:
            dims.append(None)
        else:
            dims.append(dim)
            dim += 1
    return dims
