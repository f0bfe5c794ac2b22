"""The pass pipeline: the order is data, and every pass can be dumped or skipped.

`run_pipeline(gm, example_inputs, config)` runs `PASSES` in order on a Dynamo graph.
Each pass is a pure function of the state so far; the runner lints the graph after
every pass, names the passes run so far in any error, writes
`$SLC_DUMP_DIR/NNN_passname.txt` after each pass when that variable is set, and skips
the passes named in `SLC_DISABLE` (comma separated; only the optional ones), saying so
in the log.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import pathlib
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from slcompile.analysis.batch_propagation import BatchPlan, propagate_batch
from slcompile.analysis.inputs import GraphInput, classify_inputs
from slcompile.config import SpeedLoaderConfig
from slcompile.errors import RefusedError
from slcompile.passes.check_splittable import check_splittable
from slcompile.passes.find_batch_dim import BatchInfo, find_batch_dim
from slcompile.passes.find_blocks import BlockGraph, find_blocks
from slcompile.passes.interleave import InterleaveReport, interleave
from slcompile.passes.stream_weights import StreamedWeights, stream_weights
from slcompile.schedules.policies import policy_for

__all__ = ["PipelineState", "Pass", "PASSES", "run_pipeline", "disabled_passes"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class PipelineState:
    """Everything the passes have produced so far.

    Attributes:
        gm: the current graph (the Dynamo graph until `interleave` rewrites it).
        example_inputs: Dynamo's example inputs, one per placeholder.
        config: the backend's options.
        inputs: placeholders classified (param, buffer, user, size).
        blocks: prefix, blocks, suffix.
        batch: the batch dimension of each input.
        plan: how each node runs over sub-batches.
        interleaved: what `interleave` emitted, if it ran.
        streamer: the runtime's WeightStreamer when weights rest off the device.
        streamed: which weights `stream_weights` fetches per block.
        passes_run: names of the passes run, with their time, in order.
    """

    gm: torch.fx.GraphModule
    example_inputs: Sequence[Any]
    config: SpeedLoaderConfig
    inputs: tuple[GraphInput, ...] | None = None
    blocks: BlockGraph | None = None
    batch: BatchInfo | None = None
    plan: BatchPlan | None = None
    interleaved: InterleaveReport | None = None
    streamer: Any = None
    streamed: StreamedWeights | None = None
    passes_run: tuple[str, ...] = ()


@dataclasses.dataclass(frozen=True)
class Pass:
    name: str
    run: Callable[[PipelineState], PipelineState]
    optional: bool = False


def _classify(state: PipelineState) -> PipelineState:
    return dataclasses.replace(state, inputs=tuple(classify_inputs(state.gm, state.example_inputs)))


def _find_blocks(state: PipelineState) -> PipelineState:
    return dataclasses.replace(state, blocks=find_blocks(state.gm, list(state.inputs)))


def _find_batch_dim(state: PipelineState) -> PipelineState:
    batch = find_batch_dim(
        state.gm, list(state.inputs), state.config.batch_dim, state.config.num_subbatches
    )
    return dataclasses.replace(state, batch=batch)


def _propagate(state: PipelineState) -> PipelineState:
    plan = propagate_batch(
        state.gm,
        state.inputs,
        state.batch.batched_inputs,
        state.batch.batch_symbols,
        state.batch.batch_size,
        state.config.num_subbatches,
        state.blocks.regions,
    )
    return dataclasses.replace(state, plan=plan)


def _check(state: PipelineState) -> PipelineState:
    return dataclasses.replace(state, plan=check_splittable(state.plan))


def _interleave(state: PipelineState) -> PipelineState:
    sample_major = policy_for(state.config.schedule).sample_major
    gm, report = interleave(state.gm, state.blocks, state.batch, state.plan, sample_major=sample_major)
    return dataclasses.replace(state, gm=gm, interleaved=report)


def _stream(state: PipelineState) -> PipelineState:
    from slcompile.runtime.engine import get_engine
    from slcompile.runtime.tiers import Tier
    from slcompile.runtime.weights import WeightStreamer

    if state.interleaved is None or state.config.weights == "device":
        return state
    engine = engine_for(state.config.offload_dir)
    if engine.copies_nothing(Tier(state.config.weights), Tier.DEVICE):
        log.debug("weights=%s copies nothing on this machine: weights stay resident", state.config.weights)
        return state
    streamer = WeightStreamer(engine, state.config.weights, state.config.live_blocks)
    gm, streamed = stream_weights(
        state.gm, state.blocks, state.inputs, streamer.stored_key_for, streamer.graph_key,
        per_subbatch=policy_for(state.config.schedule).sample_major,
    )
    return dataclasses.replace(state, gm=gm, streamer=streamer, streamed=streamed)


_ENGINES: dict[str, Any] = {}


def engine_for(offload_dir: str | None):
    """The process-wide engine, or one engine per offload directory."""
    from slcompile.runtime.engine import TransferEngine, get_engine

    if offload_dir is None:
        return get_engine()
    if offload_dir not in _ENGINES:
        _ENGINES[offload_dir] = TransferEngine(offload_dir=offload_dir)
    return _ENGINES[offload_dir]


PASSES: tuple[Pass, ...] = (
    Pass("classify_inputs", _classify),
    Pass("find_blocks", _find_blocks),
    Pass("find_batch_dim", _find_batch_dim),
    Pass("propagate_batch", _propagate),
    Pass("check_splittable", _check, optional=True),
    Pass("interleave", _interleave, optional=True),
    Pass("stream_weights", _stream, optional=True),
)


def disabled_passes() -> set[str]:
    """Pass names listed in `SLC_DISABLE` (comma separated)."""
    return {p.strip() for p in os.environ.get("SLC_DISABLE", "").split(",") if p.strip()}


def run_pipeline(
    gm: torch.fx.GraphModule,
    example_inputs: Sequence[Any],
    config: SpeedLoaderConfig,
    *,
    passes: Sequence[Pass] = PASSES,
    stop_after: str | None = None,
) -> PipelineState:
    """Runs the passes on a Dynamo graph.

    Args:
        gm: the Dynamo graph.
        example_inputs: Dynamo's example inputs.
        config: the backend's options.
        passes: the passes to run, in order.
        stop_after: the name of the last pass to run (analysis without rewriting).

    Returns:
        the final state.

    Raises:
        RefusedError: a pass refused the graph; the message names the passes run and
            `err.state` holds what the passes before it produced.
    """
    disabled = disabled_passes()
    dump_dir = os.environ.get("SLC_DUMP_DIR")
    state = PipelineState(gm=gm, example_inputs=example_inputs, config=config)
    for number, step in enumerate(passes):
        if step.name in disabled:
            if not step.optional:
                raise ValueError(f"SLC_DISABLE names {step.name}, which the pipeline cannot run without")
            log.warning("speedloader: pass %s skipped (SLC_DISABLE)", step.name)
            continue
        started = time.perf_counter()
        try:
            state = step.run(state)
            state.gm.graph.lint()
        except RefusedError as err:
            err.pass_name = step.name
            err.state = state
            raise
        except Exception as exc:
            ran = ", ".join(state.passes_run) or "none"
            err = RefusedError(
                f"internal error in pass {step.name} ({type(exc).__name__}: {exc}); passes run: {ran}",
                step.name,
            )
            err.state = state
            raise err from exc
        took = time.perf_counter() - started
        state = dataclasses.replace(state, passes_run=(*state.passes_run, f"{step.name} ({took * 1e3:.0f} ms)"))
        if dump_dir:
            _dump(pathlib.Path(dump_dir), number, step.name, state)
        if step.name == stop_after:
            break
    return state


def _dump(directory: pathlib.Path, number: int, name: str, state: PipelineState) -> None:
    from slcompile.viz.dot import graph_to_dot

    directory.mkdir(parents=True, exist_ok=True)
    stem = directory / f"{number:03d}_{name}"
    header = f"# after {state.passes_run[-1]}\n"
    stem.with_suffix(".txt").write_text(header + state.gm.print_readable(print_output=False))
    stem.with_suffix(".dot").write_text(graph_to_dot(state.gm, title=name))
