"""Rewrite the Dynamo graph to run over K sub-batches in the schedule's order.

Runs after `check_splittable`. Needs the BlockGraph (regions), BatchInfo (which inputs
are batched), the BatchPlan (how each node runs) and the Schedule (the order of the
forward's compute steps). Returns a new GraphModule whose forward computes exactly
what the original does, in this order (the speedloader schedule's):

1. Each batched input is narrowed into K sub-batches; a dynamic batch size symbol
   becomes `batch // K` inside per-sub-batch code.
2. The prefix runs once per sub-batch.
3. For each block: all K sub-batches through that block, then the next block.
4. The suffix runs per sub-batch; cross-sample ops (the loss) combine the sub-batches:
   sums and means add partial sums (cross-entropy's mean divides by the count of
   non-ignored labels of the whole batch), anything else concatenates the sub-batches
   and runs once.
5. Per-sample outputs are concatenated back along their batch dimension.

Under another schedule, steps 2-4 follow its order instead (grad_accumulation: sub-batch
0 through the prefix, every block and its share of the suffix, then sub-batch 1, and so
on); the combining ops run after the region's last sub-batch. The nodes emitted are the
same, only their order differs.

Shared (batch-free) values are computed once and sliced where a sub-batch reads them
along the batch; they run before the region's first sub-batch when its sub-batches run
one after the other, else with that first sub-batch, at their place in its pass.
Ops that change global state (grad mode, autocast) keep their place relative to every
other op. Every emitted node is tagged with its block and sub-batch
(`slcompile.meta`). AOTAutograd then derives a backward in the same order (layer-major
or sample-major), reversed.
"""

from __future__ import annotations

import dataclasses
import graphlib
import logging
import operator
from collections.abc import Iterator
from typing import Any

import torch
import torch.fx
from torch.fx.operator_schemas import normalize_function

from slcompile.analysis.batch_propagation import BATCHED_INT, BatchPlan, is_barrier
from slcompile.analysis.blocks import BlockGraph
from slcompile.analysis.order import priority_order
from slcompile.compat import graph_module
from slcompile.errors import RefusedError
from slcompile.meta import SlcMeta, set_slc_meta
from slcompile.passes.find_batch_dim import BatchInfo
from slcompile.schedules.base import Schedule

__all__ = ["InterleaveReport", "interleave"]

log = logging.getLogger(__name__)

# Slots of an item: an int sub-batch, or one of these.
_SHARED = "shared"
_COMBINE = "combine"
_KEEP_META = ("nn_module_stack", "source_fn_stack", "stack_trace", "fwd_source_fn_stack", "custom")


@dataclasses.dataclass(frozen=True)
class InterleaveReport:
    """What `interleave` emitted.

    Attributes:
        num_subbatches: K.
        order: the tags of the emitted compute nodes, in graph order, with runs of
            the same tag collapsed (`("prefix.sb0", "prefix.sb1", "blk0.sb0", ...)`).
        nodes_before: call nodes in the original graph.
        nodes_after: call nodes in the rewritten graph.
    """

    num_subbatches: int
    order: tuple[str, ...]
    nodes_before: int
    nodes_after: int


def interleave(
    gm: torch.fx.GraphModule, blocks: BlockGraph, batch: BatchInfo, plan: BatchPlan, schedule: Schedule
) -> tuple[torch.fx.GraphModule, InterleaveReport]:
    """Returns the GraphModule in the order of `schedule`'s forward and a report of
    what was emitted."""
    return _Interleaver(gm, blocks, batch, plan, schedule).run()


@dataclasses.dataclass
class _Item:
    key: tuple  # the emission priority (`_priority`)
    node: torch.fx.Node
    slot: Any


class _Interleaver:
    def __init__(self, gm, blocks, batch, plan, schedule):
        self.gm = gm
        self.order = schedule.order("fwd")
        self.blocks = blocks
        self.batch = batch
        self.plan = plan
        self.k = plan.num_subbatches
        self.graph = torch.fx.Graph()
        self.values: dict[tuple[str, Any], torch.fx.Node] = {}
        self.narrowed: dict[tuple[str, int, int], torch.fx.Node] = {}
        self.sub_size: dict[str, torch.fx.Node] = {}
        # Per sub-batch denominators of means: label counts, element counts.
        self.counts: dict[tuple[str, int], torch.fx.Node] = {}
        # Per-sub-batch values concatenated back, by node name: each once.
        self.concatenated: dict[str, torch.fx.Node] = {}
        self.emitted_order: list[str] = []

    # -- regions and items -------------------------------------------------
    def _region(self, node: torch.fx.Node) -> tuple[int, str, int | None]:
        region = self.blocks.regions.get(node.name, "prefix")
        if region == "block":
            pos = self.blocks.block_of[node.name]
            return 1 + pos, region, pos
        if region == "suffix":
            return 1 + len(self.blocks.blocks), region, None
        return 0, region, None

    def _slots(self, node: torch.fx.Node) -> list[Any]:
        split = self.plan.nodes[node.name]
        if split.kind == "batched":
            return list(range(self.k))
        if split.kind == "combine" and split.combine in ("sum", "mean", "cross_entropy"):
            return [*range(self.k), _COMBINE]
        if split.kind == "combine":
            return [_COMBINE]
        return [_SHARED]

    def _deps(self, node: torch.fx.Node, slot: Any) -> Iterator[tuple[str, Any]]:
        split = self.plan.nodes[node.name]
        if slot == _COMBINE and split.combine in ("sum", "mean", "cross_entropy"):
            yield from ((node.name, k) for k in range(self.k))
            return
        for inp in node.all_input_nodes:
            if inp.op == "placeholder" and self.plan.nodes[inp.name].kind != "batched":
                continue
            in_kind = self.plan.nodes[inp.name].kind
            if in_kind == "batched":
                if isinstance(slot, int):
                    yield inp.name, slot
                elif split.from_subbatch:
                    yield inp.name, 0
                else:
                    yield from ((inp.name, k) for k in range(self.k))
            elif in_kind == "combine":
                yield inp.name, _COMBINE
            else:
                yield inp.name, _SHARED

    # -- emission ----------------------------------------------------------
    def run(self) -> tuple[torch.fx.GraphModule, InterleaveReport]:
        originals = list(self.gm.graph.nodes)
        for node in originals:
            if node.op == "placeholder":
                new = self.graph.placeholder(node.name, type_expr=node.type)
                new.meta = dict(node.meta)
                self.values[(node.name, _SHARED)] = new

        calls = [n for n in originals if n.op not in ("placeholder", "output")]
        index = {n.name: i for i, n in enumerate(calls)}
        items: dict[tuple[str, Any], _Item] = {}
        # Batched placeholders: one narrow per sub-batch, in the prefix.
        for node in originals:
            if node.op == "placeholder" and self.plan.nodes[node.name].kind == "batched":
                for k in range(self.k):
                    items[(node.name, k)] = _Item(self._priority(0, k, -1), node, k)
        for node in calls:
            region_index, _, _ = self._region(node)
            for slot in self._slots(node):
                items[(node.name, slot)] = _Item(self._priority(region_index, slot, index[node.name]), node, slot)

        deps: dict[tuple[str, Any], set] = {key: set() for key in items}
        for key, item in items.items():
            if item.node.op != "placeholder":
                deps[key].update(d for d in self._deps(item.node, item.slot) if d in items)
        self._order_barriers(calls, items, deps)

        try:
            order = priority_order(items, deps, key=lambda key: items[key].key)
        except graphlib.CycleError:
            raise RefusedError("interleaving found a dependency cycle between blocks", "interleave") from None
        for key in order:
            self._emit(items[key])

        self._emit_output(originals[-1])
        self.graph.lint()
        new_gm = graph_module(self.gm, self.graph)
        nodes_after = sum(1 for n in new_gm.graph.nodes if n.op not in ("placeholder", "output"))
        report = InterleaveReport(
            num_subbatches=self.k,
            order=tuple(self.emitted_order),
            nodes_before=len(calls),
            nodes_after=nodes_after,
        )
        return new_gm, report

    def _priority(self, region_index: int, slot: Any, index: int) -> tuple[int, int, int]:
        """The emission priority of an item; dependencies always come first.

        By the schedule's position of the item's (region, block, sub-batch); work the
        region shares runs before its first sub-batch when its sub-batches run one
        after the other, else with the first one; combining work after its last.
        """
        if region_index == 0:
            region, block = "prefix", None
        elif region_index == 1 + len(self.blocks.blocks):
            region, block = "suffix", None
        else:
            region, block = "block", self.blocks.blocks[region_index - 1].index
        first = self.order.first(region, block)
        first = 0 if first is None else first
        if region == "suffix" and self.plan.whole_suffix:
            # One run of the suffix: its ops in the graph's order (an in-place write,
            # `shifted[..., 1:] = labels[..., :-1]`, before what reads the tensor after it).
            return first, 0, index
        if slot == _SHARED:
            return first, -1 if self.order.contiguous(region, block) else 0, index
        if slot == _COMBINE:
            last = self.order.last(region, block)
            return (first if last is None else last), 1, index
        position = self.order.step(region, block, slot)
        return (first if position is None else position), 0, index

    def _order_barriers(self, calls, items, deps) -> None:
        """Global-state ops stay between everything before and everything after them."""
        previous: list[tuple[str, Any]] = []
        barrier_keys: list[tuple[str, Any]] = []
        for node in calls:
            keys = [key for key in items if key[0] == node.name]
            if is_barrier(node):
                for key in keys:
                    deps[key].update(previous)
                    deps[key].update(barrier_keys)
                barrier_keys = keys
                previous = []
            else:
                for key in keys:
                    deps[key].update(barrier_keys)
                previous.extend(keys)

    def _tag(self, node: torch.fx.Node, slot: Any) -> SlcMeta:
        _, region, block = self._region(node)
        subbatch = slot if isinstance(slot, int) else None
        block_index = self.blocks.blocks[block].index if block is not None else None
        # A suffix run whole is the suffix's compute, however its nodes read the sub-batches.
        whole = region == "suffix" and self.plan.whole_suffix
        role = "combine" if slot == _COMBINE and not whole else "compute"
        return SlcMeta(region=region, block=block_index, subbatch=subbatch, role=role)

    def _new_node(self, op, target, args, kwargs, like: torch.fx.Node, meta: SlcMeta, name=None):
        new = self.graph.create_node(op, target, args, kwargs, name=name)
        for key in _KEEP_META:
            if key in like.meta:
                new.meta[key] = like.meta[key]
        set_slc_meta(new, meta)
        if meta.role == "compute":
            tag = meta.tag
            if not self.emitted_order or self.emitted_order[-1] != tag:
                self.emitted_order.append(tag)
        return new

    def _emit(self, item: _Item) -> None:
        node, slot = item.node, item.slot
        if node.op == "placeholder":
            self.values[(node.name, slot)] = self._split_input(node, slot)
            return
        split = self.plan.nodes[node.name]
        meta = self._tag(node, slot)
        if split.kind == "batched":
            args = self._map(split.args, slot, dict(split.narrow), dict(split.rebase))
            kwargs = self._map(split.kwargs, slot, dict(split.narrow), dict(split.rebase))
            name = f"{node.name}_sb{slot}"
            self.values[(node.name, slot)] = self._new_node(node.op, node.target, args, kwargs, node, meta, name)
        elif split.kind == "shared":
            sub = 0 if split.from_subbatch else None
            args = self._map(node.args, sub, {})
            kwargs = self._map(node.kwargs, sub, {})
            self.values[(node.name, _SHARED)] = self._new_node(node.op, node.target, args, kwargs, node, meta, node.name)
        elif slot == _COMBINE:
            self.values[(node.name, _COMBINE)] = self._combine(node, split, meta)
        else:
            self.values[(node.name, slot)] = self._partial(node, split, slot, meta)

    def _map(self, args, slot, narrow: dict[str, int], rebase: dict[str, int] | None = None):
        """Original arg nodes -> emitted nodes for one sub-batch (or shared)."""
        rebase = rebase or {}

        def lookup(n: torch.fx.Node):
            split = self.plan.nodes[n.name]
            if split.kind == "batched":
                if slot is None and n.op == "placeholder" and split.out_bdims == BATCHED_INT:
                    # The full batch size, for a shared value made from it (`arange(batch)`).
                    return self.values[(n.name, _SHARED)]
                if slot is None:
                    raise RefusedError(f"shared node reads per-sample value {n.name}", "interleave")
                return self.values[(n.name, slot)]
            if split.kind == "combine":
                return self.values[(n.name, _COMBINE)]
            value = self.values[(n.name, _SHARED)]
            if slot is not None and n.name in rebase:
                return self._rebase_shared(n.name, value, rebase[n.name], slot)
            if slot is not None and n.name in narrow:
                return self._narrow_shared(n.name, value, narrow[n.name], slot)
            return value

        return torch.fx.node.map_arg(args, lookup)

    def _narrow_shared(self, name: str, value: torch.fx.Node, dim: int, slot: int) -> torch.fx.Node:
        key = (name, dim, slot)
        if key not in self.narrowed:
            self.narrowed[key] = self._narrow(value, dim, slot, name, f"{name}_d{dim}")
        return self.narrowed[key]

    def _rebase_shared(self, name: str, value: torch.fx.Node, dim: int, slot: int) -> torch.fx.Node:
        """A sub-batch's slice of a shared sample index, less the index of its first
        sample: the indices of its own rows."""
        key = (name, dim, f"rebased{slot}")
        if key not in self.narrowed:
            narrowed = self._narrow_shared(name, value, dim, slot)
            start = self._times(self._chunk_length(value, dim, f"{name}_d{dim}"), slot)
            if isinstance(start, int) and start == 0:
                self.narrowed[key] = narrowed
            else:
                rebased = self.graph.create_node(
                    "call_function", operator.sub, (narrowed, start), name=f"{name}_rebased_sb{slot}"
                )
                set_slc_meta(rebased, SlcMeta(region="prefix", subbatch=slot, role="split"))
                self.narrowed[key] = rebased
        return self.narrowed[key]

    def _narrow(self, value: torch.fx.Node, dim: int, slot: int, name: str, cache_key: str) -> torch.fx.Node:
        """Sub-batch `slot` of `value` along `dim`."""
        length = self._chunk_length(value, dim, cache_key)
        start = self._times(length, slot)
        new = self.graph.create_node("call_function", torch.narrow, (value, dim, start, length), name=f"{name}_sb{slot}")
        set_slc_meta(new, SlcMeta(region="prefix", subbatch=slot, role="split"))
        return new

    def _split_input(self, node: torch.fx.Node, slot: int) -> torch.fx.Node:
        value = self.values[(node.name, _SHARED)]
        if self.k == 1:
            return value
        if self.plan.nodes[node.name].out_bdims == BATCHED_INT:
            if node.name not in self.sub_size:
                size = self.graph.create_node(
                    "call_function", operator.floordiv, (value, self.k), name=f"{node.name}_per_subbatch"
                )
                set_slc_meta(size, SlcMeta(region="prefix", role="split"))
                self.sub_size[node.name] = size
            return self.sub_size[node.name]
        return self._narrow(value, self.plan.nodes[node.name].out_bdims, slot, node.name, node.name)

    def _chunk_length(self, value: torch.fx.Node, dim: int, cache_key: str):
        """The sub-batch length along `dim`: a literal, or `size // K` when dynamic."""
        example = value.meta.get("example_value")
        size = example.shape[dim] if isinstance(example, torch.Tensor) else None
        if size is not None and not isinstance(size, torch.SymInt):
            return int(size) // self.k
        if cache_key not in self.sub_size:
            full = self.graph.call_method("size", (value, dim))
            length = self.graph.call_function(operator.floordiv, (full, self.k))
            set_slc_meta(full, SlcMeta(region="prefix", role="split"))
            set_slc_meta(length, SlcMeta(region="prefix", role="split"))
            self.sub_size[cache_key] = length
        return self.sub_size[cache_key]

    def _times(self, length, slot: int):
        if isinstance(length, int):
            return length * slot
        if slot == 0:
            return 0
        start = self.graph.call_function(operator.mul, (length, slot))
        set_slc_meta(start, SlcMeta(region="prefix", role="split"))
        return start

    # -- cross-sample ops after the blocks --------------------------------
    def _partial(self, node, split, slot: int, meta: SlcMeta) -> torch.fx.Node:
        """One sub-batch's share of a sum, a mean or a cross-entropy."""
        args = self._map(node.args, slot, {})
        kwargs = self._map(node.kwargs, slot, {})
        name = f"{node.name}_partial_sb{slot}"
        if split.combine == "cross_entropy":
            named = normalize_function(node.target, args, kwargs, normalize_to_only_use_kwargs=True).kwargs
            reduction = named.get("reduction", "mean")
            named["reduction"] = "sum"
            loss = self._new_node("call_function", node.target, (), named, node, meta, name)
            if reduction != "mean":
                return loss
            valid = self._new_node(
                "call_function", operator.ne, (named["target"], named["ignore_index"]), {}, node, meta
            )
            self.counts[(node.name, slot)] = self._new_node(
                "call_method", "sum", (valid,), {}, node, meta, f"{node.name}_count_sb{slot}"
            )
            return loss
        if split.combine == "sum":
            return self._new_node(node.op, node.target, args, kwargs, node, meta, name)
        # mean: (sum, numel) per sub-batch.
        source = args[0]
        total = self._new_node("call_method", "sum", (source,), {}, node, meta, name)
        self.counts[(node.name, slot)] = self._new_node("call_method", "numel", (source,), {}, node, meta)
        return total

    def _combine(self, node, split, meta: SlcMeta) -> torch.fx.Node:
        if split.combine == "concat":
            return self._concat_and_run(node, meta)
        sums = [self.values[(node.name, k)] for k in range(self.k)]
        if (node.name, 0) not in self.counts:  # a plain sum
            return self._add_all(sums, node, meta, node.name)
        counts = [self.counts[(node.name, k)] for k in range(self.k)]
        total = self._add_all(sums, node, meta, f"{node.name}_sum")
        count = self._add_all(counts, node, meta, f"{node.name}_count")
        return self._new_node("call_function", operator.truediv, (total, count), {}, node, meta, node.name)

    def _add_all(self, values, like, meta, name):
        total = values[0]
        for value in values[1:]:
            total = self._new_node("call_function", operator.add, (total, value), {}, like, meta)
        if total is values[0]:
            return total
        total.name = self.graph._graph_namespace.create_name(name, None)
        return total

    def _concat_and_run(self, node, meta: SlcMeta) -> torch.fx.Node:
        """The op runs once on the sub-batches concatenated back: exact, at full size.
        A batch size given as an input is the sum of the sub-batches' (with a dynamic
        batch, `K * (batch // K)`, as the concatenated tensors' sizes are: the input
        itself would make Dynamo guard that the two are equal)."""

        def lookup(n: torch.fx.Node):
            split = self.plan.nodes[n.name]
            if split.kind == "batched" and n.op == "placeholder" and split.out_bdims == BATCHED_INT:
                if n.name not in self.concatenated:
                    self.concatenated[n.name] = self._add_all([self.values[(n.name, k)] for k in range(self.k)],
                                                              n, dataclasses.replace(meta, role="combine"), n.name)
                return self.concatenated[n.name]
            if split.kind == "batched":
                if not isinstance(split.out_bdims, int):
                    raise RefusedError(
                        f"node {node.name} mixes samples of {n.name}, which has no single batch dimension",
                        "interleave",
                    )
                if n.name not in self.concatenated:
                    parts = [self.values[(n.name, k)] for k in range(self.k)]
                    joined = dataclasses.replace(meta, role="combine")
                    self.concatenated[n.name] = self._new_node(
                        "call_function", torch.cat, (parts,), {"dim": split.out_bdims}, n, joined)
                return self.concatenated[n.name]
            if split.kind == "combine":
                return self.values[(n.name, _COMBINE)]
            return self.values[(n.name, _SHARED)]

        args = torch.fx.node.map_arg(node.args, lookup)
        kwargs = torch.fx.node.map_arg(node.kwargs, lookup)
        return self._new_node(node.op, node.target, args, kwargs, node, meta, node.name)

    def _emit_output(self, output: torch.fx.Node) -> None:
        suffix = SlcMeta(region="suffix", role="combine")

        def lookup(n: torch.fx.Node):
            split = self.plan.nodes[n.name]
            if split.kind == "combine":
                return self.values[(n.name, _COMBINE)]
            if split.kind != "batched":
                return self.values[(n.name, _SHARED)]
            parts = [self.values[(n.name, k)] for k in range(self.k)]
            bdim = split.out_bdims
            if self.k == 1:
                return parts[0]
            if isinstance(bdim, int):
                cat = self.graph.call_function(torch.cat, (parts,), {"dim": bdim})
                set_slc_meta(cat, suffix)
                return cat
            if bdim == BATCHED_INT:
                return self._add_all(parts, n, suffix, n.name)
            if bdim is None:
                return parts[0]
            raise RefusedError(f"output {n.name} has no single batch dimension", "interleave")

        self.graph.output(torch.fx.node.map_arg(output.args[0], lookup))

