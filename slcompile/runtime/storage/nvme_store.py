"""The transfer engine's nvme tier: stores into arena slots and loads out of them.

Where it sits: one ``NvmeStore`` per ``TransferEngine`` (``slcompile.runtime.storage.engine``),
which holds it, between the engine's public ``store``/``load`` and the ``NvmeArena``
(``slcompile.runtime.storage.nvme``) whose I/O threads do the reads and writes.

Needs: the engine's ``Ledger`` (``slcompile.runtime.storage.ledger``: its entries, its arena,
the page-aligned memory loads land in, the host pool and the bookkeeping) and, on a
CUDA machine, its ``HostCopier`` for the staging copies.

Guarantees: a store writes straight from the source's memory (on CUDA from a pinned
staging block the copy stream fills) and leaves the entry failed if the write fails;
a load reads into the caller's ``into``, into reused page-aligned memory, or on a CPU
machine into memory made on the I/O thread that reads it (a run's members that follow
each other in the file: into memory taken on the issuing thread, one read for them
all, their tensors made on the I/O thread that read them). Errors of a load reach the
waiting thread through its handle, never as an exception on an I/O thread. Every
finished transfer is counted and put on the ``"store"`` or ``"load"`` lane.
"""

from __future__ import annotations

import functools
import logging
import time

import torch

from ..errors import OffloadError, TransferFailedError
from .handles import TransferHandle, _Entry
from .host_copier import HostCopier
from .ledger import Ledger
from .nvme_io import IoOutcome, NvmeSlot, batched
from .page_buffers import address_of, profiler_sees_buffers
from .tiers import Tier

__all__ = ["NvmeStore"]

log = logging.getLogger(__name__)


class NvmeStore:
    """The nvme-tier stores and loads of a ``TransferEngine``.

    Args:
        ledger: The engine's entries and memory (its arena, made on first use).
        host: The engine's host copier: on a CUDA machine an nvme transfer is staged
            in pinned host memory by the copy stream.
    """

    def __init__(self, ledger: Ledger, host: HostCopier):
        self._ledger = ledger
        self._host = host

    def store(self, handle: TransferHandle, entry: _Entry, source: torch.Tensor,
                    reserved: NvmeSlot | None = None) -> None:
        arena = self._ledger.get_arena(handle.key)
        if entry.nbytes == 0:
            self._ledger.install(entry)
            now = time.perf_counter()
            self._ledger.recorder.transfer_finished(
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
        self._ledger.recorder.resident_change(Tier.NVME, entry.nbytes)
        before = None
        block = None
        if source.device.type == "cuda":
            block = self._ledger.pool().allocate(slot.byte_range.size, handle.key)
            event = self._host.copy_to_host(source, block, entry)
            handle._cuda_event = event
            before = event.synchronize
            address, readable = block.buffer.data_ptr(), block.byte_range.size
        else:
            address, readable = _place(source)
        self._ledger.install(entry)

        # The I/O thread reaches the source only through `handle._keep`: no frame of
        # its own may hold it once the waiting thread wakes (see `_finish`).
        def on_done(outcome: IoOutcome) -> None:
            if block is not None:
                self._ledger.host_pool.release(block)
            self._store_nvme_done(handle, entry, outcome)

        try:
            arena.write(slot, address, readable, on_done,
                        on_start=lambda now: self._ledger.recorder.lane_begin("store", now),
                        before=before)
        except OffloadError as error:
            if block is not None:
                self._ledger.host_pool.release(block)
            self._ledger.fail_entry(entry, error)
            handle._finish(None, error)
            raise

    def store_run(self, handles: list[TransferHandle], entries: list[_Entry],
                        sources: list[torch.Tensor]) -> None:
        """Stores of CPU tensors (each of at least one byte) into consecutive slots,
        written together (`NvmeArena.write_run`)."""
        arena = self._ledger.get_arena(handles[0].key)
        slots = arena.allocate_run([entry.nbytes for entry in entries], [handle.key for handle in handles])
        places = []
        for handle, entry, source, slot in zip(handles, entries, sources, slots):
            entry.slot = slot
            entry.store_handle = handle
            handle._keep = source
            # Readable: the tensor's own bytes. A run is staged whole, or slot by slot
            # where it is written so (a source short of its padded slot is staged).
            places.append((source.data_ptr(), entry.nbytes))
        self._ledger.recorder.resident_change(Tier.NVME, sum(entry.nbytes for entry in entries))
        self._ledger.install_many(entries)

        def on_done(outcome: IoOutcome) -> None:
            if outcome.start is not None:
                self._ledger.recorder.lane_end("store", outcome.end)
            if outcome.error is None:
                self._stores_finished(handles, entries, outcome)
                return
            for handle, entry in zip(handles, entries):
                self._store_nvme_finished(handle, entry, outcome)

        try:
            arena.write_run(slots, places, on_done, on_start=lambda now: self._ledger.recorder.lane_begin("store", now))
        except OffloadError as error:
            for handle, entry in zip(handles, entries):
                self._ledger.fail_entry(entry, error)
                handle._finish(None, error)
            raise

    def _stores_finished(self, handles: list[TransferHandle], entries: list[_Entry], outcome: IoOutcome) -> None:
        """`_store_nvme_finished` of each store of a run that one write did well."""
        self._ledger.recorder.transfers_finished(handles, handles[0].source, Tier.NVME, outcome.start, outcome.end, "store")
        self._stores_settled(handles, entries)

    def _store_nvme_done(self, handle, entry, outcome: IoOutcome) -> None:
        if outcome.start is not None:
            self._ledger.recorder.lane_end("store", outcome.end)
        self._store_nvme_finished(handle, entry, outcome)

    def _store_nvme_finished(self, handle, entry, outcome: IoOutcome) -> None:
        if outcome.error is not None:
            log.warning("store of %r failed: %s", handle.key, outcome.error)
            self._ledger.fail_entry(entry, outcome.error)
        else:
            self._ledger.recorder.transfer_finished(
                (handle.kind, handle.source, Tier.NVME), handle.nbytes,
                outcome.start, outcome.end, "store", handle.label,
            )
        self._stores_settled([handle], [entry], outcome.error)

    def _stores_settled(self, handles: list[TransferHandle], entries: list[_Entry],
                        error: OffloadError | None = None) -> None:
        """Finishes the handles of stores whose I/O is over (with `error`, if it failed)
        and releases what a retired entry no longer needs."""
        for handle in handles:
            handle._finish(None if error is not None or handle.forget_source else handle._keep, error)
        with self._ledger.lock:
            # A finished store's handle holds its source: the entry keeps only the slot,
            # or an entry resting on nvme would hold its tensor in memory as well.
            for handle, entry in zip(handles, entries):
                if entry.store_handle is handle:
                    entry.store_handle = None
        for entry in entries:
            if entry.retired:  # one retired later is released by its `_retire`
                self._ledger.release_if_unused(entry)

    def load(self, handle: TransferHandle, entry: _Entry, into: torch.Tensor | None = None) -> None:
        # May run on an I/O thread (chained after a store): report errors, never raise.
        try:
            if entry.error is not None:
                raise TransferFailedError(
                    f"the store this load waited for failed ({entry.error.reason})",
                    key=handle.key, path=entry.error.path,
                )
            if entry.nbytes == 0:
                result = torch.empty(entry.shape, dtype=entry.dtype, device=self._ledger.device)
                now = time.perf_counter()
                self._ledger.recorder.transfer_finished(
                    (handle.kind, Tier.NVME, Tier.DEVICE), 0, now, now, "load", handle.label
                )
                self._ledger.load_finished(handle, entry, result, None)
                return
            slot = entry.slot
            if self._ledger.cuda:
                result = into
                if result is None:
                    result = torch.empty(entry.shape, dtype=entry.dtype, device=self._ledger.device)
                    self._ledger.track_delivered(result, Tier.DEVICE, entry.nbytes)
                block = self._ledger.pool().allocate(slot.byte_range.size, handle.key)
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
                    self._ledger.recorder.resident_change(Tier.DEVICE, nbytes)
                    result = self._ledger.buffers.tensor(
                        nbytes, entry.dtype, entry.shape,
                        on_release=lambda: self._ledger.recorder.resident_change(Tier.DEVICE, -nbytes),
                    )
                storage = result.untyped_storage()
                address = result.data_ptr()
                writable = storage.nbytes() - (address - storage.data_ptr())

            def on_done(outcome: IoOutcome) -> None:
                if outcome.start is not None:
                    self._ledger.recorder.lane_end("load", outcome.end)
                error = outcome.error
                if error is None and block is not None:
                    self._host.copy_from_host(result, block, entry, wait=True)
                if block is not None:
                    self._ledger.host_pool.release(block)
                if error is None:
                    self._ledger.recorder.transfer_finished(
                        (handle.kind, Tier.NVME, Tier.DEVICE), handle.nbytes,
                        outcome.start, outcome.end, "load", handle.label,
                    )
                self._ledger.load_finished(handle, entry, None if error else result, error)

            self._ledger.arena.read(slot, address, writable, on_done,
                             on_start=lambda now: self._ledger.recorder.lane_begin("load", now))
        except OffloadError as error:
            self._ledger.load_finished(handle, entry, None, error)
        except Exception as error:  # noqa: BLE001 - must reach the waiting thread
            self._ledger.load_finished(
                handle, entry, None,
                TransferFailedError(f"load could not start: {error!r}", key=handle.key),
            )

    def load_new_run(self, loads: list[tuple[TransferHandle, _Entry]]) -> None:
        """`_load_nvme_new` of each (handle, entry), issued together: the memory they take is counted and the load lane started
        once for the run; the slots that follow each other in the arena file (a run of
        stores, in any order) are read by one I/O each (`_load_nvme_group`)."""
        recorder, arena = self._ledger.recorder, self._ledger.arena
        recorder.resident_change(Tier.DEVICE, sum(entry.nbytes for _, entry in loads))
        groups = arena.read_groups([entry.slot for _, entry in loads])
        recorder.lane_begin("load", time.perf_counter(), len(groups))
        with batched():  # one job of the I/O threads, or a few of about JOB_BYTES
            for group in groups:
                if len(group) == 1:
                    self._load_nvme_new(*loads[group[0]], begun=True)
                else:
                    self._load_nvme_group([loads[index] for index in group])

    def _load_nvme_group(self, loads: list[tuple[TransferHandle, _Entry]]) -> None:
        """Loads of slots that follow each other in the file, each into new memory of
        its own, by one vectored read (`NvmeArena.read_run`); counted and begun by
        `load_new_run`. The issuing thread takes the memory; the I/O thread that
        reads makes the tensors on it once the read is done."""
        recorder, buffers = self._ledger.recorder, self._ledger.buffers
        memory = []

        def fail(error: OffloadError) -> None:
            for buffer in memory:
                buffers.give_back(buffer)
            memory.clear()
            recorder.resident_change(Tier.DEVICE, -sum(entry.nbytes for _, entry in loads))
            recorder.lane_end("load", time.perf_counter())
            for handle, entry in loads:
                self._ledger.load_finished(handle, entry, None, error)

        def on_done(outcome: IoOutcome, failed: dict[int, OffloadError]) -> None:
            if outcome.error is not None:
                fail(outcome.error)
                return
            recorder.lane_end("load", outcome.end)
            recorder.transfers_finished([handle for index, (handle, _) in enumerate(loads) if index not in failed],
                                        Tier.NVME, Tier.DEVICE, outcome.start, outcome.end, "load")
            results = []
            for index, ((_, entry), buffer) in enumerate(zip(loads, memory)):
                if index in failed:
                    buffers.give_back(buffer)
                    recorder.resident_change(Tier.DEVICE, -entry.nbytes)
                    results.append(None)
                else:
                    results.append(buffers.wrap(buffer, entry.dtype, entry.shape, functools.partial(
                        recorder.resident_change, Tier.DEVICE, -entry.nbytes)))
            memory.clear()
            with self._ledger.lock:
                for _, entry in loads:
                    entry.readers -= 1
                retired = [entry for _, entry in loads if entry.retired]
            for entry in retired:
                self._ledger.release_if_unused(entry)
            for index, ((handle, _), result) in enumerate(zip(loads, results)):
                handle._finish(result, failed.get(index))
            results.clear()

        try:
            for _, entry in loads:
                memory.append(buffers.take(entry.slot.byte_range.size))
        except Exception as failure:  # noqa: BLE001 - reported as the loads' outcome
            fail(TransferFailedError(f"load could not start: {failure!r}", key=loads[0][0].key))
            return
        try:
            self._ledger.arena.read_run([entry.slot for _, entry in loads], [address_of(buffer) for buffer in memory],
                                 on_done)
        except OffloadError as error:
            fail(error)

    def _load_nvme_new(self, handle: TransferHandle, entry: _Entry, begun: bool = False) -> None:
        """A load on a CPU machine into new page-aligned memory, made on the I/O
        thread that reads it: issuing costs the compute thread no tensor and no
        system call (`NvmeArena.read_new`). `begun`: its memory is counted and its
        load lane started already (`load_new_run`)."""
        # Residency is counted from the issue, as the memory model counts a load, and
        # lasts as long as the memory does, not as long as the handle. The release
        # callback lives as long as the memory and must not reach the entry: a state
        # loaded here and stored again would keep, through it, every earlier
        # generation of that state alive.
        nbytes, dtype, shape, recorder = entry.nbytes, entry.dtype, entry.shape, self._ledger.recorder
        if not begun:
            recorder.resident_change(Tier.DEVICE, nbytes)
        made: list[torch.Tensor] = []

        def make_destination() -> torch.Tensor:
            tensor = self._ledger.buffers.tensor(
                nbytes, dtype, shape, on_release=lambda: recorder.resident_change(Tier.DEVICE, -nbytes))
            made.append(tensor)
            return tensor

        def on_done(outcome: IoOutcome) -> None:
            if outcome.start is not None or begun:
                recorder.lane_end("load", time.perf_counter() if outcome.end is None else outcome.end)
            if not made:  # failed before its memory was made
                recorder.resident_change(Tier.DEVICE, -nbytes)
            error = outcome.error
            if error is None:
                recorder.transfer_finished((handle.kind, Tier.NVME, Tier.DEVICE), handle.nbytes,
                                           outcome.start, outcome.end, "load", handle.label)
            self._ledger.load_finished(handle, entry, None if error else made[0], error)

        try:
            self._ledger.arena.read_new(entry.slot, make_destination, on_done,
                                 on_start=None if begun else lambda now: recorder.lane_begin("load", now))
        except BaseException:
            recorder.resident_change(Tier.DEVICE, -nbytes)
            if begun:
                recorder.lane_end("load", time.perf_counter())
            raise


def _place(source: torch.Tensor) -> tuple[int, int]:
    """(address, bytes readable from it up to its storage's end) of a CPU tensor."""
    return source.data_ptr(), source.untyped_storage().nbytes() - source.storage_offset() * source.element_size()
