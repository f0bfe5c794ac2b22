"""The transfer engine's copies on a CUDA machine: host and device tiers through one
copy stream.

Where it sits: a part of ``TransferEngine`` (``slcompile.runtime.engine``), which
calls these methods for the host and device tiers on a CUDA machine and, through
``_copy_to_host``/``_copy_from_host``, for the staging of nvme transfers.

Needs: the engine's ``device``, ``_copy_stream`` (one persistent stream), ``_pool()``
(the pinned ``HostPool``), ``_recorder`` and its bookkeeping (``_install``,
``_load_finished``, ``_track_delivered``).

Guarantees: copies are ``non_blocking`` on the copy stream, which first waits for
the compute stream; each transfer's handle carries the event its ``wait`` makes the
compute stream wait on. Results are allocated on the compute stream, where they are
used and freed. Host copies are counted when issued.
"""

from __future__ import annotations

import time

import torch

from .errors import OffloadError, TransferFailedError
from .handles import TransferHandle, _Entry, _typed_view
from .tiers import HostBlock, Tier

__all__ = ["CudaCopies"]


class CudaCopies:
    """The host- and device-tier transfers of ``TransferEngine`` on a CUDA machine."""

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
