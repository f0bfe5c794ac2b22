"""The KV cache of each (block, sub-batch) of a generation, resting on one tier.

Where it sits: `slcompile.generate` runs a decoder layer-major over K sub-batches;
after a (block, sub-batch) runs, its keys and values are stored here, and the next
decode step loads them back just before that (block, sub-batch) runs again.

Guarantees:
- Every store and load goes through the transfer engine with kind ``kv``: bytes are
  counted per tier in ``runtime_stats()``; the device tier, and the host tier on a
  CPU-only machine, copy nothing and count nothing.
- On a tier that copies, the cache is a list of segments along the position
  dimension, each one stored tensor holding its positions' keys and values
  position-major (a position's keys, then its values, as one row of bytes), so a
  segment is one read and the segments of a cache are consecutive rows of one
  buffer. A store writes the positions that are new (the prefill's, then one per
  decode step) merged with the most recent segments that are not longer than
  them (`merged_segments`, as a binary counter carries): a cache of n positions
  past the prefill is at most log2(n) + 2 segments, and a position is written
  about log2(n) times, from the cache the layer step returned (nothing is read
  back to merge). A load reads
  the segments that hold the positions the cache still keeps: a full-attention
  cache reads exactly what it uses; a sliding-window cache also reads the older
  part of the one segment the window starts in, and forgets segments once the
  window has left them. On a tier that copies nothing the whole cache is kept by
  reference, as the layer returned it.
- Where a row is a whole number of pages (and on a GPU), the segments of a cache
  are read straight into their rows of one buffer (`reads_in_place`); elsewhere
  each is read on its own and they are joined with one copy. On a CPU that
  buffer is page-aligned memory reused from one take to the next once the cache
  taken before is gone. The keys and values `take` returns are views of those
  rows, `(..., positions, head_dim)` as the layer returned them.
- ``issue(block, subbatch)`` starts the loads on the engine's I/O threads; ``take``
  returns their result (or loads right away when nothing was issued). A load issued
  after a store of the same (block, sub-batch) reads what that store wrote.
- Stores run in the background; the stored tensors are kept alive until their
  store is done, at most ``stores_in_flight`` (block, sub-batch)s' at once. A store
  copies the positions it writes out first, so what stays alive is those
  positions, not the whole cache they were computed in.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging

import torch

from slcompile.kv_segments import KV_STORES_IN_FLIGHT, forgettable_segments, merged_segments, reads_in_place
from slcompile.plans import new_name

from .storage.engine import TransferEngine, TransferHandle
from .storage.page_buffers import PageBufferCache
from .storage.tiers import PAGE_BYTES, Tier, TransferKind

__all__ = ["KVStore", "PartRows"]

log = logging.getLogger(__name__)


class PartRows:
    """The rows of one cache filled by parts of its sequences (`KVStore.empty_rows`)."""

    def __init__(self, store: KVStore, keys: torch.Tensor, values: torch.Tensor, sequences: int):
        self.sequences, self.filled = sequences, 0
        # Where the tier copies nothing, the parts themselves (no rows).
        self.parts: list[tuple[torch.Tensor, torch.Tensor]] = []
        self.rows: torch.Tensor | None = None
        if not store.appends:
            return
        whole_keys = keys.new_empty((sequences, *keys.shape[1:]), device="meta")
        whole_values = values.new_empty((sequences, *values.shape[1:]), device="meta")
        self.layout = _Rows.of(whole_keys, whole_values)
        self.rows = torch.empty((keys.shape[-2], self.layout.row_bytes), dtype=torch.uint8, device=keys.device)

    def add(self, keys: torch.Tensor, values: torch.Tensor) -> bool:
        """Copies in the next sequences' keys and values; True once all are there."""
        count = keys.shape[0]
        if self.rows is not None:
            self.layout.keys(self.rows).narrow(0, self.filled, count).copy_(keys)
            self.layout.values(self.rows).narrow(0, self.filled, count).copy_(values)
        else:
            self.parts.append((keys, values))
        self.filled += count
        return self.filled == self.sequences

    def joined(self) -> tuple[torch.Tensor, torch.Tensor]:
        return torch.cat([k for k, _ in self.parts]), torch.cat([v for _, v in self.parts])


@dataclasses.dataclass(frozen=True)
class _Rows:
    """How one position's keys and values lie in a row of bytes: the keys, then
    the values (each aligned for its type), `(..., head_dim)` each."""

    key_shape: tuple[int, ...]
    key_dtype: torch.dtype
    value_shape: tuple[int, ...]
    value_dtype: torch.dtype
    value_offset: int
    row_bytes: int

    @classmethod
    def of(cls, keys: torch.Tensor, values: torch.Tensor) -> _Rows:
        def shape(tensor):  # one position's
            return tuple(tensor.shape[:-2]) + tuple(tensor.shape[-1:])

        key_bytes = keys.element_size() * keys[..., :1, :].numel()
        value_bytes = values.element_size() * values[..., :1, :].numel()
        offset = -(-key_bytes // values.element_size()) * values.element_size()
        align = max(keys.element_size(), values.element_size())
        row = -(-(offset + value_bytes) // align) * align
        return cls(shape(keys), keys.dtype, shape(values), values.dtype, offset, row)

    def _view(self, rows: torch.Tensor, start: int, end: int, shape, dtype) -> torch.Tensor:
        part = rows.narrow(1, start, end - start).view(dtype)
        return part.view(rows.shape[0], *shape).movedim(0, -2)

    def keys(self, rows: torch.Tensor) -> torch.Tensor:
        """The keys of `(positions, row_bytes)` rows, `(..., positions, head_dim)`."""
        nbytes = torch.Size(self.key_shape).numel() * self.key_dtype.itemsize
        return self._view(rows, 0, nbytes, self.key_shape, self.key_dtype)

    def values(self, rows: torch.Tensor) -> torch.Tensor:
        nbytes = torch.Size(self.value_shape).numel() * self.value_dtype.itemsize
        return self._view(rows, self.value_offset, self.value_offset + nbytes, self.value_shape, self.value_dtype)


class KVStore:
    """The keys and values of every (block, sub-batch), on one tier.

    Args:
        engine: the transfer engine that stores and loads them.
        tier: where they rest between decode steps.
        stores_in_flight: stores whose source tensors may still be alive at once
            (older ones are waited for before a new one is issued).
    """

    def __init__(self, engine: TransferEngine, tier: Tier | str, stores_in_flight: int = KV_STORES_IN_FLIGHT):
        self.engine = engine
        self.tier = Tier(tier)
        self.name = new_name("kv")
        self.stores_in_flight = stores_in_flight
        # A tier that copies nothing keeps the layer's whole cache by reference;
        # appending would copy it into one tensor again at every load.
        self.appends = not engine.copies_nothing(self.tier, Tier.DEVICE)
        self._stores: collections.deque[TransferHandle] = collections.deque()
        # (block, sub-batch) -> the loads issued, and the rows they read into
        # (None: each into its own tensor).
        self._pending: dict[tuple[int, int], tuple[list[TransferHandle], torch.Tensor | None]] = {}
        # (block, sub-batch) -> [(segment number, positions)], oldest first.
        self._segments: dict[tuple[int, int], list[tuple[int, int]]] = {}
        self._length: dict[tuple[int, int], int] = {}
        self._rows: dict[tuple[int, int], _Rows] = {}
        self._numbers = itertools.count()
        # The buffers segments are joined in, reused once the cache taken is gone
        # (fresh memory would cost a page fault per page at every take); those of
        # smaller caches are dropped when a cache grows past every earlier one.
        self._joined = PageBufferCache(1 << 30)
        self._largest = 0

    def _key(self, block: int, subbatch: int, segment: int, part: str) -> str:
        return f"{self.name}:blk{block}.sb{subbatch}.seg{segment}.{part}"

    def _parts(self) -> tuple[str, ...]:
        # One stored tensor per segment where rows are appended; the layer's keys
        # and values as they are elsewhere.
        return ("kv",) if self.appends else ("k", "v")

    def __contains__(self, where: tuple[int, int]) -> bool:
        return where in self._segments

    def segments(self, block: int, subbatch: int) -> tuple[int, ...]:
        """The positions each stored segment of one (block, sub-batch) holds, oldest first."""
        return tuple(size for _, size in self._segments.get((block, subbatch), ()))

    def store(self, block: int, subbatch: int, keys: torch.Tensor, values: torch.Tensor, new: int) -> None:
        """Issues the store of one (block, sub-batch)'s cache after a pass.

        Args:
            block, subbatch: whose cache it is.
            keys, values: the whole cache, `(..., positions, head_dim)`: its last
                `new` positions are new, the others are the last ones stored before.
            new: how many positions the pass added (more than the cache keeps when
                a sliding window dropped some).
        """
        where = (block, subbatch)
        length = keys.shape[-2]
        if not self.appends:
            self._forget(where)
            number = next(self._numbers)
            for part, tensor in (("k", keys), ("v", values)):
                self._stores.append(self.engine.store(self._key(block, subbatch, number, part), tensor, self.tier,
                                                      TransferKind.KV))
            self._segments[where] = [(number, length)]
            self._length[where] = length
            self._wait_stores()
            return
        segments = self._segments.setdefault(where, [])
        replaced, count = merged_segments([size for _, size in segments], min(new, length), length) \
            if segments else (0, length)
        rows = None
        if count:
            layout = self._rows.setdefault(where, _Rows.of(keys, values))
            # The positions written, copied out as rows: a view would keep the
            # layer's whole cache alive until the store is done.
            rows = torch.empty((count, layout.row_bytes), dtype=torch.uint8, device=keys.device)
            layout.keys(rows).copy_(keys.narrow(-2, length - count, count))
            layout.values(rows).copy_(values.narrow(-2, length - count, count))
        self._store_rows(where, rows, replaced, length)

    def empty_rows(self, keys: torch.Tensor, values: torch.Tensor, sequences: int) -> PartRows:
        """Rows for the cache of `sequences` sequences, to be filled part by part
        (the keys and values of some of them: `(part, ..., positions, head_dim)`) and
        stored whole by `store_rows`; where the tier copies nothing, the parts are
        kept and joined."""
        return PartRows(self, keys, values, sequences)

    def store_rows(self, block: int, subbatch: int, filled: PartRows) -> None:
        """Issues the first store of one (block, sub-batch)'s cache from filled rows."""
        where = (block, subbatch)
        if not self.appends:
            keys, values = filled.joined()
            self.store(block, subbatch, keys, values, keys.shape[-2])
            return
        if where in self._segments:
            raise ValueError(f"store_rows: blk{block}.sb{subbatch} already has a stored cache")
        self._segments[where] = []
        self._rows[where] = filled.layout
        self._store_rows(where, filled.rows, 0, filled.rows.shape[0])

    def _store_rows(self, where: tuple[int, int], rows: torch.Tensor | None, replaced: int, length: int) -> None:
        """Stores `rows` (None: nothing new) as the newest segment of a cache of
        `length` positions, replacing its last `replaced` segments."""
        block, subbatch = where
        segments = self._segments[where]
        if rows is not None:
            count = rows.shape[0]
            number = next(self._numbers)
            # The engine keeps a store's handle with the stored entry: one that
            # kept its source would hold every segment in memory as long as it is
            # stored on the tier.
            self._stores.append(self.engine.store(self._key(block, subbatch, number, "kv"), rows, self.tier,
                                                  TransferKind.KV, forget_source=True))
            for old, _ in segments[len(segments) - replaced:]:
                self._free(block, subbatch, old)
            del segments[len(segments) - replaced:]
            segments.append((number, count))
        self._length[where] = length
        dropped = forgettable_segments([size for _, size in segments], length)
        for number, _ in segments[:dropped]:
            self._free(block, subbatch, number)
        del segments[:dropped]
        self._wait_stores()

    def _wait_stores(self) -> None:
        while len(self._stores) > len(self._parts()) * self.stores_in_flight:
            self.engine.wait(self._stores.popleft())

    def issue(self, block: int, subbatch: int) -> bool:
        """Starts loading one (block, sub-batch)'s cache, unless it is pending or
        absent; True when loads were started."""
        where = (block, subbatch)
        if where in self._pending or where not in self:
            return False
        segments = self._segments[where]
        layout = self._rows.get(where)
        granularity = 1 if self.engine.device.type != "cpu" else PAGE_BYTES
        if layout is None or len(segments) == 1 or not reads_in_place(layout.row_bytes, granularity):
            self._pending[where] = ([self.engine.load(self._key(block, subbatch, number, part), TransferKind.KV)
                                     for number, _ in segments for part in self._parts()], None)
            return True
        rows = self._buffer(sum(size for _, size in segments), layout.row_bytes, self.engine.device)
        handles, start = [], 0
        for number, size in segments:
            handles.append(self.engine.load(self._key(block, subbatch, number, "kv"), TransferKind.KV,
                                            into=rows.narrow(0, start, size)))
            start += size
        self._pending[where] = (handles, rows)
        return True

    def take(self, block: int, subbatch: int) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The cache of one (block, sub-batch) on the device; None before its first store."""
        where = (block, subbatch)
        if where not in self:
            return None
        self.issue(block, subbatch)
        handles, rows = self._pending.pop(where)
        loaded = [self.engine.wait(handle) for handle in handles]
        if not self.appends:
            return loaded[0], loaded[1]
        if rows is None:
            rows = loaded[0] if len(loaded) == 1 else torch.cat(loaded, out=self._buffer(
                sum(part.shape[0] for part in loaded), loaded[0].shape[1], loaded[0].device))
        length = self._length[where]
        if rows.shape[0] > length:
            rows = rows.narrow(0, rows.shape[0] - length, length)
        layout = self._rows[where]
        return layout.keys(rows), layout.values(rows)

    def _buffer(self, positions: int, row_bytes: int, device: torch.device) -> torch.Tensor:
        """Memory for the rows of a cache's segments, joined."""
        shape = (positions, row_bytes)
        if device.type != "cpu":
            return torch.empty(shape, dtype=torch.uint8, device=device)
        nbytes = shape[0] * shape[1]
        if nbytes > self._largest:
            self._joined.clear()
            self._largest = nbytes
        return self._joined.tensor(nbytes, torch.uint8, shape)

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
        self._joined.clear()

    def _forget(self, where: tuple[int, int]) -> None:
        for handle in self._pending.pop(where, ((), None))[0]:
            self.engine.wait(handle)
        for number, _ in self._segments.pop(where, ()):
            self._free(*where, number)
        self._length.pop(where, None)
        self._rows.pop(where, None)

    def _free(self, block: int, subbatch: int, number: int) -> None:
        for part in self._parts():
            key = self._key(block, subbatch, number, part)
            if key in self.engine:
                self.engine.free(key)
