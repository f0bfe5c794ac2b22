"""Saved activations on a slower tier, and block-level recomputation.

Two passes around AOTAutograd's partitioner:

- `tag_block_recompute` (joint graph, before partitioning): every forward op inside a
  block is recomputed in the backward, except the block's outputs (what the next
  block or the suffix reads: the boundary activations) and random ops (recomputing
  them would draw new numbers). The partitioner then saves, per (block, sub-batch),
  only its input and its random masks, and the backward recomputes the rest from
  them just before it needs them. Weights fetched from a tier are recomputed anyway
  (`stream_weights`).
- `offload_saved` (the partitioned pair): every saved tensor that belongs to one
  (block, sub-batch) and has at least `min_bytes` is stored when it is made
  (`slc::stash`); the forward returns the stash token instead of the tensor, waits for
  the store after the tensor's last forward use (`slc::wait`, which keeps it alive
  until then; a saved view is stored as its own contiguous copy, so its base can be
  freed), and the backward issues the load (`slc::unstash`) when the
  (block, sub-batch) before the one that reads it starts, and waits for it
  (`slc::unstash_wait`) just before its first use: one (block, sub-batch) of
  lookahead. Model outputs and graph inputs (and views of them) stay as they are, and
  so do the saved tensors of a (block, sub-batch) the schedule keeps on the device
  (`Schedule.stashes()`).
"""

from __future__ import annotations

import dataclasses
import logging
import operator

import sympy
import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from slcompile.analysis.lifetimes import tensor_bytes
from slcompile.compat import optimization_hint
from slcompile.meta import SlcMeta, get_slc_meta, set_slc_meta
from slcompile.vocabulary import STASH, UNSTASH, UNSTASH_WAIT, WAIT, fake_token

__all__ = ["OffloadedActivations", "tag_block_recompute", "offload_saved", "forward_nodes"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OffloadedActivations:
    """What `offload_saved` did.

    Attributes:
        names: the offloaded saved tensors (forward node names), in forward order.
        bytes: their total size per step, a sympy expression of the size symbols.
        kept: saved tensors left on the device, with the reason.
    """

    names: tuple[str, ...] = ()
    bytes: sympy.Expr = sympy.Integer(0)
    kept: tuple[tuple[str, str], ...] = ()


def forward_nodes(joint: torch.fx.Graph) -> set[torch.fx.Node]:
    """The nodes of a joint graph that do not depend on a tangent."""
    backward: set[torch.fx.Node] = set()
    for node in joint.nodes:
        if node.op == "placeholder" and node.name.startswith("tangents"):
            backward.add(node)
        elif any(inp in backward for inp in node.all_input_nodes):
            backward.add(node)
    return {n for n in joint.nodes if n not in backward and n.op != "output"}


_PREFIX = -1  # the block index of the prefix in a group


def _group(node: torch.fx.Node) -> tuple[int, int] | None:
    """(block, sub-batch) of a node of the prefix (block -1) or a block."""
    meta = get_slc_meta(node)
    if meta is None or meta.subbatch is None or meta.region not in ("prefix", "block"):
        return None
    return (_PREFIX if meta.region == "prefix" else meta.block), meta.subbatch


def _meta(group: tuple[int, int], role: str) -> SlcMeta:
    block, subbatch = group
    if block == _PREFIX:
        return SlcMeta("prefix", None, subbatch, role=role)
    return SlcMeta("block", block, subbatch, role=role)


def _is_random(node: torch.fx.Node) -> bool:
    """Whether running the node again could draw other random numbers: ops tagged
    as seeded, unless their dropout probability is 0 or they run in eval mode
    (attention kernels carry the tag for their optional dropout)."""
    if torch.Tag.nondeterministic_seeded not in getattr(node.target, "tags", ()):
        return False
    schema = getattr(node.target, "_schema", None)
    if schema is None:
        return True
    values = {arg.name: arg.default_value for arg in schema.arguments if arg.has_default_value()}
    values.update(zip((arg.name for arg in schema.arguments), node.args))
    values.update(node.kwargs)
    if values.get("train") is False:
        return False
    for name in ("dropout_p", "p"):
        if name in values and isinstance(values[name], (int, float)) and values[name] == 0:
            return False
    return True


def tag_block_recompute(joint: torch.fx.Graph) -> int:
    """Tags a joint graph so the backward recomputes each block from its input.

    Returns:
        the number of forward nodes tagged for recomputation.
    """
    tagged = 0
    forward = forward_nodes(joint)
    for node in [n for n in joint.nodes if n in forward]:
        group = _group(node)
        if node.op != "call_function" or group is None or group[0] == _PREFIX:
            continue
        if node.meta.get("recompute") == CheckpointPolicy.MUST_RECOMPUTE:
            continue  # a fetched weight or its view
        leaves_group = any(_group(user) != group for user in node.users if user.op != "output")
        if leaves_group or _is_random(node):
            if isinstance(node.meta.get("val"), torch.Tensor):
                node.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            else:  # several outputs: their getitems are what can be saved
                for user in node.users:
                    if user.target is operator.getitem:
                        user.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        elif node.target is operator.getitem and node.meta.get("recompute") == CheckpointPolicy.MUST_SAVE:
            continue
        else:
            node.meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
            tagged += 1
    return tagged


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node` views (itself if it owns its memory)."""
    while node.op == "call_function" and node.args and isinstance(node.args[0], torch.fx.Node):
        source = node.args[0]
        if node.target is operator.getitem:
            if not getattr(source.target, "is_view", False):
                break  # one output of a multi-output op: its own memory
        elif not getattr(node.target, "is_view", False):
            break
        node = source
    return node


def _bytes_hint(value: torch.Tensor) -> int:
    return optimization_hint(value.numel()) * value.element_size()


def offload_saved(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    num_fwd_outputs: int,
    graph_key,
    min_bytes: int,
    stashes: frozenset | None = None,
) -> OffloadedActivations:
    """Moves the saved tensors of a partitioned pair to the stash (in place).

    Args:
        fw, bw: the partitioned forward and backward.
        num_fwd_outputs: how many of the forward's outputs are the model's.
        graph_key: `graph_key(name) -> key` of the `slc::stash` op (a `StashKey`'s text).
        min_bytes: saved tensors smaller than this stay on the device.
        stashes: the (region, block, sub-batch) whose saved tensors may leave the
            device (`Schedule.stashes()`); None: every one.
    """
    fw_nodes = list(fw.graph.nodes)
    fw_index = {node: i for i, node in enumerate(fw_nodes)}
    output = fw_nodes[-1]
    outputs = list(output.args[0])
    bw_inputs = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    model_outputs = set(outputs[:num_fwd_outputs])

    group_end: dict[tuple[int, int], int] = {}
    for i, node in enumerate(fw_nodes):
        group = _group(node)
        if group is not None:
            group_end[group] = i

    chosen, kept = [], []
    for position in range(num_fwd_outputs, len(outputs)):
        node = outputs[position]
        value = node.meta.get("val") if isinstance(node, torch.fx.Node) else None
        if not isinstance(value, torch.Tensor):
            continue
        reason = None
        if _base(node).op != "call_function":
            reason = "a graph input or a view of one"
        elif node in model_outputs:
            reason = "also a model output"
        elif _group(node) is None:
            reason = "not of one sub-batch of the prefix or a block"
        elif stashes is not None and _step_key(_group(node)) not in stashes:
            reason = "kept on the device by the schedule"
        elif node.name not in bw_inputs:
            reason = "not read by the backward"
        elif _bytes_hint(value) < min_bytes:
            reason = f"smaller than min_offload_bytes ({_bytes_hint(value)} B)"
        if reason is None:
            chosen.append((position, node))
        else:
            kept.append((node.name, reason))

    total = sympy.Integer(0)
    pairs = []
    for position, node in chosen:
        group = _group(node)
        readers = [u for u in node.users if u.op != "output"]
        after = max([node, *readers], key=fw_index.__getitem__)
        if fw_index[after] < group_end[group]:
            after = fw_nodes[group_end[group]]
        source = node
        if not node.meta["val"].is_contiguous():
            # The store needs one contiguous run of bytes; copying here keeps the
            # copy's memory visible to the lifetimes like any other value.
            with fw.graph.inserting_after(node):
                source = fw.graph.call_function(
                    torch.ops.aten.clone.default, (node,), {"memory_format": torch.contiguous_format}
                )
            source.meta["val"] = node.meta["val"].contiguous()
            set_slc_meta(source, _meta(group, "store"))
        with fw.graph.inserting_after(source):
            token = fw.graph.call_function(STASH, (source, graph_key(f"{_tag(group)}.{node.name}")))
        with fw.graph.inserting_after(after if fw_index[after] > fw_index[node] else token):
            done = fw.graph.call_function(WAIT, (token, [source]))
        for inserted, role in ((token, "store"), (done, "store")):
            inserted.meta["val"] = fake_token()
            set_slc_meta(inserted, _meta(group, role))
        outputs[position] = token
        pairs.append((node, token))
        total += tensor_bytes(node.meta["val"])
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    fw.graph.lint()
    fw.recompile()

    _reload(bw, pairs)
    names = tuple(node.name for _, node in chosen)
    log.debug("offloading %d saved activations (%s bytes per step)", len(names), total)
    return OffloadedActivations(names, sympy.expand(total), tuple(kept))


def _tag(group: tuple[int, int]) -> str:
    return _meta(group, "store").tag


def _step_key(group: tuple[int, int]) -> tuple[str, int | None, int]:
    """The (region, block, sub-batch) of a schedule step, for a group."""
    block, subbatch = group
    return ("prefix", None, subbatch) if block == _PREFIX else ("block", block, subbatch)


def _reload(bw: torch.fx.GraphModule, saved: list[tuple[torch.fx.Node, torch.fx.Node]]) -> None:
    """Replaces the backward's saved inputs (named as the forward nodes they were)
    by the stash tokens (named as theirs) and loads each one (block, sub-batch)
    ahead of its first use."""
    nodes = list(bw.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    first_compute = next(n for n in nodes if n.op != "placeholder")
    # The (block, sub-batch) groups in the order the backward starts them.
    starts: list[tuple[tuple[int, int], torch.fx.Node]] = []
    seen = set()
    for node in nodes:
        group = _group(node) if node.op == "call_function" else None
        if group is not None and group not in seen:
            seen.add(group)
            starts.append((group, node))
    order = {group: i for i, (group, _) in enumerate(starts)}

    for fw_node, token in saved:
        old = placeholders[fw_node.name]
        value = old.meta["val"]
        with bw.graph.inserting_after(old):
            placeholder = bw.graph.placeholder(token.name)
        placeholder.meta.update(old.meta)
        old.replace_all_uses_with(placeholder)
        bw.graph.erase_node(old)
        index[placeholder] = index.pop(old)
        first_user = min(placeholder.users, key=index.__getitem__)
        group = _group(first_user)
        if group in order and order[group] > 0:
            issue_before, issue_group = starts[order[group] - 1][1], starts[order[group] - 1][0]
        else:
            issue_before, issue_group = first_compute, group
        with bw.graph.inserting_before(issue_before):
            load = bw.graph.call_function(UNSTASH, (placeholder,))
        with bw.graph.inserting_before(first_user):
            loaded = bw.graph.call_function(
                UNSTASH_WAIT, (load, list(value.shape), value.dtype, value.device)
            )
        load.meta["val"] = fake_token()
        loaded.meta["val"] = value.contiguous()  # stored and loaded without gaps
        if issue_group is not None:
            set_slc_meta(load, _meta(issue_group, "load"))
        if group is not None:
            set_slc_meta(loaded, _meta(group, "load"))
        placeholder.replace_all_uses_with(loaded, delete_user_cb=lambda user: user is not load)
        placeholder.meta["val"] = fake_token()
        if placeholder.name != token.name:
            raise RuntimeError(f"backward input {placeholder.name!r} cannot take the name {token.name!r}")
    bw.graph.lint()
    bw.recompile()
