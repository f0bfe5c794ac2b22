"""What a transfer engine holds: its keys' entries, the memory they rest in, and the
bookkeeping that releases that memory once nothing uses it.

Where it sits: one ``Ledger`` per ``TransferEngine`` (``slcompile.runtime.storage.engine``),
held by the engine and by the two parts it is made of, its nvme store
(``slcompile.runtime.storage.nvme_store``) and its host copier
(``slcompile.runtime.storage.host_copier``). They reach one another's state only through it.

Guarantees:
- One lock (``lock``) guards the entries and every entry's readers, slot and blocks.
- ``install`` makes an entry its key's and retires what the key held; a retired entry
  gives back its nvme slot, host block and device tensor once no load reads it and its
  store is done (``release_if_unused``), and the tiers' resident bytes drop then.
- The nvme arena and the host pool are made on first use, from the options the
  engine was made with; once the ledger is gone (its engine and every transfer in
  flight), the arena's directory and I/O threads go and the tiers stop counting what
  its keys held.
"""

from __future__ import annotations

import itertools
import threading
import weakref
from collections.abc import Callable

import torch

from ..errors import OffloadError
from ..finalizing import when_safe
from .handles import TransferHandle, _Entry
from .nvme import NvmeArena, NvmeSlot, PageBufferCache
from ..stats import Recorder
from .tiers import HostPool, Tier

__all__ = ["Ledger"]


class Ledger:
    """The entries of one engine by key, and the memory they rest in.

    Args:
        device: The compute device.
        recorder: Where bytes, stalls and events are counted.
        make_arena: Makes the nvme arena (on the first nvme transfer); refers to no
            engine, so that the engine goes when nothing holds it.
        make_pool: Makes the host pool (on the first host-tier store or reservation).
        buffers: The page-aligned memory nvme loads land in, kept for reuse.
        host_copies: Whether the host tier is memory of its own, which moves between it
            and the device copy (a CUDA machine; a CPU machine's `separate_host`).
    """

    def __init__(self, device: torch.device, recorder: Recorder, make_arena: Callable[[], NvmeArena],
                 make_pool: Callable[[], HostPool], buffers: PageBufferCache, host_copies: bool):
        self.device = device
        self.cuda = device.type == "cuda"
        self.host_copies = host_copies
        self.recorder = recorder
        self.lock = threading.RLock()
        self.entries: dict[str, _Entry] = {}
        self.ids = itertools.count(1)  # transfer handles' numbers
        self.buffers = buffers
        self.arena: NvmeArena | None = None
        self.host_pool: HostPool | None = None
        self._make_arena = make_arena
        self._make_pool = make_pool
        self._close_arena: weakref.finalize | None = None
        # Once the ledger is gone, the tiers stop counting what its keys held.
        weakref.finalize(self, when_safe, _uncount, self.entries, recorder).atexit = False

    # -- memory ----------------------------------------------------------------

    def get_arena(self, key: str | None) -> NvmeArena:
        """The nvme arena, made now if there is none; its errors name `key`."""
        with self.lock:
            if self.arena is None:
                try:
                    self.arena = self._make_arena()
                except OffloadError as error:
                    raise (error.with_key(key) if key is not None else error) from error
                # Removes the directory and stops the I/O threads when the ledger goes.
                self._close_arena = weakref.finalize(self, when_safe, self.arena.close)
            return self.arena

    def pool(self) -> HostPool:
        """The host pool, made now if there is none."""
        with self.lock:
            if self.host_pool is None:
                self.host_pool = self._make_pool()
            return self.host_pool

    def forget_arena(self) -> Callable[[], None] | None:
        """Drops the arena (a later transfer makes a new one); returns what closes it."""
        with self.lock:
            self.arena = None
            close, self._close_arena = self._close_arena, None
        return close

    def tier_of(self, tensor: torch.Tensor) -> Tier:
        """The tier a tensor's memory belongs to: device if on the compute device,
        else host."""
        return Tier.DEVICE if tensor.device.type == self.device.type else Tier.HOST

    # -- entries ---------------------------------------------------------------

    def install(self, entry: _Entry) -> None:
        self.install_many((entry,))

    def install_many(self, entries) -> None:
        """Makes each entry its key's, retiring what the key held before."""
        with self.lock:
            installed = self.entries
            for entry in entries:
                old = installed.get(entry.key)
                installed[entry.key] = entry
                if old is not None:
                    self.retire(old)

    def retire(self, entry: _Entry) -> None:
        with self.lock:
            entry.retired = True
            self.release_if_unused(entry)

    def release_if_unused(self, entry: _Entry) -> None:
        """Gives back what a retired entry rests in, once no load reads it and its
        store is done."""
        with self.lock:
            if not entry.retired or entry.readers > 0:
                return
            if entry.store_handle is not None and not entry.store_handle.done():
                return
            slot, entry.slot = entry.slot, None
            tensor, entry.tensor = entry.tensor, None
            block, entry.host_block = entry.host_block, None
            event, entry.last_event = entry.last_event, None
        if slot is not None and not slot.released:
            self.release_slot(slot)
            self.recorder.resident_change(Tier.NVME, -entry.nbytes)
        if tensor is not None:
            self.recorder.resident_change(entry.tier, -entry.nbytes)
        if block is not None:
            if event is not None:
                event.synchronize()
            if entry.host_group is not None:
                entry.host_group.release_member(self.host_pool)
            else:
                self.host_pool.release(block)
            self.recorder.resident_change(Tier.HOST, -entry.nbytes)

    def fail_entry(self, entry: _Entry, error: OffloadError) -> None:
        """Marks an entry's store failed; its slot goes back at once."""
        with self.lock:
            entry.error = error
            slot, entry.slot = entry.slot, None
        if slot is not None:
            self.release_slot(slot)
            self.recorder.resident_change(Tier.NVME, -entry.nbytes)

    def release_slot(self, slot: NvmeSlot) -> None:
        # A transfer that finishes while `close` waits for the arena's I/O finds it
        # gone from the engine: its file goes with it.
        arena = self.arena
        if arena is not None:
            arena.release(slot)

    def track_delivered(self, owner: object, tier: Tier, nbytes: int) -> None:
        """Counts `nbytes` resident on `tier` for as long as `owner` lives."""
        self.recorder.resident_change(tier, nbytes)
        weakref.finalize(owner, when_safe, self.recorder.resident_change, tier, -nbytes)

    def load_finished(self, handle: TransferHandle, entry: _Entry, result, error) -> None:
        """A load of `entry` is done: one reader fewer, and its handle finished."""
        with self.lock:
            entry.readers -= 1
        self.release_if_unused(entry)
        handle._finish(result, error)


def _uncount(entries: dict[str, _Entry], recorder: Recorder) -> None:
    """Takes what the keys of a ledger that is gone held off the tiers' resident bytes."""
    for entry in entries.values():
        if entry.slot is not None and not entry.slot.released:
            recorder.resident_change(Tier.NVME, -entry.nbytes)
        if entry.tensor is not None:
            recorder.resident_change(entry.tier, -entry.nbytes)
        if entry.host_block is not None:
            recorder.resident_change(Tier.HOST, -entry.nbytes)
