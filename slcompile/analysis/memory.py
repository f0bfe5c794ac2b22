"""Predicted memory per tier of a compiled step, from the lifetimes of its graphs.

The device's peak is the larger of the forward's and the backward's, each the max
over nodes of:

    bytes of the graph's live values (`analyze_lifetimes`: activations, fetched
    weights, reloaded activations, gradients, saved tensors)
  + bytes of the weights the streamer has prefetched but the graph has not yet
    fetched (the `live_blocks - 1` block visits after the current one, in the
    cyclic forward-then-backward fetch plan)

plus what the caller holds for the whole step: resident parameters and buffers and
the batch (`held`; streamed parameters hold no memory). The slower tiers hold the
streamed weights and, from the forward's stores to the backward's last read, the
offloaded activations. Everything is a sympy expression of the size symbols,
evaluated for the example inputs.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping

import sympy
import torch
import torch.fx

from slcompile.analysis.lifetimes import LifetimeTable, analyze_lifetimes, analyze_training_step, tensor_bytes
from slcompile.meta import get_slc_meta

__all__ = ["MemoryPrediction", "predict_memory", "size_hints", "measured_peak_bytes"]


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
    """

    peak_bytes: dict[str, int]
    step_peak_bytes: int
    held_bytes: int
    prefetch_bytes: int
    offloaded_activation_bytes: int
    expressions: dict[str, sympy.Expr]
    recompute: str = "none"

    def __str__(self) -> str:
        tiers = ", ".join(f"{tier} {_mib(b)}" for tier, b in self.peak_bytes.items() if b)
        return (
            f"predicted peak: {tiers or 'nothing'} (step {_mib(self.step_peak_bytes)}, held "
            f"{_mib(self.held_bytes)}, prefetched weights {_mib(self.prefetch_bytes)}, offloaded "
            f"activations {_mib(self.offloaded_activation_bytes)}; recompute={self.recompute})"
        )


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.2f} MiB"


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
    from slcompile.runtime import weights as _weights  # noqa: F401  registers the op

    return torch.ops.slc.fetch_weight.default


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
        if node.users and all(u.op == "call_function" and u.target is fetch for u in node.users):
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
    return MemoryPrediction(
        peak_bytes=evaluated,
        step_peak_bytes=int(step_expr.subs(subs)),
        held_bytes=int(held_expr.subs(subs)),
        prefetch_bytes=max((max(per_node, default=0) for per_node in extra), default=0),
        offloaded_activation_bytes=int(sympy.sympify(offloaded_bytes).subs(subs)),
        expressions={**{f"peak_{tier}": expr for tier, expr in tier_exprs.items()}, "step_peak": step_expr},
        recompute=recompute,
    )


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
