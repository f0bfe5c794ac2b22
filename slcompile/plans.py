"""What a compiled step's runtime will hold, as plain data.

A compiled graph reaches its weight streamer, activation stash and gradient sink
through the keys its `slc::` ops carry (`slcompile.vocabulary`): `w3|w0:fc_weight`,
`a2|blk1.sb0.relu`, `g1|w0:fc_weight`. The passes write those keys from the plans
here, which name the holder and say where it rests; nothing in them moves data,
holds a lock or registers itself. `slcompile.runtime.step.StepRuntime` makes the
runtime objects from them when the compiled step is about to run, so `explain`,
`tune` and every plan a budget search discards make none.

Names are unique in the process (`new_name`), since the runtime finds a holder by
the name in a key; a runtime object made without a plan (generation's) draws its
name from the same counter.
"""

from __future__ import annotations

import dataclasses
import itertools
import threading
from collections.abc import Mapping
from typing import Any

from slcompile.errors import OptionError
from slcompile.vocabulary import GradientKey, StashKey, WeightKey

__all__ = ["HostPoolPlan", "StreamerPlan", "StashPlan", "SinkPlan", "new_name", "sink_plan"]

_NUMBERS = itertools.count()
_LOCK = threading.Lock()


def new_name(prefix: str) -> str:
    """A holder name no other holder of the process has: `prefix` and a number."""
    with _LOCK:
        return f"{prefix}{next(_NUMBERS)}"


@dataclasses.dataclass(frozen=True)
class StreamerPlan:
    """The weight streamer of a compiled step.

    Attributes:
        name: the streamer's name in fetch keys (`w3`).
        tier: where the streamed weights rest ("host" or "nvme").
        live_blocks: how many blocks' weights may be on the device at once.
        offload_dir: the transfer engine's directory (None: the default).
        world_size: the ranks the weights are sharded over (`shard_weights`); 1 with
            whole weights, and also for sharding over one rank.
        sharded: whether the weights are sharded (`shard_weights`), over any ranks.
        issues_in_groups: every run of `slc::fetch_issue` calls in the graphs is
            followed by a `slc::fetch_weight` before any other op reads a weight
            (`place_prefetches` puts each visit's issues just before its own
            fetches): the streamer may then hold the issues of a run and start
            their loads together at that fetch (`TransferEngine.load_many`). False
            where an issue must start at once (a generation pass issues the next
            layer's weights, then computes).
    """

    name: str
    tier: str
    live_blocks: int
    offload_dir: str | None = None
    world_size: int = 1
    sharded: bool = False
    issues_in_groups: bool = False

    def graph_key(self, stored_key: str) -> WeightKey:
        """The key of a fetch of `stored_key` in this streamer's graphs."""
        return WeightKey(self.name, stored_key)


@dataclasses.dataclass(frozen=True)
class StashPlan:
    """The activation stash of a compiled step.

    Attributes:
        name: the stash's name in stash keys (`a2`).
        tier: where the stashed activations rest ("host" or "nvme"), unless a
            key names another (a unit whose schedule step names its tier).
        offload_dir: the transfer engine's directory (None: the default).
    """

    name: str
    tier: str
    offload_dir: str | None = None

    def graph_key(self, name: str, tier: str | None = None) -> str:
        """The key of the stash of the saved tensor `name` (its tag and node name),
        onto `tier` (None: the stash's `tier`)."""
        return StashKey(self.name, name, tier).format()


@dataclasses.dataclass(frozen=True)
class SinkPlan:
    """The gradient sink of a compiled step: where the streamed weights' gradients go.

    Attributes:
        name: the sink's name in gradient keys (`g1`).
        tier: the tier they are stored to ("host" or "nvme").
        leaving: the stored keys of the weights whose gradients leave the device:
            every streamed weight's when the user named the tier, those an
            offloaded optimizer holds for "auto".
        offload_dir: the transfer engine's directory (None: the default).
        sharded: whether each rank stores its shard of a reduce-scattered gradient.
    """

    name: str
    tier: str
    leaving: frozenset[str]
    offload_dir: str | None = None
    sharded: bool = False

    def graph_key(self, stored_key: str) -> str:
        """The key of the store of the gradient of the weight `stored_key`."""
        return GradientKey(self.name, stored_key).format()

    def wants(self, stored_key: str) -> bool:
        """Whether the gradient of the weight `stored_key` leaves the device."""
        return stored_key in self.leaving


def sink_plan(gradients: str, streamer: StreamerPlan | None, streamed: Any, inputs, held: Mapping[int, str],
              offload_dir: str | None = None) -> SinkPlan | None:
    """The gradient sink of a graph being compiled, or None when its gradients stay
    on the device.

    Args:
        gradients: the `gradients` option ("auto", "device", "host", "nvme").
        streamer: the graph's `StreamerPlan`, or None when no weight is streamed.
        streamed: the `StreamedWeights` of `stream_weights`.
        inputs: the classified placeholders (parameters carry their real values).
        held: `id` of each parameter an offloaded optimizer steps -> the tier it
            takes gradients on (`ProcessFacts.optimizer_held`).
        offload_dir: the transfer engine's directory.

    Raises:
        OptionError: `shard_weights` with no offloaded optimizer to take the shards.
    """
    if streamer is None or streamed is None or gradients == "device":
        return None
    values = {i.name: i.value for i in inputs}
    params = {key: values[name] for block in streamed.blocks for name, key in block}
    holders = {key: held.get(id(param)) for key, param in params.items()}
    tiers = [tier for tier in holders.values() if tier is not None]
    if streamer.sharded and gradients == "auto" and not tiers:
        raise OptionError(
            "speedloader option 'shard_weights' sends each rank's shard of the weight gradients to an "
            "offloaded optimizer, but none holds the model's parameters: create "
            "slcompile.offload_optimizer(model, ...) before the compiled model's first call"
        )
    explicit = gradients != "auto" or streamer.sharded
    if not explicit and not tiers:
        return None
    # A frozen weight streams for its values alone: no gradient of it is stored or expected.
    leaving = frozenset(key for key, tier in holders.items()
                        if params[key].requires_grad and (explicit or tier is not None))
    if not leaving and not streamer.sharded:
        return None
    return SinkPlan(new_name("g"), gradients if gradients != "auto" else tiers[0],
                    leaving=leaving, offload_dir=offload_dir, sharded=streamer.sharded)


@dataclasses.dataclass(frozen=True)
class HostPoolPlan:
    """The pinned host memory a compiled step holds, reserved when its runtime starts
    (`StepRuntime.start`, before the streamed weights move there).

    Attributes:
        peak_bytes: the plan's predicted host peak (streamed weights, activations in
            flight).
        resting: the stored keys of the streamed weights: what of them already rests
            on the host (an earlier graph's) is not reserved again.
        tensors: how many tensors the host tier holds (streamed weights, activations
            stashed there): each takes whole pages, so up to a page more each.
        largest: the largest single streamed weight.
        host_memory: the `host_memory` option (None: the engine's own cap).
        offload_dir: the transfer engine's directory (None: the default).
    """

    peak_bytes: int
    resting: tuple[str, ...]
    tensors: int
    largest: int
    host_memory: int | None = None
    offload_dir: str | None = None
