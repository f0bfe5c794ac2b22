"""Saved activations on a slower tier, and block-level recomputation.

Around AOTAutograd's partitioner:

- `tag_block_recompute` (joint graph, before partitioning): every forward op inside a
  block is recomputed in the backward, except the block's outputs (what the next
  block or the suffix reads: the boundary activations) and random ops (recomputing
  them would draw new numbers). The partitioner then saves, per (block, sub-batch),
  only its input and its random masks, and the backward recomputes the rest from
  them just before it needs them. Given the (block, sub-batch) units a schedule
  recomputes (`Schedule.recompute`), it tags those alone and leaves the others'
  activations to be saved. Weights fetched from a tier are recomputed anyway
  (`stream_weights`).
- `saved_activations` (the partitioned pair, read only): every tensor the forward
  saves for the backward, the (block, sub-batch) step that makes it, the op and the
  module path that make it, its bytes, the
  steps of its last forward use and first backward use, and why it must stay on the
  device if it must (a graph input or a view of one, a model output, not of one
  sub-batch, smaller than `min_offload_bytes`). The policy is asked again with them
  (`Schedule.replan`): it decides which steps stash and where every transfer runs.
  A graph with symbolic sizes runs at every size its guards admit, not only at the
  one it was traced with: a saved tensor is compared with `min_offload_bytes` at the
  largest size its shape may take (`largest_bytes`: the upper ends of its size
  symbols' ranges, unbounded unless `torch._dynamo.mark_dynamic(..., max=)` bounds
  them), so one that grows with the batch or the sequence leaves at every size, and
  at any size the graph stashes at least what a graph traced at that size would.
- `offload_saved` (the partitioned pair): every saved tensor of a step the schedule
  stashes is stored once its (block, sub-batch) is done computing (`slc::stash`, one
  after another after the step's last node, so the step's compute stays one run
  that `compile_regions` outlines whole, and its stores one run that
  `coalesce_transfers` issues as one call); the forward returns the stash
  token instead of the tensor and waits for the store (`slc::wait`, which keeps it
  alive until then; a saved view is stored as its own contiguous copy, so its base
  can be freed) where the schedule's `stash.wait` step is; the backward issues the
  load (`slc::unstash`) and waits for it (`slc::unstash_wait`) where its
  `unstash.issue` and `unstash.wait` steps are. A step runs just before the first
  node of the compute step after it in the schedule. Model outputs and graph inputs
  (and views of them) stay as they are, and so do the saved tensors of a step the
  schedule keeps on the device and those it keeps by name (`Schedule.kept_saved`).
  A step's `stash.issue` may name the tier its tensors go to (`Step.tier`): their
  keys name it (`a2@host|...`), and the stash stores them there.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import operator

import sympy
import torch
import torch.fx
from torch.utils.checkpoint import CheckpointPolicy

from slcompile.analysis.order import runs_suffix_whole, unit_key
from slcompile.analysis.lifetimes import tensor_bytes
from slcompile.compat import optimization_hint
from slcompile.meta import SlcMeta, get_slc_meta, module_path, set_slc_meta
from slcompile.schedules.base import SavedActivation, Schedule
from slcompile.vocabulary import STASH, UNSTASH, UNSTASH_WAIT, WAIT, fake_token, is_compute

__all__ = [
    "OffloadedActivations", "tag_block_recompute", "saved_activations", "offload_saved", "forward_nodes",
    "largest_bytes",
]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class OffloadedActivations:
    """What `offload_saved` did.

    Attributes:
        names: the offloaded saved tensors (forward node names), in forward order.
        bytes: their total size per step, a sympy expression of the size symbols.
        kept: saved tensors left on the device, with the reason.
        tiers: the tier each of `names` goes to, where its unit's schedule step
            names one (`Step.tier`), else None (the stash's tier).
        tier_bytes: (tier, bytes) of the tensors whose tier is named, per tier.
    """

    names: tuple[str, ...] = ()
    bytes: sympy.Expr = sympy.Integer(0)
    kept: tuple[tuple[str, str], ...] = ()
    tiers: tuple[str | None, ...] = ()
    tier_bytes: tuple[tuple[str, sympy.Expr], ...] = ()

    def bytes_by_tier(self, default: str) -> dict[str, sympy.Expr]:
        """Their size per tier, `default` standing for the stash's own tier (only
        tiers that hold some)."""
        named = dict(self.tier_bytes)
        rest = sympy.expand(self.bytes - sum(named.values(), sympy.Integer(0)))
        by_tier = {default: rest} if rest != 0 else {}
        for tier, nbytes in named.items():
            by_tier[tier] = sympy.expand(by_tier.get(tier, sympy.Integer(0)) + nbytes)
        return by_tier


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


def tag_block_recompute(joint: torch.fx.Graph, units: frozenset[tuple[int, int]] | None = None) -> int:
    """Tags a joint graph so the backward recomputes each block from its input.

    Args:
        joint: the joint graph.
        units: the (block, sub-batch) units to recompute; None: every one.

    Returns:
        the number of forward nodes tagged for recomputation.
    """
    tagged = 0
    forward = forward_nodes(joint)
    for node in [n for n in joint.nodes if n in forward]:
        group = _group(node)
        if node.op != "call_function" or group is None or group[0] == _PREFIX:
            continue
        if units is not None and group not in units:
            continue  # the partitioner saves what the backward reads of it
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


# The results of CUDA's attention ops that hold their random state: traced on the
# compute device, they are CPU tensors when the op runs outside a CUDA graph capture
# (torch's Note [Seed and Offset]), so a move would neither start nor end where the
# plan says.
_RANDOM_STATE_RESULTS = frozenset({"philox_seed", "philox_offset", "rng_state"})


def _random_state(node: torch.fx.Node) -> bool:
    if node.target is not operator.getitem or not isinstance(node.args[0], torch.fx.Node):
        return False
    op, index = node.args[0].target, node.args[1]
    if not isinstance(op, torch._ops.OpOverload) or not isinstance(index, int):
        return False
    results = [r.name for r in op._schema.returns]
    if index >= len(results):
        return False
    # The flash ops name the slot after their `rng_state` "unused" (their offset).
    return results[index] in _RANDOM_STATE_RESULTS or (results[index] == "unused" and "rng_state" in results)


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


def largest_bytes(value: torch.Tensor) -> int | float:
    """The most bytes `value` takes at any size its graph may run at: its size as
    is, or for a symbolic one the upper end of its range in the shape environment
    (`math.inf` where a size symbol is unbounded, as Dynamo leaves a dynamic batch
    unless `mark_dynamic(..., max=)` bounds it)."""
    numel = value.numel()
    if not isinstance(numel, torch.SymInt):
        return int(numel) * value.element_size()
    node = numel.node
    if not node.expr.free_symbols:
        return int(node.expr) * value.element_size()
    upper = node.shape_env.bound_sympy(node.expr).upper
    if not isinstance(upper, sympy.Integer):  # torch's int_oo calls itself finite
        return math.inf
    return int(upper) * value.element_size()


def _step_of_nodes(gm: torch.fx.GraphModule) -> tuple[dict[torch.fx.Node, tuple | None], dict[tuple, torch.fx.Node]]:
    """(node -> the compute step it runs in: the step of the last node at or before
    it that computes for one sub-batch, or for the suffix run whole; step -> its
    first such node)."""
    current = None
    step_of: dict[torch.fx.Node, tuple | None] = {}
    first: dict[tuple, torch.fx.Node] = {}
    whole = runs_suffix_whole(gm)
    for node in gm.graph.nodes:
        key = unit_key(get_slc_meta(node), whole) if is_compute(node) else None
        if key is not None:
            current = key
            first.setdefault(current, node)
        step_of[node] = current
    return step_of, first


def saved_activations(
    fw: torch.fx.GraphModule, bw: torch.fx.GraphModule, num_fwd_outputs: int, min_bytes: int = 0
) -> tuple[SavedActivation, ...]:
    """The tensors a partitioned forward saves for its backward, with their lifetimes
    in steps and why those that cannot leave the device stay.

    The last forward use is the step of the last forward reader (at least the step
    that makes it); the first backward use the step of the first backward reader. A
    tensor stays for being smaller than `min_bytes` only where it is smaller at its
    largest size (`largest_bytes`).
    """
    fw_nodes = list(fw.graph.nodes)
    outputs = list(fw_nodes[-1].args[0])
    model_outputs = set(outputs[:num_fwd_outputs])
    bw_inputs = {n.name: n for n in bw.graph.nodes if n.op == "placeholder"}
    fw_step, _ = _step_of_nodes(fw)
    bw_step, _ = _step_of_nodes(bw)
    bw_index = {node: i for i, node in enumerate(bw.graph.nodes)}
    fw_order = {}
    for node in fw_nodes:
        if fw_step[node] is not None:
            fw_order.setdefault(fw_step[node], len(fw_order))
    saved = [node for node in dict.fromkeys(outputs[num_fwd_outputs:])
             if isinstance(node, torch.fx.Node) and isinstance(node.meta.get("val"), torch.Tensor)]
    # On a GPU, a saved tensor on the CPU is already off the device.
    accelerated = any(node.meta["val"].device.type not in ("cpu", "meta") for node in saved)
    found = []
    for node in saved:
        value = node.meta["val"]
        group = _group(node)
        owner = _step_key(group) if group is not None else None
        reason = None
        if _base(node).op != "call_function":
            reason = "a graph input or a view of one"
        elif node in model_outputs:
            reason = "also a model output"
        elif accelerated and value.device.type == "cpu":
            reason = "on the host, not the compute device"
        elif _random_state(node):
            reason = "attention's random state, whose device is chosen when it runs"
        elif group is None:
            reason = "not of one sub-batch of the prefix or a block"
        elif node.name not in bw_inputs:
            reason = "not read by the backward"
        elif largest_bytes(value) < min_bytes:
            # Below the threshold at the largest size it may take: a graph traced at
            # a small batch and run at a larger one keeps nothing a graph traced at
            # the larger batch would stash.
            largest = largest_bytes(value)
            reason = (f"smaller than min_offload_bytes ({largest} B)" if largest == _bytes_hint(value) else
                      f"smaller than min_offload_bytes at its largest size ({largest} B)")
        readers = [u for u in node.users if u.op != "output"]
        last = max((fw_step[u] for u in readers if fw_step[u] is not None), key=fw_order.__getitem__, default=owner)
        if owner is not None and last is not None and fw_order.get(owner, -1) > fw_order.get(last, -1):
            last = owner
        placeholder = bw_inputs.get(node.name)
        first = None
        if placeholder is not None and placeholder.users:
            first = bw_step[min(placeholder.users, key=bw_index.__getitem__)]
        found.append(SavedActivation(node.name, owner, _bytes_hint(value), last, first, reason,
                                     op=_op_name(node), module_path=_module_path(node)))
    return tuple(found)


def _op_name(node: torch.fx.Node) -> str | None:
    """The op that made `node` (`aten.mm.default`): for one output of a multi-output
    op, that op; None for a graph input."""
    if node.op == "call_function" and node.target is operator.getitem and node.args \
            and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    if node.op != "call_function":
        return None
    target = node.target
    if isinstance(target, torch._ops.OpOverload):
        return str(target)
    if isinstance(target, torch._ops.HigherOrderOperator):
        return target.name()
    return getattr(target, "__qualname__", None) or str(target)


def _module_path(node: torch.fx.Node) -> str | None:
    """The innermost module whose forward made `node`, as the model names it
    (`model.layers.3.self_attn`), from the `nn_module_stack` AOTAutograd keeps on
    forward nodes (`fwd_nn_module_stack` where only that is kept); None when unknown."""
    stack = node.meta.get("nn_module_stack") or node.meta.get("fwd_nn_module_stack")
    if not stack:
        return None
    path, _kind = list(stack.values())[-1]
    return module_path(path) if isinstance(path, str) else None


def offload_saved(
    fw: torch.fx.GraphModule,
    bw: torch.fx.GraphModule,
    num_fwd_outputs: int,
    graph_key,
    saved: tuple[SavedActivation, ...],
    schedule: Schedule,
) -> OffloadedActivations:
    """Moves the saved tensors of a partitioned pair to the stash (in place), where
    the schedule's stash and unstash steps are.

    Each tensor the schedule stashes (its owner has a `stash.issue` step, and the
    schedule does not keep it by name: `Schedule.kept_saved`) is stored after the
    last node of its owner's compute, onto the tier the owner's `stash.issue` names
    (`Step.tier`, in its key), else the stash's. Its other transfers go where the schedule's steps of
    its owner are: each step runs just before the first node of the compute step
    that follows it in the schedule (after that step's weight fetches), or at the
    end of its graph. A tensor takes the first `stash.wait` after its last forward
    use, the last `unstash.wait` at or before its first backward use, and the last
    `unstash.issue` before that wait. When the schedule has no such step where the
    tensor allows one, the tensor waits after its last forward reader, and is loaded
    one step ahead of and waited for just before its first backward reader (logged).

    Args:
        fw, bw: the partitioned forward and backward.
        num_fwd_outputs: how many of the forward's outputs are the model's.
        graph_key: `graph_key(name, tier) -> key` of the `slc::stash` op (a
            `StashKey`'s text; tier None: the stash's).
        saved: `saved_activations(fw, bw, ...)`.
        schedule: the schedule, written with `saved` (`Schedule.replan(saved=...)`).
    """
    stashes, tiers = schedule.stashes(), schedule.stash_tiers()
    chosen = [a for a in saved if a.stays is None and a.owner in stashes and a.name not in schedule.kept_saved]
    kept = [(a.name, a.stays if a.stays is not None else "kept on the device by the schedule")
            for a in saved if a not in chosen]
    fw_nodes = {node.name: node for node in fw.graph.nodes}
    # The backward states each loaded tensor's size; a symbolic one must be
    # computable there from the backward's other inputs.
    sizes = _SizeSources(bw, {a.name for a in chosen})
    for activation in list(chosen):
        if not sizes.can_compute(fw_nodes[activation.name].meta["val"].shape):
            chosen.remove(activation)
            kept.append((activation.name, "its symbolic size is not computable in the backward"))
            log.info("offload_saved: %s stays on the device: its size %s is not computable in the backward",
                     activation.name, tuple(fw_nodes[activation.name].meta["val"].shape))
    output = fw.graph.output_node()
    outputs = list(output.args[0])
    _, fw_first = _step_of_nodes(fw)
    fw_index = {node: i for i, node in enumerate(fw.graph.nodes)}
    group_end: dict[tuple, torch.fx.Node] = {}
    for node in fw.graph.nodes:
        group = _group(node)
        if group is not None:
            group_end[_step_key(group)] = node

    # Where each tensor's transfers go: (step index in the schedule, anchor node).
    places = _Places(schedule)
    total = sympy.Integer(0)
    tier_bytes: dict[str, sympy.Expr] = {}
    pairs = []
    stash_after: dict[tuple, torch.fx.Node] = {}
    waits: list[tuple[int, torch.fx.Node, list]] = []  # (schedule index, anchor, [(token, source, group)])
    for activation in chosen:
        node = fw_nodes[activation.name]
        group = _group(node)
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
        end = group_end[activation.owner]
        anchor = stash_after.get(activation.owner) or (source if node is end else end)
        with fw.graph.inserting_after(anchor):
            key = graph_key(f"{_tag(group)}.{node.name}", tiers.get(activation.owner))
            token = fw.graph.call_function(STASH, (source, key))
        stash_after[activation.owner] = token
        token.meta["val"] = fake_token()
        set_slc_meta(token, _meta(group, "store"))
        place = places.stash_wait(activation, fw_first, output)
        readers = [u for u in node.users if u.op != "output" and u is not token and u is not source]
        latest = max([node, *readers, group_end[activation.owner]], key=fw_index.__getitem__)
        if place is None or fw_index.get(place[1], len(fw_index)) <= fw_index[latest]:
            log.info("offload_saved: the schedule waits for no stash of %s after its last forward use; "
                     "it waits after %s", activation.name, latest.name)
            place = (-1, latest.next)
        waits.append((place[0], place[1], [(token, source, group)]))
        outputs = [token if value is node else value for value in outputs]
        pairs.append((node, token, activation))
        total += tensor_bytes(node.meta["val"])
        if activation.owner in tiers:
            tier = tiers[activation.owner]
            tier_bytes[tier] = tier_bytes.get(tier, sympy.Integer(0)) + tensor_bytes(node.meta["val"])
    for _, anchor, entries in sorted(waits, key=lambda w: w[0]):
        for token, source, group in entries:
            with fw.graph.inserting_before(anchor):
                done = fw.graph.call_function(WAIT, (token, [source]))
            done.meta["val"] = fake_token()
            set_slc_meta(done, _meta(group, "store"))
    output.args = (tuple(outputs),) + tuple(output.args[1:])
    fw.graph.lint()
    fw.recompile()

    _reload(bw, pairs, places, sizes)
    names = tuple(a.name for a in chosen)
    log.debug("offloading %d saved activations (%s bytes per step)", len(names), total)
    return OffloadedActivations(
        names, sympy.expand(total), tuple(kept), tuple(tiers.get(a.owner) for a in chosen),
        tuple((tier, sympy.expand(nbytes)) for tier, nbytes in sorted(tier_bytes.items())),
    )


class _Places:
    """The schedule's stash.wait / unstash.issue / unstash.wait steps of each owner:
    (index of the step, key of the compute step it runs before or None)."""

    def __init__(self, schedule: Schedule):
        self.steps: dict[tuple[str, str, tuple], list[tuple[int, tuple | None]]] = {}
        pending: list[tuple[str, str, tuple, int]] = []
        for index, step in enumerate(schedule.steps):
            if step.kind == "compute":
                for phase, kind, key, at in pending:
                    if phase == step.phase:
                        self.steps.setdefault((phase, kind, key), []).append((at, step.key))
                pending = [p for p in pending if p[0] != step.phase]
            elif step.kind in ("stash.wait", "unstash.issue", "unstash.wait"):
                pending.append((step.phase, step.kind, step.key, index))
        for phase, kind, key, at in pending:
            self.steps.setdefault((phase, kind, key), []).append((at, None))
        self.order = {phase: schedule.order(phase).position for phase in ("fwd", "bwd")}

    def stash_wait(self, activation: SavedActivation, first: dict, output: torch.fx.Node):
        """The first stash.wait of the owner after the tensor's last forward use."""
        position = self.order["fwd"]
        last = position.get(activation.last_forward_use, -1)
        for index, before in self.steps.get(("fwd", "stash.wait", activation.owner), []):
            if before is None:
                return index, output
            if position.get(before, -1) > last and before in first:
                return index, first[before]
        return None

    def unstash(self, activation: SavedActivation, first: dict):
        """(issue, wait) of the owner's unstash steps for the tensor: the last wait at
        or before its first backward use, the last issue before that wait."""
        position = self.order["bwd"]
        use = position.get(activation.first_backward_use)
        wait = None
        for index, before in self.steps.get(("bwd", "unstash.wait", activation.owner), []):
            if before is not None and before in first and use is not None and position.get(before, use + 1) <= use:
                wait = (index, first[before], position[before])
        if wait is None:
            return None, None
        # The last issue before a compute step earlier than the wait's (the load
        # overlaps that step), else the last one before the wait.
        issue = earlier = None
        for index, before in self.steps.get(("bwd", "unstash.issue", activation.owner), []):
            if index < wait[0] and before is not None and before in first:
                issue = (index, first[before])
                if position.get(before, use) < wait[2]:
                    earlier = issue
        return earlier or issue, wait[:2]


def _tag(group: tuple[int, int]) -> str:
    return _meta(group, "store").tag


def _step_key(group: tuple[int, int]) -> tuple[str, int | None, int]:
    """The (region, block, sub-batch) of a schedule step, for a group."""
    block, subbatch = group
    return ("prefix", None, subbatch) if block == _PREFIX else ("block", block, subbatch)


class _SizeSources:
    """Computes symbolic sizes in the backward from its inputs that stay: the size
    symbols it receives and the sizes of the tensors it receives (the inputs the
    stash tokens replace are left out)."""

    def __init__(self, bw: torch.fx.GraphModule, replaced: set[str]):
        self.graph = bw.graph
        self.exprs: dict[sympy.Expr, tuple] = {}  # expr -> (placeholder, dim or None)
        for node in bw.graph.nodes:
            if node.op != "placeholder" or node.name in replaced:
                continue
            value = node.meta.get("val")
            if isinstance(value, torch.SymInt):
                self.exprs.setdefault(value.node.expr, (node, None))
            elif isinstance(value, torch.Tensor):
                for dim, size in enumerate(value.shape):
                    if isinstance(size, torch.SymInt):
                        self.exprs.setdefault(size.node.expr, (node, dim))
        self.made: dict[sympy.Expr, torch.fx.Node] = {}
        # Made once, before the first computation: every load that needs one comes later.
        self.start = next(n for n in bw.graph.nodes if n.op != "placeholder")

    def can_compute(self, shape) -> bool:
        return all(self._computable(size.node.expr) for size in shape if isinstance(size, torch.SymInt))

    def _computable(self, expr) -> bool:
        if expr in self.exprs or isinstance(expr, sympy.Integer):
            return True
        if isinstance(expr, (sympy.Add, sympy.Mul)) or type(expr).__name__ == "FloorDiv":
            return all(self._computable(arg) for arg in expr.args)
        return False

    def emit(self, shape) -> list:
        """The size as graph values (ints, and nodes computed from the inputs)."""
        with self.graph.inserting_before(self.start):
            return [self._emit(size.node.expr) if isinstance(size, torch.SymInt) else size for size in shape]

    def _emit(self, expr):
        if isinstance(expr, sympy.Integer):
            return int(expr)
        if expr in self.made:
            return self.made[expr]
        if expr in self.exprs:
            source, dim = self.exprs[expr]
            if dim is None:
                return source
            node = self.graph.call_function(torch.ops.aten.sym_size.int, (source, dim))
            node.meta["val"] = source.meta["val"].shape[dim]
        else:
            combine = {sympy.Add: operator.add, sympy.Mul: operator.mul}.get(type(expr), operator.floordiv)
            args = [self._emit(arg) for arg in expr.args]
            node = args[0]
            for arg in args[1:]:
                value = combine(*(a.meta["val"] if isinstance(a, torch.fx.Node) else a for a in (node, arg)))
                node = self.graph.call_function(combine, (node, arg))
                node.meta["val"] = value
        self.made[expr] = node
        return node


def _reload(bw: torch.fx.GraphModule, saved, places: _Places, sizes: _SizeSources) -> None:
    """Replaces the backward's saved inputs (named as the forward nodes they were)
    by the stash tokens (named as theirs) and loads each one where the schedule's
    unstash steps of its owner are (see `offload_saved`)."""
    nodes = list(bw.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    placeholders = {n.name: n for n in nodes if n.op == "placeholder"}
    first_compute = next(n for n in nodes if n.op != "placeholder")
    _, first = _step_of_nodes(bw)
    # The (block, sub-batch) groups in the order the backward starts them.
    starts: list[tuple[tuple[int, int], torch.fx.Node]] = []
    seen = set()
    for node in nodes:
        group = _group(node) if node.op == "call_function" else None
        if group is not None and group not in seen:
            seen.add(group)
            starts.append((group, node))
    order = {group: i for i, (group, _) in enumerate(starts)}

    inserts = []  # (schedule index, 0 issue / 1 wait, anchor, placeholder, owner)
    for fw_node, token, activation in saved:
        old = placeholders[fw_node.name]
        with bw.graph.inserting_after(old):
            placeholder = bw.graph.placeholder(token.name)
        placeholder.meta.update(old.meta)
        old.replace_all_uses_with(placeholder)
        bw.graph.erase_node(old)
        index[placeholder] = index.pop(old)
        if placeholder.name != token.name:
            raise RuntimeError(f"backward input {placeholder.name!r} cannot take the name {token.name!r}")
        first_user = min(placeholder.users, key=index.__getitem__)
        issue, wait = places.unstash(activation, first)
        if wait is None or index[wait[1]] > index[first_user]:
            log.info("offload_saved: the schedule loads no stash of %s before its first backward use; "
                     "it is loaded one step ahead of it", fw_node.name)
            group = _group(first_user)
            wait = (-1, first_user)
            issue = (-1, starts[order[group] - 1][1] if order.get(group, 0) > 0 else first_compute)
        elif issue is None or index[issue[1]] > index[wait[1]]:
            # (A step whose first node the graph runs after a later step's.)
            issue = (issue[0] if issue is not None else wait[0], wait[1])
        owner = _group(fw_node)
        inserts.append((issue[0], 0, issue[1], placeholder, owner))
        inserts.append((wait[0], 1, wait[1], placeholder, owner))
    loads: dict[torch.fx.Node, torch.fx.Node] = {}
    for _, kind, anchor, placeholder, owner in sorted(inserts, key=lambda i: (i[0], i[1])):
        with bw.graph.inserting_before(anchor):
            if kind == 0:
                node = bw.graph.call_function(UNSTASH, (placeholder,))
                node.meta["val"] = fake_token()
                loads[placeholder] = node
            else:
                load = loads[placeholder]
                value = placeholder.meta["val"]
                size = sizes.emit(value.shape)
                node = bw.graph.call_function(UNSTASH_WAIT, (load, size, value.dtype, value.device))
                node.meta["val"] = value.contiguous()  # stored and loaded without gaps
                placeholder.replace_all_uses_with(node, delete_user_cb=lambda user, load=load: user is not load)
                placeholder.meta["val"] = fake_token()
        # Tagged as the step they run in (the schedule reads the stash token), so
        # regions and pictures keep them there.
        where = _group(anchor) or owner
        set_slc_meta(node, _meta(where, "load"))
    bw.graph.lint()
    bw.recompile()

