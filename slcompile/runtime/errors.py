"""Named errors of the offload runtime.

Every error raised by the runtime for a transfer or for the offload storage is an
``OffloadError``. Each message names the tensor key the failure concerns (when
there is one) and the filesystem path involved (when there is one), so that a
failure deep inside an I/O thread can be traced back to the schedule step that
issued it. The key and path are also kept as attributes for programs that want
to react to them.
"""

from __future__ import annotations

import logging

__all__ = [
    "OffloadError",
    "OffloadDirError",
    "DiskFullError",
    "ShortReadError",
    "CorruptDataError",
    "OffloadFileMissingError",
    "UnsupportedTensorError",
    "UnknownKeyError",
    "HostPoolFullError",
    "TransferFailedError",
    "ArenaClosedError",
]

from slcompile.errors import OffloadError

log = logging.getLogger(__name__)


class OffloadDirError(OffloadError):
    """The offload directory is missing, not a directory, unsafe or unwritable,
    or its filesystem cannot do direct I/O."""


class DiskFullError(OffloadError):
    """The offload storage has no room: the arena's ``capacity_bytes`` cap was
    reached or the filesystem answered ENOSPC."""


class ShortReadError(OffloadError):
    """A read returned fewer bytes than were written (the file was truncated
    or damaged underneath the runtime)."""


class CorruptDataError(OffloadError):
    """Bytes read back from the offload storage differ from the bytes written: the
    checksum taken when the slot was written does not match the one of the bytes
    read (the file was changed underneath the runtime, or the disk returned bad
    data). The message names the tensor key, the file and the byte offset.

    Attributes:
        offset: The file offset of the range whose checksum failed, when known.
    """

    def __init__(self, message: str, *, key: str | None = None, path: str | None = None,
                 offset: int | None = None):
        super().__init__(message, key=key, path=path)
        self.offset = offset

    def with_key(self, key: str) -> "OffloadError":
        error = super().with_key(key)
        error.offset = self.offset
        return error


class OffloadFileMissingError(OffloadError):
    """The arena file (or its directory) was removed while tensors lived in it."""


class UnsupportedTensorError(OffloadError):
    """The tensor cannot be transferred (sparse, nested, quantized, a tensor
    subclass, on the meta device, ...); the message says why."""


class UnknownKeyError(OffloadError):
    """A load or free named a key that was never stored or was already freed."""


class HostPoolFullError(OffloadError):
    """The pinned host pool has no free range of the requested size."""


class ArenaClosedError(OffloadError):
    """A transfer reached an nvme arena after `NvmeArena.close()` (or after its
    transfer engine went): its directory, file and I/O threads are gone. Its file
    descriptors' numbers may name other files by then, so nothing is attempted."""


class TransferFailedError(OffloadError):
    """A load named a key whose last store failed; the data is not valid."""
