"""The `speedloader` Dynamo backend.

Registered through the `torch_dynamo_backends` entry point, so
`torch.compile(model, backend="speedloader", options={...})` works after
`pip install` with no import of slcompile. Dynamo hands over each captured graph and
its example inputs; the backend runs the pass pipeline on it and lowers the rewritten
graph, or, when the pipeline refuses, lowers the original graph and logs one warning
with the reason (`on_refusal="raise"` raises instead). Results are never silently
different: a dynamic batch that turns out not divisible by K at run time runs the
plain graph, compiled on first need.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.fx

from slcompile.backends.lowering import StepPlan, lower
from slcompile.config import SpeedLoaderConfig
from slcompile.errors import RefusedError
from slcompile.pipeline import run_pipeline
from slcompile.report import CompileReport, add_report
from slcompile.schedules.policies import policy_for

__all__ = ["speedloader_backend"]

log = logging.getLogger("slcompile")


def speedloader_backend(
    gm: torch.fx.GraphModule, example_inputs: Sequence[Any], options: dict | None = None
) -> Callable:
    """The backend: `torch.compile(model, backend="speedloader", options=options)`.

    Raises:
        ValueError: an unknown option or a bad value (the message names the key).
        RefusedError: with `on_refusal="raise"`, when the graph cannot be split.
    """
    config = SpeedLoaderConfig.from_options(options)
    report = CompileReport(config=config)
    add_report(report)
    original = gm
    try:
        state = run_pipeline(gm, example_inputs, config)
    except RefusedError as err:
        if config.on_refusal == "raise":
            raise
        report.fallback_reason = str(err)
        log.warning(
            "speedloader: compiling this graph with plain %s instead: %s", config.lowering, err
        )
        return lower(gm, example_inputs, config.lowering, report)

    report.blocks = tuple(b.path for b in state.blocks.blocks)
    report.batch_size = state.batch.batch_size
    report.block_inputs = {
        b.index: tuple(state.batch.input_index[name] for name in b.params) for b in state.blocks.blocks
    }
    report.passes_run = state.passes_run
    report.schedule = policy_for(config.schedule).build(state.blocks, config.num_subbatches).text()
    streams = state.streamed is not None
    compiled = lower(state.gm, example_inputs, config.lowering, report, step_plan(state))
    if streams:
        _offload_weights(state)
        report.streamed_bytes = state.streamed.streamed_bytes
    if not state.batch.dynamic or config.num_subbatches == 1:
        return compiled
    return _DivisibleBatchGuard(compiled, original, example_inputs, state, report)


def step_plan(state) -> StepPlan:
    """The StepPlan of a pipeline state that ran through `interleave`."""
    config = state.config
    return StepPlan(
        block_positions={block.index: pos for pos, block in enumerate(state.blocks.blocks)},
        num_subbatches=config.num_subbatches,
        streamer=state.streamer,
        stash=_activation_stash(config),
        recompute=config.recompute,
        min_offload_bytes=config.min_offload_bytes,
        memory_budget=config.memory_budget,
        live_blocks=config.live_blocks,
        weights_tier=config.weights if state.streamer is not None else "device",
        activations_tier=config.activations,
        streamed_bytes=state.streamed.streamed_bytes if state.streamed is not None else 0,
        sample_major=policy_for(config.schedule).sample_major,
    )


def _activation_stash(config: SpeedLoaderConfig):
    """An ActivationStash on the configured tier, or None when activations stay."""
    from slcompile.pipeline import engine_for
    from slcompile.runtime.activations import ActivationStash
    from slcompile.runtime.tiers import Tier

    if config.activations == "device":
        return None
    engine = engine_for(config.offload_dir)
    if engine.copies_nothing(Tier(config.activations), Tier.DEVICE):
        log.debug("activations=%s copies nothing on this machine: they stay on the device", config.activations)
        return None
    return ActivationStash(engine, config.activations)


def _offload_weights(state) -> None:
    """After lowering (which traced with the real values), move the streamed weights
    to their tier and release the parameters' memory."""
    streamer = state.streamer
    values = {i.name: i.value for i in state.inputs}
    for block in state.streamed.blocks:
        for name, key in block:
            streamer.offload(key, values[name])
    log.info(
        "speedloader: %d bytes of block weights now rest on %s", state.streamed.streamed_bytes, streamer.tier.value
    )


class _DivisibleBatchGuard:
    """Checks a dynamic batch against K on every call; runs the plain graph if it
    does not divide (compiled once, on first need), with one warning."""

    def __init__(self, compiled, original, example_inputs, state, report):
        self.compiled = compiled
        self.original = original
        self.example_inputs = list(example_inputs)
        self.config = state.config
        self.report = report
        name, dim = next(iter(state.batch.batched_inputs.items()))
        self.position = state.batch.input_index[name]
        self.dim = dim
        self.plain = None
        self.lock = threading.Lock()

    def __call__(self, *args: Any) -> Any:
        batch = args[self.position].shape[self.dim]
        if batch % self.config.num_subbatches == 0:
            return self.compiled(*args)
        with self.lock:
            if self.plain is None:
                log.warning(
                    "speedloader: batch size %d is not divisible by num_subbatches=%d; "
                    "running this call with plain %s",
                    batch, self.config.num_subbatches, self.config.lowering,
                )
                plain_report = CompileReport(config=self.config, fallback_reason=(
                    f"batch size {batch} is not divisible by num_subbatches={self.config.num_subbatches}"
                ))
                self.plain = lower(self.original, self.example_inputs, self.config.lowering, plain_report)
        return self.plain(*args)
