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
- On CUDA (not exercised on CPU machines): one persistent copy stream and events;
  host-tier tensors and nvme staging live in one pinned ``HostPool`` sized from
  the compiled plan (``reserve_host``) and grown by whole chunks; copies are
  ``non_blocking``; ``wait`` makes the current stream wait on the copy's event.
  Host copies are counted when issued.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import (
    OffloadError,
    TransferFailedError,
    UnknownKeyError,
    UnsupportedTensorError,
)
from .nvme import IoOutcome, NvmeArena, NvmeSlot, PageBufferCache, profiler_sees_buffers
from .stats import RECORDER, Recorder
from .tiers import (
    DEFAULT_CHUNK_BYTES,
    PAGE_BYTES,
    HostBlock,
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


def normalize_key(key: str | int) -> str:
    """Returns the engine's form of a key: strings as they are, ints as ``str(key)``.

    Raises:
        TypeError: for anything else (bools included).
    """
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise TypeError(f"transfer keys are str or int, got {type(key).__name__}")


@dataclass(frozen=True)
class StoredTensor:
    """What the engine knows about one key.

    Attributes:
        key: The key.
        tier: Where the tensor rests.
        kind: The kind it was stored as.
        shape: Its shape.
        dtype: Its element type.
        nbytes: Its size in bytes.
    """

    key: str
    tier: Tier
    kind: TransferKind
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


class TransferHandle:
    """One issued store or load; pass it to ``TransferEngine.wait``.

    Attributes:
        id: Unique in the process; the custom ops carry it in their token.
        key: The tensor key.
        kind: What the transfer carries.
        source: Tier the bytes come from.
        destination: Tier the bytes go to.
        nbytes: Logical size in bytes.
        direction: ``"store"`` or ``"load"``.
        zero_copy: True when nothing was copied and the result is a tensor the
            engine also holds (device tier; host tier on CPU-only machines).
    """

    __slots__ = (
        "id", "key", "kind", "source", "destination", "nbytes", "direction",
        "zero_copy", "issued", "_finished", "_event", "_error", "_result", "_cuda_event",
        "_callbacks", "_lock", "_keep", "forget_source", "__weakref__",
    )

    def __init__(self, id_, key, kind, source, destination, nbytes, direction):
        self.id = id_
        self.key = key
        self.kind = kind
        self.source = source
        self.destination = destination
        self.nbytes = nbytes
        self.direction = direction
        self.zero_copy = False
        self.issued = time.perf_counter()
        self._finished = False
        # Made by the first thread that waits while the transfer runs: most finish
        # before anyone waits (host copies are issued, not awaited, on the I/O side).
        self._event: threading.Event | None = None
        self._error: OffloadError | None = None
        self._result: torch.Tensor | None = None
        self._cuda_event = None
        self._callbacks: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._keep: object = None
        # A store that does not keep its source as its result (see `store`).
        self.forget_source = False

    @property
    def label(self) -> str:
        """``"<kind> <key> <source>-><destination>"``, as on the timeline."""
        return f"{self.kind.value} {self.key} {self.source.value}->{self.destination.value}"

    def done(self) -> bool:
        """True once the transfer finished (successfully or not)."""
        return self._finished

    def wait_done(self) -> None:
        """Blocks until the transfer finished (successfully or not)."""
        if self._finished:
            return
        with self._lock:
            if self._finished:
                return
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        event.wait()

    def _finish(self, result: torch.Tensor | None, error: OffloadError | None) -> None:
        with self._lock:
            self._result = None if self.forget_source else result
            self._error = error
            if not self.forget_source:
                # A store that forgets its source leaves `_keep` to the waiting
                # thread (`TransferEngine.wait`): released here, on an I/O thread,
                # it could be the last reference and free the source there.
                self._keep = None
            self._finished = True
            event = self._event
            callbacks, self._callbacks = self._callbacks, []
        if event is not None:
            event.set()
        for callback in callbacks:
            callback()

    def _when_done(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._finished:
                self._callbacks.append(callback)
                return
        callback()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"TransferHandle({self.direction} {self.label}, {self.nbytes} B, {state})"


class _Entry:
    """Where one key's data rests, and what still uses it."""

    __slots__ = (
        "key", "tier", "kind", "shape", "dtype", "nbytes", "slot", "tensor",
        "host_block", "store_handle", "error", "readers", "retired", "last_event",
    )

    def __init__(self, key, tier, kind, shape, dtype, nbytes):
        self.key = key
        self.tier = tier
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.slot: NvmeSlot | None = None
        self.tensor: torch.Tensor | None = None
        self.host_block: HostBlock | None = None
        self.store_handle: TransferHandle | None = None
        self.error: OffloadError | None = None
        self.readers = 0
        self.retired = False
        self.last_event = None


def _typed_view(buffer: torch.Tensor, entry: _Entry) -> torch.Tensor:
    """Views the first ``entry.nbytes`` bytes of a uint8 buffer as the entry's tensor."""
    flat = buffer[: entry.nbytes].view(entry.dtype)
    return flat.view(entry.shape)


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
        recorder: Where bytes, stalls and events are counted.
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
        self._recorder = recorder
        self._lock = threading.RLock()
        self._entries: dict[str, _Entry] = {}
        self._arena: NvmeArena | None = None
        self._host_pool: HostPool | None = None
        self._ids = itertools.count(1)
        self._buffers = PageBufferCache(buffer_cache_bytes)
        self._cuda = self.device.type == "cuda"
        # One persistent copy stream: a new stream per call would cost a sync each time.
        self._copy_stream = torch.cuda.Stream(self.device) if self._cuda else None

    # -- resources -----------------------------------------------------------

    @property
    def arena(self) -> NvmeArena:
        """The nvme arena, created on first use."""
        return self._get_arena(None)

    @property
    def has_arena(self) -> bool:
        """True once the nvme arena exists."""
        return self._arena is not None

    def _get_arena(self, key: str | None) -> NvmeArena:
        with self._lock:
            if self._arena is None:
                try:
                    self._arena = NvmeArena(
                        self.offload_dir,
                        capacity_bytes=self.capacity_bytes,
                        chunk_bytes=self.chunk_bytes,
                        num_threads=self.num_io_threads,
                        checksums=self.checksums,
                    )
                except OffloadError as error:
                    raise (error.with_key(key) if key is not None else error) from error
            return self._arena

    def _pool(self) -> HostPool:
        with self._lock:
            if self._host_pool is None:
                self._host_pool = HostPool(
                    pin=True, chunk_bytes=self.host_chunk_bytes, limit_bytes=self.host_memory,
                    on_growth=lambda growth: self._recorder.host_pinned(growth.added_bytes),
                )
            return self._host_pool

    @property
    def host_pool(self) -> HostPool | None:
        """The pinned host pool, once something was reserved or stored in it."""
        return self._host_pool

    def reserve_host(
        self, nbytes: int, *, largest: int = 0, what: str = "the plan", host_memory: int | None = None
    ) -> HostPoolGrowth | None:
        """Sizes the pinned host pool for a compiled plan: ``nbytes`` more bytes free.

        Nothing is pinned on a CPU-only machine, where the host tier copies nothing.

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
        if not self._cuda or nbytes <= 0:
            return None
        pool = self._pool()
        if host_memory is not None:
            self.host_memory = host_memory
            pool.limit_bytes = host_memory
        return pool.reserve(nbytes, largest=largest, what=what)

    def host_bytes_of(self, keys) -> int:
        """Bytes of the given keys that rest on the host tier now (unknown keys: 0)."""
        with self._lock:
            entries = (self._entries.get(normalize_key(key)) for key in keys)
            return sum(e.nbytes for e in entries if e is not None and e.tier is Tier.HOST)

    def copies_nothing(self, source: Tier | str, destination: Tier | str) -> bool:
        """True when a move between the two tiers keeps the same memory: the same
        tier, or host and device on a CPU-only machine (host memory is device memory).
        """
        source, destination = Tier(source), Tier(destination)
        if source is destination:
            return True
        return not self._cuda and {source, destination} <= {Tier.DEVICE, Tier.HOST}

    def tier_of(self, tensor: torch.Tensor) -> Tier:
        """The tier a tensor's memory belongs to: device if on the compute device,
        else host."""
        return Tier.DEVICE if tensor.device.type == self.device.type else Tier.HOST

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
        tier, kind = Tier(tier), TransferKind(kind)
        source = self._prepare_source(key, tensor)
        nbytes = source.numel() * source.element_size()
        source_tier = self.tier_of(source)
        handle = TransferHandle(next(self._ids), key, kind, source_tier, tier, nbytes, "store")
        handle.forget_source = forget_source
        entry = _Entry(key, tier, kind, tuple(source.shape), source.dtype, nbytes)
        if self.copies_nothing(source_tier, tier):
            entry.tensor = source
            handle.zero_copy = True
            self._recorder.resident_change(tier, nbytes)
            self._install(entry)
            handle._finish(source, None)
        elif tier is Tier.NVME:
            self._store_nvme(handle, entry, source, reserved)
        elif tier is Tier.HOST:
            self._store_host_cuda(handle, entry, source)
        else:
            self._store_device_cuda(handle, entry, source)
        return handle

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

    @property
    def batches_loads(self) -> bool:
        """Whether `load_many` issues loads together at a lower cost than one by one:
        on a CUDA machine, the host tier's copies share one switch to the copy stream
        and one event."""
        return self._cuda

    def load_many(self, keys, kind: TransferKind | str | None = None) -> list[TransferHandle]:
        """Issues loads of `keys` (as `load` does, in order) together: on a CUDA
        machine the host tier's copies go to the copy stream in one switch and are
        awaited by one event; other loads are issued one by one.

        Raises:
            UnknownKeyError, TransferFailedError: as `load` (the loads of the keys
                before the failing one are issued).
        """
        started: list[tuple[TransferHandle, _Entry | None, TransferHandle | None]] = []
        try:
            for key in keys:
                started.append(self._start_load(key, kind, None))
        finally:
            together = []
            for handle, entry, pending_store in started:
                if entry is None:
                    continue
                if self._cuda and entry.tier is Tier.HOST and entry.host_block is not None:
                    together.append((handle, entry))
                else:
                    self._dispatch_load(handle, entry, pending_store, None)
            if together:
                self._load_host_cuda_together(together)
        return [handle for handle, _, _ in started]

    def _start_load(self, key, kind, into) -> tuple[TransferHandle, _Entry | None, TransferHandle | None]:
        """(the load's handle, its entry or None when it finished without copying,
        the store it must follow)."""
        key = normalize_key(key)
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                raise UnknownKeyError("nothing is stored under this key", key=key)
            if entry.error is not None:
                raise TransferFailedError(
                    f"the last store of this key failed ({entry.error.reason})",
                    key=key, path=entry.error.path,
                )
            kind = TransferKind(kind) if kind is not None else entry.kind
            handle = TransferHandle(
                next(self._ids), key, kind, entry.tier, Tier.DEVICE, entry.nbytes, "load"
            )
            if entry.tensor is not None and self.copies_nothing(entry.tier, Tier.DEVICE):
                handle.zero_copy = True
                handle._finish(entry.tensor, None)
                return handle, None, None
            if into is not None and not self._cuda and into.data_ptr() % PAGE_BYTES:
                raise ValueError(f"load of {key!r} into a tensor that does not start on a page: on a CPU machine "
                                 "O_DIRECT reads need page-aligned memory; pass a view of a page-aligned buffer "
                                 "(PageBufferCache.tensor) or leave into=None")
            entry.readers += 1
            return handle, entry, entry.store_handle

    def _dispatch_load(self, handle, entry, pending_store, into) -> None:
        if entry.tier is Tier.NVME:
            if pending_store is not None:
                # Read only what the store wrote: start after its last chunk landed.
                pending_store._when_done(lambda: self._load_nvme(handle, entry, into))
            else:
                self._load_nvme(handle, entry, into)
        else:
            self._load_host_cuda(handle, entry, into)

    def wait(self, handle: TransferHandle) -> torch.Tensor:
        """Blocks until ``handle``'s transfer is done; may be called again.

        Returns:
            The loaded tensor for a load, the stored tensor for a store.

        Raises:
            OffloadError: whatever made the transfer fail.
        """
        if not handle._finished:
            start = time.perf_counter()
            handle.wait_done()
            self._recorder.stalled(start, time.perf_counter(), f"wait {handle.label}")
        if handle.forget_source:
            handle._keep = None
        if handle._error is not None:
            raise handle._error
        if handle._cuda_event is not None:
            torch.cuda.current_stream(self.device).wait_event(handle._cuda_event)
        return handle._result

    def free(self, key: str | int) -> None:
        """Forgets ``key``; its storage is released once no transfer uses it.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
        """
        key = normalize_key(key)
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                raise UnknownKeyError("cannot free: nothing is stored under this key", key=key)
            self._retire(entry)

    def rename(self, key: str | int, new_key: str | int) -> None:
        """Moves what rests under ``key`` to ``new_key``, replacing what that held
        (released once no transfer uses it). Nothing is copied: a store under a
        staging key, renamed once written, replaces a key all at once.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
        """
        key, new_key = normalize_key(key), normalize_key(new_key)
        with self._lock:
            entry = self._entries.pop(key, None)
            if entry is None:
                raise UnknownKeyError("cannot rename: nothing is stored under this key", key=key)
            entry.key = new_key
            if entry.slot is not None:
                entry.slot.key = new_key  # errors of later reads name the key it rests under
            self._install(entry)

    def stored(self, key: str | int) -> StoredTensor:
        """Describes what rests under ``key``.

        Raises:
            UnknownKeyError: nothing is stored under ``key``.
        """
        key = normalize_key(key)
        with self._lock:
            entry = self._entries.get(key)
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
        return self._get_arena(key).allocate(nbytes, key)

    def unreserve(self, slot: NvmeSlot | None) -> None:
        """Gives back a reservation that no store used (a used one is left alone)."""
        if slot is not None and not slot.valid and self._arena is not None:
            with self._lock:
                used = any(entry.slot is slot for entry in self._entries.values())
            if not used:
                self._arena.release(slot)

    def nvme_location(self, key: str | int) -> tuple[str, int, int]:
        """Where the bytes of a key on the nvme tier are: (arena file, offset, nbytes).

        Raises:
            UnknownKeyError: nothing is stored under ``key``, or not in an nvme file.
        """
        key = normalize_key(key)
        with self._lock:
            entry = self._entries.get(key)
            slot = entry.slot if entry is not None else None
        if slot is None:
            raise UnknownKeyError("nothing is stored under this key in an nvme file", key=key)
        return self._arena.file_path, slot.byte_range.offset, slot.nbytes

    def keys(self) -> list[str]:
        """The keys currently stored."""
        with self._lock:
            return list(self._entries)

    def __contains__(self, key: object) -> bool:
        try:
            key = normalize_key(key)  # type: ignore[arg-type]
        except TypeError:
            return False
        with self._lock:
            return key in self._entries

    def close(self) -> None:
        """Forgets every key and removes the nvme arena (waiting for its I/O)."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
            for entry in entries:
                self._retire(entry)
            arena, self._arena = self._arena, None
        self._buffers.clear()
        if arena is not None:
            arena.close()

    # -- sources ---------------------------------------------------------------

    def _prepare_source(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        def refuse(reason: str) -> UnsupportedTensorError:
            return UnsupportedTensorError(f"cannot transfer this tensor: {reason}", key=key)

        if not isinstance(tensor, torch.Tensor):
            raise refuse(f"expected a torch.Tensor, got {type(tensor).__name__}")
        if type(tensor) not in (torch.Tensor, torch.nn.Parameter):
            raise refuse(f"tensor subclass {type(tensor).__name__} has no plain storage to move")
        if tensor.is_nested:
            raise refuse("nested tensors are not supported")
        if tensor.layout is not torch.strided:
            raise refuse(f"layout {tensor.layout} is not supported; only dense strided tensors")
        if tensor.is_quantized:
            raise refuse("quantized tensors are not supported")
        if tensor.device.type == "meta":
            raise refuse("meta tensors have no data")
        if tensor.device.type not in ("cpu", self.device.type):
            raise refuse(f"device {tensor.device} is neither the compute device nor the host")
        # A tensor of a compiled graph needs no detach, a dispatched op on the hot path.
        source = tensor.detach() if tensor.requires_grad or type(tensor) is not torch.Tensor else tensor
        copied = False
        if source.is_conj() or source.is_neg():
            source = source.resolve_conj().resolve_neg()
            copied = True
        if not source.is_contiguous():
            source = source.contiguous()
            copied = True
        if copied:
            nbytes = source.numel() * source.element_size()
            log.debug("made %r contiguous before storing it (%d bytes)", key, nbytes)
            self._recorder.local_copy(nbytes)
        return source

    # -- bookkeeping -----------------------------------------------------------

    def _install(self, entry: _Entry) -> None:
        with self._lock:
            old = self._entries.get(entry.key)
            self._entries[entry.key] = entry
            if old is not None:
                self._retire(old)

    def _retire(self, entry: _Entry) -> None:
        with self._lock:
            entry.retired = True
            self._release_if_unused(entry)

    def _release_if_unused(self, entry: _Entry) -> None:
        with self._lock:
            if not entry.retired or entry.readers > 0:
                return
            if entry.store_handle is not None and not entry.store_handle.done():
                return
            slot, entry.slot = entry.slot, None
            tensor, entry.tensor = entry.tensor, None
            block, entry.host_block = entry.host_block, None
            event, entry.last_event = entry.last_event, None
        if slot is not None and not slot.released:
            self._arena.release(slot)
            self._recorder.resident_change(Tier.NVME, -entry.nbytes)
        if tensor is not None:
            self._recorder.resident_change(entry.tier, -entry.nbytes)
        if block is not None:
            if event is not None:
                event.synchronize()
            self._host_pool.release(block)
            self._recorder.resident_change(Tier.HOST, -entry.nbytes)

    def _fail_entry(self, entry: _Entry, error: OffloadError) -> None:
        with self._lock:
            entry.error = error
            slot, entry.slot = entry.slot, None
        if slot is not None:
            self._arena.release(slot)
            self._recorder.resident_change(Tier.NVME, -entry.nbytes)

    def _track_delivered(self, owner: object, tier: Tier, nbytes: int) -> None:
        self._recorder.resident_change(tier, nbytes)
        weakref.finalize(owner, self._recorder.resident_change, tier, -nbytes)

    # -- nvme ------------------------------------------------------------------

    def _store_nvme(self, handle: TransferHandle, entry: _Entry, source: torch.Tensor,
                    reserved: NvmeSlot | None = None) -> None:
        arena = self._get_arena(handle.key)
        if entry.nbytes == 0:
            self._install(entry)
            now = time.perf_counter()
            self._recorder.transfer_finished(
                (handle.kind, handle.source, Tier.NVME), 0, now, now, "store", handle.label
            )
            handle._finish(source, None)
            return
        if reserved is not None and reserved.nbytes == entry.nbytes and not reserved.released:
            slot = reserved
            slot.key = handle.key
        else:
            if reserved is not None:
                arena.release(reserved)
            slot = arena.allocate(entry.nbytes, handle.key)
        entry.slot = slot
        entry.store_handle = handle
        handle._keep = source
        self._recorder.resident_change(Tier.NVME, entry.nbytes)
        before = None
        block = None
        if source.device.type == "cuda":
            block = self._pool().allocate(slot.byte_range.size, handle.key)
            event = self._copy_to_host(source, block, entry)
            handle._cuda_event = event
            before = event.synchronize
            address, readable = block.buffer.data_ptr(), block.byte_range.size
        else:
            address = source.data_ptr()
            readable = source.untyped_storage().nbytes() - (
                source.storage_offset() * source.element_size()
            )
        self._install(entry)

        # The I/O thread reaches the source only through `handle._keep`: no frame of
        # its own may hold it once the waiting thread wakes (see `_finish`).
        def on_done(outcome: IoOutcome) -> None:
            if block is not None:
                self._host_pool.release(block)
            self._store_nvme_done(handle, entry, outcome)

        try:
            arena.write(slot, address, readable, on_done,
                        on_start=lambda now: self._recorder.lane_begin("store", now),
                        before=before)
        except OffloadError as error:
            if block is not None:
                self._host_pool.release(block)
            self._fail_entry(entry, error)
            handle._finish(None, error)
            raise

    def _store_nvme_done(self, handle, entry, outcome: IoOutcome) -> None:
        if outcome.start is not None:
            self._recorder.lane_end("store", outcome.end)
        if outcome.error is not None:
            log.warning("store of %r failed: %s", handle.key, outcome.error)
            self._fail_entry(entry, outcome.error)
            handle._finish(None, outcome.error)
        else:
            self._recorder.transfer_finished(
                (handle.kind, handle.source, Tier.NVME), handle.nbytes,
                outcome.start, outcome.end, "store", handle.label,
            )
            handle._finish(None if handle.forget_source else handle._keep, None)
        with self._lock:
            # A finished store's handle holds its source: the entry keeps only the slot,
            # or an entry resting on nvme would hold its tensor in memory as well.
            if entry.store_handle is handle:
                entry.store_handle = None
        self._release_if_unused(entry)

    def _load_nvme(self, handle: TransferHandle, entry: _Entry, into: torch.Tensor | None = None) -> None:
        # May run on an I/O thread (chained after a store): report errors, never raise.
        try:
            if entry.error is not None:
                raise TransferFailedError(
                    f"the store this load waited for failed ({entry.error.reason})",
                    key=handle.key, path=entry.error.path,
                )
            if entry.nbytes == 0:
                result = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                now = time.perf_counter()
                self._recorder.transfer_finished(
                    (handle.kind, Tier.NVME, Tier.DEVICE), 0, now, now, "load", handle.label
                )
                self._load_finished(handle, entry, result, None)
                return
            slot = entry.slot
            if self._cuda:
                result = into
                if result is None:
                    result = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                    self._track_delivered(result, Tier.DEVICE, entry.nbytes)
                block = self._pool().allocate(slot.byte_range.size, handle.key)
                address, writable = block.buffer.data_ptr(), block.byte_range.size
            elif into is None and not profiler_sees_buffers():
                self._load_nvme_new(handle, entry)
                return
            else:
                block = None
                if into is not None:
                    result = into
                else:
                    nbytes = entry.nbytes
                    self._recorder.resident_change(Tier.DEVICE, nbytes)
                    result = self._buffers.tensor(
                        nbytes, entry.dtype, entry.shape,
                        on_release=lambda: self._recorder.resident_change(Tier.DEVICE, -nbytes),
                    )
                storage = result.untyped_storage()
                address = result.data_ptr()
                writable = storage.nbytes() - (address - storage.data_ptr())

            def on_done(outcome: IoOutcome) -> None:
                if outcome.start is not None:
                    self._recorder.lane_end("load", outcome.end)
                error = outcome.error
                if error is None and block is not None:
                    self._copy_from_host(result, block, entry, wait=True)
                if block is not None:
                    self._host_pool.release(block)
                if error is None:
                    self._recorder.transfer_finished(
                        (handle.kind, Tier.NVME, Tier.DEVICE), handle.nbytes,
                        outcome.start, outcome.end, "load", handle.label,
                    )
                self._load_finished(handle, entry, None if error else result, error)

            self._arena.read(slot, address, writable, on_done,
                             on_start=lambda now: self._recorder.lane_begin("load", now))
        except OffloadError as error:
            self._load_finished(handle, entry, None, error)
        except Exception as error:  # noqa: BLE001 - must reach the waiting thread
            self._load_finished(
                handle, entry, None,
                TransferFailedError(f"load could not start: {error!r}", key=handle.key),
            )

    def _load_nvme_new(self, handle: TransferHandle, entry: _Entry) -> None:
        """A load on a CPU machine into new page-aligned memory, made on the I/O
        thread that reads it: issuing costs the compute thread no tensor and no
        system call (`NvmeArena.read_new`)."""
        # Residency is counted from the issue, as the memory model counts a load, and
        # lasts as long as the memory does, not as long as the handle. The release
        # callback lives as long as the memory and must not reach the entry: a state
        # loaded here and stored again would keep, through it, every earlier
        # generation of that state alive.
        nbytes, dtype, shape, recorder = entry.nbytes, entry.dtype, entry.shape, self._recorder
        recorder.resident_change(Tier.DEVICE, nbytes)
        made: list[torch.Tensor] = []

        def make_destination() -> torch.Tensor:
            tensor = self._buffers.tensor(
                nbytes, dtype, shape, on_release=lambda: recorder.resident_change(Tier.DEVICE, -nbytes))
            made.append(tensor)
            return tensor

        def on_done(outcome: IoOutcome) -> None:
            if outcome.start is not None:
                recorder.lane_end("load", outcome.end)
            if not made:  # failed before its memory was made
                recorder.resident_change(Tier.DEVICE, -nbytes)
            error = outcome.error
            if error is None:
                recorder.transfer_finished((handle.kind, Tier.NVME, Tier.DEVICE), handle.nbytes,
                                           outcome.start, outcome.end, "load", handle.label)
            self._load_finished(handle, entry, None if error else made[0], error)

        try:
            self._arena.read_new(entry.slot, make_destination, on_done,
                                 on_start=lambda now: recorder.lane_begin("load", now))
        except BaseException:
            recorder.resident_change(Tier.DEVICE, -nbytes)
            raise

    def _load_finished(self, handle, entry, result, error) -> None:
        with self._lock:
            entry.readers -= 1
        self._release_if_unused(entry)
        handle._finish(result, error)

    # -- CUDA host and device copies --------------------------------------------

    def _copy_to_host(self, source: torch.Tensor, block: HostBlock, entry: _Entry):
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            _typed_view(block.buffer, entry).copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        return event

    def _copy_from_host(self, result: torch.Tensor, block: HostBlock, entry: _Entry,
                        *, wait: bool):
        stream = self._copy_stream
        with torch.cuda.stream(stream):
            result.copy_(_typed_view(block.buffer, entry), non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        if wait:
            event.synchronize()
        return event

    def _store_host_cuda(self, handle, entry, source) -> None:
        block = self._pool().allocate(entry.nbytes, handle.key)
        self._recorder.resident_change(Tier.HOST, entry.nbytes)
        event = self._copy_to_host(source, block, entry)
        entry.host_block, entry.last_event = block, event
        handle._cuda_event = event
        self._install(entry)
        now = time.perf_counter()
        self._recorder.transfer_finished(
            (handle.kind, handle.source, Tier.HOST), entry.nbytes, now, now, "store", handle.label
        )
        handle._finish(source, None)

    def _store_device_cuda(self, handle, entry, source) -> None:
        # Allocated on the compute stream, which is where it will be used and freed.
        result = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
        stream = self._copy_stream
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            result.copy_(source, non_blocking=True)
            event = torch.cuda.Event()
            event.record(stream)
        entry.tensor = result
        handle._cuda_event = event
        self._recorder.resident_change(Tier.DEVICE, entry.nbytes)
        self._install(entry)
        now = time.perf_counter()
        self._recorder.transfer_finished(
            (handle.kind, handle.source, Tier.DEVICE), entry.nbytes, now, now, "store",
            handle.label,
        )
        handle._finish(result, None)

    def _load_host_cuda(self, handle, entry, into=None) -> None:
        try:
            result = into
            if result is None:
                # Allocated on the compute stream, which is where it will be used and freed.
                result = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                self._track_delivered(result, Tier.DEVICE, entry.nbytes)
            stream = self._copy_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            if entry.host_block is not None:
                event = self._copy_from_host(result, entry.host_block, entry, wait=False)
            else:
                with torch.cuda.stream(stream):
                    result.copy_(entry.tensor, non_blocking=True)
                    event = torch.cuda.Event()
                    event.record(stream)
            entry.last_event = event
            handle._cuda_event = event
            now = time.perf_counter()
            self._recorder.transfer_finished(
                (handle.kind, Tier.HOST, Tier.DEVICE), entry.nbytes, now, now, "load",
                handle.label,
            )
            self._load_finished(handle, entry, result, None)
        except OffloadError as error:
            self._load_finished(handle, entry, None, error)
            raise


    def _load_host_cuda_together(self, loads: list[tuple[TransferHandle, _Entry]]) -> None:
        """Host-tier loads of pinned blocks onto the device, issued as one: each
        result allocated on the compute stream, then one wait of the copy stream for
        it, every copy, and one event that all the loads' waits wait on."""
        results = []
        try:
            for _, entry in loads:
                result = torch.empty(entry.shape, dtype=entry.dtype, device=self.device)
                self._track_delivered(result, Tier.DEVICE, entry.nbytes)
                results.append(result)
            stream = self._copy_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(stream):
                for (_, entry), result in zip(loads, results):
                    result.copy_(_typed_view(entry.host_block.buffer, entry), non_blocking=True)
                event = torch.cuda.Event()
                event.record(stream)
        except Exception as error:  # noqa: BLE001 - every load must finish
            failure = error if isinstance(error, OffloadError) else \
                TransferFailedError(f"load could not start: {error!r}", key=loads[0][0].key)
            for handle, entry in loads:
                self._load_finished(handle, entry, None, failure)
            raise failure from error
        now = time.perf_counter()
        for (handle, entry), result in zip(loads, results):
            entry.last_event = event
            handle._cuda_event = event
            self._recorder.transfer_finished(
                (handle.kind, Tier.HOST, Tier.DEVICE), entry.nbytes, now, now, "load", handle.label,
            )
            self._load_finished(handle, entry, result, None)


_ENGINE: TransferEngine | None = None
# Offload directory -> its engine: one per directory named in the options, for the
# life of the process (one arena, one set of I/O threads each).
_ENGINES: dict[str, TransferEngine] = {}
_ENGINE_LOCK = threading.Lock()


def get_engine(offload_dir: str | None = None) -> TransferEngine:
    """The engine that holds what the options name: the one place that answers
    "which engine" for a configuration (a stored weight's engine is
    `slcompile.runtime.weights.weight_home(param)[0]`).

    Args:
        offload_dir: the `offload_dir` option; None: the process-wide engine, made
            with the defaults on first use.
    """
    global _ENGINE
    with _ENGINE_LOCK:
        if offload_dir is not None:
            if offload_dir not in _ENGINES:
                _ENGINES[offload_dir] = TransferEngine(offload_dir=offload_dir)
            return _ENGINES[offload_dir]
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
