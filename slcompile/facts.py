"""What compiling needs to know of this machine and process, read from the runtime once.

The passes and the analyses take plain records (`MachineFacts`, `ProcessFacts` in
`slcompile.analysis.machine`) and never import the runtime; the backend, `explain`
and `tune` make those records here, before the passes run:

- `machine_facts`: which tiers are the device's own memory (the transfer engine of
  the `offload_dir`), how loads pad, the ranks weights shard over;
- `process_facts`: those, and what the process already holds of a graph's
  parameters: the keys of weights an earlier graph offloaded, and the weights an
  offloaded optimizer steps;
- `open_tiers`: the tiers a compile's options name, opened before anything compiles
  (an unusable `offload_dir` fails there) and held by the backend until the step's
  runtime, made from the plans when the step first runs, holds them.

Where it sits: above the runtime it reads, `config` and `analysis`; below what
compiles or plans (the backend, `explain`, `tune`, generation) and the offloaded
optimizer's memory model. The runtime never imports it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from slcompile.analysis.machine import MachineFacts, ProcessFacts
from slcompile.config import TIERS
from slcompile.runtime.storage.engine import get_engine
from slcompile.runtime.gradients import consumer_of
from slcompile.runtime.storage.tiers import PAGE_BYTES, Tier
from slcompile.runtime.weights import weight_home

__all__ = ["machine_facts", "open_tiers", "process_facts"]


@contextlib.contextmanager
def open_tiers(config: Any) -> Iterator[None]:
    """Holds the storage the options `config` (`SpeedLoaderConfig`) name while a
    compile runs: its transfer engine, with the nvme arena opened when a tier is
    nvme (it would be opened on first use, deep in the lowering: opened now, an
    unusable `offload_dir` fails before anything compiles). The facts the compile
    reads and the runtime its step makes then share that engine.

    Raises:
        OffloadError: the `offload_dir` cannot hold an arena.
    """
    engine = get_engine(config.offload_dir)
    if "nvme" in (config.weights, config.activations):
        engine.arena
    yield


def machine_facts(offload_dir: str | None = None, world_size: int = 1, load_overhead: int = 0) -> MachineFacts:
    """This machine's facts (`MachineFacts`), from the transfer engine of
    `offload_dir`: the tiers whose memory is the device's, and how loads pad (on a
    CPU machine loads read files straight into page-padded memory). `world_size`
    and `load_overhead` are given: the ranks the weights shard over, and a loaded
    tensor's bytes beyond its padded size (a page where the allocator's view is
    measured, inside `slcompile.runtime.storage.nvme.buffers_seen_by_profiler`)."""
    engine = get_engine(offload_dir)
    device = engine.device.type
    return MachineFacts(
        device=device,
        resident_tiers=frozenset(tier for tier in TIERS if engine.copies_nothing(Tier(tier), Tier.DEVICE)),
        load_granularity=PAGE_BYTES if device == "cpu" else 1,
        load_overhead=load_overhead,
        world_size=world_size,
    )


def process_facts(config: Any, example_inputs: Sequence[Any]) -> ProcessFacts:
    """The facts the Dynamo stage's passes read for a graph whose example inputs
    are `example_inputs`, compiled with the options `config` (`SpeedLoaderConfig`):
    the machine's (with the default process group's ranks when `shard_weights`),
    and which of those inputs an earlier graph offloaded or an offloaded optimizer
    steps."""
    world_size = 1
    if config.shard_weights:
        from slcompile.runtime.collectives import shard_group

        world_size = shard_group().world_size
    tensors = [value for value in example_inputs if isinstance(value, torch.Tensor)]
    stored = {}
    for tensor in tensors:
        home = weight_home(tensor)
        if home is not None:
            stored[id(tensor)] = home[1]
    return ProcessFacts(
        machine=machine_facts(config.offload_dir, world_size),
        stored_keys=stored,
        optimizer_held={id(tensor): consumer.gradient_tier.value for tensor in tensors
                        if (consumer := consumer_of(tensor)) is not None},
    )
