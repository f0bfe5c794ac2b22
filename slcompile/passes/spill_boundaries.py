"""Boundary activations on the activations' tier while they wait for their sub-batch's turn.

In a layer-major forward, the output of (block b, sub-batch s) is read by (block b+1,
sub-batch s), and the other sub-batches' steps run in between: the output waits on
the device. A schedule's `spill.*` and `fill.*` steps (`add_spills`) move it off the
device for that wait. `spill_boundaries` rewrites the forward (or inference) graph so
that, for each spilled (region, block, sub-batch):

- its boundary outputs (the tensors it makes that, outside itself, only its
  sub-batch's next region reads) are stored right after it is computed
  (`slc::stash`). An output the forward also stashes for the backward is stored once:
  that stash's store is the spill's, and its wait moves to the spill's;
- the store is waited for (`slc::wait`, which keeps the output alive until then)
  where the schedule's `spill.wait` step is: the output's memory goes there;
- the load is issued (`slc::unstash`) and waited for (`slc::unstash_wait`) where the
  `fill.issue` and `fill.wait` steps are, and the next region reads the loaded copy
  (so does the backward, for an output saved on the device).

Each step runs just before the first computing node of the compute step after it in
the schedule (after the weight fetches and the stash steps placed there), as in
`offload_saved`. The stash keys of spills carry `.spill.` after the tag, which is how
`schedule_of` reads the steps back.
"""

from __future__ import annotations

import dataclasses
import logging

import sympy
import torch
import torch.fx

from slcompile.analysis.order import runs_suffix_whole, unit_key
from slcompile.analysis.lifetimes import tensor_bytes
from slcompile.errors import PolicyError
from slcompile.meta import SlcMeta, get_slc_meta, set_slc_meta
from slcompile.passes.offload_activations import _base, _SizeSources, _step_of_nodes
from slcompile.schedules.base import Schedule, Step, next_region
from slcompile.vocabulary import SPILL_MARK, STASH, UNSTASH, UNSTASH_WAIT, WAIT, StashKey, fake_token, is_slc_op

__all__ = ["SpilledBoundaries", "spill_boundaries", "boundary_outputs"]

log = logging.getLogger(__name__)

@dataclasses.dataclass(frozen=True)
class SpilledBoundaries:
    """What `spill_boundaries` did.

    Attributes:
        names: the spilled forward nodes, in the forward's order.
        bytes: their total size per step, a sympy expression of the size symbols: each
            leaves the device once and comes back once in the forward.
        stored_bytes: of those, the bytes the spills store themselves (the rest is
            also stashed for the backward, and stored once for both).
    """

    names: tuple[str, ...] = ()
    bytes: sympy.Expr = sympy.Integer(0)
    stored_bytes: sympy.Expr = sympy.Integer(0)


def _key_of(node: torch.fx.Node, whole_suffix: bool) -> tuple[str, int | None, int | None] | None:
    return unit_key(get_slc_meta(node), whole_suffix)


def _tagged(node: torch.fx.Node, key: tuple, role: str) -> torch.fx.Node:
    region, block, subbatch = key
    set_slc_meta(node, SlcMeta(region, block, subbatch, role=role))
    return node


def boundary_outputs(fw: torch.fx.GraphModule, key: tuple, reader: tuple,
                     whole_suffix: bool = False) -> tuple[list[torch.fx.Node], str | None]:
    """The tensors the unit `key` makes that, outside itself, only `reader` reads
    (slc ops and the graph's output aside; `whole_suffix`: the suffix runs once,
    its key is ("suffix", None, None)), and why none can spill if one of them is a
    view of another tensor (its memory is its base's), else None."""
    found, problem = [], None
    for node in fw.graph.nodes:
        if node.op != "call_function" or is_slc_op(node) or _key_of(node, whole_suffix) != key:
            continue
        if not isinstance(node.meta.get("val"), torch.Tensor):
            continue
        outside = [u for u in node.users if u.op != "output" and not is_slc_op(u)
                   and _key_of(u, whole_suffix) != key]
        if not outside or any(_key_of(u, whole_suffix) != reader for u in outside):
            continue
        if _base(node) is not node:
            problem = f"its output {node.name} reaches the next region as a view of {_base(node).name}"
            continue
        found.append(node)
    return found, problem


def _anchors(schedule: Schedule, first: dict, output: torch.fx.Node) -> list[tuple[Step, torch.fx.Node]]:
    """The forward's spill and fill steps in order, each with the node it goes before:
    the first computing node of the compute step after it, or the graph's output."""
    placed, pending = [], []
    for step in schedule.phase("fwd").steps:
        if step.kind == "compute":
            anchor = first.get(step.key)
            if anchor is not None:
                placed += [(p, anchor) for p in pending]
                pending = []
        elif step.kind.startswith(("spill.", "fill.")):
            pending.append(step)
    return placed + [(p, output) for p in pending]


def spill_boundaries(
    fw: torch.fx.GraphModule, schedule: Schedule, graph_key, policy: str = "<unnamed>"
) -> SpilledBoundaries:
    """Moves the boundary outputs of the units the schedule spills to the activations'
    tier while they wait (in place; see the module docstring).

    Args:
        fw: the partitioned forward, after `offload_saved`, or an inference graph.
        schedule: the schedule (its request says which region reads each unit).
        graph_key: `graph_key(name) -> key` of the `slc::stash` op (a `StashKey`'s text).
        policy: the policy's name, for errors.

    Raises:
        PolicyError: a spilled unit has no output that only its next region reads.
    """
    spills = schedule.phase("fwd").spills()
    if not spills:
        return SpilledBoundaries()
    request = schedule.request
    output = fw.graph.output_node()
    _, first = _step_of_nodes(fw)
    whole = runs_suffix_whole(fw)
    sizes = _SizeSources(fw, set())
    outputs = list(output.args[0])
    spilled: dict[tuple, list[tuple[torch.fx.Node, torch.fx.Node, torch.fx.Node]]] = {}  # key -> (h, source, token)
    loads: dict[torch.fx.Node, torch.fx.Node] = {}
    names, total, stored = [], sympy.Integer(0), sympy.Integer(0)
    for step, anchor in _anchors(schedule, first, output):
        key = step.key
        if step.kind == "spill.issue":
            reader = next_region(key, request)
            nodes, problem = boundary_outputs(fw, key, reader, whole)
            if not nodes:
                raise PolicyError(policy, f"the compiled forward has no output of `{step.tag}` that only "
                                          f"`{Step('fwd', *reader).tag}` reads ({problem or 'nothing to spill'})",
                                  step.text())
            spilled[key] = [_store(fw, h, key, graph_key) for h in nodes]
            for h, source, token in spilled[key]:
                names.append(h.name)
                total += tensor_bytes(h.meta["val"])
                if token.meta.get("slc_spill_stores"):
                    stored += tensor_bytes(source.meta["val"])
            continue
        for h, source, token in spilled.get(key, ()):
            with fw.graph.inserting_before(anchor):
                if step.kind == "spill.wait":
                    node = _tagged(fw.graph.call_function(WAIT, (token, [source])), key, "store")
                    node.meta["val"] = fake_token()
                elif step.kind == "fill.issue":
                    node = loads[h] = fw.graph.call_function(UNSTASH, (token,))
                    node.meta["val"] = fake_token()
                    _tagged(node, _key_of(anchor, whole) or key, "load")
                else:
                    value = h.meta["val"]
                    node = fw.graph.call_function(UNSTASH_WAIT, (loads[h], sizes.emit(value.shape), value.dtype,
                                                                 value.device))
                    node.meta["val"] = value.contiguous()
                    _tagged(node, _key_of(anchor, whole) or key, "load")
                    reader = next_region(key, request)
                    h.replace_all_uses_with(node, delete_user_cb=lambda user, reader=reader: _key_of(user, whole) == reader
                                            and not is_slc_op(user))
                    outputs = [node if value is h else value for value in outputs]
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    fw.graph.lint()
    fw.recompile()
    log.debug("spilling %d boundary activations (%s bytes per step)", len(names), total)
    return SpilledBoundaries(tuple(names), sympy.expand(total), sympy.expand(stored))


def _store(fw: torch.fx.GraphModule, h: torch.fx.Node, key: tuple, graph_key):
    """(h, the stored tensor, the stash token) of a boundary output: the stash the
    forward already makes of it for the backward (its wait removed: the spill's
    replaces it), else a new store right after it."""
    tag = Step("fwd", *key).tag
    name = f"{tag}.{SPILL_MARK}.{h.name}"
    copies = [u for u in h.users if u.target is torch.ops.aten.clone.default
              and getattr(get_slc_meta(u), "role", None) == "store"]  # a stash's contiguous copy
    for source in (h, *copies):
        for token in [u for u in source.users if u.target is STASH]:
            for wait in [u for u in token.users if u.target is WAIT]:
                fw.graph.erase_node(wait)
            token.args = (source, graph_key(name, StashKey.parse(token.args[1]).tier))  # on the stash's tier
            return h, source, token
    source = h
    if not h.meta["val"].is_contiguous():
        with fw.graph.inserting_after(h):
            source = fw.graph.call_function(torch.ops.aten.clone.default, (h,),
                                            {"memory_format": torch.contiguous_format})
        source.meta["val"] = h.meta["val"].contiguous()
        _tagged(source, key, "store")
    with fw.graph.inserting_after(source):
        token = fw.graph.call_function(STASH, (source, graph_key(name)))
    token.meta["val"] = fake_token()
    token.meta["slc_spill_stores"] = True
    _tagged(token, key, "store")
    return h, source, token
