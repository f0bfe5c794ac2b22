"""The memory model of a compiled step: live bytes per node, tier and kind, and the
peaks, from the lifetimes of its graphs. Everything that states a predicted figure
(the CompileReport, `explain`, `tune`, the memory plot, the recompute search) reads it
from `predict_memory`; `measured_peak_bytes` is the one instrument tests and benches
measure a step with.

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
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import sympy
import torch
import torch.fx

from slcompile.analysis.lifetimes import LifetimeTable, analyze_lifetimes, analyze_training_step, tensor_bytes
from slcompile.meta import get_slc_meta
from slcompile.units import format_bytes

__all__ = [
    "GraphMemory",
    "MemoryPrediction",
    "predict_memory",
    "predict_step_memory",
    "size_hints",
    "measured_peak_bytes",
]

# What the caller holds for the step; the other kinds are values the graphs make.
_STEP_KINDS = ("prefetched", "outputs_held")


@dataclasses.dataclass(frozen=True)
class GraphMemory:
    """Device bytes live at each node of one graph, by kind, for the example sizes.

    Attributes:
        kind: the graph: "forward", "backward" or "inference".
        nodes: the node names, in program order.
        live: per kind, the bytes live at each node: the lifetime kinds ("weight":
            fetched weights, "activation", "saved", "gradient", "input": inputs the
            graph frees) and "prefetched" (weights loaded ahead, not yet fetched) and
            "outputs_held" (in the backward, the forward's outputs the caller holds).
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
        """Fetched weights live at each node."""
        return self.live.get("weight", (0,) * len(self.nodes))

    @property
    def other(self) -> tuple[int, ...]:
        """Every other value the graph makes (activations, saved values, gradients,
        freed inputs), live at each node."""
        kinds = [k for k in self.live if k != "weight" and k not in _STEP_KINDS]
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
            inputs; the device's includes `held_bytes`.
        step_peak_bytes: the device bytes the step itself allocates at its peak
            (what a profiler sees from the step's start).
        held_bytes: device bytes the caller holds through the step (resident
            parameters and buffers, the inputs).
        prefetch_bytes: the most weight bytes prefetched ahead at once.
        offloaded_activation_bytes: saved activations stored off the device per step.
        expressions: the symbolic form of `peak_bytes` and `step_peak_bytes`.
        recompute: the recompute choice the plan was made with.
        graphs: per graph, in the order they run, the device bytes live at each node
            by kind; the largest total is `step_peak_bytes`.
    """

    peak_bytes: dict[str, int]
    step_peak_bytes: int
    held_bytes: int
    prefetch_bytes: int
    offloaded_activation_bytes: int
    expressions: dict[str, sympy.Expr]
    recompute: str = "none"
    graphs: tuple[GraphMemory, ...] = ()

    def __str__(self) -> str:
        tiers = ", ".join(f"{tier} {_mib(b)}" for tier, b in self.peak_bytes.items() if b)
        return (
            f"predicted peak: {tiers or 'nothing'} (step {_mib(self.step_peak_bytes)}, held "
            f"{_mib(self.held_bytes)}, prefetched weights {_mib(self.prefetch_bytes)}, offloaded "
            f"activations {_mib(self.offloaded_activation_bytes)}; recompute={self.recompute})"
        )


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


def _visits(gm: torch.fx.GraphModule, granularity: int, overhead: int) -> tuple[list[int], list[int]]:
    """(first node index, weight bytes) of each block visit: a run of fetches of
    one block."""
    fetch = _fetch_op()
    starts, sizes, last_block = [], [], object()
    for i, node in enumerate(gm.graph.nodes):
        if node.op != "call_function" or node.target is not fetch:
            continue
        meta = get_slc_meta(node)
        block = meta.block if meta is not None else None
        nbytes = -(-int(tensor_bytes(node.meta["val"])) // granularity) * granularity + overhead
        if block != last_block:
            starts.append(i)
            sizes.append(0)
            last_block = block
        sizes[-1] += nbytes
    return starts, sizes


def _prefetched(tables, graphs, live_blocks: int, granularity: int, overhead: int) -> list[list[int]]:
    """Per graph, per node: weight bytes prefetched and not yet fetched."""
    visits = [_visits(gm, granularity, overhead) for gm in graphs]
    sizes = [size for _, graph_sizes in visits for size in graph_sizes]
    total = len(sizes)
    ahead = min(live_blocks - 1, max(total - 1, 0))
    extra = []
    offset = 0
    for (starts, _), table in zip(visits, tables):
        per_node = []
        current = offset - 1  # before the graph's first fetch: the previous visit
        for i in range(len(table.resident)):
            while current + 1 - offset < len(starts) and starts[current + 1 - offset] <= i:
                current += 1
            per_node.append(sum(sizes[(current + j) % total] for j in range(1, ahead + 1)) if total else 0)
        extra.append(per_node)
        offset += len(starts)
    return extra


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
    recompute: str = "none",
    sizes: Mapping[sympy.Symbol, int] | None = None,
    load_granularity: int = 1,
    load_overhead: int = 0,
) -> MemoryPrediction:
    """Predicts a step's memory per tier (the graphs are not changed).

    Args:
        forward: the forward graph (or the inference graph, with `graph_kind`).
        backward: the backward graph of a training step, or None.
        graph_kind: "forward" or "inference" when there is no backward.
        live_blocks: the streamer's window (1: no prefetch).
        weights_tier: where streamed weights rest; `streamed_bytes` of them.
        activations_tier: where offloaded activations rest; `offloaded_bytes` of them.
        recompute: recorded in the prediction.
        sizes: values of the size symbols; default: the example inputs'.
        load_granularity: loaded tensors take their size rounded up to this (see
            `analyze_lifetimes`), plus `load_overhead` bytes each.
    """
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
    extra = _prefetched(tables, graphs, live_blocks, load_granularity, load_overhead)
    resident = [
        sympy.expand(held_before + expr + ahead)
        for table, per_node, held_before in zip(tables, extra, before)
        for expr, ahead in zip(table.resident, per_node)
    ]
    step_expr = sympy.Max(*set(resident)) if resident else sympy.Integer(0)
    held_expr = _held_bytes(forward)
    device_expr = sympy.expand(held_expr) + step_expr
    tier_exprs: dict[str, sympy.Expr] = {"device": device_expr, "host": sympy.Integer(0), "nvme": sympy.Integer(0)}
    if weights_tier != "device" and streamed_bytes:
        tier_exprs[weights_tier] += streamed_bytes
    if activations_tier != "device":
        tier_exprs[activations_tier] += offloaded_bytes
    evaluated = {tier: int(expr.subs(subs)) for tier, expr in tier_exprs.items()}
    kinds = ["forward", "backward"] if backward is not None else [graph_kind]
    per_node = tuple(
        _graph_memory(kind, gm, table, ahead, int(sympy.sympify(held_before).subs(subs)), subs)
        for kind, gm, table, ahead, held_before in zip(kinds, graphs, tables, extra, before)
    )
    return MemoryPrediction(
        peak_bytes=evaluated,
        step_peak_bytes=int(step_expr.subs(subs)),
        held_bytes=int(held_expr.subs(subs)),
        prefetch_bytes=max((max(per_node, default=0) for per_node in extra), default=0),
        offloaded_activation_bytes=int(sympy.sympify(offloaded_bytes).subs(subs)),
        expressions={**{f"peak_{tier}": expr for tier, expr in tier_exprs.items()}, "step_peak": step_expr},
        recompute=recompute,
        graphs=per_node,
    )


def _graph_memory(kind, gm, table: LifetimeTable, prefetched: list[int], outputs_held: int, subs) -> GraphMemory:
    """The lifetime table swept over the nodes, one series per value kind."""
    nodes = tuple(node.name for node in gm.graph.nodes)
    deltas: dict[str, list[int]] = {}
    for value in table.values:
        size = int(sympy.sympify(value.bytes).subs(subs))
        delta = deltas.setdefault(value.kind, [0] * (len(nodes) + 1))
        delta[value.first_use] += size
        delta[min(value.last_use + 1, len(nodes))] -= size
    live: dict[str, tuple[int, ...]] = {}
    for value_kind, delta in deltas.items():
        running, series = 0, []
        for index in range(len(nodes)):
            running += delta[index]
            series.append(running)
        live[value_kind] = tuple(series)
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
    engine are seen inside `slcompile.runtime.nvme.buffers_seen_by_profiler()`."""
    from torch.profiler import profile

    with profile(profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak
