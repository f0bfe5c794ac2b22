"""`slcompile.explain(model, *args, **options)`: what the backend would do, without training.

Captures the model's graphs with Dynamo (the model's forward runs once, eagerly, with
the given inputs, weights that a compiled step moved to their tier loaded for the
run; no backward, no optimizer; apart from the recompile limit of the
model's own `torch.compile`, and leaving no runtime object behind) and runs the analysis passes on each
graph: the blocks found, the batch dimension, K, the fallback reason (or None) and the
schedule as deterministic text. Graphs that would be rewritten are also lowered with
AOTAutograd (traced and partitioned, nothing compiled to code, no weight moved) to
predict the step's peak memory per tier from the lifetimes of its graphs; their
schedule is then the one the transfers were placed by, and the planner's decision
for each step's saved activations (stash or keep) is listed.

With an optimizer (the offloaded optimizer attached to the model, or the one given
with `optimizer=`), the prediction covers the whole step, `optimizer.step()`
included, and the explanation lists the optimizer's share per tier
(`MemoryPrediction.optimizer_lines`): on the device the resident parameters' state,
the step phase (their gradients and the step's temporaries) and the gradient
copies on their way out; on the host the master weights, the states, the
gradients a block step reads and its temporaries. On a CPU-only machine the host is
the same memory as the device, and a last line adds the two.
"""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Mapping
from typing import Any

import torch

from slcompile import defaults
from slcompile.backends.dumps import drawing_dumps
from slcompile.compat import capture_graphs
from slcompile.config import SpeedLoaderConfig, single_options
from slcompile.errors import (
    BudgetError, OffloadError, OptionError, RefusedError, as_refusal, compile_error, passes_through_fallback,
)
from slcompile.facts import process_facts
from slcompile.passes.stream_weights import weight_placement
from slcompile.pipeline import run_pipeline
from slcompile.runtime.gathering import loading_released_weights
from slcompile.schedules.planner import describe
from slcompile.schedules.policies import suffix_plans

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
        memory: the full `MemoryPrediction` (with the optimizer's share, printed
            per tier, when there is an optimizer), or None.
        budget_error: why no plan fits `memory_budget`, or None.
        activation_plan: per forward step whose saved activations may leave the
            device, the planner's decision (`stash` or `keep`) with their bytes and
            idle steps (`slcompile.schedules.planner.describe`).
        notes: what the backend changed of the options for this graph (gradient
            checkpointing run as `recompute="blocks"`).
        weights: which parameters would stream from the `weights` tier and which
            stay on the device, with the reason (`WeightPlacement`), or None when
            none streams.
        time: the predicted timeline of one steady-state step on the machine
            profile (`slcompile.analysis.time.TimePrediction`: per block compute,
            stalls and transfers per lane, the step time, tokens/s and what bounds
            it), or None. A prediction, not a measurement.
        planned_schedule: the `Schedule` whose text is `schedule` (with the
            policy and the request that wrote it, so `to_json()` keeps what it was
            written for), or None when the graph would compile plainly.
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
    notes: tuple[str, ...] = ()
    weights: Any = None
    time: Any = None
    planned_schedule: Any = dataclasses.field(default=None, repr=False)

    def __str__(self) -> str:
        lines = [
            f"blocks: {len(self.blocks)} ({', '.join(self.blocks[:2])}{', ...' if len(self.blocks) > 2 else ''})",
            f"structural groups: {len(self.block_groups)}",
            f"batch: size {self.batch_size}, inputs "
            + (", ".join(f"{k} dim {v}" for k, v in self.batch_inputs.items()) or "none"),
            f"num_subbatches: {self.num_subbatches}",
            f"fallback: {self.fallback_reason or 'none'}",
            *(f"note: {note}" for note in self.notes),
        ]
        if self.weights is not None:
            lines += self.weights.lines()
        if self.memory is not None:
            lines.append(str(self.memory))
        if self.time is not None:
            lines.append(str(self.time))
        if self.budget_error is not None:
            lines.append(f"memory budget: {self.budget_error}")
        if self.activation_plan:
            lines += ["saved activations:", *("  " + line for line in self.activation_plan)]
        spilled = [line.split()[-1] for line in self.schedule.splitlines() if line.startswith("fwd spill.issue ")]
        if spilled:
            lines.append(f"boundary activations spilled while they wait: {len(spilled)} "
                         f"({', '.join(spilled[:3])}{', ...' if len(spilled) > 3 else ''})")
        lines += ["schedule:", *("  " + line for line in self.schedule.splitlines())]
        return "\n".join(lines)


@dataclasses.dataclass(frozen=True)
class Explanation:
    """What the backend would do with every graph of the model.

    The attributes of the first graph are mirrored at the top level; a model with
    graph breaks has several graphs.
    """

    graphs: tuple[GraphExplanation, ...]
    # Every option not at its default: (name, value, where it came from: "options",
    # "slcompile.defaults" or an SLC_* environment variable).
    options: tuple[tuple[str, Any, str], ...] = ()

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

    @property
    def weights(self):
        """The first graph's `WeightPlacement`, or None."""
        return self._first().weights

    @property
    def memory(self):
        """The first graph's `MemoryPrediction`, or None."""
        return self._first().memory

    @property
    def time(self):
        """The first graph's predicted timeline (`TimePrediction`), or None."""
        return self._first().time

    @property
    def planned_schedule(self):
        """The first graph's `Schedule`, or None when it would compile plainly."""
        return self._first().planned_schedule

    def write_predicted_timeline(self, out_dir, title: str | None = None):
        """Writes the first graph's predicted timeline into `out_dir` as
        `predicted_trace.json` (a Chrome trace) and `predicted_timeline.png`
        (`slcompile.viz.pictures.write_predicted_timeline`); returns the paths by
        picture.

        Raises:
            ValueError: there is no predicted timeline (`profile=None`, or a graph
                compiled plainly).
        """
        from slcompile.viz.pictures import write_predicted_timeline

        if self.time is None:
            raise ValueError("no predicted timeline to write: explain(..., profile=None) predicts none, nor does "
                             "a graph compiled plainly")
        return write_predicted_timeline(out_dir, self.time, title)

    def __str__(self) -> str:
        parts = ["options: " + (", ".join(f"{name}={value!r} ({source})" for name, value, source in self.options)
                                or "the defaults")]
        for i, graph in enumerate(self.graphs):
            parts.append(f"graph {i}:\n" + "\n".join("  " + l for l in str(graph).splitlines()))
        return "\n".join(parts)


def explain(
    model: torch.nn.Module,
    *args: Any,
    kwargs: Mapping[str, Any] | None = None,
    optimizer: Any = None,
    optimizer_options: Mapping[str, Any] | None = None,
    profile: Any = "current",
    **options: Any,
) -> Explanation:
    """Explains how the speedloader backend would compile `model(*args, **kwargs)`.

    Args:
        model: the model (or any callable Dynamo can capture).
        *args: its positional inputs.
        kwargs: its keyword inputs (`labels=...`).
        optimizer: the optimizer whose step the prediction covers: an
            `OffloadedOptimizer`, or a `torch.optim.Optimizer` class as
            `slcompile.offload_optimizer` would run it; default: the offloaded
            optimizer attached to the model, if any.
        optimizer_options: with a class, the keyword options of
            `slcompile.offload_optimizer` (`states=`, `gradients=`, `max_grad_norm=`,
            and the class's own: `lr=`, `weight_decay=`, `foreach=`, ...).
        profile: the machine the predicted timeline is for: "current" (this
            machine's measured profile, `slcompile.profile.machine_profile`), a
            named profile ("h100-pcie5-nvme", "8xh100-ib": what-if questions on
            paper), a `MachineProfile`, or None for no timeline.
        **options: backend options, as in `torch.compile(..., options=...)`; those
            not given take their defaults from `slcompile.defaults`. Each takes one
            value, or a sequence of one (`slcompile.config.option_values`: `tune`
            searches several).

    Returns:
        the Explanation, one entry per captured graph, and the options that are not
        at their defaults with where each came from (printed first).
    """
    from slcompile.measure import machine_profile

    options = single_options(options, "explain")
    config = SpeedLoaderConfig.from_options(options)
    _, sources = defaults.resolve(options)
    check_optimizer(optimizer, optimizer_options, "explain")
    machine = (machine_profile(profile, offload_dir=config.offload_dir, refuse_untrusted=True)
               if profile is not None else None)
    tiers = transfer_tiers(config, optimizer_options)
    planned = config
    if machine is not None and not machine.host_is_device and not torch.cuda.is_available() \
            and "host" in (config.weights, config.activations):
        # Here host memory is the device's, so "host" would move nothing; the profile's
        # machine has a host link: plan the transfers a separate tier needs (as for
        # nvme), and time them on the link.
        planned = dataclasses.replace(
            config, weights="nvme" if config.weights == "host" else config.weights,
            activations="nvme" if config.activations == "host" else config.activations)
    graphs: list[GraphExplanation] = []

    def explain_graph(gm: torch.fx.GraphModule, example_inputs):
        try:
            # As the backend: under a budget the whole suffix does not fit, per sub-batch.
            for asked in suffix_plans(planned):
                graph = _explain_graph(gm, example_inputs, asked, optimizer, optimizer_options, machine, tiers)
                if graph.budget_error is None:
                    break
            graphs.append(graph)
        except (OptionError, OffloadError) as err:
            # What torch.compile raises for it: Dynamo re-raises a CompileError as it
            # is, where it would wrap anything else in its BackendCompilerFailed.
            raise compile_error(err, inspect.currentframe()).with_traceback(err.__traceback__) from None
        if planned is not config:
            graphs[-1] = dataclasses.replace(graphs[-1], notes=graphs[-1].notes + (
                f"host tier planned as a separate memory, as on {machine.name}: this machine's host is its "
                "device, so the predicted peak names the host's bytes nvme",))

    kwargs = dict(kwargs or {})
    without_cache = _without_kv_cache_on_meta(model, args, kwargs)
    # The streamers, stashes and sinks planned here die with the plans: nothing compiled holds them.
    # Weights a compiled step moved to their tier are loaded for the captured run, as
    # the backend's plain graphs load them.
    try:
        capture_graphs(model, args, kwargs, explain_graph, run_as=loading_released_weights)
    except Exception as err:
        if _asks_autocast_about_meta(err):
            raise OptionError(
                "this forward asks autocast about the meta device, which torch refuses, so it cannot be explained "
                "without weights (transformers before 5.4 does so in its rotary embeddings): upgrade "
                "transformers, or explain the model on the CPU") from err
        raise
    if without_cache is not None:
        graphs[:] = [dataclasses.replace(graph, notes=graph.notes + (without_cache,)) for graph in graphs]
    return Explanation(tuple(graphs), tuple((name, getattr(config, name), source) for name, source in sources.items()))


def _asks_autocast_about_meta(err: BaseException) -> bool:
    """Whether capturing failed in `torch.is_autocast_enabled("meta")` or its like."""
    while err is not None:
        if isinstance(err, RuntimeError) and "unknown device type for autocast" in str(err):
            return True
        err = err.__cause__ or err.__context__
    return False


def _without_kv_cache_on_meta(model, args, kwargs: dict) -> str | None:
    """On the meta device, sets `use_cache=False` in `kwargs` for a Hugging Face
    forward that would build a KV cache, and returns the note saying so (else None).

    A `DynamicCache` starts each layer from `torch.tensor([])`, which under Dynamo's
    fake tensors stays a real meta tensor that `torch.cat` refuses beside the fake
    keys; a training step needs no cache (Hugging Face drops it under gradient
    checkpointing too), and a model on the meta device only ever runs on paper.
    """
    import inspect

    if "use_cache" in kwargs or not getattr(getattr(model, "config", None), "use_cache", False):
        return None
    try:
        takes_use_cache = "use_cache" in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return None
    tensors = [*args, *kwargs.values(), *model.parameters(), *model.buffers()] if isinstance(model, torch.nn.Module) \
        else [*args, *kwargs.values()]
    on_meta = any(isinstance(value, torch.Tensor) and value.device.type == "meta" for value in tensors)
    if not (takes_use_cache and on_meta):
        return None
    kwargs["use_cache"] = False
    return ("captured with use_cache=False: on the meta device the forward's KV cache cannot be traced, and a "
            "training step reads none; pass use_cache=False to the compiled model's calls to train the same graph")


@drawing_dumps()
def _explain_graph(gm, example_inputs, config: SpeedLoaderConfig, optimizer=None,
                   optimizer_options=None, machine=None, tiers=None) -> GraphExplanation:
    try:
        state = run_pipeline(gm, example_inputs, config, facts=process_facts(config, example_inputs))
        reason = None
    except RefusedError as err:
        # Report what the analysis found before it refused.
        state = err.state
        reason = str(err)
    except Exception as err:  # noqa: BLE001  (the backend falls back on any failure: say why)
        if passes_through_fallback(err):
            raise
        state, reason = None, str(as_refusal(err, "the Dynamo stage"))
    blocks = state.blocks if state is not None else None
    batch = state.batch if state is not None else None
    sources = {}
    if batch is not None:
        names = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
        for name, dim in batch.batched_inputs.items():
            grapharg = names[name].meta.get("grapharg")
            source = getattr(getattr(grapharg, "source", None), "name", name)
            sources[source() if callable(source) else source] = dim
    planned = getattr(state, "schedule", None) if reason is None else None
    schedule = planned.text() if planned is not None else ""
    memory, budget_error, activation_plan, timeline = None, None, (), None
    if reason is None and state is not None and state.interleaved is not None:
        try:
            memory, budget_error, lowered, report = _predict(state, example_inputs, optimizer, optimizer_options)
        except RefusedError as err:  # as the backend: a failed lowering compiles plainly
            reason, schedule, planned, lowered, report = str(err), "", None, None, None
        if lowered is not None:  # with the transfers placed from the lifetimes
            planned, schedule = lowered, lowered.text()
            activation_plan = describe(lowered)
        if machine is not None and report is not None and (report.graphs or report.partitioned):
            timeline = predict_step_time(report, state, example_inputs, machine, tiers)
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
        notes=state.notes if state is not None else (),
        weights=weight_placement(state.streamed, state.inputs, state.streamer.tier)
        if reason is None and state is not None and state.streamed is not None else None,
        time=timeline,
        planned_schedule=planned,
    )


def transfer_tiers(config: SpeedLoaderConfig, optimizer_options=None) -> dict[str, str]:
    """The tier of each transfer kind's data under `config` (`predict_time`'s `tiers`)."""
    gradients = config.gradients
    if gradients not in ("host", "nvme"):
        gradients = (optimizer_options or {}).get("gradients", "host")
    return {"fetch": config.weights, "stash": config.activations, "unstash": config.activations,
            "store_grad": gradients}


def predict_step_time(report, state, example_inputs, machine, tiers=None):
    """The predicted timeline (`slcompile.analysis.time.predict_time`) of a lowered
    step's graphs on `machine`, with each transfer kind on its tier (`tiers`,
    default: where `state.config` puts it), and the step's tokens (the elements of
    its first integer batched input: token ids) for tokens/s."""
    tokens = None
    if state.batch is not None:
        positions = {n.name: i for i, n in enumerate(n for n in state.gm.graph.nodes if n.op == "placeholder")}
        for name in state.batch.batched_inputs:
            value = example_inputs[positions[name]] if name in positions else None
            if isinstance(value, torch.Tensor) and not value.is_floating_point():
                tokens = int(value.numel())
                break
        if tokens is None:
            tokens = state.batch.batch_size
    return report_time(report, state.config, machine, tiers, tokens)


def report_time(report, config: SpeedLoaderConfig, machine, tiers=None, tokens: int | None = None):
    """The predicted timeline of a compiled step's graphs (`report.partitioned`, else
    `report.graphs`) on `machine`: a training step when it holds a forward and a
    backward, else its inference or forward graph; each transfer kind on its tier
    (`tiers`, default: where `config` puts it); `tokens` per step for tokens/s.
    A measured profile's spread gives the interval's slow end
    (`TimePrediction.slow_step_seconds`)."""
    from slcompile.analysis.time import predict_time

    tiers = tiers or transfer_tiers(config)
    graphs = report.partitioned or report.graphs
    lowering = config.lowering if config.lowering in ("inductor", "aot_eager") else "aot_eager"
    if "forward" in graphs and "backward" in graphs:
        step, kind = (graphs["forward"], graphs["backward"]), {}
    else:
        kind = "inference" if "inference" in graphs else "forward"
        step, kind = (graphs[kind],), {"phase": "inference" if kind == "inference" else "fwd"}
    policy = getattr(config.schedule, "name", config.schedule)
    timeline = dataclasses.replace(
        predict_time(*step, profile=machine, tiers=tiers, tokens=tokens, lowering=lowering, **kind),
        policy=policy if isinstance(policy, str) else None, num_subbatches=config.num_subbatches)
    if not machine.spread:
        return timeline
    slow = predict_time(*step, profile=machine.at_spread(), tiers=tiers, tokens=tokens, lowering=lowering, **kind)
    return dataclasses.replace(timeline, slow_step_seconds=max(slow.step_seconds, timeline.step_seconds))


def _predict(state, example_inputs, optimizer=None, optimizer_options=None):
    """(MemoryPrediction, None, the lowered step's planned Schedule, the
    CompileReport), or (None, why no plan fits the budget, None, None)."""
    from slcompile.backends.lowering import failed_stage, lower
    from slcompile.report import CompileReport

    report = CompileReport(config=state.config)
    report.pass_log.entries.extend(state.passes_run)  # for the stage a failure names
    try:
        lower(state.gm, example_inputs, "aot_eager", report, plan_with_optimizer(state, optimizer, optimizer_options))
    except BudgetError as err:
        return None, str(err), None, None
    except Exception as err:  # noqa: BLE001  (the backend compiles plainly: the reason, as a refusal)
        if passes_through_fallback(err):
            raise
        raise as_refusal(err, failed_stage(report.pass_log, "aot_eager")) from err
    return report.memory, None, report.planned_schedule, report


def check_optimizer(optimizer, optimizer_options, caller: str) -> None:
    """Refuses an `optimizer=` / `optimizer_options=` pair `explain` or `tune` cannot use."""
    from slcompile.optim import OffloadedOptimizer

    if optimizer is None or isinstance(optimizer, OffloadedOptimizer):
        if optimizer_options:
            raise ValueError(f"{caller}: optimizer_options go with an optimizer class (optimizer=torch.optim.AdamW); "
                             "an OffloadedOptimizer already has its options")
        return
    if not (isinstance(optimizer, type) and issubclass(optimizer, torch.optim.Optimizer)):
        raise TypeError(f"{caller}: optimizer must be a torch.optim.Optimizer class (torch.optim.AdamW) or the "
                        f"OffloadedOptimizer of slcompile.offload_optimizer, got {optimizer!r}")
    options = dict(optimizer_options or {})
    tiers = ("host", "nvme")
    for name in ("states", "gradients"):
        value = options.pop(name, "host")
        if value not in tiers:
            raise ValueError(f"{caller}: optimizer_options[{name!r}] must be one of {tiers}, got {value!r}")
    options.pop("max_grad_norm", None)
    try:
        optimizer([torch.zeros(1, requires_grad=True)], **options)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{caller}: optimizer_options do not suit {optimizer.__name__}: {err}") from err


def plan_with_optimizer(state, optimizer=None, optimizer_options=None):
    """The StepPlan of a pipeline state (`step_plan`), with the step of `optimizer`
    (see `explain`) when one is given: the streamed weights' gradients then leave
    the device for it, as they would for an offloaded optimizer attached before
    compiling (`gradients="auto"`)."""
    from slcompile.analysis.optimizer_memory import optimizer_memory
    from slcompile.backends.speedloader import step_plan
    from slcompile.optim import OffloadedOptimizer
    from slcompile.plans import sink_plan

    plan = step_plan(state)
    if optimizer is None:
        return plan
    values = {i.name: i.value for i in state.inputs}
    blocks = state.streamed.blocks if state.streamed is not None else ()
    streamed = [[values[name] for name, _ in block] for block in blocks]
    if isinstance(optimizer, OffloadedOptimizer):
        memory, gradients_tier = optimizer.memory(streamed, plan.machine), optimizer.gradient_tier.value
    else:
        options = dict(optimizer_options or {})
        states, gradients_tier = options.pop("states", "host"), options.pop("gradients", "host")
        max_grad_norm = options.pop("max_grad_norm", None)
        off = {id(p) for block in streamed for p in block}
        resident = [i.value for i in state.inputs if i.kind == "param" and isinstance(i.value, torch.Tensor)
                    and i.value.requires_grad and id(i.value) not in off]
        # A frozen weight has no host copy, state or gradient to count.
        streamed = [trained for trained in ([p for p in block if p.requires_grad] for block in streamed) if trained]
        memory = optimizer_memory(
            optimizer, options, [resident], streamed, states=states, max_grad_norm=max_grad_norm,
            machine=plan.machine,
        )
    sink = plan.gradients
    if sink is None and state.config.gradients == "auto":
        sink = sink_plan(gradients_tier, state.streamer, state.streamed, state.inputs, state.facts.optimizer_held,
                         state.config.offload_dir)
    return dataclasses.replace(plan, optimizer=memory, gradients=sink)

