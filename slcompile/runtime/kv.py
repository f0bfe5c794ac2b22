"""The KV cache of each (block, sub-batch) of a generation, resting on one tier.

Where it sits: `slcompile.generate` runs a decoder layer-major over K sub-batches;
after a (block, sub-batch) runs, its keys and values are stored here, and the next
decode step loads them back just before that (block, sub-batch) runs again.

Guarantees:
- Every store and load goes through the transfer engine with kind ``kv``: bytes are
  counted per tier in ``runtime_stats()``; the device tier, and the host tier on a
  CPU-only machine, copy nothing and count nothing.
- ``issue(block, subbatch)`` starts the load on the engine's I/O threads; ``take``
  returns its result (or loads right away when nothing was issued). A load issued
  after a store of the same (block, sub-batch) reads what that store wrote.
- Stores run in the background; the stored tensors are kept alive until their
  store is done, at most ``stores_in_flight`` of them at once.
"""

from __future__ import annotations

import collections
import itertools
import logging

import torch

from .engine import TransferEngine, TransferHandle
from .tiers import Tier, TransferKind

__all__ = ["KVStore"]

log = logging.getLogger(__name__)

_NUMBERS = itertools.count()


class KVStore:
    """The keys and values of every (block, sub-batch), on one tier.

    Args:
        engine: the transfer engine that stores and loads them.
        tier: where they rest between decode steps.
        stores_in_flight: stores whose source tensors may still be alive at once
            (older ones are waited for before a new one is issued).
    """

    def __init__(self, engine: TransferEngine, tier: Tier | str, stores_in_flight: int = 4):
        self.engine = engine
        self.tier = Tier(tier)
        self.name = f"kv{next(_NUMBERS)}"
        self.stores_in_flight = stores_in_flight
        self._stores: collections.deque[TransferHandle] = collections.deque()
        self._pending: dict[tuple[int, int], tuple[TransferHandle, TransferHandle]] = {}
        self._keys: set[str] = set()

    def _key(self, block: int, subbatch: int, part: str) -> str:
        return f"{self.name}:blk{block}.sb{subbatch}.{part}"

    def __contains__(self, where: tuple[int, int]) -> bool:
        return self._key(*where, "k") in self._keys

    def store(self, block: int, subbatch: int, keys: torch.Tensor, values: torch.Tensor) -> None:
        """Issues the stores of one (block, sub-batch)'s cache, replacing what it held."""
        for part, tensor in (("k", keys), ("v", values)):
            key = self._key(block, subbatch, part)
            self._stores.append(self.engine.store(key, tensor, self.tier, TransferKind.KV))
            self._keys.add(key)
        while len(self._stores) > 2 * self.stores_in_flight:
            self.engine.wait(self._stores.popleft())

    def issue(self, block: int, subbatch: int) -> None:
        """Starts loading one (block, sub-batch)'s cache, unless it is pending or absent."""
        where = (block, subbatch)
        if where in self._pending or where not in self:
            return
        self._pending[where] = tuple(
            self.engine.load(self._key(block, subbatch, part), TransferKind.KV) for part in ("k", "v")
        )

    def take(self, block: int, subbatch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cache of one (block, sub-batch) on the device; None before its first store."""
        if (block, subbatch) not in self:
            return None
        self.issue(block, subbatch)
        keys, values = self._pending.pop((block, subbatch))
        return self.engine.wait(keys), self.engine.wait(values)

    def flush(self) -> None:
        """Waits for every store issued."""
        while self._stores:
            self.engine.wait(self._stores.popleft())

    def close(self) -> None:
        """Waits for the transfers in flight and frees every stored key."""
        self.flush()
        for keys, values in self._pending.values():
            self.engine.wait(keys)
            self.engine.wait(values)
        self._pending.clear()
        for key in self._keys:
            if key in self.engine:
                self.engine.free(key)
        self._keys.clear()
