"""The torch internals slcompile relies on that differ across the supported releases.

Supported: torch 2.11 through 2.15 (``pyproject.toml``: ``>=2.11,<2.16``). Every private
torch name whose place or existence changed inside that range is reached through this
module, chosen once at import by feature detection, so the rest of the package imports
one name and never branches on the version.

Needs: torch 2.11 or newer.

Guarantees:
- Importing this module does not fail on a supported release; a release outside the
  range is logged once at WARNING (it may work; it is not tested).
- ``optimization_hint(n)`` is the concrete size hint of an int or ``torch.SymInt``
  without adding guards: torch's own function where it exists (2.12 and later), else
  the shape environment's ``size_hint`` (2.11), which answers the same.

- ``backed_value(shape_env, symbol)`` is the value a backed size symbol had when
  traced (None for an unbacked one): ``ShapeEnv.backed_var_to_val`` where it exists,
  else ``var_to_val`` (which later releases still answer, with a warning).

What moved, for the record: ``torch.fx.experimental.symbolic_shapes.optimization_hint``
appeared in 2.12; 2.11 has ``ShapeEnv.size_hint`` (and ``hint_int``, gone by 2.13).
The other internals used (``torch._inductor.custom_graph_pass.CustomGraphPass``,
``CustomPartitionerFn``, ``get_hash_for_files``; the Inductor config keys
``custom_partitioner_fn``, ``joint_custom_pre_pass``, ``reorder_for_peak_memory``,
``reorder_for_locality``; ``torch._functorch.partitioners``; ``torch._dynamo.backends``;
``torch._library.effects.EffectType``, the fake-tensor helpers, ``torch._dynamo.exc``,
``torch._ops.OpOverload``) are in the same place on 2.11 and 2.13;
``missing_internals()`` lists any a release lacks.
- ``capture_graphs(fn, args, kwargs, on_graph)`` captures what Dynamo hands a backend
  without counting against the recompile limit of the caller's own
  ``torch.compile`` of the same code: ``torch.compile(..., isolate_recompiles=True)``
  (2.13 and later), whose cache entries are dropped after the capture when no other
  compile holds entries on that code; on a release without it (2.11, 2.12), a
  capture under a raised ``recompile_limit`` whose entries stay in the shared cache.
- ``graph_module(root, graph)`` makes a graph module that writes its Python code
  when it is first run or its code is read, not at every ``recompile()`` (torch's
  ``_LazyGraphModule``, what Dynamo hands a backend); ``lazy_graph_modules()`` makes
  the graph modules torch itself builds inside it (AOTAutograd's joint, forward and
  backward graphs) such too. A graph that is only analysed never writes its code.
- ``watch_recompile_limit(callback)`` calls ``callback(limit_name, limit, compiler_fn,
  code)`` whenever Dynamo refuses to compile a frame because it hit a recompile limit
  (the frame then runs eagerly): Dynamo only logs it. It wraps
  ``torch._dynamo.convert_frame.exceeds_recompile_limit`` and reads the backend from
  the frame of ``_compile`` that called it; a release without them is not watched.
  A callback that claims the frame (returns True) is called again at each later call
  that runs it eagerly: ``ConvertFrame.__call__`` is wrapped so that the frame runs
  eagerly for that call only (``ConvertFrameReturn(apply_to_code=False)``) instead
  of its code being marked to run from the cache alone; a release without them
  calls it at the first only.

Graphs differ too, without a name to reach: torch 2.13's partitioner saves the generator
state of the CPU attention kernel it recomputes (``run_and_save_rng_state``, read back in
the backward as ``rng_state_output_<i>``); 2.15 recomputes it without. The lifetime
analysis matches such states to the forward's outputs (``analysis/lifetimes.py``).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import sys
import threading
import weakref

import torch
from torch.fx.experimental import symbolic_shapes as _symbolic_shapes

__all__ = [
    "SUPPORTED_TORCH",
    "TORCH_VERSION",
    "optimization_hint",
    "shape_env_optimization_hint",
    "backed_value",
    "missing_internals",
    "torch_is_supported",
    "capture_graphs",
    "watch_recompile_limit",
    "graph_module",
    "lazy_graph_modules",
]

log = logging.getLogger(__name__)

SUPPORTED_TORCH = ((2, 11), (2, 16))
"""The supported torch releases: from the first (inclusive) to the second (exclusive)."""


def _release(version: str) -> tuple[int, int]:
    major, minor = version.split("+")[0].split(".")[:2]
    return int(major), int("".join(ch for ch in minor if ch.isdigit()) or 0)


TORCH_VERSION = _release(torch.__version__)
"""(major, minor) of the installed torch."""


def torch_is_supported(version: tuple[int, int] = TORCH_VERSION) -> bool:
    """True when ``version`` (default: the installed torch) is in ``SUPPORTED_TORCH``."""
    low, high = SUPPORTED_TORCH
    return low <= version < high


def shape_env_optimization_hint(value: torch.SymInt | int, fallback: int | None = None) -> int:
    """The size hint of ``value`` from its shape environment (torch 2.11's way).

    Args:
        value: An int or a SymInt.
        fallback: Returned when the symbol has no hint (unbacked); None: raise.

    Returns:
        The concrete value the example inputs gave the expression.

    Raises:
        ValueError: the symbol has no hint and no fallback was given.
    """
    if not isinstance(value, torch.SymInt):
        return int(value)
    node = value.node
    hint = getattr(node, "_hint", None)
    if hint is not None:
        return int(hint)
    hint = node.shape_env.size_hint(node.expr, allow_none=True)
    if hint is None:
        if fallback is None:
            raise ValueError(f"the size {node.expr} has no hint (data-dependent) and no fallback was given")
        return fallback
    return int(hint)


optimization_hint = getattr(_symbolic_shapes, "optimization_hint", shape_env_optimization_hint)
"""``optimization_hint(value, fallback=None) -> int``: see the module docstring."""


def backed_value(shape_env, symbol) -> int | None:
    """The traced value of a backed size symbol of `shape_env`; None for an unbacked one."""
    values = getattr(shape_env, "backed_var_to_val", None)
    value = (shape_env.var_to_val if values is None else values).get(symbol)
    return None if value is None else int(value)


# (module, attribute or None for the module itself), or (module, config key).
_INTERNALS = (
    ("torch._inductor.custom_graph_pass", "CustomGraphPass"),
    ("torch._inductor.custom_graph_pass", "CustomPartitionerFn"),
    ("torch._inductor.custom_graph_pass", "get_hash_for_files"),
    ("torch._inductor.config", "custom_partitioner_fn"),
    ("torch._inductor.config", "joint_custom_pre_pass"),
    ("torch._inductor.config", "reorder_for_peak_memory"),
    ("torch._inductor.config", "reorder_for_locality"),
    ("torch._inductor.compile_fx", "compile_fx"),
    ("torch._inductor.compile_fx", "compile_fx_inner"),
    ("torch._functorch.partitioners", "default_partition"),
    ("torch._functorch.partitioners", "min_cut_rematerialization_partition"),
    ("torch._dynamo.backends.common", "aot_autograd"),
    ("torch._dynamo.backends.debugging", "boxed_nop"),
    ("torch._library.effects", "EffectType"),
    ("torch._subclasses.fake_tensor", "FakeTensorMode"),
    ("torch._subclasses.fake_tensor", "unset_fake_temporarily"),
    ("torch._guards", "detect_fake_mode"),
    ("torch._dynamo.exc", "BackendCompilerFailed"),
    ("torch._ops", "OpOverload"),
    ("torch._C", "_set_grad_enabled"),
    ("torch.fx._lazy_graph_module", "_LazyGraphModule"),
    ("torch.fx._lazy_graph_module", "_use_lazy_graph_module"),
)


def capture_graphs(fn, args, kwargs, on_graph, *, fullgraph: bool = False, run_as=None) -> None:
    """Runs `fn(*args, **kwargs)` under Dynamo once, calling `on_graph(gm,
    example_inputs)` for each graph captured (each then runs as it was captured, or
    as `run_as(gm.forward)` where `run_as` is given).

    The entries this leaves in Dynamo's cache sit apart from the caller's own
    compiles of the same code (an isolated region), so a capture never makes a later
    `torch.compile` of the model hit its recompile limit and run eagerly; where no
    other compile holds entries on a captured code object, they are dropped.
    """
    import inspect

    from torch._dynamo import eval_frame

    captured: list[tuple[object, int]] = []  # (code, isolated region) of each graph

    def backend(gm, example_inputs):
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
        region = torch._C._dynamo.eval_frame.get_eval_frame_isolate_recompiles_id() if isolated else -1
        captured.append((tx.f_code, region))
        on_graph(gm, example_inputs)
        return gm.forward if run_as is None else run_as(gm.forward)

    isolated = "isolate_recompiles" in inspect.signature(torch.compile).parameters
    finalizers = set(weakref.finalize._registry)
    with _full_collections_allowed():
        if isolated:
            compiled = torch.compile(fn, backend=backend, fullgraph=fullgraph, isolate_recompiles=True)
            compiled(*args, **kwargs)
        else:  # 2.11, 2.12: the entries share the caller's region while they exist
            with torch._dynamo.config.patch(recompile_limit=1 << 20, accumulated_recompile_limit=1 << 20):
                torch.compile(fn, backend=backend, fullgraph=fullgraph)(*args, **kwargs)
    dropped = True
    for code in {code for code, _ in captured}:
        regions = {region for c, region in captured if c is code}
        ours = sum(len(eval_frame._get_cache_entries_for_region(code, region)) for region in regions) \
            if isolated else None
        if ours is not None and ours == eval_frame._get_total_cache_entry_count(code):
            eval_frame.reset_code(code)
        else:
            dropped = False
    if dropped:
        _detach_guard_finalizers(finalizers)
    _forget_backend(backend)


def _detach_guard_finalizers(before: set) -> None:
    """Detaches the finalizers Dynamo registered since `before` (the registry's
    keys then) to invalidate the guards of the entries a capture made once an object
    they guard dies. Dynamo puts them on long-lived objects (the model's modules, its
    classes, builtins, code objects), and each holds its entry's guards and their
    stack summaries: about 1 MB a capture, for as long as the model lives. The
    entries are gone (`reset_code`), so there is nothing left to invalidate."""
    for finalizer in set(weakref.finalize._registry) - before:
        info = weakref.finalize._registry.get(finalizer)
        method = getattr(getattr(info, "func", None), "func", None)  # partial(manager.invalidate, ...)
        if getattr(method, "__name__", None) == "invalidate" and \
                type(getattr(method, "__self__", None)).__name__ == "CheckFunctionManager":
            finalizer.detach()


def _full_collections_allowed():
    """A context in which Dynamo does not put off the garbage collector's full
    collections while it compiles. From 2.15 it does (`gc_gen2_threshold_during_compile`),
    expecting one to follow the compile; a capture's `on_graph` runs the whole
    pipeline and its predictions inside the compile, and back-to-back captures
    (`explain`, `tune`) would then never collect the cycles each leaves: about 5 MiB
    of native memory per `explain` kept. Earlier versions have no such setting."""
    config = torch._dynamo.config
    if not hasattr(config, "gc_gen2_threshold_during_compile"):
        return contextlib.nullcontext()
    return config.patch(gc_gen2_threshold_during_compile=None)


def _forget_backend(backend) -> None:
    """Drops `backend` from the backends Dynamo keeps until `torch._dynamo.reset()`
    (for their `reset()`): a capture's backend is never called again, and what it
    reaches (the graphs and whatever `on_graph` kept) would live as long as the
    process, one more copy for each `explain()` or `tune()`."""
    from torch._dynamo import eval_frame

    cached = getattr(eval_frame, "cached_backends", None)
    if not isinstance(cached, dict):
        return
    for key, value in list(cached.items()):
        if value is backend or getattr(value, "compiler_fn", None) is backend:
            cached.pop(key, None)


def graph_module(root: torch.nn.Module | dict, graph: torch.fx.Graph,
                 class_name: str = "GraphModule") -> torch.fx.GraphModule:
    """`torch.fx.GraphModule(root, graph, class_name)` whose code is written when
    first needed (see the module's guarantees)."""
    from torch.fx._lazy_graph_module import _LazyGraphModule

    return _LazyGraphModule(root, graph, class_name)


def lazy_graph_modules() -> contextlib.AbstractContextManager:
    """Within it, the graph modules torch builds write their code when first needed."""
    from torch.fx._lazy_graph_module import _use_lazy_graph_module

    return _use_lazy_graph_module(True)


def missing_internals() -> list[str]:
    """The private torch names slcompile uses that the installed torch lacks
    (empty on every supported release)."""
    missing = []
    for module_name, name in _INTERNALS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            missing.append(module_name)
            continue
        if not hasattr(module, name):
            missing.append(f"{module_name}.{name}")
    return missing


if not torch_is_supported():
    log.warning(
        "slcompile supports torch %d.%d to %d.%d; this is torch %s (untested)",
        *SUPPORTED_TORCH[0], SUPPORTED_TORCH[1][0], SUPPORTED_TORCH[1][1] - 1, torch.__version__,
    )


def watch_recompile_limit(callback) -> bool:
    """Calls `callback(limit_name, limit, compiler_fn, code)` each time Dynamo hits
    `limit_name` ("recompile_limit", "accumulated_recompile_limit") on `code` while
    compiling with `compiler_fn` (the backend as Dynamo holds it; None where it
    cannot be read). Dynamo then runs that frame eagerly. The callback runs inside
    Dynamo: what it raises propagates.

    A callback that returns True claims the frame: Dynamo would otherwise mark its
    code to run from the cache alone, with no callback for any later call, so that
    every configuration after the first past the limit would run eagerly unseen.
    A claimed frame runs eagerly for this call only, and each later call that finds
    no compiled entry comes back to the callbacks (with the backend of that call)
    without entering Dynamo's compile, so long as the code keeps its cache entries
    and the limits are unchanged (`torch._dynamo.reset()` or a raised limit gives
    the code back to Dynamo).

    Returns:
        whether this torch can be watched (the wrapped function exists).
    """
    from torch._dynamo import convert_frame

    current = getattr(convert_frame, "exceeds_recompile_limit", None)
    if current is None:
        return False
    # The watchers live on the wrapper Dynamo calls, so that they outlive a reload
    # of this module.
    watchers = getattr(current, "slc_watchers", None)
    if watchers is None:
        original, watchers = current, []

        def exceeds_recompile_limit(cache_size, compile_id):
            exceeded, limit_name = original(cache_size, compile_id)
            if exceeded:
                compiler_fn, code = _compiling()
                limit = getattr(torch._dynamo.config, limit_name, None)
                claimed = False
                for watcher in tuple(watchers):
                    claimed = bool(watcher(limit_name, limit, compiler_fn, code)) or claimed
                if claimed and code is not None:
                    _PAST_LIMIT.claimed = (code, limit_name)
            return exceeded, limit_name

        exceeds_recompile_limit.__wrapped__ = original
        exceeds_recompile_limit.slc_watchers = watchers
        convert_frame.exceeds_recompile_limit = exceeds_recompile_limit
        _watch_each_call(convert_frame, watchers)
    if callback not in watchers:
        watchers.append(callback)
    return True


class _PastLimit(threading.local):
    """The code a watcher claimed during this thread's current Dynamo compile."""

    claimed: tuple | None = None


_PAST_LIMIT = _PastLimit()
# code -> (limit name, the limits then): code whose frames the watchers claimed.
_CLAIMED_CODE: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def _limits() -> tuple:
    config = torch._dynamo.config
    return getattr(config, "recompile_limit", None), getattr(config, "accumulated_recompile_limit", None)


def _watch_each_call(convert_frame, watchers) -> None:
    """Wraps `ConvertFrame.__call__` (Dynamo's callback for a frame with no compiled
    entry that matches): a frame a watcher claimed runs eagerly for this call only,
    and a later call of its code past the same limits goes to the watchers directly."""
    from torch._dynamo import types as dynamo_types

    frame_class = getattr(convert_frame, "ConvertFrame", None)
    result_class = getattr(dynamo_types, "ConvertFrameReturn", None)
    strategy = getattr(dynamo_types, "FrameExecStrategy", None)
    action = getattr(dynamo_types, "FrameAction", None)
    if frame_class is None or strategy is None or action is None or result_class is None \
            or "apply_to_code" not in getattr(result_class, "__dataclass_fields__", {}):
        return  # this torch marks the code after the first: one warning, as Dynamo's own log
    original = frame_class.__call__
    if getattr(original, "slc_watched", False):
        return

    def run_eagerly_this_call():
        return result_class(frame_exec_strategy=strategy(action.RUN_ONLY, action.RUN_ONLY), apply_to_code=False,
                            skip_reason="recompile limit hit (slcompile watches each call)")

    def __call__(self, frame, cache_entry, hooks, frame_state, skip=0):
        code = frame.f_code
        known = _CLAIMED_CODE.get(code)
        if known is not None:
            limit_name, limits = known
            if cache_entry is not None and limits == _limits():
                compiler_fn = getattr(self, "_torchdynamo_orig_backend", None)
                limit = getattr(torch._dynamo.config, limit_name, None)
                if any([bool(watcher(limit_name, limit, compiler_fn, code)) for watcher in tuple(watchers)]):
                    return run_eagerly_this_call()
            else:  # reset, or another limit: Dynamo decides again
                del _CLAIMED_CODE[code]
        _PAST_LIMIT.claimed = None
        result = original(self, frame, cache_entry, hooks, frame_state, skip=skip + 1)
        claimed, _PAST_LIMIT.claimed = _PAST_LIMIT.claimed, None
        if claimed is not None and claimed[0] is code:
            _CLAIMED_CODE[code] = (claimed[1], _limits())
            return run_eagerly_this_call()
        return result

    __call__.slc_watched = True
    __call__.__wrapped__ = original
    frame_class.__call__ = __call__


def _compiling():
    """(compiler_fn, code) of the Dynamo `_compile` frame on this thread's stack, or
    (None, None)."""
    frame = sys._getframe(2)
    for _ in range(4):
        if frame is None:
            break
        if "compiler_fn" in frame.f_locals:
            return frame.f_locals["compiler_fn"], frame.f_locals.get("code")
        frame = frame.f_back
    return None, None
