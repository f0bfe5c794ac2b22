"""What the backend did with each graph Dynamo handed it.

`slcompile.compile_reports()` returns the reports of the graphs compiled in this
process, and of the configurations Dynamo ran eagerly past its recompile limit
(`CompileReport.compiled` False), newest last (a bounded history). Each keeps the
schedule, the fallback reason and the order in which the AOTAutograd forward and
backward graphs run their ops.

Graphs are what a report weighs (their fake tensors, shape environment and generated
code: megabytes for a tiny model), so only the newest `GRAPHS_KEPT` reports of the
history keep theirs; an older one is replaced in the history by a copy without them
(`graphs_dropped`), and a report held elsewhere (a comparison's rows) keeps its own.
"""

from __future__ import annotations

import collections
import dataclasses
import threading

import torch.fx

from slcompile.meta import get_slc_meta
from slcompile.passes.manager import PassLog

__all__ = ["CompileReport", "compile_reports", "clear_compile_reports", "GRAPHS_KEPT"]

_HISTORY = 64
GRAPHS_KEPT = 4
"""How many of the newest reports in the history keep their graphs."""
_reports: collections.deque = collections.deque(maxlen=_HISTORY)
_lock = threading.Lock()


@dataclasses.dataclass
class CompileReport:
    """One graph's compilation.

    Attributes:
        config: the backend's options.
        fallback_reason: why the graph compiled without sub-batching, or None.
        blocks: the block paths found.
        batch_size: the batch size of the example inputs, if found.
        schedule: the schedule text, read from the compiled graphs once they are
            partitioned (`slcompile.schedules.schedule_of`); the policy's until then.
        planned_schedule: the policy's Schedule, which the passes followed.
        pass_log: the passes run on this graph, every stage's, with their time, and
            the dump counter (`slcompile.passes.manager.PassLog`); `passes_run` is
            its entries.
        graph_order: per AOT graph kind ("forward", "backward", "inference"), the tags
            of its ops in order (`blk3.sb1`), untagged ops left out.
        graphs: the AOT graphs themselves, by kind (the last one of each kind).
        partitioned: the forward and backward of a training step as partitioned and
            planned, before they are compiled (the backward is compiled at the first
            backward call; `explain` and `tune` never make one): what the memory and
            time models read.
        block_inputs: block index -> positions among the graph's inputs of the
            parameters it reads (AOTAutograd's backward returns gradients in that order).
        streamed_bytes: bytes of block weights fetched from their tier each pass (P).
        weights: which parameters stream from their tier and which stay on the
            device, with the reason (`slcompile.passes.stream_weights.WeightPlacement`),
            or None when no weight streams.
        fused_weight_grads: weight gradients summed over sub-batches in one matmul.
        memory: the predicted memory per tier (`MemoryPrediction`) of the plan
            compiled, for the example inputs.
        budget_guard: under a `memory_budget`, with symbolic sizes, the condition
            on them under which the plan compiled fits the budget, which Dynamo
            guards the graph with (`slcompile.backends.lowering.guard_budget`); else None.
        offloaded_activations: which saved activations rest off the device.
        spilled_boundaries: which boundary activations rest off the device while they
            wait for their sub-batch's next region (`SpilledBoundaries`).
        offloaded_gradients: which weight gradients the backward stores off the
            device, per block (`GradientReport`), or None.
        traced_units: how AOTAutograd traced the step's (block, sub-batch) units
            (`slcompile.passes.trace_units.TracedUnits`: as calls of one subgraph per
            distinct unit, the `trace_units_once` option), or None: every op traced.
        regions: per AOT graph kind, what `compile_regions` did to it
            (`slcompile.passes.outline_regions.RegionOutline`); empty when the
            graphs were compiled flat.
        cudagraphs_skipped: why the step runs without the CUDA graphs that the
            `cudagraphs` option (or mode="reduce-overhead") asked for, or None.
        graphs_dropped: True for a report of the history older than the newest
            `GRAPHS_KEPT`: a copy without `graphs` and `partitioned`.
        compiled: False for the report of a configuration Dynamo ran eagerly, not
            compiling it at all (its recompile limit hit on the frame:
            `fallback_reason` says so); True for every graph the backend compiled,
            plainly or not.
    """

    config: object
    fallback_reason: str | None = None
    blocks: tuple[str, ...] = ()
    batch_size: int | None = None
    schedule: str = ""
    planned_schedule: object = None
    pass_log: PassLog = dataclasses.field(default_factory=PassLog)
    graph_order: dict[str, tuple[str, ...]] = dataclasses.field(default_factory=dict)
    graphs: dict[str, torch.fx.GraphModule] = dataclasses.field(default_factory=dict)
    partitioned: dict[str, torch.fx.GraphModule] = dataclasses.field(default_factory=dict)
    block_inputs: dict[int, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    streamed_bytes: int = 0
    weights: object = None
    fused_weight_grads: int = 0
    memory: object = None
    budget_guard: object = None
    offloaded_activations: object = None
    spilled_boundaries: object = None
    offloaded_gradients: object = None
    traced_units: object = None
    regions: dict[str, object] = dataclasses.field(default_factory=dict)
    cudagraphs_skipped: str | None = None
    graphs_dropped: bool = False
    compiled: bool = True

    @property
    def passes_run(self) -> tuple[str, ...]:
        """`"stage/name (N ms)"` per pass run, in order, across all stages."""
        return tuple(self.pass_log.entries)

    def predicted_peak_bytes(self, sizes=None) -> int:
        """Peak bytes the compiled step allocates on the device, from the lifetimes
        of its forward and backward graphs (parameters and inputs excluded; no
        prefetch, loads at their own size): `predict_step_memory(...).step_peak_bytes`
        of the graphs as compiled.

        Args:
            sizes: values for the size symbols of a dynamic graph; default: the
                example inputs'.
        """
        from slcompile.analysis.memory import predict_step_memory

        if self.graphs_dropped:
            raise ValueError(f"this report's graphs were dropped from the history of compile reports (only the "
                             f"newest {GRAPHS_KEPT} keep theirs): read predicted_peak_bytes() of a report "
                             "held from when it was the newest")
        return predict_step_memory(self.graphs, sizes=sizes).step_peak_bytes

    def record_graph(self, kind: str, gm: torch.fx.GraphModule) -> None:
        tags = []
        for node in gm.graph.nodes:
            meta = get_slc_meta(node) if node.op == "call_function" else None
            if meta is not None:
                tags.append(meta.tag)
        self.graph_order[kind] = tuple(tags)
        self.graphs[kind] = gm

    def without_graphs(self) -> "CompileReport":
        """A copy without the graphs (the rest shared): what the history keeps of
        an older report."""
        return dataclasses.replace(self, graphs={}, partitioned={}, graphs_dropped=True)


def add_report(report: CompileReport) -> None:
    with _lock:
        _reports.append(report)
        if len(_reports) > GRAPHS_KEPT:
            position = len(_reports) - 1 - GRAPHS_KEPT
            older = _reports[position]
            if older.graphs or older.partitioned:
                _reports[position] = older.without_graphs()


def discard_report(report: CompileReport) -> None:
    """Takes `report` out of the history (a compile Dynamo restarted)."""
    with _lock:
        for position, kept in enumerate(_reports):
            if kept is report:
                del _reports[position]
                return


def compile_reports() -> list[CompileReport]:
    """The reports of the graphs compiled in this process, oldest first, and of the
    configurations Dynamo ran eagerly past its recompile limit (`compiled` False)."""
    with _lock:
        return list(_reports)


def clear_compile_reports() -> None:
    with _lock:
        _reports.clear()
