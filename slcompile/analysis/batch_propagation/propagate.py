"""The walk behind `propagate_batch`: it goes through the graph in order, runs every
node on fake tensors at the full batch and at one sub-batch, and decides the node's
`NodeSplit` from its inputs' splits and the two results.

Every call node goes through `_call`: in-place writes first (`writes`), then shared
values, creation methods, routed tokens (`routing`), arange over the batch
(`sample_index`), ops that mix samples (`cross_sample`), and the node run on one
sub-batch (`subbatch`), its literal batch sizes rewritten (`reshape`). Whatever mixes
samples is combined from the sub-batches after the blocks (`cross_sample`) or is a
problem. What the walk knows is one `PropagationState` (`state`), handed to each of
those modules' functions.

Where it sits: the `propagate_batch` pass, after `find_blocks` and `find_batch_dim`.
Needs: the placeholders classified, the batch's inputs, symbols and size, and the
regions (prefix, block, suffix) of every node.
Guarantees: the graph is unchanged; every node but the output has a `NodeSplit`;
what the rules cannot explain is a problem, never a guess."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
import torch.fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from slcompile.analysis.batch_propagation.cross_sample import combine_kind, mixes_samples
from slcompile.analysis.batch_propagation.nodes import CREATION_METHODS, describe
from slcompile.analysis.batch_propagation.plan import BATCHED_INT, BatchPlan, NodeSplit
from slcompile.analysis.batch_propagation.reshape import rewrite_shapes
from slcompile.analysis.batch_propagation.routing import TOKENS, is_counts, route_mismatch, routing
from slcompile.analysis.batch_propagation.sample_index import (
    counts_from_batch_size,
    shared_at_batch_size,
    track_sample_index,
)
from slcompile.analysis.batch_propagation.state import PropagationState
from slcompile.analysis.batch_propagation.subbatch import per_subbatch
from slcompile.analysis.batch_propagation.writes import mutation_problem, written_once_whole
from slcompile.analysis.inputs import GraphInput
from slcompile.errors import RefusedError

__all__ = ["propagate_batch", "PROPAGATE_BATCH_CODE"]


def propagate_batch(
    gm: torch.fx.GraphModule,
    inputs: Sequence[GraphInput],
    batched_inputs: Mapping[str, int],
    batch_symbols: Sequence[str],
    batch_size: int,
    num_subbatches: int,
    regions: Mapping[str, str],
) -> BatchPlan:
    """Decides, node by node, how the graph runs over sub-batches.

    Args:
        gm: the Dynamo graph.
        inputs: its placeholders, classified.
        batched_inputs: placeholder name -> batch dimension, for per-sample inputs.
        batch_symbols: placeholder names of SymInts equal to the batch size.
        batch_size: the full batch size (concrete).
        num_subbatches: K.
        regions: node name -> "prefix", "block" or "suffix".

    Returns:
        the BatchPlan.
    """
    state = PropagationState(gm, inputs, batched_inputs, batch_symbols, batch_size, num_subbatches, regions)
    grad_enabled = torch.is_grad_enabled()
    try:
        for node in gm.graph.nodes:
            if node.op == "placeholder":
                _placeholder(state, node)
            elif node.op == "output":
                output_bdims = _output(state, node)
            else:
                _call(state, node)
    finally:
        torch.set_grad_enabled(grad_enabled)
    return BatchPlan(
        num_subbatches=state.num_subbatches,
        batch_size=state.batch_size,
        nodes=state.splits,
        problems=tuple(state.problems),
        output_bdims=output_bdims,
    )


# Step 1: values of the placeholders at full and sub-batch size.
def _placeholder(state: PropagationState, node: torch.fx.Node) -> None:
    info = state.inputs[node.name]
    value = info.value
    if isinstance(value, torch.SymInt):
        value = int(value.node.hint)
    if _is_scalar_input(info):
        # A Python number Dynamo lifted into a tensor (`dynamic=True`: LayerNorm's
        # eps, embedding's norm_type); the graph reads it with `.item()`.
        value = value.detach().clone()
        state.input_storages[StorageWeakRef(value.untyped_storage())] = node.name
    elif isinstance(value, torch.Tensor):
        value = _concrete_fake(state, value)
        state.input_storages[StorageWeakRef(value.untyped_storage())] = node.name
    state.full[node.name] = value
    if node.name in state.batched_inputs:
        bdim = state.batched_inputs[node.name]
        with state.fake_mode:
            state.sub[node.name] = value.narrow(bdim, 0, value.shape[bdim] // state.num_subbatches)
        state.splits[node.name] = NodeSplit("batched", out_bdims=bdim)
    elif node.name in state.batch_symbols:
        state.sub[node.name] = value // state.num_subbatches
        state.splits[node.name] = NodeSplit("batched", out_bdims=BATCHED_INT)
    else:
        state.sub[node.name] = value
        state.splits[node.name] = NodeSplit("shared")


def _concrete_fake(state: PropagationState, tensor: torch.Tensor) -> torch.Tensor:
    def hint(v):
        return int(v.node.hint) if isinstance(v, torch.SymInt) else int(v)

    shape = [hint(s) for s in tensor.shape]
    stride = [hint(s) for s in tensor.stride()]
    with state.fake_mode:
        fake = torch.empty_strided(shape, stride, dtype=tensor.dtype, device=tensor.device)
    if isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad:
        fake.requires_grad_(tensor.requires_grad)
    return fake


def _output(state: PropagationState, node: torch.fx.Node) -> tuple:
    bdims = []
    for leaf in pytree.tree_leaves(node.args[0]):
        if isinstance(leaf, torch.fx.Node) and leaf.name in state.routes:
            state.problems.append((leaf.name, f"{describe(leaf)} is an output in the order its sub-batch routed it", "mixes-samples"))
        if isinstance(leaf, torch.fx.Node):
            split = state.splits[leaf.name]
            bdims.append(split.out_bdims if split.kind == "batched" else None)
        else:
            bdims.append(None)
    return tuple(bdims)


# Step 2: every call node.
def _call(state: PropagationState, node: torch.fx.Node) -> None:
    if state.num_subbatches == 1:
        # One sub-batch is the whole batch: nothing is sliced, nothing can mix.
        batched = any(state.batched(n.name) for n in node.all_input_nodes)
        kind = "batched" if batched else "shared"
        state.splits[node.name] = NodeSplit(kind, args=node.args, kwargs=node.kwargs)
        return
    env_full = lambda n: state.full[n.name]  # noqa: E731
    full_args = torch.fx.node.map_arg(node.args, env_full)
    full_kwargs = torch.fx.node.map_arg(node.kwargs, env_full)
    try:
        full_out = state.execute(node, full_args, full_kwargs)
    except (DataDependentOutputException, DynamicOutputShapeException) as exc:
        raise RefusedError(
            f"cannot split the batch: {describe(node)} computes a result from the values of a tensor "
            f"({type(exc).__name__}: {exc}), which batch propagation cannot follow",
            "propagate_batch",
        ) from exc
    state.full[node.name] = full_out

    batched_inputs = [n for n in node.all_input_nodes if state.batched(n.name)]
    mutation = mutation_problem(state, node, full_args, batched_inputs)
    if mutation is not None and written_once_whole(state, node):
        # Decided below: computed from all sub-batches after the blocks, it is no problem.
        _split_node(state, node, full_args, full_kwargs, full_out, batched_inputs)
        split = state.splits[node.name]
        if split.kind != "combine" or split.combine != "concat" or state.regions.get(node.name) != "suffix":
            state.problems.append((node.name, mutation, "mutation"))
        return
    if mutation is not None:
        state.problems.append((node.name, mutation, "mutation"))
    _split_node(state, node, full_args, full_kwargs, full_out, batched_inputs)


def _split_node(state: PropagationState, node, full_args, full_kwargs, full_out, batched_inputs) -> None:
    """Decides the node's NodeSplit (or its problem) from its inputs' splits."""
    if not batched_inputs or shared_at_batch_size(state, node, batched_inputs):
        state.sub[node.name] = full_out
        state.splits[node.name] = NodeSplit("shared", args=node.args, kwargs=node.kwargs)
        track_sample_index(state, node)
        return
    if node.op == "call_method" and node.target in CREATION_METHODS:
        state.sub[node.name] = full_out
        state.splits[node.name] = NodeSplit(
            "shared", args=node.args, kwargs=node.kwargs, from_subbatch=True
        )
        return

    routed = routing(state, node, full_args, full_kwargs)
    if routed is not None:
        route, reason = routed
        split = None
        if reason is None:
            split, reason = per_subbatch(state, node, full_out, counts=is_counts(route), narrows=False)
        if split is not None:
            reason = route_mismatch(node, route, split.out_bdims, full_out)
        if reason is None:
            if route is not TOKENS:
                state.routes[node.name] = route
            state.splits[node.name] = split
            return
        if state.regions.get(node.name) == "suffix":
            # Concatenated back, routed values would be in the wrong order.
            state.problems.append((node.name, reason, "mixes-samples"))
    else:
        reason = counts_from_batch_size(state, node, batched_inputs)
        if reason is None:
            reason = mixes_samples(state, node, full_args, full_kwargs, full_out)
        split = None
        if reason is None:
            split, reason = per_subbatch(state, node, full_out)
        if split is not None and node.name in state.gathers and split.out_bdims != state.gathers[node.name][2]:
            split, reason = None, f"{describe(node)} gathers samples into an order that cannot be split"
        if split is not None:
            state.splits[node.name] = split
            return

    # Cross-sample: the value is computed from all sub-batches, full size.
    state.sub[node.name] = full_out
    state.splits[node.name] = NodeSplit(
        "combine",
        args=node.args,
        kwargs=node.kwargs,
        combine=combine_kind(state, node, full_kwargs=full_kwargs, full_args=full_args),
        reason=reason,
    )
    if state.regions.get(node.name) != "suffix":
        state.problems.append((node.name, reason, "mixes-samples"))


# The code `propagate_batch` runs, an object from each of its modules: the pass's
# `code`, whose modules the Inductor cache key hashes.
PROPAGATE_BATCH_CODE = (
    propagate_batch, NodeSplit, describe, PropagationState, per_subbatch, rewrite_shapes, written_once_whole,
    track_sample_index, routing, mixes_samples,
)


def _is_scalar_input(info: GraphInput) -> bool:
    value = info.value
    return (
        info.kind == "user" and isinstance(value, torch.Tensor) and value.dim() == 0
        and not isinstance(value, FakeTensor) and value.device.type == "cpu"
    )
