"""Checkpoints of a model and its offloaded optimizer with `torch.distributed.checkpoint`.

`slcompile.save_sharded(model, optimizer, path)` writes the model's weights and the
optimizer's state as a DCP checkpoint (a directory: one `.distcp` file per rank and
the `.metadata` the coordinator writes); `slcompile.load_sharded(model, optimizer,
path)` reads it back. Every rank calls both together.

With `shard_weights=True` (`slcompile.runtime.collectives`) no rank gathers a
weight: each rank writes its own shard of every streamed weight and of its
optimizer state, and reads back only the shard it keeps. A sharded tensor is saved
as the 1-D view of the whole tensor (`(numel,)`), each rank's shard a DTensor on a
1-D mesh over the ranks with `Shard(0)`: rank r holds elements
`[r * n, min((r + 1) * n, numel))`, `n = ceil(numel / W)`, which is the layout of
`ShardGroup.shard` less its zero padding, so DCP's chunk metadata describes the
shards exactly, and a checkpoint written by W ranks loads on another number of
ranks, or in one process without a process group (DCP reads the overlapping chunks). What every rank holds whole (embeddings, head,
their optimizer state, scalars such as Adam's step) is a plain tensor, written
once: DCP's planner gives each such entry to one rank.

What each rank writes comes from where it rests: the streamed weights from the
optimizer's host copies (this rank's shard, in host memory already; no copy for
fp32 weights) or, for a streamed weight the optimizer does not step, its tier; the
optimizer state from host memory or its nvme files (`OffloadedOptimizer.state_dict`
loads those). No rank holds more than its shards of the streamed weights and
their state, and the replicated tensors. (Reading nvme states block by block as the
writer asks for them would not lower that: DCP's file writer keeps every tensor of
a file until the file is written.)

Entries: `model/<name>` for parameters and persistent buffers,
`optimizer/<name>/<state>` for the optimizer state, and `slcompile` for the
optimizer class, its param groups and the names of the sharded tensors.

Loading works on a model not compiled yet (the usual resume: build, load, compile,
train) and on one already compiled. Not compiled yet, the parameters are whole:
each rank reads whole weights into them, and the state of the weights the
checkpoint has sharded is read as this rank's shard, ready for the compile with
the same `shard_weights` (the host step of a sharded weight refuses a state of
another size). Compiled
and sharded, the weights are read into the optimizer's host copies and written to
their tier.
"""

from __future__ import annotations

import contextlib
import logging
import os
import warnings
from collections.abc import Iterator
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, TensorStorageMetadata
from torch.distributed.tensor import DTensor, Shard

from slcompile.optim import OffloadedOptimizer
from slcompile.runtime.collectives import process_group_ready, shard_range
from slcompile.runtime.storage.tiers import TransferKind
from slcompile.runtime.weights import shard_group_of, weight_home

__all__ = ["save_sharded", "load_sharded"]

log = logging.getLogger(__name__)

_FORMAT = 1
_META = "slcompile"
_MODEL = "model/"
_OPTIMIZER = "optimizer/"


def save_sharded(model: torch.nn.Module, optimizer: OffloadedOptimizer | None, path: str | os.PathLike) -> None:
    """Writes `model`'s weights and `optimizer`'s state to the DCP checkpoint `path`,
    each rank its own shards (see the module docstring). Every rank calls it.

    Args:
        model: the model (compiled or not).
        optimizer: its `slcompile.offload_optimizer`, or None for the weights alone.
        path: the checkpoint directory (made if missing).
    """
    _check_optimizer(optimizer)
    if optimizer is not None:
        optimizer.wait()
    mesh = _mesh(model)
    state: dict[str, Any] = {}
    sharded: list[str] = []
    for name, param in model.named_parameters():
        values = _weight_values(param, optimizer)
        if shard_group_of(param) is not None:
            sharded.append(_MODEL + name)
            values = _as_dtensor(values, param.numel(), mesh)
        state[_MODEL + name] = values
    for name, buffer in _persistent_buffers(model):
        state[_MODEL + name] = buffer.detach()
    meta: dict[str, Any] = {"format": _FORMAT, "sharded": sharded}
    if optimizer is not None:
        saved = optimizer.state_dict()
        params = _params_by_name(model)
        for name, values in saved["state"].items():
            shards = shard_group_of(params[name])
            for key, value in values.items():
                fqn = f"{_OPTIMIZER}{name}/{key}"
                if shards is not None and _is_shard(value, params[name], shards):
                    sharded.append(fqn)
                    value = _as_dtensor(value, params[name].numel(), mesh)
                state[fqn] = value
        meta.update(optimizer=saved["optimizer"], options=saved["options"], param_groups=saved["param_groups"])
    state[_META] = meta
    log.debug("save_sharded: %d entries (%d sharded over the ranks) to %s", len(state), len(sharded), path)
    with _single_process_quiet():
        dcp.save(state, storage_writer=dcp.FileSystemWriter(os.fspath(path)),
                 planner=DefaultSavePlanner(flatten_state_dict=False, flatten_sharded_tensors=False),
                 no_dist=not process_group_ready())


def load_sharded(model: torch.nn.Module, optimizer: OffloadedOptimizer | None, path: str | os.PathLike) -> None:
    """Reads what `save_sharded` wrote into `model` and `optimizer`, each rank only
    what it keeps. Every rank calls it; call it before the compiled model's first
    call or after, not while a step runs.

    Args:
        model: a model with the same parameter names and shapes.
        optimizer: its `slcompile.offload_optimizer` (same class, same param groups),
            or None to read the weights alone.
        path: the checkpoint directory.

    Raises:
        ValueError: the checkpoint lacks a weight of `model`, has another shape for
            it, or holds another optimizer's state.
    """
    _check_optimizer(optimizer)
    path = os.fspath(path)
    no_dist = not process_group_ready()
    planner = dict(flatten_state_dict=False, flatten_sharded_tensors=False)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    head: dict[str, Any] = {_META: None}
    with _single_process_quiet():
        dcp.load(head, storage_reader=dcp.FileSystemReader(path), planner=DefaultLoadPlanner(**planner),
                 no_dist=no_dist)
    meta = head[_META]
    if optimizer is not None:
        optimizer.wait()
        if meta.get("optimizer") != optimizer.optimizer_class.__name__:
            raise ValueError(f"load_sharded: {path} holds a {meta.get('optimizer')} state, not a "
                             f"{optimizer.optimizer_class.__name__} one (pass the same optimizer class)")
    saved_sharded = set(meta["sharded"])
    mesh = None
    params = _params_by_name(model)
    state: dict[str, Any] = {}
    streamed: list[torch.nn.Parameter] = []  # their host copies go to their tier once read
    resharded: list[tuple[torch.Tensor, torch.Tensor, Any]] = []  # (host copy, whole weight read, shards)

    def mesh_now():
        nonlocal mesh
        if mesh is None:
            mesh = _mesh(model, required=True)
        return mesh

    for name, param in params.items():
        fqn = _MODEL + name
        size = _saved_size(metadata, fqn, param.shape, path)
        shards = shard_group_of(param)
        if weight_home(param) is None:
            # Resident (or not compiled yet): the whole weight, in place.
            state[fqn] = param.detach().view(size)
            continue
        if not _steps(optimizer, param):
            raise ValueError(f"load_sharded: {name!r} is streamed; pass the optimizer that steps it")
        master = optimizer.host_copy(param)
        if shards is None:
            target = master.view(size)
        elif len(size) == 1:
            target = _as_dtensor(master, param.numel(), mesh_now())
        else:  # saved whole: read it, keep this rank's shard
            target = torch.empty(size, dtype=master.dtype)
            resharded.append((master, target, shards))
        state[fqn] = target
        streamed.append(param)
    for name, buffer in _persistent_buffers(model):
        fqn = _MODEL + name
        state[fqn] = buffer.detach().view(_saved_size(metadata, fqn, buffer.shape, path))
    loaded_state: dict[str, dict[str, Any]] = {}
    if optimizer is not None:
        for fqn, item in metadata.items():
            if not fqn.startswith(_OPTIMIZER):
                continue
            name, key = fqn[len(_OPTIMIZER):].rsplit("/", 1)
            param = params[name]
            if isinstance(item, BytesStorageMetadata):
                state[fqn] = None
                continue
            shards = shard_group_of(param)
            will_shard = shards is None and weight_home(param) is None and fqn in saved_sharded and not no_dist
            if len(item.size) == 1 and item.size[0] == param.numel() and (shards is not None or will_shard):
                # This rank's padded shard of a sharded state tensor.
                world_size = dist.get_world_size()
                padded = torch.zeros(-(-param.numel() // world_size), dtype=item.properties.dtype)
                state[fqn] = _as_dtensor(padded, param.numel(), mesh_now())
                loaded_state.setdefault(name, {})[key] = padded
            else:
                state[fqn] = torch.empty(item.size, dtype=item.properties.dtype)
    with _single_process_quiet():
        dcp.load(state, storage_reader=dcp.FileSystemReader(path), planner=DefaultLoadPlanner(**planner),
                 no_dist=no_dist)
    with torch.no_grad():
        for master, whole, shards in resharded:
            master.copy_(shards.shard(whole))
    if optimizer is None:
        return
    optimizer.store_host_copies(streamed)
    for fqn, value in state.items():
        if not fqn.startswith(_OPTIMIZER):
            continue
        name, key = fqn[len(_OPTIMIZER):].rsplit("/", 1)
        if key in loaded_state.get(name, {}):
            continue
        param = params[name]
        if isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == param.numel():
            value = value.view(param.shape)  # saved sharded, read whole
        loaded_state.setdefault(name, {})[key] = value
    optimizer.load_state_dict({"optimizer": meta["optimizer"], "param_groups": meta["param_groups"],
                               "state": loaded_state})


# -- helpers ---------------------------------------------------------------
@contextlib.contextmanager
def _single_process_quiet() -> Iterator[None]:
    """Without a process group, DCP warns that it assumes one process: that is the
    intent here (a checkpoint saved or read by one process), so it stays quiet."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def _check_optimizer(optimizer) -> None:
    if optimizer is not None and not isinstance(optimizer, OffloadedOptimizer):
        raise TypeError(f"save_sharded/load_sharded take the optimizer slcompile.offload_optimizer made "
                        f"(or None), got {type(optimizer).__name__}; save a torch optimizer with "
                        "torch.distributed.checkpoint directly")


def _steps(optimizer: OffloadedOptimizer | None, param: torch.nn.Parameter) -> bool:
    """Whether `optimizer` steps `param` (and so keeps its host copy)."""
    return optimizer is not None and any(p is param for p in optimizer.params)


def _params_by_name(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    return dict(model.named_parameters())


def _persistent_buffers(model: torch.nn.Module):
    for module_name, module in model.named_modules():
        for name, buffer in module.named_buffers(recurse=False):
            if buffer is not None and name not in module._non_persistent_buffers_set:
                yield (f"{module_name}.{name}" if module_name else name), buffer


_MESH: tuple[Any, Any] | None = None  # (the default group it was made under, the mesh)


def _mesh(model: torch.nn.Module, required: bool = False):
    """A 1-D device mesh over the default group's ranks, made once per default group
    (None when nothing is sharded). It only places the shards: DCP runs its own
    collectives on the default group."""
    global _MESH
    if not required and all(shard_group_of(p) is None for p in model.parameters()):
        return None
    if _MESH is None or _MESH[0] is not dist.group.WORLD:
        from torch.distributed.device_mesh import init_device_mesh

        _MESH = (dist.group.WORLD, init_device_mesh("cpu", (dist.get_world_size(),)))
    return _MESH[1]


def _shard_range(numel: int, mesh) -> tuple[int, int]:
    """This rank's `[start, end)` of a flat tensor of `numel` elements (the padding cut off)."""
    return shard_range(numel, mesh.get_local_rank(), mesh.size())


def _as_dtensor(padded: torch.Tensor, numel: int, mesh) -> DTensor:
    """This rank's padded flat shard as its part of the 1-D view of the whole tensor."""
    start, end = _shard_range(numel, mesh)
    return DTensor.from_local(padded.reshape(-1)[: end - start], mesh, [Shard(0)], run_check=False,
                              shape=torch.Size([numel]), stride=(1,))


def _is_shard(value: Any, param: torch.nn.Parameter, shards) -> bool:
    return isinstance(value, torch.Tensor) and value.dim() == 1 and value.numel() == shards.shard_numel(param.numel())


def _weight_values(param: torch.nn.Parameter, optimizer: OffloadedOptimizer | None) -> torch.Tensor:
    """The values of a parameter to save: whole, or this rank's padded flat shard."""
    home = weight_home(param)
    if home is None:
        return param.detach()
    if _steps(optimizer, param):
        return optimizer.host_copy(param).to(param.dtype)
    engine, key, _ = home
    values = engine.wait(engine.load(key, TransferKind.WEIGHT))
    return values if shard_group_of(param) is not None else values.view(param.shape)


def _saved_size(metadata, fqn: str, shape: torch.Size, path: str) -> torch.Size:
    """The shape `fqn` was saved in: `shape`, or its 1-D view when it was sharded."""
    item = metadata.get(fqn)
    if not isinstance(item, TensorStorageMetadata):
        raise ValueError(f"load_sharded: {path} has no tensor {fqn!r} (a checkpoint of another model?)")
    if item.size not in (shape, torch.Size([shape.numel()])):
        raise ValueError(f"load_sharded: {fqn!r} has shape {tuple(item.size)} in {path}, the model's is "
                         f"{tuple(shape)}")
    return item.size
