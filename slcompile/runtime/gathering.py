"""Offloaded weights brought back into their parameters: for a block of code
(`gathered_weights`), or for one call of a graph lowered plainly, which reads its
parameters' values (`loading_released_weights`).

Where it sits: above the weight registry and the streamers (`slcompile.runtime.weights`),
whose records say where each offloaded parameter's values rest; below the package's
public `gathered_weights` and the lowerings that fall back to plain graphs.

Guarantees: a gather is all or none: the room for the updated values is reserved on
entry, so a full disk raises before the block runs, and on exit every parameter is
stored again and released, its stored values replaced together or not at all.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from slcompile.runtime.weights import (
    _OWNERS,
    _REGISTRY_LOCK,
    _RELEASED,
    _ReleasedMixin,
    commit_weights,
    drain_prefetches,
    load_whole,
    release,
    restore,
    shard_group_of,
    stage_weights,
    weight_home,
)

__all__ = ["gathered_weights", "loading_released_weights", "offloaded_parameters"]


def offloaded_parameters(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """The parameters of `model` whose values rest on a slower tier."""
    with _REGISTRY_LOCK:
        return [(name, p) for name, p in model.named_parameters() if p in _OWNERS]


@contextlib.contextmanager
def gathered_weights(model: torch.nn.Module) -> Iterator[None]:
    """Brings offloaded weights back into `model`'s parameters for the block.

    Use it around code that reads or writes parameter values directly, such as an
    optimizer step or `state_dict()`. On exit the (possibly updated) values are stored
    again, all of them or none, and the storage released. The room for them is
    reserved on entry (the nvme tier holds a second copy of the weights until the
    exit's stores have all landed), so a full disk raises `DiskFullError` on entry,
    before the block runs: the parameters, the optimizer and its state are then
    exactly as before, and the same block can run again once there is room. The
    loads and stores count as weight traffic.

    Raises:
        DiskFullError: on entry, no room for the new values; nothing was loaded.
        OffloadError: on exit, a store failed all the same (an I/O error): every
            weight on the tier is still the one loaded on entry, whole; the parameters
            hold no memory, as after a normal exit. Changes the block made elsewhere
            (resident parameters, an optimizer's state) are not undone.
    """
    drain_prefetches()
    params = offloaded_parameters(model)
    reserved = _reserve_updates(params)
    try:
        _load_into(params)
    except BaseException:
        _unreserve(params, reserved)
        raise
    try:
        yield
    finally:
        try:
            updates = []
            for _, param in params:
                shards = shard_group_of(param)
                updates.append((param, param.detach() if shards is None else shards.shard(param)))
            commit_weights(stage_weights(updates, reserved))
        finally:
            _release_again(params)
            _unreserve(params, reserved)


def _reserve_updates(params) -> list:
    """Room for a staged update of every parameter (`TransferEngine.reserve`), all or none."""
    reserved = []
    try:
        for _, param in params:
            engine, key, tier = _OWNERS[param]
            reserved.append(engine.reserve(f"{key}~update", engine.stored(key).nbytes, tier))
    except BaseException:
        _unreserve(params, reserved)
        raise
    return reserved


def _unreserve(params, reserved) -> None:
    for (_, param), slot in zip(params, reserved):
        _OWNERS[param][0].unreserve(slot)


def _load_into(params) -> None:
    """Loads offloaded values back into their parameters (all-gathered when sharded);
    a failure leaves every parameter without memory, as before."""
    try:
        _load_each(params)
    except BaseException:
        _release_again(params)
        raise


def _release_again(params) -> None:
    """Releases loaded parameters again (their values rest on their tier)."""
    for _, param in params:
        if param.untyped_storage().nbytes():
            release(param, _RELEASED[param][1], _OWNERS[param][2])


def _load_each(params) -> None:
    for _, param in params:
        values = load_whole(param)
        restore(param, values.numel() * values.element_size())
        with torch.no_grad():
            param.copy_(values.view_as(param))
class _LoadedWeight(torch.autograd.Function):
    """A released parameter's values, loaded for one call; the gradient flows to it."""

    @staticmethod
    def forward(ctx, param):
        return load_whole(param).view(param.shape)

    @staticmethod
    def backward(ctx, grad):
        return grad


def loading_released_weights(compiled: Callable) -> Callable:
    """`compiled` (a graph lowered plainly, which reads its parameters' values), run
    with every released parameter among its arguments replaced by its values, loaded
    for the call and kept while its backward needs them; gradients reach the
    parameters as from the parameters themselves."""

    def run(*args):
        return compiled(*(_LoadedWeight.apply(a) if isinstance(a, _ReleasedMixin) and weight_home(a) is not None
                          else a for a in args))

    return run
