"""`slcompile.explain(model, *args, **options)`: what the backend would do, without training.

Captures the model's graphs with Dynamo (the model's forward runs once, eagerly, with
the given inputs; no backward, no optimizer) and runs the analysis passes on each
graph: the blocks found, the batch dimension, K, the fallback reason (or None) and the
schedule as deterministic text. Graphs that would be rewritten are also lowered with
AOTAutograd (traced and partitioned, nothing compiled to code, no weight moved) to
predict the step's peak memory per tier from the lifetimes of its graphs; their
schedule is then the one the transfers were placed by, and the planner's decision
for each step's saved activations (stash or keep) is listed.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from slcompile.config import SpeedLoaderConfig
from slcompile.errors import BudgetError, RefusedError
from slcompile.pipeline import run_pipeline
from slcompile.schedules.planner import describe

__all__ = ["Explanation", "GraphExplanation", "explain"]


@dataclasses.dataclass(frozen=True)
class GraphExplanation:
    """One captured graph.

    Attributes:
        blocks: the block paths found (`model.layers.0`, ...).
        block_groups: block positions grouped by structural identity.
        batch_inputs: per batched input (as Dynamo names it: `L['idx']`), its batch dim.
        batch_size: the batch size of the example inputs.
        num_subbatches: K.
        fallback_reason: why this graph would compile without sub-batching, or None.
        schedule: the schedule text, one line per step (`fwd blk3.sb1`).
        predicted_peak_bytes: per tier ("device", "host", "nvme"), the predicted
            peak of one step for the example inputs, or None.
        memory_expressions: the same (and the step's own peak) as sympy expressions
            of the size symbols.
        memory: the full `MemoryPrediction`, or None.
        budget_error: why no plan fits `memory_budget`, or None.
        activation_plan: per forward step whose saved activations may leave the
            device, the planner's decision (`stash` or `keep`) with their bytes and
            idle steps (`slcompile.schedules.planner.describe`).
    """

    blocks: tuple[str, ...]
    block_groups: tuple[tuple[int, ...], ...]
    batch_inputs: dict[str, int]
    batch_size: int | None
    num_subbatches: int
    fallback_reason: str | None
    schedule: str
    predicted_peak_bytes: dict[str, int] | None = None
    memory_expressions: dict | None = None
    memory: Any = None
    budget_error: str | None = None
    activation_plan: tuple[str, ...] = ()

    def __str__(self) -> str:
        lines = [
            f"blocks: {len(self.blocks)} ({', '.join(self.blocks[:2])}{', ...' if len(self.blocks) > 2 else ''})",
            f"structural groups: {len(self.block_groups)}",
            f"batch: size {self.batch_size}, inputs "
            + (", ".join(f"{k} dim {v}" for k, v in self.batch_inputs.items()) or "none"),
            f"num_subbatches: {self.num_subbatches}",
            f"fallback: {self.fallback_reason or 'none'}",
        ]
        if self.memory is not None:
            lines.append(str(self.memory))
        if self.budget_error is not None:
            lines.append(f"memory budget: {self.budget_error}")
        if self.activation_plan:
            lines += ["saved activations:", *("  " + line for line in self.activation_plan)]
        lines += ["schedule:", *("  " + line for line in self.schedule.splitlines())]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What the backend would do with every graph of the model.

    The attributes of the first graph are mirrored at the top level; a model with
    graph breaks has several graphs.
    """

    graphs: tuple[GraphExplanation, ...]

    def _first(self) -> GraphExplanation:
        if not self.graphs:
            raise ValueError("Dynamo captured no graph for this model and these inputs")
        return self.graphs[0]

    @property
    def blocks(self) -> tuple[str, ...]:
        return self._first().blocks

    @property
    def batch_inputs(self) -> dict[str, int]:
        return self._first().batch_inputs

    @property
    def num_subbatches(self) -> int:
        return self._first().num_subbatches

    @property
    def fallback_reason(self) -> str | None:
        return self._first().fallback_reason

    @property
    def schedule(self) -> str:
        return self._first().schedule

    @property
    def predicted_peak_bytes(self) -> dict[str, int] | None:
        return self._first().predicted_peak_bytes

    @property
    def memory_expressions(self) -> dict | None:
        return self._first().memory_expressions

    def __str__(self) -> str:
        parts = []
        for i, graph in enumerate(self.graphs):
            parts.append(f"graph {i}:\n" + "\n".join("  " + l for l in str(graph).splitlines()))
        return "\n".join(parts)


def explain(model: torch.nn.Module, *args: Any, kwargs: Mapping[str, Any] | None = None, **options: Any) -> Explanation:
    """Explains how the speedloader backend would compile `model(*args, **kwargs)`.

    Args:
        model: the model (or any callable Dynamo can capture).
        *args: its positional inputs.
        kwargs: its keyword inputs (`labels=...`).
        **options: backend options, as in `torch.compile(..., options=...)`.

    Returns:
        the Explanation, one entry per captured graph.
    """
    config = SpeedLoaderConfig.from_options(options)
    graphs: list[GraphExplanation] = []

    def capture(gm: torch.fx.GraphModule, example_inputs):
        graphs.append(_explain_graph(gm, example_inputs, config))
        return gm.forward

    compiled = torch.compile(model, backend=capture, fullgraph=False)
    compiled(*args, **dict(kwargs or {}))
    return Explanation(tuple(graphs))


def _explain_graph(gm, example_inputs, config: SpeedLoaderConfig) -> GraphExplanation:
    try:
        state = run_pipeline(gm, example_inputs, config)
        reason = None
    except RefusedError as err:
        # Report what the analysis found before it refused.
        state = err.state
        reason = str(err)
    blocks = state.blocks if state is not None else None
    batch = state.batch if state is not None else None
    sources = {}
    if batch is not None:
        names = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        for name, dim in batch.batched_inputs.items():
            grapharg = names[name].meta.get("grapharg")
            source = getattr(getattr(grapharg, "source", None), "name", name)
            sources[source() if callable(source) else source] = dim
    planned = getattr(state, "schedule", None)
    schedule = planned.text() if planned is not None and reason is None else ""
    memory, budget_error, activation_plan = None, None, ()
    if reason is None and state is not None and state.interleaved is not None:
        memory, budget_error, lowered = _predict(state, example_inputs)
        if lowered is not None:  # with the transfers placed from the lifetimes
            schedule = lowered.text()
            activation_plan = describe(lowered)
    return GraphExplanation(
        blocks=tuple(b.path for b in blocks.blocks) if blocks else (),
        block_groups=blocks.groups if blocks else (),
        batch_inputs=sources,
        batch_size=batch.batch_size if batch else None,
        num_subbatches=config.num_subbatches,
        fallback_reason=reason,
        schedule=schedule,
        predicted_peak_bytes=dict(memory.peak_bytes) if memory is not None else None,
        memory_expressions=dict(memory.expressions) if memory is not None else None,
        memory=memory,
        budget_error=budget_error,
        activation_plan=activation_plan,
    )


def _predict(state, example_inputs):
    """(MemoryPrediction, None, the lowered step's planned Schedule), or (None, why
    no plan fits the budget, None)."""
    from slcompile.backends.lowering import lower
    from slcompile.backends.speedloader import step_plan
    from slcompile.report import CompileReport

    report = CompileReport(config=state.config)
    try:
        lower(state.gm, example_inputs, "aot_eager", report, step_plan(state))
    except BudgetError as err:
        return None, str(err), None
    return report.memory, None, report.planned_schedule

