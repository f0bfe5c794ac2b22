"""The transfer engine's records: the handle of one issued transfer and what rests
under one key.

Where it sits: below ``TransferEngine`` (``slcompile.runtime.storage.engine``), which makes
and reads every record here; callers see handles and ``StoredTensor``s, the custom
ops carry a handle's id in their token.

Guarantees:
- Keys have one form (``normalize_key``): strings as they are, ints as ``str(key)``.
- A handle finishes once, with a result or an error; whoever waits for it wakes
  then, and callbacks added with ``_when_done`` run then, on the finishing thread
  (at once when it already finished).
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..errors import OffloadError, UnsupportedTensorError
from .nvme_io import NvmeSlot
from .tiers import HostBlock, Tier, TransferKind

__all__ = ["TransferHandle", "StoredTensor", "normalize_key", "storable"]


def normalize_key(key: str | int) -> str:
    """Returns the engine's form of a key: strings as they are, ints as ``str(key)``.

    Raises:
        TypeError: for anything else (bools included).
    """
    if isinstance(key, str):
        return key
    if isinstance(key, int) and not isinstance(key, bool):
        return str(key)
    raise TypeError(f"transfer keys are str or int, got {type(key).__name__}")


def storable(key: str, tensor: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, int]:
    """(what a store of `tensor` under `key` writes, the bytes copied to make it): a
    plain dense tensor on the CPU or `device` (the compute device), contiguous, its
    conjugate and negative bits resolved (a tier stores values, not storage identity,
    so a loaded tensor never aliases anything else).

    Raises:
        UnsupportedTensorError: a tensor no tier can hold, saying why.
    """
    def refuse(reason: str) -> UnsupportedTensorError:
        return UnsupportedTensorError(f"cannot transfer this tensor: {reason}", key=key)

    kind = type(tensor)
    if kind is not torch.Tensor and kind is not torch.nn.Parameter:
        if not isinstance(tensor, torch.Tensor):
            raise refuse(f"expected a torch.Tensor, got {kind.__name__}")
        raise refuse(f"tensor subclass {kind.__name__} has no plain storage to move")
    if tensor.is_nested:
        raise refuse("nested tensors are not supported")
    if tensor.layout is not torch.strided:
        raise refuse(f"layout {tensor.layout} is not supported; only dense strided tensors")
    if tensor.is_quantized:
        raise refuse("quantized tensors are not supported")
    if tensor.device.type != "cpu" and tensor.device.type != device.type:
        raise refuse("meta tensors have no data" if tensor.device.type == "meta"
                     else f"device {tensor.device} is neither the compute device nor the host")
    # A tensor of a compiled graph needs no detach, a dispatched op on the hot path.
    source = tensor.detach() if tensor.requires_grad or kind is not torch.Tensor else tensor
    copied = False
    if source.is_conj() or source.is_neg():
        source = source.resolve_conj().resolve_neg()
        copied = True
    if not source.is_contiguous():
        source = source.contiguous()
        copied = True
    return source, source.numel() * source.element_size() if copied else 0


@dataclass(frozen=True)
class StoredTensor:
    """What the engine knows about one key.

    Attributes:
        key: The key.
        tier: Where the tensor rests.
        kind: The kind it was stored as.
        shape: Its shape.
        dtype: Its element type.
        nbytes: Its size in bytes.
    """

    key: str
    tier: Tier
    kind: TransferKind
    shape: tuple[int, ...]
    dtype: torch.dtype
    nbytes: int


class TransferHandle:
    """One issued store or load; pass it to ``TransferEngine.wait``.

    Attributes:
        id: Unique in the process; the custom ops carry it in their token.
        key: The tensor key.
        kind: What the transfer carries.
        source: Tier the bytes come from.
        destination: Tier the bytes go to.
        nbytes: Logical size in bytes.
        direction: ``"store"`` or ``"load"``.
        zero_copy: True when nothing was copied and the result is a tensor the
            engine also holds (device tier; host tier on CPU-only machines).
    """

    __slots__ = (
        "id", "key", "kind", "source", "destination", "nbytes", "direction",
        "zero_copy", "_finished", "_event", "_error", "_result", "_cuda_event",
        "_callbacks", "_lock", "_keep", "forget_source", "__weakref__",
    )

    def __init__(self, id_, key, kind, source, destination, nbytes, direction):
        self.id = id_
        self.key = key
        self.kind = kind
        self.source = source
        self.destination = destination
        self.nbytes = nbytes
        self.direction = direction
        self.zero_copy = False
        self._finished = False
        # Made by the first thread that waits while the transfer runs: most finish
        # before anyone waits (host copies are issued, not awaited, on the I/O side).
        self._event: threading.Event | None = None
        self._error: OffloadError | None = None
        self._result: torch.Tensor | None = None
        self._cuda_event = None
        self._callbacks: list[Callable[[], None]] | None = None  # made by the first `_when_done`
        self._lock = threading.Lock()
        self._keep: object = None
        # A store that does not keep its source as its result (see `store`).
        self.forget_source = False

    @property
    def label(self) -> str:
        """``"<kind> <key> <source>-><destination>"``, as on the timeline."""
        return f"{self.kind.value} {self.key} {self.source.value}->{self.destination.value}"

    def done(self) -> bool:
        """True once the transfer finished (successfully or not)."""
        return self._finished

    def wait_done(self) -> None:
        """Blocks until the transfer finished (successfully or not)."""
        if self._finished:
            return
        with self._lock:
            if self._finished:
                return
            if self._event is None:
                self._event = threading.Event()
            event = self._event
        event.wait()

    def _finish(self, result: torch.Tensor | None, error: OffloadError | None) -> None:
        with self._lock:
            self._result = None if self.forget_source else result
            self._error = error
            if not self.forget_source:
                # A store that forgets its source leaves `_keep` to the waiting
                # thread (`TransferEngine.wait`): released here, on an I/O thread,
                # it could be the last reference and free the source there.
                self._keep = None
            self._finished = True
            event = self._event
            callbacks, self._callbacks = self._callbacks, None
        if event is not None:
            event.set()
        for callback in callbacks or ():
            callback()

    def _when_done(self, callback: Callable[[], None]) -> None:
        with self._lock:
            if not self._finished:
                if self._callbacks is None:
                    self._callbacks = []
                self._callbacks.append(callback)
                return
        callback()

    def __repr__(self) -> str:
        state = "done" if self.done() else "pending"
        return f"TransferHandle({self.direction} {self.label}, {self.nbytes} B, {state})"


class _Entry:
    """Where one key's data rests, and what still uses it."""

    __slots__ = (
        "key", "tier", "kind", "shape", "dtype", "nbytes", "slot", "tensor",
        "host_block", "store_handle", "error", "readers", "retired", "last_event", "host_group", "host_offset",
    )

    def __init__(self, key, tier, kind, shape, dtype, nbytes):
        self.key = key
        self.tier = tier
        self.kind = kind
        self.shape = shape
        self.dtype = dtype
        self.nbytes = nbytes
        self.slot: NvmeSlot | None = None
        self.tensor: torch.Tensor | None = None
        self.host_block: HostBlock | None = None
        self.store_handle: TransferHandle | None = None
        self.error: OffloadError | None = None
        self.readers = 0
        self.retired = False
        self.last_event = None
        # A member of a host group (`slcompile.runtime.storage.host_copier`): the group, and
        # where in its range the entry's bytes start.
        self.host_group = None
        self.host_offset = 0


def _typed_view(buffer: torch.Tensor, entry: _Entry) -> torch.Tensor:
    """Views the first ``entry.nbytes`` bytes of a uint8 buffer as the entry's tensor."""
    flat = buffer[: entry.nbytes].view(entry.dtype)
    return flat.view(entry.shape)
