"""The propagator behind `propagate_batch`: it walks the graph in order, runs every
node on fake tensors at the full batch and at one sub-batch, and decides the node's
`NodeSplit` from its inputs' splits and the two results.

Every call node goes through `_Propagator._call`: in-place writes first
(`writes`), then shared values, creation methods, routed tokens (`routing`),
arange over the batch (`sample_index`), ops that mix samples (`cross_sample`), and
the node run on one sub-batch, its literal batch sizes rewritten (`reshape`).
Whatever mixes samples is combined from the sub-batches after the blocks
(`cross_sample`) or is a problem."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    FakeTensorMode,
)
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils import _pytree as pytree

from slcompile.analysis.batch_propagation.cross_sample import _CrossSample
from slcompile.analysis.batch_propagation.nodes import _CREATION_METHODS, _describe, _run_real
from slcompile.analysis.batch_propagation.plan import BATCHED_INT, BatchPlan, NodeSplit
from slcompile.analysis.batch_propagation.reshape import _Reshapes
from slcompile.analysis.batch_propagation.routing import _TOKENS, _is_counts, _route_mismatch, _Routing
from slcompile.analysis.batch_propagation.sample_index import _SampleIndices
from slcompile.analysis.batch_propagation.writes import _Writes
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
    return _Propagator(
        gm, inputs, batched_inputs, batch_symbols, batch_size, num_subbatches, regions
    ).run()


class _Propagator(_Writes, _SampleIndices, _Routing, _CrossSample, _Reshapes):
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

    def _input_bdims(self, node):
        """(input node, its full value, batch dim) for batched tensor inputs."""
        for n in node.all_input_nodes:
            split = self.splits[n.name]
            if split.kind == "batched" and isinstance(split.out_bdims, int):
                yield n, self.full[n.name], split.out_bdims

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


# The code `propagate_batch` runs, an object from each of its modules: the pass's
# `code`, whose modules the Inductor cache key hashes.
PROPAGATE_BATCH_CODE = (propagate_batch, NodeSplit, _describe, *_Propagator.__mro__[:-1])


def _symbolic_dim(node: torch.fx.Node, dim: int) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() > dim and isinstance(value.shape[dim], torch.SymInt)


def _is_small_real(value: torch.Tensor) -> bool:
    return not isinstance(value, FakeTensor) and value.device.type == "cpu" and value.numel() <= 64


def _is_scalar_input(info: GraphInput) -> bool:
    value = info.value
    return (
        info.kind == "user" and isinstance(value, torch.Tensor) and value.dim() == 0
        and not isinstance(value, FakeTensor) and value.device.type == "cpu"
    )
