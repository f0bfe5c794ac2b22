"""The nvme arena's I/O: its threads, the chunks of one slot transfer, their outcome.

Where it sits: below the nvme arena (``slcompile.runtime.storage.nvme``), which cuts each
slot write or read into chunks and submits them here.

Guarantees:
- ``IoThreads.submit`` costs the submitting thread one queue put; the threads start
  with the first submission and ``shutdown`` runs what was queued, then stops them.
- Within ``batched()``, what a thread submits is held back until the outermost
  ``batched()`` ends, then queued in order to the I/O threads as jobs of about
  ``JOB_BYTES`` each: a run of small transfers wakes one I/O thread, not one per
  transfer.
- An ``IoBatch`` reports once, from the last of its chunks to finish, with the
  first error any chunk had; ``on_start`` runs once, when the first chunk starts.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator

from ..errors import OffloadError
from .ranges import ByteRange

__all__ = ["NvmeSlot", "IoOutcome", "IoBatch", "IoThreads", "batched", "defer", "JOB_BYTES"]

log = logging.getLogger(__name__)

JOB_BYTES = 1 << 20
"""Bytes of I/O one job of a ``batched()`` run holds before the next job starts (a
larger transfer is a job of its own chunks, which the threads share)."""

# What a thread holds back while inside `batched()`: (sink, payload).
_deferred = threading.local()


@contextlib.contextmanager
def batched() -> Iterator[None]:
    """Holds back the I/O this thread submits (``IoThreads.submit``) until the end of the outermost ``batched()``, then queues it
    (see the module's guarantees). Nothing may wait inside it for I/O issued inside
    it."""
    if getattr(_deferred, "items", None) is not None:
        yield
        return
    _deferred.items, _deferred.seen = [], set()
    try:
        yield
    finally:
        items, _deferred.items, _deferred.seen = _deferred.items, None, None
        _queue_jobs(items)


def _queue_jobs(items: list) -> None:
    by_sink: dict = {}
    for sink, payload in items:
        by_sink.setdefault(sink, []).append(payload)
    for sink, payloads in by_sink.items():
        sink.flush_deferred(payloads)



def defer(sink, payload) -> bool:
    """Holds `payload` back for `sink.flush_deferred` when this thread is inside
    ``batched()``; False (nothing held) outside it."""
    deferred = getattr(_deferred, "items", None)
    if deferred is None:
        return False
    deferred.append((sink, payload))
    return True


def _run_each(calls: list) -> None:
    for fn, args in calls:
        try:
            fn(*args)
        except BaseException:  # noqa: BLE001 - a chunk reports its own errors; this is a bug
            log.exception("nvme I/O task %r failed", fn)


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


class IoBatch:
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


class IoThreads:
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

    def submit(self, fn: Callable[..., None], *args, nbytes: int = 0) -> None:
        """Queues `fn(*args)`, moving `nbytes` (how ``batched()`` cuts its jobs)."""
        if self._closed:
            raise RuntimeError("the nvme arena's I/O threads are shut down")
        if defer(self, (fn, args, nbytes)):
            return
        if not self._threads:
            self._start()
        self._queue.put((fn, args))

    def flush_deferred(self, payloads: list) -> None:
        """Queues what ``batched()`` held back, `(fn, args, nbytes)` each, as jobs of
        about ``JOB_BYTES``."""
        jobs: list[list] = []
        for fn, args, nbytes in payloads:
            if not jobs or jobs[-1][0] >= JOB_BYTES or nbytes >= JOB_BYTES:
                jobs.append([0, []])
            jobs[-1][0] += nbytes
            jobs[-1][1].append((fn, args))
        for _, calls in jobs:
            if len(calls) == 1:
                fn, args = calls[0]
                self.submit(fn, *args)
            else:
                self.submit(_run_each, calls)

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
