"""The transfer engine: asynchronous store/load of tensors between tiers.

Where it sits: the custom ops of ``slcompile.runtime.ops`` call the process-wide
engine (``get_engine()``); schedules issue a transfer early and wait for it late.

Needs: tensors that are dense, strided and of a plain ``torch.Tensor`` type;
keys that are strings (ints are accepted and mean ``str(key)``).

Guarantees:
- ``store`` and ``load`` only issue; ``wait`` blocks until that one transfer is
  done (on CPU the nvme I/O threads are the transfer "stream") and returns the
  tensor. A load issued after a store of the same key reads what that store
  wrote: it starts only once the write is complete.
- Moves that copy nothing are free: the device tier, and the host tier on a
  CPU-only machine (where host memory *is* device memory), keep a reference to
  the stored tensor and hand the same tensor back, counting zero bytes.
- Every other finished transfer adds its ``nbytes`` to
  ``bytes_moved[(kind, source tier, destination tier)]`` of
  ``slcompile.runtime.stats`` and records a timeline event on lane ``"store"`` or
  ``"load"``; time blocked in ``wait`` is counted as stall.
- Residency (``peak_bytes``/``resident_bytes``) counts logical tensor bytes:
  nvme = bytes of stored slots; host = bytes of keys resting on host; device =
  bytes of keys resting on the device plus tensors delivered by nvme/host loads
  until the last tensor using that memory is gone (exact on CPU, where the
  engine owns the buffer; on CUDA until the delivered tensor object dies).
- On CPU, nvme loads read straight into page-aligned memory that becomes the
  returned tensor (no copy); once that tensor is gone its memory is kept, up to
  ``buffer_cache_bytes``, for the next load of the same size, so a steady
  schedule does not pay page faults on every load.
- Non-contiguous (and conjugate/negative-bit) sources are made contiguous on
  purpose before storing, counted in ``local_copy_bytes``: a tier stores values,
  not storage identity, so a loaded tensor never aliases anything else. Sparse,
  nested, quantized, meta and tensor-subclass sources are refused with
  ``UnsupportedTensorError`` saying why.
- The caller keeps a stored tensor unchanged until ``wait`` on its store
  returns; the engine keeps it alive until then.
- A store that fails leaves its key failed: ``wait`` raises the error and later
  loads raise ``TransferFailedError``; half-written data is never returned.
- The engine of an ``offload_dir`` (``get_engine``) lives while something holds
  it; once nothing does, its arena's directory is removed, its I/O threads stop
  and the tiers stop counting what its keys held.
- On CUDA: one persistent copy stream and events; host-tier tensors and nvme
  staging live in one pinned ``HostPool`` sized from the compiled plan
  (``reserve_host``) and grown by whole chunks; copies are ``non_blocking``;
  ``wait`` makes the current stream wait on the copy's event. Host copies are
  counted when issued. A run stored onto the host together is one host group, and
  a run of its loads one copy (``slcompile.runtime.storage.host_copier``).
- ``separate_host`` (default: ``SLC_SEPARATE_HOST=1`` in the environment) gives a
  CPU machine's engine a host tier of its own memory, which loads and stores copy,
  as a GPU machine's does (without streams or pinning): the host tier's path,
  counted and testable on a CPU.
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import threading
import time
import weakref

import torch

from ..errors import TransferFailedError, UnknownKeyError
from .handles import StoredTensor, TransferHandle, _Entry, normalize_key, storable
from .host_copier import HostCopier
from .ledger import Ledger
from .nvme import NvmeArena, NvmeSlot, PageBufferCache
from .nvme_store import NvmeStore
from .page_buffers import profiler_sees_buffers
from ..stats import RECORDER, Recorder
from .tiers import (
    DEFAULT_CHUNK_BYTES,
    PAGE_BYTES,
    HostPool,
    HostPoolGrowth,
    Tier,
    TransferKind,
    compute_device,
)

__all__ = [
    "TransferEngine",
    "TransferHandle",
    "StoredTensor",
    "normalize_key",
    "get_engine",
    "set_engine",
    "configure_engine",
]

log = logging.getLogger(__name__)


class TransferEngine:
    """Moves tensors between the device, host and nvme tiers, asynchronously.

    Args:
        offload_dir: Parent directory of the nvme arena's private directory
            (default: the temp dir). The arena is created on the first nvme store.
        capacity_bytes: Cap on the nvme arena file (None: the disk is the cap).
        chunk_bytes: Largest single nvme I/O.
        num_io_threads: nvme I/O threads.
        host_memory: Cap on the pinned host pool (CUDA machines only; None: no
            cap). The pool is sized from each compiled plan (``reserve_host``) and
            grows by whole chunks of ``host_chunk_bytes`` only when a tensor finds
            no room; past this cap it raises ``HostPoolFullError`` instead.
        host_chunk_bytes: The largest piece of host memory pinned at once.
        buffer_cache_bytes: On CPU, most bytes of freed load buffers kept for
            reuse by later loads of the same size (0: none).
        checksums: Checksum nvme slots when written and verify them when read
            (``NvmeArena``; default: on unless ``SLC_CHECKSUMS=0``).
        separate_host: On a CPU machine, keep the host tier in memory of its own
            that loads and stores copy (default: ``SLC_SEPARATE_HOST=1``); a CUDA
            machine's host tier always is.
        recorder: Where bytes, stalls and events are counted.

    The engine is made of three parts, each holding what it needs: its ``Ledger``
    (``slcompile.runtime.storage.ledger``: the entries by key, the arena, the host pool and
    the page buffers, and the bookkeeping that releases them), its ``NvmeStore``
    (``slcompile.runtime.storage.nvme_store``) and its ``HostCopier``
    (``slcompile.runtime.storage.host_copier``). It checks what it is asked and hands each
    transfer to the part of its tier.
    """

    def __init__(
        self,
        offload_dir: str | None = None,
        *,
        capacity_bytes: int | None = None,
        chunk_bytes: int = 8 << 20,
        num_io_threads: int = 4,
        host_memory: int | None = None,
        host_chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        buffer_cache_bytes: int = 1 << 30,
        checksums: bool | None = None,
        separate_host: bool | None = None,
        recorder: Recorder = RECORDER,
    ):
        self.offload_dir = offload_dir
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.num_io_threads = num_io_threads
        self.host_memory = host_memory
        self.host_chunk_bytes = host_chunk_bytes
        self.checksums = checksums
        self.device = compute_device()
        cuda = self.device.type == "cuda"
        if separate_host is None:
            separate_host = os.environ.get("SLC_SEPARATE_HOST", "0") == "1"
        self._recorder = recorder
        # Made by partials that refer to no engine, so that an engine nothing holds goes.
        make_arena = functools.partial(NvmeArena, offload_dir, capacity_bytes=capacity_bytes,
                                       chunk_bytes=chunk_bytes, num_threads=num_io_threads, checksums=checksums)
        make_pool = functools.partial(HostPool, pin=cuda, chunk_bytes=host_chunk_bytes, limit_bytes=host_memory,
                                      on_growth=functools.partial(_count_pinned, recorder))
        # Whether the host tier is memory of its own, which moves between it and the device copy.
        self._ledger = Ledger(self.device, recorder, make_arena, make_pool, PageBufferCache(buffer_cache_bytes),
                              host_copies=cuda or separate_host)
        # One persistent copy stream: a new stream per call would cost a sync each time.
        self._host = HostCopier(self._ledger, torch.cuda.Stream(self.device) if cuda else None)
        self._nvme = NvmeStore(self._ledger, self._host)
        # The keys the last `close()` forgot, for the error of a load of one.
        self._closed_keys: frozenset[str] = frozenset()

    # -- resources -----------------------------------------------------------

    @property
    def arena(self) -> NvmeArena:
        """The nvme arena, created on first use."""
        return self._ledger.get_arena(None)

    @property
    def has_arena(self) -> bool:
        """True once the nvme arena exists."""
        return self._ledger.arena is not None

    @property
    def host_pool(self) -> HostPool | None:
        """The pinned host pool, once something was reserved or stored in it."""
        return self._ledger.host_pool

    def reserve_host(
        self, nbytes: int, *, largest: int = 0, what: str = "the plan", host_memory: int | None = None
    ) -> HostPoolGrowth | None:
        """Sizes the pinned host pool for a compiled plan: ``nbytes`` more bytes free.

        Nothing is reserved on a CPU-only machine, where the host tier copies nothing
        (unless ``separate_host``: its pool is then ordinary memory).

        Args:
            nbytes: What the plan will hold on the host beyond what already rests there
                (streamed weights, activations in flight).
            largest: Its largest single tensor.
            what: Who needs it, for the log line and the error.
            host_memory: Cap from the plan's options (None: keep the engine's).

        Returns:
            What was pinned, or None when nothing was.

        Raises:
            HostPoolFullError: over ``host_memory`` or the memory could not be pinned;
                the message names the bytes and the option.
        """
        if not self._ledger.host_copies or nbytes <= 0:
            return None
        pool = self._ledger.pool()
        if host_memory is not None:
            self.host_memory = host_memory
            pool.limit_bytes = host_memory
        return pool.reserve(nbytes, largest=largest, what=what)

    def host_bytes_of(self, keys) -> int:
        """Bytes of the given keys that rest on the host tier now (unknown keys: 0)."""
        with self._ledger.lock:
            entries = (self._ledger.entries.get(normalize_key(key)) for key in keys)
            return sum(e.nbytes for e in entries if e is not None and e.tier is Tier.HOST)

    def copies_nothing(self, source: Tier | str, destination: Tier | str) -> bool:
        """True when a move between the two tiers keeps the same memory: the same
        tier, or host and device on a CPU-only machine (host memory is device memory,
        unless ``separate_host``).
        """
        source = source if source.__class__ is Tier else Tier(source)
        destination = destination if destination.__class__ is Tier else Tier(destination)
        if source is destination:
            return True
        return not self._ledger.host_copies and {source, destination} <= {Tier.DEVICE, Tier.HOST}

    def tier_of(self, tensor: torch.Tensor) -> Tier:
        """The tier a tensor's memory belongs to: device if on the compute device,
        else host."""
        return self._ledger.tier_of(tensor)

    # -- public API ----------------------------------------------------------

    def store(
        self,
        key: str | int,
        tensor: torch.Tensor,
        tier: Tier | str,
        kind: TransferKind | str,
        forget_source: bool = False,
        reserved: NvmeSlot | None = None,
    ) -> TransferHandle:
        """Issues a store of ``tensor`` under ``key`` onto ``tier``.

        Replaces whatever the key held before (the old data is released once no
        transfer uses it). Keep ``tensor`` unchanged until ``wait`` returns.

        Args:
            key: Names the tensor; str, or int meaning ``str(key)``.
            tensor: The values to store.
            tier: Where they should rest.
            kind: What they are, for the byte counters.
            forget_source: drop the handle's reference to ``tensor`` when the store
                is done (``wait`` then returns None), so the caller's last
                reference frees it, on the caller's thread.
            reserved: an nvme slot from ``reserve`` of this key, written instead of
                a slot allocated now (so the store cannot run out of room); ignored
                where the store writes no file.

        Returns:
            The handle; ``wait`` on it returns the stored (source) tensor.

        Raises:
            UnsupportedTensorError: the tensor cannot be stored (message says why).
            DiskFullError: no room in the nvme arena.
            OffloadDirError: the nvme arena's directory is unusable.
        """
        key = normalize_key(key)
        tier = tier if tier.__class__ is Tier else Tier(tier)
        kind = kind if kind.__class__ is TransferKind else TransferKind(kind)
        source = self._prepare_source(key, tensor)
        nbytes = source.numel() * source.element_size()
        source_tier = self.tier_of(source)
        handle = TransferHandle(next(self._ledger.ids), key, kind, source_tier, tier, nbytes, "store")
        handle.forget_source = forget_source
        entry = _Entry(key, tier, kind, tuple(source.shape), source.dtype, nbytes)
        if self.copies_nothing(source_tier, tier):
            entry.tensor = source
            handle.zero_copy = True
            self._recorder.resident_change(tier, nbytes)
            self._ledger.install(entry)
            handle._finish(source, None)
        elif tier is Tier.NVME:
            self._nvme.store(handle, entry, source, reserved)
        elif tier is Tier.HOST:
            self._host.store(handle, entry, source)
        else:
            self._host.store_on_device(handle, entry, source)
        return handle

    def store_many(self, keys, tensors, tier: Tier | str, kind: TransferKind | str,
                   forget_source: bool = False) -> list[TransferHandle]:
        """`store` of each (key, tensor), in order, onto one tier: a run onto a host
        tier that copies is one host group (one range of the pool, whose members
        `load_many` loads by one copy: `slcompile.runtime.storage.host_copier`); on a CPU
        machine a run onto the nvme tier takes consecutive slots of the arena and,
        at most `NvmeArena.run_bytes` in all, is written by one I/O (`NvmeArena.write_run`);
        otherwise the tensors are stored one by one.

        Raises:
            As `store`. A run written together raises before any of it is issued.
        """
        tier = tier if tier.__class__ is Tier else Tier(tier)
        kind = kind if kind.__class__ is TransferKind else TransferKind(kind)
        keys = [normalize_key(key) for key in keys]
        if tier is Tier.HOST and self._ledger.host_copies and len(keys) > 1:
            sources = [self._prepare_source(key, tensor) for key, tensor in zip(keys, tensors)]
            return self._host.store_group(keys, sources, kind)
        if tier is not Tier.NVME or self._ledger.cuda or len(keys) < 2:
            return [self.store(key, tensor, tier, kind, forget_source) for key, tensor in zip(keys, tensors)]
        sources = [self._prepare_source(key, tensor) for key, tensor in zip(keys, tensors)]
        sizes = [source.numel() * source.element_size() for source in sources]
        if 0 in sizes:
            return [self.store(key, source, tier, kind, forget_source) for key, source in zip(keys, sources)]
        ids = self._ledger.ids
        # A CPU machine's sources are all in its memory: the device tier.
        handles = [TransferHandle(next(ids), key, kind, Tier.DEVICE, tier, nbytes, "store")
                   for key, nbytes in zip(keys, sizes)]
        if forget_source:
            for handle in handles:
                handle.forget_source = True
        entries = [_Entry(key, tier, kind, tuple(source.shape), source.dtype, nbytes)
                   for key, source, nbytes in zip(keys, sources, sizes)]
        self._nvme.store_run(handles, entries, sources)
        return handles

    def load(self, key: str | int, kind: TransferKind | str | None = None,
             into: torch.Tensor | None = None) -> TransferHandle:
        """Issues a load of ``key`` onto the device.

        Args:
            key: A key previously stored.
            kind: What the tensor is, for the byte counters (default: the kind it
                was stored as).
            into: A contiguous device tensor of the stored tensor's dtype and shape
                to load into (not counted as delivered: its memory is the caller's);
                on a CPU machine its memory starts on a page and the stored size
                rounded up to pages is writable from there. Where nothing is copied
                the stored tensor is returned instead.

        Returns:
            The handle; ``wait`` on it returns the tensor on the device. For
            zero-copy tiers that is the stored tensor itself.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
            TransferFailedError: the last store of ``key`` failed.
        """
        handle, entry, pending_store = self._start_load(key, kind, into)
        if entry is not None:
            self._dispatch_load(handle, entry, pending_store, into)
        return handle

    def load_many(self, keys, kind: TransferKind | str | None = None, into=None) -> list[TransferHandle]:
        """Issues loads of `keys` (as `load` does, in order) together: where the host
        tier copies, its copies go to the copy stream in one switch and are awaited
        by one event, the members of a host group that follow each other there by
        one copy into one device buffer (`_load_host_together`; with `into`, into
        one region of the tensor the destinations view where they follow each other
        there as in the group); on a CPU machine the nvme tier's small reads are
        counted and started as one run (`NvmeStore.load_new_run`); other loads are
        issued one by one. `into`: a destination per key, as `load` takes one.

        Raises:
            UnknownKeyError, TransferFailedError: as `load` (the loads of the keys
                before the failing one are issued).
        """
        started: list[tuple[TransferHandle, _Entry | None, TransferHandle | None]] = []
        try:
            with self._ledger.lock:
                for key, destination in zip(keys, into or itertools.repeat(None)):
                    started.append(self._start_load(key, kind, destination))
        finally:
            together, destinations = [], {}
            alone = not self._ledger.host_copies and profiler_sees_buffers()  # see `_together`
            for (handle, entry, pending_store), destination in zip(started, into or itertools.repeat(None)):
                if entry is None:
                    continue
                if not alone and self._together(entry, pending_store) and \
                        (destination is None or entry.tier is Tier.HOST):
                    together.append((handle, entry))
                    destinations[id(handle)] = destination
                else:
                    self._dispatch_load(handle, entry, pending_store, destination)
            host = [load for load in together if load[1].tier is Tier.HOST]
            if host:
                self._host.load_together(host, destinations)
            if len(host) < len(together):
                self._nvme.load_new_run([load for load in together if load[1].tier is not Tier.HOST])
        return [handle for handle, _, _ in started]

    def _together(self, entry: _Entry, pending_store: TransferHandle | None) -> bool:
        """Whether `load_many` issues this entry's load with the others: from a host
        tier that copies; on a CPU machine from a written nvme slot small enough to
        be a member of a run one I/O reads (`NvmeArena.run_bytes`), into new memory (never while the profiler is to see the memory
        loads take: `load_many` asks that once)."""
        if entry.tier is Tier.HOST:
            return entry.host_block is not None
        if self._ledger.cuda:
            return False
        slot = entry.slot
        return (entry.tier is Tier.NVME and entry.error is None and slot is not None and slot.valid
                and (pending_store is None or pending_store._finished)
                and 0 < entry.nbytes <= self._ledger.arena.run_bytes)

    def _start_load(self, key, kind, into) -> tuple[TransferHandle, _Entry | None, TransferHandle | None]:
        """(the load's handle, its entry or None when it finished without copying,
        the store it must follow)."""
        key = normalize_key(key)
        with self._ledger.lock:
            entry = self._ledger.entries.get(key)
            if entry is None:
                if key in self._closed_keys:
                    raise UnknownKeyError("nothing is stored under this key: the engine was closed since it was "
                                          "stored (TransferEngine.close() forgets every key)", key=key)
                raise UnknownKeyError("nothing is stored under this key", key=key)
            if entry.error is not None:
                raise TransferFailedError(
                    f"the last store of this key failed ({entry.error.reason})",
                    key=key, path=entry.error.path,
                )
            kind = entry.kind if kind is None else kind if kind.__class__ is TransferKind else TransferKind(kind)
            handle = TransferHandle(
                next(self._ledger.ids), key, kind, entry.tier, Tier.DEVICE, entry.nbytes, "load"
            )
            if entry.tensor is not None and self.copies_nothing(entry.tier, Tier.DEVICE):
                handle.zero_copy = True
                handle._finish(entry.tensor, None)
                return handle, None, None
            if into is not None and entry.tier is Tier.NVME and not self._ledger.cuda and into.data_ptr() % PAGE_BYTES:
                raise ValueError(f"load of {key!r} into a tensor that does not start on a page: on a CPU machine "
                                 "O_DIRECT reads need page-aligned memory; pass a view of a page-aligned buffer "
                                 "(PageBufferCache.tensor) or leave into=None")
            entry.readers += 1
            return handle, entry, entry.store_handle

    def _dispatch_load(self, handle, entry, pending_store, into) -> None:
        if entry.tier is Tier.NVME:
            if pending_store is not None:
                # Read only what the store wrote: start after its last chunk landed.
                pending_store._when_done(lambda: self._nvme.load(handle, entry, into))
            else:
                self._nvme.load(handle, entry, into)
        else:
            self._host.load(handle, entry, into)

    def wait(self, handle: TransferHandle) -> torch.Tensor:
        """Blocks until ``handle``'s transfer is done; may be called again.

        Returns:
            The loaded tensor for a load, the stored tensor for a store.

        Raises:
            OffloadError: whatever made the transfer fail.
        """
        return self._wait(handle, None)

    def wait_many(self, handles) -> list[torch.Tensor]:
        """`wait` of each handle, in order; the compute stream waits once for each
        distinct copy event (the loads `load_many` issued together share one)."""
        waited: set[int] = set()
        return [self._wait(handle, waited) for handle in handles]

    def _wait(self, handle: TransferHandle, waited: set[int] | None) -> torch.Tensor:
        if not handle._finished:
            start = time.perf_counter()
            handle.wait_done()
            self._recorder.stalled(start, time.perf_counter(), f"wait {handle.label}")
        if handle.forget_source:
            handle._keep = None
        if handle._error is not None:
            raise handle._error
        event = handle._cuda_event
        if event is not None and (waited is None or id(event) not in waited):
            torch.cuda.current_stream(self.device).wait_event(event)
            if waited is not None:
                waited.add(id(event))
        return handle._result

    def free(self, key: str | int) -> None:
        """Forgets ``key``; its storage is released once no transfer uses it.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
        """
        key = normalize_key(key)
        with self._ledger.lock:
            entry = self._ledger.entries.pop(key, None)
            if entry is None:
                raise UnknownKeyError("cannot free: nothing is stored under this key", key=key)
            self._ledger.retire(entry)

    def rename(self, key: str | int, new_key: str | int) -> None:
        """Moves what rests under ``key`` to ``new_key``, replacing what that held
        (released once no transfer uses it). Nothing is copied: a store under a
        staging key, renamed once written, replaces a key all at once.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
        """
        key, new_key = normalize_key(key), normalize_key(new_key)
        with self._ledger.lock:
            entry = self._ledger.entries.pop(key, None)
            if entry is None:
                raise UnknownKeyError("cannot rename: nothing is stored under this key", key=key)
            entry.key = new_key
            if entry.slot is not None:
                entry.slot.key = new_key  # errors of later reads name the key it rests under
            self._ledger.install(entry)

    def stored(self, key: str | int) -> StoredTensor:
        """Describes what rests under ``key``.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
        """
        key = normalize_key(key)
        with self._ledger.lock:
            entry = self._ledger.entries.get(key)
        if entry is None:
            raise UnknownKeyError("nothing is stored under this key", key=key)
        return StoredTensor(key, entry.tier, entry.kind, entry.shape, entry.dtype, entry.nbytes)

    def reserve(self, key: str | int, nbytes: int, tier: Tier | str) -> NvmeSlot | None:
        """Reserves room for a later store of ``nbytes`` under ``key`` onto ``tier``
        (pass it to ``store`` as ``reserved``), so that a full disk is found now,
        before anything changes, and not halfway through a set of stores.

        Returns:
            The nvme slot held for it; None where such a store writes no file.

        Raises:
            DiskFullError: no room.
        """
        key = normalize_key(key)
        if Tier(tier) is not Tier.NVME or nbytes == 0:
            return None
        return self._ledger.get_arena(key).allocate(nbytes, key)

    def unreserve(self, slot: NvmeSlot | None) -> None:
        """Gives back a reservation that no store used (a used one is left alone)."""
        arena = self._ledger.arena
        if slot is not None and not slot.valid and arena is not None:
            with self._ledger.lock:
                used = any(entry.slot is slot for entry in self._ledger.entries.values())
            if not used:
                arena.release(slot)

    def nvme_location(self, key: str | int) -> tuple[str, int, int]:
        """Where the bytes of a key on the nvme tier are: (arena file, offset, nbytes).

        Raises:
            UnknownKeyError: nothing is stored under ``key``, or not in an nvme file.
        """
        key = normalize_key(key)
        with self._ledger.lock:
            entry = self._ledger.entries.get(key)
            slot = entry.slot if entry is not None else None
        if slot is None:
            raise UnknownKeyError("nothing is stored under this key in an nvme file", key=key)
        return self._ledger.arena.file_path, slot.byte_range.offset, slot.nbytes

    def keys(self) -> list[str]:
        """The keys currently stored."""
        with self._ledger.lock:
            return list(self._ledger.entries)

    def __contains__(self, key: object) -> bool:
        try:
            key = normalize_key(key)  # type: ignore[arg-type]
        except TypeError:
            return False
        with self._ledger.lock:
            return key in self._ledger.entries

    def close(self) -> None:
        """Forgets every key and removes the nvme arena (waiting for its I/O). A later
        store starts a new arena; a load of a key it forgot raises `UnknownKeyError`
        saying so."""
        ledger = self._ledger
        with ledger.lock:
            entries = list(ledger.entries.values())
            self._closed_keys = frozenset(ledger.entries)
            ledger.entries.clear()
            for entry in entries:
                ledger.retire(entry)
            close_arena = ledger.forget_arena()
        ledger.buffers.clear()
        if close_arena is not None:
            close_arena()

    # -- sources ---------------------------------------------------------------

    def _prepare_source(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        source, copied = storable(key, tensor, self.device)
        if copied:
            log.debug("made %r contiguous before storing it (%d bytes)", key, copied)
            self._recorder.local_copy(copied)
        return source

    # -- the host tier's own memory --------------------------------------------

    def overwrite(self, key: str | int, values: torch.Tensor, kind: TransferKind | str | None = None) -> None:
        """`HostCopier.overwrite`: `values` written in place into the host memory `key`
        rests in, its address kept."""
        self._host.overwrite(key, values, kind)

    def read_host(self, key: str | int) -> torch.Tensor:
        """`HostCopier.read_host`: a copy, read on the host, of a key resting in host
        memory of its own."""
        return self._host.read_host(key)

    def load_packed(self, keys, places, packed, kind: TransferKind | str = TransferKind.WEIGHT
                    ) -> TransferHandle | None:
        """`HostCopier.load_packed`: a block visit's weights resting on a host tier that
        copies, loaded into its packed tensors as one transfer (None: not all rest so)."""
        return self._host.load_packed(keys, places, packed, kind)


def _count_pinned(recorder: Recorder, growth: HostPoolGrowth) -> None:
    recorder.host_pinned(growth.pinned_bytes)


_ENGINE: TransferEngine | None = None
# Offload directory -> its engine, one per directory named in the options, while
# something holds it: the runtime objects that store and load through it (weight
# streamers, activation stashes, gradient sinks, KV stores), the offloaded weights
# resting in it, a compile in progress. An engine nothing holds goes, and its arena
# and I/O threads with it.
_ENGINES: weakref.WeakValueDictionary[str, TransferEngine] = weakref.WeakValueDictionary()
_ENGINE_LOCK = threading.Lock()


def get_engine(offload_dir: str | None = None) -> TransferEngine:
    """The engine that holds what the options name: the one place that answers
    "which engine" for a configuration (a stored weight's engine is
    `slcompile.runtime.weights.weight_home(param)[0]`).

    The engine of an `offload_dir` is made when none is alive and lives as long as
    something holds it (the registry does not): whoever needs that same engine later
    (its keys, its arena, its pinned pool) keeps it.

    Args:
        offload_dir: the `offload_dir` option; None: the process-wide engine, made
            with the defaults on first use.
    """
    global _ENGINE
    with _ENGINE_LOCK:
        if offload_dir is not None:
            engine = _ENGINES.get(offload_dir)
            if engine is None:
                engine = _ENGINES[offload_dir] = TransferEngine(offload_dir=offload_dir)
            return engine
        if _ENGINE is None:
            _ENGINE = TransferEngine()
        return _ENGINE


def set_engine(engine: TransferEngine | None) -> TransferEngine | None:
    """Makes ``engine`` the process-wide engine (None: a default one on next use).

    Returns:
        The previous engine (not closed: the caller decides).
    """
    global _ENGINE
    with _ENGINE_LOCK:
        previous, _ENGINE = _ENGINE, engine
        return previous


def configure_engine(**options) -> TransferEngine:
    """Replaces the process-wide engine by ``TransferEngine(**options)``, closing
    the previous one.

    Returns:
        The new engine.
    """
    previous = set_engine(engine := TransferEngine(**options))
    if previous is not None:
        previous.close()
    return engine
