"""Block weights that rest on a slower tier and are fetched for each pass.

The `stream_weights` pass puts `slc::fetch_weight(param, key)` in front of each block
of the rewritten graph, and `place_prefetches` puts `slc::fetch_issue(key)` of the
same key `live_blocks - 1` blocks earlier (schemas in `slcompile.vocabulary`); this
module keeps the weights and implements both ops.

- `WeightStreamer.offload(key, param)` stores a parameter's values on the tier and
  releases the parameter's storage (its shape, dtype and identity stay, so Dynamo's
  guards and autograd see the same parameter; its memory is gone).
- `slc::fetch_issue(key)` starts the load of the weight `key` names, on the engine's
  I/O threads, and keeps it pending under that key; `slc::fetch_weight(param, key)`
  takes the pending load of its key (or, when none was issued, loads right away) and
  returns the values as a new tensor. The graphs pair the two by key: an issue at the
  end of a forward serves a fetch of the backward, an issue at the end of a backward
  serves a fetch of the next forward. An issue whose key is already pending does
  nothing, so each fetch is served by exactly one load.
- `slc::fetch_weight` is a pure function of its key (the compiler re-runs it: the
  backward fetches again instead of keeping the forward's copy alive) and its
  gradient flows to the parameter unchanged.
- A released parameter's class becomes a subclass of its own (`_Released...`) whose
  `__torch_function__` lets metadata through (shape, dtype, device, `.grad`,
  `requires_grad`, `empty_like`, the `slc::` ops the compiled graphs call) and raises
  `ReleasedWeightError` for anything that would read or write its values (an
  eager forward, `.data`'s values, `clone`), where a kernel would read freed
  memory. `detach()` raises too, so `state_dict()` (which calls it) refuses before
  it returns: `torch.save(model.state_dict(), path)` opens `path` only after its
  argument is built, and a refusal in the pickler would come after the file was
  truncated. For that reason `torch.save(model, path)`, which pickles the parameters
  after opening its file, does not refuse: a whole offloaded parameter pickles as a
  plain parameter of its stored values, loaded for it. A parameter whose offloaded
  optimizer keeps its values (the consumer of its gradients, `slcompile.optim`)
  detaches to a tensor of the same kind, which that optimizer's `state_dict()` hook
  replaces by the values. A `torch.optim` step
  that would update a released parameter (one with a `.grad`) that no offloaded
  optimizer steps is refused by a global step pre-hook before it updates anything,
  so a step retried inside `gathered_weights` steps every parameter once. A
  conversion to what the parameter already is (`model.to(its device)`,
  `model.float()`) returns it. Dynamo
  guards on the class; it is set while the backend compiles, before the guards are
  made, so they expect it, and while Dynamo compiles (a recompile traces through the
  method) everything passes. The compiled graphs hand released parameters to
  `slc::fetch_weight` and AOTAutograd asks them `_is_view()`: about 3 µs of Python
  each, per fetch.
- `gathered_weights(model)` (`slcompile.runtime.gathering`) brings the values back
  into the parameters for code that reads them directly (an optimizer step,
  `state_dict()`), then offloads them again, all or none: the room for the new
  values is reserved on entry, so a full disk raises there, before the block changes
  anything, and the new values are written beside the old ones, which they replace
  only once all are written (`update_weights`); on a host tier that copies they are
  written into the old ones' memory once all are ready (nothing there can run out
  of room), so each weight keeps its address. It first drops pending loads, so no
  stale value is ever read.
- Sharded (`shards`, a `slcompile.runtime.collectives.ShardGroup`): the tier holds this
  rank's shard of each weight; an issue loads it and all-gathers the full weight on
  the group's communication thread (a prefetch overlaps both with compute), and
  `gathered_weights` all-gathers too (every rank must call it). Only the graphs
  issue all-gathers, so every rank issues them in the same order: the loads the
  optimizer issues after a block's update load the shard only, and the all-gather
  waits for the fetch. The thread that issues an all-gather allocates its output
  buffer (`ShardGroup.gathered_buffer`: the padded full weight) and keeps the
  shard's load until the fetch: the device holds both from the issue to the fetch,
  and the gathered buffer, as the fetched weight, after it; each is freed on the
  graph's thread (`slcompile.analysis.memory` predicts them so).

Graph keys are `WeightKey`s, `w3|w0:layers_0_fc_weight#sb1@bwd`: the streamer of the
compiled graph, the stored tensor's key, the sub-batch of a per-sub-batch fetch and
the phase.
"""

from __future__ import annotations

import functools
import logging
import threading
import weakref
from types import MappingProxyType
from typing import NamedTuple

import torch
from torch._C import DisableTorchFunctionSubclass
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from slcompile.analysis.inputs import parameter_name
from slcompile.errors import ReleasedWeightError
from slcompile.plans import new_name
from slcompile.runtime import gradients, ops
from slcompile.runtime.storage.engine import TransferEngine, TransferHandle
from slcompile.runtime.errors import OffloadError
from slcompile.runtime.storage.tiers import Tier, TransferKind
from slcompile.runtime.visits import PackedVisits
from slcompile.vocabulary import WeightKey, packing_order

__all__ = [
    "WeightStreamer", "stored_key_for", "mark_sharded", "weight_home", "update_weights",
    "stage_weights", "commit_weights", "discard_weights", "StagedWeight", "drain_prefetches", "shard_group_of",
    "fetch_weight_many", "fetch_issue_many",
    "release", "restore", "parameter_name", "forget_weights", "load_whole",
]

log = logging.getLogger(__name__)

# Streamer name -> streamer, for the graphs' `slc::` ops, without keeping it alive:
# the compiled graphs that call them hold their streamer (`hold_runtime`), so a
# streamer goes with the last of them.
_STREAMERS: weakref.WeakValueDictionary[str, WeightStreamer] = weakref.WeakValueDictionary()
# Parameter -> (engine, stored key, tier), by identity, without keeping it alive.
_OWNERS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Parameter -> the ShardGroup its weight is sharded over, from compile time on.
_SHARDS: WeakIdKeyDictionary = WeakIdKeyDictionary()
# Released parameter -> (its class before the release, its name for messages).
_RELEASED: WeakIdKeyDictionary = WeakIdKeyDictionary()
_REGISTRY_LOCK = threading.Lock()


def mark_sharded(params, shards) -> None:
    """Marks `params` as sharded over the `ShardGroup` `shards` (before the lowering,
    so an offloaded optimizer prepares shard-sized copies)."""
    with _REGISTRY_LOCK:
        for param in params:
            _SHARDS[param] = shards


def stored_key_for(streamer: str, name: str, param: torch.Tensor) -> str:
    """The key `param` is stored under when the streamer named `streamer` streams it
    as `name`: the key it already has if another graph offloaded it."""
    with _REGISTRY_LOCK:
        owner = _OWNERS.get(param)
    return f"{streamer}:{name}" if owner is None else owner[1]


def _metadata_functions() -> frozenset:
    """What a released parameter answers: everything that reads no values."""
    tensor = torch.Tensor
    functions = {
        tensor.size, tensor.dim, tensor.stride, tensor.storage_offset, tensor.numel, tensor.element_size,
        tensor.is_contiguous, tensor.untyped_storage, tensor.data_ptr, tensor.requires_grad_,
        tensor.register_hook, tensor.register_post_accumulate_grad_hook, tensor.retain_grad, tensor.__len__,
        tensor.__hash__, tensor.get_device, tensor.is_floating_point, tensor.is_complex, tensor._is_view,
        tensor.is_inference, tensor.is_conj, tensor.is_neg, tensor._is_zerotensor, tensor._fix_weakref,
        torch._has_compatible_shallow_copy_type,
        torch.empty_like,  # new memory of the same layout (passes make their meta values so)
    }
    for name in ("shape", "dtype", "device", "requires_grad", "grad", "is_leaf", "ndim", "layout", "is_cuda",
                 "is_cpu", "is_meta", "is_sparse", "is_quantized", "is_nested", "is_mkldnn", "grad_fn",
                 "_version", "itemsize", "nbytes", "_base", "names", "output_nr", "_grad", "_grad_fn",
                 "retains_grad", "_backward_hooks", "_post_accumulate_grad_hooks"):
        attribute = getattr(tensor, name, None)
        for accessor in ("__get__", "__set__", "__delete__"):
            if hasattr(attribute, accessor):
                functions.add(getattr(attribute, accessor))
    return frozenset(functions)


_METADATA = _metadata_functions()
_DATA = torch._C.TensorBase.__dict__["data"]  # its __get__ / __set__ are made anew at each access


def _is_data(func, accessor: str) -> bool:
    return getattr(func, "__name__", None) == accessor and getattr(func, "__self__", None) is _DATA


class _ReleasedMixin:
    """Turns every use of a released parameter's values into `ReleasedWeightError`."""

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # First, and nothing Dynamo cannot trace before it: a recompile traces this
        # method (the parameters are graph inputs, fetched by the graph it captures),
        # and Dynamo's own code reads their metadata while it compiles.
        if torch.compiler.is_compiling():
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func in _METADATA or _is_slc_op(func) or _reads_metadata(func):
            with DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        if func is torch.Tensor.detach and gradients.consumer_of(args[0]) is None:
            name, tier = _released_info(args[0]) or ("(unnamed)", "offload")
            raise ReleasedWeightError(name, tier, what="detach, as state_dict() calls it")
        if func is torch.Tensor.detach or _is_data(func, "__get__"):  # released until read
            with DisableTorchFunctionSubclass():
                detached = func(*args, **kwargs)
            _mark_released(detached, args[0], _ReleasedTensor)
            return detached
        if func is torch.Tensor.__repr__:
            return _describe(args[0])
        if _leaves_as_is(func, args, kwargs):  # `model.to(its own device)`, `model.float()` of a float model
            return args[0]
        name, tier = next((_released_info(t) for t in _tensors(args, kwargs) if _released_info(t) is not None),
                          ("(unnamed)", "offload"))
        raise ReleasedWeightError(name, tier, what=getattr(func, "__name__", str(func)))

    def __reduce_ex__(self, protocol):
        # `torch.save(model, path)` pickles the parameters after it has opened, and
        # truncated, its file: a refusal here would leave an empty checkpoint where a
        # good one may have been. So a whole offloaded parameter pickles as a plain
        # parameter of its stored values (a load, counted as weight traffic); only a
        # weight sharded over ranks, which one rank cannot gather alone, refuses.
        shards = shard_group_of(self)
        if weight_home(self) is None or (shards is not None and shards.world_size > 1):
            return super().__reduce_ex__(protocol)
        saved = torch.nn.Parameter(load_whole(self).view(self.shape), self.requires_grad)
        saved.__dict__.update(self.__dict__)
        return saved.__reduce_ex__(protocol)


def _is_slc_op(func) -> bool:
    """An `slc::` op, as an overload (`torch.ops.slc.fetch_weight.default`, what graphs
    call) or as its packet (`torch.ops.slc.fetch_weight`, what Python code calls)."""
    return (getattr(func, "namespace", None) == "slc"
            or getattr(func, "_qualified_op_name", "").startswith("slc::"))


# Tensor properties that are views of the values, not metadata.
_VALUE_PROPERTIES = frozenset({"data", "real", "imag", "T", "mT", "H", "mH"})


def _reads_metadata(func) -> bool:
    """Whether `func` gets or sets a tensor property other than a view of its values
    (`grad_dtype`, `is_leaf`, ...: Dynamo reads many of them)."""
    if getattr(func, "__name__", None) not in ("__get__", "__set__", "__delete__"):
        return False
    return getattr(getattr(func, "__self__", None), "__name__", None) not in _VALUE_PROPERTIES


_CASTS = MappingProxyType({torch.Tensor.float: torch.float32, torch.Tensor.double: torch.float64,
                           torch.Tensor.half: torch.float16, torch.Tensor.bfloat16: torch.bfloat16})


def _leaves_as_is(func, args, kwargs) -> bool:
    """Whether `func(*args, **kwargs)` returns its released first argument itself
    (a conversion to what it already is, as `Module.to` / `Module.float` make), or
    sets its `.data` to itself: no value is read."""
    tensor = args[0] if args else None
    if _is_data(func, "__set__"):
        return args[1] is tensor
    if func in _CASTS:
        return _CASTS[func] == tensor.dtype and not kwargs
    if func is torch.Tensor.cpu:
        return tensor.device.type == "cpu"
    if func is torch.Tensor.to:
        device, dtype, _, memory_format = torch._C._nn._parse_to(*args[1:], **kwargs)
        return (device is None or torch.device(device) == tensor.device) and \
            (dtype is None or dtype == tensor.dtype) and memory_format in (None, torch.preserve_format) and \
            not kwargs.get("copy", False)
    return False


class _ReleasedTensor(_ReleasedMixin, torch.Tensor):
    """`.data` of a released parameter, or its `state_dict()` entry where an offloaded
    optimizer fills that entry in."""


def _refuse_steps_of_released(optimizer, args, kwargs) -> None:
    """A `torch.optim` step pre-hook: refuses, before any parameter changes, a step
    that would update a released parameter (one with a gradient) that no offloaded
    optimizer steps (that one, or a wrapper such as accelerate's, steps it from its
    host copy). Unhooked, a for-loop SGD updates the resident parameters and raises
    at the first released one, and a retry steps those twice."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            if isinstance(param, _ReleasedMixin) and param.grad is not None \
                    and gradients.consumer_of(param) is None:
                name, tier = _released_info(param) or ("(unnamed)", "offload")
                raise ReleasedWeightError(name, tier, what=f"{type(optimizer).__name__}.step")


_STEP_HOOK = None  # the handle of `_refuse_steps_of_released`, from the first release on


def _hook_optimizer_steps() -> None:
    global _STEP_HOOK
    with _REGISTRY_LOCK:
        if _STEP_HOOK is None:
            _STEP_HOOK = register_optimizer_step_pre_hook(_refuse_steps_of_released)


_RELEASED_CLASSES: dict[type, type] = {}


def _released_class(cls: type) -> type:
    """The class a released parameter of class `cls` takes (made once per class)."""
    if issubclass(cls, _ReleasedMixin):
        return cls
    if cls not in _RELEASED_CLASSES:
        _RELEASED_CLASSES[cls] = type(f"Released{cls.__name__}", (_ReleasedMixin, cls), {"__module__": __name__})
    return _RELEASED_CLASSES[cls]


def _tensors(args, kwargs):
    for value in (*args, *kwargs.values()):
        if isinstance(value, torch.Tensor):
            yield value
        elif isinstance(value, (list, tuple)):
            yield from (v for v in value if isinstance(v, torch.Tensor))


def _released_info(tensor: torch.Tensor) -> tuple[str, str] | None:
    with _REGISTRY_LOCK:
        entry = _RELEASED.get(tensor)
    return None if entry is None else entry[1:]


def _describe(tensor: torch.Tensor) -> str:
    name, tier = _released_info(tensor)
    return f"<released {tensor.dtype} weight of shape {tuple(tensor.shape)}: {name}, on the {tier} tier>"


def _mark_released(tensor: torch.Tensor, like: torch.Tensor, cls: type | None = None) -> None:
    """Makes `tensor` (its storage released) raise on use, named like `like`."""
    with _REGISTRY_LOCK:
        entry = _RELEASED.get(like)
        _RELEASED[tensor] = (type(tensor), *entry[1:])
    tensor.__class__ = cls or _released_class(type(tensor))


def release(param: torch.Tensor, name: str, tier: Tier) -> None:
    """Releases `param`'s storage (its values are stored elsewhere) and makes any use
    of its values raise `ReleasedWeightError` naming it."""
    _hook_optimizer_steps()
    param.untyped_storage().resize_(0)
    with _REGISTRY_LOCK:
        original = _RELEASED[param][0] if param in _RELEASED else type(param)
        _RELEASED[param] = (original, name, Tier(tier).value)
    param.__class__ = _released_class(original)


def restore(param: torch.Tensor, nbytes: int) -> None:
    """Gives a released parameter `nbytes` of storage and its class back."""
    with _REGISTRY_LOCK:
        original = _RELEASED[param][0]
    param.__class__ = original
    param.untyped_storage().resize_(nbytes)


class WeightStreamer:
    """The streamed weights of one compiled graph, on one tier.

    Args:
        engine: the transfer engine that stores and loads them.
        tier: where the weights rest between uses.
        live_blocks: how many blocks' weights may be on the device at once: the one
            computing and `live_blocks - 1` prefetched (the graphs' `slc::fetch_issue`
            calls sit that far ahead; the streamer loads whatever they issue).
        shards: the `ShardGroup` the weights are sharded over (None: whole weights).
    """

    def __init__(self, engine: TransferEngine, tier: Tier | str, live_blocks: int, shards=None,
                 name: str | None = None, group_issues: bool = False):
        self.shards = shards
        # Issues held until the next fetch, then loaded together (`load_many`): the
        # graphs put every run of issues just before a fetch (`StreamerPlan`).
        self.group_issues = group_issues and shards is None
        self.queued: dict[str, str] = {}  # graph key -> stored key, not yet issued to the engine
        self.engine = engine
        self.tier = Tier(tier)
        self.live_blocks = live_blocks
        self.name = name or new_name("w")
        self.pending: dict[str, TransferHandle] = {}  # graph key -> issued load (or all-gather)
        # Sharded: graph key -> the load of the shard a pending all-gather reads,
        # held until the fetch so the shard is freed there, on the graph's thread.
        self.shard_loads: dict[str, TransferHandle] = {}
        self.shapes: dict[str, torch.Size] = {}  # stored key -> the weight's shape
        self.dtypes: dict[str, torch.dtype] = {}  # stored key -> the weight's dtype
        self.visits = PackedVisits(engine, self.shapes, self.dtypes)  # loaded packed (`issue_many`)
        # Stored key -> the engine holding it, for weights another streamer stored
        # (a graph compiled again, perhaps with another offload_dir); else `engine`.
        self.homes: dict[str, TransferEngine] = {}
        self.lock = threading.Lock()
        with _REGISTRY_LOCK:
            _STREAMERS[self.name] = self

    # -- set-up, when the compiled step starts (`StepRuntime.start`) -----
    def stored_key_for(self, name: str, param: torch.Tensor) -> str:
        """The stored key of `param`: its existing one if it is already offloaded."""
        return stored_key_for(self.name, name, param)

    def graph_key(self, stored_key: str) -> WeightKey:
        """The key of a fetch of `stored_key` in this streamer's graphs."""
        return WeightKey(self.name, stored_key)


    def offload(self, stored_key: str, param: torch.Tensor, name: str | None = None) -> None:
        """`offload_block` of one parameter."""
        self.offload_block([(stored_key, param, name or stored_key)])

    def offload_block(self, members) -> None:
        """Stores the values of a block's parameters (this rank's shards when sharded)
        together (`TransferEngine.store_many`) and releases their storage; a
        parameter already offloaded (a graph compiled again) is left as it is.

        Args:
            members: (stored key, parameter, its name for messages) of each, in the
                order the block reads them (a visit's loads follow it).
        """
        fresh = []
        # Stored in packing order: a visit packs its weights in the order the host
        # group holds them, so that it copies each run of them once (`runtime/visits.py`).
        order = packing_order([(stored_key, param.dtype) for stored_key, param, _ in members])
        for stored_key, param, name in (members[i] for i in order):
            self.shapes[stored_key] = param.shape
            self.dtypes[stored_key] = param.dtype
            with _REGISTRY_LOCK:
                owner = _OWNERS.get(param)
            if owner is not None:
                self.homes[owner[1]] = owner[0]
            else:
                fresh.append((stored_key, param, name))
        if not fresh:
            return
        values = [param.detach() if self.shards is None else self.shards.shard(param) for _, param, _ in fresh]
        handles = self.engine.store_many([key for key, _, _ in fresh], values, self.tier, TransferKind.WEIGHT)
        self.engine.wait_many(handles)
        for stored_key, param, name in fresh:
            release(param, name, self.tier)
            with _REGISTRY_LOCK:
                _OWNERS[param] = (self.engine, stored_key, self.tier)

    # -- at run time ------------------------------------------------------
    def issue(self, key: WeightKey, *, gather: bool = True, graph_key: str | None = None) -> None:
        """Starts the load `key` names, unless one is already pending under it.
        Sharded, `gather` also issues its all-gather (only the graphs' issues do).
        `graph_key` is `key.format()`, when the caller has it."""
        graph_key = graph_key or key.format()
        with self.lock:
            if graph_key in self.pending or graph_key in self.queued:
                return
            if self.group_issues:
                self.queued[graph_key] = key.stored
                return
            engine = self._engine_of(key.stored)
            self.pending[graph_key] = engine.load(key.stored, TransferKind.WEIGHT)
            if self.shards is not None and gather:
                self.shard_loads[graph_key] = self.pending[graph_key]
                self.pending[graph_key] = self._gather(key, self.pending[graph_key])

    def fetch(self, key: WeightKey, graph_key: str | None = None) -> torch.Tensor:
        """The weight `key` names: its pending load's result, or a load now.
        `graph_key` is `key.format()`, when the caller has it."""
        graph_key = graph_key or key.format()
        with self.lock:
            if self.queued:
                self._issue_queued()
            handle = self.pending.pop(graph_key, None)
            load = self.shard_loads.pop(graph_key, None)
        engine = self._engine_of(key.stored)
        if handle is None:
            handle = engine.load(key.stored, TransferKind.WEIGHT)
        if self.shards is None:
            return engine.wait(handle)
        if handle.kind is not TransferKind.ALL_GATHER:
            load, handle = handle, self._gather(key, handle)
        weight = self.shards.wait(handle)
        if self.shards.world_size > 1:  # one rank's weight is its shard's memory
            _release_shard(engine, load)
        return weight

    # -- a visit's weights, packed (`slc::fetch_weight_many`) -------------
    def _packs(self, keys: list[WeightKey]) -> bool:
        """Whether these weights load straight into a visit's packed tensors
        (`runtime/visits.py`): whole weights resting in this streamer's engine (this
        streamer's, or an earlier compile's of the same model) on a host tier that
        copies."""
        return (self.shards is None and self.tier is Tier.HOST
                and not self.engine.copies_nothing(Tier.HOST, Tier.DEVICE)
                and all(self._engine_of(key.stored) is self.engine for key in keys))

    def issue_many(self, keys: list[WeightKey], graph_keys: list[str]) -> None:
        """`issue` of each key, as one: a visit's weights on a host tier that copies
        are loaded straight into its packed tensors, which `fetch_many` takes."""
        if not self._packs(keys):
            for key, graph_key in zip(keys, graph_keys):
                self.issue(key, graph_key=graph_key)
            return
        with self.lock:
            if not any(k in self.pending or k in self.queued for k in graph_keys):
                self.visits.issue(keys, graph_keys)

    def fetch_many(self, keys: list[WeightKey], graph_keys: list[str]) -> list[torch.Tensor]:
        """The weights `keys` name (in packing order, as `coalesce_transfers` writes
        them), packed as `vocabulary.weight_layout` says: the visit's loads issued by
        `issue_many`, or loaded now. Weights that load another way (sharded, issued
        one by one, resting in another engine) are fetched one by one and packed by
        copies."""
        with self.lock:
            loading = self.visits.take(graph_keys)
            alone = self.queued or any(k in self.pending for k in graph_keys)
        if loading is None and not alone and self._packs(keys):
            loading = self.visits.load(keys)
        if loading is not None:
            return self.visits.wait(loading)
        return self.visits.pack([self.fetch(key, graph_key) for key, graph_key in zip(keys, graph_keys)])

    def _gather(self, key: WeightKey, load: TransferHandle) -> TransferHandle:
        """The all-gather of the weight whose shard `load` brings, into a buffer
        allocated here (the caller keeps `load` until the gather's wait)."""
        engine = self._engine_of(key.stored)
        shape = self.shapes[key.stored]
        # One rank: the shard is the weight; no buffer to gather into.
        out = self.shards.gathered_buffer(shape, self.dtypes[key.stored], engine.device) \
            if self.shards.world_size > 1 else None
        return self.shards.all_gather(key.format(), lambda: engine.wait(load), shape, out=out)

    def _engine_of(self, stored_key: str) -> TransferEngine:
        return self.homes.get(stored_key, self.engine)

    def _issue_queued(self) -> None:
        """Starts the held issues' loads, those of one engine together (the caller
        holds the lock)."""
        queued, self.queued = self.queued, {}
        by_engine: dict[int, tuple[TransferEngine, list[str]]] = {}
        for graph_key, stored in queued.items():
            engine = self._engine_of(stored)
            by_engine.setdefault(id(engine), (engine, []))[1].append(graph_key)
        for engine, graph_keys in by_engine.values():
            handles = engine.load_many([queued[k] for k in graph_keys], TransferKind.WEIGHT)
            self.pending.update(zip(graph_keys, handles))

    def _drop_pending(self) -> int:
        """Waits for and drops the loads issued ahead; returns their bytes (all-gathers' aside)."""
        self.queued.clear()  # never issued: nothing to wait for
        dropped = self.visits.drop()
        pending, self.pending = self.pending, {}
        shard_loads, self.shard_loads = self.shard_loads, {}
        for graph_key, handle in pending.items():
            if handle.kind is TransferKind.ALL_GATHER:
                self.shards.wait(handle)  # every rank issued it, so it ends
                if self.shards.world_size > 1:
                    _release_shard(self._engine_of(WeightKey.parse(graph_key).stored), shard_loads[graph_key])
            else:
                try:
                    self.engine.wait(handle)
                except OffloadError as err:
                    # Dropped unread: a fetch that needs the weight loads it again and
                    # raises there; the caller draining (an optimizer step, another
                    # model's compile) has nothing to do with it.
                    log.debug("a dropped prefetch of %s failed: %s", graph_key, err)
                else:
                    dropped += handle.nbytes
        return dropped

    def drain(self) -> int:
        """Waits for and drops prefetched loads: before the weights change (an
        optimizer step), so no stale copy is ever read. Returns the bytes they loaded."""
        with self.lock:
            return self._drop_pending()

    def reissue(self, stored_key: str) -> int:
        """Issues again the pending loads of `stored_key` (after a store of new values
        under it: each load then reads them); returns how many were stale."""
        with self.lock:
            stale = [k for k in self.pending if WeightKey.parse(k).stored == stored_key]
            gathered = [k for k in stale if self.pending[k].kind is TransferKind.ALL_GATHER]
            if gathered:
                # Issuing it again here would put it out of step with the other ranks.
                raise OffloadError(
                    "a weight was updated while its all-gather of the old values was pending; with "
                    "shard_weights, prefetches of the next forward must wait for the update",
                    key=stored_key,
                )
            for graph_key in stale:
                engine = self._engine_of(stored_key)
                engine.wait(self.pending.pop(graph_key))
                self.pending[graph_key] = engine.load(stored_key, TransferKind.WEIGHT)
            visits = self.visits.reload(stored_key)
        return len(stale) + visits


def _release_shard(engine: TransferEngine, load: TransferHandle) -> None:
    """Frees a gathered shard's load now, on this thread (the graph's): the I/O
    thread that loaded it may hold the last reference a little longer, and the
    memory must not follow that thread's timing. Only a CPU tensor of its own
    memory from torch's allocator (on the GPU, the collective's stream may still
    read it until the caching allocator sees it unused; a zero-copy load is the
    stored shard itself; a page buffer returns to its cache when unused)."""
    if load.zero_copy:
        return
    shard = engine.wait(load)
    storage = shard.untyped_storage()
    if shard.device.type == "cpu" and storage.resizable():
        storage.resize_(0)


def _streamer_of(key: WeightKey) -> WeightStreamer:
    streamer = _STREAMERS.get(key.streamer)
    if streamer is None:
        raise KeyError(f"no weight streamer {key.streamer!r} for key {key.format()!r}")
    return streamer


@functools.lru_cache(maxsize=1 << 14)
def _parsed_key(key: str) -> tuple[WeightKey, str]:
    """The key and its canonical form; a graph's keys are few and fixed, so each is
    parsed once, not at every call."""
    parsed = WeightKey.parse(key)
    return parsed, parsed.format()


def fetch_issue(key: str, gather: bool = True) -> torch.Tensor:
    """Starts loading the weight `key` names; `fetch_weight` of that key takes it.
    Returns a dependency token. A sharded weight's all-gather is issued too unless
    `gather` is False (an issue from outside the graphs: the fetch issues it)."""
    parsed, graph_key = _parsed_key(key)
    _streamer_of(parsed).issue(parsed, gather=gather, graph_key=graph_key)
    return ops._dependency_token()


def fetch_weight(param: torch.Tensor, key: str) -> torch.Tensor:
    """The values of an offloaded parameter, as a new tensor on the device."""
    parsed, graph_key = _parsed_key(key)
    return _streamer_of(parsed).fetch(parsed, graph_key=graph_key)


def fetch_issue_many(keys: list[str]) -> None:
    """`fetch_issue` of each key, as one call: a block visit's issues (one streamer's,
    as `coalesce_transfers` groups them)."""
    parsed = [_parsed_key(key) for key in keys]
    streamer = _streamer_of(parsed[0][0])
    if any(key.streamer != streamer.name for key, _ in parsed):
        for key in keys:
            fetch_issue(key)
        return
    streamer.issue_many([key for key, _ in parsed], [graph_key for _, graph_key in parsed])


def fetch_weight_many(params: list[torch.Tensor], keys: list[str]) -> list[torch.Tensor]:
    """A block visit's weights (one streamer's, in packing order, as
    `coalesce_transfers` groups them), packed: one tensor per dtype
    (`vocabulary.weight_layout`)."""
    parsed = [_parsed_key(key) for key in keys]
    return _streamer_of(parsed[0][0]).fetch_many([key for key, _ in parsed], [graph_key for _, graph_key in parsed])


def shard_group_of(param: torch.Tensor):
    """The `ShardGroup` a parameter's weight is sharded over; None when it is not."""
    with _REGISTRY_LOCK:
        return _SHARDS.get(param)


def weight_home(param: torch.Tensor) -> tuple[TransferEngine, str, Tier] | None:
    """(engine, stored key, tier) of an offloaded parameter; None when it is resident."""
    with _REGISTRY_LOCK:
        return _OWNERS.get(param)


def load_whole(param: torch.Tensor) -> torch.Tensor:
    """The values of an offloaded parameter, loaded now (all-gathered when sharded)."""
    engine, key, _ = weight_home(param)
    load = engine.load(key, TransferKind.WEIGHT)
    shards = shard_group_of(param)
    if shards is None:
        return engine.wait(load)
    return shards.wait(shards.all_gather(key, lambda: engine.wait(load), param.shape))


def update_weights(updates: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """Stores new values of offloaded parameters, all of them or none (an optimizer
    step's write-back): each is written under a staging key first, and only once
    every write has landed do the staging keys replace the parameters' keys (no
    copy, nothing that can run out of room). Loads of them issued before are issued
    again, so every later fetch reads the new values.

    Args:
        updates: (parameter, its new values); keep the values unchanged until this returns.

    Raises:
        OffloadError: a store failed (`DiskFullError` for a full disk); every
            parameter still holds its previous values, whole, and no staging key is left.
        KeyError: a parameter is not offloaded.
    """
    commit_weights(stage_weights(updates))


class StagedWeight(NamedTuple):
    """New values of an offloaded weight, written under a staging key beside the
    weight's own (which still holds the previous values) until `commit_weights`; or,
    on a host tier that copies, held (`values`, `staging_key` None) until
    `commit_weights` writes them into the weight's own memory."""

    engine: TransferEngine
    stored_key: str
    staging_key: str | None
    values: torch.Tensor | None = None


def _in_place(engine: TransferEngine, tier: Tier) -> bool:
    """Whether a weight on `tier` is updated in its own memory: on a host tier that
    copies (pinned memory on a GPU machine), whose addresses copies captured in a
    CUDA graph read, and where writing cannot run out of room."""
    return tier is Tier.HOST and not engine.copies_nothing(Tier.HOST, Tier.DEVICE)


def stage_weights(updates: list[tuple[torch.Tensor, torch.Tensor]], reserved=None) -> list[StagedWeight]:
    """The first half of `update_weights`: writes every new value under a staging key
    and waits for all of them; the weights' keys still hold the previous values. A
    weight updated in place (a host tier that copies) keeps its values in the record
    until `commit_weights`.

    Args:
        updates: (parameter, its new values); keep the values of a weight updated in
            place unchanged until `commit_weights`.
        reserved: for each update, room reserved for it (`TransferEngine.reserve`)
            or None; the caller gives back what no store used.

    Raises:
        OffloadError: a store failed; no staging key of these updates is left.
        KeyError: a parameter is not offloaded.
    """
    tried: list[tuple[TransferEngine, str]] = []  # (engine, staging key) of every store issued
    stores: list[tuple[StagedWeight, TransferHandle]] = []
    try:
        for number, (param, values) in enumerate(updates):
            home = weight_home(param)
            if home is None:
                raise KeyError("update_weights: the parameter is not offloaded")
            engine, stored_key, tier = home
            if _in_place(engine, tier):
                stores.append((StagedWeight(engine, stored_key, None, values.detach()), None))
                continue
            staging = f"{stored_key}~update"
            tried.append((engine, staging))
            handle = engine.store(staging, values.detach(), tier, TransferKind.WEIGHT,
                                  reserved=reserved[number] if reserved else None)
            stores.append((StagedWeight(engine, stored_key, staging), handle))
        for staged, handle in stores:
            if handle is not None:
                staged.engine.wait(handle)
    except BaseException:
        for engine, staging in tried:
            if staging in engine:
                engine.free(staging)
        raise
    return [staged for staged, _ in stores]


def commit_weights(staged: list[StagedWeight]) -> None:
    """Puts staged values in place of the weights' (renames, or copies into a host
    weight's own memory: nothing that can run out of room) and issues again loads of
    them issued before."""
    with _REGISTRY_LOCK:
        streamers = list(_STREAMERS.values())
    for engine, stored_key, staging, values in staged:
        if staging is None:
            engine.overwrite(stored_key, values, TransferKind.WEIGHT)
        else:
            engine.rename(staging, stored_key)
        stale = sum(streamer.reissue(stored_key) for streamer in streamers)
        if stale:
            log.debug("update_weights: %d prefetched loads of %r were stale and are issued again", stale, stored_key)


def discard_weights(staged: list[StagedWeight]) -> None:
    """Drops staged values: the weights keep their previous ones."""
    for engine, _, staging, _ in staged:
        if staging is not None and staging in engine:
            engine.free(staging)

ops.implement("fetch_issue", fetch_issue)
ops.implement("fetch_weight", fetch_weight)
ops.implement("fetch_weight_many", fetch_weight_many)


def forget_weights(model: torch.nn.Module) -> int:
    """Frees the stored values of `model`'s offloaded parameters and forgets them, and
    the streamers that streamed only those: for a model that will not run again (a copy
    compiled for one measurement), so what its tier held does not count in later
    figures of the process (the tiers' resident bytes and peaks). Its parameters stay
    released (any use of their values raises `ReleasedWeightError`).

    Returns:
        the number of parameters forgotten.
    """
    drain_prefetches()
    with _REGISTRY_LOCK:
        owned = [(p, _OWNERS[p]) for p in model.parameters() if p in _OWNERS]
        streamers = list(_STREAMERS.values())
        for param, (engine, stored_key, _) in owned:
            del _OWNERS[param]
            for streamer in streamers:
                streamer.homes.pop(stored_key, None)
        forgotten = {stored_key for _, (_, stored_key, _) in owned}
        still_owned = {stored_key for _, stored_key, _ in _OWNERS.values()}
        prefixes = {key.split(":", 1)[0] for key in forgotten}
        for name in [n for n in _STREAMERS if n in prefixes]:
            if not any(key.split(":", 1)[0] == name for key in still_owned):
                del _STREAMERS[name]
    for _, (engine, stored_key, _) in owned:
        if stored_key in engine:
            engine.free(stored_key)
    return len(owned)


def drain_prefetches() -> int:
    """Waits for and drops every streamer's prefetched loads (`WeightStreamer.drain`); returns their bytes."""
    with _REGISTRY_LOCK:
        streamers = list(_STREAMERS.values())
    return sum(streamer.drain() for streamer in streamers)
