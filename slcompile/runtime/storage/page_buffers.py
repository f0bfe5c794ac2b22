"""Page-aligned memory for O_DIRECT I/O, and the cache that reuses it.

Where it sits: below the nvme arena (``slcompile.runtime.storage.nvme``), whose I/O threads
read into and write from this memory, and the transfer engine, whose CPU loads
return tensors on it (``PageBufferCache``); the KV store joins segments in it.

Guarantees:
- ``PageBuffer`` is private anonymous memory (not shared memory, which the kernel
  accounts as page cache), page-aligned and a whole number of pages.
- ``PageBufferCache.tensor`` returns a tensor whose storage starts on a page and is
  padded to whole pages, so O_DIRECT reads whole pages straight into it; once the
  last tensor using the memory is gone, the memory is kept by exact size, up to the
  cache's capacity, for the next tensor of that size. ``take`` hands out that memory
  before any tensor is made on it (a read lands in it first), ``wrap`` makes the
  tensor later, ``give_back`` returns it unused.
- Inside ``buffers_seen_by_profiler`` that memory comes from torch's CPU allocator
  instead, so ``torch.profiler``'s memory timeline counts it.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import mmap
import threading
import weakref
from collections.abc import Callable, Iterator

import torch

from ..finalizing import when_safe
from .ranges import round_up
from .tiers import PAGE_BYTES

__all__ = [
    "PageBuffer",
    "PageBufferCache",
    "buffers_seen_by_profiler",
    "profiler_sees_buffers",
    "address_of",
    "memory_at",
]


class PageBuffer(mmap.mmap):
    """Private anonymous page-aligned memory; a subclass so it can carry weak references.

    Create it with ``PageBuffer.allocate``: ``mmap.mmap(-1, n)`` alone maps *shared*
    memory, which the kernel accounts as page cache (shmem).

    ``PageBufferCache`` builds tensors on it and reuses it after they die.
    """

    @classmethod
    def allocate(cls, nbytes: int) -> "PageBuffer":
        """Maps ``nbytes`` (a multiple of the page size) of private anonymous memory."""
        # No MADV_HUGEPAGE: fewer faults, but the kernel's compaction to find huge
        # pages made first loads 3x slower here than plain pages.
        return cls(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)


_PROFILER_VISIBLE = [0]  # nesting depth of buffers_seen_by_profiler


@contextlib.contextmanager
def buffers_seen_by_profiler() -> Iterator[None]:
    """Within the block, loads land in memory from torch's CPU
    allocator instead of private mappings, so `torch.profiler`'s memory timeline
    counts them with every other tensor. For measuring memory, not for speed: the
    memory is not reused between loads and each buffer carries one page of slack
    for alignment."""
    _PROFILER_VISIBLE[0] += 1
    try:
        yield
    finally:
        _PROFILER_VISIBLE[0] -= 1


def profiler_sees_buffers() -> bool:
    """Whether loads are inside `buffers_seen_by_profiler`."""
    return _PROFILER_VISIBLE[0] > 0


class PageBufferCache:
    """Hands out tensors on page-aligned memory and reuses that memory once they die.

    Fresh memory costs page faults and zeroing on the CPU that compute needs; a
    schedule loads tensors of the same sizes step after step, so buffers are kept
    by exact size, up to ``capacity_bytes`` in total, and reused. Idle buffers are
    not resident data (no tier counts them) but do count in the process's RSS.

    Args:
        capacity_bytes: Most idle bytes kept; 0 keeps none.
    """

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._idle: dict[int, list[PageBuffer]] = {}
        self._idle_bytes = 0
        self._lock = threading.Lock()

    @property
    def idle_bytes(self) -> int:
        """Bytes of idle buffers kept for reuse."""
        return self._idle_bytes

    def tensor(
        self,
        nbytes: int,
        dtype: torch.dtype,
        shape: tuple[int, ...],
        on_release: Callable[[], None] | None = None,
    ) -> torch.Tensor:
        """Returns a contiguous tensor on page-aligned memory padded to whole pages.

        The padding lets O_DIRECT read whole pages straight into the tensor.

        Args:
            nbytes: The tensor's size in bytes (> 0).
            dtype: Element type.
            shape: Shape; its element count times the item size is ``nbytes``.
            on_release: Called once the last tensor using the memory is gone.

        Returns:
            The tensor; not a view (its storage is the whole padded buffer).
        """
        size = round_up(nbytes, PAGE_BYTES)
        if _PROFILER_VISIBLE[0]:
            return _allocator_tensor(size, dtype, shape, on_release)
        return self.wrap(self.take(size), dtype, shape, on_release)

    def take(self, size: int) -> PageBuffer:
        """An idle buffer of `size` bytes (a whole number of pages), or a new one: memory
        to read into before a tensor is made on it (`wrap`), or to give back unused
        (`give_back`)."""
        with self._lock:
            idle = self._idle.get(size)
            buffer = idle.pop() if idle else None
            if buffer is not None:
                self._idle_bytes -= size
        return buffer if buffer is not None else PageBuffer.allocate(size)

    def wrap(self, buffer: PageBuffer, dtype: torch.dtype, shape: tuple[int, ...],
             on_release: Callable[[], None] | None = None) -> torch.Tensor:
        """The tensor of `shape` and `dtype` at the start of a buffer from `take`, as
        `tensor` makes it: the buffer comes back to the cache, and `on_release` is
        called, once the last tensor using it is gone."""
        size = len(buffer)
        # The ctypes array is the storage's owner: it dies with the last tensor
        # using the memory and gives the buffer back, to be reused.
        owner = _owner_type(size).from_buffer(buffer)
        owner.giving_back = (self, buffer, size, on_release)
        # A 1-d tensor over the whole buffer, shrunk in place to its shape: the storage
        # stays the padded buffer (two dispatches, where `set_` onto it takes three).
        return torch.frombuffer(owner, dtype=dtype).resize_(shape)

    def give_back(self, buffer: PageBuffer) -> None:
        """Returns a buffer from `take` that no tensor was made on."""
        self._give_back(buffer, len(buffer), None)

    def _give_back(self, buffer: PageBuffer, size: int, on_release) -> None:
        if on_release is not None:
            on_release()
        with self._lock:
            if self._idle_bytes + size <= self.capacity_bytes:
                self._idle.setdefault(size, []).append(buffer)
                self._idle_bytes += size

    def clear(self) -> None:
        """Drops every idle buffer."""
        with self._lock:
            self._idle.clear()
            self._idle_bytes = 0


def _give_back_owner(owner) -> None:
    cache, buffer, size, on_release = owner.giving_back
    when_safe(cache._give_back, buffer, size, on_release)


@functools.lru_cache(maxsize=1024)
def _owner_type(size: int) -> type:
    """The ctypes array of `size` bytes that owns a `PageBufferCache` tensor's
    storage, and gives its buffer back when it dies (cheaper than a
    `weakref.finalize` on each)."""
    return type("PageBufferOwner", (ctypes.c_char * size,), {"__del__": _give_back_owner})


def _allocator_tensor(size: int, dtype: torch.dtype, shape: tuple[int, ...], on_release) -> torch.Tensor:
    """A tensor on page-aligned memory inside a buffer from torch's CPU allocator
    (a view of it, so the profiler ties the tensor to that allocation)."""
    base = torch.empty(size + PAGE_BYTES, dtype=torch.uint8, device="cpu")
    offset = -base.data_ptr() % PAGE_BYTES
    numel = 1
    for dim in shape:
        numel *= dim
    tensor = base[offset : offset + size].view(dtype)[:numel].view(shape)
    if on_release is not None:
        weakref.finalize(tensor, when_safe, on_release)
    return tensor


def address_of(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


_memory_view_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view_from_memory.restype = ctypes.py_object
_memory_view_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte memoryview over raw memory the caller keeps alive."""
    return _memory_view_from_memory(address, nbytes, _PYBUF_WRITE)

