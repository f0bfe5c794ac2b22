"""The nvme arena's transfers by Linux's native AIO: a slot written or read whole by
one I/O, a run of slots written from one staging buffer, a group of slots read by one
vectored read.

Where it sits: a part of ``NvmeArena`` (``slcompile.runtime.nvme``), between its
``write``/``read``/``read_new`` and the kernel's queue (``slcompile.runtime.nvme_aio``),
as ``NvmeTransfers`` is a part of the transfer engine.

Needs: the arena's ``_aio`` (None: none of this runs), ``_aio_bytes``, ``_fd``,
``_lock``, ``_staging_free``, ``_vectored``, ``checksums``, ``file_path``, ``write``,
``_refuse_closed``, ``_check_file`` and ``_os_error``.

Guarantees: the issuing thread copies what is not page-aligned into staging pages and
takes a write's checksums; the reaper thread checks a read's, and reports every outcome
through ``on_done``, never as an exception. A slot is marked written (``valid``) only
once all of its bytes reached the file.
"""

from __future__ import annotations

import ctypes
import logging
import os
import time
from collections.abc import Callable, Sequence

import crc32c

from .errors import CorruptDataError, OffloadError, ShortReadError
from .nvme_aio import IOCB_CMD_PREAD, IOCB_CMD_PREADV, IOCB_CMD_PWRITE
from .nvme_io import IoBatch, IoOutcome, NvmeSlot, first_in_batch
from .page_buffers import PageBuffer, address_of, copy_memory, fill_memory, memory_at
from .tiers import PAGE_BYTES

__all__ = ["AioTransfers"]

log = logging.getLogger(__name__)

_IOV_MAX = 1024  # buffers one vectored read takes (Linux's UIO_MAXIOV)
_STAGING_KEPT = 64  # staging buffers of one size kept for reuse


def _begin(on_start: Callable[[float], None] | None) -> float:
    """Now, told to `on_start` (a transfer's first I/O starts)."""
    now = time.perf_counter()
    if on_start is not None:
        on_start(now)
    return now


def _checksum(view: memoryview) -> int:
    # CRC-32C in hardware (SSE4.2 / ARMv8 CRC) where there is one; the GIL is
    # released for large buffers, so I/O threads checksum in parallel with compute.
    return crc32c.crc32c(view)


class AioTransfers:
    """The native-AIO transfers of ``NvmeArena``."""

    def write_run(
        self,
        slots: Sequence[NvmeSlot],
        sources: Sequence[tuple[int, int]],
        on_done: Callable[[IoOutcome], None],
        *,
        on_start: Callable[[float], None] | None = None,
    ) -> None:
        """Writes `sources`, `(address, readable bytes)` each, into `slots` from
        `allocate_run` (in its order), as `write` writes one: where native AIO takes
        the run whole (at most `AIO_MAX_BYTES` and one chunk), copied into one staging
        buffer and written by one I/O; otherwise slot by slot. `on_done` is called once,
        with the run's outcome (every slot valid, or the first error)."""
        self._refuse_closed(slots[0].key)
        padded = slots[-1].byte_range.offset + slots[-1].byte_range.size - slots[0].byte_range.offset
        if padded > self._aio_bytes or len(slots) == 1:
            self._write_each(slots, sources, on_done, on_start)
            return
        staging = None
        try:
            if first_in_batch(self):
                self._check_file(slots[0].key)
            staging = self._take_staging(padded)
            base, first = address_of(staging), slots[0].byte_range.offset
            with memoryview(staging) as view:
                for slot, (address, _) in zip(slots, sources):
                    at = slot.byte_range.offset - first
                    copy_memory(base + at, address, slot.nbytes)
                    if slot.byte_range.size > slot.nbytes:
                        fill_memory(base + at + slot.nbytes, 0, slot.byte_range.size - slot.nbytes)
                    slot.checksums = [_checksum(view[at:at + slot.nbytes])] if self.checksums else None
        except Exception as failure:  # noqa: BLE001 - reported as the write's outcome
            if staging is not None:
                self._give_staging(staging)
            self._fail(on_done, failure, slots[0].key)
            return
        start = _begin(on_start)

        def complete(result: int, end: float) -> None:
            self._give_staging(staging)
            outcome = self._aio_outcome(start, end, result, "write", slots[0].key)
            if outcome.error is None and result < padded:
                outcome.error = OffloadError(f"wrote {result} of {padded} bytes", key=slots[0].key,
                                             path=self.file_path)
            if outcome.error is None:
                for slot in slots:
                    slot.valid = True
            on_done(outcome)

        self._aio.issue((self._fd, IOCB_CMD_PWRITE, base, padded, slots[0].byte_range.offset, complete))

    def _write_each(self, slots, sources, on_done, on_start) -> None:
        """`write_run` slot by slot: the slots' writes as the chunks of one `IoBatch`
        (`on_start` once, `on_done` once after the last, with the first error)."""
        batch = IoBatch(len(slots), on_start, on_done, None)
        for slot, (address, readable) in zip(slots, sources):
            self.write(slot, address, readable, lambda outcome: batch.chunk_finished(outcome.error),
                       on_start=lambda _: batch.chunk_started())

    @property
    def vectored(self) -> bool:
        """Whether native AIO here reads a group of slots into several buffers by one
        I/O (`read_groups`, `read_run`)."""
        return self._vectored

    def read_groups(self, slots: Sequence[NvmeSlot]) -> list[list[int]]:
        """Indices of `slots` in groups that cover them, each a set of slots that
        `read_run` reads with one I/O: slots that follow each other in the file (as
        `allocate_run` makes them), in file order, at most `aio_bytes` in all; every
        other slot alone."""
        if len(slots) < 2:
            return [[index] for index in range(len(slots))]
        groups: list[list[int]] = []
        end = total = None
        for index in sorted(range(len(slots)), key=lambda index: slots[index].byte_range.offset):
            slot = slots[index]
            size = slot.byte_range.size
            if (slot.byte_range.offset != end or total + size > self._aio_bytes
                    or len(groups[-1]) >= _IOV_MAX or slot.nbytes > self._aio_bytes):
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
        page, the slot's padded size writable there) by one vectored native AIO read.
        `on_done(outcome, failed)` runs once, on the reaper thread (or here, when the
        read cannot start): `outcome.error` fails every slot; `failed` maps a slot's
        index to its own error (a short read, a checksum that does not match).

        Raises:
            OffloadError: a slot is not (or no longer) completely written.
            ArenaClosedError: the arena is closed.
        """
        self._refuse_closed(slots[0].key)
        for slot in slots:
            if not slot.valid:
                raise OffloadError("slot is not completely written; refusing to read it", key=slot.key,
                                   path=self.file_path)
        first = slots[0].byte_range.offset
        try:
            if first_in_batch(self):
                self._check_file(slots[0].key)
        except OffloadError as failure:
            outcome = IoOutcome()
            outcome.error = failure
            on_done(outcome, {})
            return
        vectors = (ctypes.c_uint64 * (2 * len(slots)))()
        vectors[0::2] = addresses
        vectors[1::2] = [slot.byte_range.size for slot in slots]
        start = time.perf_counter()

        def complete(result: int, end: float) -> None:
            outcome = self._aio_outcome(start, end, result, "read", slots[0].key)
            failed: dict[int, OffloadError] = {}
            if outcome.error is None:
                offset = 0
                for index, (slot, address) in enumerate(zip(slots, addresses)):
                    error = self._read_error(slot, address, result - offset)
                    if error is not None:
                        failed[index] = error
                    offset += slot.byte_range.size
            on_done(outcome, failed)

        # The kernel copies the vectors at submission; `complete` holds them until then.
        complete.vectors = vectors
        self._aio.issue((self._fd, IOCB_CMD_PREADV, ctypes.addressof(vectors), len(slots), first, complete))

    def _probe_vectored_reads(self) -> bool:
        """Whether native AIO here takes a vectored read: asked of the kernel with a
        read of one page, before the arena's first transfer."""
        if self._aio is None:
            return False
        page = self._take_staging(PAGE_BYTES)
        try:
            vectored = self._aio.reads_vectored(self._fd, address_of(page))
        finally:
            self._give_staging(page)
        if not vectored:
            log.info("native AIO takes no vectored reads here; each slot of a run is read alone")
        return vectored

    # -- native AIO (small transfers) -----------------------------------------

    def _fail(self, on_done: Callable[[IoOutcome], None], failure: Exception, key: str) -> None:
        outcome = IoOutcome()
        outcome.error = failure if isinstance(failure, OffloadError) else OffloadError(
            f"I/O failed: {failure!r}", key=key, path=self.file_path)
        on_done(outcome)

    def _aio_write(self, slot, address, readable, on_done, on_start) -> None:
        nbytes, padded = slot.nbytes, slot.byte_range.size
        staging = None
        try:
            if first_in_batch(self):
                self._check_file(slot.key)
            if address % PAGE_BYTES or readable < padded:
                staging = self._take_staging(padded)
                staged = address_of(staging)
                copy_memory(staged, address, nbytes)
                if padded > nbytes:
                    fill_memory(staged + nbytes, 0, padded - nbytes)
                address = staged
            if slot.checksums is not None:
                slot.checksums[0] = _checksum(memory_at(address, nbytes))
        except Exception as failure:  # noqa: BLE001 - reported as the write's outcome
            if staging is not None:
                self._give_staging(staging)
            self._fail(on_done, failure, slot.key)
            return
        start = _begin(on_start)

        def complete(result: int, end: float) -> None:
            if staging is not None:
                self._give_staging(staging)
            outcome = self._aio_outcome(start, end, result, "write", slot.key)
            if outcome.error is None and result < padded:
                outcome.error = OffloadError(f"wrote {result} of {padded} bytes", key=slot.key,
                                             path=self.file_path)
            on_done(outcome)

        self._aio.issue((self._fd, IOCB_CMD_PWRITE, address, padded, slot.byte_range.offset, complete))

    def _aio_read(self, slot, address, on_done, on_start) -> None:
        padded, offset = slot.byte_range.size, slot.byte_range.offset
        try:
            if first_in_batch(self):  # once per run of transfers
                self._check_file(slot.key)
        except OffloadError as failure:
            self._fail(on_done, failure, slot.key)
            return
        start = _begin(on_start)

        def complete(result: int, end: float) -> None:
            outcome = self._aio_outcome(start, end, result, "read", slot.key)
            if outcome.error is None:
                outcome.error = self._read_error(slot, address, result)
            on_done(outcome)

        self._aio.issue((self._fd, IOCB_CMD_PREAD, address, padded, offset, complete))

    def _read_error(self, slot: NvmeSlot, address: int, got: int) -> OffloadError | None:
        """What is wrong with a slot read into `address`, of which `got` bytes (the
        tensor's own first) came back: a short read, a checksum that does not match,
        or nothing."""
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

    def _aio_outcome(self, start: float, end: float, result: int, what: str, key: str) -> IoOutcome:
        """The outcome of a native AIO transfer that returned `result` (bytes, or -errno)."""
        outcome = IoOutcome()
        outcome.start, outcome.end = start, end
        if result < 0:
            outcome.error = self._os_error(OSError(-result, os.strerror(-result)), f"{what} failed", key)
        return outcome

    def _take_staging(self, nbytes: int) -> PageBuffer:
        with self._lock:
            free = self._staging_free.get(nbytes)
            if free:
                return free.pop()
        return PageBuffer.allocate(nbytes)

    def _give_staging(self, buffer: PageBuffer) -> None:
        with self._lock:
            free = self._staging_free.setdefault(len(buffer), [])
            if len(free) < _STAGING_KEPT:
                free.append(buffer)
                return
        buffer.close()
