"""Linux native asynchronous I/O (`io_submit`) for the nvme arena's small transfers.

Where it sits: below the nvme arena (``slcompile.runtime.nvme``), beside its I/O
threads (``nvme_io``). The arena sends a read or write that fits one I/O here, and
the rest to its threads.

Why: a Python I/O thread needs the GIL before and after each system call, and on a
CPU machine Inductor's kernels hold the GIL while they run, so a thread's small
transfer waits for gaps in the compute and every hand-over costs both threads
context switches. Here the issuing thread hands the kernel the transfers (a run of
them in one `io_submit`, see ``nvme_io.batched``) and the disk does the rest on its
own; one reaper thread, blocked in `io_getevents` without the GIL, runs the
completions of whatever finished, together.

Needs: Linux on x86-64 or AArch64 (little-endian), the syscalls allowed (a seccomp
profile may forbid them), room under `fs.aio-max-nr`; O_DIRECT descriptors,
page-aligned memory, offsets and lengths. `AioQueue.open` returns None where any of
it is missing, and the arena keeps to its threads.

Guarantees:
- ``submit`` only issues; ``on_complete(result, end)`` runs once per transfer on the
  reaper thread with the byte count or ``-errno``. A transfer the kernel refuses at
  submission, or one submitted after ``shutdown`` (``-ECANCELED``), completes the
  same way, with the error, on the submitting thread.
- A completion may submit (a load waiting for its store is issued when the store
  completes): what finds every slot in flight there waits in a backlog that the
  reaper submits as its next completions free slots, since the reaper, which alone
  frees them, cannot wait for one.
- ``shutdown`` waits for every submitted transfer to complete, then stops the
  reaper and frees the kernel context.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import logging
import os
import platform
import struct
import sys
import threading
import time
from collections.abc import Callable
from types import MappingProxyType

from .nvme_io import defer

__all__ = ["AioQueue", "IOCB_CMD_PREAD", "IOCB_CMD_PWRITE", "IOCB_CMD_PREADV", "aio_default", "AIO_ENV",
           "inode_holding_gil"]

log = logging.getLogger(__name__)

AIO_ENV = "SLC_AIO"
IOCB_CMD_PREAD, IOCB_CMD_PWRITE = 0, 1
# A vectored read: `buf` holds the address of an iovec array, `nbytes` its length.
IOCB_CMD_PREADV = 7
# (io_setup, io_destroy, io_getevents, io_submit)
_SYSCALLS = MappingProxyType({"x86_64": (206, 207, 208, 209), "aarch64": (0, 1, 4, 2)})
# newfstatat; both machines' `struct stat` hold `st_ino` at byte 8 (after `st_dev`).
_FSTATAT = MappingProxyType({"x86_64": 262, "aarch64": 79})
_AT_SYMLINK_NOFOLLOW = 0x100
_DEPTH = 1024  # transfers in flight at once
_REAP = 256  # completions read at once


def aio_default() -> bool:
    """Whether arenas use native asynchronous I/O where the machine has it: yes,
    unless the environment variable ``SLC_AIO`` is ``0`` (or ``false``/``no``/``off``)."""
    return os.environ.get(AIO_ENV, "1").strip().lower() not in ("0", "false", "no", "off")


# struct iocb of linux/aio_abi.h (little-endian): data, key, rw_flags, opcode, reqprio,
# fildes, buf, nbytes, offset, reserved2, flags, resfd; and struct io_event.
_IOCB = struct.Struct("<QIiHhIQQqQII")
_EVENT = struct.Struct("<QQqq")
assert _IOCB.size == 64 and _EVENT.size == 32


class _Timespec(ctypes.Structure):
    _fields_ = [("sec", ctypes.c_long), ("nsec", ctypes.c_long)]


_syscalls: dict[bool, Callable] = {}


def _libc_syscall(hold_gil: bool = False):
    """libc's `syscall`: a CDLL call releases the GIL; a PyDLL call (`hold_gil`) keeps it."""
    if hold_gil not in _syscalls:
        function = (ctypes.PyDLL if hold_gil else ctypes.CDLL)(None, use_errno=True).syscall
        function.restype = ctypes.c_long
        _syscalls[hold_gil] = function
    return _syscalls[hold_gil]


def inode_holding_gil(dir_fd: int, name: str) -> int | None:
    """The inode number of `name` in the directory `dir_fd` (not following a link),
    None where there is no such file, by a system call that keeps the GIL: on the
    compute thread, `os.stat` would hand the GIL to the reaper, whose completions then
    run before the caller's transfer op goes on. Falls back to `os.stat` off Linux on
    x86-64 and AArch64.

    Raises:
        OSError: the call failed for another reason.
    """
    number = _FSTATAT.get(platform.machine()) if sys.platform == "linux" else None
    if number is None:
        try:
            return os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_ino
        except FileNotFoundError:
            return None
    info = ctypes.create_string_buffer(256)
    if _libc_syscall(hold_gil=True)(number, dir_fd, name.encode(), info, _AT_SYMLINK_NOFOLLOW) != 0:
        failure = ctypes.get_errno()
        if failure == errno.ENOENT:
            return None
        raise OSError(failure, os.strerror(failure))
    return struct.unpack_from("<Q", info, 8)[0]


class AioQueue:
    """One kernel AIO context and its reaper thread."""

    def __init__(self, context: int, numbers: tuple[int, int, int, int]):
        self._context = ctypes.c_ulong(context)
        self._setup, self._destroy, self._getevents, self._submit = numbers
        self._syscall = _libc_syscall()
        # `io_submit` keeps the GIL: it returns in tens of microseconds, and released,
        # the GIL would let the reaper run earlier completions' Python in the middle of
        # the compute thread's transfer op (which waits for it), not while that thread
        # blocks in a wait.
        self._submit_call = _libc_syscall(hold_gil=True)
        # One iocb per transfer in flight, in slots of one buffer, written by `_IOCB`
        # (cheaper than a ctypes structure per transfer); slot -> its on_complete.
        self._blocks = ctypes.create_string_buffer(_DEPTH * _IOCB.size)
        self._base = ctypes.addressof(self._blocks)
        self._free = list(range(_DEPTH))
        self._pending: dict[int, Callable[[int, float], None]] = {}
        # What the reaper submitted while every slot was in flight, in order.
        self._backlog: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._reaper: threading.Thread | None = None
        self._closed = False

    @classmethod
    def open(cls) -> AioQueue | None:
        """A new queue, or None (logged) where the machine offers no native AIO."""
        numbers = _SYSCALLS.get(platform.machine())
        if sys.platform != "linux" or numbers is None or sys.byteorder != "little":
            log.debug("no native AIO on %s %s", sys.platform, platform.machine())
            return None
        context = ctypes.c_ulong(0)
        if _libc_syscall()(numbers[0], _DEPTH, ctypes.byref(context)) != 0:
            log.info("native AIO unavailable (io_setup: %s); the nvme tier uses its I/O threads",
                     os.strerror(ctypes.get_errno()))
            return None
        return cls(context.value, numbers)

    def issue(self, request: tuple[int, int, int, int, int, Callable[[int, float], None]]) -> None:
        """Issues one `(fd, opcode, address, nbytes, offset, on_complete)`, or holds it
        back until the end of this thread's ``nvme_io.batched()``."""
        if not defer(self, request):
            self.submit([request])

    def flush_deferred(self, requests: list) -> None:
        self.submit(requests)

    def reads_vectored(self, fd: int, address: int) -> bool:
        """Whether the kernel takes a vectored read (`IOCB_CMD_PREADV`) of `fd`: one
        page read at offset 0 into the page at `address`, submitted and reaped on this
        thread. Call it before anything else is submitted (no reaper runs yet)."""
        vectors = (ctypes.c_uint64 * 2)(address, 4096)
        block = ctypes.create_string_buffer(_IOCB.size)
        # Its `data` names no slot: were it ever reaped by the reaper, it would be ignored.
        _IOCB.pack_into(block, 0, _DEPTH, 0, 0, IOCB_CMD_PREADV, 0, fd, ctypes.addressof(vectors), 1, 0, 0, 0, 0)
        pointer = ctypes.c_uint64(ctypes.addressof(block))
        event = ctypes.create_string_buffer(_EVENT.size)
        with self._lock:
            if self._reaper is not None or self._closed:
                return False
            if self._syscall(self._submit, self._context, 1, ctypes.byref(pointer)) != 1:
                return False
            while (count := self._syscall(self._getevents, self._context, 1, 1, event, None)) < 0 \
                    and ctypes.get_errno() == errno.EINTR:
                pass
        return count == 1 and _EVENT.unpack(event.raw)[2] >= 0

    def submit(self, requests: list[tuple[int, int, int, int, int, Callable[[int, float], None]]]) -> None:
        """Issues each `(fd, opcode, address, nbytes, offset, on_complete)`, in order, in
        as few `io_submit` calls as the kernel takes them."""
        for start in range(0, len(requests), _REAP):
            self._submit_some(requests[start:start + _REAP])

    def _submit_some(self, requests: list, accepted: bool = False) -> None:
        # At most `_REAP` at once: the slots this call takes before submitting any can
        # never be all of them, so waiting for a free one always ends (on any thread but
        # the reaper's). `accepted`: backlog the reaper submits, taken before a shutdown.
        slots = []
        with self._lock:
            closed = self._closed and not accepted
            if not closed and self._reaper is None:
                self._reaper = threading.Thread(target=self._reap, name="slc-nvme-aio", daemon=True)
                self._reaper.start()
            on_reaper = self._reaper is threading.current_thread()
            for index, (fd, opcode, address, nbytes, offset, on_complete) in enumerate([] if closed else requests):
                if not self._free and on_reaper:
                    self._backlog.extend(requests[index:])
                    break
                while not self._free:
                    self._idle.wait()  # every slot in flight: the reaper frees some
                slot = self._free.pop()
                _IOCB.pack_into(self._blocks, slot * _IOCB.size, slot, 0, 0, opcode, 0, fd, address, nbytes,
                                offset, 0, 0, 0)
                self._pending[slot] = on_complete
                slots.append(slot)
        if closed:
            # Shut down (the arena is closing): each completes as cancelled, here.
            for *_, on_complete in requests:
                on_complete(-errno.ECANCELED, time.perf_counter())
            return
        if not slots:
            return
        pointers = (ctypes.c_uint64 * len(slots))(*[self._base + slot * _IOCB.size for slot in slots])
        done = 0
        while done < len(slots):
            count = self._submit_call(self._submit, self._context, len(slots) - done,
                                      ctypes.byref(pointers, done * 8))
            if count > 0:
                done += count
                continue
            failure = ctypes.get_errno() if count < 0 else errno.EIO
            if failure == errno.EAGAIN:
                time.sleep(0.0001)  # the kernel has no room until the reaper reads some
                continue
            # The kernel refused the first one left: it completes with the error.
            with self._lock:
                on_complete = self._pending.pop(slots[done])
                self._free.append(slots[done])
                self._idle.notify_all()
            on_complete(-failure, time.perf_counter())
            done += 1

    def _reap(self) -> None:
        events = ctypes.create_string_buffer(_REAP * _EVENT.size)
        view = memoryview(events).cast("B")
        on_complete = None
        timeout = _Timespec(0, 20_000_000)  # how soon an idle reaper sees `shutdown`
        while True:
            count = self._syscall(self._getevents, self._context, 1, _REAP, events, ctypes.byref(timeout))
            now = time.perf_counter()
            if count < 0 and ctypes.get_errno() != errno.EINTR:
                if not self._closed:
                    log.error("io_getevents failed: %s", os.strerror(ctypes.get_errno()))
                return
            finished = []
            with self._lock:
                for slot, _, result, _ in _EVENT.iter_unpack(view[:max(count, 0) * _EVENT.size]):
                    on_complete = self._pending.pop(slot, None)
                    if on_complete is not None:
                        finished.append((on_complete, result))
                        self._free.append(slot)
                self._idle.notify_all()
            for on_complete, result in finished:
                try:
                    on_complete(result, now)
                except BaseException:  # noqa: BLE001 - a completion reports its own errors; this is a bug
                    log.exception("nvme AIO completion %r failed", on_complete)
            # What a completion holds (a loaded tensor, its source) must not wait here for
            # the next event.
            finished = on_complete = None
            if not self._backlog and not self._closed:
                continue  # (only this thread adds to the backlog)
            with self._lock:
                backlog = [self._backlog.popleft() for _ in range(min(len(self._free), len(self._backlog)))]
                last = self._closed and not self._pending and not self._backlog and not backlog
            if backlog:
                self._submit_some(backlog, accepted=True)
            elif last:  # closed, and the last completions are delivered
                return

    def shutdown(self) -> None:
        """Waits for what was submitted, then stops the reaper and frees the context."""
        on_reaper = self._reaper is threading.current_thread()
        with self._lock:
            if self._closed:
                return
            self._closed = True
            while (self._pending or self._backlog) and self._reaper is not None and not on_reaper:
                self._idle.wait(1.0)
            reaper = self._reaper
        if reaper is not None and not on_reaper:
            reaper.join()
        self._syscall(self._destroy, self._context)
