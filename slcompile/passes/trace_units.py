"""Trace each distinct (block, sub-batch) unit once: AOTAutograd sees the units of
a rewritten Dynamo graph as calls of one subgraph per distinct unit, and the joint
graph it returns is made flat again before any other pass reads it.

A rewritten step holds K copies of every block, and the blocks of a model are
copies of each other. Traced flat, AOTAutograd dispatches, functionalizes and
differentiates every op of every copy. `outline_units` cuts each (block, sub-batch)
run of the Dynamo graph out as a call of PyTorch's `invoke_subgraph` higher-order op,
the same subgraph for units that are the same graph on inputs of the same size,
stride, dtype and `requires_grad`; AOTAutograd then traces, differentiates and
partitions each distinct subgraph once and records every other unit as a call.
`inline_units` puts the calls' (partitioned) forward and backward subgraphs back in
place in the joint graph (or an inference graph): each copy's nodes carry the
unit's tag and module path, so the joint, partitioned and compiled stages read the
graph they read when it was traced flat.

Used by `slcompile.backends.lowering.lower` (the `trace_units_once` option); the
joint graph's first reader (the partitioner's wrapper, Inductor's joint pre-pass, the
inference graph's passes) inlines the calls before anything else reads it.

Needs: a Dynamo graph rewritten by `interleave` (`SlcMeta` tags on its nodes, their
`example_value`s).
Guarantees:
- The flat joint graph computes what a flat trace computes: the same ops on the same
  values, each unit's values kept as AOTAutograd's partition of the subgraph keeps
  them (the weights' gradients are summed over the calls outside them, as flat).
- A unit is left in the graph (traced flat) when cutting it out could change what
  is traced: it writes to an input, draws random numbers (dropout that drops nothing
  aside), takes an input that is not a tensor or an int, returns a value that is
  not a tensor or that views its inputs or another output, or reads a value made
  after its first node. The record says how many units became calls.
- No subgraph writes to an input: `invoke_subgraph`'s own check of a subgraph's
  schema is made once per subgraph here; the same check at every call of it while
  AOTAutograd traces for training (on torch 2.13 a trace of the subgraph per call,
  which made the outlined trace slower than the flat one) is skipped while the
  outlined graph is traced (`tracing_calls`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import operator
import re
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch._dispatch.python import enable_python_dispatcher
from torch._subclasses.fake_tensor import FakeTensor
from torch.multiprocessing.reductions import StorageWeakRef

from slcompile.compat import graph_module
from slcompile.meta import get_slc_meta

__all__ = ["TracedUnits", "UnitCalls", "has_unit_calls", "inline_units", "outline_units", "tracing_calls",
           "unit_variants"]

log = logging.getLogger(__name__)

_INVOKE_SUBGRAPH = torch.ops.higher_order.invoke_subgraph
_PREFIX = "slc_unit_"
_IDENTIFIER = re.compile(rf"{_PREFIX}\d+")
_PATH = "slc_unit_path"  # meta["custom"] key of a call: the unit's module path
_RANDOM = ("rand", "bernoulli", "normal", "uniform", "multinomial", "dropout", "poisson", "exponential")


@dataclasses.dataclass(frozen=True)
class TracedUnits:
    """How AOTAutograd traced a step's (block, sub-batch) units (`CompileReport.traced_units`).

    Attributes:
        calls: the units traced as calls of a subgraph.
        subgraphs: the distinct subgraphs they call, each traced once (its backward
            once per layout of the gradients it receives: a unit whose output the
            suffix joins gets views into the whole batch's gradient).
        kept: units traced flat, with the reason: `("blk1.sb0", "writes to an input")`.
        variants: the forward-backward pairs AOTAutograd traced and partitioned for
            those subgraphs, read from the joint graph (0 until it is).
    """

    calls: int
    subgraphs: int
    kept: tuple[tuple[str, str], ...] = ()
    variants: int = 0


@dataclasses.dataclass(frozen=True)
class UnitCalls:
    """What `outline_units` made of a Dynamo graph.

    Attributes:
        graph: the Dynamo graph with the units as calls (the input graph is left as it was).
        traced: how many units became calls of how many subgraphs, and which did not.
        origins: subgraph identifier -> the module path of the unit it was cut from
            (the path every copy's nodes carry until `inline_units` renames them).
    """

    graph: torch.fx.GraphModule
    traced: TracedUnits
    origins: dict[str, str]


def outline_units(gm: torch.fx.GraphModule) -> UnitCalls | None:
    """A copy of `gm` whose (block, sub-batch) units are `invoke_subgraph` calls, one
    subgraph per distinct unit; None when no unit can be cut out (`gm` is left as
    it is)."""
    graph = torch.fx.Graph()
    copies: dict[torch.fx.Node, torch.fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, copies))
    outlined = graph_module(gm, graph)
    # The values of nodes the rewrite made (a sub-batch's slice), since copies of a
    # unit share a subgraph only where their inputs' sizes are known the same.
    _fill_examples(graph)
    runs: dict[str, list[torch.fx.Node]] = {}
    for node in graph.nodes:
        meta = get_slc_meta(node)
        if node.op in ("call_function", "call_method") and meta is not None and meta.region == "block" \
                and meta.subbatch is not None:
            runs.setdefault(meta.tag, []).append(node)
    order = {node: position for position, node in enumerate(graph.nodes)}
    bodies: dict[tuple, str] = {}
    refused: dict[tuple, str] = {}  # signatures of subgraphs that write to an input
    origins: dict[str, str] = {}
    kept, calls = [], 0
    for tag, members in runs.items():
        unit = _unit(members, order)
        if isinstance(unit, str):
            kept.append((tag, unit))
            continue
        inputs, outputs, anchor = unit
        body = _body(outlined, members, inputs, outputs)
        signature = _signature(body)
        if signature in refused:
            kept.append((tag, refused[signature]))
            continue
        name = bodies.get(signature)
        path = _unit_path(members)
        if name is None:
            name = f"{_PREFIX}{len(bodies)}"
            problem = _writes_an_input(body, name, inputs)
            if problem is not None:
                refused[signature] = problem
                kept.append((tag, problem))
                continue
            bodies[signature] = name
            origins[name] = path
            outlined.register_module(name, body)
        _replace(graph, name, members, inputs, outputs, path, anchor)
        calls += 1
    for tag, reason in kept:
        log.debug("traced flat: %s: %s", tag, reason)
    if not calls:
        return None
    graph.lint()
    outlined.recompile()
    log.debug("outlined %d units as calls of %d subgraphs; kept %s", calls, len(bodies), kept)
    return UnitCalls(outlined, TracedUnits(calls, len(bodies), tuple(kept)), origins)


def _fill_examples(graph: torch.fx.Graph) -> None:
    """`example_value` of each op call that has none, computed on its arguments' in
    their fake mode."""
    fake = next((value for node in graph.nodes if isinstance(value := _example(node), FakeTensor)), None)
    if fake is None:
        return
    fake_mode = fake.fake_mode
    for node in graph.nodes:
        # A pass's own values (a fetched weight's) rest on the meta device.
        value = _example(node)
        if isinstance(value, torch.Tensor) and not isinstance(value, FakeTensor) and value.device.type == "meta":
            with fake_mode:
                node.meta["example_value"] = torch.empty_strided(
                    value.shape, value.stride(), dtype=value.dtype, device=fake.device)
    for node in graph.nodes:
        if node.op not in ("call_function", "call_method") or _example(node) is not None:
            continue
        missing = False

        def value(arg: torch.fx.Node) -> Any:
            nonlocal missing
            example = _example(arg)
            missing = missing or example is None
            return example

        args, kwargs = torch.fx.node.map_arg((node.args, node.kwargs), value)
        if missing:
            continue
        try:
            with fake_mode, enable_python_dispatcher():
                if node.op == "call_method":
                    example = getattr(args[0], node.target)(*args[1:], **kwargs)
                else:
                    example = node.target(*args, **kwargs)
        except Exception as error:  # noqa: BLE001 - the unit that reads it stays in the graph
            log.debug("no example value for %s: %s", node.format_node(), error)
            continue
        node.meta["example_value"] = example


def _unit(members: list[torch.fx.Node], order: dict) -> tuple[list, list, torch.fx.Node | None] | str:
    """(inputs, outputs, the input the call goes after or None: before the run) of
    a unit's run of nodes, or why it stays in the graph."""
    inside = set(members)
    inputs: list[torch.fx.Node] = []
    for node in members:
        if _draws(node):
            return "draws random numbers"
        for value in node.all_input_nodes:
            if value not in inside and value not in inputs:
                inputs.append(value)
    # The call goes where the run starts or, where it reads a value made inside its
    # span (a weight fetched just before its first use), after the last such value,
    # so long as nothing outside reads the run's values before that. (The results of
    # units already cut out sit where their run started: before.)
    last = max(inputs, key=lambda value: order.get(value, -1), default=None)
    anchor = last if last is not None and order.get(last, -1) > order[members[0]] else None
    if any(not isinstance(_example(value), (torch.Tensor, torch.SymInt, int)) or isinstance(_example(value), bool)
           for value in inputs):
        return "takes an input that is neither a tensor nor an int"
    outputs = [node for node in members if any(user not in inside for user in node.users)]
    if anchor is not None and any(order[user] < order[anchor] for node in outputs for user in node.users
                                  if user not in inside):
        return "is read from before it has all its inputs"
    storages = [StorageWeakRef(value.untyped_storage()) for value in map(_example, inputs)
                if isinstance(value, torch.Tensor)]
    for node in outputs:
        value = _example(node)
        if not isinstance(value, torch.Tensor):
            return "returns a value that is not a tensor"
        storage = StorageWeakRef(value.untyped_storage())
        if storage in storages:
            return "returns a view of an input or of another output"
        storages.append(storage)
    return inputs, outputs, anchor


def _example(node: torch.fx.Node) -> Any:
    return node.meta.get("example_value", node.meta.get("val"))


def _draws(node: torch.fx.Node) -> bool:
    target = node.target
    name = target if isinstance(target, str) else getattr(target, "__name__", "")
    if name == "scaled_dot_product_attention":
        dropout = node.kwargs.get("dropout_p", node.args[4] if len(node.args) > 4 else 0.0)
        return dropout != 0
    if not any(word in name for word in _RANDOM):
        return False
    if "dropout" in name:
        # F.dropout(x, p, training): nothing is drawn when p is 0 or training is False.
        args = dict(zip(("input", "p", "training"), node.args))
        args.update(node.kwargs)
        return args.get("p", 0.5) != 0 and args.get("training", True) is not False
    return True


def _writes_an_input(body: torch.fx.GraphModule, name: str, inputs: list) -> str | None:
    """Why the subgraph cannot be a call (it writes to an input, or its schema could
    not be read), or None: `invoke_subgraph`'s own check, made once per subgraph
    instead of at every call."""
    examples = [_example(value) for value in inputs]
    fake_mode = next((value.fake_mode for value in examples if isinstance(value, FakeTensor)), None)
    try:
        # (Without gradients: the examples are leaves, which a write would refuse.)
        with fake_mode if fake_mode is not None else contextlib.nullcontext(), torch.no_grad():
            schema = _INVOKE_SUBGRAPH.gen_schema(body, name, *examples)
    except Exception as error:  # noqa: BLE001 - the unit is traced flat
        return f"its schema could not be read ({type(error).__name__}: {error})"
    if any(argument.is_write for argument in schema.arguments):
        return "writes to an input"
    return None


def _body(root: torch.fx.GraphModule, members: list, inputs: list, outputs: list) -> torch.fx.GraphModule:
    graph = torch.fx.Graph()
    values: dict[torch.fx.Node, torch.fx.Node] = {}
    for value in inputs:
        placeholder = graph.placeholder(value.name)
        placeholder.meta.update(value.meta)
        values[value] = placeholder
    for node in members:
        values[node] = graph.node_copy(node, values.__getitem__)
    graph.output(tuple(values[node] for node in outputs))
    return graph_module(root, graph)


def _signature(body: torch.fx.GraphModule) -> tuple:
    """The subgraph as data that two copies of a unit share: its ops, their arguments
    (nodes by position) and its inputs' size, stride, dtype and `requires_grad`."""
    position = {node: index for index, node in enumerate(body.graph.nodes)}

    def args(value):
        return repr(torch.fx.node.map_arg(value, lambda node: f"%{position[node]}"))

    def spec(node):
        value = _example(node)
        if isinstance(value, torch.Tensor):
            return ("tensor", str(tuple(value.shape)), str(value.stride()), str(value.dtype), str(value.device),
                    value.requires_grad)
        return ("int", str(value) if isinstance(value, torch.SymInt) else "int")

    return tuple((node.op, spec(node)) if node.op == "placeholder" else
                 (node.op, str(node.target), args(node.args), args(node.kwargs)) for node in body.graph.nodes)


def _unit_path(members: list[torch.fx.Node]) -> str:
    """The deepest module every node of the unit runs inside (`nn_module_stack`)."""
    common = None
    for node in members:
        paths = [path for path, _ in (node.meta.get("nn_module_stack") or {}).values()]
        if common is None:
            common = paths
        else:
            shared = 0
            while shared < min(len(common), len(paths)) and common[shared] == paths[shared]:
                shared += 1
            common = common[:shared]
    return common[-1] if common else ""


def _replace(graph: torch.fx.Graph, name: str, members: list, inputs: list, outputs: list, path: str,
             anchor: torch.fx.Node | None) -> None:
    first = members[0]
    with graph.inserting_before(first if anchor is None else anchor.next):
        body = graph.get_attr(name)
        call = graph.call_function(_INVOKE_SUBGRAPH, (body, name, *inputs))
        call.meta.update({key: first.meta[key] for key in ("nn_module_stack", "stack_trace") if key in first.meta})
        call.meta["custom"] = {**(first.meta.get("custom") or {}), _PATH: path}
        results = []
        for index, node in enumerate(outputs):
            result = graph.call_function(operator.getitem, (call, index))
            result.meta.update(node.meta)
            results.append(result)
    inside = set(members)
    for node, result in zip(outputs, results):
        node.replace_all_uses_with(result, delete_user_cb=lambda user: user not in inside)
    for node in reversed(members):
        graph.erase_node(node)


def has_unit_calls(graph: torch.fx.Graph) -> bool:
    """Whether `graph` calls a unit's subgraph (forward or backward)."""
    return any(_is_unit_call(node) for node in graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH))


def _is_unit_call(node: torch.fx.Node) -> bool:
    return _identifier(node.args[1]) is not None


def unit_variants(graph: torch.fx.Graph) -> int:
    """The distinct forward subgraphs of units `graph` calls (in a joint graph, one
    per pair AOTAutograd traced and partitioned)."""
    return len({call.args[0].target for call in graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH)
                if _is_unit_call(call) and not call.args[1].removeprefix("partitioned_").startswith("bw_")})


def inline_units(graph: torch.fx.Graph, origins: dict[str, str]) -> int:
    """Replaces every call of a unit's subgraph in `graph` (a joint, forward, backward
    or inference graph of AOTAutograd) by the subgraph's nodes; returns how many.

    Each copy's nodes carry the call's tag (`meta["custom"]`) and module paths renamed
    from the unit the subgraph was cut from (`origins`) to the call's own."""
    module = graph.owning_module
    inlined, used = 0, set()
    for call in list(graph.find_nodes(op="call_function", target=_INVOKE_SUBGRAPH)):
        if not _is_unit_call(call):
            continue
        attribute = call.args[0].target
        body = getattr(module, attribute)
        used.add(attribute)
        custom = dict(call.meta.get("custom") or {})
        path = custom.pop(_PATH, None)
        origin = origins.get(_identifier(call.args[1]))
        values: dict[torch.fx.Node, Any] = dict(zip(body.graph.find_nodes(op="placeholder"), call.args[2:]))
        results: tuple = ()
        live = _live_nodes(body.graph)
        with graph.inserting_before(call):
            for node in body.graph.nodes:
                if node.op == "placeholder" or node not in live:
                    continue
                if node.op == "output":
                    results = tuple(node.args[0])
                    continue
                if node.op == "get_attr":
                    values[node] = _lift(graph, module, body, node)
                    continue
                copy = graph.node_copy(node, values.__getitem__)
                copy.meta["custom"] = {**(node.meta.get("custom") or {}), **custom}
                if path is not None and origin is not None and origin != path:
                    _rename_paths(copy.meta, origin, path)
                values[node] = copy
        outputs = [values[value] if isinstance(value, torch.fx.Node) else value for value in results]
        for user in list(call.users):
            if user.target is not operator.getitem:
                raise AssertionError(f"a call of {attribute} is read by {user.format_node()}, not by getitem")
            user.replace_all_uses_with(outputs[user.args[1]])
            graph.erase_node(user)
        body_node = call.args[0]
        graph.erase_node(call)
        if not body_node.users:
            graph.erase_node(body_node)
        inlined += 1
    for attribute in used:
        if not graph.find_nodes(op="get_attr", target=attribute):
            delattr(module, attribute)
    if inlined:
        graph.lint()
        module.recompile()
    return inlined


def _live_nodes(graph: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a subgraph that its outputs or a side effect need. A subgraph's
    partitioned backward can hold a forward op nobody reads (the CPU flash
    attention's, multi-output): copied into the step, the partitioner would take it
    for a tensor it cannot save, where a flat trace has no such node."""
    live: set[torch.fx.Node] = set()
    for node in reversed(graph.nodes):
        if node.op in ("output", "placeholder") or node in live or node.is_impure(impure_random=False):
            live.add(node)
            live.update(node.all_input_nodes)
    return live


def _identifier(identifier: Any) -> str | None:
    """The identifier `outline_units` gave a unit's subgraph, from that of a call in
    an AOTAutograd graph: its own, its backward's (`bw_<identifier>_<n>`) or a
    partitioned one's (`partitioned_fw_<identifier>_<n>`); None for another call."""
    match = _IDENTIFIER.search(identifier) if isinstance(identifier, str) else None
    return match.group(0) if match else None


def _lift(graph: torch.fx.Graph, module: torch.nn.Module, body: torch.nn.Module, node: torch.fx.Node) -> torch.fx.Node:
    """A constant of a subgraph as an attribute of the graph's module."""
    value = getattr(body, node.target)
    name = f"_slc_unit_constant_{id(value):x}"
    if not hasattr(module, name):
        module.register_buffer(name, value) if isinstance(value, torch.Tensor) else setattr(module, name, value)
    lifted = graph.get_attr(name)
    lifted.meta.update(node.meta)
    return lifted


def _rename_paths(meta: dict, origin: str, path: str) -> None:
    """Module paths under `origin` in a node's module stacks, under `path` instead."""
    for key in ("nn_module_stack", "fwd_nn_module_stack"):
        stack = meta.get(key)
        if stack:
            meta[key] = {name: (_renamed(where, origin, path), kind) for name, (where, kind) in stack.items()}


def _renamed(where: str, origin: str, path: str) -> str:
    if where == origin or (where.startswith(origin) and where[len(origin)] in ".["):
        return path + where[len(origin):]
    return where


@contextlib.contextmanager
def tracing_calls() -> Iterator[None]:
    """While AOTAutograd traces an outlined step: `invoke_subgraph` calls traced for
    training skip their check for writes to their inputs, which traces the subgraph
    again at every call (`outline_units` checked each subgraph once), and torch's
    warning that a subgraph's backward was traced more than once (expected: see
    `TracedUnits.variants`) is not shown."""
    missing = object()
    previous = _INVOKE_SUBGRAPH.__dict__.get("_supports_training_input_mutation", missing)
    _INVOKE_SUBGRAPH._supports_training_input_mutation = True
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="invoke_subgraph traced multiple backward graphs")
            yield
    finally:
        if previous is missing:
            del _INVOKE_SUBGRAPH._supports_training_input_mutation
        else:
            _INVOKE_SUBGRAPH._supports_training_input_mutation = previous
