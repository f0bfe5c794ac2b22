"""Inline activation-checkpointed regions into the Dynamo graph.

Runs first in the Dynamo stage. `torch.utils.checkpoint` (a Hugging Face model's
`gradient_checkpointing_enable()`, one checkpoint around each layer) reaches the
backend as `torch.ops.higher_order.tag_activation_checkpoint(body, *args)`, its body a
submodule traced for the whole batch: its views and reshapes hold the batch size. A
call of that body per sub-batch would hand it tensors of another size. Inlined, the
body's nodes are ordinary nodes of the graph, which batch propagation and
`interleave` rewrite per sub-batch like any other; each node keeps the module path it
had (the layer), so `find_blocks` finds the layers as blocks. Regions inside a body
(a custom autograd.Function's forward and backward, as BLOOM's GELU; a checkpoint
inside a checkpoint) come along as attributes of the graph; nested checkpoints are
inlined in turn. Dead code goes, writes in place whose result nobody reads stay.

What the checkpoint asked for, recomputing a layer's internals in the backward from
its input, is what `recompute="blocks"` does per block and sub-batch: the backend
compiles the graph with it (unless the options say `recompute="none"`, then nothing
is recomputed), and says so.
"""

from __future__ import annotations

import inspect
import logging
import operator

import torch
import torch.fx

from slcompile.compat import graph_module
from slcompile.errors import RefusedError

__all__ = ["inline_checkpoints", "is_checkpoint"]

log = logging.getLogger(__name__)


def is_checkpoint(node: torch.fx.Node) -> bool:
    """Whether `node` calls a checkpointed region."""
    hop = getattr(torch.ops.higher_order, "tag_activation_checkpoint", None)
    return node.op == "call_function" and hop is not None and node.target is hop


def inline_checkpoints(gm: torch.fx.GraphModule) -> tuple[torch.fx.GraphModule, tuple[str, ...]]:
    """Replaces every checkpointed region's call by its body's nodes.

    Returns:
        (a new GraphModule, or `gm` itself when it holds no region; the module path of
        each region inlined, in graph order). `gm` is left as it was: a fallback
        compiles it with its checkpoints.

    Raises:
        RefusedError: a region whose body is not a submodule of `gm`, calls modules of
            its own, or whose outputs are used other than by index.
    """
    if not any(is_checkpoint(n) for n in gm.graph.nodes):
        return gm, ()
    graph = torch.fx.Graph()
    output = graph.graph_copy(gm.graph, {})
    graph.output(output)
    gm = graph_module(gm, graph, gm.__class__.__name__)
    inlined = []
    # A region inlined may bring regions of its own (a checkpoint inside a
    # checkpoint): inline until none is left.
    while calls := [n for n in gm.graph.nodes if is_checkpoint(n)]:
        for node in calls:
            inlined.append(_inline(gm, node))
    if inlined:
        gm.graph.eliminate_dead_code(is_impure_node=_has_effects)
        gm.delete_all_unused_submodules()
        gm.graph.lint()
        gm.recompile()
        log.debug("inlined %d checkpointed regions", len(inlined))
    return gm, tuple(inlined)


def _inline(gm: torch.fx.GraphModule, call: torch.fx.Node) -> str:
    body_attr, *args = call.args
    if body_attr.op != "get_attr" or not isinstance(getattr(gm, body_attr.target, None), torch.fx.GraphModule):
        raise RefusedError(f"checkpointed region {call.name} calls no traced body", "inline_checkpoints")
    body: torch.fx.GraphModule = getattr(gm, body_attr.target)
    where = _path(call, body)
    modules = [n.name for n in body.graph.nodes if n.op == "call_module"]
    if modules:
        raise RefusedError(
            f"checkpointed region {call.name} ({where}) calls modules of its own ({modules[0]})",
            "inline_checkpoints",
        )
    if any(user.op != "call_function" or user.target is not operator.getitem
           for user in call.users):
        raise RefusedError(f"checkpointed region {call.name} ({where}) has outputs used whole", "inline_checkpoints")
    placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(args):
        raise RefusedError(
            f"checkpointed region {call.name} ({where}) takes {len(placeholders)} inputs, called with {len(args)}",
            "inline_checkpoints",
        )
    env: dict[torch.fx.Node, torch.fx.Node] = dict(zip(placeholders, args))
    outputs = None
    with gm.graph.inserting_before(call):
        for node in body.graph.nodes:
            if node.op == "placeholder":
                continue
            if node.op == "output":
                outputs = torch.fx.node.map_arg(node.args[0], env.__getitem__)
                continue
            copy = gm.graph.node_copy(node, env.__getitem__)
            if node.op == "get_attr":
                # The body's own regions (an autograd.Function's forward and backward,
                # a nested checkpoint) and constants move to `gm` under a fresh name.
                copy.target = _adopt(gm, body, node.target)
            env[node] = copy
    if not isinstance(outputs, (tuple, list)):
        outputs = (outputs,)
    for user in list(call.users):
        user.replace_all_uses_with(outputs[user.args[1]])
        gm.graph.erase_node(user)
    gm.graph.erase_node(call)
    return where


def _adopt(gm: torch.fx.GraphModule, body: torch.fx.GraphModule, target: str) -> str:
    """Registers `body`'s attribute `target` on `gm` under a name `gm` has not used yet."""
    value = body
    for part in target.split("."):
        value = getattr(value, part)
    base = target.replace(".", "_")
    name, suffix = base, 0
    while hasattr(gm, name):
        suffix += 1
        name = f"{base}_{suffix}"
    if isinstance(value, torch.nn.Module):
        gm.add_module(name, value)
    elif isinstance(value, torch.nn.Parameter):
        gm.register_parameter(name, value)
    elif isinstance(value, torch.Tensor):
        gm.register_buffer(name, value)
    else:
        setattr(gm, name, value)
    return name


# Operators that write into their first argument.
_INPLACE_OPERATORS = frozenset({operator.iadd, operator.isub, operator.imul, operator.itruediv, operator.ifloordiv,
                      operator.imod, operator.ipow, operator.iand, operator.ior, operator.ixor,
                      operator.ilshift, operator.irshift, operator.imatmul, operator.setitem})


def _has_effects(node: torch.fx.Node) -> bool:
    """Whether removing `node` would change what the graph computes though nothing
    reads its result. torch.fx's own check misses writes in place: a Dynamo graph
    calls `x.masked_fill_(mask, 0)` (a method) whose result nobody reads, and the
    write is all that matters (T5's `_shift_right` turns -100 labels into pad ids so).
    """
    if node.is_impure():
        return True
    if node.op == "call_module":
        return True
    if node.op == "call_method":
        return node.target.endswith("_") and not node.target.startswith("_")
    if node.op != "call_function":
        return False
    if node.target in _INPLACE_OPERATORS:
        return True
    name = getattr(node.target, "__name__", "")
    if name.endswith("_") and not name.startswith("_"):
        return True
    if node.kwargs.get("out") is not None:
        return True
    # `F.relu(x, inplace=True)`, or by position: `F.dropout(x, p, training, True)`.
    try:
        bound = inspect.signature(node.target).bind(*node.args, **node.kwargs)
    except (TypeError, ValueError):
        # No signature to read: any literal True may be `inplace`.
        return bool(node.kwargs.get("inplace")) or any(arg is True for arg in node.args)
    return bool(bound.arguments.get("inplace", False))


def _path(call: torch.fx.Node, body: torch.fx.GraphModule) -> str:
    """The module the region runs: the innermost module path every node of its body
    shares (the call itself has none when the checkpoint is called outside a module),
    without Dynamo's root (`L['self'].`)."""
    stacks = [[path for path, _ in (n.meta.get("nn_module_stack") or {}).values()]
              for n in body.graph.nodes if n.op not in ("placeholder", "output")]
    stacks = [stack for stack in stacks if stack] or \
        [[path for path, _ in (call.meta.get("nn_module_stack") or {}).values()]]
    shared = []
    for paths in zip(*stacks):
        if any(path != paths[0] for path in paths):
            break
        shared.append(paths[0])
    if not shared:
        return "the graph"
    return shared[-1].split("].", 1)[1] if "]." in shared[-1] else shared[-1]
