"""Transfer custom ops (namespace ``slc``) that compiled graphs call.

Where it sits: ``materialize`` emits these ops into the FX graph (before
AOTAutograd, or into a post-grad graph); at run time they call the process-wide
``TransferEngine`` (``get_engine()``).

The ops, as issue + wait pairs so a schedule can move them apart:

    slc::store(Tensor src, str key, str tier, str kind, Tensor? after=None) -> Tensor
    slc::load(str key, str kind, Tensor? after=None) -> Tensor
    slc::wait(Tensor token, Tensor[] keepalive) -> Tensor
    slc::wait_load(Tensor token, str key, SymInt[] size, ScalarType dtype,
                   Device device) -> Tensor
    slc::free(str key, Tensor? after=None) -> Tensor

``store`` and ``load`` return a *token*: a 0-dim int64 CPU tensor whose value is
the id of the issued transfer. ``wait`` blocks until the transfer is done and
returns a dependency token (value 0); ``wait_load`` blocks and returns the loaded
tensor. ``after`` is a token that must come first (a data dependency only; chain
tokens for more). ``kind=""`` in ``load`` means the kind the key was stored as.

Why this shape:
- Nothing aliases: every output is a fresh tensor, so the ops pass
  functionalization and can be inserted before AOTAutograd as well as after
  partitioning. (An aliasing ``wait(Tensor(a)) -> Tensor(a)`` would be rejected
  by functionalization.)
- All five are registered as ORDERED effectful ops. AOTAutograd threads effect
  tokens through them (``with_effects``), Inductor keeps them as extern calls in
  program order (``EffectfulKernel``) and never dead-code-eliminates them, even
  when their result is unused (a store whose wait result nobody reads), and two
  identical loads are never merged by CSE.
- ``wait``'s ``keepalive`` must list the tensors a store reads. Inductor reuses
  a buffer's memory in place after its last use in the graph, including the
  output of an extern call; naming the source here makes the wait its last use,
  so the memory is not overwritten while the I/O threads still read it.
- For the same reason ``wait_load`` always returns a tensor the graph owns: when
  the engine hands out a tensor it keeps (zero-copy tiers: the device tier, the
  host tier on a CPU-only machine) the op returns a copy, and a zero-copy
  ``store`` copies its source first; those copies are counted in
  ``local_copy_bytes``, not as tier traffic.
- Keys are strings: they appear verbatim in the generated code and in the
  schedule's text form (``"blk3.w"``, ``"blk2.act.sb0"``).
- Waiting again on a token is allowed and returns the same result; the engine
  forgets a transfer when the token tensor ``store``/``load`` returned is
  garbage collected (copies of a token are good only while it lives).
- ``torch.library.opcheck`` passes for ``wait``, ``wait_load`` and ``free``. For
  ``store`` and ``load`` it passes the schema, autograd-registration and fake
  checks; its AOT-dispatch check compares eager and compiled outputs by value,
  and two issues are two transfers with two ids, so the tests run that check
  with a comparison of the transfers the tokens name (same key, direction,
  tiers and kind) instead.

With Inductor, turn ``reorder_for_peak_memory`` and ``reorder_for_locality`` off:
the first moves waits (which free their ``keepalive``) up next to their issue, the
second moves compute down next to its consumers, past the waits; either removes
the overlap between a transfer and the compute scheduled beside it.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Sequence

import torch
from torch._library.effects import EffectType

from .engine import TransferEngine, TransferHandle, get_engine
from .errors import OffloadError
from .stats import RECORDER

__all__ = [
    "store",
    "load",
    "wait",
    "wait_load",
    "free",
    "STORE",
    "LOAD",
    "WAIT",
    "WAIT_LOAD",
    "FREE",
    "TRANSFER_OPS",
    "fake_token",
    "transfer_of",
    "pending_tokens",
]

log = logging.getLogger(__name__)

# A token's value is the id of its transfer, so copies of a token (opcheck clones
# inputs) still name it.
_HANDLES: dict[int, tuple[TransferEngine, TransferHandle]] = {}
_HANDLES_LOCK = threading.Lock()


def _forget(handle_id: int) -> None:
    with _HANDLES_LOCK:
        _HANDLES.pop(handle_id, None)


def _token_for(engine: TransferEngine, handle: TransferHandle) -> torch.Tensor:
    token = torch.tensor(handle.id, dtype=torch.int64)
    with _HANDLES_LOCK:
        _HANDLES[handle.id] = (engine, handle)
    # The token owns the transfer record: waits may repeat while it lives.
    weakref.finalize(token, _forget, handle.id)
    return token


def _lookup(token: torch.Tensor) -> tuple[TransferEngine, TransferHandle]:
    if token.dim() != 0 or token.dtype != torch.int64 or token.device.type != "cpu":
        raise OffloadError(
            f"not a transfer token: {token.dtype} tensor of shape {tuple(token.shape)} "
            f"on {token.device}"
        )
    handle_id = int(token)
    with _HANDLES_LOCK:
        found = _HANDLES.get(handle_id)
    if found is None:
        raise OffloadError(f"no transfer is known for token {handle_id} (a dependency "
                           "token, or one whose transfer was forgotten)")
    return found


def transfer_of(token: torch.Tensor) -> TransferHandle:
    """Returns the transfer a token names (for tests and debugging)."""
    return _lookup(token)[1]


def pending_tokens() -> int:
    """How many transfer tokens are alive (for leak checks in tests)."""
    with _HANDLES_LOCK:
        return len(_HANDLES)


def fake_token() -> torch.Tensor:
    """A tensor shaped like a token, for ``node.meta["val"]`` of inserted nodes."""
    return torch.empty((), dtype=torch.int64)


def _dependency_token() -> torch.Tensor:
    return torch.zeros((), dtype=torch.int64)


@torch.library.custom_op("slc::store", mutates_args=())
def store(
    src: torch.Tensor,
    key: str,
    tier: str,
    kind: str,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    """Issues a store of ``src`` under ``key`` onto ``tier``; returns its token."""
    engine = get_engine()
    if engine.copies_nothing(engine.tier_of(src), tier):
        # The engine would keep the graph's own buffer, which Inductor may reuse.
        src = src.detach().clone(memory_format=torch.contiguous_format)
        RECORDER.local_copy(src.numel() * src.element_size())
    return _token_for(engine, engine.store(key, src, tier, kind))


@store.register_fake
def _(src, key, tier, kind, after=None):
    return fake_token()


@torch.library.custom_op("slc::load", mutates_args=())
def load(key: str, kind: str, after: torch.Tensor | None = None) -> torch.Tensor:
    """Issues a load of ``key`` onto the device; returns its token."""
    engine = get_engine()
    return _token_for(engine, engine.load(key, kind or None))


@load.register_fake
def _(key, kind, after=None):
    return fake_token()


@torch.library.custom_op("slc::wait", mutates_args=())
def wait(token: torch.Tensor, keepalive: Sequence[torch.Tensor]) -> torch.Tensor:
    """Blocks until the token's transfer is done; returns a dependency token."""
    engine, handle = _lookup(token)
    engine.wait(handle)
    return _dependency_token()


@wait.register_fake
def _(token, keepalive):
    return fake_token()


def _same_device(actual: torch.device, wanted: torch.device) -> bool:
    if actual.type != wanted.type:
        return False
    return wanted.index is None or actual.index == wanted.index


@torch.library.custom_op("slc::wait_load", mutates_args=())
def wait_load(
    token: torch.Tensor,
    key: str,
    size: Sequence[int],
    dtype: torch.dtype,
    device: torch.device,
) -> torch.Tensor:
    """Blocks until the token's load is done; returns the loaded tensor."""
    engine, handle = _lookup(token)
    if handle.direction != "load" or handle.key != key:
        raise OffloadError(
            f"token {handle.id} is the {handle.direction} of {handle.key!r}, not a load of it",
            key=key,
        )
    result = engine.wait(handle)
    if (
        tuple(result.shape) != tuple(size)
        or result.dtype != dtype
        or not _same_device(result.device, torch.device(device))
    ):
        raise OffloadError(
            f"loaded {result.dtype} {tuple(result.shape)} on {result.device}, but the graph "
            f"expects {dtype} {tuple(size)} on {device}",
            key=key,
        )
    if handle.zero_copy:
        # The engine keeps this tensor; the graph must own what it gets.
        result = result.clone()
        RECORDER.local_copy(result.numel() * result.element_size())
    return result


@wait_load.register_fake
def _(token, key, size, dtype, device):
    return torch.empty(size, dtype=dtype, device=device)


@torch.library.custom_op("slc::free", mutates_args=())
def free(key: str, after: torch.Tensor | None = None) -> torch.Tensor:
    """Releases ``key``'s storage once no transfer uses it; a no-op for unknown
    keys, so replaying a graph is harmless. Returns a dependency token."""
    engine = get_engine()
    if key in engine:
        engine.free(key)
    return _dependency_token()


@free.register_fake
def _(key, after=None):
    return fake_token()


for _op in (store, load, wait, wait_load, free):
    _op.register_effect(EffectType.ORDERED)

STORE = torch.ops.slc.store.default
LOAD = torch.ops.slc.load.default
WAIT = torch.ops.slc.wait.default
WAIT_LOAD = torch.ops.slc.wait_load.default
FREE = torch.ops.slc.free.default
TRANSFER_OPS = (STORE, LOAD, WAIT, WAIT_LOAD, FREE)
"""The op overloads, for passes that insert or recognise transfer nodes."""
