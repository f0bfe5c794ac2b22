"""Memory tiers, transfer kinds, and the pinned host pool.

Where it sits: the vocabulary of the runtime. The planner assigns each value a
``Tier``; the transfer engine moves values between tiers and counts bytes per
``TransferKind``.

Guarantees:
- ``device`` is where compute runs: the CUDA device when one is present, else
  the CPU.
- ``host`` is pinned RAM on a CUDA machine, handed out from one ``HostPool``
  sized from the compiled plan, allocated in chunks once and reused (pinning on
  the fly forces synchronisations); it grows by whole chunks only when a tensor
  the plan did not foresee finds no room, and ``host_memory`` caps it. Each chunk
  is page-aligned memory of its own, pinned at exactly its size with
  ``cudaHostRegister`` (torch's pinned allocator rounds a request up to a power of
  two), so the bytes the pool books are the bytes pinned; a growth that would pin
  more than the machine or its cgroup has available is refused before anything is
  pinned (``slcompile.runtime.storage.memory_limits``).
  On a CPU-only machine ``host`` *is* the device's memory: the engine moves
  nothing for it and counts zero bytes.
- ``nvme`` is the O_DIRECT arena of ``slcompile.runtime.storage.nvme``; it has no torch
  device of its own (data passes through host or device buffers).
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import logging
import mmap
import threading
import time
import weakref
from collections.abc import Callable

import torch

from ..errors import HostPoolFullError
from ..finalizing import when_safe
from .memory_limits import AvailableMemory, available_host_memory
from .ranges import ByteRange, RangeAllocator, round_up

__all__ = [
    "Tier",
    "TransferKind",
    "PAGE_BYTES",
    "compute_device",
    "device_for",
    "host_is_device",
    "HostPool",
    "HostBlock",
    "HostPoolGrowth",
    "ChunkAllocator",
    "AvailableMemoryReader",
    "DEFAULT_CHUNK_BYTES",
    "HOST_MEMORY_OPTION",
    "pinned_chunk",
    "pageable_chunk",
]

log = logging.getLogger(__name__)

# O_DIRECT wants buffer addresses, file offsets and lengths aligned to the logical
# block size (512 here); the page size satisfies every device seen in practice.
PAGE_BYTES = 4096


class Tier(str, enum.Enum):
    """Where a tensor rests between uses."""

    DEVICE = "device"
    HOST = "host"
    NVME = "nvme"


class TransferKind(str, enum.Enum):
    """What a transfer carries; byte counters are kept per kind."""

    WEIGHT = "weight"
    ACTIVATION = "activation"
    GRADIENT = "gradient"
    OPTIMIZER_STATE = "optimizer_state"
    KV = "kv"
    # Collectives between ranks (`slcompile.runtime.collectives`): bytes received
    # from the other ranks, keyed device->device.
    ALL_GATHER = "all_gather"
    REDUCE_SCATTER = "reduce_scatter"
    ALL_REDUCE = "all_reduce"


def compute_device() -> torch.device:
    """Returns the device compute runs on: the current CUDA device, else the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def host_is_device() -> bool:
    """True when the host tier is the device's own memory (a CPU-only machine)."""
    return compute_device().type == "cpu"


def device_for(tier: Tier | str) -> torch.device:
    """Returns the torch device whose memory holds tensors resting on ``tier``.

    Args:
        tier: A tier or its name.

    Returns:
        The compute device for ``device``; the CPU for ``host``.

    Raises:
        ValueError: for ``nvme``, which is a file arena, not a torch device.
    """
    tier = Tier(tier)
    if tier is Tier.DEVICE:
        return compute_device()
    if tier is Tier.HOST:
        return torch.device("cpu")
    raise ValueError("the nvme tier is a file arena and has no torch device")


ChunkAllocator = Callable[[int], torch.Tensor]
"""Returns a uint8 CPU tensor of at least the given number of bytes (pinned on a CUDA
machine). The pool asks for a chunk's size and, when the memory returned does not
start on a page, asks once more for a page more to align in."""

AvailableMemoryReader = Callable[[], AvailableMemory | None]
"""Returns the host memory the process can still take (None: no limit known)."""

DEFAULT_CHUNK_BYTES = 256 << 20
"""Largest piece the host pool pins at once: pinning gigabytes in one call is slow
and fails more often than pinning the same bytes in pieces."""

HOST_MEMORY_OPTION = "host_memory"
"""The option that caps the host pool, named in every error about its size."""


def pinned_chunk(nbytes: int) -> torch.Tensor:
    """Allocates ``nbytes`` (whole pages) of page-aligned host memory and pins exactly
    that with ``cudaHostRegister``; torch's own pinned allocator would round the
    request up to a power of two (256 MiB and a page pin 512 MiB).

    The memory is unpinned, then unmapped, once the last tensor on it is gone.

    Raises:
        RuntimeError: CUDA did not pin it; the message is CUDA's.
    """
    mapping = _private_pages(nbytes)
    owner = (ctypes.c_char * nbytes).from_buffer(mapping)
    address = ctypes.addressof(owner)
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostRegister(address, nbytes, 0)
    if status != cudart.cudaError.success:
        _clear_cuda_error()
        raise RuntimeError(f"cudaHostRegister of {nbytes} bytes failed: {cudart.cudaGetErrorString(status)}")
    # The mapping rides with the finalizer: deferred out of a garbage collection, the
    # unregistering must still find the memory mapped. At exit the process's end
    # unpins everything, with no CUDA call into a runtime shutting down.
    weakref.finalize(owner, when_safe, _unpin, address, mapping).atexit = False
    return torch.frombuffer(owner, dtype=torch.uint8)


def pageable_chunk(nbytes: int) -> torch.Tensor:
    """Allocates ``nbytes`` of ordinary page-aligned host memory (the allocator of
    tests and of CPU-only machines, where nothing is copied to a device)."""
    return torch.frombuffer(_private_pages(nbytes), dtype=torch.uint8)


def _private_pages(nbytes: int) -> mmap.mmap:
    # Private: mmap.mmap(-1, n) alone maps shared memory, which the kernel counts as page cache.
    return mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


def _unpin(address: int, mapping: mmap.mmap) -> None:
    """Unregisters a ``pinned_chunk``; ``mapping`` is unmapped when this, its last
    reference, lets it go."""
    cudart = torch.cuda.cudart()
    status = cudart.cudaHostUnregister(address)
    if status != cudart.cudaError.success:
        _clear_cuda_error()
        log.warning("cudaHostUnregister of %d bytes failed: %s", len(mapping), cudart.cudaGetErrorString(status))


def _clear_cuda_error() -> None:
    # A failed runtime call stays the thread's last CUDA error, which torch's next
    # kernel launch check would raise as its own; torch.cuda.cudart() binds no
    # cudaGetLastError, so a launch here takes it.
    with contextlib.suppress(RuntimeError):
        torch.zeros(1, device=compute_device())


class HostBlock:
    """One range of one host pool chunk, with a uint8 tensor view over its bytes.

    Attributes:
        byte_range: Offset and size inside the chunk.
        buffer: uint8 CPU tensor of ``byte_range.size`` bytes, page-aligned.
        chunk: Index of the chunk the range belongs to.
    """

    __slots__ = ("byte_range", "buffer", "chunk")

    def __init__(self, byte_range: ByteRange, buffer: torch.Tensor, chunk: int = 0):
        self.byte_range = byte_range
        self.buffer = buffer
        self.chunk = chunk


class _Chunk:
    """One allocation of the pool: its page-aligned bytes and their free ranges.

    ``storage`` is what the allocator returned (``nbytes`` from its first page
    boundary on), and owns the memory.
    """

    __slots__ = ("storage", "base", "ranges")

    def __init__(self, storage: torch.Tensor, nbytes: int):
        # Page-align the start so every block is usable as an O_DIRECT buffer.
        start = (-storage.data_ptr()) % PAGE_BYTES
        self.storage = storage
        self.base = storage[start : start + nbytes]
        self.ranges = RangeAllocator(nbytes, PAGE_BYTES)


@dataclasses.dataclass(frozen=True)
class HostPoolGrowth:
    """What one growth of the host pool pinned.

    Attributes:
        added_bytes: Usable bytes added (page multiples).
        chunk_bytes: The size of each chunk added, in order.
        pinned_bytes: Bytes pinned for them (0 when the pool does not pin): the
            allocators' sizes, equal to ``added_bytes`` unless an allocator returned
            memory off a page boundary and a spare page was taken to align it.
        seconds: Wall time the allocation took.
        capacity_bytes: The pool's capacity afterwards.
        reason: Why it grew ("plan" or "demand").
    """

    added_bytes: int
    chunk_bytes: tuple[int, ...]
    pinned_bytes: int
    seconds: float
    capacity_bytes: int
    reason: str


class HostPool:
    """Host memory, allocated in chunks and handed out in page-aligned ranges.

    Every host-tier tensor and every nvme staging buffer on a CUDA machine lives
    here, so no transfer pins memory on the fly. The pool is sized from the
    compiled plan (``reserve``): it pins what the plan will hold on the host, in
    chunks of at most ``chunk_bytes``, once. A request that still finds no free
    range (a tensor the plan did not foresee) grows the pool by one more chunk;
    a chunk is never given back while the pool lives, so a steady schedule pins
    nothing after its first step.

    A pinned chunk is page-aligned memory of exactly its size, registered with
    ``cudaHostRegister`` (``pinned_chunk``), so ``pinned_bytes`` (and what each
    growth reports) is the memory really pinned, not a power of two above it.
    Before a growth pins anything it is checked against ``available_memory``: a
    growth larger than what the machine or its cgroup can still give raises
    ``HostPoolFullError`` instead of inviting the OOM killer.

    Args:
        capacity_bytes: Bytes to allocate up front (0: none until needed).
        pin: Whether the chunks are pinned (default: when CUDA is available and
            ``allocate_chunk`` is not given): the default allocator pins with
            ``cudaHostRegister``; with ``allocate_chunk``, says whether that
            allocator pins.
        chunk_bytes: The largest chunk allocated at once; a single tensor larger
            than this gets a chunk of its own size.
        limit_bytes: The most the pool may hold (the ``host_memory`` option);
            None: no cap.
        allocate_chunk: Allocates one chunk (default: pinned or pageable by
            ``pin``); tests pass a CPU allocator to check the sizing exactly.
        on_growth: Called with each ``HostPoolGrowth`` (the engine counts pinned
            bytes in the runtime stats).
        available_memory: Reads the host memory the process can still take,
            before each growth (default: ``available_host_memory`` when the pool
            pins, else no check).

    Raises:
        HostPoolFullError: the up-front capacity is over ``limit_bytes`` or over
            what is available, or could not be allocated.
    """

    def __init__(
        self,
        capacity_bytes: int = 0,
        *,
        pin: bool | None = None,
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
        limit_bytes: int | None = None,
        allocate_chunk: ChunkAllocator | None = None,
        on_growth: Callable[[HostPoolGrowth], None] | None = None,
        available_memory: AvailableMemoryReader | None = None,
    ):
        if chunk_bytes < PAGE_BYTES:
            raise ValueError(f"chunk_bytes must be at least one page ({PAGE_BYTES}), got {chunk_bytes}")
        if pin is None:
            pin = allocate_chunk is None and torch.cuda.is_available()
        if allocate_chunk is None:
            allocate_chunk = pinned_chunk if pin else pageable_chunk
        if available_memory is None and pin:
            available_memory = available_host_memory
        self.pinned = bool(pin)
        self.chunk_bytes = round_up(chunk_bytes, PAGE_BYTES)
        self.limit_bytes = limit_bytes
        self.growths: list[HostPoolGrowth] = []
        self._allocate_chunk = allocate_chunk
        self._on_growth = on_growth
        self._available_memory = available_memory
        self._chunks: list[_Chunk] = []
        self._lock = threading.Lock()
        if capacity_bytes:
            self.reserve(capacity_bytes)

    @property
    def limit_bytes(self) -> int | None:
        """The most the pool may hold, in whole pages (None: no cap)."""
        return self._limit_bytes

    @limit_bytes.setter
    def limit_bytes(self, value: int | None) -> None:
        self._limit_bytes = None if value is None else round_up(value, PAGE_BYTES)

    @property
    def capacity_bytes(self) -> int:
        """Usable bytes allocated so far (page multiples)."""
        return sum(chunk.ranges.capacity for chunk in self._chunks)

    @property
    def used_bytes(self) -> int:
        """Bytes currently handed out (rounded to pages)."""
        return sum(chunk.ranges.used_bytes for chunk in self._chunks)

    @property
    def free_bytes(self) -> int:
        """Bytes allocated and not handed out (possibly in several ranges)."""
        return self.capacity_bytes - self.used_bytes

    @property
    def pinned_bytes(self) -> int:
        """Bytes pinned for the chunks: the sizes their allocator registered (0 when
        the pool does not pin)."""
        return sum(chunk.storage.numel() for chunk in self._chunks) if self.pinned else 0

    @property
    def chunk_sizes(self) -> tuple[int, ...]:
        """The usable size of each chunk, in allocation order."""
        return tuple(chunk.ranges.capacity for chunk in self._chunks)

    def reserve(self, nbytes: int, *, largest: int = 0, what: str = "the plan") -> HostPoolGrowth | None:
        """Grows the pool until ``nbytes`` more bytes are free, in chunks, at once.

        Args:
            nbytes: Bytes the caller will hold on the host (rounded up to pages).
            largest: The largest single tensor among them: no chunk is smaller.
            what: Who needs the bytes, for the error message.

        Returns:
            What was added, or None when the pool already had room.

        Raises:
            HostPoolFullError: growing would pass ``limit_bytes``, or the memory
                could not be allocated (pinned memory is finite); the message
                names the bytes needed and the ``host_memory`` option.
        """
        with self._lock:
            missing = round_up(nbytes, PAGE_BYTES) - self.free_bytes
            if missing <= 0:
                return None
            size = max(self.chunk_bytes, round_up(largest, PAGE_BYTES))
            sizes = [size] * (missing // size) + ([missing % size] if missing % size else [])
            # Full chunks hold the largest tensor; a lone smaller chunk must too.
            sizes[-1] = max(sizes[-1], round_up(largest, PAGE_BYTES))
            return self._grow(sizes, needed=nbytes, what=what, reason="plan")

    def allocate(self, nbytes: int, key: str | None = None) -> HostBlock:
        """Takes a page-aligned block of at least ``nbytes`` bytes.

        Grows the pool by one chunk when no free range is large enough.

        Args:
            nbytes: Bytes wanted.
            key: The tensor the block is for, named in the error if the pool is full.

        Returns:
            The block; give it back with ``release``.

        Raises:
            HostPoolFullError: no free range is large enough and the pool cannot
                grow (``limit_bytes`` reached, or the allocation failed).
        """
        with self._lock:
            found = self._find(nbytes)
            if found is None:
                needed = round_up(nbytes, PAGE_BYTES)
                size = max(self.chunk_bytes, needed)
                if self.limit_bytes is not None:
                    # Under a cap, a smaller last chunk beats refusing the tensor.
                    size = max(needed, min(size, self.limit_bytes - self.capacity_bytes))
                try:
                    self._grow([size], needed=nbytes, what=f"a tensor of {nbytes} bytes", reason="demand")
                except HostPoolFullError as error:
                    raise error.with_key(key) if key is not None else error
                found = self._find(nbytes)
        index, byte_range = found
        view = self._chunks[index].base[byte_range.offset : byte_range.offset + byte_range.size]
        return HostBlock(byte_range, view, index)

    def release(self, block: HostBlock) -> None:
        """Gives a block back to the pool."""
        with self._lock:
            self._chunks[block.chunk].ranges.free(block.byte_range)

    def _find(self, nbytes: int) -> tuple[int, ByteRange] | None:
        for index, chunk in enumerate(self._chunks):
            byte_range = chunk.ranges.allocate(nbytes)
            if byte_range is not None:
                return index, byte_range
        return None

    def _grow(self, sizes: list[int], *, needed: int, what: str, reason: str) -> HostPoolGrowth:
        added = sum(sizes)
        capacity = self.capacity_bytes
        kind = "pinned host" if self.pinned else "host"
        if self.limit_bytes is not None and capacity + added > self.limit_bytes:
            raise HostPoolFullError(
                f"{what} needs {needed} bytes of {kind} memory; the pool holds {capacity} "
                f"({self.used_bytes} in use) and {HOST_MEMORY_OPTION}={self.limit_bytes} caps it at that: "
                f"set {HOST_MEMORY_OPTION} to at least {capacity + added} (or None to size the pool from the plan)"
            )
        if self._available_memory is not None:
            available = self._available_memory()
            if available is not None and added > available.available_bytes:
                raise HostPoolFullError(
                    f"{what} needs {needed} bytes of {kind} memory: the pool holds {capacity} and would pin "
                    f"{added} more, over the {available.available_bytes} bytes available ({available.source}); "
                    f"keep fewer tensors on the host (nvme holds what does not fit), free host memory, or give the "
                    f"process more: the {HOST_MEMORY_OPTION} option caps the pool and cannot raise what is available"
                )
        start = time.perf_counter()
        chunks = []
        for size in sizes:
            try:
                storage = self._allocate_chunk(size)
                if storage.data_ptr() % PAGE_BYTES:
                    # An allocator that does not align (torch's own) gets a spare page to align in.
                    del storage
                    storage = self._allocate_chunk(size + PAGE_BYTES)
            except RuntimeError as error:
                raise HostPoolFullError(
                    f"allocating {size} bytes of {kind} memory failed ({error}); {what} needs "
                    f"{needed} bytes and the pool holds {capacity + sum(c.ranges.capacity for c in chunks)}: "
                    f"free host memory, keep fewer tensors on the host, or set {HOST_MEMORY_OPTION} "
                    f"to what this machine can {'pin' if self.pinned else 'allocate'}"
                ) from error
            chunks.append(_Chunk(storage, size))
        self._chunks.extend(chunks)
        pinned = sum(chunk.storage.numel() for chunk in chunks) if self.pinned else 0
        growth = HostPoolGrowth(added, tuple(sizes), pinned, time.perf_counter() - start, self.capacity_bytes, reason)
        self.growths.append(growth)
        if self._on_growth is not None:
            self._on_growth(growth)
        log.info(
            "host pool: %s %d bytes in %d chunk(s) in %.2f s for %s (%s); capacity now %d bytes, %d pinned",
            "pinned" if self.pinned else "allocated", added, len(sizes), growth.seconds, what, reason,
            growth.capacity_bytes, self.pinned_bytes,
        )
        return growth
