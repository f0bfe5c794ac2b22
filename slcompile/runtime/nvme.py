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
  several I/Os are in flight at once.
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
  ``OffloadFileMissingError``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import logging
import mmap
import os
import queue
import re
import secrets
import shutil
import signal
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Iterator

import crc32c
import torch

from .errors import (
    CorruptDataError,
    DiskFullError,
    OffloadDirError,
    OffloadError,
    OffloadFileMissingError,
    ShortReadError,
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

PRIVATE_DIR_PREFIX = "slc-offload-"
_PRIVATE_DIR_PATTERN = re.compile(r"^slc-offload-(\d+)-[0-9a-f]{8}$")
# A private directory is made under this name and renamed to its final one once
# its lock is held, so that no cleaner ever sees a live directory unlocked.
_UNFINISHED_PATTERN = re.compile(r"^slc-offload-(\d+)-[0-9a-f]{8}\.new$")
_UNFINISHED_GRACE_SECONDS = 600.0
_ARENA_FILE = "arena.bin"
_LOCK_FILE = "lock"
_DISK_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)
CHECKSUMS_ENV = "SLC_CHECKSUMS"


def checksums_default() -> bool:
    """Whether arenas checksum their slots when not told: yes, unless the
    environment variable ``SLC_CHECKSUMS`` is ``0`` (or ``false``/``no``/``off``)."""
    return os.environ.get(CHECKSUMS_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


def _checksum(view: memoryview) -> int:
    # CRC-32C in hardware (SSE4.2 / ARMv8 CRC) where there is one; the GIL is
    # released for large buffers, so I/O threads checksum in parallel with compute.
    return crc32c.crc32c(view)


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
        with self._lock:
            idle = self._idle.get(size)
            buffer = idle.pop() if idle else None
            if buffer is not None:
                self._idle_bytes -= size
        if buffer is None:
            buffer = PageBuffer.allocate(size)
        # The ctypes array is the storage's owner: it dies with the last tensor
        # using the memory, while the buffer itself can outlive it and be reused.
        owner = (ctypes.c_char * size).from_buffer(buffer)
        storage = torch.frombuffer(owner, dtype=torch.uint8).untyped_storage()
        tensor = torch.empty((), dtype=dtype, device="cpu").set_(storage, 0, shape)
        weakref.finalize(owner, self._give_back, buffer, size, on_release)
        return tensor

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
        weakref.finalize(tensor, on_release)
    return tensor


def _address_of(buffer: mmap.mmap) -> int:
    return ctypes.addressof(ctypes.c_char.from_buffer(buffer))


_memory_view_from_memory = ctypes.pythonapi.PyMemoryView_FromMemory
_memory_view_from_memory.restype = ctypes.py_object
_memory_view_from_memory.argtypes = (ctypes.c_void_p, ctypes.c_ssize_t, ctypes.c_int)
_PYBUF_WRITE = 0x200


def _memory_at(address: int, nbytes: int) -> memoryview:
    """A writable byte memoryview over raw memory the caller keeps alive."""
    return _memory_view_from_memory(address, nbytes, _PYBUF_WRITE)


# This process's live private directories, path -> the pid that made them. Read by
# the SIGTERM handler, so a plain dict (no lock a handler could wait on).
_LIVE_DIRS: dict[str, int] = {}
_SIGTERM = {"installed": False}


def _try_lock(dir_fd: int) -> int | None:
    """The descriptor of a directory's lock file, locked; None if another process
    holds the lock or there is no lock file."""
    try:
        fd = os.open(_LOCK_FILE, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def clean_stale_dirs(base: str) -> list[str]:
    """Removes private arena directories under ``base`` whose arena is gone.

    A directory is removed only if it is named like ours, owned by this user, and
    its lock file's lock can be taken: the process that held it died (or closed
    the arena without removing it). Pids are not consulted: a pid names a process
    only in its own pid namespace and on its own host. A directory without a lock
    file is kept, as is one of this process's own live arenas.

    Args:
        base: The parent directory (an ``offload_dir``).

    Returns:
        The paths removed.
    """
    removed = []
    try:
        names = os.listdir(base)
    except OSError:
        return removed
    for name in names:
        unfinished = _UNFINISHED_PATTERN.match(name)
        if _PRIVATE_DIR_PATTERN.match(name) is None and unfinished is None:
            continue
        path = os.path.join(base, name)
        if path in _LIVE_DIRS:
            continue
        try:
            dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        lock_fd = None
        try:
            info = os.fstat(dir_fd)
            if info.st_uid != os.getuid():
                continue
            # An unfinished directory is locked only a moment after it is made:
            # left alone while it may still be on its way.
            if unfinished is not None and time.time() - info.st_mtime < _UNFINISHED_GRACE_SECONDS:
                continue
            lock_fd = _try_lock(dir_fd)
            if lock_fd is None:
                continue
            # Removed while holding the lock: a second cleaner finds it taken.
            shutil.rmtree(path, ignore_errors=True)
        finally:
            if lock_fd is not None:
                os.close(lock_fd)
            os.close(dir_fd)
        log.info("removed offload directory %s left by a process that is gone", path)
        removed.append(path)
    return removed


def _make_private_dir(base: str) -> tuple[str, int, int]:
    """Creates this arena's private directory under ``base``, locked.

    Returns:
        Its path, a descriptor of it and the descriptor of its locked lock file.
    """
    if not os.path.exists(base):
        parent = os.path.dirname(base)
        if not os.path.isdir(parent):
            raise OffloadDirError(f"offload directory does not exist, nor does its parent {parent}", path=base)
        try:
            os.mkdir(base, 0o700)  # only the last folder, private like the arena's own
        except FileExistsError:
            pass
        except OSError as error:
            raise OffloadDirError(
                f"cannot create the offload directory in {parent}: {_why_not_writable(error)}", path=base
            ) from error
    if not os.path.isdir(base):
        raise OffloadDirError("offload directory is not a directory", path=base)
    for _ in range(8):
        path = os.path.join(base, f"{PRIVATE_DIR_PREFIX}{os.getpid()}-{secrets.token_hex(4)}")
        unfinished = path + ".new"
        try:
            os.mkdir(unfinished, 0o700)
        except FileExistsError:
            continue
        except OSError as error:
            raise OffloadDirError(
                f"cannot create a private directory in the offload directory: {_why_not_writable(error)}",
                path=base,
            ) from error
        dir_fd, lock_fd = _open_private_dir(unfinished)
        try:
            if os.path.lexists(path):
                raise FileExistsError(path)
            os.rename(unfinished, path)
            if os.lstat(path).st_ino != os.fstat(dir_fd).st_ino:
                raise OffloadDirError("the private directory was replaced while it was being made", path=path)
        except FileExistsError:
            shutil.rmtree(unfinished, ignore_errors=True)
            os.close(lock_fd)
            os.close(dir_fd)
            continue
        except OffloadError:
            os.close(lock_fd)  # a directory swapped in is not ours to remove
            os.close(dir_fd)
            raise
        except OSError as error:
            shutil.rmtree(unfinished, ignore_errors=True)
            os.close(lock_fd)
            os.close(dir_fd)
            raise OffloadDirError(f"cannot name the private directory ({error.strerror})", path=path) from error
        return path, dir_fd, lock_fd
    raise OffloadDirError("could not find a free private directory name", path=base)


def _open_private_dir(path: str) -> tuple[int, int]:
    """Opens a just-made private directory without following links, checks it is
    this user's (a directory swapped in by a race is refused, not chmod-ed) and
    takes its lock. Returns the directory's descriptor and the lock file's."""
    try:
        dir_fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as error:
        raise OffloadDirError(
            f"cannot open the private directory just made ({error.strerror}): it was replaced, "
            "perhaps by a link", path=path,
        ) from error
    try:
        info = os.fstat(dir_fd)
        if info.st_uid != os.getuid():
            raise OffloadDirError(
                f"the private directory just made belongs to uid {info.st_uid}, not to this user "
                f"({os.getuid()}): it was replaced by someone else; refusing to use it", path=path,
            )
        if stat.S_IMODE(info.st_mode) & 0o077:
            os.fchmod(dir_fd, 0o700)  # this user's own, made wider by a umask or an ACL default
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        lock_fd = os.open(_LOCK_FILE, flags, 0o600, dir_fd=dir_fd)
        try:
            fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(lock_fd)
            raise
    except OffloadError:
        os.close(dir_fd)
        raise
    except OSError as error:
        os.close(dir_fd)
        shutil.rmtree(path, ignore_errors=True)
        raise OffloadDirError(f"cannot lock the private directory ({error.strerror})", path=path) from error
    return dir_fd, lock_fd


def _install_sigterm_cleanup() -> None:
    """On SIGTERM with its default action, removes this process's private
    directories, then dies by the signal as it would have. A handler someone else
    installed is left in charge (it may shut down gracefully and still read the
    arena); interpreter exit removes the directories then. Only the main thread may
    install handlers: from another thread this does nothing."""
    if _SIGTERM["installed"] or threading.current_thread() is not threading.main_thread():
        return
    try:
        previous = signal.getsignal(signal.SIGTERM)
        if previous is not signal.SIG_DFL:
            return
        signal.signal(signal.SIGTERM, _on_sigterm)
    except (ValueError, OSError):  # not the main interpreter
        return
    _SIGTERM["installed"] = True


def _on_sigterm(signum, frame) -> None:
    _remove_live_dirs()
    signal.signal(signum, signal.SIG_DFL)
    os.kill(os.getpid(), signum)


def _remove_live_dirs() -> None:
    """Removes the private directories this process made; without waiting for I/O
    (a signal handler may run while an I/O thread waits for this thread)."""
    pid = os.getpid()
    for path, owner in list(_LIVE_DIRS.items()):
        if owner == pid:
            shutil.rmtree(path, ignore_errors=True)


def _warn_if_others_can_move(path: str) -> None:
    """Warns when another user could move the private directory made in ``path``
    away (and put their own in its place): ``path`` or a folder above it is writable
    by every user without the sticky bit, which would keep others from renaming what
    is not theirs (as /tmp's does). The arena's own descriptors keep working; the
    cleanup, which goes by path, would then miss the directory."""
    folder = path
    while True:
        try:
            mode = os.stat(folder).st_mode
        except OSError:
            return
        if mode & stat.S_IWOTH and not mode & stat.S_ISVTX:
            log.warning(
                "offload directory %s: %s is writable by every user and has no sticky bit (mode %04o), so "
                "another user can move the private directory made there away; use a directory only you can "
                "write to, or set the sticky bit (chmod +t %s)", path, folder, stat.S_IMODE(mode), folder)
            return
        parent = os.path.dirname(folder)
        if parent == folder:
            return
        folder = parent


def _why_not_writable(error: OSError) -> str:
    """The cause of a failed mkdir in an existing directory, in words: ENOENT there
    means a filesystem that takes no new entries (/proc, /sys), not a missing path."""
    if error.errno in (errno.EACCES, errno.EPERM):
        return "this user may not write there (permission denied)"
    if error.errno == errno.EROFS:
        return "the filesystem is read-only"
    if error.errno == errno.ENOENT:
        return "the filesystem takes no new files or folders (a virtual one such as /proc or /sys)"
    return error.strerror or str(error)


def _remove_private_dir(
    executor: _IoThreads, fds: list[int], path: str, owner: int
) -> None:
    # Runs from close(), garbage collection or interpreter exit; must not use the arena.
    # A forked child inherits the arena but not the directory: only its maker removes it.
    mine = os.getpid() == owner
    if mine:
        executor.shutdown()
        shutil.rmtree(path, ignore_errors=True)
        _LIVE_DIRS.pop(path, None)
    # The lock file's descriptor is the last of `fds`: closed after the removal.
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


class NvmeSlot:
    """One tensor's range of the arena file.

    Attributes:
        key: The tensor key the slot was allocated for.
        byte_range: Offset and padded size in the file.
        nbytes: The tensor's logical size.
        valid: True only once every byte of the write has reached the file.
        released: True once the range went back to the free list.
        checksums: The CRC-32C of each chunk's bytes as written (chunk ``i`` holds
            bytes ``i * chunk_bytes`` on), or None when the arena does not checksum.
    """

    __slots__ = ("key", "byte_range", "nbytes", "valid", "released", "checksums")

    def __init__(self, key: str, byte_range: ByteRange, nbytes: int):
        self.key = key
        self.byte_range = byte_range
        self.nbytes = nbytes
        self.valid = False
        self.released = False
        self.checksums: list[int | None] | None = None


class IoOutcome:
    """How one slot write or read went.

    Attributes:
        start: ``perf_counter`` time the first chunk began (None if none ran).
        end: ``perf_counter`` time the last chunk ended.
        error: The first error of any chunk, or None.
    """

    __slots__ = ("start", "end", "error")

    def __init__(self):
        self.start: float | None = None
        self.end: float | None = None
        self.error: OffloadError | None = None


class _IoBatch:
    """Chunks of one slot transfer in flight; the last one to finish reports."""

    def __init__(
        self,
        chunks: int,
        on_start: Callable[[float], None] | None,
        on_done: Callable[[IoOutcome], None],
        before: Callable[[], None] | None,
    ):
        self.remaining = chunks
        self.lock = threading.Lock()
        self.outcome = IoOutcome()
        self.on_start = on_start
        self.on_done = on_done
        self.before = before

    def chunk_started(self) -> None:
        now = time.perf_counter()
        with self.lock:
            first = self.outcome.start is None
            if first:
                self.outcome.start = now
        if first and self.on_start is not None:
            self.on_start(now)

    def chunk_finished(self, error: OffloadError | None) -> None:
        with self.lock:
            if error is not None and self.outcome.error is None:
                self.outcome.error = error
            self.remaining -= 1
            last = self.remaining == 0
            if last:
                self.outcome.end = time.perf_counter()
        if last:
            self.on_done(self.outcome)


class _IoThreads:
    """The arena's I/O threads, fed by one queue: `submit(fn, *args)` costs the
    submitting thread a queue put, where `concurrent.futures` makes a future, a
    condition and a work item per call (the transfer ops call it on the compute
    thread's hot path). The threads start with the first submission; `shutdown`
    runs what was queued, then stops them."""

    def __init__(self, count: int, name: str):
        self._count = count
        self._name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._closed = False

    def submit(self, fn: Callable[..., None], *args) -> None:
        if self._closed:
            raise RuntimeError("the nvme arena's I/O threads are shut down")
        if not self._threads:
            self._start()
        self._queue.put((fn, args))

    def _start(self) -> None:
        with self._lock:
            if self._closed:
                raise RuntimeError("the nvme arena's I/O threads are shut down")
            while len(self._threads) < self._count:
                thread = threading.Thread(target=self._work, name=f"{self._name}_{len(self._threads)}",
                                          daemon=True)
                thread.start()
                self._threads.append(thread)

    def _work(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, args = item
            try:
                fn(*args)
            except BaseException:  # noqa: BLE001 - a chunk reports its own errors; this is a bug
                log.exception("nvme I/O task %r failed", fn)
            del item, fn, args

    def shutdown(self) -> None:
        with self._lock:
            self._closed = True
            threads, self._threads = self._threads, []
        for _ in threads:
            self._queue.put(None)
        for thread in threads:
            if thread is not threading.current_thread():
                thread.join()


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
        self.base_dir = base
        self.capacity_bytes = capacity_bytes
        self.chunk_bytes = chunk_bytes
        self.grow_bytes = round_up(grow_bytes, PAGE_BYTES)
        self.checksums = checksums_default() if checksums is None else bool(checksums)
        if os.path.isdir(base):
            clean_stale_dirs(base)
        self.path, self._dir_fd, lock_fd = _make_private_dir(base)
        _warn_if_others_can_move(base)
        _LIVE_DIRS[self.path] = os.getpid()
        _install_sigterm_cleanup()
        self.file_path = os.path.join(self.path, _ARENA_FILE)
        fds: list[int] = [self._dir_fd]
        executor = _IoThreads(num_threads, "slc-nvme")
        self._finalizer = weakref.finalize(
            self, _remove_private_dir, executor, fds, self.path, os.getpid()
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
        self._allocator = RangeAllocator(0, PAGE_BYTES)
        self._lock = threading.Lock()
        self._staging = threading.local()
        log.debug("nvme arena at %s (cap=%s)", self.file_path, capacity_bytes)

    # -- space -------------------------------------------------------------

    @property
    def file_bytes(self) -> int:
        """Current size of the arena file."""
        return self._allocator.capacity

    @property
    def used_bytes(self) -> int:
        """Bytes held by live slots (padded to pages)."""
        return self._allocator.used_bytes

    def allocate(self, nbytes: int, key: str) -> NvmeSlot:
        """Reserves a slot for a tensor of ``nbytes`` bytes, growing the file if needed.

        Args:
            nbytes: The tensor's size (> 0).
            key: The tensor key, named in errors.

        Returns:
            The slot (not yet valid).

        Raises:
            DiskFullError: the cap would be exceeded or the disk is full.
        """
        padded = round_up(nbytes, PAGE_BYTES)
        with self._lock:
            byte_range = self._allocator.allocate(padded)
            if byte_range is None:
                self._grow(padded - self._allocator.tail_free(), key)
                byte_range = self._allocator.allocate(padded)
            assert byte_range is not None
        return NvmeSlot(key, byte_range, nbytes)

    def _grow(self, needed: int, key: str) -> None:
        """Grows the file by at least ``needed`` bytes (a multiple of the page size)."""
        old = self._allocator.capacity
        if self.capacity_bytes is not None and old + needed > self.capacity_bytes:
            raise DiskFullError(
                f"arena capacity of {self.capacity_bytes} bytes reached: {needed} more "
                f"bytes needed with {self._allocator.used_bytes} in use",
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
                        f"disk full: no room to grow the arena file in {self.path}: {needed} bytes needed, "
                        f"{'an unknown number of' if free is None else free} bytes free "
                        f"({error.strerror})",
                        key=key, path=self.file_path,
                    ) from error
                raise self._os_error(error, "cannot grow the arena file", key) from error
            self._allocator.grow(old + grow)
            return

    def _free_bytes(self) -> int | None:
        """Bytes this user may still allocate on the arena's filesystem, if known."""
        try:
            info = os.fstatvfs(self._fd)
        except OSError:
            return None
        return info.f_bavail * info.f_frsize

    def release(self, slot: NvmeSlot) -> None:
        """Returns a slot's range to the free list (idempotent)."""
        with self._lock:
            if slot.released:
                return
            slot.released = True
            slot.valid = False
            self._allocator.free(slot.byte_range)

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

        An arena file removed underneath is found on the I/O thread, before the read:
        `on_done` gets `OffloadFileMissingError`.
        """
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
        """Reads a valid slot into a tensor that `make_destination()` makes on an I/O
        thread (page-aligned, its storage padded to whole pages), so the issuing
        thread makes no tensor and waits on no file check: the check that the arena
        file is still there runs on the I/O thread too, its error in the outcome.

        Raises:
            OffloadError: the slot is not (or no longer) completely written.
        """
        if not slot.valid:
            raise OffloadError(
                "slot is not completely written; refusing to read it", key=slot.key,
                path=self.file_path,
            )
        self._executor.submit(self._start_read_new, slot, make_destination, on_done, on_start)

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
        batch = _IoBatch(len(starts), on_start, on_done, None)
        # This thread reads the first chunk; the others go to the pool.
        for start in starts[1:]:
            self._executor.submit(self._read_chunk, batch, slot, start, address + start,
                                  min(self.chunk_bytes, nbytes - start), writable - start)
        self._read_chunk(batch, slot, 0, address, min(self.chunk_bytes, nbytes), writable)

    def _submit(self, slot, address, memory_bytes, chunk_fn, on_done, on_start, before) -> None:
        nbytes = slot.nbytes
        starts = range(0, nbytes, self.chunk_bytes)
        batch = _IoBatch(len(starts), on_start, on_done, before)
        for start in starts:
            length = min(self.chunk_bytes, nbytes - start)
            self._executor.submit(
                chunk_fn, batch, slot, start, address + start, length, memory_bytes - start
            )

    def _check_file(self, key: str) -> None:
        try:
            info = os.stat(_ARENA_FILE, dir_fd=self._dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            info = None
        if info is None or info.st_ino != self._inode:
            raise OffloadFileMissingError(
                "the arena file was removed while tensors lived in it", key=key,
                path=self.file_path,
            )

    def _os_error(self, error: OSError, what: str, key: str) -> OffloadError:
        if error.errno in _DISK_FULL_ERRNOS:
            return DiskFullError(f"{what}: disk full ({error.strerror})", key=key,
                                 path=self.file_path)
        if error.errno in (errno.ENOENT, errno.ESTALE, errno.EBADF):
            return OffloadFileMissingError(f"{what} ({error.strerror})", key=key,
                                           path=self.file_path)
        return OffloadError(f"{what} ({error.strerror})", key=key, path=self.file_path)

    def _staging_buffer(self) -> tuple[PageBuffer, int]:
        staged = getattr(self._staging, "buffer", None)
        if staged is None:
            buffer = PageBuffer.allocate(self.chunk_bytes)
            staged = self._staging.buffer = (buffer, _address_of(buffer))
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
                view = _memory_at(address, padded)
            else:
                # O_DIRECT needs aligned memory: go through this thread's staging pages.
                staging, staging_address = self._staging_buffer()
                ctypes.memmove(staging_address, address, length)
                if padded > length:
                    ctypes.memset(staging_address + length, 0, padded - length)
                view = memoryview(staging)[:padded]
            if slot.checksums is not None:
                slot.checksums[start // self.chunk_bytes] = _checksum(view[:length])
            offset = slot.byte_range.offset + start
            written = 0
            while written < padded:
                count = os.pwritev(self._fd, [view[written:]], offset + written)
                if count <= 0:
                    raise OSError(errno.EIO, "write made no progress")
                written += count
        except OffloadError as failure:
            error = failure
        except OSError as failure:
            error = self._os_error(failure, "write failed", slot.key)
        except Exception as failure:  # noqa: BLE001 - must reach the waiting thread
            error = OffloadError(f"write failed: {failure!r}", key=slot.key,
                                 path=self.file_path)
        batch.chunk_finished(error)

    def _read_chunk(self, batch, slot, start, address, length, writable) -> None:
        batch.chunk_started()
        error = None
        try:
            self._check_file(slot.key)
            padded = round_up(length, PAGE_BYTES)
            view = _memory_at(address, padded)
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
        except OffloadError as failure:
            error = failure
        except OSError as failure:
            error = self._os_error(failure, "read failed", slot.key)
        except Exception as failure:  # noqa: BLE001 - must reach the waiting thread
            error = OffloadError(f"read failed: {failure!r}", key=slot.key,
                                 path=self.file_path)
        batch.chunk_finished(error)

    # -- lifetime ------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """True once the arena's directory has been removed."""
        return not self._finalizer.alive

    def close(self) -> None:
        """Waits for queued I/O, closes the file and removes the private directory."""
        self._finalizer()
