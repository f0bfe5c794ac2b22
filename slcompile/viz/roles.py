"""What each node of a compiled graph is for, and where a picture draws it.

Needs: a graph whose nodes carry `SlcMeta` tags (the rewritten Dynamo graph, or the
AOTAutograd forward/backward graphs in `CompileReport.graphs`). AOTAutograd keeps
only the tag (`blk3.sb1`) of each node, not its role, so on those graphs the roles
the rewrite inserted are recognised from the graph itself:
- transfers: calls of the `slc::` transfer ops (`slcompile.vocabulary`): issues and
  waits of weight fetches, activation stashes and unstashes;
- split: a slicing op that hands one sub-batch a piece of a value that is not that
  sub-batch's alone (a batch input, the tangent of concatenated outputs);
- combine: a node where values of different sub-batches meet (the loss summed over
  sub-batches, a weight gradient accumulated over them).
An annotated role other than "compute" (graphs before AOTAutograd) wins.

Guarantees: `classify_nodes` is a pure function of the graph; every node gets a role
and the cluster (tag) it is drawn in; untagged nodes are drawn with the block their
inputs belong to when they all agree.
"""

from __future__ import annotations

import dataclasses
import logging
import operator
import re

import torch
import torch.fx

from slcompile.meta import get_slc_meta
from slcompile.units import format_bytes as _format_bytes
from slcompile.vocabulary import WeightKey, is_fetch, is_mark, is_unstash_wait, transfer_kind

__all__ = [
    "NodeRole",
    "INSERTED_ROLES",
    "TRANSFER_ROLES",
    "classify_nodes",
    "transfer_nodes",
    "transfer_role",
    "cluster_parent",
    "short_op_name",
    "short_key",
    "value_bytes",
    "transfer_bytes",
    "fetched_weight_bytes",
    "format_bytes",
]

log = logging.getLogger(__name__)

TRANSFER_ROLES = ("load", "store", "wait")
INSERTED_ROLES = ("split", "combine", *TRANSFER_ROLES)
"""Roles of nodes the rewrite inserted (pictures highlight them)."""

_SLICING = frozenset({"slice", "narrow", "split", "split_with_sizes", "chunk", "tensor_split", "unbind", "select"})


@dataclasses.dataclass(frozen=True)
class NodeRole:
    """One node's role and place.

    Attributes:
        role: "input", "output", "marker", "compute", or one of `INSERTED_ROLES`.
        cluster: the tag of the cluster it is drawn in (`blk3.sb1`, `blk3` for work
            shared by a block's sub-batches, `prefix`), or None (top level).
        subbatches: the sub-batches whose data the node's value carries.
    """

    role: str
    cluster: str | None
    subbatches: frozenset[int] = frozenset()


def transfer_role(node: torch.fx.Node) -> str | None:
    """"load" (a weight fetch, the issue of a load), "store" (the issue of a store) or
    "wait" (for a store or an activation load) for a transfer op call, else None."""
    kind = transfer_kind(node)
    if kind is None:
        return None
    what, half = kind
    if what == "fetch":
        return "load"  # the fetch itself is the weight, drawn as its load
    if half == "wait":
        return "wait"
    return "store" if what in ("stash", "store_grad") else "load"


def transfer_nodes(gm: torch.fx.GraphModule) -> tuple[str, ...]:
    """The names of the transfer nodes of `gm`, in program order."""
    return tuple(node.name for node in gm.graph.nodes if transfer_role(node) is not None)


def classify_nodes(gm: torch.fx.GraphModule) -> dict[str, NodeRole]:
    """The role and cluster of every node of `gm`, by node name.

    Args:
        gm: a tagged graph.

    Returns:
        node name -> NodeRole, in program order.
    """
    nodes = list(gm.graph.nodes)
    carried = _carried_subbatches(nodes)
    position = {node: i for i, node in enumerate(nodes)}
    roles: dict[str, NodeRole] = {}
    for node in nodes:
        meta = get_slc_meta(node)
        tag = meta.tag if meta is not None else None
        if node.op == "placeholder":
            roles[node.name] = NodeRole("input", tag, carried[node])
            continue
        if node.op == "output":
            roles[node.name] = NodeRole("output", None)
            continue
        if is_mark(node):
            roles[node.name] = NodeRole("marker", None)
            continue
        role = transfer_role(node)
        if role is None and meta is not None and meta.role != "compute":
            role = meta.role
        if role is None and _is_split(node, carried):
            role = "split"
        if role is None and (meta is None or meta.subbatch is None) and _is_combine(node, carried):
            role = "combine"
        cluster = tag if tag is not None else _cluster_from_inputs(node, roles, position, role == "combine")
        roles[node.name] = NodeRole(role or "compute", cluster, carried[node])
    return roles


def cluster_parent(tag: str) -> str | None:
    """`blk3.sb1` -> `blk3`; `prefix.sb0` -> `prefix`; a tag without sub-batch -> None."""
    if "." not in tag:
        return None
    return tag.split(".", 1)[0]


def _carried_subbatches(nodes: list[torch.fx.Node]) -> dict[torch.fx.Node, frozenset[int]]:
    """Sub-batches a value carries: its own, or (shared, untagged) its inputs' union."""
    carried: dict[torch.fx.Node, frozenset[int]] = {}
    for node in nodes:
        meta = get_slc_meta(node)
        if meta is not None and meta.subbatch is not None:
            carried[node] = frozenset((meta.subbatch,))
        else:
            carried[node] = frozenset().union(*(carried.get(i, frozenset()) for i in node.all_input_nodes))
    return carried


def _is_split(node: torch.fx.Node, carried) -> bool:
    if short_op_name(node) not in _SLICING or not node.all_input_nodes:
        return False
    source = carried[node.all_input_nodes[0]]
    meta = get_slc_meta(node)
    if meta is not None and meta.subbatch is not None:
        target = frozenset((meta.subbatch,))
    else:
        users = [carried[user] for user in node.users]
        target = users[0] if users and all(u == users[0] for u in users) else frozenset()
    return len(target) == 1 and source != target


def _is_combine(node: torch.fx.Node, carried) -> bool:
    parts = {carried[i] for i in node.all_input_nodes if carried[i]}
    return len(parts) >= 2


def _cluster_from_inputs(
    node: torch.fx.Node, roles: dict[str, NodeRole], position: dict[torch.fx.Node, int], combine: bool
) -> str | None:
    """An untagged node is drawn where its inputs are: a combine in its block's
    shared cluster, anything else with its latest placed input (it runs after that
    input, as `order_layer_major` ranks it)."""
    placed = [i for i in node.all_input_nodes if roles.get(i.name) and roles[i.name].cluster]
    if not placed:
        return None
    if combine:
        heads = {roles[i.name].cluster.split(".", 1)[0] for i in placed}
        return heads.pop() if len(heads) == 1 else None
    return roles[max(placed, key=position.__getitem__).name].cluster


def short_op_name(node: torch.fx.Node) -> str:
    """`addmm` for `aten.addmm.default`, `getitem`, `size` for a method call."""
    target = node.target
    if node.op in ("placeholder", "output", "get_attr", "call_method"):
        return str(target)
    if target is operator.getitem:
        return "getitem"
    if isinstance(target, torch._ops.OpOverload):
        return target.overloadpacket.__name__.lstrip("_") or str(target)
    return getattr(target, "__name__", str(target))


def short_key(key: str) -> str:
    """`w0|w0:l_self_modules_layers_modules_1_modules_ln1_parameters_weight_@fwd`
    -> `layers.1.ln1.weight`: the parameter a transfer key names, readable."""
    try:
        name = WeightKey.parse(key).stored.split(":", 1)[-1]
    except ValueError:  # a stored key (`w0:name`), as the runtime's events name it
        name = key.split(":", 1)[-1]
    name = re.sub(r"^l_self_", "", name)
    # Dynamo spells `layers.1.ln1.weight` as `modules_layers_modules_1_..._parameters_weight_`.
    name = re.sub(r"_?(modules|parameters|buffers)_", ".", name)
    return name.strip("._")


def value_bytes(node: torch.fx.Node) -> int:
    """Bytes of the tensor(s) in `node.meta["val"]` (0 when unknown or symbolic)."""
    return _bytes_of(node.meta.get("val"))


def fetched_weight_bytes(gm: torch.fx.GraphModule | torch.fx.Graph) -> dict[str, int]:
    """Stored weight key -> bytes of its `fetch_weight` in `gm` (for `transfer_bytes`)."""
    graph = gm if isinstance(gm, torch.fx.Graph) else gm.graph
    return {_stored_key(node.args[1]): value_bytes(node) for node in graph.nodes if is_fetch(node)}


def transfer_bytes(node: torch.fx.Node, weight_bytes: dict[str, int] | None = None) -> int:
    """Bytes the transfer a node belongs to moves (0 for other nodes, or unknown): a
    node's own value is often a token (a store's issue and wait, an activation load's
    issue, a weight load issued ahead), so the bytes are read where the data is: the
    stored tensor (`stash`, `offload_grad`), the loaded one (`unstash_wait`, the
    `fetch_weight` of the same stored weight in the graph; `weight_bytes`, from
    `fetched_weight_bytes`, saves the search when many nodes are asked)."""
    kind = transfer_kind(node)
    if kind is None:
        return 0
    what, half = kind
    if what == "fetch":
        if half == "wait":
            return value_bytes(node)
        if weight_bytes is None:
            weight_bytes = fetched_weight_bytes(node.graph)
        # A load issued ahead for the other phase reads the same stored weight.
        return weight_bytes.get(_stored_key(node.args[0]) if node.args else None, 0)
    if what == "unstash":
        if half == "wait":
            return value_bytes(node)
        return sum(value_bytes(user) for user in node.users if is_unstash_wait(user))
    # A store (activation or gradient): the tensor it stores; its wait names the issue.
    issue = node.args[0] if half == "wait" else node
    if isinstance(issue, torch.fx.Node) and issue.args and isinstance(issue.args[0], torch.fx.Node):
        return value_bytes(issue.args[0])
    return 0


def _stored_key(key) -> str | None:
    try:
        return WeightKey.parse(key).stored
    except (ValueError, TypeError):
        return None


def _bytes_of(value) -> int:
    if isinstance(value, torch.Tensor):
        try:
            return int(value.numel()) * value.element_size()
        except (TypeError, RuntimeError):  # a symbolic size the hint cannot settle
            return 0
    if isinstance(value, (list, tuple)):
        return sum(_bytes_of(v) for v in value)
    return 0


def format_bytes(count: float) -> str:
    """`12.0 KiB`, `1.5 MiB`: `slcompile.units.format_bytes` with one decimal."""
    return _format_bytes(count, digits=1)
