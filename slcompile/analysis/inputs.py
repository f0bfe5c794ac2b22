"""What each placeholder of a Dynamo graph is: parameter, buffer, user input or size.

Needs the Dynamo FX graph and the example inputs Dynamo hands a backend (placeholders
and example inputs in the same order). Dynamo lifts parameters and buffers to
placeholders and records where each came from in `node.meta["grapharg"].source`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

import torch
import torch.fx

__all__ = ["GraphInput", "classify_inputs", "parameter_name"]


@dataclasses.dataclass(frozen=True)
class GraphInput:
    """One placeholder.

    Attributes:
        name: the placeholder's node name.
        index: its position among the graph's inputs.
        kind: "param", "buffer", "user" (a tensor the caller passed) or "size" (a
            SymInt Dynamo lifted for a dynamic dimension), or "other".
        source: Dynamo's name for where it came from (`L['idx']`), or "".
        value: the example input.
    """

    name: str
    index: int
    kind: str
    source: str
    value: object


def parameter_name(source: str) -> str:
    """`layers.0.fc.weight` for Dynamo's `L['self']._modules['layers']._modules['0']
    ._modules['fc']._parameters['weight']` (or `.__dict__['_modules']['layers']`, as
    Dynamo reads a module whose class defines `__getattr__`, peft's); other sources
    as they are."""
    parts = re.findall(r"(?:\._(?:modules|parameters)|\.__dict__\['_(?:modules|parameters)'\])\['([^']+)'\]", source)
    return ".".join(parts) if parts else source


def classify_inputs(gm: torch.fx.GraphModule, example_inputs: Sequence[object]) -> list[GraphInput]:
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        raise ValueError(
            f"graph has {len(placeholders)} placeholders but {len(example_inputs)} example inputs"
        )
    result = []
    for index, (node, value) in enumerate(zip(placeholders, example_inputs)):
        grapharg = node.meta.get("grapharg")
        source = getattr(getattr(grapharg, "source", None), "name", "") or ""
        if callable(source):
            source = source()
        if isinstance(value, torch.nn.Parameter) or "._parameters[" in source:
            kind = "param"
        elif "._buffers[" in source or _is_module_state(node):
            kind = "buffer"
        elif isinstance(value, torch.Tensor):
            kind = "user"
        elif isinstance(value, torch.SymInt):
            kind = "size"
        else:
            kind = "other"
        result.append(GraphInput(node.name, index, kind, str(source), value))
    return result


def _is_module_state(node: torch.fx.Node) -> bool:
    """A tensor Dynamo lifted from a module and marks static: a buffer, when the
    placeholder carries no source (a buffer first read inside a nested call)."""
    return (node.meta.get("tensor_dict") or {}).get("_dynamo_static_input_type") == "unguarded"
