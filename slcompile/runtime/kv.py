"""The KV cache of each (block, sub-batch) of a generation, resting on one tier.

Where it sits: `slcompile.generate` runs a decoder layer-major over K sub-batches;
after a (block, sub-batch) runs, its keys and values are stored here, and the next
decode step loads them back just before that (block, sub-batch) runs again.

Guarantees:
- Every store and load goes through the transfer engine with kind ``kv``: bytes are
  counted per tier in ``runtime_stats()``; the device tier, and the host tier on a
  CPU-only machine, copy nothing and count nothing.
- On a tier that copies, the cache is a list of segments along the position
  dimension: a store writes only the positions that are new (the prefill's, then
  one per decode step), and a load reads the segments that hold the positions the
  cache still keeps. A full-attention cache therefore reads exactly what it uses; a
  sliding-window cache also reads the older part of the one segment the window
  starts in, and forgets segments once the window has left them. Each segment is
  its own stored tensor (one read per segment, each padded to a page in the nvme
  arena). On a tier that copies nothing the whole cache is kept by reference, as
  the layer returned it.
- ``issue(block, subbatch)`` starts the loads on the engine's I/O threads; ``take``
  returns their result (or loads right away when nothing was issued). A load issued
  after a store of the same (block, sub-batch) reads what that store wrote.
- Stores run in the background; the stored tensors are kept alive until their
  store is done, at most ``stores_in_flight`` (block, sub-batch)s' at once. A store
  of a cache's new positions copies them out first, so what stays alive is those
  positions, not the whole cache they were computed in.
"""

from __future__ import annotations

import collections
import itertools
import logging
from collections.abc import Sequence

import torch

from .engine import TransferEngine, TransferHandle
from .tiers import Tier, TransferKind

__all__ = ["KVStore", "forgettable_segments"]

log = logging.getLogger(__name__)

_NUMBERS = itertools.count()


def forgettable_segments(positions: Sequence[int], length: int) -> int:
    """How many leading segments of a cache hold none of its last `length` positions.

    Args:
        positions: the positions each segment holds, oldest first.
        length: the positions the cache keeps (the last ones).

    Returns:
        The number of segments, from the front, that can be forgotten.
    """
    dropped, later = 0, sum(positions)
    for size in positions[:-1]:
        if later - size < length:
            break
        later -= size
        dropped += 1
    return dropped


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
        # A tier that copies nothing keeps the layer's whole cache by reference;
        # appending would copy it into one tensor again at every load.
        self.appends = not engine.copies_nothing(self.tier, Tier.DEVICE)
        self._stores: collections.deque[TransferHandle] = collections.deque()
        self._pending: dict[tuple[int, int], list[tuple[TransferHandle, TransferHandle]]] = {}
        # (block, sub-batch) -> [(segment number, positions)], oldest first.
        self._segments: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._length: dict[tuple[int, int], int] = {}
        self._numbers = itertools.count()

    def _key(self, block: int, subbatch: int, segment: int, part: str) -> str:
        return f"{self.name}:blk{block}.sb{subbatch}.seg{segment}.{part}"

    def __contains__(self, where: tuple[int, int]) -> bool:
        return where in self._segments

    def segments(self, block: int, subbatch: int) -> tuple[int, ...]:
        """The positions each stored segment of one (block, sub-batch) holds, oldest first."""
        return tuple(size for _, size in self._segments.get((block, subbatch), ()))

    def store(self, block: int, subbatch: int, keys: torch.Tensor, values: torch.Tensor, new: int) -> None:
        """Issues the stores of one (block, sub-batch)'s cache after a pass.

        Args:
            block, subbatch: whose cache it is.
            keys, values: the whole cache, `(..., positions, head_dim)`: its last
                `new` positions are new, the others are the last ones stored before.
            new: how many positions the pass added (more than the cache keeps when
                a sliding window dropped some).
        """
        where = (block, subbatch)
        length = keys.shape[-2]
        if not self.appends or where not in self._segments:
            new = length
        new = min(new, length)
        if not self.appends:
            self._forget(where)
        if new:
            number = next(self._numbers)
            for part, tensor in (("k", keys), ("v", values)):
                # The new positions alone, copied: a view would keep the layer's
                # whole cache alive until the store is done.
                piece = tensor if new == length else tensor.narrow(-2, length - new, new).clone(
                    memory_format=torch.contiguous_format)
                key = self._key(block, subbatch, number, part)
                # The engine keeps a store's handle with the stored entry: one that
                # kept its source would hold every segment in memory as long as it is
                # stored on the tier.
                self._stores.append(self.engine.store(key, piece, self.tier, TransferKind.KV,
                                                      forget_source=self.appends))
            self._segments.setdefault(where, []).append((number, new))
        self._length[where] = length
        segments = self._segments.get(where, [])
        dropped = forgettable_segments([size for _, size in segments], length)
        for number, _ in segments[:dropped]:
            self._free(block, subbatch, number)
        del segments[:dropped]
        while len(self._stores) > 2 * self.stores_in_flight:
            self.engine.wait(self._stores.popleft())

    def issue(self, block: int, subbatch: int) -> bool:
        """Starts loading one (block, sub-batch)'s cache, unless it is pending or
        absent; True when loads were started."""
        where = (block, subbatch)
        if where in self._pending or where not in self:
            return False
        self._pending[where] = [
            tuple(self.engine.load(self._key(block, subbatch, number, part), TransferKind.KV) for part in ("k", "v"))
            for number, _ in self._segments[where]
        ]
        return True

    def take(self, block: int, subbatch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cache of one (block, sub-batch) on the device; None before its first store."""
        where = (block, subbatch)
        if where not in self:
            return None
        self.issue(block, subbatch)
        loaded = [(self.engine.wait(keys), self.engine.wait(values)) for keys, values in self._pending.pop(where)]
        if len(loaded) == 1:
            keys, values = loaded[0]
        else:
            keys = torch.cat([keys for keys, _ in loaded], dim=-2)
            values = torch.cat([values for _, values in loaded], dim=-2)
        length = self._length[where]
        if keys.shape[-2] > length:
            start = keys.shape[-2] - length
            keys, values = keys.narrow(-2, start, length), values.narrow(-2, start, length)
        return keys, values

    def drop(self, block: int, subbatch: int) -> None:
        """Forgets one (block, sub-batch)'s cache (its sequences are finished)."""
        self._forget((block, subbatch))

    def flush(self) -> None:
        """Waits for every store issued."""
        while self._stores:
            self.engine.wait(self._stores.popleft())

    def close(self) -> None:
        """Waits for the transfers in flight and frees every stored key."""
        self.flush()
        for where in list(self._segments):
            self._forget(where)

    def _forget(self, where: tuple[int, int]) -> None:
        for handles in self._pending.pop(where, ()):
            for handle in handles:
                self.engine.wait(handle)
        for number, _ in self._segments.pop(where, ()):
            self._free(*where, number)
        self._length.pop(where, None)

    def _free(self, block: int, subbatch: int, number: int) -> None:
        for part in ("k", "v"):
            key = self._key(block, subbatch, number, part)
            if key in self.engine:
                self.engine.free(key)
