"""The transfer engine's copies where the host tier is memory of its own: through
one copy stream on a CUDA machine; as plain copies on a CPU machine whose engine
keeps a separate host tier (``separate_host``: the same path, testable without a GPU).

Where it sits: one ``HostCopier`` per ``TransferEngine`` (``slcompile.runtime.storage.engine``),
which holds it and hands it the host and device tiers' transfers where the host tier
copies; the engine's nvme store (``slcompile.runtime.storage.nvme_store``) holds it too,
for the staging of nvme transfers on a CUDA machine (``copy_to_host``,
``copy_from_host``).

Needs: the engine's ``Ledger`` (``slcompile.runtime.storage.ledger``: its entries, the host
pool, pinned on a CUDA machine, and the bookkeeping) and the copy stream (None on a CPU).

Guarantees:
- On a CUDA machine copies are ``non_blocking`` on the copy stream, which first
  waits for the compute stream; each transfer's handle carries the event its
  ``wait`` makes the compute stream wait on. Results are allocated on the compute
  stream, where they are used and freed. On a CPU machine a copy is done when issued.
- Host groups: tensors stored onto the host together (``store_many``, as a block's
  weights are) share one range of the pool, each at the next 16-byte boundary after
  the one before (``group_layout``: what Triton kernels assume of a tensor's start,
  as `vocabulary.weight_layout` packs a visit's weights). Loads of members of one
  group that follow each other there are one copy: into one new device buffer, each
  member's result a view of it (``load_many``), or into the packed tensors of a
  block visit, as one transfer with one handle and one record (``load_packed``).
- ``overwrite`` writes new values into a host entry's own bytes, after the copies
  that read them: the entry keeps its address (a captured copy from it stays valid);
  ``read_host`` reads an entry there, for a consumer on the host.
- Bytes are counted per key, its logical size; residency likewise.
"""

from __future__ import annotations

import contextlib
import time

import torch

from slcompile.vocabulary import WEIGHT_ALIGNMENT

from ..errors import OffloadError, TransferFailedError, UnknownKeyError
from .handles import TransferHandle, _Entry, _typed_view, normalize_key
from .ledger import Ledger
from .ranges import round_up
from .tiers import HostBlock, HostPool, Tier, TransferKind

__all__ = ["HostCopier", "HostGroup", "group_layout", "GROUP_ALIGNMENT"]

GROUP_ALIGNMENT = WEIGHT_ALIGNMENT
"""Bytes a host group's members are aligned to, from the group's start: as a block
visit packs them (`vocabulary.weight_layout`), so that a run of them is one copy."""


def group_layout(sizes) -> tuple[list[int], int]:
    """(each member's offset, the group's bytes) of members of `sizes` bytes laid out
    in order, each at the next `GROUP_ALIGNMENT` boundary."""
    offsets, end = [], 0
    for nbytes in sizes:
        offset = round_up(end, GROUP_ALIGNMENT)
        offsets.append(offset)
        end = offset + nbytes
    return offsets, end


class HostGroup:
    """One pool range shared by the host entries of a group; given back to the pool
    when the last of them is released."""

    __slots__ = ("block", "members")

    def __init__(self, block: HostBlock, members: int):
        self.block = block
        self.members = members

    def release_member(self, pool: HostPool) -> None:
        self.members -= 1
        if self.members == 0:
            pool.release(self.block)


class HostCopier:
    """The host- and device-tier transfers of a ``TransferEngine`` where the host tier
    copies (see the module docstring).

    Args:
        ledger: The engine's entries and memory.
        copy_stream: The one persistent copy stream of a CUDA machine (None on a CPU).
    """

    def __init__(self, ledger: Ledger, copy_stream):
        self._ledger = ledger
        self._copy_stream = copy_stream

    # -- the copy stream (a CUDA machine) or none (a CPU machine) -------------

    def _copying(self):
        """The context copies are issued in: the copy stream, after the work the
        compute stream issued so far."""
        if not self._ledger.cuda:
            return contextlib.nullcontext()
        self._copy_stream.wait_stream(torch.cuda.current_stream(self._ledger.device))
        return torch.cuda.stream(self._copy_stream)

    def _copies_done(self):
        """What a reader waits on before using what the copies issued so far wrote:
        an event of the copy stream; None on a CPU, where a copy is done when issued."""
        if not self._ledger.cuda:
            return None
        event = torch.cuda.Event()
        event.record(self._copy_stream)
        return event

    # -- the nvme staging of a CUDA machine ------------------------------------

    def copy_to_host(self, source: torch.Tensor, block: HostBlock, entry: _Entry):
        with self._copying():
            _typed_view(block.buffer, entry).copy_(source, non_blocking=True)
            return self._copies_done()

    def copy_from_host(self, result: torch.Tensor, block: HostBlock, entry: _Entry, *, wait: bool):
        with torch.cuda.stream(self._copy_stream):
            result.copy_(_typed_view(block.buffer, entry), non_blocking=True)
            event = torch.cuda.Event()
            event.record(self._copy_stream)
        if wait:
            event.synchronize()
        return event

    # -- stores ---------------------------------------------------------------

    def store(self, handle, entry, source) -> None:
        block = self._ledger.pool().allocate(entry.nbytes, handle.key)
        self._ledger.recorder.resident_change(Tier.HOST, entry.nbytes)
        event = self.copy_to_host(source, block, entry)
        entry.host_block, entry.last_event = block, event
        handle._cuda_event = event
        self._ledger.install(entry)
        self._stored(handle, entry, Tier.HOST)
        handle._finish(source, None)

    def store_group(self, keys: list[str], sources: list[torch.Tensor], kind) -> list[TransferHandle]:
        """Stores of a run onto the host as one group: one pool range, one event."""
        handles, entries = [], []
        for key, source in zip(keys, sources):
            nbytes = source.numel() * source.element_size()
            handles.append(TransferHandle(next(self._ledger.ids), key, kind, self._ledger.tier_of(source), Tier.HOST, nbytes, "store"))
            entries.append(_Entry(key, Tier.HOST, kind, tuple(source.shape), source.dtype, nbytes))
        offsets, total = group_layout([entry.nbytes for entry in entries])
        block = self._ledger.pool().allocate(total, keys[0])
        group = HostGroup(block, len(entries))
        self._ledger.recorder.resident_change(Tier.HOST, sum(entry.nbytes for entry in entries))
        with self._copying():
            for entry, source, offset in zip(entries, sources, offsets):
                entry.host_block = HostBlock(None, block.buffer[offset:offset + entry.nbytes], block.chunk)
                entry.host_group, entry.host_offset = group, offset
                _typed_view(entry.host_block.buffer, entry).copy_(source, non_blocking=True)
            event = self._copies_done()
        for handle, entry, source in zip(handles, entries, sources):
            entry.last_event = event
            handle._cuda_event = event
            self._ledger.install(entry)
            self._stored(handle, entry, Tier.HOST)
            handle._finish(source, None)
        return handles

    def store_on_device(self, handle, entry, source) -> None:
        # Allocated on the compute stream, which is where it will be used and freed.
        result = torch.empty(entry.shape, dtype=entry.dtype, device=self._ledger.device)
        with self._copying():
            result.copy_(source, non_blocking=True)
            event = self._copies_done()
        entry.tensor = result
        handle._cuda_event = event
        self._ledger.recorder.resident_change(Tier.DEVICE, entry.nbytes)
        self._ledger.install(entry)
        self._stored(handle, entry, Tier.DEVICE)
        handle._finish(result, None)

    def _stored(self, handle, entry, tier: Tier) -> None:
        now = time.perf_counter()
        self._ledger.recorder.transfer_finished((handle.kind, handle.source, tier), entry.nbytes, now, now, "store",
                                         handle.label)

    def overwrite(self, key: str | int, values: torch.Tensor, kind: TransferKind | str | None = None) -> None:
        """Writes `values` into the memory a host-tier key rests in, in place, once the
        loads that read it are done: its address stays (what is loaded from it later,
        copies captured in a CUDA graph included, reads the new values). Nothing is
        allocated, so nothing can run out of room. Counted as a store.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
            ValueError: ``key`` does not rest in host memory of its own (another
                tier, or a host tier that copies nothing), or `values` differ in
                dtype or number of elements.
        """
        key = normalize_key(key)
        with self._ledger.lock:
            entry = self._ledger.entries.get(key)
            if entry is None:
                raise UnknownKeyError("cannot overwrite: nothing is stored under this key", key=key)
            self._overwrite_host(entry, values.detach(), entry.kind if kind is None else TransferKind(kind))

    def read_host(self, key: str | int) -> torch.Tensor:
        """A copy in host memory of what a key resting in host memory of its own holds,
        read there, once the copies writing it are done: for a consumer on the host
        (an offloaded optimizer's gradients), with no trip to the device and back.
        Counted as a local copy.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
            ValueError: ``key`` does not rest in host memory of its own.
        """
        key = normalize_key(key)
        with self._ledger.lock:
            entry = self._ledger.entries.get(key)
            if entry is None:
                raise UnknownKeyError("cannot read: nothing is stored under this key", key=key)
            return self._read_host(entry)

    def _overwrite_host(self, entry: _Entry, values: torch.Tensor, kind) -> None:
        """`overwrite` of `entry` (the caller holds the ledger's lock)."""
        if entry.host_block is None:
            raise ValueError(f"overwrite({entry.key!r}): only a key resting in host memory of its own is written in "
                             f"place; this one rests on the {entry.tier.value} tier")
        if values.dtype != entry.dtype or values.numel() * values.element_size() != entry.nbytes:
            raise ValueError(f"overwrite({entry.key!r}): {values.dtype} values of {values.numel()} elements for a "
                             f"{entry.dtype} tensor of shape {entry.shape}")
        if entry.last_event is not None:  # copies still reading the old values
            entry.last_event.synchronize()
        with self._copying():
            _typed_view(entry.host_block.buffer, entry).copy_(values.reshape(entry.shape), non_blocking=True)
            event = self._copies_done()
        if event is not None:
            event.synchronize()  # the caller may change `values` once this returns
        entry.last_event = None
        now = time.perf_counter()
        self._ledger.recorder.transfer_finished((kind, self._ledger.tier_of(values), Tier.HOST), entry.nbytes, now, now, "store",
                                         f"{kind.value} {entry.key} overwrite")

    def _read_host(self, entry: _Entry) -> torch.Tensor:
        """`read_host` of `entry` (the caller holds the ledger's lock)."""
        if entry.host_block is None:
            raise ValueError(f"read_host({entry.key!r}): the key rests on the {entry.tier.value} tier, not in host "
                             "memory of its own")
        if entry.last_event is not None:  # the store writing it
            entry.last_event.synchronize()
        self._ledger.recorder.local_copy(entry.nbytes)
        return _typed_view(entry.host_block.buffer, entry).clone()

    # -- loads ----------------------------------------------------------------

    def load(self, handle, entry, into=None) -> None:
        try:
            result = into
            if result is None:
                # Allocated on the compute stream, which is where it will be used and freed.
                result = torch.empty(entry.shape, dtype=entry.dtype, device=self._ledger.device)
                self._ledger.track_delivered(result, Tier.DEVICE, entry.nbytes)
            with self._copying():
                source = _typed_view(entry.host_block.buffer, entry) if entry.host_block is not None else entry.tensor
                result.copy_(source, non_blocking=True)
                event = self._copies_done()
            entry.last_event = event
            handle._cuda_event = event
            self._loaded(handle, entry)
            self._ledger.load_finished(handle, entry, result, None)
        except OffloadError as error:
            self._ledger.load_finished(handle, entry, None, error)
            raise

    def load_together(self, loads: list[tuple[TransferHandle, _Entry]], destinations=None) -> None:
        """Host-tier loads issued as one (`_copy_runs`): one switch to the copy stream
        and one event for all; `destinations`: id(handle) -> its tensor or None."""
        destinations = destinations or {}
        try:
            with self._copying():
                results = self._copy_runs([(entry, destinations.get(id(handle))) for handle, entry in loads])
                event = self._copies_done()
        except Exception as error:  # noqa: BLE001 - every load must finish
            failure = error if isinstance(error, OffloadError) else \
                TransferFailedError(f"load could not start: {error!r}", key=loads[0][0].key)
            for handle, entry in loads:
                self._ledger.load_finished(handle, entry, None, failure)
            raise failure from error
        for (handle, entry), result in zip(loads, results):
            entry.last_event = event
            handle._cuda_event = event
            self._loaded(handle, entry)
            self._ledger.load_finished(handle, entry, result, None)

    def load_packed(self, keys, places, packed, kind: TransferKind | str = TransferKind.WEIGHT
                    ) -> TransferHandle | None:
        """Loads of keys resting in host memory of their own into packed tensors (a
        block visit's weights: `vocabulary.weight_layout`) as one transfer: one
        handle, one record on the timeline, one event, and one copy for each run of
        keys that follow each other in a host group as their places do in one packed
        tensor (keys in the group's order, the packing order, make one run per
        dtype). `wait` on the handle returns None (the results are `packed`). Returns
        None, issuing nothing, where a key does not rest so (another tier, a failed
        store): `load_many` loads those.

        Args:
            keys: the keys, in order.
            places: per key, (its packed tensor's index, its first element there).
            packed: the tensors loaded into, each of one dtype.

        Raises:
            TransferFailedError: a copy could not start.
        """
        keys = [normalize_key(key) for key in keys]
        kind = kind if kind.__class__ is TransferKind else TransferKind(kind)
        with self._ledger.lock:
            entries = [self._ledger.entries.get(key) for key in keys]
            if not self._ledger.host_copies or any(entry is None or entry.error is not None or entry.host_block is None
                                            for entry in entries):
                return None
            for entry in entries:
                entry.readers += 1
        nbytes = sum(entry.nbytes for entry in entries)
        handle = TransferHandle(next(self._ledger.ids), keys[0], kind, Tier.HOST, Tier.DEVICE, nbytes, "load")
        error = None
        try:
            with self._copying():
                for first, last in _packed_runs(entries, places, packed):
                    (entry, (section, offset)), end = first, last[0].host_offset + last[0].nbytes
                    target = packed[section]
                    span = (end - entry.host_offset) // target.element_size() if entry.host_group is not None \
                        else entry.nbytes // target.element_size()
                    source = entry.host_group.block.buffer[entry.host_offset:end] \
                        if entry.host_group is not None else entry.host_block.buffer[:entry.nbytes]
                    target[offset:offset + span].copy_(source.view(target.dtype), non_blocking=True)
                event = self._copies_done()
        except Exception as failure:  # noqa: BLE001 - the load must finish
            error = failure if isinstance(failure, OffloadError) else \
                TransferFailedError(f"load could not start: {failure!r}", key=keys[0])
        for entry in entries:
            if error is None:
                entry.last_event = event
            with self._ledger.lock:
                entry.readers -= 1
            self._ledger.release_if_unused(entry)
        if error is not None:
            handle._finish(None, error)
            raise error
        handle._cuda_event = event
        now = time.perf_counter()
        self._ledger.recorder.transfer_finished((kind, Tier.HOST, Tier.DEVICE), nbytes, now, now, "load",
                                         f"{kind.value} {keys[0]} and {len(keys) - 1} more host->device")
        handle._finish(None, None)
        return handle

    def _copy_runs(self, pairs: list[tuple[_Entry, torch.Tensor | None]]) -> list[torch.Tensor]:
        """Copies host entries to the device, in the copy context: members of one host
        group that follow each other there are one copy, into one new device buffer
        (each result a view of it) or into their destinations, where those follow each
        other in one tensor's memory as in the group; the others one copy each.
        Returns each pair's result (its destination, when given)."""
        results: list[torch.Tensor | None] = [destination for _, destination in pairs]
        for run in _runs(pairs):
            first, destination = pairs[run[0]]
            last = pairs[run[-1]][0]
            if first.host_group is None:
                if destination is None:
                    destination = results[run[0]] = torch.empty(first.shape, dtype=first.dtype, device=self._ledger.device)
                    self._ledger.track_delivered(destination, Tier.DEVICE, first.nbytes)
                destination.copy_(_typed_view(first.host_block.buffer, first), non_blocking=True)
                continue
            start, end = first.host_offset, last.host_offset + last.nbytes
            source = first.host_group.block.buffer[start:end]
            if destination is None:
                flat = torch.empty(end - start, dtype=torch.uint8, device=self._ledger.device)
                self._ledger.track_delivered(flat, Tier.DEVICE, sum(pairs[i][0].nbytes for i in run))
                for i in run:
                    entry = pairs[i][0]
                    offset = entry.host_offset - start
                    results[i] = _typed_view(flat[offset:offset + entry.nbytes], entry)
            else:  # one tensor's memory, from the first destination on: its dtype
                flat = destination.as_strided(((end - start) // destination.element_size(),), (1,))
                source = source.view(destination.dtype)
            flat.copy_(source, non_blocking=True)
        return results

    def _loaded(self, handle, entry) -> None:
        now = time.perf_counter()
        self._ledger.recorder.transfer_finished((handle.kind, Tier.HOST, Tier.DEVICE), entry.nbytes, now, now, "load",
                                         handle.label)


def _runs(pairs: list[tuple[_Entry, torch.Tensor | None]]) -> list[list[int]]:
    """The (entry, destination) pairs, by index, as runs that one copy serves: members
    of one host group that follow each other in it (in the group's order, whatever the
    order asked), whose destinations, if given, follow each other likewise in one
    tensor's memory; or one pair."""
    grouped = sorted((i for i, (entry, _) in enumerate(pairs) if entry.host_group is not None),
                     key=lambda i: (id(pairs[i][0].host_group), pairs[i][0].host_offset))
    runs = [[i] for i, (entry, _) in enumerate(pairs) if entry.host_group is None]
    for i in grouped:
        entry, destination = pairs[i]
        if runs and pairs[runs[-1][0]][0].host_group is entry.host_group:
            before, before_destination = pairs[runs[-1][-1]]
            if before is not entry and \
                    round_up(before.host_offset + before.nbytes, GROUP_ALIGNMENT) == entry.host_offset and \
                    _follows(before_destination, destination, entry.host_offset - before.host_offset):
                runs[-1].append(i)
                continue
        runs.append([i])
    return runs


def _packed_runs(entries: list[_Entry], places, packed) -> list[tuple[tuple, tuple]]:
    """(first, last) (entry, place) of each run `load_packed` copies at once: entries
    in order that follow each other in one host group as their places do in one
    packed tensor."""
    runs = []
    before = None
    for entry, place in zip(entries, places):
        if before is not None and entry.host_group is not None and entry.host_group is before[0].host_group \
                and place[0] == before[1][0] and \
                round_up(before[0].host_offset + before[0].nbytes, GROUP_ALIGNMENT) == entry.host_offset and \
                (place[1] - before[1][1]) * packed[place[0]].element_size() == entry.host_offset - before[0].host_offset:
            runs[-1] = (runs[-1][0], (entry, place))
        else:
            runs.append(((entry, place), (entry, place)))
        before = (entry, place)
    return runs


def _follows(before: torch.Tensor | None, after: torch.Tensor | None, distance: int) -> bool:
    """Whether `after` starts `distance` bytes after `before` in the same memory (or
    neither has a destination)."""
    if before is None or after is None:
        return before is None and after is None
    return before.untyped_storage().data_ptr() == after.untyped_storage().data_ptr() and \
        after.data_ptr() - before.data_ptr() == distance
