"""What the `slc::` ops do when a compiled graph runs, and the transfer tokens.

Where it sits: `slcompile.vocabulary` defines the ops (schemas, fake implementations,
effects); this module registers the implementations of `slc::wait` and `slc::mark`
and keeps the tokens every transfer op hands out; `activations` implements
`stash`/`unstash`/`unstash_wait` and `weights` implements `fetch_issue`/
`fetch_weight`, all against the transfer engine (`get_engine()`).

Tokens: a 0-dim int64 CPU tensor whose value names the issued transfer (the token
also carries it as an attribute, read without dispatching an op; copies of a token
find it by the value). `wait` blocks until the transfer is done and returns a
dependency token (value 0). Tokens come from pools made 256 at a time.

Why this shape:
- `wait`'s `keepalive` must list the tensors a store reads. Inductor reuses a
  buffer's memory in place after its last use in the graph, including the output of
  an extern call; naming the source here makes the wait its last use, so the memory
  is not overwritten while the I/O threads still read it.
- Ops that return a loaded tensor always return one the graph owns: when the engine
  hands out a tensor it keeps (zero-copy tiers: the device tier, the host tier on a
  CPU-only machine) the op returns a copy, and a zero-copy store copies its source
  first; those copies are counted in `local_copy_bytes`, not as tier traffic.
- Waiting again on a token is allowed and returns the same result; the engine
  forgets a transfer when the token tensor is garbage collected (copies of a token
  are good only while it lives).

With Inductor, turn `reorder_for_peak_memory` and `reorder_for_locality` off: the
first moves waits (which free their `keepalive`) up next to their issue, the second
moves compute down next to its consumers, past the waits; either removes the overlap
between a transfer and the compute scheduled beside it.
"""

from __future__ import annotations

import collections
import itertools
import logging
import threading
import time
from collections.abc import Callable, Sequence

import torch

from slcompile import vocabulary

from .storage.engine import TransferEngine, TransferHandle
from .errors import OffloadError
from .finalizing import when_safe
from .storage.page_buffers import profiler_sees_buffers
from .stats import RECORDER

__all__ = [
    "wait",
    "mark",
    "implement",
    "bind_implementations",
    "set_region_listener",
    "fake_token",
    "transfer_of",
    "pending_tokens",
]

log = logging.getLogger(__name__)

_IMPL = torch.library.Library("slc", "IMPL")
fake_token = vocabulary.fake_token


_PYTHON: dict[str, Callable] = {}  # op name -> its implementation


def implement(name: str, function: Callable) -> None:
    """Registers `function` as what `slc::name` (defined in `slcompile.vocabulary`)
    does at run time, on every device."""
    _IMPL.impl(name, function, "CompositeExplicitAutograd")
    _PYTHON[name] = function


def bind_implementations(graph: torch.fx.Graph) -> None:
    """Makes every `slc::` op node of `graph` call the op's implementation as a
    Python function, without the dispatcher: for a graph that is run as it is,
    neither traced nor differentiated (a generation pass), where the dispatcher's
    autograd wrapper and the offloaded parameters' `__torch_function__` cost more
    than the op at small sizes."""
    for node in graph.nodes:
        if node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload) \
                and node.target.namespace == "slc":
            node.target = _PYTHON[node.target._schema.name.split("::")[1]]


# A token's value is the id of its transfer, so copies of a token (opcheck clones
# inputs) still name it. Each use is one dict operation, safe without a lock: a token
# dying in a garbage collection forgets its entry on whichever thread collects, also
# one inside `_tokens_for`.
_HANDLES: dict[int, tuple[TransferEngine, TransferHandle]] = {}


class _TokenPool:
    """0-dim int64 CPU tensors made `_POOL_SIZE` at a time, by one foreach op: an op hands out a token without dispatching an op of its own (on the
    compute thread's hot path each dispatch may wait for the I/O threads' hold on
    the GIL). Counting pools number their tokens from 1 up (a transfer's token
    names it by its value); the others hand out zeros (dependency tokens)."""

    def __init__(self, counting: bool):
        self._counting = counting
        self._next = 1
        # Popped as handed out: the pool keeps no token that is in use.
        self._tokens: collections.deque[tuple[torch.Tensor, int]] = collections.deque()
        self._lock = threading.Lock()

    def take(self) -> tuple[torch.Tensor, int]:
        """(a token, its value)."""
        if profiler_sees_buffers():
            # Measuring memory: each token is allocated when handed out, as the memory
            # model counts it, not with a pool's worth of others.
            with self._lock:
                value = self._next if self._counting else 0
                self._next += 1
            return torch.tensor(value, dtype=torch.int64), value
        try:
            return self._tokens.popleft()
        except IndexError:
            return self._refill()

    def take_many(self, count: int) -> list[tuple[torch.Tensor, int]]:
        """`count` tokens and their values, as `take` hands them out."""
        if profiler_sees_buffers():
            return [self.take() for _ in range(count)]
        taken, popleft = [], self._tokens.popleft
        for _ in range(count):
            try:
                taken.append(popleft())
            except IndexError:
                taken.append(self._refill())
        return taken

    def _refill(self) -> tuple[torch.Tensor, int]:
        with self._lock:
            if self._tokens:
                return self._tokens.popleft()
            # Never inference tensors: a stash token is saved for the backward.
            with torch.inference_mode(False), torch.no_grad():
                # One foreach op makes them all, each on storage of its own (a view
                # at an offset is not the fresh tensor the op's fake says it returns).
                start = self._next
                values = list(range(start, start + _POOL_SIZE)) if self._counting else [0] * _POOL_SIZE
                zero = torch.zeros((), dtype=torch.int64)
                self._next += _POOL_SIZE
                self._tokens.extend(zip(torch._foreach_add([zero] * _POOL_SIZE, values), values))
            return self._tokens.popleft()


_POOL_SIZE = 256
_TRANSFER_TOKENS = _TokenPool(counting=True)
_DEPENDENCY_TOKENS = _TokenPool(counting=False)


def _forget(token_id: int) -> None:
    _HANDLES.pop(token_id, None)


class _TokenLife:
    """Held by a transfer token alone (its `_slc` attribute): names the token's
    transfer, and when the token dies, forgets its record and runs `release(*args)` (a
    stash frees its stored copy). Cheaper on the compute thread than a
    `weakref.finalize` per token, and it dies with it."""

    __slots__ = ("token_id", "transfer", "release")

    def __init__(self, token_id: int, transfer: tuple[TransferEngine, TransferHandle], release: tuple | None):
        self.token_id, self.transfer, self.release = token_id, transfer, release

    def __del__(self):
        _forget(self.token_id)
        if self.release is not None:
            when_safe(*self.release)


def _token_for(engine: TransferEngine, handle: TransferHandle, release: tuple | None = None) -> torch.Tensor:
    """A transfer's token. The token owns the transfer record (waits may repeat while
    it lives); `release`, `(fn, *args)`, runs when the token dies."""
    return _tokens_for(engine, (handle,), None if release is None else (release,))[0]


def _tokens_for(engine: TransferEngine, handles: Sequence[TransferHandle],
                releases: Sequence[tuple] | None = None) -> list[torch.Tensor]:
    """`_token_for` of each handle (with its release, if `releases`), for a run."""
    taken = _TRANSFER_TOKENS.take_many(len(handles))
    transfers = [(engine, handle) for handle in handles]
    _HANDLES.update(zip([token_id for _, token_id in taken], transfers))
    tokens = []
    for (token, token_id), transfer, release in zip(taken, transfers, releases or itertools.repeat(None)):
        token._slc = _TokenLife(token_id, transfer, release)
        tokens.append(token)
    return tokens


def _lookup(token: torch.Tensor) -> tuple[TransferEngine, TransferHandle]:
    life = getattr(token, "_slc", None)
    if life is not None:
        return life.transfer
    # A copy of a token (opcheck clones inputs) names its transfer by its value.
    if token.dim() != 0 or token.dtype != torch.int64 or token.device.type != "cpu":
        raise OffloadError(
            f"not a transfer token: {token.dtype} tensor of shape {tuple(token.shape)} "
            f"on {token.device}"
        )
    handle_id = int(token)
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
    return len(_HANDLES)


def _dependency_token() -> torch.Tensor:
    return _DEPENDENCY_TOKENS.take()[0]


def wait(token: torch.Tensor, keepalive: Sequence[torch.Tensor]) -> torch.Tensor:
    """Blocks until the token's transfer is done; returns a dependency token."""
    engine, handle = _lookup(token)
    engine.wait(handle)
    return _dependency_token()


def mark(label: str, begin: bool) -> torch.Tensor:
    """Opens (`begin`) or closes the compute region `label` on the timeline; returns
    a dependency token."""
    now = time.perf_counter()
    if begin:
        _open.label, _open.start = label, now
    elif getattr(_open, "label", None) == label:
        RECORDER.compute(_open.start, now, label)
        _open.label = None
    if _listener is not None:
        _listener(label, begin, now)
    # A token of its own, allocated in the step as the memory model counts it: a
    # marker is no transfer, and its few microseconds are not the transfers'.
    return torch.zeros((), dtype=torch.int64)


def set_region_listener(listener: Callable[[str, bool, float], None] | None) -> None:
    """Calls `listener(label, begin, perf_counter seconds)` at every marker (None: stop)."""
    global _listener
    _listener = listener


_open = threading.local()
_listener: Callable[[str, bool, float], None] | None = None

implement("wait", wait)
implement("mark", mark)
