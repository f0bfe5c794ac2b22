"""Follow the batch dimension through a Dynamo graph: which values are per-sample.

Run after `find_blocks` and `find_batch_dim`. Never changes the graph.

Every node is run twice on fake tensors with concrete sizes: once at the full batch
and once at one sub-batch (batch / K). Comparing the two outputs tells where the batch
dimension went (`x.transpose(0, 1)` moves it, `x.sum()` removes it). A node is

- *shared*: none of its inputs depends on the batch (weights, masks, positions); it is
  computed once, at full size, and narrowed to a sub-batch where a per-sample value
  consumes it along the batch dimension (`narrow`).
- *batched*: it runs once per sub-batch, with literal batch sizes baked into
  `view`/`reshape`/`expand` arguments rewritten for the sub-batch (`args`).
- *cross-sample*: its result mixes samples (a reduction over the batch, an op along
  the batch dimension, BatchNorm in training). After the last block (the loss) it is
  computed from all sub-batches (`combine`): sums and means of sums decompose exactly,
  anything else runs once on the sub-batches concatenated back. Before or inside a
  block it is a problem that `check_splittable` turns into a refusal.

Inside a block, a mixture of experts flattens batch and sequence into one token
dimension (a row-major merge, so each sub-batch's tokens stay one contiguous chunk),
sorts the tokens by expert, gathers them, multiplies each expert's group and puts the
results back in token order. Those ops work along the batch dimension, yet each
token's result depends on that token alone: run per sub-batch, they route the
sub-batch's own tokens (`_routing`). The values in between are *routed*, the
sub-batch's own and not slices of the full batch's; they stay batched nodes, and
the rules say what each one holds (`_Route`) so that only ops whose meaning carries
over accept them, and none leaves its block in routed order.

Padding masks gather each sample's own row: Hugging Face builds the 4-D mask with
`mask[batch_arange[:, None, None, None], kv_idx]`, `batch_arange = arange(batch)`.
Such an `arange` over the batch (and its shape-only ops, checked on real values) is a
*sample index*: a shared value like any other, whose uses as a value read slices of
it. A gather that indexes the batch dimension with it keeps each sample's rows its
own; each sub-batch reads its slice of the index less its first sample's index
(`rebase`), so that it indexes its own rows. With a dynamic batch, `arange` of the
batch size symbol and shared masks expanded to it are computed once from the full
batch size; an `arange` of another size that scales with the batch is refused (each
sub-batch would count from 0).

A fresh tensor made at the batch size and written per sample, directly or through
views (`k = kv.new_empty(...)`, `k[..., :d].copy_(k_nope)`), is made per sub-batch.
A fresh tensor made from sizes that one in-place write reads all samples into and
nothing else reads (`torch.zeros(experts).scatter_add_(0, chosen, mask)`, Mixtral's
load-balancing loss counting tokens per expert) is fine after the blocks, where that
write runs once on the sub-batches concatenated back; in a block it mixes samples.

A value is never assumed to be per-sample from its shape alone: every rule below is
checked against the fake outputs, and anything the rules cannot explain is a problem,
not a guess.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator
import warnings
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
import torch.fx
import torch.nn.functional as F
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.fx.operator_schemas import normalize_function
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from slcompile.analysis.inputs import GraphInput
from slcompile.errors import RefusedError
from slcompile.meta import module_path

__all__ = ["NodeSplit", "BatchPlan", "propagate_batch", "BATCHED_INT", "is_barrier"]

log = logging.getLogger(__name__)

# Leaf marker in `NodeSplit.out_bdims` for an integer that scales with the batch
# (a dynamic batch size, or a size computed from it).
BATCHED_INT = "batched-int"

# Ops whose `dim` may equal the batch dimension without mixing samples.
_DIM_SAFE = {"unsqueeze", "stack", "squeeze", "size", "movedim", "transpose", "swapaxes"}
# Methods that use their tensor argument only for dtype and device.
_CREATION_METHODS = {"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"}
# Ops that merge or split dimensions: sub-batches stay contiguous chunks only when the
# batch is the outermost dimension of what is merged.
_RESHAPES = {"view", "reshape", "flatten", "unflatten", "view_as", "reshape_as"}
# Ops that change global state; they keep their place relative to everything else.
_BARRIER_TARGETS: set[object] = {
    torch._C._set_grad_enabled,
    torch.amp.autocast_mode._enter_autocast,
    torch.amp.autocast_mode._exit_autocast,
}
_CROSS_ENTROPY = {F.cross_entropy, F.nll_loss}
_SUM = {torch.sum, "sum"}
_MEAN = {torch.mean, "mean"}


def is_barrier(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _BARRIER_TARGETS


@dataclasses.dataclass(frozen=True)
class NodeSplit:
    """How one node is computed under sub-batching.

    Attributes:
        kind: "shared", "batched" or "combine" (a cross-sample op after the blocks,
            computed from all sub-batches).
        out_bdims: for batched nodes, a pytree shaped like the output with, per leaf,
            the batch dimension (int), None (batch-free; for a tensor, each
            sub-batch's own, such as its tokens counted per expert) or BATCHED_INT.
        args: per-sub-batch positional args (original nodes, literal batch sizes
            rewritten); for other kinds the original args.
        kwargs: as args.
        narrow: (input node name, dim) for shared inputs that a batched node consumes
            along the batch: each sub-batch reads its own slice.
        combine: for kind "combine": "sum", "mean", "cross_entropy" or "concat".
        reason: why the node mixes samples (kind "combine" or a problem).
        from_subbatch: a shared node that reads a batched input for its dtype and
            device only (`x.new_zeros(...)`): computed once from sub-batch 0.
        rebase: (input node name, dim) for shared sample indices (`arange` over the
            batch, see `_Propagator._track_sample_index`) that a batched node reads
            as the index of its samples: each sub-batch reads its own slice less the
            index of its first sample, so that it indexes its own rows.
    """

    kind: str
    out_bdims: Any = None
    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    narrow: tuple[tuple[str, int], ...] = ()
    combine: str | None = None
    reason: str | None = None
    from_subbatch: bool = False
    rebase: tuple[tuple[str, int], ...] = ()


@dataclasses.dataclass(frozen=True)
class BatchPlan:
    """The result of `propagate_batch`.

    Attributes:
        num_subbatches: K.
        batch_size: the full batch size of the example inputs.
        nodes: node name -> NodeSplit, for every node but the output.
        problems: (node name, reason, kind) for what sub-batching would change; kind
            is "mixes-samples" (a cross-sample op before the suffix) or "mutation"
            (an in-place write that would repeat per sub-batch).
        output_bdims: per output leaf, its batch dimension or None.
    """

    num_subbatches: int
    batch_size: int
    nodes: Mapping[str, NodeSplit]
    problems: tuple[tuple[str, str, str], ...]
    output_bdims: tuple


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
    return _Propagator(
        gm, inputs, batched_inputs, batch_symbols, batch_size, num_subbatches, regions
    ).run()


class _Propagator:
    def __init__(self, gm, inputs, batched_inputs, batch_symbols, batch_size, num_subbatches, regions):
        self.gm = gm
        self.inputs = {i.name: i for i in inputs}
        self.batched_inputs = dict(batched_inputs)
        self.batch_symbols = set(batch_symbols)
        self.batch_size = batch_size
        self.k = num_subbatches
        self.regions = regions
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.full: dict[str, Any] = {}
        self.sub: dict[str, Any] = {}
        self.splits: dict[str, NodeSplit] = {}
        self.problems: list[tuple[str, str]] = []
        self.input_storages: dict[Any, str] = {}
        # Values each sub-batch routes on its own (see `_Route`), by node name.
        self.routes: dict[str, Any] = {}
        # Shared tensors that hold each sample's index along one axis, by node name.
        self.sample_indices: dict[str, int] = {}
        # Gathers by sample index: node name -> (narrow, rebase, output batch dim).
        self.gathers: dict[str, tuple] = {}
        # With a dynamic batch, a literal size equal to the example batch is not the batch.
        self.dynamic = bool(self.batch_symbols) or any(
            _symbolic_dim(node, dim) for node in gm.graph.nodes
            if node.op == "placeholder" and (dim := self.batched_inputs.get(node.name)) is not None
        )

    # Step 1: values of the placeholders at full and sub-batch size.
    def _placeholder(self, node: torch.fx.Node) -> None:
        info = self.inputs[node.name]
        value = info.value
        if isinstance(value, torch.SymInt):
            value = int(value.node.hint)
        if _is_scalar_input(info):
            # A Python number Dynamo lifted into a tensor (`dynamic=True`: LayerNorm's
            # eps, embedding's norm_type); the graph reads it with `.item()`.
            value = value.detach().clone()
            self.input_storages[StorageWeakRef(value.untyped_storage())] = node.name
        elif isinstance(value, torch.Tensor):
            value = self._concrete_fake(value)
            self.input_storages[StorageWeakRef(value.untyped_storage())] = node.name
        self.full[node.name] = value
        if node.name in self.batched_inputs:
            bdim = self.batched_inputs[node.name]
            with self.fake_mode:
                self.sub[node.name] = value.narrow(bdim, 0, value.shape[bdim] // self.k)
            self.splits[node.name] = NodeSplit("batched", out_bdims=bdim)
        elif node.name in self.batch_symbols:
            self.sub[node.name] = value // self.k
            self.splits[node.name] = NodeSplit("batched", out_bdims=BATCHED_INT)
        else:
            self.sub[node.name] = value
            self.splits[node.name] = NodeSplit("shared")

    def _concrete_fake(self, tensor: torch.Tensor) -> torch.Tensor:
        def hint(v):
            return int(v.node.hint) if isinstance(v, torch.SymInt) else int(v)

        shape = [hint(s) for s in tensor.shape]
        stride = [hint(s) for s in tensor.stride()]
        with self.fake_mode:
            fake = torch.empty_strided(shape, stride, dtype=tensor.dtype, device=tensor.device)
        if isinstance(tensor, torch.nn.Parameter) or tensor.requires_grad:
            fake.requires_grad_(tensor.requires_grad)
        return fake

    def run(self) -> BatchPlan:
        grad_enabled = torch.is_grad_enabled()
        try:
            for node in self.gm.graph.nodes:
                if node.op == "placeholder":
                    self._placeholder(node)
                elif node.op == "output":
                    output_bdims = self._output(node)
                else:
                    self._call(node)
        finally:
            torch.set_grad_enabled(grad_enabled)
        return BatchPlan(
            num_subbatches=self.k,
            batch_size=self.batch_size,
            nodes=self.splits,
            problems=tuple(self.problems),
            output_bdims=output_bdims,
        )

    def _output(self, node: torch.fx.Node) -> tuple:
        bdims = []
        for leaf in pytree.tree_leaves(node.args[0]):
            if isinstance(leaf, torch.fx.Node) and leaf.name in self.routes:
                self.problems.append((leaf.name, f"{_describe(leaf)} is an output in the order its sub-batch routed it", "mixes-samples"))
            if isinstance(leaf, torch.fx.Node):
                split = self.splits[leaf.name]
                bdims.append(split.out_bdims if split.kind == "batched" else None)
            else:
                bdims.append(None)
        return tuple(bdims)

    def _batched(self, name: str) -> bool:
        return self.splits[name].kind == "batched"

    def _execute(self, node: torch.fx.Node, args, kwargs):
        leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if leaves and all(_is_small_real(leaf) for leaf in leaves):
            # Lifted scalars (and values computed from them): their real values, which
            # `.item()` needs; anything the real values cannot run on runs on fakes.
            try:
                return _run_real(node, {}, {}, args, kwargs, strict=True)
            except Exception:  # noqa: BLE001
                pass
        with self.fake_mode:
            if node.op == "call_function":
                return node.target(*args, **kwargs)
            if node.op == "call_method":
                self_obj, *rest = args
                return getattr(self_obj, node.target)(*rest, **kwargs)
            if node.op == "call_module":
                return self.gm.get_submodule(node.target)(*args, **kwargs)
            if node.op == "get_attr":
                obj = self.gm
                for part in node.target.split("."):
                    obj = getattr(obj, part)
                return obj
        raise NotImplementedError(node.op)

    # Step 2: every call node.
    def _call(self, node: torch.fx.Node) -> None:
        if self.k == 1:
            # One sub-batch is the whole batch: nothing is sliced, nothing can mix.
            batched = any(self._batched(n.name) for n in node.all_input_nodes)
            kind = "batched" if batched else "shared"
            self.splits[node.name] = NodeSplit(kind, args=node.args, kwargs=node.kwargs)
            return
        env_full = lambda n: self.full[n.name]  # noqa: E731
        full_args = torch.fx.node.map_arg(node.args, env_full)
        full_kwargs = torch.fx.node.map_arg(node.kwargs, env_full)
        try:
            full_out = self._execute(node, full_args, full_kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException) as exc:
            raise RefusedError(
                f"cannot split the batch: {_describe(node)} computes a result from the values of a tensor "
                f"({type(exc).__name__}: {exc}), which batch propagation cannot follow",
                "propagate_batch",
            ) from exc
        self.full[node.name] = full_out

        batched_inputs = [n for n in node.all_input_nodes if self._batched(n.name)]
        mutation = self._mutation_problem(node, full_args, batched_inputs)
        if mutation is not None and self._written_once_whole(node):
            # Decided below: computed from all sub-batches after the blocks, it is no problem.
            self._split_node(node, full_args, full_kwargs, full_out, batched_inputs)
            split = self.splits[node.name]
            if split.kind != "combine" or split.combine != "concat" or self.regions.get(node.name) != "suffix":
                self.problems.append((node.name, mutation, "mutation"))
            return
        if mutation is not None:
            self.problems.append((node.name, mutation, "mutation"))
        self._split_node(node, full_args, full_kwargs, full_out, batched_inputs)

    def _written_once_whole(self, node) -> bool:
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
            and not self._batched(target.name)
            and list(target.users) == [node]
        )

    def _split_node(self, node, full_args, full_kwargs, full_out, batched_inputs) -> None:
        """Decides the node's NodeSplit (or its problem) from its inputs' splits."""
        if not batched_inputs or self._shared_at_batch_size(node, batched_inputs):
            self.sub[node.name] = full_out
            self.splits[node.name] = NodeSplit("shared", args=node.args, kwargs=node.kwargs)
            self._track_sample_index(node)
            return
        if node.op == "call_method" and node.target in _CREATION_METHODS:
            self.sub[node.name] = full_out
            self.splits[node.name] = NodeSplit(
                "shared", args=node.args, kwargs=node.kwargs, from_subbatch=True
            )
            return

        routed = self._routing(node, full_args, full_kwargs)
        if routed is not None:
            route, reason = routed
            split = None
            if reason is None:
                split, reason = self._per_subbatch(node, full_out, counts=_is_counts(route), narrows=False)
            if split is not None:
                reason = _route_mismatch(node, route, split.out_bdims, full_out)
            if reason is None:
                if route is not _TOKENS:
                    self.routes[node.name] = route
                self.splits[node.name] = split
                return
            if self.regions.get(node.name) == "suffix":
                # Concatenated back, routed values would be in the wrong order.
                self.problems.append((node.name, reason, "mixes-samples"))
        else:
            reason = self._counts_from_batch_size(node, batched_inputs)
            if reason is None:
                reason = self._mixes_samples(node, full_args, full_kwargs, full_out)
            split = None
            if reason is None:
                split, reason = self._per_subbatch(node, full_out)
            if split is not None and node.name in self.gathers and split.out_bdims != self.gathers[node.name][2]:
                split, reason = None, f"{_describe(node)} gathers samples into an order that cannot be split"
            if split is not None:
                self.splits[node.name] = split
                return

        # Cross-sample: the value is computed from all sub-batches, full size.
        self.sub[node.name] = full_out
        self.splits[node.name] = NodeSplit(
            "combine",
            args=node.args,
            kwargs=node.kwargs,
            combine=self._combine_kind(node, full_kwargs=full_kwargs, full_args=full_args),
            reason=reason,
        )
        if self.regions.get(node.name) != "suffix":
            self.problems.append((node.name, reason, "mixes-samples"))

    def _mutation_problem(self, node, full_args, batched_inputs) -> str | None:
        """In-place writes that sub-batching would repeat or reorder."""
        if not _is_inplace(node, full_args) or not full_args or not isinstance(full_args[0], torch.Tensor):
            return None
        owner = self.input_storages.get(StorageWeakRef(full_args[0].untyped_storage()))
        if owner is not None:
            kind = self.inputs[owner].kind
            what = {"param": "parameter", "buffer": "buffer"}.get(kind, "input")
            return f"{_describe(node)} writes in place to {what} {owner}; split into sub-batches it would be written once per sub-batch"
        target = node.args[0]
        if batched_inputs and isinstance(target, torch.fx.Node) and not self._batched(target.name):
            if self._made_per_sample(node, target):
                return None
            return f"{_describe(node)} writes per-sample values in place into {target.name}, a value shared by all sub-batches"
        if node.target is operator.setitem and isinstance(target, torch.fx.Node) and self._batched(target.name):
            # Literal indices (`t[0] = ...`); tensor indices are for the routing rules.
            bdim, index = self.splits[target.name].out_bdims, node.args[1]
            literal = not any(isinstance(i, torch.fx.Node) for i in (index if isinstance(index, tuple) else (index,)))
            if isinstance(bdim, int) and literal and _getitem_touches_batch(node, index, full_args[0], bdim):
                return (
                    f"{_describe(node)} writes in place into some samples of {target.name} "
                    "(it indexes the batch dimension)"
                )
        return None

    def _made_per_sample(self, node, target) -> bool:
        """A write of per-sample values into a fresh tensor the graph made at full batch
        size (`x.new_zeros(x.shape)`, then `t[..., 1:] = x[..., :-1]`), or into a view
        of one (`k = kv.new_empty(...)`, then `k[..., :d].copy_(k_nope)`), that leaves
        its batch dimension whole: the tensor (and its views) become per-sample, made
        at sub-batch size. Needs no earlier reader of the tensor but the views written
        through, and a creation op whose size along the batch is a literal or the
        dynamic batch size."""
        chain = self._fresh_views(target)
        dim = dict(self._narrowing(node)).get(target.name)
        if chain is None or dim is None:
            return False
        members = {n.name for n in chain}
        for member in chain:
            if any(u is not node and u.name in self.splits and u.name not in members for u in member.users):
                return False
        name = _target_name(node)
        if name not in _PER_SAMPLE_WRITES or (
            name == "setitem" and _getitem_touches_batch(node, node.args[1], self.full[target.name], dim)
        ):
            return False
        if name == "index_put_" and len(node.args[1]) > dim and node.args[1][dim] is not None:
            return False
        root = chain[0]
        for root_dim in range(self.full[root.name].dim()):
            saved = {n.name: (self.splits[n.name], self.sub[n.name]) for n in chain}
            if self._split_fresh(root, root_dim) and self._split_views(chain[1:]):
                if self.splits[target.name].out_bdims == dim:
                    return True
            for member, (split, sub) in saved.items():
                self.splits[member], self.sub[member] = split, sub
        return False

    def _fresh_views(self, target) -> list | None:
        """[creation node, views of it..., target] when `target` is a shared tensor the
        graph made from sizes (or a view of one by slicing), else None."""
        chain = [target]
        while _SIZE_ARG.get(chain[0].target) is None:
            view = chain[0]
            source = view.args[0] if view.args else None
            if not isinstance(source, torch.fx.Node) or self._batched(source.name) or view.op not in (
                "call_function", "call_method"
            ):
                return None
            name = _target_name(view)
            if name == "getitem":
                items = view.args[1] if isinstance(view.args[1], tuple) else (view.args[1],)
                if any(isinstance(i, torch.fx.Node) for i in items):
                    return None
            elif name not in _VIEWS:
                return None
            chain.insert(0, source)
        return chain

    def _split_fresh(self, target, dim) -> bool:
        """Makes the creation node `target` per-sample along `dim`."""
        position = _SIZE_ARG.get(target.target)
        if position is None or len(target.args) <= position:
            return False
        size, full = target.args[position], self.full[target.name].shape[dim]
        shape = isinstance(size, torch.fx.Node) and isinstance(self.splits[size.name].out_bdims, (tuple, list))
        packed = isinstance(size, (tuple, list))
        if shape:
            sizes = list(self.splits[size.name].out_bdims)
        else:
            sizes = list(size) if packed else list(target.args[position:])
        if len(sizes) <= dim:
            return False
        if shape or isinstance(sizes[dim], torch.fx.Node):  # a dynamic batch: per sub-batch already
            batched = sizes[dim] if shape else self.splits[sizes[dim].name].out_bdims
            if batched != BATCHED_INT or full != self.batch_size:
                return False
        elif not isinstance(sizes[dim], int) or sizes[dim] != full or full != self.batch_size or self.dynamic:
            return False
        else:
            sizes[dim] = full // self.k
        rest = target.args[position + 1 :] if packed else ()
        args = target.args if shape else (*target.args[:position], *((tuple(sizes),) if packed else sizes), *rest)
        env_sub = lambda n: self.sub[n.name]  # noqa: E731
        sub_out = self._execute(
            target, torch.fx.node.map_arg(args, env_sub), torch.fx.node.map_arg(target.kwargs, env_sub)
        )
        self.sub[target.name] = sub_out
        self.splits[target.name] = NodeSplit("batched", out_bdims=dim, args=args, kwargs=target.kwargs)
        return True

    def _split_views(self, views) -> bool:
        for view in views:
            split, _ = self._per_subbatch(view, self.full[view.name])
            if split is None:
                return False
            self.splits[view.name] = split
        return True

    # Sample indices: `arange` over the batch, used to gather each sample's own rows.
    def _shared_at_batch_size(self, node, batched_inputs) -> bool:
        """With a dynamic batch, shared values made at the batch size read the batch
        size symbol: `arange(batch)`, and a shared mask expanded to it
        (`mask.expand(batch, -1, q, kv)`). They are computed once, shared, from the full
        batch size (the symbol itself, not a sub-batch's), and sliced where per-sample
        values read them."""
        if not all(n.name in self.batch_symbols and n.op == "placeholder" for n in batched_inputs):
            return False
        if node.op == "call_method" and node.target in _CREATION_METHODS:
            return False
        if node.target is torch.arange:
            return self._sample_index_axis(node) == 0
        return any(
            isinstance(value := self.full[n.name], torch.Tensor) and self.batch_size in value.shape
            for n in node.all_input_nodes if not self._batched(n.name)
        )

    def _track_sample_index(self, node) -> None:
        """Records a shared node that holds each sample's index (`torch.arange(batch)`,
        and shape-only ops of it such as `[:, None, None, None]` or `expand`).

        Such a value is shared like any other: its uses as values read slices of it.
        Only a gather that indexes the batch dimension with it (`_sample_gather`)
        reads it as a sample's own index."""
        axis = self._sample_index_axis(node)
        if axis is not None:
            self.sample_indices[node.name] = axis

    def _sample_index_axis(self, node) -> int | None:
        name = _target_name(node)
        sources = [n for n in node.all_input_nodes if isinstance(self.full[n.name], torch.Tensor)]
        if name == "arange" and not sources:
            symbols = [n.name in self.batch_symbols for n in node.all_input_nodes]
            if (not any(symbols)) if self.dynamic else bool(symbols):
                # Dynamic: a literal equal to the example batch is not the batch.
                # Static: a symbol (a dynamic length) is not the batch either.
                return None
        elif name not in _INDEX_PRESERVING or len(sources) != 1 or sources[0].name not in self.sample_indices:
            return None
        out = self.full[node.name]
        if not isinstance(out, torch.Tensor) or out.dtype.is_floating_point or out.is_complex():
            return None
        if self.batch_size not in out.shape or out.numel() > _REAL_CHECK_LIMIT:
            return None  # a materialized copy too large to check: an ordinary value
        replace = {n.name: self._real_sample_index(n.name) for n in sources}
        real = _run_real(node, self.full, replace)
        return None if real is None else _sample_axis(real, self.batch_size)

    def _real_sample_index(self, name: str) -> torch.Tensor:
        value = self.full[name]
        return _iota(self.batch_size, self.sample_indices[name], value.dim()).expand(value.shape).to(value.dtype)

    def _counts_from_batch_size(self, node, batched_inputs) -> str | None:
        """`arange` of a size that scales with the batch would count from 0 in every
        sub-batch: not a slice of the full batch's values."""
        if node.target is torch.arange and batched_inputs:
            return (
                f"{_describe(node)} counts up to a size that scales with the batch; each sub-batch "
                "would count from 0"
            )
        return None

    def _sample_gather(self, node):
        """`x[sample_index, ...]` (how Hugging Face masks take each sample's padding
        row: `mask[batch_arange[:, None, None, None], kv_arange]`): the dimension of
        `x` of the batch is indexed by the index of each sample. Each sub-batch then
        gathers its own rows with its slice of the index, less its first sample's
        (`rebase`); a shared `x` is narrowed to the sub-batch's rows. The other index
        tensors must broadcast along the samples (size 1 there) or be per sample with
        their batch on the same broadcast dimension. Returns `_NOT_A_GATHER` when no
        sample index indexes `x`, None when accepted (recorded in `gathers`), else the
        reason for refusing."""
        source, index = node.args[0], node.args[1]
        items = index if isinstance(index, tuple) else (index,)
        if not isinstance(source, torch.fx.Node) or not any(
            isinstance(i, torch.fx.Node) and i.name in self.sample_indices for i in items
        ):
            return _NOT_A_GATHER
        x = self.full[source.name]
        what = f"{_describe(node)} gathers along the batch dimension"
        dims = _index_dims(items, self.full, x.dim())
        if dims is None:
            return f"{what} with a boolean mask"
        split = self.splits[source.name]
        narrow = ()
        if split.kind == "batched":
            bdim = split.out_bdims
            samples = [pos for pos, d in enumerate(dims) if d == bdim]
            if not isinstance(bdim, int) or not samples or not _is_node_in(items[samples[0]], self.sample_indices):
                return _NOT_A_GATHER
            position = samples[0]
        else:
            info = self.inputs.get(source.name)
            candidates = [
                pos for pos, (item, d) in enumerate(zip(items, dims))
                if _is_node_in(item, self.sample_indices) and d is not None and x.shape[d] == self.batch_size
            ]
            if not candidates or (info is not None and info.kind in ("param", "buffer")):
                return _NOT_A_GATHER
            position, bdim = candidates[0], dims[candidates[0]]
            narrow = ((source.name, bdim),)
        sample = items[position]
        tensors = [(pos, item) for pos, item in enumerate(items)
                   if isinstance(item, torch.fx.Node) and isinstance(self.full[item.name], torch.Tensor)]
        width = max(self.full[item.name].dim() for _, item in tensors)
        # The samples' dimension among the broadcast index dimensions.
        along = self.sample_indices[sample.name] + width - self.full[sample.name].dim()
        replace = {sample.name: self._real_sample_index(sample.name)}
        for pos, item in tensors:
            if pos == position:
                continue
            value = self.full[item.name]
            at = along - (width - value.dim())
            item_split = self.splits[item.name]
            if item_split.kind == "batched":
                if item_split.out_bdims != at:
                    return f"{what} with per-sample indices {item.name} not lined up with the samples"
            elif 0 <= at < value.dim() and value.shape[at] != 1:
                return f"{what} with indices {item.name} shared by all samples that vary along the samples"
            replace[item.name] = torch.zeros(value.shape, dtype=torch.long)
        # Which output dimension holds the samples: gather the sample ids themselves.
        shape = [
            self.batch_size if d == bdim else (1 if d not in dims or _is_full_slice(items[dims.index(d)]) else x.shape[d])
            for d in range(x.dim())
        ]
        replace[source.name] = _iota(self.batch_size, bdim, x.dim()).expand(shape)
        real = _run_real(node, self.full, replace)
        axis = None if real is None else _sample_axis(real, self.batch_size)
        if axis is None:
            return f"{what} in a way that does not keep each sample's rows its own"
        self.gathers[node.name] = (narrow, ((sample.name, self.sample_indices[sample.name]),), axis)
        return None

    def _per_subbatch(self, node, full_out, counts=False, narrows=True):
        """Runs the node on one sub-batch; returns (NodeSplit, None) or (None, reason).
        With `counts`, its tensors keep their full shape (counts over the sub-batch).
        Without `narrows`, shared inputs are read whole (routed rows are no slice of
        anything shared)."""
        args, kwargs = self._rewrite_shapes(node)
        narrow = self._narrowing(node) if narrows else ()
        checked, rebase = (), ()
        if node.name in self.gathers:
            # Index tensors line up by broadcasting, not with the source: the gather
            # rule placed them (`_sample_gather`).
            checked, rebase, _ = self.gathers[node.name]
            narrow = checked
        narrow_dims = dict(narrow) | dict(rebase)

        def env_sub(n: torch.fx.Node):
            value = self.sub[n.name]
            if n.name in narrow_dims:
                dim = narrow_dims[n.name]
                value = value.narrow(dim, 0, value.shape[dim] // self.k)
            return value

        sub_args = torch.fx.node.map_arg(args, env_sub)
        sub_kwargs = torch.fx.node.map_arg(kwargs, env_sub)
        try:
            sub_out = self._execute(node, sub_args, sub_kwargs)
        except Exception as exc:  # the op's own error, at sub-batch size
            return None, (
                f"{_describe(node)} fails on one sub-batch ({type(exc).__name__}: "
                f"{str(exc).splitlines()[0] if str(exc) else ''})"
            )
        out_bdims, reason = self._compare(node, full_out, sub_out, counts)
        if reason is not None:
            return None, reason
        reason = self._check_alignment(node, () if checked else narrow, full_out, out_bdims)
        if reason is None:
            reason = self._check_reshape(node, full_out, out_bdims)
        if reason is not None:
            return None, reason
        self.sub[node.name] = sub_out
        return NodeSplit(
            "batched", out_bdims=out_bdims, args=args, kwargs=kwargs, narrow=narrow, rebase=rebase
        ), None

    def _compare(self, node, full_out, sub_out, counts=False):
        full_leaves, full_spec = pytree.tree_flatten(full_out)
        sub_leaves, sub_spec = pytree.tree_flatten(sub_out)
        if full_spec != sub_spec:
            return None, f"{_describe(node)} returns a different structure for one sub-batch"
        bdims = []
        for full, sub in zip(full_leaves, sub_leaves):
            if isinstance(full, torch.Tensor):
                if not isinstance(sub, torch.Tensor) or full.dim() != sub.dim():
                    return None, f"{_describe(node)} changes rank on one sub-batch"
                differ = [d for d in range(full.dim()) if full.shape[d] != sub.shape[d]]
                if counts and not differ:
                    bdims.append(None)
                    continue
                if not differ:
                    return None, (
                        f"{_describe(node)} reduces over the batch dimension "
                        f"(its output {tuple(full.shape)} does not depend on the batch)"
                    )
                if len(differ) > 1 or full.shape[differ[0]] != self.k * sub.shape[differ[0]]:
                    return None, (
                        f"{_describe(node)} has output {tuple(full.shape)} for the batch but "
                        f"{tuple(sub.shape)} for one sub-batch; its batch dimension is unclear"
                    )
                bdims.append(differ[0])
            elif isinstance(full, (int, torch.SymInt)) and not isinstance(full, bool):
                if full == sub:
                    bdims.append(None)
                elif full == self.k * sub:
                    bdims.append(BATCHED_INT)
                else:
                    return None, f"{_describe(node)} computes a size that does not scale with the batch"
            else:
                if full != sub:
                    return None, f"{_describe(node)} returns a value that depends on the batch"
                bdims.append(None)
        return pytree.tree_unflatten(bdims, full_spec), None

    # Routing: tokens sorted and gathered per expert (mixture of experts).
    def _routing(self, node, args, kwargs):
        """(route, None) or (None, reason) for what takes part in routing tokens, or
        None for everything else.

        A mixture of experts flattens batch and sequence into one token dimension
        that carries the batch, sorts the tokens by expert, gathers them, multiplies
        each expert's group and puts the results back in token order. Run on one
        sub-batch, the same code routes that sub-batch's tokens only: every token's
        result is the same, though the values in between (the sorted order, the
        positions, the counts per expert) are the sub-batch's own, not slices of the
        full batch's. `_Route` says what such a value holds; the rules below accept
        an op on one only where the meaning carries over, and such values never leave
        the block that routes them.
        """
        name = _target_name(node)
        routed = {n.name: self.routes[n.name] for n in node.all_input_nodes if n.name in self.routes}
        in_block = self.regions.get(node.name) == "block"
        if not routed:
            return self._start_routing(node, name, args, kwargs) if in_block else None
        if not in_block:
            return None, f"{_describe(node)} reads {', '.join(routed)}, routed inside a block, outside of it"
        source = node.args[0] if node.args else None
        first = routed.get(source.name) if isinstance(source, torch.fx.Node) else None
        if name == "getitem" and first is not None and isinstance(self.full[source.name], (tuple, list)):
            return (first[node.args[1]] if isinstance(first, tuple) else first), None
        if any(isinstance(r, tuple) for r in routed.values()):
            return None, f"{_describe(node)} uses a routing result as a whole"
        if name in ("size", "numel", "dim"):
            return _TOKENS, None
        if name in _KEEP_VALUES and first is not None and len(node.all_input_nodes) == 1:
            return first, None
        if name in ("getitem", "index_select"):
            return self._route_gather(node, name, args, kwargs, routed)
        if name in ("floordiv", "remainder", "mod") and first is not None and first.kind == "positions":
            return self._route_positions_arithmetic(node, name, first)
        if name in _SCATTERS:
            return self._route_scatter(node, name, args, kwargs, routed)
        if "grouped_mm" in name:
            return self._route_grouped_mm(node, args, kwargs, routed)
        if name in ("empty_like", "zeros_like") and first is not None:
            return _Route("fresh", order=first.order, length=first.length), None
        if name in _COUNTS:
            return self._route_counts(node, name, args, kwargs)
        return self._route_rowwise(node, args, kwargs, routed)

    def _start_routing(self, node, name, args, kwargs):
        """Sorts along a 1-D token dimension, counts per expert, positions 0..n-1."""
        if name in _SORTS or name in _COUNTS:
            source = node.args[0] if node.args else None
            bdim = self.splits[source.name].out_bdims if isinstance(source, torch.fx.Node) else None
            tensor = args[0] if args else None
            if bdim != 0 or not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
                return None
            if name in _COUNTS:
                return self._route_counts(node, name, args, kwargs)
            named = _named_args(node, args, kwargs) or {}
            if named.get("dim", -1) not in (0, -1):
                return None
            length = tensor.shape[0]
            rows = _Route("rows", order=node.name, length=length, sorted_keys=True)
            positions = _Route("positions", order=node.name, length=length, space=length, bijective=True)
            if name == "argsort":
                return positions, None
            return (rows if name == "msort" else (rows, positions)), None
        if name == "arange" and len(node.args) == 1 and isinstance(node.args[0], torch.fx.Node):
            if self.splits[node.args[0].name].out_bdims == BATCHED_INT:
                return _Route("iota", length=self.full[node.args[0].name]), None
        return None

    def _route_gather(self, node, name, args, kwargs, routed):
        """x[positions] and x.index_select(0, positions): rows in the positions' order."""
        source = node.args[0]
        if name == "getitem":
            index, dim = node.args[1], 0
        else:
            index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
            dim = (_named_args(node, args, kwargs) or {}).get("dim")
        positions = routed.get(index.name) if isinstance(index, torch.fx.Node) else None
        what = f"{_describe(node)} indexes tokens routed by their sub-batch"
        if (
            positions is not None and positions.kind == "rows" and isinstance(source, torch.fx.Node)
            and not self._batched(source.name) and name == "getitem"
        ):
            # A shared table (the experts' weights) looked up per routed row.
            return _Route("rows", order=positions.order, length=positions.length), None
        if positions is None or positions.kind != "positions" or dim != 0 or not isinstance(source, torch.fx.Node):
            return None, what + " in a way that cannot be split"
        rows = routed.get(source.name)
        if rows is None:
            order = "" if self.splits[source.name].out_bdims == 0 else None
        else:
            order = rows.order if rows.kind == "rows" else None
        if order != positions.points or self.full[source.name].shape[0] != positions.space:
            return None, what + " with positions into other rows"
        if positions.order == "":
            return _TOKENS, None
        return _Route("rows", order=positions.order, length=positions.length), None

    def _route_positions_arithmetic(self, node, name, positions):
        """Positions of pairs // pairs per token: positions of tokens (and % the rank
        within the token), exact when each sub-batch holds whole tokens."""
        divisor = node.args[1] if len(node.args) > 1 else None
        if not isinstance(divisor, int) or divisor <= 0 or (positions.space // self.k) % divisor:
            return None, f"{_describe(node)} divides token positions by a size that splits a sub-batch's tokens"
        if name == "floordiv":
            return dataclasses.replace(positions, space=positions.space // divisor, bijective=False), None
        if positions.order == "":
            return _TOKENS, None
        return _Route("rows", order=positions.order, length=positions.length), None

    def _route_scatter(self, node, name, args, kwargs, routed):
        """Writes by positions: `inverse[perm] = arange(n)` (the inverse permutation),
        `out[positions] = rows` and `out.index_add_(0, positions, rows)` (routed rows
        back in token order)."""
        if name == "setitem":
            target, index, value = node.args
            dim = 0
        else:
            target = node.args[0]
            index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
            value = node.args[3] if len(node.args) > 3 else node.kwargs.get("source")
            dim = node.args[1] if len(node.args) > 1 else node.kwargs.get("dim")
        written, positions, rows = (routed.get(n.name) if isinstance(n, torch.fx.Node) else None
                                    for n in (target, index, value))
        what = f"{_describe(node)} writes routed tokens in a way that cannot be split"
        if dim != 0 or positions is None or positions.kind != "positions" or not isinstance(target, torch.fx.Node):
            return None, what
        if not name.startswith("index_add") and not positions.bijective:
            # A position written twice keeps the write that comes last in routed order.
            return None, what
        fresh = written is not None and written.kind == "fresh"
        space = positions.space
        if name == "setitem" and fresh and written.length == space == positions.length and (
            (rows is None and self._make_iota(value, space, users_besides=node))
            or (rows is not None and rows.kind == "iota" and rows.length == space)
        ):
            self.routes[target.name] = _Route(
                "positions", order=positions.points, length=space, points=positions.order, space=space,
                bijective=True,
            )
            return _TOKENS, None
        in_tokens = fresh or (written is None and self.splits[target.name].out_bdims == 0)
        if (
            in_tokens and positions.points == "" and self.full[target.name].shape[0] == space
            and rows is not None and rows.kind == "rows" and rows.order == positions.order
            and rows.length == positions.length
        ):
            self.routes.pop(target.name, None)  # in token order from here on
            return _TOKENS, None
        return None, what

    def _make_iota(self, value, length, users_besides) -> bool:
        """A shared `arange(n)` of the full token count, read only here, becomes
        `arange(n / K)` per sub-batch: each sub-batch numbers its own tokens."""
        if not isinstance(value, torch.fx.Node) or _target_name(value) != "arange" or value.args != (length,):
            return False
        if any(user is not users_besides for user in value.users) or length % self.k:
            return False
        args = (length // self.k,)
        self.sub[value.name] = self._execute(value, args, value.kwargs)
        self.splits[value.name] = NodeSplit("batched", out_bdims=0, args=args, kwargs=value.kwargs)
        return True

    def _route_grouped_mm(self, node, args, kwargs, routed):
        """A grouped matmul of rows sorted by expert, with offsets counted from the
        same sort's keys: rows in that order."""
        source = node.args[0]
        offsets = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
        rows = routed.get(getattr(source, "name", None))
        counts = routed.get(getattr(offsets, "name", None))
        others = [n for n in node.all_input_nodes if n is not source and n is not offsets and self._batched(n.name)]
        if (
            rows is None or rows.kind != "rows" or counts is None or counts.kind != "offsets"
            or counts.order != rows.order or others
        ):
            return None, f"{_describe(node)} groups tokens by offsets not counted from their own sort"
        return _Route("rows", order=rows.order, length=rows.length), None

    def _route_counts(self, node, name, args, kwargs):
        """Tokens per expert: counts over the sub-batch's tokens."""
        source = node.args[0]
        named = _named_args(node, args, kwargs) or {}
        if named.get("weights") is not None or (source.name not in self.routes and self.splits[source.name].out_bdims != 0):
            return None, f"{_describe(node)} counts tokens in a way that cannot be split"
        rows = self.routes.get(source.name)
        if rows is not None and rows.kind != "rows":
            return None, f"{_describe(node)} counts token positions"
        sorted_keys = rows is not None and rows.sorted_keys
        return _Route("counts", order=rows.order if rows is not None else "", sorted_keys=sorted_keys), None

    def _route_rowwise(self, node, args, kwargs, routed):
        """Row by row over rows in one routed order (or on counts alone)."""
        kinds = {r.kind for r in routed.values()}
        orders = {r.order for r in routed.values()}
        unrouted = [n for n in node.all_input_nodes if n.name not in routed and self._batched(n.name)]
        if kinds == {"counts"} and len(orders) == 1 and not unrouted:
            first = next(iter(routed.values()))
            named = _named_args(node, args, kwargs) or {}
            if _target_name(node) == "cumsum" and named.get("dim") in (0, -1) and first.sorted_keys:
                # The end of each expert's group in the sorted rows.
                return _Route("offsets", order=first.order, sorted_keys=True), None
            return _Route("counts", order=first.order, sorted_keys=False), None
        described = ", ".join(f"{n} ({r.kind})" for n, r in routed.items())
        if kinds == {"rows"} and len(orders) == 1 and unrouted:
            return None, (
                f"{_describe(node)} combines tokens in the order their sub-batch routed them ({described}) "
                f"with tokens in their own order ({', '.join(n.name for n in unrouted)})"
            )
        if kinds != {"rows"} or len(orders) > 1 or unrouted:
            return None, f"{_describe(node)} combines routed values {described} in a way that cannot be split"
        reason = self._mixes_samples(node, args, kwargs, None)
        if reason is not None:
            return None, reason
        first = next(iter(routed.values()))
        return _Route("rows", order=first.order, length=first.length), None

    def _input_bdims(self, node):
        """(input node, its full value, batch dim) for batched tensor inputs."""
        for n in node.all_input_nodes:
            split = self.splits[n.name]
            if split.kind == "batched" and isinstance(split.out_bdims, int):
                yield n, self.full[n.name], split.out_bdims

    def _mixes_samples(self, node, args, kwargs, full_out) -> str | None:
        """Reasons that the shapes alone cannot see: ops along the batch dimension."""
        name = _target_name(node)
        bdims = list(self._input_bdims(node))
        if node.target in (F.batch_norm, torch.batch_norm) or name == "batch_norm":
            named = _named_args(node, args, kwargs) or {}
            if named.get("training", False):
                return f"{_describe(node)} is BatchNorm in training mode: its statistics span the whole batch"
        if not bdims:
            return None
        first_tensor = bdims[0]
        if name == "getitem":
            gather = self._sample_gather(node)
            if gather is not _NOT_A_GATHER:
                return gather
        if name in ("getitem",) and isinstance(first_tensor[1], torch.Tensor) and node.args[0] is first_tensor[0]:
            return _getitem_touches_batch(node, args[1], first_tensor[1], first_tensor[2])
        if name == "layer_norm":
            named = _named_args(node, args, kwargs) or {}
            shape = named.get("normalized_shape", ())
            tensor, bdim = first_tensor[1], first_tensor[2]
            if bdim >= tensor.dim() - len(tuple(shape)):
                return f"{_describe(node)} normalizes over the batch dimension"
            return None
        if name in _DIM_SAFE:
            return None
        named = _named_args(node, args, kwargs)
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
                return f"{_describe(node)} works along the batch dimension (dim={d})"
        return None

    def _rewrite_shapes(self, node):
        """Literal batch sizes in view/reshape/expand args, rewritten for one sub-batch."""
        name = _target_name(node)
        if name not in ("view", "reshape", "expand") or node.op not in ("call_method", "call_function"):
            return node.args, node.kwargs
        source = node.args[0]
        if not isinstance(source, torch.fx.Node) or not self._batched(source.name):
            return node.args, node.kwargs
        in_bdim = self.splits[source.name].out_bdims
        full_in = self.full[source.name]
        full_out = self.full[node.name]
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
            out_bdim = _reshaped_batch_dim(full_in.shape, in_bdim, full_out.shape, self.k)
            if out_bdim is None:
                return node.args, node.kwargs
        target = list(full_out.shape)
        target[out_bdim] //= self.k
        new_sizes = [
            target[i] if isinstance(s, int) and s != -1 and s != target[i] else s
            for i, s in enumerate(sizes)
        ]
        rest = (tuple(new_sizes),) if packed else tuple(new_sizes)
        return (node.args[0], *rest), node.kwargs

    def _narrowing(self, node) -> tuple[tuple[str, int], ...]:
        """Shared tensors a batched node reads along the batch (broadcast-aligned)."""
        batched = list(self._input_bdims(node))
        result = []
        for n in node.all_input_nodes:
            split = self.splits[n.name]
            info = self.inputs.get(n.name)
            if split.kind != "shared" or (info is not None and info.kind in ("param", "buffer")):
                continue
            value = self.full[n.name]
            if not isinstance(value, torch.Tensor) or value.dim() == 0:
                continue
            for _, full_x, bdim in batched:
                aligned = bdim - (full_x.dim() - value.dim())
                size = full_x.shape[bdim]
                if 0 <= aligned < value.dim() and value.shape[aligned] == size and size != 1:
                    result.append((n.name, aligned))
                    break
        return tuple(result)

    def _check_alignment(self, node, narrow, full_out, out_bdims) -> str | None:
        """A narrowed shared input must line up with the output's batch dimension."""
        if not narrow:
            return None
        out_bdim = out_bdims if isinstance(out_bdims, int) else None
        if out_bdim is None or not isinstance(full_out, torch.Tensor):
            return f"{_describe(node)} reads a full-batch shared value along the batch in a way that cannot be sliced"
        for name, dim in narrow:
            value = self.full[name]
            if dim - (value.dim() - full_out.dim()) != out_bdim:
                return (
                    f"{_describe(node)} reads {name} of shape {tuple(value.shape)} with a "
                    f"dimension equal to the batch size that does not line up with the batch"
                )
        return None

    def _check_reshape(self, node, full_out, out_bdims) -> str | None:
        """Merging dims keeps sub-batches contiguous only if the batch is outermost."""
        if _target_name(node) not in _RESHAPES:
            return None
        source = node.args[0]
        in_bdim = self.splits[source.name].out_bdims
        if not isinstance(in_bdim, int) or not isinstance(out_bdims, int):
            return None
        before_in = math.prod(self.full[source.name].shape[:in_bdim])
        before_out = math.prod(full_out.shape[:out_bdims])
        if before_in != before_out:
            return f"{_describe(node)} merges the batch dimension with an outer dimension"
        return None

    def _combine_kind(self, node, full_args, full_kwargs) -> str:
        """How a cross-sample op after the blocks is computed from the sub-batches."""
        named = _named_args(node, full_args, full_kwargs) or {}
        if node.target in _CROSS_ENTROPY:
            if (
                named.get("weight") is None
                and named.get("reduction", "mean") in ("mean", "sum")
                and not named.get("label_smoothing", 0.0)
                and named.get("size_average") is None
                and named.get("reduce") is None
                and all(self._batched(n.name) for n in node.all_input_nodes)
            ):
                return "cross_entropy"
            return "concat"
        target = node.target
        if target in _SUM or target in _MEAN:
            extra = {k: v for k, v in named.items() if k not in ("input", "self") and v is not None}
            if not extra and len(node.args) == 1 and not node.kwargs:
                return "sum" if target in _SUM else "mean"
        return "concat"


@dataclasses.dataclass(frozen=True)
class _Route:
    """What a value holds when each sub-batch routes its own tokens (`_routing`).

    Attributes:
        kind: "rows": along dim 0, the sub-batch's own rows in the order of the sort
            `order` (not a slice of the full batch's value); "positions": integer
            positions, local to the sub-batch, into the `space` rows (full batch) of
            values in order `points` ("": token order), themselves in order `order`;
            "counts": no batch dimension, counts per expert over the sub-batch's
            rows; "offsets": their cumulative sum, where each expert's group of
            sorted rows ends; "iota": `arange` over the sub-batch's `length` rows; "fresh": an
            unwritten tensor shaped like routed rows.
        order: "" for token order, else the sort node that ordered the rows.
        length: rows along dim 0 for the full batch.
        points, space: for positions, what they index.
        bijective: positions that name every row once (a permutation).
        sorted_keys: rows that are their sort's keys; counts of such keys (offsets
            for a grouped matmul).
    """

    kind: str
    order: str = ""
    length: int = 0
    points: str = ""
    space: int = 0
    bijective: bool = False
    sorted_keys: bool = False


# The result of a routing op in token order again: an ordinary per-sample value.
_TOKENS = _Route("tokens")
_SORTS = {"sort", "argsort", "msort"}
_COUNTS = {"histc", "bincount"}
_SCATTERS = {"setitem", "index_add", "index_add_", "index_copy", "index_copy_"}
# Ops that keep what the values mean (a dtype, a copy).
_KEEP_VALUES = {"to", "float", "int", "long", "clone", "contiguous", "detach"}


def _is_counts(route) -> bool:
    return isinstance(route, _Route) and route.kind in ("counts", "offsets")


def _route_mismatch(node, route, out_bdims, full_out) -> str | None:
    """A routed result must keep its rows along dim 0 (counts: no batch dimension)."""
    routes = route if isinstance(route, tuple) else None
    leaves = pytree.tree_leaves(full_out)
    bdims = pytree.tree_leaves(out_bdims, is_leaf=lambda x: x is None)
    for i, (leaf, bdim) in enumerate(zip(leaves, bdims)):
        if not isinstance(leaf, torch.Tensor):
            continue
        r = routes[i] if routes is not None else route
        if r is _TOKENS or _is_counts(r):
            if _is_counts(r) and bdim is not None:
                return f"{_describe(node)} counts per sub-batch but its result scales with the batch"
            continue
        if bdim != 0 or leaf.shape[0] != r.length:
            return f"{_describe(node)} changes the rows of tokens routed by their sub-batch"
    return None


_INPLACE_OPERATORS = {operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.setitem}
# Ops that make a tensor of one value from sizes: where the sizes start in their args.
_SIZE_ARG = {"new_zeros": 1, "new_ones": 1, "new_empty": 1, "new_full": 1,
             torch.zeros: 0, torch.ones: 0, torch.empty: 0, torch.full: 0}
# Views a write into a fresh tensor may go through.
_VIEWS = {"narrow", "select", "unsqueeze", "squeeze", "view", "transpose", "permute", "movedim", "swapaxes"}
# In-place writes that keep samples apart when the batch dimension is left whole.
_PER_SAMPLE_WRITES = {"setitem", "index_put_", "copy_", "fill_", "masked_fill_", "add_", "sub_", "mul_", "div_",
                      "iadd", "isub", "imul", "itruediv"}


def _is_inplace(node: torch.fx.Node, full_args) -> bool:
    if node.op == "call_method":
        name = node.target
        return name.endswith("_") and not name.startswith("_")
    if node.op == "call_function":
        if node.target in _INPLACE_OPERATORS:
            return True
        if "inplace" in node.kwargs:
            return bool(node.kwargs["inplace"])
        named = _named_args(node, full_args, {}) if node.args else None
        return bool((named or {}).get("inplace", False))
    return False


def _reshaped_batch_dim(in_shape, in_bdim, out_shape, k) -> int | None:
    """Where the batch lands after a row-major reshape, if sub-batches stay contiguous."""
    before = math.prod(in_shape[:in_bdim])
    for j in range(len(out_shape)):
        if math.prod(out_shape[:j]) == before and out_shape[j] % k == 0 and out_shape[j] >= k:
            if out_shape[j] * math.prod(out_shape[j + 1 :]) == math.prod(in_shape[in_bdim:]):
                return j
    return None


def _getitem_touches_batch(node, index, tensor, bdim) -> str | None:
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
            return f"{_describe(node)} indexes the batch dimension"
        if isinstance(item, torch.Tensor) and item.dtype == torch.bool:
            dim += item.dim()
            if dim > bdim:
                return f"{_describe(node)} indexes the batch dimension with a mask"
            continue
        dim += 1
    return None


_NOT_A_GATHER = object()
# Ops that can keep a sample index a sample index (checked on real values).
_INDEX_PRESERVING = {"getitem", "unsqueeze", "view", "reshape", "expand", "to", "contiguous", "clone",
                     "detach", "long", "int", "squeeze", "add", "sub", "permute", "transpose"}
# Largest sample index (elements) checked on real values.
_REAL_CHECK_LIMIT = 1 << 22


def _symbolic_dim(node: torch.fx.Node, dim: int) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() > dim and isinstance(value.shape[dim], torch.SymInt)


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


def _run_real(node: torch.fx.Node, full: Mapping[str, Any], replace: Mapping[str, torch.Tensor],
              args=None, kwargs=None, strict=False):
    """Runs the node on real CPU tensors: `replace` for its tensor inputs, the full
    values of its integer inputs (or the given `args` and `kwargs`); None if it
    cannot run so (with `strict`, the op's error)."""

    def real(n: torch.fx.Node):
        if n.name in replace:
            return replace[n.name]
        value = full[n.name]
        if isinstance(value, (int, float, bool)):
            return value
        raise _NotReal

    if args is None:
        try:
            args = torch.fx.node.map_arg(node.args, real)
            kwargs = {k: v for k, v in torch.fx.node.map_arg(node.kwargs, real).items() if k != "device"}
        except _NotReal:
            return None
        if node.op == "call_method" and node.target == "to":
            args = tuple(a for a in args if not isinstance(a, (torch.device, str)))
    try:
        if node.op == "call_function":
            return node.target(*args, **kwargs)
        if node.op == "call_method":
            self_obj, *rest = args
            return getattr(self_obj, node.target)(*rest, **kwargs)
    except Exception:  # noqa: BLE001 - an op that needs more than these values
        if strict:
            raise
        return None
    if strict:
        raise NotImplementedError(node.op)
    return None


def _is_small_real(value: torch.Tensor) -> bool:
    return not isinstance(value, FakeTensor) and value.device.type == "cpu" and value.numel() <= 64


def _is_scalar_input(info: GraphInput) -> bool:
    value = info.value
    return (
        info.kind == "user" and isinstance(value, torch.Tensor) and value.dim() == 0
        and not isinstance(value, FakeTensor) and value.device.type == "cpu"
    )


class _NotReal(Exception):
    pass


def _named_args(node, args, kwargs) -> dict | None:
    """The node's arguments by parameter name, or None when the signature is unknown."""
    target = node.target
    if node.op == "call_method":
        target = getattr(torch, node.target, None)
        if target is None:
            return None
    if not callable(target):
        return None
    for kwargs_types in (False, True):
        try:
            arg_types = tuple(type(a) if not isinstance(a, torch.Tensor) else torch.Tensor for a in args) if kwargs_types else None
            kw_types = {k: (torch.Tensor if isinstance(v, torch.Tensor) else type(v)) for k, v in kwargs.items()} if kwargs_types else None
            with warnings.catch_warnings():
                # operator_schemas warns about schemas it cannot type; irrelevant here.
                warnings.simplefilter("ignore")
                pair = normalize_function(
                    target, tuple(args), dict(kwargs), arg_types=arg_types, kwarg_types=kw_types,
                    normalize_to_only_use_kwargs=True,
                )
        except Exception:
            continue
        if pair is not None:
            return pair.kwargs
    log.debug("no signature for %s", _describe(node))
    return None


def _target_name(node: torch.fx.Node) -> str:
    if node.op == "call_method":
        return node.target
    if node.target is operator.getitem:
        return "getitem"
    return getattr(node.target, "__name__", str(node.target))


def _describe(node: torch.fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    where = ""
    if stack:
        path = list(stack.values())[-1][0]
        where = " in " + (f"model.{module_path(path)}" if module_path(path) else "model")
    return f"node {node.name} ({_target_name(node)}){where}"
