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
none of its own.

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

from slcompile.config import SpeedLoaderConfig, check_names
from slcompile.errors import OptionError

__all__ = ["patch", "explain", "resolve", "reset", "environment_variable"]

_PREFIX = "SLC_"
_FIELDS = {field.name: field for field in dataclasses.fields(SpeedLoaderConfig)}
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")
_lock = threading.Lock()
_overrides: dict[str, Any] = {}  # values set in code: assignment or patch


def environment_variable(name: str) -> str:
    """The environment variable of an option: `SLC_NUM_SUBBATCHES` for `num_subbatches`."""
    return _PREFIX + name.upper()


def resolve(options: Mapping[str, Any] | None = None) -> tuple[dict[str, Any], dict[str, str]]:
    """Every option's value and where it came from, `options` (those given to
    `torch.compile`, already known to be names of options) taking precedence.

    Returns:
        (values, sources): the value of every option, and for those not at their
        field's default, "options", "slcompile.defaults" or the environment
        variable's name.

    Raises:
        OptionError: an environment variable whose value the option cannot take,
            naming the variable.
    """
    options = dict(options or {})
    with _lock:
        overrides = dict(_overrides)
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for name, field in _FIELDS.items():
        if name in options:
            values[name], source = options[name], "options"
        elif name in overrides:
            values[name], source = overrides[name], "slcompile.defaults"
        elif (raw := os.environ.get(environment_variable(name))) is not None:
            values[name], source = _from_environment(name, raw), environment_variable(name)
        else:
            values[name], source = field.default, None
        if source is not None and values[name] != field.default:
            sources[name] = source
    return values, sources


def explain(options: Mapping[str, Any] | None = None) -> str:
    """The options a graph compiled now would get, one line each, and where every one
    that is not its field's default came from."""
    values, sources = resolve(check_names(options or {}))
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
        _check(name, new)
    return _Patch(changes)


def reset() -> None:
    """Forgets every default set in code (the environment's still count)."""
    with _lock:
        _overrides.clear()


class _Patch(contextlib.ContextDecorator):
    def __init__(self, changes: dict[str, Any]):
        self.changes = changes
        self.saved: list[dict[str, Any]] = []

    def __enter__(self) -> None:
        with _lock:
            self.saved.append({name: _overrides.get(name, _UNSET) for name in self.changes})
            _overrides.update(self.changes)

    def __exit__(self, *exc_info: Any) -> None:
        with _lock:
            for name, previous in self.saved.pop().items():
                if previous is _UNSET:
                    _overrides.pop(name, None)
                else:
                    _overrides[name] = previous


_UNSET = object()


def _check(name: str, value: Any) -> None:
    if name not in _FIELDS:
        close = difflib.get_close_matches(name, sorted(_FIELDS), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise AttributeError(f"slcompile.defaults has no option {name!r}{hint}")
    if name == "shard_weights":
        # Checked when a graph compiles: it needs a process group, which may come later.
        if not isinstance(value, bool):
            raise OptionError(f"speedloader option 'shard_weights' must be True or False, got {value!r}")
        return
    SpeedLoaderConfig(**{name: value})


def _from_environment(name: str, raw: str) -> Any:
    """An option's value from its environment variable's text, by the field's type."""
    kind = str(_FIELDS[name].type)
    text = raw.strip()
    try:
        if "None" in kind and text.lower() in ("", "none"):
            return None
        value: Any = text
        if kind == "bool":
            if text.lower() not in _TRUE + _FALSE:
                raise OptionError(f"expected one of {', '.join(_TRUE + _FALSE)}")
            value = text.lower() in _TRUE
        elif kind.startswith("int"):
            try:
                value = int(text)
            except ValueError:
                if kind == "int":
                    raise OptionError("expected an integer") from None
        _check(name, value)
        return value
    except OptionError as err:
        raise OptionError(f"environment variable {environment_variable(name)}={raw!r}: {err}") from None


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
        _check(name, value)
        with _lock:
            _overrides[name] = value

    def __delattr__(self, name: str) -> None:
        if name in _FIELDS:
            with _lock:
                _overrides.pop(name, None)
            return
        super().__delattr__(name)

    def __dir__(self):
        return sorted({*super().__dir__(), *_FIELDS})


sys.modules[__name__].__class__ = _DefaultsModule
