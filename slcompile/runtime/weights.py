"""Block weights that rest on a slower tier and are fetched for each pass.

The `stream_weights` pass puts `slc::fetch_weight(param, key)` in front of each block
of the rewritten graph; this module keeps the weights and answers those fetches.

- `WeightStreamer.offload(key, param)` stores a parameter's values on the tier and
  releases the parameter's storage (its shape, dtype and identity stay, so Dynamo's
  guards and autograd see the same parameter; its memory is gone).
- `slc::fetch_weight` returns the values as a new tensor. It is a pure function of its
  key (the compiler re-runs it: the backward fetches again instead of keeping the
  forward's copy alive) and its gradient flows to the parameter unchanged.
- The lowering tells the streamer the order in which the compiled forward and
  backward fetch (`set_plan`); the plan repeats every step. Entering a block's fetches
  issues the loads of the next `live_blocks - 1` blocks of the plan, across the turn
  from forward to backward and on into the next step, so each fetch is served by
  exactly one load and the I/O overlaps compute on the engine's threads.
- `gathered_weights(model)` brings the values back into the parameters for code that
  reads them directly (an optimizer step, `state_dict()`), then offloads them again;
  it first drops prefetched copies, so no stale value is ever read.

Graph keys look like `w3|w0:layers_0_fc_weight@bwd`: the streamer of the compiled
graph, the stored tensor's key, and the phase. A graph that fetches the same weight
once per sub-batch (the grad_accumulation schedule) tells the fetches apart with a
suffix on the stored key, `w3|w0:layers_0_fc_weight#sb1@bwd`; the runtime ignores it.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
from collections.abc import Iterator, Sequence

import torch
from torch.utils.weak import WeakIdKeyDictionary

from slcompile.runtime.engine import TransferEngine, TransferHandle
from slcompile.runtime.tiers import Tier, TransferKind

__all__ = ["WeightStreamer", "gathered_weights", "offloaded_parameters", "split_graph_key", "copy_suffix"]

log = logging.getLogger(__name__)

_STREAMERS: dict[str, WeightStreamer] = {}
# Parameter -> (engine, stored key, tier), by identity, without keeping it alive.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Stored key -> the engine that holds it.
_ENGINE_OF: dict[str, TransferEngine] = {}
_REGISTRY_LOCK = threading.Lock()
_NUMBERS = itertools.count()


def split_graph_key(graph_key: str) -> tuple[str, str, str]:
    """`w3|w0:name#sb1@bwd` -> ("w3", "w0:name", "bwd"); the phase defaults to "fwd"."""
    streamer, _, rest = graph_key.partition("|")
    stored, _, phase = rest.partition("@")
    return streamer, stored.partition("#")[0], phase or "fwd"


def copy_suffix(subbatch: int) -> str:
    """What tells one sub-batch's fetch of a weight from the others' in a graph key."""
    return f"#sb{subbatch}"


class WeightStreamer:
    """The streamed weights of one compiled graph, on one tier.

    Args:
        engine: the transfer engine that stores and loads them.
        tier: where the weights rest between uses.
        live_blocks: how many blocks' weights may be on the device at once: the one
            computing and `live_blocks - 1` prefetched.
    """

    def __init__(self, engine: TransferEngine, tier: Tier | str, live_blocks: int):
        self.engine = engine
        self.tier = Tier(tier)
        self.live_blocks = live_blocks
        self.name = f"w{next(_NUMBERS)}"
        self.plans: dict[str, tuple[tuple[int, str], ...]] = {}
        self.sequence: list[tuple[str, int, str]] = []  # (phase, block, stored key)
        self.visit_of: list[int] = []
        self.visit_start: list[int] = []
        self.cursor = 0
        self.current_visit: int | None = None
        self.pending: dict[int, TransferHandle] = {}  # sequence position -> load
        self.lock = threading.Lock()
        with _REGISTRY_LOCK:
            _STREAMERS[self.name] = self

    # -- set-up, at compile time ------------------------------------------
    def stored_key_for(self, name: str, param: torch.Tensor) -> str:
        """The stored key of `param`: its existing one if it is already offloaded."""
        with _REGISTRY_LOCK:
            owner = _OWNERS.get(param)
        return owner[1] if owner is not None else f"{self.name}:{name}"

    def graph_key(self, stored_key: str) -> str:
        return f"{self.name}|{stored_key}"

    def offload(self, stored_key: str, param: torch.Tensor) -> None:
        """Stores `param`'s values and releases its storage; a parameter already
        offloaded (a graph compiled again) is left as it is."""
        with _REGISTRY_LOCK:
            if param in _OWNERS:
                return
        self.engine.wait(self.engine.store(stored_key, param.detach(), self.tier, TransferKind.WEIGHT))
        param.untyped_storage().resize_(0)
        with _REGISTRY_LOCK:
            _OWNERS[param] = (self.engine, stored_key, self.tier)
            _ENGINE_OF[stored_key] = self.engine

    def set_plan(self, phase: str, fetches: Sequence[tuple[int, str]]) -> None:
        """The (block, stored key) fetches of one compiled graph, in order.

        The plan is the forward's fetches followed by the backward's, repeating.
        """
        with self.lock:
            self.plans[phase] = tuple(fetches)
            self.sequence = [
                (name, block, key) for name in ("fwd", "bwd") for block, key in self.plans.get(name, ())
            ]
            self.visit_of, self.visit_start = [], []
            for position, (name, block, _) in enumerate(self.sequence):
                previous = self.sequence[position - 1] if position else None
                if previous is None or previous[:2] != (name, block):
                    self.visit_start.append(position)
                self.visit_of.append(len(self.visit_start) - 1)
            self._drop_pending()
            self.cursor, self.current_visit = 0, None

    # -- fetches, at run time ---------------------------------------------
    def fetch(self, stored_key: str, phase: str) -> torch.Tensor:
        engine = _engine_of(stored_key, self.engine)
        with self.lock:
            position = self._find(phase, stored_key)
            handle = None
            if position is not None:
                handle = self.pending.pop(position, None)
                visit = self.visit_of[position]
                if visit != self.current_visit:
                    self.current_visit = visit
                    self._prefetch(visit)
                self.cursor = (position + 1) % len(self.sequence)
        if handle is None:
            handle = engine.load(stored_key, TransferKind.WEIGHT)
        return engine.wait(handle)

    def _find(self, phase: str, stored_key: str) -> int | None:
        """The plan position of this fetch: the next matching one from the cursor."""
        n = len(self.sequence)
        for offset in range(n):
            position = (self.cursor + offset) % n
            name, _, key = self.sequence[position]
            if name == phase and key == stored_key:
                return position
        return None

    def _prefetch(self, visit: int) -> None:
        visits = len(self.visit_start)
        for step in range(1, min(self.live_blocks, visits)):
            target = (visit + step) % visits
            start = self.visit_start[target]
            end = self.visit_start[target + 1] if target + 1 < visits else len(self.sequence)
            for position in range(start, end):
                if position not in self.pending:
                    key = self.sequence[position][2]
                    self.pending[position] = _engine_of(key, self.engine).load(key, TransferKind.WEIGHT)

    def _drop_pending(self) -> None:
        pending, self.pending = self.pending, {}
        for handle in pending.values():
            self.engine.wait(handle)

    def drain(self) -> None:
        """Waits for and drops prefetched loads: before the weights change (an
        optimizer step), so no stale copy is ever read."""
        with self.lock:
            self._drop_pending()


def _engine_of(stored_key: str, default: TransferEngine) -> TransferEngine:
    with _REGISTRY_LOCK:
        return _ENGINE_OF.get(stored_key, default)


def offloaded_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of `model` whose values rest on a slower tier."""
    with _REGISTRY_LOCK:
        return [(name, p) for name, p in model.named_parameters() if p in _OWNERS]


@contextlib.contextmanager
def gathered_weights(model: torch.nn.Module) -> Iterator[None]:
    """Brings offloaded weights back into `model`'s parameters for the block.

    Use it around code that reads or writes parameter values directly, such as an
    optimizer step or `state_dict()`. On exit the (possibly updated) values are stored
    again and the storage released. The loads and stores count as weight traffic.
    """
    with _REGISTRY_LOCK:
        streamers = list(_STREAMERS.values())
    for streamer in streamers:
        streamer.drain()
    params = offloaded_parameters(model)
    for _, param in params:
        engine, key, _ = _OWNERS[param]
        values = engine.wait(engine.load(key, TransferKind.WEIGHT))
        param.untyped_storage().resize_(values.numel() * values.element_size())
        with torch.no_grad():
            param.copy_(values.view_as(param))
    try:
        yield
    finally:
        for _, param in params:
            engine, key, tier = _OWNERS[param]
            engine.wait(engine.store(key, param.detach(), tier, TransferKind.WEIGHT))
            param.untyped_storage().resize_(0)


@torch.library.custom_op("slc::fetch_weight", mutates_args=())
def fetch_weight(param: torch.Tensor, key: str) -> torch.Tensor:
    """The values of an offloaded parameter, as a new tensor on the device."""
    streamer_name, stored_key, phase = split_graph_key(key)
    with _REGISTRY_LOCK:
        streamer = _STREAMERS.get(streamer_name)
    if streamer is None:
        raise KeyError(f"no weight streamer {streamer_name!r} for key {key!r}")
    return streamer.fetch(stored_key, phase)


@fetch_weight.register_fake
def _(param: torch.Tensor, key: str) -> torch.Tensor:
    return torch.empty_like(param)


def _fetch_backward(ctx, grad: torch.Tensor):
    return grad, None


fetch_weight.register_autograd(_fetch_backward)
