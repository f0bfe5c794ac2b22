"""Saved activations that rest on a slower tier between the forward and the backward.

The `offload_activations` pass rewrites a partitioned forward/backward pair: the
forward stores each chosen saved tensor once its (block, sub-batch) has run and
hands the backward a *stash token* in its place; the backward issues the load one
(block, sub-batch) before it needs the tensor and waits for it just before its first
use. This module
registers what `slc::stash`, `slc::unstash` and `slc::unstash_wait` do (their schemas
are in `slcompile.vocabulary`; `slc::wait` is in `ops`, the ops' `_many` forms in
`runs`).

Keys in the graph are `StashKey`s, `a2|blk3.sb1.mul_4`: the `ActivationStash` (engine
and tier) and the tensor's name; `a2@host|blk3.sb1.mul_4` stores onto the tier it
names instead of the stash's (a unit whose schedule chose its tier). Every store gets
a fresh stored key (`...#17`), so two forwards of the same graph before their
backwards never overwrite each other. The stored copy lives as long as the stash
token: AOTAutograd keeps the token as a saved tensor and drops it when the backward
is done with it (or when the graph is freed without a backward). A saved activation's
stash is loaded once (`offload_activations` places one `slc::unstash` per stash, its
last use), so that load frees an nvme copy where it is issued: its slot goes back as
soon as the read is done, whatever still holds the token. A spill of a boundary
activation (`spill_boundaries`, a key whose name is marked `spill`) may be filled in
the forward and loaded again in the backward when a stash shares it: its token's
finalizer frees it, as it frees the copies on other tiers and those of a stash never
loaded (a forward without a backward). A second backward
through one graph (`retain_graph=True`) is not supported: AOTAutograd donates the
backward's saved buffers, and torch refuses the second backward of such a graph.
"""

from __future__ import annotations

import functools
import itertools
import threading
import weakref
from collections.abc import Sequence

import torch

from slcompile.plans import new_name
from slcompile.runtime import ops
from slcompile.runtime.storage.engine import TransferEngine, TransferHandle
from slcompile.runtime.errors import OffloadError
from slcompile.runtime.stats import RECORDER
from slcompile.runtime.storage.tiers import Tier, TransferKind
from slcompile.vocabulary import SPILL_MARK, StashKey

__all__ = ["ActivationStash"]

# Stash name -> stash, for the graphs' `slc::` ops, without keeping it alive (the
# compiled graphs that call them hold their stash).
_STASHES: weakref.WeakValueDictionary[str, ActivationStash] = weakref.WeakValueDictionary()
_LOCK = threading.Lock()
_STORES = itertools.count()


class ActivationStash:
    """Where one compiled graph's offloaded activations rest.

    Args:
        engine: the transfer engine that stores and loads them.
        tier: the tier they rest on.
        name: its name in stash keys (its `StashPlan`'s); a new one when None.
    """

    def __init__(self, engine: TransferEngine, tier: Tier | str, name: str | None = None):
        self.engine = engine
        self.tier = Tier(tier)
        self.name = name or new_name("a")
        with _LOCK:
            _STASHES[self.name] = self

    def graph_key(self, name: str, tier: str | None = None) -> str:
        return StashKey(self.name, name, tier).format()


@functools.lru_cache(maxsize=1 << 14)
def _parsed_key(key: str) -> StashKey:
    """A graph's keys are few and fixed: each is parsed once, not at every call."""
    return StashKey.parse(key)


def _stash_of(key: str) -> ActivationStash:
    name = _parsed_key(key).stash
    stash = _STASHES.get(name)
    if stash is None:
        raise OffloadError(f"no activation stash {name!r} for key {key!r}", key=key)
    return stash


@functools.lru_cache(maxsize=1 << 14)
def _named_tier(key: str) -> Tier | None:
    tier = _parsed_key(key).tier
    return Tier(tier) if tier is not None else None


def _tier_of(key: str, owner: ActivationStash) -> Tier:
    """The tier a key's tensor goes to: the one it names, else its stash's."""
    return _named_tier(key) or owner.tier


def _free_stored(engine: TransferEngine, stored_key: str) -> None:
    if stored_key in engine:
        engine.free(stored_key)


def stash(x: torch.Tensor, key: str) -> torch.Tensor:
    """Issues the store of a saved activation; returns the stash token."""
    owner = _stash_of(key)
    engine = owner.engine
    tier = _tier_of(key, owner)
    if engine.copies_nothing(engine.tier_of(x), tier):
        x = x.detach().clone(memory_format=torch.contiguous_format)
        RECORDER.local_copy(x.numel() * x.element_size())
    stored_key = f"{_parsed_key(key).name}#{next(_STORES)}"
    # The handle must not keep the source as its result for as long as the token
    # lives (until the backward): that memory is what offloading frees.
    handle = engine.store(stored_key, x, tier, TransferKind.ACTIVATION, forget_source=True)
    return ops._token_for(engine, handle, (_free_stored, engine, stored_key))


@functools.lru_cache(maxsize=1 << 12)
def _run_of(keys: tuple[str, ...]) -> tuple[str, Tier | None, tuple[str, ...]] | None:
    """(the stash's name, the tier the keys name or None, the tensors' names) of a run
    of keys that share both; None for a run that mixes them. A graph's runs are few
    and fixed (the stash itself is looked up at each call: the cache must not keep
    it alive)."""
    parsed = [_parsed_key(key) for key in keys]
    if len({(key.stash, key.tier) for key in parsed}) != 1:
        return None
    return parsed[0].stash, _named_tier(keys[0]), tuple(key.name for key in parsed)


def stash_many(xs: Sequence[torch.Tensor], keys: Sequence[str]) -> list[torch.Tensor]:
    """`stash` of each (x, key); their stash tokens. A run onto the nvme tier of one
    stash is stored together (`TransferEngine.store_many`)."""
    run = _run_of(tuple(keys))
    if run is None:
        return [stash(x, key) for x, key in zip(xs, keys)]
    _, named_tier, names = run
    owner = _stash_of(keys[0])
    tier = named_tier or owner.tier
    if tier is not Tier.NVME:
        return [stash(x, key) for x, key in zip(xs, keys)]
    engine = owner.engine
    stored_keys = [f"{name}#{next(_STORES)}" for name in names]
    handles = engine.store_many(stored_keys, xs, tier, TransferKind.ACTIVATION, forget_source=True)
    return ops._tokens_for(engine, handles, [(_free_stored, engine, stored_key) for stored_key in stored_keys])


def _stashed(stash_token: torch.Tensor) -> tuple[TransferEngine, TransferHandle]:
    """The engine and store a stash token names."""
    engine, handle = ops._lookup(stash_token)
    if handle.direction != "store":
        raise OffloadError(f"token {handle.id} is a {handle.direction}, not a stash", key=handle.key)
    return engine, handle


def _load_once(engine: TransferEngine, loads: Sequence[TransferHandle]) -> None:
    """Frees the nvme copies of saved activations whose loads were just issued (each
    such stash's last use): a slot goes back once its read is done, on the I/O thread
    that read it. A spill may be loaded again (see the module's docstring); a host
    block waits for its copy's event before it goes back (on a GPU that would stall
    the issuing thread here): those go with their tokens."""
    for load in loads:
        if load.source is Tier.NVME and load.key.split(".")[2:3] != [SPILL_MARK]:
            engine.free(load.key)


def _stored_key(engine: TransferEngine, handle: TransferHandle) -> str:
    if handle.key not in engine:
        raise OffloadError("this stash was loaded already: a saved activation's stash is loaded once "
                           "(slc::unstash is its last use)", key=handle.key)
    return handle.key


def unstash(stash_token: torch.Tensor) -> torch.Tensor:
    """Issues the load of a stashed activation; returns the load's token. The stash's
    copy goes once the load is done (`_load_once`).

    Raises:
        OffloadError: the stash was loaded already.
    """
    engine, handle = _stashed(stash_token)
    load = engine.load(_stored_key(engine, handle), TransferKind.ACTIVATION)
    _load_once(engine, (load,))
    return ops._token_for(engine, load)


def unstash_many(stash_tokens: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """`unstash` of each stash token; their load tokens. The loads of one engine are
    issued together (`TransferEngine.load_many`)."""
    found = [_stashed(token) for token in stash_tokens]
    engine = found[0][0] if found else None
    if any(found_engine is not engine for found_engine, _ in found):
        return [unstash(token) for token in stash_tokens]
    handles = engine.load_many([_stored_key(engine, handle) for _, handle in found], TransferKind.ACTIVATION)
    _load_once(engine, handles)
    return ops._tokens_for(engine, handles)


def unstash_wait(
    load_token: torch.Tensor, size: Sequence[int], dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """Blocks until the load is done; returns the activation as the graph's own tensor."""
    engine, handle = ops._lookup(load_token)
    result = engine.wait(handle)
    if tuple(result.shape) != tuple(size) or result.dtype != dtype:
        raise OffloadError(
            f"unstashed {result.dtype} {tuple(result.shape)}, but the graph expects {dtype} {tuple(size)}",
            key=handle.key,
        )
    if handle.zero_copy:
        result = result.clone()
        RECORDER.local_copy(result.numel() * result.element_size())
    return result


ops.implement("stash", stash)
ops.implement("unstash", unstash)
ops.implement("unstash_wait", unstash_wait)
