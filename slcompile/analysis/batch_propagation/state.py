"""What one walk of batch propagation knows: the graph's inputs and batch, each
node's values at the full batch and at one sub-batch, the splits decided so far, the
problems found, and the tables the families of rules keep (routed values, sample
indices, gathers by sample index).

Where it sits: `propagate_batch` (`propagate`) makes one `PropagationState` per graph
and hands it, with each node in graph order, to the families of rules (`writes`,
`sample_index`, `routing`, `cross_sample`, `reshape`) and to the node's run on one
sub-batch (`subbatch`), which read and write its tables and call its helpers.
Needs: the Dynamo graph, its classified inputs, the batch's inputs, symbols and size,
K, and the regions of `find_blocks`.
Guarantees: a node's entries are written while the walk is at that node, or remade
by the rules at a later node that shows what it holds: a fresh tensor written per
sample and the views written through (`writes`), an `arange` numbering routed tokens
and a tensor that routed positions are written into (`routing`)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch
import torch.fx
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.utils import _pytree as pytree

from slcompile.analysis.batch_propagation.nodes import run_real
from slcompile.analysis.batch_propagation.plan import NodeSplit
from slcompile.analysis.inputs import GraphInput

__all__ = ["PropagationState"]


class PropagationState:
    """The walk's tables and the helpers every family of rules needs.

    Attributes:
        gm: the Dynamo graph.
        inputs: placeholder name -> its `GraphInput`.
        batched_inputs: placeholder name -> batch dimension, for per-sample inputs.
        batch_symbols: placeholder names of SymInts equal to the batch size.
        batch_size: the full batch size (concrete).
        num_subbatches: K.
        regions: node name -> "prefix", "block" or "suffix".
        fake_mode: the fake mode every node runs in.
        full: node name -> its value at the full batch.
        sub: node name -> its value for one sub-batch (the full value for shared and
            combined nodes).
        splits: node name -> its `NodeSplit`.
        problems: (node name, reason, kind) found so far.
        input_storages: storage of a placeholder's value -> the placeholder's name.
        routes: node name -> what it holds when each sub-batch routes its own tokens
            (a `routing.Route`, or a tuple of them per output).
        sample_indices: node name -> the axis along which a shared value holds each
            sample's index (`sample_index`).
        gathers: node name -> (narrow, rebase, output batch dim) for gathers by sample
            index (`sample_index.sample_gather`).
        dynamic: the batch is symbolic, so a literal size equal to the example batch
            is not the batch.
    """

    def __init__(
        self,
        gm: torch.fx.GraphModule,
        inputs: Sequence[GraphInput],
        batched_inputs: Mapping[str, int],
        batch_symbols: Sequence[str],
        batch_size: int,
        num_subbatches: int,
        regions: Mapping[str, str],
    ):
        self.gm = gm
        self.inputs = {i.name: i for i in inputs}
        self.batched_inputs = dict(batched_inputs)
        self.batch_symbols = set(batch_symbols)
        self.batch_size = batch_size
        self.num_subbatches = num_subbatches
        self.regions = regions
        self.fake_mode = FakeTensorMode(allow_non_fake_inputs=True)
        self.full: dict[str, Any] = {}
        self.sub: dict[str, Any] = {}
        self.splits: dict[str, NodeSplit] = {}
        self.problems: list[tuple[str, str, str]] = []
        self.input_storages: dict[Any, str] = {}
        self.routes: dict[str, Any] = {}
        self.sample_indices: dict[str, int] = {}
        self.gathers: dict[str, tuple] = {}
        self.dynamic = bool(self.batch_symbols) or any(
            _symbolic_dim(node, dim) for node in gm.graph.nodes
            if node.op == "placeholder" and (dim := self.batched_inputs.get(node.name)) is not None
        )

    def batched(self, name: str) -> bool:
        """Whether the node runs once per sub-batch."""
        return self.splits[name].kind == "batched"

    def input_bdims(self, node: torch.fx.Node) -> Iterator[tuple[torch.fx.Node, Any, int]]:
        """(input node, its full value, batch dim) for batched tensor inputs."""
        for n in node.all_input_nodes:
            split = self.splits[n.name]
            if split.kind == "batched" and isinstance(split.out_bdims, int):
                yield n, self.full[n.name], split.out_bdims

    def execute(self, node: torch.fx.Node, args, kwargs):
        """Runs the node on the given arguments: on fake tensors, or on real values
        where every tensor argument is a small real one (lifted scalars, which
        `.item()` needs)."""
        leaves = [leaf for leaf in pytree.tree_leaves((args, kwargs)) if isinstance(leaf, torch.Tensor)]
        if leaves and all(_is_small_real(leaf) for leaf in leaves):
            # Anything the real values cannot run on runs on fakes.
            try:
                return run_real(node, {}, {}, args, kwargs, strict=True)
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


def _symbolic_dim(node: torch.fx.Node, dim: int) -> bool:
    value = node.meta.get("example_value")
    return isinstance(value, torch.Tensor) and value.dim() > dim and isinstance(value.shape[dim], torch.SymInt)


def _is_small_real(value: torch.Tensor) -> bool:
    return not isinstance(value, FakeTensor) and value.device.type == "cpu" and value.numel() <= 64
