"""In-place writes under sub-batching: a write that would repeat once per sub-batch
(into an input, a parameter or a buffer) or put per-sample values into a value all
sub-batches share is a problem; a write of per-sample values into a fresh tensor the
graph made at the batch size makes that tensor (and the views written through) per
sub-batch; a fresh tensor of sizes written once from all samples and read by nothing
else is fine after the blocks, computed once from the sub-batches concatenated.
Functions of the walk's `PropagationState`, called by `propagate` before the other
rules; a fresh tensor written per sample has its split, and its views', remade."""

from __future__ import annotations

import operator
from types import MappingProxyType

import torch
import torch.fx
from torch.multiprocessing.reductions import StorageWeakRef

from slcompile.analysis.batch_propagation.cross_sample import getitem_touches_batch
from slcompile.analysis.batch_propagation.nodes import describe, named_args, target_name
from slcompile.analysis.batch_propagation.plan import BATCHED_INT, NodeSplit
from slcompile.analysis.batch_propagation.state import PropagationState
from slcompile.analysis.batch_propagation.subbatch import narrowing, per_subbatch

__all__ = ["written_once_whole", "mutation_problem"]

_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem})
# Ops that make a tensor of one value from sizes: where the sizes start in their args.
_SIZE_ARG = MappingProxyType({"new_zeros": 1, "new_ones": 1, "new_empty": 1, "new_full": 1,
                              torch.zeros: 0, torch.ones: 0, torch.empty: 0, torch.full: 0})
# Views a write into a fresh tensor may go through.
_VIEWS = frozenset({"narrow", "select", "unsqueeze", "squeeze", "view", "transpose", "permute", "movedim", "swapaxes"})
# In-place writes that keep samples apart when the batch dimension is left whole.
_PER_SAMPLE_WRITES = frozenset({
    "setitem", "index_put_", "copy_", "fill_", "masked_fill_", "add_", "sub_", "mul_", "div_", "iadd", "isub", "imul",
    "itruediv",
})


def _is_inplace(node: torch.fx.Node, full_args) -> bool:
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        if "inplace" in node.kwargs:
            return bool(node.kwargs["inplace"])
        named = named_args(node, full_args, {}) if node.args else None
        return bool((named or {}).get("inplace", False))
    return False


def written_once_whole(state: PropagationState, node) -> bool:
    """A write in place into a fresh tensor the graph made from sizes, shared, that
    nothing else reads (`torch.zeros(experts).scatter_add_(0, index, src)`, a
    mixture of experts' load-balancing loss counting tokens per expert). Computed
    once from all sub-batches concatenated (`combine="concat"`), as after the
    blocks, the write is the one eager makes."""
    target = node.args[0] if node.args else None
    return (
        isinstance(target, torch.fx.Node)
        and target.op == "call_function"
        and _SIZE_ARG.get(target.target) is not None
        and not state.batched(target.name)
        and list(target.users) == [node]
    )


def mutation_problem(state: PropagationState, node, full_args, batched_inputs) -> str | None:
    """In-place writes that sub-batching would repeat or reorder."""
    if not _is_inplace(node, full_args) or not full_args or not isinstance(full_args[0], torch.Tensor):
        return None
    owner = state.input_storages.get(StorageWeakRef(full_args[0].untyped_storage()))
    if owner is not None:
        kind = state.inputs[owner].kind
        what = {"param": "parameter", "buffer": "buffer"}.get(kind, "input")
        return f"{describe(node)} writes in place to {what} {owner}; split into sub-batches it would be written once per sub-batch"
    target = node.args[0]
    if batched_inputs and isinstance(target, torch.fx.Node) and not state.batched(target.name):
        if _made_per_sample(state, node, target):
            return None
        return f"{describe(node)} writes per-sample values in place into {target.name}, a value shared by all sub-batches"
    if node.target is operator.setitem and isinstance(target, torch.fx.Node) and state.batched(target.name):
        # Literal indices (`t[0] = ...`); tensor indices are for the routing rules.
        bdim, index = state.splits[target.name].out_bdims, node.args[1]
        literal = not any(isinstance(i, torch.fx.Node) for i in (index if isinstance(index, tuple) else (index,)))
        if isinstance(bdim, int) and literal and getitem_touches_batch(node, index, full_args[0], bdim):
            return (
                f"{describe(node)} writes in place into some samples of {target.name} "
                "(it indexes the batch dimension)"
            )
    return None


def _made_per_sample(state: PropagationState, node, target) -> bool:
    """A write of per-sample values into a fresh tensor the graph made at full batch
    size (`x.new_zeros(x.shape)`, then `t[..., 1:] = x[..., :-1]`), or into a view
    of one (`k = kv.new_empty(...)`, then `k[..., :d].copy_(k_nope)`), that leaves
    its batch dimension whole: the tensor (and its views) become per-sample, made
    at sub-batch size. Needs no earlier reader of the tensor but the views written
    through, and a creation op whose size along the batch is a literal or the
    dynamic batch size."""
    chain = _fresh_views(state, target)
    dim = dict(narrowing(state, node)).get(target.name)
    if chain is None or dim is None:
        return False
    members = {n.name for n in chain}
    for member in chain:
        if any(u is not node and u.name in state.splits and u.name not in members for u in member.users):
            return False
    name = target_name(node)
    if name not in _PER_SAMPLE_WRITES or (
        name == "setitem" and getitem_touches_batch(node, node.args[1], state.full[target.name], dim)
    ):
        return False
    if name == "index_put_" and len(node.args[1]) > dim and node.args[1][dim] is not None:
        return False
    root = chain[0]
    for root_dim in range(state.full[root.name].dim()):
        saved = {n.name: (state.splits[n.name], state.sub[n.name]) for n in chain}
        if _split_fresh(state, root, root_dim) and _split_views(state, chain[1:]):
            if state.splits[target.name].out_bdims == dim:
                return True
        for member, (split, sub) in saved.items():
            state.splits[member], state.sub[member] = split, sub
    return False


def _fresh_views(state: PropagationState, target) -> list | None:
    """[creation node, views of it..., target] when `target` is a shared tensor the
    graph made from sizes (or a view of one by slicing), else None."""
    chain = [target]
    while _SIZE_ARG.get(chain[0].target) is None:
        view = chain[0]
        source = view.args[0] if view.args else None
        if not isinstance(source, torch.fx.Node) or state.batched(source.name) or view.op not in (
            "call_function", "call_method"
        ):
            return None
        name = target_name(view)
        if name == "getitem":
            items = view.args[1] if isinstance(view.args[1], tuple) else (view.args[1],)
            if any(isinstance(i, torch.fx.Node) for i in items):
                return None
        elif name not in _VIEWS:
            return None
        chain.insert(0, source)
    return chain


def _split_fresh(state: PropagationState, target, dim) -> bool:
    """Makes the creation node `target` per-sample along `dim`."""
    position = _SIZE_ARG.get(target.target)
    if position is None or len(target.args) <= position:
        return False
    size, full = target.args[position], state.full[target.name].shape[dim]
    shape = isinstance(size, torch.fx.Node) and isinstance(state.splits[size.name].out_bdims, (tuple, list))
    packed = isinstance(size, (tuple, list))
    if shape:
        sizes = list(state.splits[size.name].out_bdims)
    else:
        sizes = list(size) if packed else list(target.args[position:])
    if len(sizes) <= dim:
        return False
    if shape or isinstance(sizes[dim], torch.fx.Node):  # a dynamic batch: per sub-batch already
        batched = sizes[dim] if shape else state.splits[sizes[dim].name].out_bdims
        if batched != BATCHED_INT or full != state.batch_size:
            return False
    elif not isinstance(sizes[dim], int) or sizes[dim] != full or full != state.batch_size or state.dynamic:
        return False
    else:
        sizes[dim] = full // state.num_subbatches
    rest = target.args[position + 1 :] if packed else ()
    args = target.args if shape else (*target.args[:position], *((tuple(sizes),) if packed else sizes), *rest)
    env_sub = lambda n: state.sub[n.name]  # noqa: E731
    sub_out = state.execute(
        target, torch.fx.node.map_arg(args, env_sub), torch.fx.node.map_arg(target.kwargs, env_sub)
    )
    state.sub[target.name] = sub_out
    state.splits[target.name] = NodeSplit("batched", out_bdims=dim, args=args, kwargs=target.kwargs)
    return True


def _split_views(state: PropagationState, views) -> bool:
    for view in views:
        split, _ = per_subbatch(state, view, state.full[view.name])
        if split is None:
            return False
        state.splits[view.name] = split
    return True
