"""Routing: a mixture of experts flattens batch and sequence into one token
dimension, sorts the tokens by expert, gathers them, multiplies each expert's group
and puts the results back in token order. Run per sub-batch, those ops route the
sub-batch's own tokens; the values in between are the sub-batch's own, not slices of
the full batch's. `Route` says what such a value holds, and the rules accept an op
on one only where its meaning carries over; no routed value leaves its block.
Functions of the walk's `PropagationState`, called by `propagate`; they keep its
`routes`."""

from __future__ import annotations

import dataclasses

import torch
import torch.fx
from torch.utils import _pytree as pytree

from slcompile.analysis.batch_propagation.cross_sample import getitem_touches_batch, mixes_samples
from slcompile.analysis.batch_propagation.nodes import describe, named_args, target_name
from slcompile.analysis.batch_propagation.plan import BATCHED_INT, NodeSplit
from slcompile.analysis.batch_propagation.state import PropagationState

__all__ = ["Route", "TOKENS", "routing", "is_counts", "route_mismatch"]


@dataclasses.dataclass(frozen=True)
class Route:
    """What a value holds when each sub-batch routes its own tokens (`routing`).

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
TOKENS = Route("tokens")
_SORTS = frozenset({"sort", "argsort", "msort"})
_COUNTS = frozenset({"histc", "bincount"})
_SCATTERS = frozenset({"setitem", "index_add", "index_add_", "index_copy", "index_copy_"})
# Ops that keep what the values mean (a dtype, a copy).
_KEEP_VALUES = frozenset({"to", "float", "int", "long", "clone", "contiguous", "detach"})


def _basic_index(index) -> bool:
    """Whether a subscript holds only ints, slices, None and Ellipsis (no tensor)."""
    items = index if isinstance(index, tuple) else (index,)
    return all(
        item is None or item is Ellipsis or isinstance(item, (int, torch.SymInt))
        or (isinstance(item, slice) and not any(isinstance(v, torch.Tensor) for v in (item.start, item.stop, item.step)))
        for item in items
    )


def is_counts(route) -> bool:
    """Whether a routed value holds counts per expert (or their cumulative sum)."""
    return isinstance(route, Route) and route.kind in ("counts", "offsets")


def route_mismatch(node, route, out_bdims, full_out) -> str | None:
    """A routed result must keep its rows along dim 0 (counts: no batch dimension)."""
    routes = route if isinstance(route, tuple) else None
    leaves = pytree.tree_leaves(full_out)
    bdims = pytree.tree_leaves(out_bdims, is_leaf=lambda x: x is None)
    for i, (leaf, bdim) in enumerate(zip(leaves, bdims)):
        if not isinstance(leaf, torch.Tensor):
            continue
        r = routes[i] if routes is not None else route
        if r is TOKENS or is_counts(r):
            if is_counts(r) and bdim is not None:
                return f"{describe(node)} counts per sub-batch but its result scales with the batch"
            continue
        if bdim != 0 or leaf.shape[0] != r.length:
            return f"{describe(node)} changes the rows of tokens routed by their sub-batch"
    return None


def routing(state: PropagationState, node, args, kwargs):
    """(route, None) or (None, reason) for what takes part in routing tokens, or
    None for everything else.

    A mixture of experts flattens batch and sequence into one token dimension
    that carries the batch, sorts the tokens by expert, gathers them, multiplies
    each expert's group and puts the results back in token order. Run on one
    sub-batch, the same code routes that sub-batch's tokens only: every token's
    result is the same, though the values in between (the sorted order, the
    positions, the counts per expert) are the sub-batch's own, not slices of the
    full batch's. `Route` says what such a value holds; the rules below accept
    an op on one only where the meaning carries over, and such values never leave
    the block that routes them.
    """
    name = target_name(node)
    routed = {n.name: state.routes[n.name] for n in node.all_input_nodes if n.name in state.routes}
    in_block = state.regions.get(node.name) == "block"
    if not routed:
        return _start_routing(state, node, name, args, kwargs) if in_block else None
    if not in_block:
        return None, f"{describe(node)} reads {', '.join(routed)}, routed inside a block, outside of it"
    source = node.args[0] if node.args else None
    first = routed.get(source.name) if isinstance(source, torch.fx.Node) else None
    if name == "getitem" and first is not None and isinstance(state.full[source.name], (tuple, list)):
        return (first[node.args[1]] if isinstance(first, tuple) else first), None
    if any(isinstance(r, tuple) for r in routed.values()):
        return None, f"{describe(node)} uses a routing result as a whole"
    if name in ("size", "numel", "dim"):
        return TOKENS, None
    if name in _KEEP_VALUES and first is not None and len(node.all_input_nodes) == 1:
        return first, None
    if name == "getitem" and first is not None and first.kind == "rows" and _basic_index(args[1]):
        return _route_basic_index(state, node, args, first)
    if name in ("getitem", "index_select"):
        return _route_gather(state, node, name, args, kwargs, routed)
    if name in ("floordiv", "remainder", "mod") and first is not None and first.kind == "positions":
        return _route_positions_arithmetic(state, node, name, first)
    if name in _SCATTERS:
        return _route_scatter(state, node, name, args, kwargs, routed)
    if "grouped_mm" in name:
        return _route_grouped_mm(state, node, args, kwargs, routed)
    if name in ("empty_like", "zeros_like") and first is not None:
        return Route("fresh", order=first.order, length=first.length), None
    if name in _COUNTS:
        return _route_counts(state, node, name, args, kwargs)
    return _route_rowwise(state, node, args, kwargs, routed)


def _start_routing(state: PropagationState, node, name, args, kwargs):
    """Sorts along a 1-D token dimension, counts per expert, positions 0..n-1."""
    if name in _SORTS or name in _COUNTS:
        source = node.args[0] if node.args else None
        bdim = state.splits[source.name].out_bdims if isinstance(source, torch.fx.Node) else None
        tensor = args[0] if args else None
        if bdim != 0 or not isinstance(tensor, torch.Tensor) or tensor.dim() != 1:
            return None
        if name in _COUNTS:
            return _route_counts(state, node, name, args, kwargs)
        named = named_args(node, args, kwargs) or {}
        if named.get("dim", -1) not in (0, -1):
            return None
        length = tensor.shape[0]
        rows = Route("rows", order=node.name, length=length, sorted_keys=True)
        positions = Route("positions", order=node.name, length=length, space=length, bijective=True)
        if name == "argsort":
            return positions, None
        return (rows if name == "msort" else (rows, positions)), None
    if name == "arange" and len(node.args) == 1 and isinstance(node.args[0], torch.fx.Node):
        if state.splits[node.args[0].name].out_bdims == BATCHED_INT:
            return Route("iota", length=state.full[node.args[0].name]), None
    return None


def _route_basic_index(state: PropagationState, node, args, rows):
    """x[..., ::2], x[:, 0]: indexing by ints and slices that leaves the rows (dim
    0) whole reads each routed row's own values (GPT-OSS splits each token's
    gate and up projections so): rows in the same order."""
    if getitem_touches_batch(node, args[1], args[0], 0) is not None:
        return None, (f"{describe(node)} picks among tokens routed by their sub-batch (it indexes their "
                      "rows, dim 0): on one sub-batch the same index picks other tokens")
    return Route("rows", order=rows.order, length=rows.length), None


def _route_gather(state: PropagationState, node, name, args, kwargs, routed):
    """x[positions] and x.index_select(0, positions): rows in the positions' order."""
    source = node.args[0]
    if name == "getitem":
        index, dim = node.args[1], 0
    else:
        index = node.args[2] if len(node.args) > 2 else node.kwargs.get("index")
        dim = (named_args(node, args, kwargs) or {}).get("dim")
    positions = routed.get(index.name) if isinstance(index, torch.fx.Node) else None
    what = f"{describe(node)} indexes tokens routed by their sub-batch"
    if (
        positions is not None and positions.kind == "rows" and isinstance(source, torch.fx.Node)
        and not state.batched(source.name) and name == "getitem"
    ):
        # A shared table (the experts' weights) looked up per routed row.
        return Route("rows", order=positions.order, length=positions.length), None
    if positions is None or positions.kind != "positions" or dim != 0 or not isinstance(source, torch.fx.Node):
        return None, what + " in a way that cannot be split"
    rows = routed.get(source.name)
    if rows is None:
        order = "" if state.splits[source.name].out_bdims == 0 else None
    else:
        order = rows.order if rows.kind == "rows" else None
    if order != positions.points or state.full[source.name].shape[0] != positions.space:
        return None, what + " with positions into other rows"
    if positions.order == "":
        return TOKENS, None
    return Route("rows", order=positions.order, length=positions.length), None


def _route_positions_arithmetic(state: PropagationState, node, name, positions):
    """Positions of pairs // pairs per token: positions of tokens (and % the rank
    within the token), exact when each sub-batch holds whole tokens."""
    divisor = node.args[1] if len(node.args) > 1 else None
    if not isinstance(divisor, int) or divisor <= 0 or (positions.space // state.num_subbatches) % divisor:
        return None, f"{describe(node)} divides token positions by a size that splits a sub-batch's tokens"
    if name == "floordiv":
        return dataclasses.replace(positions, space=positions.space // divisor, bijective=False), None
    if positions.order == "":
        return TOKENS, None
    return Route("rows", order=positions.order, length=positions.length), None


def _route_scatter(state: PropagationState, node, name, args, kwargs, routed):
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
    what = f"{describe(node)} writes routed tokens in a way that cannot be split"
    if dim != 0 or positions is None or positions.kind != "positions" or not isinstance(target, torch.fx.Node):
        return None, what
    if not name.startswith("index_add") and not positions.bijective:
        # A position written twice keeps the write that comes last in routed order.
        return None, what
    fresh = written is not None and written.kind == "fresh"
    space = positions.space
    if name == "setitem" and fresh and written.length == space == positions.length and (
        (rows is None and _make_iota(state, value, space, users_besides=node))
        or (rows is not None and rows.kind == "iota" and rows.length == space)
    ):
        state.routes[target.name] = Route(
            "positions", order=positions.points, length=space, points=positions.order, space=space,
            bijective=True,
        )
        return TOKENS, None
    in_tokens = fresh or (written is None and state.splits[target.name].out_bdims == 0)
    if (
        in_tokens and positions.points == "" and state.full[target.name].shape[0] == space
        and rows is not None and rows.kind == "rows" and rows.order == positions.order
        and rows.length == positions.length
    ):
        state.routes.pop(target.name, None)  # in token order from here on
        return TOKENS, None
    return None, what


def _make_iota(state: PropagationState, value, length, users_besides) -> bool:
    """A shared `arange(n)` of the full token count, read only here, becomes
    `arange(n / K)` per sub-batch: each sub-batch numbers its own tokens."""
    if not isinstance(value, torch.fx.Node) or target_name(value) != "arange" or value.args != (length,):
        return False
    if any(user is not users_besides for user in value.users) or length % state.num_subbatches:
        return False
    args = (length // state.num_subbatches,)
    state.sub[value.name] = state.execute(value, args, value.kwargs)
    state.splits[value.name] = NodeSplit("batched", out_bdims=0, args=args, kwargs=value.kwargs)
    return True


def _route_grouped_mm(state: PropagationState, node, args, kwargs, routed):
    """A grouped matmul of rows sorted by expert, with offsets counted from the
    same sort's keys: rows in that order."""
    source = node.args[0]
    offsets = node.kwargs.get("offs", node.args[2] if len(node.args) > 2 else None)
    rows = routed.get(getattr(source, "name", None))
    counts = routed.get(getattr(offsets, "name", None))
    others = [n for n in node.all_input_nodes if n is not source and n is not offsets and state.batched(n.name)]
    if (
        rows is None or rows.kind != "rows" or counts is None or counts.kind != "offsets"
        or counts.order != rows.order or others
    ):
        return None, f"{describe(node)} groups tokens by offsets not counted from their own sort"
    return Route("rows", order=rows.order, length=rows.length), None


def _route_counts(state: PropagationState, node, name, args, kwargs):
    """Tokens per expert: counts over the sub-batch's tokens."""
    source = node.args[0]
    named = named_args(node, args, kwargs) or {}
    if named.get("weights") is not None or (source.name not in state.routes and state.splits[source.name].out_bdims != 0):
        return None, f"{describe(node)} counts tokens in a way that cannot be split"
    rows = state.routes.get(source.name)
    if rows is not None and rows.kind != "rows":
        return None, f"{describe(node)} counts token positions"
    sorted_keys = rows is not None and rows.sorted_keys
    return Route("counts", order=rows.order if rows is not None else "", sorted_keys=sorted_keys), None


def _route_rowwise(state: PropagationState, node, args, kwargs, routed):
    """Row by row over rows in one routed order (or on counts alone)."""
    kinds = {r.kind for r in routed.values()}
    orders = {r.order for r in routed.values()}
    unrouted = [n for n in node.all_input_nodes if n.name not in routed and state.batched(n.name)]
    if kinds == {"counts"} and len(orders) == 1 and not unrouted:
        first = next(iter(routed.values()))
        named = named_args(node, args, kwargs) or {}
        if target_name(node) == "cumsum" and named.get("dim") in (0, -1) and first.sorted_keys:
            # The end of each expert's group in the sorted rows.
            return Route("offsets", order=first.order, sorted_keys=True), None
        return Route("counts", order=first.order, sorted_keys=False), None
    described = ", ".join(f"{n} ({r.kind})" for n, r in routed.items())
    if kinds == {"rows"} and len(orders) == 1 and unrouted:
        return None, (
            f"{describe(node)} combines tokens in the order their sub-batch routed them ({described}) "
            f"with tokens in their own order ({', '.join(n.name for n in unrouted)})"
        )
    if kinds != {"rows"} or len(orders) > 1 or unrouted:
        return None, f"{describe(node)} combines routed values {described} in a way that cannot be split"
    reason = mixes_samples(state, node, args, kwargs, None)
    if reason is not None:
        return None, reason
    first = next(iter(routed.values()))
    return Route("rows", order=first.order, length=first.length), None
