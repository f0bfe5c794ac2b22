"""The device the tests run on: ``SLC_TEST_DEVICE`` ("cpu", "cuda", "cuda:1"), else
CUDA when there is one, else the CPU.

The offload runtime always computes on ``slcompile.runtime.compute_device()``; a test
that compares what it loads with an original builds the original on this device, or
compares with ``same_bits`` (which looks at both on the CPU).
"""

from __future__ import annotations

import functools
import os

import torch

__all__ = ["device_under_test", "same_bits", "on_cuda", "flip_bits"]


@functools.cache
def device_under_test() -> torch.device:
    """The device named by ``SLC_TEST_DEVICE``, else CUDA when available, else the CPU.

    Raises:
        RuntimeError: ``SLC_TEST_DEVICE`` names CUDA on a machine without it, or a
            device torch does not know.
    """
    name = os.environ.get("SLC_TEST_DEVICE", "").strip()
    if not name:
        return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"SLC_TEST_DEVICE={name!r}, but torch {torch.__version__} sees no CUDA device")
    if device.type not in ("cpu", "cuda"):
        raise RuntimeError(f"SLC_TEST_DEVICE={name!r}: the tests run on 'cpu' or 'cuda' only")
    return device


def on_cuda() -> bool:
    """True when the tests run on a CUDA device."""
    return device_under_test().type == "cuda"


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same dtype, shape and bytes, wherever each tensor lives (NaN and -0.0 included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    a, b = a.detach().cpu().reshape(-1), b.detach().cpu().reshape(-1)
    if a.dtype is not torch.bool and a.numel():
        a, b = a.view(torch.uint8), b.view(torch.uint8)
    return torch.equal(a, b)


def flip_bits(path: str, offset: int, mask: int = 0x40) -> None:
    """Flips bits of one byte of a file, as a bad disk or another program would
    (through the page cache; an O_DIRECT read that follows sees it written back)."""
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)[0]
        os.pwrite(fd, bytes([byte ^ mask]), offset)
        os.fsync(fd)
    finally:
        os.close(fd)
