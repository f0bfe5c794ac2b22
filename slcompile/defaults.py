"""Defaults of the speedloader options, set in code or from the environment.

Frameworks (the Hugging Face Trainer, Lightning, torchtitan) call `torch.compile`
themselves; these defaults reach the backend without touching that call:

    slcompile.defaults.num_subbatches = 4              # from now on
    with slcompile.defaults.patch(weights="nvme"):     # inside the block; also a decorator
        trainer.train()

    SLC_NUM_SUBBATCHES=4 SLC_WEIGHTS=nvme python train.py

Every option of `SpeedLoaderConfig` is here under its own name, and its
environment variable is `SLC_` and the name in capitals (`SLC_MEMORY_BUDGET=2GiB`,
`SLC_COMPILE_REGIONS=0`, `SLC_OFFLOAD_DIR=none`). Precedence, lowest first: the
field's default in `SpeedLoaderConfig`, the environment variable, a value set here
(assignment or `patch`), the `options` given to `torch.compile`. The values are
read when a graph compiles (the environment too: a variable set after import
counts), so a model compiled already keeps the options it was compiled with.
`explain()` says where each option that is not its field's default came from;
`slcompile.explain(...)` prints the same. Names, types, defaults and documentation
are the fields of `SpeedLoaderConfig`, the one table of options; this module has
none of its own, and the values set here are kept with them (`config.resolve`).

This follows `torch._inductor.config` (assignment, `patch` as a context manager or
decorator, an environment variable per option) without its machinery
(`torch.utils._config_module`): that reads environment variables once, at import,
and only for booleans and strings, where most options here are ints or sizes; and
its overrides are thread-local, where these are the process's, so that a framework
that compiles on a thread of its own sees them.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import os
import sys
import threading
import types
from collections.abc import Mapping
from typing import Any

from slcompile.config import (
    GENERATION_ONLY,
    _FIELDS,
    _UNSET,
    _check_default,
    _defaults_lock,
    _overrides,
    check_names,
    environment_variable,
    resolve,
)

__all__ = ["patch", "explain", "resolve", "reset", "environment_variable"]

def explain(options: Mapping[str, Any] | None = None) -> str:
    """The options a graph compiled now would get, one line each, and where every one
    that is not its field's default came from."""
    values, sources = resolve(check_names(options or {}))
    values = {name: value for name, value in values.items() if name not in GENERATION_ONLY}
    width = max(map(len, values))
    return "\n".join(
        f"{name:<{width}} = {value!r}" + (f"  ({sources[name]})" if name in sources else "")
        for name, value in values.items()
    )


def patch(changes: Mapping[str, Any] | str | None = None, value: Any = None, **kwargs: Any):
    """Sets defaults inside a `with` block or a decorated function, and puts back
    what was there on the way out: `patch(num_subbatches=4)`, `patch("weights",
    "nvme")` or `patch({"weights": "nvme"})`, as `torch._inductor.config.patch`.

    Raises:
        AttributeError: a name that is no option (with the closest one).
        OptionError: a value the option cannot take.
    """
    if isinstance(changes, str):
        changes = {changes: value}
    changes = {**dict(changes or {}), **kwargs}
    for name, new in changes.items():
        _check_default(name, new)
    return _Patch(changes)


def reset() -> None:
    """Forgets every default set in code (the environment's still count)."""
    with _defaults_lock:
        _overrides.clear()


class _Patch(contextlib.ContextDecorator):
    def __init__(self, changes: dict[str, Any]):
        self.changes = changes
        self.saved: list[dict[str, Any]] = []

    def __enter__(self) -> None:
        with _defaults_lock:
            self.saved.append({name: _overrides.get(name, _UNSET) for name in self.changes})
            _overrides.update(self.changes)

    def __exit__(self, *exc_info: Any) -> None:
        with _defaults_lock:
            for name, previous in self.saved.pop().items():
                if previous is _UNSET:
                    _overrides.pop(name, None)
                else:
                    _overrides[name] = previous


class _DefaultsModule(types.ModuleType):
    """`slcompile.defaults.<option>` reads the value a graph compiled now would get;
    assigning one sets it (checked) until `reset()`."""

    def __getattr__(self, name: str) -> Any:
        if name in _FIELDS:
            return resolve()[0][name]
        raise AttributeError(f"module {self.__name__!r} has no attribute {name!r}")

    def __setattr__(self, name: str, value: Any) -> None:
        if name.startswith("_") or name in self.__dict__ and name not in _FIELDS:
            super().__setattr__(name, value)
            return
        _check_default(name, value)
        with _defaults_lock:
            _overrides[name] = value

    def __delattr__(self, name: str) -> None:
        if name in _FIELDS:
            with _defaults_lock:
                _overrides.pop(name, None)
            return
        super().__delattr__(name)

    def __dir__(self):
        return sorted({*super().__dir__(), *_FIELDS})


sys.modules[__name__].__class__ = _DefaultsModule
