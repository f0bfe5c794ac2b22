"""Block weights sharded across the ranks of a process group.

With `shard_weights=True` each rank keeps 1/W of every streamed weight on its tier
(W ranks of the default `torch.distributed` process group) and the two points
where a block's weights meet the device become collectives:

- a fetch (`slcompile.runtime.weights.WeightStreamer`) loads this rank's shard and
  all-gathers the full weight, once per block per pass for all K sub-batches;
- a final weight gradient (`slcompile.runtime.gradients.GradientSink`) is
  reduce-scattered (averaged over the ranks) once per block per step, and the
  offloaded optimizer receives, steps and writes back this rank's shard only.

A weight is flattened and padded with zeros to a multiple of W; rank r keeps
elements `[r * n, (r + 1) * n)` of it, `n = ceil(numel / W)` (`shard`). Less the
padding, that is `torch.chunk`'s split of the flat weight and a DTensor's `Shard(0)`
of its 1-D view: `slcompile.checkpoint` saves each rank's shards as such, one DCP
chunk each.

Every collective runs on the one communication thread of the process's
`ShardGroup`, strictly in the order it was issued: the compiled graphs issue in
the same order on every rank, so one FIFO keeps the ranks in step while the
graph computes (a fetch issued ahead overlaps its all-gather with compute). The
engine's I/O threads never run a collective.

Byte counters (`runtime_stats()`, key `(kind, Tier.DEVICE, Tier.DEVICE)`) count the
bytes this rank *receives from the other ranks*:

- `all_gather`: (W - 1) shards of the weight, `(W - 1) * n * itemsize`;
- `reduce_scatter`: (W - 1) partial shards of the gradient, the same size;
- `all_reduce`: `2 * (W - 1) * n * itemsize` for a tensor of `numel` elements (a
  reduce-scatter and an all-gather of its padded shards).

So a step all-gathers the same bytes at every K, and reduce-scatters
`P * (W - 1) / W` for P bytes of streamed weights (when W divides every weight).

The memory a collective's caller hands it stays the caller's: an all-gather writes
into an output buffer the issuing thread allocated (`gathered_buffer`), and the
communication thread drops every reference to what a collective read or wrote
before `wait` returns, so the last reference, and the free, is the waiting
thread's (the graph's, which the memory model and torch.profiler follow; the
memory a thread allocates or frees is invisible to a profile of another).

A collective that fails on one rank (a shard's load from a full disk, say) raises
there; the other ranks wait in theirs until the process group's timeout.
"""

from __future__ import annotations

import itertools
import logging
import queue
import threading
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from .storage.engine import TransferHandle
from .errors import OffloadError
from .stats import RECORDER
from .storage.tiers import Tier, TransferKind

__all__ = ["ShardGroup", "shard_group", "shard_range", "process_group_ready", "COLLECTIVE_LANE"]

log = logging.getLogger(__name__)

COLLECTIVE_LANE = "collective"
"""The lane of the collectives' busy time and timeline events."""

# Collective handles are TransferHandles (the engine and `slc::wait` wait on them);
# their ids must not meet the engines' own, which count from 1.
_IDS = itertools.count(1 << 48)
_GROUP: ShardGroup | None = None
_GROUP_LOCK = threading.Lock()
# The newer names of the two collectives; the older ones warn where both exist.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


def shard_range(numel: int, rank: int, world_size: int) -> tuple[int, int]:
    """`[start, end)` of rank `rank`'s shard in a flat tensor of `numel` elements (the
    padding past the end cut off: a rank may hold padding only, `start == end`)."""
    size = -(-numel // world_size)
    return min(rank * size, numel), min((rank + 1) * size, numel)


def process_group_ready() -> bool:
    """Whether `torch.distributed`'s default process group is initialized."""
    return dist.is_available() and dist.is_initialized()


def shard_group() -> ShardGroup:
    """The process's `ShardGroup` over the default process group (made on first use,
    and again after the default group was destroyed and made anew)."""
    global _GROUP
    with _GROUP_LOCK:
        if _GROUP is None or _GROUP.closed or _GROUP.world is not dist.group.WORLD:
            if _GROUP is not None:
                _GROUP.close()
            _GROUP = ShardGroup()
        return _GROUP


class ShardGroup:
    """One process group and the one thread that runs its collectives in issue order.

    Args:
        group: the process group (default: the default one, which must be initialized).
    """

    def __init__(self, group: dist.ProcessGroup | None = None):
        if not process_group_ready():
            raise RuntimeError("sharding weights needs torch.distributed's default process group: "
                               "call torch.distributed.init_process_group first")
        self.group = group
        self.world = dist.group.WORLD  # the default group it was made under
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.closed = False
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        # The id of the last job whose references the communication thread dropped
        # (jobs run in the order of their ids).
        self._released = threading.Condition()
        self._released_id = 0
        self._thread = threading.Thread(target=self._run, name="slc-collectives", daemon=True)
        self._thread.start()

    # -- layout -----------------------------------------------------------
    def shard_numel(self, numel: int) -> int:
        """Elements of one rank's shard of a tensor of `numel` elements."""
        return -(-numel // self.world_size)

    def shard(self, tensor: torch.Tensor) -> torch.Tensor:
        """This rank's shard of `tensor`: a new flat tensor of `shard_numel` elements
        (the padding past the end is zeros)."""
        flat = tensor.detach().reshape(-1)
        start, end = shard_range(flat.numel(), self.rank, self.world_size)
        out = torch.zeros(self.shard_numel(flat.numel()), dtype=tensor.dtype, device=tensor.device)
        out[: end - start].copy_(flat[start:end])
        return out

    def gathered_buffer(self, shape: torch.Size, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
        """An uninitialized flat buffer for the all-gather of a tensor of `shape`: every
        rank's shard, `shard_numel(numel) * world_size` elements (the padding included)."""
        return torch.empty(self.shard_numel(shape.numel()) * self.world_size, dtype=dtype, device=device)

    # -- collectives ------------------------------------------------------
    def all_gather(self, key: str, local: Callable[[], torch.Tensor], shape: torch.Size,
                   out: torch.Tensor | None = None) -> TransferHandle:
        """Issues the all-gather of a weight; `wait` returns it, full, in `shape` (a view
        of the gathered buffer).

        Args:
            key: names the weight (for the timeline and errors).
            local: returns this rank's shard; called on the communication thread
                (it may wait for the shard's load from the tier).
            shape: the full weight's shape.
            out: the buffer to gather into (`gathered_buffer`), allocated by the
                caller so its memory is the caller's thread's; default: one the
                communication thread allocates.
        """
        numel = shape.numel()

        def run() -> torch.Tensor:
            shard = local().reshape(-1)
            if self.world_size == 1:  # the shard is the whole weight (no padding): nothing to gather
                return shard.view(shape)
            full = out if out is not None else self.gathered_buffer(shape, shard.dtype, shard.device)
            _all_gather(full, shard.contiguous(), group=self.group)
            return full[:numel].view(shape)

        return self._submit(TransferKind.ALL_GATHER, key, numel, run)

    def reduce_scatter(self, key: str, full: torch.Tensor,
                       then: Callable[[torch.Tensor], object] | None = None) -> TransferHandle:
        """Issues the reduce-scatter of a gradient, averaged over the ranks; `wait`
        returns `then(this rank's shard)` (the shard itself without `then`).
        Keep `full` unchanged until it is done."""
        numel = full.numel()

        def run() -> object:
            size = self.shard_numel(numel)
            padded = full.detach().reshape(-1)
            if size * self.world_size != numel:
                padded = torch.nn.functional.pad(padded, (0, size * self.world_size - numel))
            shard = torch.empty(size, dtype=full.dtype, device=full.device)
            _reduce_scatter(shard, padded.contiguous(), op=dist.ReduceOp.SUM, group=self.group)
            shard.div_(self.world_size)
            return shard if then is None else then(shard)

        return self._submit(TransferKind.REDUCE_SCATTER, key, numel, run, element_size=full.element_size())

    def all_reduce(self, key: str, tensor: torch.Tensor) -> TransferHandle:
        """Issues the averaging of `tensor` over the ranks, in place."""

        def run() -> torch.Tensor:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM, group=self.group)
            return tensor.div_(self.world_size)

        return self._submit(TransferKind.ALL_REDUCE, key, tensor.numel(), run, element_size=tensor.element_size())

    def wait(self, handle: TransferHandle) -> object:
        """Blocks until a collective is done and the communication thread holds
        nothing of it; returns its result (stalls are counted)."""
        if not self._released_past(handle):
            start = time.perf_counter()
            with self._released:
                self._released.wait_for(lambda: self._released_past(handle))
            RECORDER.stalled(start, time.perf_counter(), f"wait {handle.label}")
        if handle._error is not None:
            raise handle._error
        return handle._result

    def close(self) -> None:
        """Finishes the collectives issued and stops the thread."""
        if not self.closed:
            self.closed = True
            self._jobs.put(None)
            self._thread.join()

    # -- the communication thread ----------------------------------------
    def received_bytes(self, kind: TransferKind, numel: int, element_size: int) -> int:
        """Bytes this rank receives from the others (see the module docstring)."""
        chunk = self.shard_numel(numel) * element_size * (self.world_size - 1)
        return 2 * chunk if kind is TransferKind.ALL_REDUCE else chunk

    def _submit(self, kind: TransferKind, key: str, numel: int, run: Callable[[], object],
                element_size: int | None = None) -> TransferHandle:
        if self.closed:
            raise OffloadError(f"{kind.value} issued after the shard group was closed", key=key)
        with self._released:  # ids in issue order, as `wait` counts them
            handle = TransferHandle(next(_IDS), key, kind, Tier.DEVICE, Tier.DEVICE, 0, COLLECTIVE_LANE)
            self._jobs.put([handle, run, numel, element_size])
        return handle

    def _released_past(self, handle: TransferHandle) -> bool:
        return handle.done() and self._released_id >= handle.id

    def _run(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            number = job[0].id
            self._run_one(job)
            # The job's references are gone with `_run_one`'s frame: the waiter's
            # are the last (see the module docstring).
            with self._released:
                self._released_id = number
                self._released.notify_all()

    def _run_one(self, job: list) -> None:
        handle, run, numel, element_size = job
        job.clear()
        start = time.perf_counter()
        RECORDER.lane_begin(COLLECTIVE_LANE, start)
        try:
            result = run()
        except BaseException as error:  # every waiter must hear of it
            del run  # what it read goes before a waiter wakes
            RECORDER.lane_end(COLLECTIVE_LANE, time.perf_counter())
            failure = OffloadError(f"{handle.kind.value} failed on rank {self.rank}: {error}", key=handle.key)
            failure.__cause__ = error
            log.error("%s", failure)
            handle._finish(None, failure)
            return
        # The closure holds what the collective read (a gradient, a shard's load):
        # dropped before a waiter wakes, the waiter's reference is its last.
        del run
        end = time.perf_counter()
        RECORDER.lane_end(COLLECTIVE_LANE, end)
        if element_size is None:  # an all-gather: the element size of what it gathered
            element_size = result.element_size()
        handle.nbytes = self.received_bytes(handle.kind, numel, element_size)
        RECORDER.transfer_finished((handle.kind, Tier.DEVICE, Tier.DEVICE), handle.nbytes, start, end,
                                   COLLECTIVE_LANE, handle.label)
        handle._finish(result, None)
