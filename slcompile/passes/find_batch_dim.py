"""Find which dimension of which input is the batch.

Runs after `find_blocks`; needs the Dynamo graph's placeholders, classified. The batch
size B is the size along `batch_dim` of the first user tensor input. With
`torch._dynamo.mark_dynamic(x, batch_dim)` (or Dynamo's automatic dynamic shapes)
that size is a symbol: every input whose batch dimension is a symbol of size B is
batched, and every SymInt placeholder equal to one of those is a batch-size symbol
(mapped to B / K per sub-batch). Inputs that nothing in the graph relates get a
symbol each (a padding mask and the token ids), so the batch may be several symbols;
the backend checks on every call that they agree. With static shapes, user
inputs of size B along `batch_dim` are batched; inputs of size 1 there broadcast.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.fx

from slcompile.analysis.inputs import GraphInput
from slcompile.config import batch_split_problem
from slcompile.errors import RefusedError

__all__ = ["BatchInfo", "find_batch_dim"]


@dataclasses.dataclass(frozen=True)
class BatchInfo:
    """The result of `find_batch_dim`.

    Attributes:
        batch_size: B for the example inputs.
        batch_dim: the dimension of each batched input that is the batch.
        batched_inputs: placeholder name -> batch dim, for per-sample inputs.
        batch_symbols: SymInt placeholders equal to B (dynamic batch only).
        dynamic: whether B is a symbol.
        input_index: placeholder name -> position among the graph's inputs.
    """

    batch_size: int
    batch_dim: int
    batched_inputs: dict[str, int]
    batch_symbols: tuple[str, ...]
    dynamic: bool
    input_index: dict[str, int]


def find_batch_dim(
    gm: torch.fx.GraphModule, inputs: list[GraphInput], batch_dim: int, num_subbatches: int
) -> BatchInfo:
    """Finds the batch.

    Raises:
        RefusedError: no batch dimension, or a batch not divisible by K.
    """
    by_name = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    users = [i for i in inputs if i.kind == "user" and i.value.dim() > batch_dim]
    if not users:
        raise RefusedError(
            f"no batch dimension: no input tensor besides parameters has a dimension {batch_dim}",
            "find_batch_dim",
        )

    def symbolic_size(info: GraphInput):
        value = by_name[info.name].meta.get("example_value")
        if isinstance(value, torch.Tensor):
            size = value.shape[batch_dim]
            if isinstance(size, torch.SymInt):
                return size.node.expr
        return None

    first = users[0]
    batch_size = int(first.value.shape[batch_dim])
    symbol = symbolic_size(first)
    if symbol is not None:
        # Dynamo gives inputs whose sizes nothing in the graph relates a symbol each
        # (GPT-NeoX's mask and token ids: s92 and s18): every symbol of the batch's
        # size at the batch dimension is the batch. The compiled call checks that they
        # are still equal (`batched_inputs` all of one size).
        batch_exprs = {
            size for i in users
            if (size := symbolic_size(i)) is not None and int(i.value.shape[batch_dim]) == batch_size
        }
        batched = {i.name: batch_dim for i in users if symbolic_size(i) in batch_exprs}
        symbols = tuple(
            i.name
            for i in inputs
            if i.kind == "size" and i.value.node.expr in batch_exprs
        )
    else:
        batched = {
            i.name: batch_dim
            for i in users
            if symbolic_size(i) is None and int(i.value.shape[batch_dim]) == batch_size
        }
        symbols = ()
    problem = batch_split_problem(batch_size, num_subbatches,
                                  f"(dim {batch_dim} of input {first.source or first.name})")
    if problem is not None:
        raise RefusedError(problem, "find_batch_dim")
    return BatchInfo(
        batch_size=batch_size,
        batch_dim=batch_dim,
        batched_inputs=batched,
        batch_symbols=symbols,
        dynamic=symbol is not None,
        input_index={i.name: i.index for i in inputs},
    )
