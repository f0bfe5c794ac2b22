"""The runtime objects of one compiled step (or one call of `generate`), made from its plans.

A `StepPlan` names its weight streamer, activation stash and gradient sink as plain
data (`slcompile.plans`). The backend makes a `StepRuntime` of those plans before
the lowering, every graph the lowering compiles holds it, and once the lowering
has succeeded (the step is about to run for the first time: Dynamo compiles on a
call) `start` makes the objects, registers them under their plans' names for the
graphs' `slc::` ops, and moves the streamed weights to their tier. The objects
then live as long as the last graph or callable holding the `StepRuntime` (a
backward can outlive the step's callable): the registries only point at them.

`explain`, `tune` and every plan a budget search discards lower without a
`StepRuntime` and make none of these objects. A call of `generate` makes its weight
streamer and activation stash the same way, from plans, when it starts; they go
with the call.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from slcompile.plans import HostPoolPlan, SinkPlan, StashPlan, StreamerPlan
from slcompile.runtime.activations import ActivationStash
from slcompile.runtime.gradients import GradientSink
from slcompile.runtime.storage.engine import get_engine
from slcompile.runtime.storage.tiers import PAGE_BYTES
from slcompile.runtime.weights import WeightStreamer, mark_sharded

__all__ = ["StepRuntime"]


class StepRuntime:
    """The runtime objects of a compiled step's plans, made by `start`.

    Args:
        streamer: the step's `StreamerPlan`, or None when no weight is streamed.
        stash: its `StashPlan`, or None when saved activations stay on the device.
        sink: its `SinkPlan`, or None when weight gradients stay on the device.
    """

    def __init__(self, streamer: StreamerPlan | None, stash: StashPlan | None, sink: SinkPlan | None):
        self.plans = (streamer, stash, sink)
        self.streamer: WeightStreamer | None = None
        self.stash: ActivationStash | None = None
        self.sink: GradientSink | None = None

    def start(self, blocks: Sequence[Sequence[tuple[str, torch.Tensor, str]]], gradients=None,
              host_pool: HostPoolPlan | None = None) -> None:
        """Sizes the pinned host pool, makes the runtime objects and moves the
        streamed weights to their tier, each block's together
        (`WeightStreamer.offload_block`).

        Args:
            blocks: per block, in the blocks' order, (stored key, parameter, its
                name) of each streamed weight it reads, in the order it reads them.
            gradients: the compiled backward's `GradientReport` (which gradients
                each block stores), when the plan has a sink.
            host_pool: what the plan holds on the host tier, or None when nothing.

        Raises:
            HostPoolFullError: the host pool cannot hold the plan (over
                `host_memory`, or the memory could not be pinned); nothing moved.
        """
        if host_pool is not None:
            engine = get_engine(host_pool.offload_dir)
            engine.reserve_host(
                host_pool.peak_bytes - engine.host_bytes_of(host_pool.resting) + PAGE_BYTES * host_pool.tensors,
                largest=host_pool.largest, what="the compiled plan's host tier", host_memory=host_pool.host_memory,
            )
        streamer_plan, stash_plan, sink_plan = self.plans
        if stash_plan is not None:
            self.stash = ActivationStash(get_engine(stash_plan.offload_dir), stash_plan.tier, name=stash_plan.name)
        if streamer_plan is None:
            return
        shards = None
        if streamer_plan.sharded:
            from slcompile.runtime.collectives import shard_group

            shards = shard_group()
        weights = [weight for block in blocks for weight in block]
        if shards is not None:
            # Before the sink: an offloaded optimizer prepares shard-sized copies.
            mark_sharded([param for _, param, _ in weights], shards)
        engine = get_engine(streamer_plan.offload_dir)
        self.streamer = WeightStreamer(
            engine, streamer_plan.tier, streamer_plan.live_blocks, shards=shards, name=streamer_plan.name,
            group_issues=streamer_plan.issues_in_groups,
        )
        if sink_plan is not None:
            self.sink = GradientSink(
                engine, sink_plan.tier, {key: param for key, param, _ in weights},
                shards=shards, name=sink_plan.name,
            )
            if gradients is not None:
                # The offloaded optimizer copies the weights while they still hold their values.
                self.sink.expect(gradients)
        for block in blocks:
            self.streamer.offload_block(block)
