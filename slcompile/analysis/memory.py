"""The memory model of a compiled step: live bytes per node, tier and kind, and the
peaks, from the lifetimes of its graphs (`predict_memory`). Everything that states
a step's predicted figure (the CompileReport, `explain`, `tune`, the memory plot,
the recompute search) reads it from here; a generation pass's is
`slcompile.analysis.pass_memory`'s, the optimizer step's share
`slcompile.analysis.optimizer_memory`'s. `measured_peak_bytes` is the one
instrument tests and benches measure a step with.

The device's peak is the larger of the forward's and the backward's, each the max
over nodes of:

    bytes of the graph's live values (`analyze_lifetimes`: activations, fetched
    weights, reloaded activations, gradients, saved tensors)
  + bytes of the weights the streamer has prefetched but the graph has not yet
    fetched (the `live_blocks - 1` block visits after the current one, in the
    cyclic forward-then-backward fetch plan)
  + in the backward, the forward's outputs the caller still holds

plus what the caller holds for the whole step: resident parameters and buffers and
the batch (`held`; streamed parameters hold no memory). `GraphMemory` keeps the
device terms per node, by kind, for the example sizes. The slower tiers hold the
streamed weights and, from the forward's stores to the backward's last read, the
offloaded activations (step totals, not per node). Everything is a sympy expression
of the size symbols, evaluated for the example inputs.

A gradient stored to a tier that copies nothing (the host tier of a CPU-only
machine) is copied first, since the graph may reuse its buffer
(`slcompile.runtime.gradients`): the backward then also holds each copy from the
store's issue to its wait, beside the graph's own buffer.

With an optimizer (`slcompile.analysis.optimizer_memory`: the offloaded optimizer's
step, or the one `explain`/`tune` are told of), the step ends with
`optimizer.step()`: the device then holds the forward's outputs, the gradients the
backward returned (the resident parameters' `.grad`) and the temporaries of the
resident parameters' step, a third phase beside the forward's and the backward's
peaks; and the resident parameters' optimizer state, held from one step to the next
like the parameters. The host's and nvme's shares of the optimizer (master weights,
the streamed weights' states, the gradients a block step reads) are reported apart
(`OptimizerMemory`), not in `peak_bytes`, which sizes the transfer engine's tiers.

With the streamed weights sharded over W ranks (`shard_weights`, `MachineFacts.world_size`)
each figure is one rank's: the weights' tier holds this rank's shard of every
streamed weight, `ceil(numel / W)` elements each (the padding included), and the
optimizer's host copies, states and gradients of streamed weights are shards of
that size too. On the device (`slcompile.runtime.weights`) a fetch of a weight
takes its loaded shard (page-rounded like any load; nothing where the tier is the
device's own memory) and the all-gather's buffer, the padded
weight, `ceil(numel / W) * W` elements: both from the issue `live_blocks - 1`
visits ahead (with the prefetched weights) to the fetch, or for a fetch issued by
itself both at its node; the buffer then is the fetched weight, to its last use.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import sympy
import torch
import torch.fx

from slcompile.analysis.lifetimes import (
    LifetimeTable,
    analyze_lifetimes,
    analyze_training_step,
    max_of,
    tensor_bytes,
)
from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.optimizer_memory import OptimizerMemory
from slcompile.meta import get_slc_meta
from slcompile.units import format_bytes
from slcompile.vocabulary import UNSTASH_WAIT, StashKey, WeightKey, is_stash, prefetched_visits

__all__ = [
    "GraphMemory",
    "MemoryPrediction",
    "predict_memory",
    "predict_step_memory",
    "size_hints",
    "sharded_weight_bytes",
    "measured_peak_bytes",
    "allocation_series",
]

# What the caller holds for the step; the other kinds are values the graphs make.
_STEP_KINDS = ("prefetched", "outputs_held")
# The memory of weights: fetched ones, and shards loaded for an all-gather.
_WEIGHT_KINDS = ("weight", "shard")


@dataclasses.dataclass(frozen=True)
class GraphMemory:
    """Device bytes live at each node of one graph, by kind, for the example sizes.

    Attributes:
        kind: the graph: "forward", "backward" or "inference".
        nodes: the node names, in program order.
        live: per kind, the bytes live at each node: the lifetime kinds ("weight":
            fetched weights, "activation", "saved", "gradient", "input": inputs the
            graph frees) and "prefetched" (weights loaded ahead, not yet fetched;
            sharded, their all-gathers' buffers) and "outputs_held" (in the
            backward, the forward's outputs the caller holds), with sharded
            weights "shard" (shards loaded and not yet fetched, ahead or in a fetch),
            and in a backward whose stored gradients are copied first,
            "gradient_copy" (copies of stored gradients until their store's wait).
            Inputs the caller holds through the step are not per node
            (`MemoryPrediction.held_bytes`).
    """

    kind: str
    nodes: tuple[str, ...]
    live: Mapping[str, tuple[int, ...]]

    @property
    def phase(self) -> str:
        return "bwd" if self.kind == "backward" else "fwd"

    @property
    def weights(self) -> tuple[int, ...]:
        """Fetched weights (and loaded shards) live at each node."""
        series = [self.live[k] for k in _WEIGHT_KINDS if k in self.live]
        return tuple(sum(values) for values in zip(*series)) if series else (0,) * len(self.nodes)

    @property
    def other(self) -> tuple[int, ...]:
        """Every other value the graph makes (activations, saved values, gradients,
        freed inputs), live at each node."""
        kinds = [k for k in self.live if k not in _WEIGHT_KINDS and k not in _STEP_KINDS]
        return tuple(sum(self.live[k][i] for k in kinds) for i in range(len(self.nodes)))

    @property
    def totals(self) -> tuple[int, ...]:
        """All device bytes of the step at each node, the held inputs excepted."""
        return tuple(sum(series[i] for series in self.live.values()) for i in range(len(self.nodes)))

    @property
    def peak(self) -> int:
        return max(self.totals, default=0)


@dataclasses.dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes of one compiled step.

    Attributes:
        peak_bytes: per tier ("device", "host", "nvme"), the peak for the example
            inputs; the device's includes `held_bytes` and the resident parameters'
            optimizer state (`optimizer.device_state_bytes`).
        step_peak_bytes: the device bytes the step itself allocates at its peak
            (what a profiler sees from the step's start), `optimizer.step()` included
            when there is an optimizer.
        held_bytes: device bytes the caller holds through the step (resident
            parameters and buffers, the inputs).
        prefetch_bytes: the most weight bytes prefetched ahead at once.
        offloaded_activation_bytes: saved activations stored off the device per step.
        expressions: the symbolic form of `peak_bytes` and `step_peak_bytes`.
        recompute: the recompute choice the plan was made with ("none", "blocks",
            or "policy": the units of the policy's schedule, `Schedule.recompute`).
        graphs: per graph, in the order they run, the device bytes live at each node
            by kind; without an optimizer the largest total is `step_peak_bytes`.
        optimizer: the optimizer's share (`OptimizerMemory`), or None when the
            prediction has no optimizer step.
        optimizer_step_bytes: device bytes of the optimizer step's phase (the
            forward's outputs, the gradients the backward returned, the resident
            step's temporaries); part of `step_peak_bytes` when it is the largest.
        optimizer_gradient_bytes: of those, the gradients the backward returned.
        gradient_copy_bytes: the most bytes of gradient copies on their way to the
            optimizer's tier at once (see `predict_memory`'s `gradients_tier`), part
            of the backward.
        weight_shards: the ranks the streamed weights are sharded over (1: not sharded).
        shard_bytes: sharded, the most device bytes of loaded shards at once
            (waiting for their all-gather and fetch).
        gather_bytes: sharded, the most device bytes of all-gather buffers (padded
            whole weights, prefetched or fetched) at once.
    """

    peak_bytes: dict[str, int]
    step_peak_bytes: int
    held_bytes: int
    prefetch_bytes: int
    offloaded_activation_bytes: int
    expressions: dict[str, sympy.Expr]
    recompute: str = "none"
    graphs: tuple[GraphMemory, ...] = ()
    optimizer: OptimizerMemory | None = None
    optimizer_step_bytes: int = 0
    optimizer_gradient_bytes: int = 0
    gradient_copy_bytes: int = 0
    weight_shards: int = 1
    shard_bytes: int = 0
    gather_bytes: int = 0

    def __str__(self) -> str:
        tiers = ", ".join(f"{tier} {_mib(b)}" for tier, b in self.peak_bytes.items() if b)
        line = (
            f"predicted peak: {tiers or 'nothing'} (step {_mib(self.step_peak_bytes)}, held "
            f"{_mib(self.held_bytes)}, prefetched weights {_mib(self.prefetch_bytes)}, offloaded "
            f"activations {_mib(self.offloaded_activation_bytes)}; recompute={self.recompute})"
        )
        if self.weight_shards > 1:
            line += (f"\nweights sharded over {self.weight_shards} ranks, device: loaded shards "
                     f"{_mib(self.shard_bytes)}, all-gathered weights {_mib(self.gather_bytes)} at most at once")
        return "\n".join((line, *self.optimizer_lines()))

    def optimizer_lines(self) -> tuple[str, ...]:
        """The optimizer's share, one line per tier (none without an optimizer)."""
        opt = self.optimizer
        if opt is None:
            return ()
        lines = [
            f"optimizer {opt.name}, device: resident states {_mib(opt.device_state_bytes)}, step phase "
            f"{_mib(self.optimizer_step_bytes)} (gradients {_mib(self.optimizer_gradient_bytes)}, step "
            f"temporaries {_mib(opt.device_step_bytes)}), gradient copies in flight {_mib(self.gradient_copy_bytes)}",
            f"optimizer {opt.name}, host: {_mib(opt.host_bytes)} (master weights {_mib(opt.host_master_bytes)}, "
            f"states {_mib(opt.host_state_bytes)}, gradients {_mib(opt.host_gradient_bytes)}, step temporaries "
            f"{_mib(opt.host_step_bytes)})" + (f"; nvme: states {_mib(opt.nvme_state_bytes)}"
                                                if opt.nvme_state_bytes else ""),
        ]
        if opt.host_is_device:
            lines.append(
                "host memory is the device's on this machine: device peak + optimizer host = "
                f"{_mib(self.peak_bytes['device'] + opt.host_bytes)}"
            )
        return tuple(lines)


def _mib(nbytes: int) -> str:
    return format_bytes(nbytes)


def size_hints(*graphs: torch.fx.GraphModule) -> dict[sympy.Symbol, int]:
    """The example value of every size symbol of the graphs' placeholders."""
    hints: dict[sympy.Symbol, int] = {}
    for gm in graphs:
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            dims = value.shape if isinstance(value, torch.Tensor) else (value,)
            for dim in dims:
                if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
                    if dim.node.hint is not None:
                        hints[dim.node.expr] = int(dim.node.hint)
    return hints


def _fetch_op():
    from slcompile.vocabulary import FETCH_WEIGHT

    return FETCH_WEIGHT


@dataclasses.dataclass(frozen=True)
class _FetchLayout:
    """Device bytes of one fetch of a streamed weight (see the module docstring).

    Attributes:
        shards: the ranks the weights are sharded over (1: whole weights).
        machine: how loads pad what they read (`MachineFacts.loaded_bytes`).
        zero_copy_shards: a shard's load is the stored tensor itself.
    """

    shards: int = 1
    machine: MachineFacts = MachineFacts()
    zero_copy_shards: bool = False

    def loaded(self, nbytes: int) -> int:
        return self.machine.loaded_bytes(nbytes)

    def weight(self, value: torch.Tensor) -> int:
        """The fetched weight: the loaded tensor, or sharded the all-gather's buffer."""
        if self.shards == 1:
            return self.loaded(int(tensor_bytes(value)))
        return -(-int(value.numel()) // self.shards) * self.shards * value.element_size()

    def shard(self, value: torch.Tensor) -> int:
        """The loaded shard of a sharded weight (0 when not sharded)."""
        if self.shards == 1 or self.zero_copy_shards:
            return 0
        return self.loaded(-(-int(value.numel()) // self.shards) * value.element_size())


def _visits(gm: torch.fx.GraphModule, size) -> tuple[list[int], list[int]]:
    """(first node index, bytes) of each block visit: a run of fetches of one
    block, or of one (block, sub-batch) when fetches are per sub-batch, as
    `place_prefetches` counts visits (a block whose sub-batches fetch one after the
    other makes as many visits); `size(value)` is what one fetch of the weight
    `value` takes."""
    fetch = _fetch_op()
    starts, sizes, last_visit = [], [], object()
    for i, node in enumerate(gm.graph.nodes):
        if node.op != "call_function" or node.target is not fetch:
            continue
        meta = get_slc_meta(node)
        visit = (meta.block if meta is not None else None, WeightKey.parse(node.args[1]).subbatch)
        nbytes = size(node.meta["val"])
        if visit != last_visit:
            starts.append(i)
            sizes.append(0)
            last_visit = visit
        sizes[-1] += nbytes
    return starts, sizes


def _prefetched(tables, graphs, live_blocks: int, size) -> list[list[int]]:
    """Per graph, per node: bytes prefetched and not yet fetched, `size(value)` per
    fetch of the weight `value`: the `live_blocks - 1` visits after the current one,
    and from its `slc::fetch_issue` on, the visit those issue (`place_prefetches`
    puts them just before the first fetch of the visit that many earlier)."""
    issued = _issued(graphs, size)
    visits = [_visits(gm, size) for gm in graphs]
    sizes = [size for _, graph_sizes in visits for size in graph_sizes]
    total = len(sizes)
    extra = []
    offset = 0
    for (starts, _), table in zip(visits, tables):
        per_node = []
        current = offset - 1  # before the graph's first fetch: the previous visit
        for i in range(len(table.resident)):
            while current + 1 - offset < len(starts) and starts[current + 1 - offset] <= i:
                current += 1
            per_node.append(sum(sizes[visit] for visit in prefetched_visits(current, live_blocks, total)))
        extra.append([a + b for a, b in zip(per_node, issued[len(extra)])])
        offset += len(starts)
    return extra


def _issued(graphs, size) -> list[list[int]]:
    """Per graph, per node: bytes of the loads issued since the graph's last fetch
    (`size(value)` per issue of the weight `value`)."""
    from slcompile.vocabulary import is_fetch, is_fetch_issue

    sizes = {node.args[1]: size(node.meta["val"]) for gm in graphs for node in gm.graph.nodes if is_fetch(node)}
    per_graph = []
    for gm in graphs:
        running, series = 0, []
        for node in gm.graph.nodes:
            if is_fetch(node):
                running = 0
            elif is_fetch_issue(node):
                running += sizes.get(node.args[0], 0)
            series.append(running)
        per_graph.append(series)
    return per_graph


def _loaded_shards(tables, graphs, live_blocks: int, layout: _FetchLayout) -> list[list[int]]:
    """Per graph, per node: bytes of sharded weights' loaded shards: prefetched
    ones, from their issue to their fetch; without prefetch, each fetch's own
    while it all-gathers (at the fetch's node only)."""
    ahead = _prefetched(tables, graphs, live_blocks, layout.shard)
    if any(map(any, ahead)):
        return ahead
    fetch = _fetch_op()
    return [[layout.shard(node.meta["val"]) if node.op == "call_function" and node.target is fetch else 0
             for node in gm.graph.nodes] for gm in graphs]


def _gathered_weights(tables, graphs, layout: _FetchLayout) -> list[list[int]]:
    """Per graph, per node: bytes the fetched weights take beyond the lifetime
    table's (a loaded tensor each): sharded, each is its all-gather's padded buffer."""
    fetch = _fetch_op()
    per_graph = []
    for gm, table in zip(graphs, tables):
        values = {v.name: v for v in table.values}
        change = [0] * (len(table.resident) + 1)
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not fetch or node.name not in values:
                continue
            value = values[node.name]
            delta = layout.weight(node.meta["val"]) - int(value.bytes)
            change[value.first_use] += delta
            change[value.last_use + 1] -= delta
        running, series = 0, []
        for delta in change[:-1]:
            running += delta
            series.append(running)
        per_graph.append(series)
    return per_graph


def sharded_weight_bytes(graphs: Sequence[torch.fx.GraphModule], weight_shards: int) -> int:
    """Bytes of one rank's shards of the weights `graphs` fetch, each weight once:
    `ceil(numel / weight_shards)` elements of each (`ShardGroup.shard`)."""
    from slcompile.vocabulary import WeightKey, is_fetch

    shards: dict[str, int] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            if is_fetch(node):
                value = node.meta["val"]
                shards[WeightKey.parse(node.args[1]).stored] = -(-value.numel() // weight_shards) * value.element_size()
    return sum(shards.values())


def _held_bytes(gm: torch.fx.GraphModule) -> sympy.Expr:
    """Bytes of the forward's tensor inputs, except parameters that are only fetched
    (their memory rests on another tier)."""
    fetch = _fetch_op()
    held = sympy.Integer(0)
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        # A training forward also returns a streamed parameter for the backward to fetch.
        used = [u for u in node.users if u.op != "output"]
        if used and all(u.op == "call_function" and u.target is fetch for u in used):
            continue
        held += tensor_bytes(value)
    return sympy.expand(held)


def predict_memory(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule | None = None,
    *,
    graph_kind: str = "forward",
    live_blocks: int = 1,
    weights_tier: str = "device",
    streamed_bytes: int = 0,
    activations_tier: str = "device",
    offloaded_bytes: sympy.Expr = sympy.Integer(0),
    offloaded_tiers: Mapping[str, sympy.Expr] | None = None,
    recompute: str = "none",
    sizes: Mapping[sympy.Symbol, int] | None = None,
    optimizer: OptimizerMemory | None = None,
    gradients_tier: str | None = None,
    machine: MachineFacts = MachineFacts(),
) -> MemoryPrediction:
    """Predicts a step's memory per tier (the graphs are not changed).

    Args:
        forward: the forward graph (or the inference graph, with `graph_kind`).
        backward: the backward graph of a training step, or None.
        graph_kind: "forward" or "inference" when there is no backward.
        live_blocks: the streamer's window (1: no prefetch).
        weights_tier: where streamed weights rest; `streamed_bytes` of them.
        activations_tier: where offloaded activations rest; `offloaded_bytes` of them.
        offloaded_tiers: `offloaded_bytes` per tier, where the schedule sends some
            units' activations to another tier than `activations_tier` (None: all
            rest there); spills that share no stash rest on `activations_tier`.
        recompute: recorded in the prediction.
        sizes: values of the size symbols; default: the example inputs'.
        optimizer: the optimizer's share (`optimizer_memory`): a training step then
            ends with its step, and the device holds its resident state.
        gradients_tier: where `slc::offload_grad` stores the streamed weights'
            gradients (None: they stay). Where that tier copies nothing and the
            weights are not sharded, each gradient is copied on the device first,
            the copy held until the store's wait.
        machine: the machine's facts (`MachineFacts`): loaded tensors take their size
            rounded up to its `load_granularity` (see `analyze_lifetimes`), plus
            `load_overhead` bytes each; with `world_size` W > 1 the streamed weights
            are sharded over W ranks: their tier holds this rank's shard of each
            (`sharded_weight_bytes`), not `streamed_bytes`, and the device each
            fetch's loaded shard (none where the weights' tier is the device's
            memory) and padded all-gather buffer (see the module docstring).
    """
    load_granularity, load_overhead = machine.load_granularity, machine.load_overhead
    weight_shards = machine.world_size
    gradient_copies = gradients_tier is not None and weight_shards == 1 and not machine.copies(gradients_tier)
    subs = dict(sizes if sizes is not None else size_hints(forward, *(g for g in (backward,) if g)))
    tables: list[LifetimeTable]
    if backward is not None:
        step = analyze_training_step(
            forward, backward, load_granularity=load_granularity, load_overhead=load_overhead
        )
        tables, graphs = [step.forward, step.backward], [forward, backward]
        before = [sympy.Integer(0), step.forward.user_output_bytes]
    else:
        tables, graphs = [analyze_lifetimes(
            forward, graph_kind, load_granularity=load_granularity, load_overhead=load_overhead
        )], [forward]
        before = [sympy.Integer(0)]
    # A shard loaded from a tier that is the device's memory (the host of a CPU-only machine) is no copy.
    zero_copy_shards = weights_tier != "device" and not machine.copies(weights_tier)
    layout = _FetchLayout(weight_shards, machine, zero_copy_shards)
    extra = _prefetched(tables, graphs, live_blocks, layout.weight)
    # Sharded weights' terms (zeros without): the loaded shards, and what the
    # fetched weights' padded buffers take beyond a loaded weight.
    shards = _loaded_shards(tables, graphs, live_blocks, layout)
    gathered = _gathered_weights(tables, graphs, layout)
    copies = [_gradient_copies(gm) if gradient_copies and kind == 1 else [sympy.Integer(0)] * len(table.resident)
              for kind, (gm, table) in enumerate(zip(graphs, tables))]
    sums: dict[tuple, sympy.Expr] = {}  # nodes in a row mostly hold the same terms

    def added(*terms) -> sympy.Expr:
        total = sums.get(terms)
        if total is None:
            total = sums[terms] = sympy.Add(*(term for term in terms if term != 0))
        return total

    resident = [
        added(held_before, expr, ahead, copied, shard, padded)
        for table, per_node, held_before, copied, graph_shards, graph_gathered
        in zip(tables, extra, before, copies, shards, gathered)
        for expr, ahead, copied, shard, padded in zip(table.resident, per_node, copied, graph_shards, graph_gathered)
    ]
    # The optimizer's step: the caller holds the outputs, the resident parameters
    # their .grad (what the backward returned), and the next forward's first blocks
    # are prefetched (as at the backward's end), while the step's temporaries live.
    stepped = optimizer is not None and backward is not None
    optimizer_step = optimizer_gradients = optimizer_state = sympy.Integer(0)
    if stepped:
        optimizer_state = sympy.Integer(optimizer.device_state_bytes)
        optimizer_gradients = _returned_gradients(tables[1])
        ahead = (extra[1][-1] + shards[1][-1]) if extra[1] else 0
        optimizer_step = sympy.expand(before[1] + optimizer_gradients + ahead + optimizer.device_step_bytes)
        resident.append(optimizer_step)
    step_expr = max_of(resident)
    held_expr = _held_bytes(forward)
    device_expr = sympy.expand(held_expr + optimizer_state) + step_expr
    tier_exprs: dict[str, sympy.Expr] = {"device": device_expr, "host": sympy.Integer(0), "nvme": sympy.Integer(0)}
    if weights_tier != "device" and streamed_bytes:
        tier_exprs[weights_tier] += (streamed_bytes if weight_shards == 1
                                     else sharded_weight_bytes(graphs, weight_shards))
    if activations_tier != "device":
        by_tier = dict(offloaded_tiers) if offloaded_tiers is not None else {activations_tier: offloaded_bytes}
        tier_exprs[activations_tier] += _stored_activations(
            forward, by_tier.pop(activations_tier, sympy.Integer(0)), activations_tier)
        for tier, nbytes in by_tier.items():
            tier_exprs[tier] += nbytes
    at = _At(subs)
    evaluated = {tier: at(expr) for tier, expr in tier_exprs.items()}
    kinds = ["forward", "backward"] if backward is not None else [graph_kind]
    per_node = tuple(
        _graph_memory(kind, gm, table, ahead, at(held_before), at, copied, graph_shards, graph_gathered)
        for kind, gm, table, ahead, held_before, copied, graph_shards, graph_gathered
        in zip(kinds, graphs, tables, extra, before, copies, shards, gathered)
    )
    return MemoryPrediction(
        peak_bytes=evaluated,
        step_peak_bytes=at(step_expr),
        held_bytes=at(held_expr),
        prefetch_bytes=max((max(per_node, default=0) for per_node in extra), default=0),
        offloaded_activation_bytes=at(offloaded_bytes),
        expressions={**{f"peak_{tier}": expr for tier, expr in tier_exprs.items()}, "step_peak": step_expr},
        recompute=recompute,
        graphs=per_node,
        optimizer=optimizer if stepped else None,
        optimizer_step_bytes=at(optimizer_step),
        optimizer_gradient_bytes=at(optimizer_gradients),
        gradient_copy_bytes=max((at(c) for c in copies[-1]), default=0),
        weight_shards=weight_shards,
        shard_bytes=_most(per_node, ("shard",)),
        gather_bytes=_most(per_node, ("prefetched", "weight")) if weight_shards > 1 else 0,
    )


def _stored_activations(forward: torch.fx.GraphModule, offloaded_bytes, tier: str) -> sympy.Expr:
    """The most activation bytes resting on `tier` (the stash's own) at once:
    `offloaded_bytes` (its stashes, all there when the backward starts) or, with
    spills of the forward's boundary activations that no stash shares
    (`spill_boundaries`), the most the stores so far and those spills hold together
    at any node, a spill's copy counted until its fill is waited for (stores whose
    key names another tier are not counted)."""
    output = forward.graph.output_node()
    handed = {v for v in output.args[0] if isinstance(v, torch.fx.Node)}
    own = {n for n in forward.graph.nodes if is_stash(n) and n not in handed and StashKey.parse(n.args[1]).spills}
    if not own:
        return offloaded_bytes
    held, most = sympy.Integer(0), [sympy.sympify(offloaded_bytes)]
    for node in forward.graph.nodes:
        if is_stash(node) and StashKey.parse(node.args[1]).tier in (None, tier):
            held += tensor_bytes(node.args[0].meta["val"])
            most.append(held)
        elif node.target is UNSTASH_WAIT and node.args[0].args[0] in own:
            held -= tensor_bytes(node.args[0].args[0].args[0].meta["val"])
    return max_of(sympy.expand(expr) for expr in most)


def _most(graphs: Sequence[GraphMemory], kinds: Sequence[str]) -> int:
    """The most bytes of the `kinds` together at any node of the graphs."""
    most = 0
    for graph in graphs:
        series = [graph.live[kind] for kind in kinds if kind in graph.live]
        most = max(most, max((sum(values) for values in zip(*series)), default=0))
    return most


def _gradient_copies(backward: torch.fx.GraphModule) -> list[sympy.Expr]:
    """Per node of the backward: bytes of the gradient copies from each
    `slc::offload_grad` to its wait (to the end when none waits)."""
    from slcompile.vocabulary import WAIT, is_gradient_store

    nodes = list(backward.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    change = [sympy.Integer(0)] * (len(nodes) + 1)
    for node in nodes:
        if not is_gradient_store(node):
            continue
        waits = [user for user in node.users if user.target is WAIT]
        end = max((index[w] for w in waits), default=len(nodes) - 1)
        change[index[node]] += tensor_bytes(node.args[0].meta["val"])
        change[end + 1] -= tensor_bytes(node.args[0].meta["val"])
    running, series = sympy.Integer(0), []
    for i in range(len(nodes)):
        running = sympy.expand(running + change[i])
        series.append(running)
    return series


def _returned_gradients(table: LifetimeTable) -> sympy.Expr:
    """Bytes of the gradients a backward returns (alive at its output)."""
    last = len(table.resident) - 1
    return sympy.expand(sum((v.bytes for v in table.values if v.kind == "gradient" and v.last_use >= last),
                            sympy.Integer(0)))


class _At:
    """Byte counts at the example sizes: `at(expr)` is `int(expr.subs(sizes))`,
    each distinct expression worked out once (by `xreplace`, which substitutes
    without `subs`'s pattern matching: thousands of nodes share a few sizes)."""

    def __init__(self, sizes: Mapping[sympy.Symbol, int]):
        self.sizes = {symbol: sympy.Integer(value) for symbol, value in sizes.items()}
        self.known: dict = {}

    def __call__(self, expr) -> int:
        if isinstance(expr, int):
            return expr
        value = self.known.get(expr)
        if value is None:
            value = self.known[expr] = int(sympy.sympify(expr).xreplace(self.sizes))
        return value


def _graph_memory(kind, gm, table: LifetimeTable, prefetched: list[int], outputs_held: int, at: _At,
                  copied=(), shards=(), gathered=()) -> GraphMemory:
    """The lifetime table swept over the nodes, one series per value kind
    (`shards`, `gathered`: the sharded weights' terms of `predict_memory`)."""
    nodes = tuple(node.name for node in gm.graph.nodes)
    deltas: dict[str, list[int]] = {}
    for value in table.values:
        size = at(value.bytes)
        delta = deltas.get(value.kind)
        if delta is None:  # not setdefault: its default would be built for every value
            delta = deltas[value.kind] = [0] * (len(nodes) + 1)
        delta[value.first_use] += size
        delta[min(value.last_use + 1, len(nodes))] -= size
    live: dict[str, tuple[int, ...]] = {}
    for value_kind, delta in deltas.items():
        running, series = 0, []
        for index in range(len(nodes)):
            running += delta[index]
            series.append(running)
        live[value_kind] = tuple(series)
    if any(copied):
        live["gradient_copy"] = tuple(at(c) for c in copied)
    if any(gathered):
        live["weight"] = tuple(w + g for w, g in zip(live["weight"], gathered))
    if any(shards):
        live["shard"] = tuple(shards)
    live["prefetched"] = tuple(prefetched)
    live["outputs_held"] = (outputs_held,) * len(nodes)
    return GraphMemory(kind, nodes, live)


def predict_step_memory(
    graphs: Mapping[str, torch.fx.GraphModule], sizes: Mapping[sympy.Symbol, int] | None = None, **options
) -> MemoryPrediction | None:
    """`predict_memory` of compiled graphs by kind (`CompileReport.graphs`): the
    forward and backward as one training step, else the inference (or forward)
    graph alone; None without graphs.

    Args:
        graphs: the graphs by kind.
        sizes: values of the size symbols; default: the example inputs'.
        **options: the other arguments of `predict_memory`.
    """
    if "forward" in graphs and "backward" in graphs:
        return predict_memory(graphs["forward"], graphs["backward"], sizes=sizes, **options)
    kind = "inference" if "inference" in graphs else "forward"
    if kind not in graphs:
        return None
    return predict_memory(graphs[kind], graph_kind=kind, sizes=sizes, **options)


def measured_peak_bytes(fn) -> int:
    """Peak bytes torch's CPU allocator handed out while `fn()` ran, relative to its
    start: the running sum of every allocation (+) and free (-) torch.profiler
    records. Memory allocated before the call is not seen; loads of the transfer
    engine are seen inside `slcompile.runtime.storage.nvme.buffers_seen_by_profiler()`."""
    return max((n for _, n in allocation_series(fn, "cpu")), default=0)


def allocation_series(fn, device: str | None = None) -> tuple[tuple[float, int], ...]:
    """Runs `fn()` under torch.profiler (`profile_memory`) and returns the running
    sum of the allocations (+) and frees (-) it records on `device` ("cpu", "cuda";
    None: CUDA's where there are any, else the CPU's) after each one, at its
    `time.perf_counter()` time: (seconds, bytes above the call's start)."""
    import time

    from torch.autograd import DeviceType
    from torch.profiler import profile

    with profile(profile_memory=True) as prof:
        # The profiler stamps its events with the wall clock (ns since the epoch).
        offset = time.perf_counter() - time.time_ns() / 1e9
        fn()
    memory = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    on = {kind: [e for e in memory if e.device_type() == getattr(DeviceType, kind.upper())] for kind in ("cpu", "cuda")}
    chosen = on[device] if device is not None else (on["cuda"] or on["cpu"])
    running, series = 0, []
    for start_ns, nbytes in sorted((e.start_ns(), e.nbytes()) for e in chosen):
        running += nbytes
        series.append((start_ns / 1e9 + offset, running))
    return tuple(series)
