"""A Hugging Face decoder seen layer by layer: the capture of every layer's
arguments from the model's own forward, the tail (final norm and head), and the
compiled layer steps of the prefill and the decode passes."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from slcompile.errors import RefusedError
from slcompile.inference.options import _Plan

# -- the compiled layer step -----------------------------------------------------


class _KVSlot:
    """What a layer's attention sees as its cache inside the compiled step: the
    past keys and values of one (layer, sub-batch), extended by `update` the way
    the Hugging Face cache layer it stands for extends them."""

    def __init__(self, keys, values, window):
        self.keys, self.values, self.window = keys, values, window

    def update(self, key_states, value_states, *args, **kwargs):
        if self.keys is not None:
            key_states = torch.cat([self.keys, key_states], dim=-2)
            value_states = torch.cat([self.values, value_states], dim=-2)
        self.keys, self.values = key_states, value_states
        if self.window is not None:
            # A sliding-window layer keeps the last window - 1 positions and
            # attends over all of them plus the new ones.
            self.keys = key_states[:, :, -self.window + 1:, :]
            self.values = value_states[:, :, -self.window + 1:, :]
        return key_states, value_states


def _layer_step(template, tensors, past_keys, past_values, window, kwargs, cache_argument):
    slot = _KVSlot(past_keys, past_values, window)
    output = torch.func.functional_call(template, tensors, (), {**kwargs, cache_argument: slot})
    return output, slot.keys, slot.values


def _prefill_layer(template, tensors, window, kwargs, cache_argument):
    return _layer_step(template, tensors, None, None, window, kwargs, cache_argument)


def _decode_layer(template, tensors, past_keys, past_values, window, kwargs, cache_argument):
    return _layer_step(template, tensors, past_keys, past_values, window, kwargs, cache_argument)


_COMPILED: dict[tuple[str, str], Callable] = {}


def _compiled(backend, phase: str) -> Callable:
    """The compiled step of `phase`. Dynamo keeps the graphs on the step function's
    code, so every call with the same backend reuses them; named backends keep their
    wrapper too (a backend object is not kept alive past its call)."""
    function = _prefill_layer if phase == "prefill" else _decode_layer
    if not isinstance(backend, str):
        return torch.compile(function, backend=backend)
    if (backend, phase) not in _COMPILED:
        _COMPILED[backend, phase] = torch.compile(function, backend=backend)
    return _COMPILED[backend, phase]


def _grow_cache_layer(layer, new: tuple[int, ...], dtype: torch.dtype) -> None:
    """Tells one layer of the model's cache object that `new[-2]` positions of
    shape `new` were added: its tensors are shape-only `meta` placeholders. A plain
    `DynamicLayer` (full attention) gets placeholders of its grown length at once,
    which is what its `update` leaves, without concatenating meta tensors (their
    `torch.cat` runs Python decompositions: about 0.3 ms per layer per pass on a
    CPU); any other layer (a sliding window, a subclass) runs its own `update`."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - every supported transformers has it
        DynamicLayer = None
    if DynamicLayer is not None and type(layer).update is DynamicLayer.update and layer.is_initialized \
            and layer.keys.dim() == len(new):
        grown = (*new[:-2], layer.keys.shape[-2] + new[-2], new[-1])
        layer.keys = torch.empty(grown, dtype=dtype, device="meta")
        layer.values = torch.empty(grown, dtype=dtype, device="meta")
        return
    meta = torch.empty(new, dtype=dtype, device="meta")
    layer.update(meta, meta)


# -- capture and tail --------------------------------------------------------------


class _Captured(Exception):
    """Stops the capture pass after the last layer was recorded."""


def _as_keywords(signature: inspect.Signature, args, kwargs) -> dict[str, Any]:
    """A layer call's arguments, all by name."""
    bound = signature.bind(*args, **kwargs)
    named = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            if value:
                raise RefusedError("a decoder layer is called with extra positional arguments; "
                                   "use model.generate for this model", "generate")
        else:
            named[name] = value
    return named


@contextlib.contextmanager
def _layers_replaced(layers: Sequence[nn.Module], forward_of: Callable[[int], Callable]) -> Iterator[None]:
    # A forward already set on the instance (a hook library's wrapper) comes back after.
    saved = [layer.__dict__.get("forward") for layer in layers]
    for index, layer in enumerate(layers):
        layer.forward = forward_of(index)
    try:
        yield
    finally:
        for layer, forward in zip(layers, saved):
            if forward is None:
                del layer.forward
            else:
                layer.forward = forward


def _model_call(model, inputs):
    return model(**inputs, return_dict=True)


def _rows(value: Any, start: int, count: int, batch: int) -> Any:
    """`value`'s rows `start:start + count` where it has the batch's rows: a tensor of
    two or more dimensions whose first is `batch`, also inside tuples and lists (the
    model inputs and the layers' arguments: ids, masks, positions, embeddings,
    rotary tables); anything else whole (a cache object, `cache_position`)."""
    if count == batch:
        return value
    if isinstance(value, torch.Tensor):
        return value.narrow(0, start, count) if value.ndim >= 2 and value.shape[0] == batch else value
    if isinstance(value, (tuple, list)):
        return type(value)(_rows(item, start, count, batch) for item in value)
    if isinstance(value, dict):
        return {name: _rows(item, start, count, batch) for name, item in value.items()}
    return value


def _same_arguments(alone: Any, shared: Any, mask: bool = False) -> bool:
    """Whether a layer argument captured for one sub-batch alone equals that
    sub-batch's rows of the one captured for the whole batch. A `mask` the sub-batch
    alone does not need (None) may be one for the whole batch: its rows let through
    what no mask does (the model builds each row's mask from that row alone)."""
    if mask and alone is None and isinstance(shared, torch.Tensor):
        return True
    if isinstance(alone, torch.Tensor) or isinstance(shared, torch.Tensor):
        return (isinstance(alone, torch.Tensor) and isinstance(shared, torch.Tensor)
                and alone.shape == shared.shape and alone.dtype == shared.dtype and torch.equal(alone, shared))
    if isinstance(alone, (tuple, list)) and isinstance(shared, (tuple, list)):
        return len(alone) == len(shared) and all(_same_arguments(a, s, mask) for a, s in zip(alone, shared))
    if isinstance(alone, dict) and isinstance(shared, dict):
        return alone.keys() == shared.keys() and all(
            _same_arguments(alone[name], shared[name], mask or "mask" in name) for name in alone)
    return type(alone) is type(shared) and (alone is shared or alone == shared)


def _cache_windows(model: nn.Module, num_layers: int) -> list[int | None]:
    """The sliding window of each layer (None: full attention), from the cache layers
    the model's own DynamicCache builds."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

    windows = []
    for cache_layer in DynamicCache(config=model.config).layers[:num_layers]:
        if type(cache_layer) is DynamicSlidingWindowLayer:
            windows.append(cache_layer.sliding_window)
        elif type(cache_layer) is DynamicLayer:
            windows.append(None)
        else:
            raise RefusedError(f"{type(model).__name__}'s cache layers are {type(cache_layer).__name__}; "
                               "slcompile.generate handles full and sliding-window attention caches; "
                               "use model.generate", "generate")
    return windows + [None] * (num_layers - len(windows))


def _position_ids(model: nn.Module, input_ids: torch.Tensor, attention_mask: torch.Tensor | None):
    """The prompts' positions, as `model.generate` counts them (None when the model
    takes none): 0 from each row's first token, 0 at left padding."""
    if "position_ids" not in inspect.signature(model.forward).parameters:
        return None
    if attention_mask is not None:
        position_ids = attention_mask.long().cumsum(-1) - 1
        return position_ids.masked_fill(attention_mask == 0, 0)
    return torch.arange(input_ids.shape[1], device=input_ids.device).unsqueeze(0).expand_as(input_ids)


def _pass_inputs(model: nn.Module, plan: _Plan, sequences, cache, attention_mask, position_ids, first: bool) -> dict:
    """The model's inputs for one pass over `sequences`, as `model.generate` builds them."""
    kwargs = {plan.cache_argument: cache, "use_cache": True}
    if attention_mask is not None:
        kwargs["attention_mask"] = attention_mask
    if position_ids is not None:
        kwargs["position_ids"] = position_ids
    if "logits_to_keep" in inspect.signature(model.forward).parameters:
        kwargs["logits_to_keep"] = 1
    return model.prepare_inputs_for_generation(sequences, next_sequence_length=None if first else 1,
                                               is_first_iteration=first, **kwargs)


def _capture(model: nn.Module, layers: Sequence[nn.Module], layers_name: str, inputs: dict) -> list[dict[str, Any]]:
    """Each layer's arguments, by name, in one run of the model's forward on
    `inputs` that stops at the last layer (each layer returns its hidden states)."""
    signature = inspect.signature(type(layers[0]).forward)
    hidden_name = list(signature.parameters)[1]  # after self
    calls: list[dict[str, Any]] = [None] * len(layers)  # type: ignore[list-item]

    def recorder(index):
        def forward(*args, **kwargs):
            calls[index] = _as_keywords(signature, (None, *args), kwargs)
            calls[index].pop("self")
            if index == len(layers) - 1:
                raise _Captured
            return calls[index][hidden_name]
        return forward

    with _layers_replaced(layers, recorder):
        try:
            _model_call(model, inputs)
        except _Captured:
            pass
    if any(call is None for call in calls):
        raise RefusedError(f"{type(model).__name__}'s forward did not call every layer of "
                           f"{layers_name}; use model.generate", "generate")
    return calls


def _tail(model: nn.Module, layers: Sequence[nn.Module], inputs: dict, output) -> torch.Tensor:
    """The last position's logits (float32) of the model's forward on `inputs`
    with every layer returning `output` (the last layer's, for the whole batch)."""
    with _layers_replaced(layers, lambda index: (lambda *args, **kwargs: output)):
        logits = _model_call(model, inputs).logits
    return logits[:, -1].to(copy=True, dtype=torch.float32)


def _split(size: int, count: int) -> list[tuple[int, int, int]]:
    """(sub-batch, first row, rows) of `count` sub-batches of `size` rows."""
    return [(sb, sb * size, size) for sb in range(count)]


def _mark_length_dynamic(past: tuple[torch.Tensor, torch.Tensor], kwargs: dict) -> None:
    """Marks the cache length dynamic in the decode step's inputs, so every decode
    step runs the same graph: the past keys and values, and the masks whose last
    dimension is the attended length."""
    past_keys, past_values = past
    torch._dynamo.maybe_mark_dynamic(past_keys, 2)
    torch._dynamo.maybe_mark_dynamic(past_values, 2)
    attended = past_keys.shape[2] + 1
    for value in kwargs.values():
        if isinstance(value, torch.Tensor) and value.ndim == 4 and value.shape[-1] == attended:
            torch._dynamo.maybe_mark_dynamic(value, 3)
