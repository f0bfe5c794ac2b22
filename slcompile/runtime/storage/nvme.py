"""The nvme tier: one O_DIRECT arena file in a private per-process directory.

Where it sits: below ``TransferEngine``; the engine allocates a slot per stored
tensor and asks the arena to write or read it asynchronously.

Needs: a directory on a filesystem that supports O_DIRECT (ext4, xfs, tmpfs
from Linux 6.6, ...). ``offload_dir`` names the parent; the default is the system
temp dir.

Guarantees:
- Privacy: the arena lives in ``<offload_dir>/slc-offload-<pid>-<random>``,
  created with mode 0700; the directory and the file are opened with O_NOFOLLOW
  and the file relative to the directory's descriptor, so a symlink planted by
  someone else cannot redirect the data. A private directory that turns out not
  to be this user's (swapped in by a race) is refused, never chmod-ed or removed.
  An ``offload_dir`` that every user may write to without the sticky bit (or below
  such a folder) is used with a warning naming it: another user could move the
  private directory away.
- Liveness is a lock, not a pid: the directory holds a ``lock`` file on which
  the arena holds an exclusive ``flock`` for its whole life, taken before the
  directory gets its final name. The kernel drops the lock when the process
  dies, however it dies; pids are not consulted, so processes in other pid
  namespaces (containers sharing a host directory) and on other hosts (a shared
  filesystem whose server arbitrates locks, as NFS does) are seen alive.
- Cleanup: the directory is removed when the arena is closed or collected, at
  interpreter exit and on SIGTERM (when SIGTERM had its default action; the
  process then dies by the signal as it would have), only by the process that
  created it (not by a forked child). A directory whose lock can be taken (its
  process was killed) is removed by the next arena created under the same
  ``offload_dir``; one without a lock file is left alone.
- The page cache is bypassed: the file is opened with O_DIRECT, so measured
  bandwidth is the disk's. Every I/O uses page-aligned memory, offsets and
  lengths; a tensor occupies a slot rounded up to whole pages.
- Thousands of small tensors do not become thousands of files: slots are ranges
  of one file, handed out first-fit from a free list and reused after release.
  The file grows by ``posix_fallocate`` (so a full disk is found when space is
  reserved, not halfway through a write) and never beyond ``capacity_bytes``:
  by what is needed or by its own size (geometric, at most ``grow_bytes`` a
  time), whichever is more, bounded by the filesystem's free space; when the
  larger growth fails it falls back to exactly what is needed, and only that
  failing raises ``DiskFullError`` (naming the directory, the bytes needed and
  the bytes free).
- I/O runs on a small pool of threads using ``os.preadv``/``os.pwritev``, which
  release the GIL; a tensor larger than ``chunk_bytes`` is split into chunks so
  several I/Os are in flight at once. A run of slots that follow each other in the
  file (``allocate_run``), at most ``RUN_MAX_BYTES`` in all, is written by one I/O
  from one staging buffer (``write_run``), and slots that follow each other are read
  by one vectored I/O into the buffers of each (``read_groups``, ``read_run``): one
  job of one I/O thread, which also copies, checksums and checks what it moves, so
  the issuing thread pays a queue put.
- A slot becomes readable (``valid``) only after every chunk of its write has
  completed; half-written data is never read back. A failed write leaves the
  slot invalid.
- Integrity: each chunk of a write is checksummed (CRC-32C, in hardware where the
  CPU has it) by the I/O thread that writes it, and each chunk read is checked
  against it by the I/O thread that reads it, so the compute thread pays nothing
  but the I/O threads' CPU time. Bytes that changed on the disk raise
  ``CorruptDataError`` instead of being used. ``checksums=False``, or the
  environment variable ``SLC_CHECKSUMS=0`` for every arena made without the
  argument, turns this off.
- Failures raise named errors from ``slcompile.runtime.errors`` naming the tensor
  key and the path: ``OffloadDirError``, ``DiskFullError`` (the cap or a real
  ENOSPC), ``ShortReadError``, ``CorruptDataError`` (with the file offset),
  ``OffloadFileMissingError``, ``ArenaClosedError``.
- Nothing after ``close``: once closed (or collected), every call that would
  allocate, write or read raises ``ArenaClosedError`` before it touches a file
  descriptor. The arena's descriptors are closed by then, and their numbers may
  already name files the process opened since: a write through one would land in
  them. ``close`` takes the allocation lock, so a slot allocated or a file grown
  while it closes is done before the descriptors go.
"""

from __future__ import annotations

import ctypes
import errno
import logging
import os
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence

import crc32c
import torch

from ..errors import (
    ArenaClosedError,
    CorruptDataError,
    DiskFullError,
    OffloadDirError,
    OffloadError,
    OffloadFileMissingError,
    ShortReadError,
)
from ..finalizing import when_safe
from .nvme_io import IoBatch, IoOutcome, IoThreads, NvmeSlot
from .offload_dirs import (
    LIVE_DIRS,
    PRIVATE_DIR_PREFIX,
    clean_stale_dirs,
    install_sigterm_cleanup,
    make_private_dir,
    remove_private_dir,
    warn_if_others_can_move,
)
from .page_buffers import (
    PageBuffer,
    PageBufferCache,
    address_of,
    buffers_seen_by_profiler,
    memory_at,
    profiler_sees_buffers,
)
from .ranges import ByteRange, RangeAllocator, round_up
from .tiers import PAGE_BYTES

__all__ = [
    "NvmeArena",
    "NvmeSlot",
    "IoOutcome",
    "PageBuffer",
    "PageBufferCache",
    "buffers_seen_by_profiler",
    "profiler_sees_buffers",
    "clean_stale_dirs",
    "PRIVATE_DIR_PREFIX",
]

log = logging.getLogger(__name__)

_ARENA_FILE = "arena.bin"
RUN_MAX_BYTES = 1 << 20
"""The most bytes of a run of slots written or read by one I/O (``write_run``,
``read_groups``); a larger transfer goes by chunks, which the I/O threads share."""
_IOV_MAX = 1024  # buffers one vectored read takes (Linux's UIO_MAXIOV)
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
CHECKSUMS_ENV = "SLC_CHECKSUMS"


def _checksum(view: memoryview) -> int:
    # CRC-32C in hardware (SSE4.2 / ARMv8 CRC) where there is one; the GIL is
    # released for large buffers, so I/O threads checksum in parallel with compute.
    return crc32c.crc32c(view)


def checksums_default() -> bool:
    """Whether arenas checksum their slots when not told: yes, unless the
    environment variable ``SLC_CHECKSUMS`` is ``0`` (or ``false``/``no``/``off``)."""
    return os.environ.get(CHECKSUMS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _os_error(error: OSError, what: str, key: str, path: str) -> OffloadError:
    if error.errno in _DISK_FULL_ERRNOS:
        return DiskFullError(f"{what}: disk full ({error.strerror})", key=key,
                             path=path)
    if error.errno in (errno.ENOENT, errno.ESTALE, errno.EBADF):
        return OffloadFileMissingError(f"{what} ({error.strerror})", key=key,
                                       path=path)
    return OffloadError(f"{what} ({error.strerror})", key=key, path=path)


class ArenaSpace:
    """The arena file's bytes: page-aligned ranges handed out first-fit and reused
    after release, the file grown by ``posix_fallocate`` when none fits (the module's
    guarantees say by how much), never beyond ``capacity_bytes`` (None: no cap).
    Thread-safe; after ``close`` nothing is allocated."""

    def __init__(self, fd: int, file_path: str, capacity_bytes: int | None, grow_bytes: int):
        self.capacity_bytes = capacity_bytes
        self.grow_bytes = round_up(grow_bytes, PAGE_BYTES)
        self.file_path = file_path
        self.closing = False
        self._fd = fd
        self._ranges = RangeAllocator(0, PAGE_BYTES)
        self._lock = threading.Lock()

    @property
    def file_bytes(self) -> int:
        """Current size of the arena file."""
        return self._ranges.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes held by live slots (padded to pages)."""
        return self._ranges.used_bytes

    def allocate(self, nbytes: int, key: str, check: Callable[[str], None]) -> ByteRange:
        """A range of ``nbytes`` (whole pages), growing the file when none fits;
        ``check(key)`` runs first under the lock (the arena refuses once closed)."""
        with self._lock:
            check(key)
            byte_range = self._ranges.allocate(nbytes)
            if byte_range is None:
                self._grow(nbytes - self._ranges.tail_free(), key)
                byte_range = self._ranges.allocate(nbytes)
            assert byte_range is not None
        return byte_range

    def release(self, slot: NvmeSlot) -> None:
        """Returns a slot's range (idempotent); the slot is invalid afterwards."""
        with self._lock:
            if slot.released:
                return
            slot.released = True
            slot.valid = False
            self._ranges.free(slot.byte_range)

    def close(self) -> None:
        """Refuses every later allocation, once one growing the file is done."""
        with self._lock:
            self.closing = True

    def _grow(self, needed: int, key: str) -> None:
        """Grows the file by at least ``needed`` bytes (a multiple of the page size)."""
        old = self._ranges.capacity
        if self.capacity_bytes is not None and old + needed > self.capacity_bytes:
            raise DiskFullError(
                f"arena capacity of {self.capacity_bytes} bytes reached: {needed} more "
                f"bytes needed with {self._ranges.used_bytes} in use",
                key=key,
                path=self.file_path,
            )
        # Geometric growth keeps the number of fallocate calls logarithmic while a
        # small arena stays small; the free space and the cap bound it.
        wanted = max(needed, min(old, self.grow_bytes))
        if self.capacity_bytes is not None:
            wanted = min(wanted, self.capacity_bytes - old)
        free = self._free_bytes()
        if free is not None:
            wanted = min(wanted, max(needed, free // PAGE_BYTES * PAGE_BYTES))
        for grow in dict.fromkeys((wanted, needed)):
            try:
                os.posix_fallocate(self._fd, old, grow)
            except OSError as error:
                try:
                    os.ftruncate(self._fd, old)  # what a failed fallocate may have left
                except OSError:
                    pass
                if error.errno in _DISK_FULL_ERRNOS and grow > needed:
                    continue  # fall back to exactly what is needed
                if error.errno in _DISK_FULL_ERRNOS:
                    free = self._free_bytes()
                    raise DiskFullError(
                        f"disk full: no room to grow the arena file in {os.path.dirname(self.file_path)}: "
                        f"{needed} bytes needed, "
                        f"{'an unknown number of' if free is None else free} bytes free "
                        f"({error.strerror})",
                        key=key, path=self.file_path,
                    ) from error
                raise _os_error(error, "cannot grow the arena file", key, self.file_path) from error
            self._ranges.grow(old + grow)
            return

    def _free_bytes(self) -> int | None:
        """Bytes this user may still allocate on the arena's filesystem, if known."""
        try:
            info = os.fstatvfs(self._fd)
        except OSError:
            return None
        return info.f_bavail * info.f_frsize


class NvmeArena:
    """An O_DIRECT slab file in a private directory, read and written by I/O threads.

    Args:
        offload_dir: Parent of the private directory (None: the temp dir). It
            must exist, or at least its parent (the last folder is created).
        capacity_bytes: Cap on the arena file size; reaching it raises
            ``DiskFullError`` just like a full disk. None means no cap.
        chunk_bytes: Largest single I/O; bigger tensors are split so several I/Os
            run at once. A multiple of the page size.
        num_threads: I/O threads.
        grow_bytes: The most the file grows at once beyond what a slot needs (it
            grows by its own size up to this, so a small arena stays small).
        checksums: Checksum every slot when written and verify it when read
            (default: on, unless ``SLC_CHECKSUMS=0``).

    Raises:
        OffloadDirError: the directory is missing, not a directory, unwritable,
            or its filesystem does not support O_DIRECT.
    """

    def __init__(
        self,
        offload_dir: str | os.PathLike | None = None,
        *,
        capacity_bytes: int | None = None,
        chunk_bytes: int = 8 << 20,
        num_threads: int = 4,
        grow_bytes: int = 256 << 20,
        checksums: bool | None = None,
    ):
        if offload_dir is None:
            offload_dir = tempfile.gettempdir()
        if not os.fspath(offload_dir):
            raise OffloadDirError("offload directory is an empty path; leave it unset (None) for the "
                                  "temp dir or name a directory", path="")
        base = os.path.abspath(os.fspath(offload_dir))
        if chunk_bytes <= 0 or chunk_bytes % PAGE_BYTES:
            raise ValueError(f"chunk_bytes must be a positive multiple of {PAGE_BYTES}")
        self.chunk_bytes = chunk_bytes
        self.checksums = checksums_default() if checksums is None else bool(checksums)
        if os.path.isdir(base):
            clean_stale_dirs(base)
        self.path, self._dir_fd, lock_fd = make_private_dir(base)
        warn_if_others_can_move(base)
        LIVE_DIRS[self.path] = os.getpid()
        install_sigterm_cleanup()
        self.file_path = os.path.join(self.path, _ARENA_FILE)
        fds: list[int] = [self._dir_fd]
        executor = IoThreads(num_threads, "slc-nvme")
        self._run_bytes = min(self.chunk_bytes, RUN_MAX_BYTES)
        self._finalizer = weakref.finalize(
            self, when_safe, remove_private_dir, (executor,), fds, self.path, os.getpid()
        )
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            try:
                self._fd = os.open(_ARENA_FILE, flags | os.O_DIRECT, 0o600, dir_fd=self._dir_fd)
            except OSError as error:
                if error.errno == errno.EINVAL:
                    raise OffloadDirError(
                        "the offload directory's filesystem does not support O_DIRECT",
                        path=base,
                    ) from error
                raise
            fds.append(self._fd)
            fds.append(lock_fd)  # last: the lock goes once the directory is gone
        except OffloadError:
            os.close(lock_fd)
            self._finalizer()
            raise
        except OSError as error:
            os.close(lock_fd)
            self._finalizer()
            raise OffloadDirError(
                f"cannot open the arena file ({error.strerror})", path=self.file_path
            ) from error
        self._inode = os.fstat(self._fd).st_ino
        self._executor = executor
        self.space = ArenaSpace(self._fd, self.file_path, capacity_bytes, grow_bytes)
        self._staging = threading.local()
        log.debug("nvme arena at %s (cap=%s)", self.file_path, capacity_bytes)

    # -- space -------------------------------------------------------------

    @property
    def run_bytes(self) -> int:
        """The most bytes of a run one I/O writes (``write_run``) or reads
        (``read_groups``); a slot larger than this is never part of one."""
        return self._run_bytes

    def allocate(self, nbytes: int, key: str) -> NvmeSlot:
        """Reserves a slot for a tensor of ``nbytes`` bytes (> 0), growing the file if
        needed; the slot is not valid until written. ``key`` is named in errors.

        Raises:
            DiskFullError: the cap would be exceeded or the disk is full.
        """
        byte_range = self.space.allocate(round_up(nbytes, PAGE_BYTES), key, self._refuse_closed)
        return NvmeSlot(key, byte_range, nbytes)

    def allocate_run(self, sizes: Sequence[int], keys: Sequence[str]) -> list[NvmeSlot]:
        """Slots for tensors of `sizes` bytes (each > 0) that follow each other in the
        file, so that one I/O can write them all (`write_run`); each is released on
        its own. Raises as `allocate` (naming the first key)."""
        padded = [round_up(nbytes, PAGE_BYTES) for nbytes in sizes]
        offset = self.space.allocate(sum(padded), keys[0], self._refuse_closed).offset
        slots = []
        for key, nbytes, size in zip(keys, sizes, padded):
            slots.append(NvmeSlot(key, ByteRange(offset, size), nbytes))
            offset += size
        return slots

    def release(self, slot: NvmeSlot) -> None:
        """Returns a slot's range to the free list (idempotent)."""
        self.space.release(slot)

    # -- I/O -----------------------------------------------------------------

    def write(
        self,
        slot: NvmeSlot,
        address: int,
        readable_bytes: int,
        on_done: Callable[[IoOutcome], None],
        *,
        on_start: Callable[[float], None] | None = None,
        before: Callable[[], None] | None = None,
    ) -> None:
        """Writes ``slot.nbytes`` bytes from memory at ``address`` into the slot.

        Returns at once; ``on_done`` runs on an I/O thread when every chunk is
        written (the slot is then valid) or when one failed (it stays invalid).
        The caller keeps the source memory alive and unchanged until then.

        Args:
            slot: Destination slot.
            address: Address of the first source byte.
            readable_bytes: Bytes readable from ``address`` (at least ``nbytes``);
                when the address is page-aligned and the padded size is readable,
                chunks are written straight from the source without a copy.
            on_done: Called once with the outcome.
            on_start: Called when the first chunk starts.
            before: Called by each chunk before its I/O (e.g. to wait for a
                device-to-host copy into the source).
        """
        self._refuse_closed(slot.key)
        if self.checksums:
            slot.checksums = [None] * -(-slot.nbytes // self.chunk_bytes)

        def finish(outcome: IoOutcome) -> None:
            if outcome.error is None:
                slot.valid = True
            on_done(outcome)

        self._submit(slot, address, readable_bytes, self._write_chunk, finish, on_start, before)

    def read(
        self,
        slot: NvmeSlot,
        address: int,
        writable_bytes: int,
        on_done: Callable[[IoOutcome], None],
        *,
        on_start: Callable[[float], None] | None = None,
    ) -> None:
        """Reads a valid slot into page-aligned memory at ``address``.

        Args:
            slot: Source slot; must be valid.
            address: Page-aligned destination address.
            writable_bytes: Bytes writable from ``address``; at least the slot's
                padded size.
            on_done: Called once, on an I/O thread, with the outcome.
            on_start: Called when the first chunk starts.

        Raises:
            OffloadError: the slot is not (or no longer) completely written.

        An arena file removed underneath is found before the read: `on_done` gets
        `OffloadFileMissingError`.
        """
        self._refuse_closed(slot.key)
        if not slot.valid:
            raise OffloadError(
                "slot is not completely written; refusing to read it", key=slot.key,
                path=self.file_path,
            )
        if address % PAGE_BYTES or writable_bytes < slot.byte_range.size:
            raise ValueError("read destination must be page-aligned and padded to pages")
        self._submit(slot, address, writable_bytes, self._read_chunk, on_done, on_start, None)

    def read_new(
        self,
        slot: NvmeSlot,
        make_destination: Callable[[], torch.Tensor],
        on_done: Callable[[IoOutcome], None],
        *,
        on_start: Callable[[float], None] | None = None,
    ) -> None:
        """Reads a valid slot into a tensor that `make_destination()` makes
        (page-aligned, its storage padded to whole pages): on an I/O thread, so the
        issuing thread makes no tensor and waits on no file check (the check that
        the arena file is still there runs there too, its error in the outcome).

        Raises:
            OffloadError: the slot is not (or no longer) completely written.
        """
        self._refuse_closed(slot.key)
        if not slot.valid:
            raise OffloadError(
                "slot is not completely written; refusing to read it", key=slot.key,
                path=self.file_path,
            )
        self._executor.submit(self._start_read_new, slot, make_destination, on_done, on_start,
                              nbytes=slot.nbytes)

    def _start_read_new(self, slot, make_destination, on_done, on_start) -> None:
        try:
            tensor = make_destination()
            storage = tensor.untyped_storage()
            address = tensor.data_ptr()
            writable = storage.nbytes() - (address - storage.data_ptr())
        except Exception as failure:  # noqa: BLE001 - must reach the waiting thread
            outcome = IoOutcome()
            outcome.error = failure if isinstance(failure, OffloadError) else OffloadError(
                f"read failed: {failure!r}", key=slot.key, path=self.file_path)
            on_done(outcome)
            return
        nbytes = slot.nbytes
        starts = range(0, nbytes, self.chunk_bytes)
        batch = IoBatch(len(starts), on_start, on_done, None)
        # This thread reads the first chunk; the others go to the pool.
        for start in starts[1:]:
            self._executor.submit(self._read_chunk, batch, slot, start, address + start,
                                  min(self.chunk_bytes, nbytes - start), writable - start)
        self._read_chunk(batch, slot, 0, address, min(self.chunk_bytes, nbytes), writable)

    def write_run(
        self,
        slots: Sequence[NvmeSlot],
        sources: Sequence[tuple[int, int]],
        on_done: Callable[[IoOutcome], None],
        *,
        on_start: Callable[[float], None] | None = None,
    ) -> None:
        """Writes `sources`, `(address, readable bytes)` each, into `slots` from
        `allocate_run` (in its order), as `write` writes one: a run of at most
        `run_bytes` by one I/O, one job of one I/O thread, which copies the members
        into its staging pages and checksums them there; a larger run (or a run of
        one) slot by slot. `on_done` is called once, on an I/O thread, with the run's
        outcome (every slot valid, or the first error). The caller keeps the sources
        alive and unchanged until then."""
        self._refuse_closed(slots[0].key)
        padded = slots[-1].byte_range.offset + slots[-1].byte_range.size - slots[0].byte_range.offset
        if padded > self._run_bytes or len(slots) == 1:
            batch = IoBatch(len(slots), on_start, on_done, None)
            for slot, (address, readable) in zip(slots, sources):
                self.write(slot, address, readable, lambda outcome: batch.chunk_finished(outcome.error),
                           on_start=lambda _: batch.chunk_started())
            return
        self._executor.submit(self._write_run, slots, sources, padded, on_done, on_start, nbytes=padded)

    def _write_run(self, slots, sources, padded, on_done, on_start) -> None:
        outcome = IoOutcome()
        outcome.start = time.perf_counter()
        if on_start is not None:
            on_start(outcome.start)
        key = slots[0].key
        try:
            self._check_file(key)
            staging, base = self._staging_buffer()
            first = slots[0].byte_range.offset
            with memoryview(staging) as view:
                for slot, (address, _) in zip(slots, sources):
                    at = slot.byte_range.offset - first
                    ctypes.memmove(base + at, address, slot.nbytes)
                    if slot.byte_range.size > slot.nbytes:
                        ctypes.memset(base + at + slot.nbytes, 0, slot.byte_range.size - slot.nbytes)
                    slot.checksums = [_checksum(view[at:at + slot.nbytes])] if self.checksums else None
                self._write_all(view[:padded], first)
            for slot in slots:
                slot.valid = True
        except Exception as failure:  # noqa: BLE001 - must reach the waiting thread
            outcome.error = self._failure(failure, "write", key)
        outcome.end = time.perf_counter()
        on_done(outcome)

    def read_groups(self, slots: Sequence[NvmeSlot]) -> list[list[int]]:
        """Indices of `slots` in groups that cover them, each a set of slots that
        `read_run` reads with one I/O: slots that follow each other in the file (as
        `allocate_run` makes them), in file order, at most `run_bytes` in all; every
        other slot alone."""
        if len(slots) < 2:
            return [[index] for index in range(len(slots))]
        groups: list[list[int]] = []
        end = total = None
        for index in sorted(range(len(slots)), key=lambda index: slots[index].byte_range.offset):
            slot = slots[index]
            size = slot.byte_range.size
            if (slot.byte_range.offset != end or total + size > self._run_bytes
                    or len(groups[-1]) >= _IOV_MAX or slot.nbytes > self._run_bytes):
                groups.append([])
                total = 0
            groups[-1].append(index)
            end = slot.byte_range.offset + size
            total += size
        return groups

    def read_run(
        self,
        slots: Sequence[NvmeSlot],
        addresses: Sequence[int],
        on_done: Callable[[IoOutcome, dict[int, OffloadError]], None],
    ) -> None:
        """Reads valid `slots`, one group of `read_groups`, into `addresses` (each on a
        page, the slot's padded size writable there) by one vectored read, one job of
        one I/O thread. `on_done(outcome, failed)` runs once, on that thread:
        `outcome.error` fails every slot; `failed` maps a slot's index to its own error
        (a short read, a checksum that does not match).

        Raises:
            OffloadError: a slot is not (or no longer) completely written.
            ArenaClosedError: the arena is closed.
        """
        self._refuse_closed(slots[0].key)
        for slot in slots:
            if not slot.valid:
                raise OffloadError("slot is not completely written; refusing to read it", key=slot.key,
                                   path=self.file_path)
        self._executor.submit(self._read_run, slots, addresses, on_done,
                              nbytes=sum(slot.byte_range.size for slot in slots))

    def _read_run(self, slots, addresses, on_done) -> None:
        outcome = IoOutcome()
        outcome.start = time.perf_counter()
        failed: dict[int, OffloadError] = {}
        key = slots[0].key
        try:
            self._check_file(key)
            sizes = [slot.byte_range.size for slot in slots]
            got = self._read_all([memory_at(address, size) for address, size in zip(addresses, sizes)],
                                 slots[0].byte_range.offset)
            for index, (slot, address) in enumerate(zip(slots, addresses)):
                error = self._read_error(slot, address, got)
                if error is not None:
                    failed[index] = error
                got -= sizes[index]
        except Exception as failure:  # noqa: BLE001 - must reach the waiting thread
            outcome.error = self._failure(failure, "read", key)
        outcome.end = time.perf_counter()
        on_done(outcome, failed)

    def _read_error(self, slot: NvmeSlot, address: int, got: int) -> OffloadError | None:
        """What is wrong with a slot of one chunk read into `address`, of which `got`
        bytes (the tensor's own first) came back: a short read, a checksum that does
        not match, or nothing."""
        nbytes, offset = slot.nbytes, slot.byte_range.offset
        if got < nbytes:
            return ShortReadError(f"read {max(got, 0)} of {nbytes} bytes at file offset {offset}",
                                  key=slot.key, path=self.file_path)
        if slot.checksums is None:
            return None
        found = _checksum(memory_at(address, nbytes))
        if found == slot.checksums[0]:
            return None
        return CorruptDataError(
            f"corrupt data: the {nbytes} bytes at file offset {offset} (byte 0 of the tensor) read "
            f"back with CRC-32C {found:08x}, written with {slot.checksums[0]:08x}",
            key=slot.key, path=self.file_path, offset=offset,
        )

    def _write_all(self, view: memoryview, offset: int) -> None:
        written = 0
        while written < len(view):
            count = os.pwritev(self._fd, [view[written:]], offset + written)
            if count <= 0:
                raise OSError(errno.EIO, "write made no progress")
            written += count

    def _read_all(self, views: list[memoryview], offset: int) -> int:
        """Reads the file from `offset` into `views`, one after the other, by vectored
        reads until they are full or the file ends; the bytes read."""
        got, total = 0, sum(len(view) for view in views)
        while got < total:
            count = os.preadv(self._fd, views, offset + got)
            if count == 0:
                break
            got += count
            while views and count >= len(views[0]):  # what is left: the views not yet full
                count -= len(views[0])
                views = views[1:]
            if views:
                views = [views[0][count:], *views[1:]]
        return got

    def _submit(self, slot, address, memory_bytes, chunk_fn, on_done, on_start, before) -> None:
        nbytes = slot.nbytes
        starts = range(0, nbytes, self.chunk_bytes)
        batch = IoBatch(len(starts), on_start, on_done, before)
        for start in starts:
            length = min(self.chunk_bytes, nbytes - start)
            self._executor.submit(
                chunk_fn, batch, slot, start, address + start, length, memory_bytes - start, nbytes=length
            )

    def _refuse_closed(self, key: str) -> None:
        if self.space.closing or not self._finalizer.alive:
            raise ArenaClosedError(
                "the nvme arena is closed: its directory, file and I/O threads are gone, so nothing can be "
                "stored in it or read from it", key=key, path=self.file_path,
            )

    def _check_file(self, key: str) -> None:
        try:
            inode = os.stat(_ARENA_FILE, dir_fd=self._dir_fd, follow_symlinks=False).st_ino
        except FileNotFoundError:
            inode = None
        if inode != self._inode:
            raise OffloadFileMissingError(
                "the arena file was removed while tensors lived in it", key=key,
                path=self.file_path,
            )

    def _failure(self, failure: Exception, what: str, key: str) -> OffloadError:
        """What a failed `what` ("read", "write") reports: an `OffloadError` as it is, an
        `OSError` by its errno (`_os_error`), anything else wrapped."""
        if isinstance(failure, OffloadError):
            return failure
        if isinstance(failure, OSError):
            return _os_error(failure, f"{what} failed", key, self.file_path)
        return OffloadError(f"{what} failed: {failure!r}", key=key, path=self.file_path)

    def _staging_buffer(self) -> tuple[PageBuffer, int]:
        staged = getattr(self._staging, "buffer", None)
        if staged is None:
            buffer = PageBuffer.allocate(self.chunk_bytes)
            staged = self._staging.buffer = (buffer, address_of(buffer))
        return staged

    def _write_chunk(self, batch, slot, start, address, length, readable) -> None:
        batch.chunk_started()
        error = None
        try:
            self._check_file(slot.key)
            if batch.before is not None:
                batch.before()
            padded = round_up(length, PAGE_BYTES)
            if address % PAGE_BYTES == 0 and readable >= padded:
                view = memory_at(address, padded)
            else:
                # O_DIRECT needs aligned memory: go through this thread's staging pages.
                staging, staging_address = self._staging_buffer()
                ctypes.memmove(staging_address, address, length)
                if padded > length:
                    ctypes.memset(staging_address + length, 0, padded - length)
                view = memoryview(staging)[:padded]
            if slot.checksums is not None:
                slot.checksums[start // self.chunk_bytes] = _checksum(view[:length])
            self._write_all(view, slot.byte_range.offset + start)
        except Exception as failure:  # noqa: BLE001 - must reach the waiting thread
            error = self._failure(failure, "write", slot.key)
        batch.chunk_finished(error)

    def _read_chunk(self, batch, slot, start, address, length, writable) -> None:
        batch.chunk_started()
        error = None
        try:
            self._check_file(slot.key)
            padded = round_up(length, PAGE_BYTES)
            view = memory_at(address, padded)
            offset = slot.byte_range.offset + start
            got = 0
            while got < padded:
                count = os.preadv(self._fd, [view[got:]], offset + got)
                if count == 0:
                    break
                got += count
            if got < length:
                error = ShortReadError(
                    f"read {got} of {length} bytes at file offset {offset}",
                    key=slot.key, path=self.file_path,
                )
            elif slot.checksums is not None:
                expected = slot.checksums[start // self.chunk_bytes]
                found = _checksum(view[:length])
                if found != expected:
                    error = CorruptDataError(
                        f"corrupt data: the {length} bytes at file offset {offset} (byte {start} of the "
                        f"tensor) read back with CRC-32C {found:08x}, written with {expected:08x}",
                        key=slot.key, path=self.file_path, offset=offset,
                    )
        except Exception as failure:  # noqa: BLE001 - must reach the waiting thread
            error = self._failure(failure, "read", slot.key)
        batch.chunk_finished(error)

    # -- lifetime ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once the arena's directory has been removed."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Waits for queued I/O, closes the file and removes the private directory;
        every later call that would do I/O raises `ArenaClosedError`."""
        self.space.close()  # an allocation growing the file finishes first
        self._finalizer()
