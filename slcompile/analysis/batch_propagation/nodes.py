"""What batch propagation reads off an FX node: the name of its op, its arguments
by parameter name, where it sits in the model (for messages), whether it changes
global state (a barrier) or makes a tensor from another's dtype and device only, and
its result on real values where fake tensors cannot tell."""

from __future__ import annotations

import logging
import operator
import warnings
from collections.abc import Mapping
from typing import Any

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from slcompile.meta import module_path

__all__ = ["is_barrier", "CREATION_METHODS", "describe", "named_args", "run_real", "target_name"]

log = logging.getLogger(__name__)

# Methods that use their tensor argument only for dtype and device.
CREATION_METHODS = frozenset({"new_zeros", "new_ones", "new_empty", "new_full", "new_tensor"})
# Ops that change global state; they keep their place relative to everything else.
_BARRIER_TARGETS: frozenset[object] = frozenset({
    torch._C._set_grad_enabled,
    torch.amp.autocast_mode._enter_autocast,
    torch.amp.autocast_mode._exit_autocast,
})


def is_barrier(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and node.target in _BARRIER_TARGETS


def run_real(node: torch.fx.Node, full: Mapping[str, Any], replace: Mapping[str, torch.Tensor],
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


class _NotReal(Exception):
    pass


def named_args(node, args, kwargs) -> dict | None:
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
    log.debug("no signature for %s", describe(node))
    return None


def target_name(node: torch.fx.Node) -> str:
    """The name of the node's op: a method's name, "getitem", or the function's."""
    if node.op == "call_method":
        return node.target
    if node.target is operator.getitem:
        return "getitem"
    return getattr(node.target, "__name__", str(node.target))


def describe(node: torch.fx.Node) -> str:
    """The node as the refusals name it: `node mean (mean) in model.layers.0`."""
    stack = node.meta.get("nn_module_stack") or {}
    where = ""
    if stack:
        path = list(stack.values())[-1][0]
        where = " in " + (f"model.{module_path(path)}" if module_path(path) else "model")
    return f"node {node.name} ({target_name(node)}){where}"
