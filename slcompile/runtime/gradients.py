"""Weight gradients that leave the device for an optimizer that steps off it.

The `offload_gradients` pass puts `slc::offload_grad(grad, key)` after the final
gradient of each streamed weight in the backward (schema in `slcompile.vocabulary`);
this module implements it. A `GradientSink` belongs to one compiled graph: its
engine, the tier gradients go to, and the streamed weights by stored key. When the
op runs, the gradient is stored (transfer kind `gradient`, counted like every other
transfer) and handed to the *consumer* of its parameter, the offloaded optimizer
(`slcompile.optim.OffloadedOptimizer`) that `attach_consumer` registered, which
steps a block as soon as all of the block's gradients have arrived.

Which gradients leave is decided when the graph compiles (`SpeedLoaderConfig.gradients`):
"auto" sends those of the streamed weights an offloaded optimizer holds at that time;
"host"/"nvme" send every streamed weight's gradient there, and a backward whose
parameters no offloaded optimizer holds raises `OffloadError`.

Sharded weights (`shard_weights`, `slcompile.runtime.collectives`): the op
reduce-scatters the gradient on the communication thread (averaged over the ranks)
and stores this rank's shard, which is what the consumer takes; every streamed
weight's gradient then leaves, and a graph with no offloaded optimizer holding them
does not compile. A gradient stored in shares (per sub-batch) is reduce-scattered
per share.

On a CPU-only machine the host tier is the device's memory: gradients sent to
"host" move no bytes (the store is zero-copy; the op copies the gradient so the
compiled graph may reuse its buffer, counted in `local_copy_bytes`). The nvme tier
moves the gradient's bytes both ways.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Iterable, Mapping
from typing import Any, Protocol

import torch
from torch.utils.weak import WeakIdKeyDictionary

from slcompile.plans import new_name
from slcompile.runtime import ops
from slcompile.runtime.storage.engine import TransferEngine, TransferHandle
from slcompile.runtime.errors import OffloadError
from slcompile.runtime.stats import RECORDER
from slcompile.runtime.storage.tiers import Tier, TransferKind
from slcompile.vocabulary import GradientKey

__all__ = [
    "GradientSink",
    "GradientConsumer",
    "attach_consumer",
    "consumer_of",
    "gradient_key_of",
]

log = logging.getLogger(__name__)

# Sink name -> sink, for the graphs' `slc::` ops, without keeping it alive (the
# compiled graphs that call them hold their sink).
_SINKS: weakref.WeakValueDictionary[str, GradientSink] = weakref.WeakValueDictionary()
_CONSUMERS: WeakIdKeyDictionary = WeakIdKeyDictionary()  # parameter -> consumer
_LOCK = threading.Lock()


class GradientConsumer(Protocol):
    """What takes the gradients a sink stores: an offloaded optimizer."""

    gradient_tier: Tier  # where "auto" sends the gradients of its parameters

    def prepare(self, params: Iterable[torch.nn.Parameter]) -> None:
        """Called when a graph that will send these parameters' gradients compiles,
        while the parameters still hold their values."""

    def gradient_arrived(self, sink: GradientSink, stored_key: str, param: torch.nn.Parameter,
                         handle: TransferHandle) -> None:
        """The store of `param`'s gradient was issued under `sink.gradient_key(stored_key)`."""


def attach_consumer(params: Iterable[torch.nn.Parameter], consumer: GradientConsumer | None) -> None:
    """Makes `consumer` take the gradients of `params` (None: detach)."""
    with _LOCK:
        for param in params:
            if consumer is None:
                _CONSUMERS.pop(param, None)
            else:
                _CONSUMERS[param] = consumer


def consumer_of(param: torch.Tensor) -> GradientConsumer | None:
    with _LOCK:
        return _CONSUMERS.get(param)


def gradient_key_of(stored_key: str) -> str:
    """The key a weight's gradient is stored under on its tier."""
    return f"grad:{stored_key}"


class GradientSink:
    """Where one compiled graph's weight gradients go.

    Args:
        engine: the transfer engine that stores them.
        tier: the tier they go to ("host" or "nvme").
        params: stored weight key -> the parameter, for every streamed weight.
        shards: the `ShardGroup` the weights are sharded over: the gradients are
            reduce-scattered and this rank's shard is stored (None: whole gradients).
        name: its name in gradient keys (its `SinkPlan`'s); a new one when None.
    """

    def __init__(self, engine: TransferEngine, tier: Tier | str, params: Mapping[str, torch.nn.Parameter],
                 *, shards=None, name: str | None = None):
        self.shards = shards
        self.engine = engine
        self.tier = Tier(tier)
        self.params = dict(params)
        self.name = name or new_name("g")
        self.report: Any = None  # the GradientReport of the compiled backward
        self.expected: dict[int | None, frozenset[str]] = {}
        self.block_of: dict[str, int | None] = {}
        self.deferred_issues: dict[str, tuple[str, ...]] = {}
        self.shares: dict[str, int] = {}  # stored key -> stores per backward
        self._stored: dict[str, list[tuple[str, TransferHandle]]] = {}  # this backward's shares so far
        with _LOCK:
            _SINKS[self.name] = self

    def expect(self, report) -> None:
        """Takes the `GradientReport` of the compiled backward: which gradients each
        block stores, and the prefetches to issue after each weight's update. Lets
        the consumers copy the weights while they still hold their values."""
        self.report = report
        self.expected = {block: frozenset(keys) for block, keys in report.blocks().items()}
        self.block_of = {stored: block for block, stored, _ in report.stores}
        self.deferred_issues = dict(report.deferred_issues)
        self.shares = report.shares()
        by_consumer: dict[int, tuple[GradientConsumer, list]] = {}
        for stored in self.block_of:
            param = self.params[stored]
            consumer = consumer_of(param)
            if consumer is not None:
                by_consumer.setdefault(id(consumer), (consumer, []))[1].append(param)
        # Called while the graph compiles, under the compiler's fake-tensor mode.
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            for consumer, params in by_consumer.values():
                consumer.prepare(params)

    def block_keys(self, stored_key: str) -> frozenset[str]:
        """The stored keys whose gradients the same block's backward stores."""
        return self.expected[self.block_of[stored_key]]

    def store(self, stored_key: str, grad: torch.Tensor) -> torch.Tensor:
        """Issues the store of a weight's gradient; returns the transfer's token."""
        param = self.params[stored_key]
        consumer = consumer_of(param)
        if consumer is None:
            raise OffloadError(
                f"the backward sends this weight's gradient to the {self.tier.value} tier for "
                "slcompile.offload_optimizer, but no offloaded optimizer holds the parameter "
                "(create one with slcompile.offload_optimizer(model, ...) before the backward, "
                "or compile with gradients='device')",
                key=stored_key,
            )
        engine = self.engine
        if self.shards is not None:
            return self._reduce_and_store(stored_key, param, consumer, grad)
        if engine.copies_nothing(engine.tier_of(grad), self.tier):
            # The engine would keep the graph's own buffer, which the graph may reuse.
            grad = grad.detach().clone(memory_format=torch.contiguous_format)
            RECORDER.local_copy(grad.numel() * grad.element_size())
        # A gradient stored in shares (one per sub-batch) reaches the consumer with its last one.
        stored = self._stored.setdefault(stored_key, [])
        key = gradient_key_of(stored_key) if self.shares.get(stored_key, 1) == 1 else \
            f"{gradient_key_of(stored_key)}#{len(stored)}"
        handle = engine.store(key, grad, self.tier, TransferKind.GRADIENT, forget_source=True)
        stored.append((key, handle))
        token = ops._token_for(engine, handle)
        # The gradient's memory is released when the graph drops the token, after its
        # wait for the store: on the graph's thread, not on the optimizer's worker or
        # an I/O thread (the consumer reads the stored copy).
        weakref.finalize(token, _release, grad)
        if len(stored) >= self.shares.get(stored_key, 1):
            consumer.gradient_arrived(self, stored_key, param, handle)
        return token

    def _reduce_and_store(self, stored_key: str, param, consumer, grad: torch.Tensor) -> torch.Tensor:
        """Sharded: issues the reduce-scatter of `grad`, whose shard is then stored;
        the token is the reduce-scatter's (the graph keeps `grad` until it is done)."""
        engine, tier = self.engine, self.tier
        stored = self._stored.setdefault(stored_key, [])
        key = gradient_key_of(stored_key) if self.shares.get(stored_key, 1) == 1 else \
            f"{gradient_key_of(stored_key)}#{len(stored)}"
        handle = self.shards.reduce_scatter(
            key, grad, then=lambda shard: engine.store(key, shard, tier, TransferKind.GRADIENT, forget_source=True)
        )
        stored.append((key, handle))
        token = ops._token_for(engine, handle)
        if len(stored) >= self.shares.get(stored_key, 1):
            consumer.gradient_arrived(self, stored_key, param, handle)
        return token

    def take(self, stored_key: str) -> torch.Tensor:
        """The gradient of a weight whose stores have all arrived, loaded from the
        tier (its shares added in the order they were stored); frees it there.
        Sharded: this rank's shard of it, flat."""
        stored = self._stored.pop(stored_key)
        total = None
        for key, handle in stored:
            result = self.engine.wait(handle)
            if self.shards is not None:
                self.engine.wait(result)  # the reduce-scatter's result is the store of its shard
            if self.tier is Tier.HOST and not self.engine.copies_nothing(Tier.HOST, Tier.DEVICE):
                share = self.engine.read_host(key)  # the consumer is on the host: no trip to the device and back
            else:
                share = self.engine.wait(self.engine.load(key, TransferKind.GRADIENT))
            self.engine.free(key)
            total = share if total is None else total + share
        return total


def _release(grad: torch.Tensor) -> None:
    """Called with the last reference to a stored gradient, which then dies."""


def _sink_of(key: GradientKey) -> GradientSink:
    with _LOCK:
        sink = _SINKS.get(key.sink)
    if sink is None:
        raise OffloadError(f"no gradient sink {key.sink!r}", key=key.format())
    return sink


def offload_grad(grad: torch.Tensor, key: str) -> torch.Tensor:
    """Issues the store of a final weight gradient to the optimizer's tier."""
    parsed = GradientKey.parse(key)
    return _sink_of(parsed).store(parsed.stored, grad)


ops.implement("offload_grad", offload_grad)
