"""Memory tiers, transfer kinds, and the pinned host pool.

Where it sits: the vocabulary of the runtime. The planner assigns each value a
``Tier``; the transfer engine moves values between tiers and counts bytes per
``TransferKind``.

Guarantees:
- ``device`` is where compute runs: the CUDA device when one is present, else
  the CPU.
- ``host`` is pinned RAM on a CUDA machine, handed out from one ``HostPool``
  allocated up front and reused (pinning on the fly forces synchronisations).
  On a CPU-only machine ``host`` *is* the device's memory: the engine moves
  nothing for it and counts zero bytes.
- ``nvme`` is the O_DIRECT arena of ``slcompile.runtime.nvme``; it has no torch
  device of its own (data passes through host or device buffers).
"""

from __future__ import annotations

import enum
import logging
import threading

import torch

from .errors import HostPoolFullError
from .ranges import ByteRange, RangeAllocator

__all__ = [
    "Tier",
    "TransferKind",
    "PAGE_BYTES",
    "compute_device",
    "device_for",
    "host_is_device",
    "HostPool",
    "HostBlock",
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
    KV = "kv"


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


class HostBlock:
    """One range of the host pool, with a uint8 tensor view over its bytes.

    Attributes:
        byte_range: Offset and size inside the pool.
        buffer: uint8 CPU tensor of ``byte_range.size`` bytes, page-aligned.
    """

    __slots__ = ("byte_range", "buffer")

    def __init__(self, byte_range: ByteRange, buffer: torch.Tensor):
        self.byte_range = byte_range
        self.buffer = buffer


class HostPool:
    """A pinned host buffer allocated once and handed out in page-aligned ranges.

    Every host-tier tensor and every nvme staging buffer on a CUDA machine lives
    here, so no transfer ever pins memory on the fly.

    Args:
        capacity_bytes: Size of the pool.
        pin: Pin the pool (default: when CUDA is available). Unpinned pools are
            useful for tests of the allocation logic on CPU machines.
    """

    def __init__(self, capacity_bytes: int, *, pin: bool | None = None):
        if pin is None:
            pin = torch.cuda.is_available()
        self.pinned = pin
        raw = torch.empty(capacity_bytes + PAGE_BYTES, dtype=torch.uint8, pin_memory=pin)
        # Page-align the start so every block is usable as an O_DIRECT buffer.
        start = (-raw.data_ptr()) % PAGE_BYTES
        self._storage = raw
        self._base = raw[start : start + capacity_bytes]
        self._allocator = RangeAllocator(capacity_bytes, PAGE_BYTES)
        self._lock = threading.Lock()
        self.capacity_bytes = self._allocator.capacity
        log.debug("host pool: %d bytes, pinned=%s", self.capacity_bytes, pin)

    @property
    def used_bytes(self) -> int:
        """Bytes currently handed out (rounded to pages)."""
        return self._allocator.used_bytes

    def allocate(self, nbytes: int, key: str | None = None) -> HostBlock:
        """Takes a page-aligned block of at least ``nbytes`` bytes.

        Args:
            nbytes: Bytes wanted.
            key: The tensor the block is for, named in the error if the pool is full.

        Returns:
            The block; give it back with ``release``.

        Raises:
            HostPoolFullError: no free range is large enough.
        """
        with self._lock:
            byte_range = self._allocator.allocate(nbytes)
            largest = self._allocator.largest_free()
        if byte_range is None:
            raise HostPoolFullError(
                f"host pool of {self.capacity_bytes} bytes has no free range of "
                f"{nbytes} bytes (largest free: {largest})",
                key=key,
            )
        view = self._base[byte_range.offset : byte_range.offset + byte_range.size]
        return HostBlock(byte_range, view)

    def release(self, block: HostBlock) -> None:
        """Gives a block back to the pool."""
        with self._lock:
            self._allocator.free(block.byte_range)
