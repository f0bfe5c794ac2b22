"""Generation layer-major over sub-batches, with weights and KV cache on tiers.

`generate(model, input_ids, ...)` returns what `model.generate(...)` returns (the
sequences, prompt included, pad after EOS) for a Hugging Face decoder-only causal LM,
computed in SpeedLoader's order: the batch is split into sub-batches, and every
forward pass (the prefill, then one decode step per token) runs each decoder layer
for all sub-batches before the next layer starts. The prefill and the decode steps
may split the batch differently (`prefill_subbatches`, `num_subbatches`).

How a pass runs, with no per-family code:

1. Capture. The model's own forward runs once on the inputs that
   `model.prepare_inputs_for_generation` builds for every sequence still generating,
   with every decoder layer's forward replaced by a recorder: the embeddings, masks,
   rotary tables and positions that each layer would receive are recorded, and the
   pass stops at the last layer. Each sub-batch's share is those tensors' rows.
2. Layers. For each layer: its weights are fetched from the `weights` tier once (the
   next layer's are prefetched), then for each sub-batch its (layer, sub-batch) KV
   cache is taken from the `kv_cache` tier (the next one's load already issued), the
   layer runs in a compiled step, and the new positions of the cache are stored.
3. Tail. The forward runs once more with the layers returning the outputs of step 2
   for all sub-batches at once: final norm and head give the logits of the last
   position.

A prefill of three or more sub-batches whose KV cache rests on a tier that copies
keeps its hidden states between layers on that tier too (`offloads_hidden`): each
sub-batch is captured alone just before each of its layer steps, its output of
every layer but the last is stored and loaded back while the step before its next
layer runs, and its tail runs just after its last layer, into the logits of every
sequence. The device then holds one sub-batch's hidden states and capture at a time
(and the next one's hidden states, loading), never the whole batch's.

The compiled step is `torch.func.functional_call` of one template layer per layer
class, with the layer's weights and the past keys and values as inputs: every layer
of a class shares one graph, and decode steps share one graph (the cache length is a
dynamic dimension). The prefill has its own graph.

One Hugging Face cache object is kept for what the model's forward reads from it
(lengths, sliding-window offsets); its tensors are shape-only `meta` placeholders,
updated with each layer's new shapes, while the values rest on the `kv_cache` tier.

A sub-batch whose sequences have all reached EOS is not computed again (its tokens
are `pad_token_id` from then on, as `model.generate` writes them), and its cache is
freed; generation stops when every sequence has finished.

`explain_generation(...)` prints the schedules of the prefill and of a decode step
and the bytes each pass moves, from the model's config, without running the model;
`generate(..., return_dict_in_generate=True)` returns the same records measured. It
also predicts the device memory of the prefill and of the decode passes
(`PassMemory`; `_MemoryModel` lists what it counts), which
`slcompile.tune_generation` chooses options from.

`with generation(model, ...)` routes `model.generate(...)` through `generate` for
code that calls the model's own method.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import logging
import re
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slcompile.config import TIERS
from slcompile.errors import OptionError, RefusedError
from slcompile.runtime.stats import TransferKey
from slcompile.runtime.tiers import Tier, TransferKind
from slcompile.vocabulary import region_label

__all__ = ["generate", "explain_generation", "find_decoder_layers", "generation", "GenerationOutput",
           "GenerationStep", "GenerationExplanation", "PassMemory"]

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class GenerationStep:
    """One forward pass of a generation: predicted (`explain_generation`) or
    measured (`generate(..., return_dict_in_generate=True)`).

    Attributes:
        phase: "prefill" or "decode".
        subbatches: the sub-batches computed (a decode step skips finished ones).
        schedule: the pass's order, e.g. ``load blk0.w | load blk1.w | blk0.sb0 |
            store blk0.kv.sb0 | ...`` (transfers only where the tier copies).
        bytes_moved: bytes per ``(kind, source tier, destination tier)``, nonzero only.
        seconds: the pass's wall time, measured (None in a prediction; not compared:
            a measured step equals its prediction when schedule and bytes do).
    """

    phase: str
    subbatches: tuple[int, ...]
    schedule: str
    bytes_moved: Mapping[TransferKey, int]
    seconds: float | None = dataclasses.field(default=None, compare=False)

    def bytes_of(self, kind: TransferKind, source: Tier, destination: Tier) -> int:
        return self.bytes_moved.get((kind, source, destination), 0)

    def __str__(self) -> str:
        """Two lines, e.g. ``decode of sub-batches 0, 1: kv device->nvme 4.00 KiB, ...``
        and the schedule."""
        from slcompile.units import format_bytes

        moved = ", ".join(f"{kind.value} {source.value}->{destination.value} {format_bytes(n)}"
                          for (kind, source, destination), n in sorted(
                              self.bytes_moved.items(), key=lambda item: tuple(x.value for x in item[0])))
        return (f"{self.phase} of sub-batches {', '.join(map(str, self.subbatches))}: "
                f"{moved or 'no bytes moved'}\n  {self.schedule}")


@dataclasses.dataclass(frozen=True)
class GenerationOutput:
    """What `generate(..., return_dict_in_generate=True)` returns.

    Attributes:
        sequences: what `generate` returns otherwise.
        steps: every forward pass that ran, in order, as measured.
    """

    sequences: torch.Tensor
    steps: tuple[GenerationStep, ...]

    @property
    def subbatch_steps(self) -> int:
        """(sub-batch, pass) pairs computed."""
        return sum(len(step.subbatches) for step in self.steps)


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 20,
    num_subbatches: int = 1,
    prefill_subbatches: int | None = None,
    weights: str = "device",
    kv_cache: str = "device",
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = 50,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    offload_dir: str | None = None,
    backend: str | Callable = "inductor",
    progress: bool = True,
    return_dict_in_generate: bool = False,
) -> torch.Tensor | GenerationOutput:
    """Generates tokens like `model.generate(...)`, layer-major over sub-batches.

    Args:
        model: a Hugging Face decoder-only causal LM (`GenerationMixin`) with a KV cache.
        input_ids: the prompts, `(batch, length)`, left-padded when their lengths differ.
        attention_mask: `(batch, length)`, 0 at padding (None: no padding).
        max_new_tokens: tokens to generate per sequence (fewer when every sequence
            has reached EOS).
        num_subbatches: K of the decode steps; the batch size must be divisible by it.
        prefill_subbatches: K of the prefill (default: `num_subbatches`); the
            prefill computes many positions per sequence, so it may want smaller
            sub-batches than the decode steps. The batch size must be divisible by it.
        weights: where the decoder layers' weights rest between uses: "device",
            "host" or "nvme"; off the device, each layer's weights are loaded once
            per forward pass for all K sub-batches. They stay offloaded afterwards
            (read them inside `slcompile.gathered_weights(model)`).
        kv_cache: where each (layer, decode sub-batch)'s keys and values rest
            between decode steps: "device", "host" or "nvme". Off the device, a step
            loads the positions the cache keeps and stores the one it adds, merged
            with the last stored segments as a binary counter carries (a cache is
            at most log2 of its decoded positions + 2 segments, each one read).
        do_sample: sample the next token (else greedy).
        temperature, top_k, top_p: Hugging Face's warpers, applied in that order
            when sampling (defaults: those of `GenerationConfig`).
        generator: the random generator sampling draws from (same seed, same tokens).
        eos_token_id: the end-of-sequence token(s) (default: the model's generation
            config's); a finished sequence gets `pad_token_id` from then on, and a
            decode sub-batch whose sequences have all finished is no longer computed.
        pad_token_id: default: the model's, else the first EOS token.
        offload_dir: parent directory of the nvme tier's files (default: temp dir).
        backend: the `torch.compile` backend of the layer steps ("inductor",
            "aot_eager", or a backend callable).
        progress: show a progress bar over the generated tokens.
        return_dict_in_generate: return a `GenerationOutput` (the sequences and,
            per forward pass, the sub-batches computed, the schedule and the bytes
            moved) instead of the sequences alone.

    Returns:
        The sequences, `(batch, length + generated)`, as `model.generate` returns them
        (in a `GenerationOutput` when `return_dict_in_generate`).

    Raises:
        OptionError: a bad argument (the message names it and a fix).
        RefusedError: the model has no repeated decoder layers or no KV cache.
    """
    plan = _plan(model, input_ids, attention_mask, max_new_tokens, num_subbatches, prefill_subbatches, weights,
                 kv_cache, do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, offload_dir)
    with torch.no_grad():
        run = _Generation(model, plan, backend, generator, progress)
        sequences = run.run(input_ids, attention_mask)
    if return_dict_in_generate:
        return GenerationOutput(sequences, tuple(run.steps))
    return sequences


_ENGINE_OPTIONS = ("num_subbatches", "prefill_subbatches", "weights", "kv_cache", "offload_dir", "backend", "progress")
_CALL_OPTIONS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id")


@contextlib.contextmanager
def generation(model: nn.Module, **options: Any) -> Iterator[nn.Module]:
    """Within the block, `model.generate(...)` runs `slcompile.generate` with these
    options; the model's own `generate` comes back on exit.

    For code that calls `model.generate` (a pipeline, an evaluation harness)::

        with slcompile.generation(model, num_subbatches=4, kv_cache="nvme"):
            sequences = model.generate(input_ids, attention_mask=mask, max_new_tokens=32)

    Args:
        model: as for `generate`.
        **options: `generate`'s options for every call in the block:
            num_subbatches, prefill_subbatches, weights, kv_cache, offload_dir,
            backend, progress.

    Inside the block `model.generate` takes `input_ids` (or `inputs`),
    `attention_mask`, `max_new_tokens` (default: the generation config's, else its
    `max_length` less the prompt), `do_sample`, `temperature`, `top_k`, `top_p`,
    `eos_token_id`, `pad_token_id` (defaults: `model.generation_config`'s or
    `generation_config=`'s), `return_dict_in_generate` and `use_cache`; any other
    argument raises OptionError.

    Raises:
        OptionError: an option that is not one of `generate`'s.
    """
    unknown = sorted(set(options) - set(_ENGINE_OPTIONS))
    if unknown:
        raise OptionError(f"generation: {', '.join(unknown)} is not an option of slcompile.generate; use "
                          f"{', '.join(_ENGINE_OPTIONS)} here and pass the others to model.generate")

    def routed(inputs=None, generation_config=None, **kwargs):
        config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
        input_ids = kwargs.pop("input_ids", inputs)
        if not isinstance(input_ids, torch.Tensor):
            raise OptionError("model.generate inside slcompile.generation: pass the prompts as input_ids, "
                              "a (batch, length) tensor of token ids")
        call = {name: kwargs.pop(name, getattr(config, name, None)) for name in _CALL_OPTIONS}
        max_length = kwargs.pop("max_length", getattr(config, "max_length", None))
        if call["max_new_tokens"] is None and max_length is not None:
            call["max_new_tokens"] = max_length - input_ids.shape[1]
        defaults = {"max_new_tokens": 20, "do_sample": False, "temperature": 1.0, "top_p": 1.0}
        call.update((name, value) for name, value in defaults.items() if call[name] is None)
        attention_mask = kwargs.pop("attention_mask", None)
        return_dict = bool(kwargs.pop("return_dict_in_generate", False))
        if kwargs.pop("use_cache", True) is False:
            raise OptionError("model.generate inside slcompile.generation: use_cache=False; the layer-major "
                              "engine generates with a KV cache; leave the block to generate without one")
        if kwargs:
            raise OptionError(f"model.generate inside slcompile.generation: {', '.join(sorted(kwargs))} is not "
                              f"supported; use {', '.join(('attention_mask', *_CALL_OPTIONS))}, or call "
                              "model.generate outside the block")
        return generate(model, input_ids, attention_mask, return_dict_in_generate=return_dict, **call, **options)

    saved = model.__dict__.get("generate")  # usually none: the class's method
    model.generate = routed
    try:
        yield model
    finally:
        if saved is None:
            del model.generate
        else:
            model.generate = saved


# -- checks and the plan -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    layers: tuple[nn.Module, ...]
    layers_name: str
    max_new_tokens: int
    num_subbatches: int
    prefill_subbatches: int
    weights: str
    kv_cache: str
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    offload_dir: str | None
    # The keywords through which the model's forward and its layers take the KV
    # cache (`cache` from transformers 5.24 on, `past_key_values` before).
    cache_argument: str
    layer_cache_argument: str


# What a parameter that takes a KV cache was called before it was annotated with
# transformers' `Cache` (and still is in code without annotations).
_CACHE_NAMES = ("cache", "past_key_values")


def cache_parameter(function: Callable) -> str | None:
    """The keyword through which `function` takes a Hugging Face KV cache: the
    parameter annotated with a `Cache`, else one named as releases name it; None
    when it takes none."""
    parameters = inspect.signature(function).parameters
    for name, parameter in parameters.items():
        if parameter.kind in (parameter.POSITIONAL_OR_KEYWORD, parameter.KEYWORD_ONLY) and re.search(
                r"\bCache\b", str(parameter.annotation)):
            return name
    return next((name for name in _CACHE_NAMES if name in parameters), None)


def find_decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's decoder layers: the `ModuleList` of modules of one class holding
    the most parameters (`model.layers`, `transformer.h`, ...).

    Raises:
        RefusedError: the model has no such list.
    """
    best, best_size = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (name, module), size
    if best is None:
        raise RefusedError(
            f"{type(model).__name__} has no list of repeated decoder layers (an nn.ModuleList of "
            "modules of one class, such as model.layers or transformer.h): slcompile.generate runs "
            "Hugging Face decoder-only causal LMs; use model.generate for this model", "generate")
    return best


def _check_subbatches(option: str, value: Any, batch: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or batch % value:
        divisors = [k for k in range(1, batch + 1) if batch % k == 0]
        raise OptionError(f"generate: {option}={value!r} does not divide the batch of {batch} "
                          f"sequences; use a divisor of {batch} ({', '.join(map(str, divisors))}) or pad the batch")


def _plan(model, input_ids, attention_mask, max_new_tokens, num_subbatches, prefill_subbatches, weights, kv_cache,
          do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, offload_dir) -> _Plan:
    """The checked options; `input_ids` may be a shape `(batch, length)` (explain)."""
    for option, value in (("weights", weights), ("kv_cache", kv_cache)):
        if value not in TIERS:
            raise OptionError(f"generate: {option}={value!r} is not a tier; use one of {', '.join(map(repr, TIERS))}")
    if isinstance(input_ids, torch.Tensor):
        if input_ids.ndim != 2:
            raise OptionError("generate: input_ids must be a (batch, length) tensor of token ids; "
                              f"got shape {tuple(input_ids.shape)}")
        shape = tuple(input_ids.shape)
    elif isinstance(input_ids, (tuple, list, torch.Size)) and len(input_ids) == 2 and all(
            isinstance(n, int) and n > 0 for n in input_ids):
        shape = tuple(input_ids)
    else:
        raise OptionError("generate: input_ids must be a (batch, length) tensor of token ids; "
                          f"got {type(input_ids).__name__}")
    if attention_mask is not None and tuple(attention_mask.shape) != shape:
        raise OptionError(f"generate: attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                          f"{shape}; pass a mask of the same shape (1 = token, 0 = padding)")
    batch = shape[0]
    _check_subbatches("num_subbatches", num_subbatches, batch)
    if prefill_subbatches is None:
        prefill_subbatches = num_subbatches
    _check_subbatches("prefill_subbatches", prefill_subbatches, batch)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise OptionError(f"generate: max_new_tokens={max_new_tokens!r} must be a positive int")
    config = getattr(model, "config", None)
    cache_argument = cache_parameter(model.forward)
    if (config is None or getattr(config, "is_encoder_decoder", False)
            or not hasattr(model, "prepare_inputs_for_generation") or cache_argument is None):
        raise RefusedError(
            f"{type(model).__name__} has no KV cache to generate with (slcompile.generate needs a Hugging "
            "Face decoder-only causal LM whose forward takes a Cache); use model.generate, "
            "or a model class ending in ForCausalLM", "generate")
    layers_name, layers = find_decoder_layers(model)
    layer_cache_argument = cache_parameter(layers[0].forward)
    if layer_cache_argument is None:
        raise RefusedError(f"the layers {layers_name} of {type(model).__name__} take no KV cache: the "
                           "model has no KV cache per layer; use model.generate", "generate")
    limit = next((getattr(config, name) for name in ("max_position_embeddings", "n_positions", "max_seq_len")
                  if isinstance(getattr(config, name, None), int)), None)
    total = shape[1] + max_new_tokens
    if limit is not None and total > limit:
        raise OptionError(
            f"generate: max_new_tokens={max_new_tokens} with prompts of {shape[1]} tokens makes "
            f"{total} positions, over the model's {limit} (config max_position_embeddings); set "
            f"max_new_tokens <= {limit - shape[1]} or shorten the prompts")
    if offload_dir is not None:
        from slcompile.config import _check_offload_dir

        _check_offload_dir(offload_dir)
    generation_config = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(generation_config, "eos_token_id", None)
    eos = () if eos_token_id is None else tuple(
        [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id])
    if pad_token_id is None:
        pad_token_id = getattr(generation_config, "pad_token_id", None)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    if do_sample and not temperature > 0:
        raise OptionError(f"generate: temperature={temperature!r} must be > 0 when sampling; "
                          "use do_sample=False for greedy decoding")
    return _Plan(tuple(layers), layers_name, max_new_tokens, num_subbatches, prefill_subbatches, weights, kv_cache,
                 do_sample, float(temperature), top_k, float(top_p), eos, pad_token_id, offload_dir,
                 cache_argument, layer_cache_argument)


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


# How many (layer, sub-batch)s ahead of the one computing a decode pass loads caches.
KV_AHEAD = 2
# Stores of the prefill's hidden states whose sources may be alive at once.
HIDDEN_STORES_IN_FLIGHT = 2


def offloads_hidden(kv_moves: bool, parts: int, layers: int) -> bool:
    """Whether a prefill of `parts` sub-batches keeps its hidden states between
    layers on the KV cache's tier: where that tier copies, and with at least 3
    sub-batches (with 2, one computes while the other's is loaded: nothing is saved)."""
    return kv_moves and parts >= 3 and layers >= 2


class _HiddenStash:
    """The prefill's hidden states between layers, on the KV cache's tier: the
    output of (layer, sub-batch) is stored when the layer makes it and loaded, one
    (layer, sub-batch) ahead, as the input of the next layer's step of that
    sub-batch. At most `HIDDEN_STORES_IN_FLIGHT` stores keep their sources alive."""

    def __init__(self, engine, tier: Tier, name: str):
        import collections

        self.engine, self.tier, self.name = engine, tier, name
        self._stores: collections.deque = collections.deque()
        self._loads: dict[tuple[int, int], Any] = {}

    def _key(self, block: int, sb: int) -> str:
        return f"{self.name}:blk{block}.h.sb{sb}"

    def store(self, block: int, sb: int, hidden: torch.Tensor) -> None:
        self._stores.append(self.engine.store(self._key(block, sb), hidden, self.tier, TransferKind.ACTIVATION,
                                              forget_source=True))
        while len(self._stores) > HIDDEN_STORES_IN_FLIGHT:
            self.engine.wait(self._stores.popleft())

    def issue(self, block: int, sb: int) -> None:
        self._loads[block, sb] = self.engine.load(self._key(block, sb), TransferKind.ACTIVATION)

    def take(self, block: int, sb: int) -> torch.Tensor:
        hidden = self.engine.wait(self._loads.pop((block, sb)))
        self.engine.free(self._key(block, sb))
        return hidden

    def close(self) -> None:
        """Waits for the transfers in flight and frees what is still stored."""
        while self._stores:
            self.engine.wait(self._stores.popleft())
        for block, sb in list(self._loads):
            self.take(block, sb)

_COMPILED: dict[tuple[str, str], Callable] = {}
# One weight streamer per (engine, tier), shared by every call: streamers register
# themselves process-wide.
_STREAMERS: dict[tuple[int, str], Any] = {}


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


def _streamed_parameters(model: nn.Module, plan: _Plan, offload: bool) -> list[list[tuple[str, nn.Parameter]]]:
    """Per layer, the parameters its pass fetches from a tier: those already resting
    on one (an earlier call, a compiled graph), and, when `offload`, those that only
    this layer uses."""
    from slcompile.runtime.weights import weight_home

    prefix = f"{plan.layers_name}."
    outside = {id(p) for name, p in model.named_parameters(remove_duplicate=False) if not name.startswith(prefix)}
    owners: dict[int, int] = {}
    for index, layer in enumerate(plan.layers):
        for param in layer.parameters():
            owners[id(param)] = index if owners.get(id(param), index) == index else -1
    streamed = []
    for index, layer in enumerate(plan.layers):
        streamed.append([(name, param) for name, param in layer.named_parameters()
                         if weight_home(param) is not None
                         or (offload and id(param) not in outside and owners[id(param)] == index)])
    return streamed


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


def _bytes_moved_since(before: Mapping[TransferKey, int]) -> dict[TransferKey, int]:
    from slcompile.runtime.stats import runtime_stats

    after = runtime_stats().cumulative.bytes_moved
    return {key: n - before.get(key, 0) for key, n in after.items() if n - before.get(key, 0)}


# -- the engine ----------------------------------------------------------------------


class _Generation:
    """One call of `generate`: the plan, the tiers, the cache and the records."""

    def __init__(self, model, plan: _Plan, backend, generator, progress):
        from transformers import DynamicCache

        from slcompile.runtime.engine import get_engine
        from slcompile.runtime.kv import KVStore

        self.model, self.plan, self.generator, self.progress = model, plan, generator, progress
        self.layers = plan.layers
        self.engine = get_engine(plan.offload_dir)
        self.kv = KVStore(self.engine, plan.kv_cache)
        self.prefill_step = _compiled(backend, "prefill")
        self.decode_step = _compiled(backend, "decode")
        self.signature = inspect.signature(type(self.layers[0]).forward)
        self.hidden_name = list(self.signature.parameters)[1]  # after self
        self.cache_factory = lambda: DynamicCache(config=model.config)
        self.windows = _cache_windows(model, len(self.layers))
        # One template per (layer class, attention type): same code, same graph.
        self.templates = []
        first_of: dict[tuple, nn.Module] = {}
        for layer, window in zip(self.layers, self.windows):
            group = (type(layer), getattr(layer, "attention_type", None), window)
            self.templates.append(first_of.setdefault(group, layer))
        self.streamer, self.streamed = None, [{} for _ in self.layers]
        self._stream_weights(offload=not self.engine.copies_nothing(Tier(plan.weights), Tier.DEVICE))
        self.weights_move = self._weights_move()
        # Whether one capture of all sub-batches gives each its layer arguments, per
        # phase (checked against a capture of one sub-batch alone on the first pass).
        self.shared_capture: dict[str, bool] = {}
        self.steps: list[GenerationStep] = []
        self.trace: list[str] = []
        self.stash: _HiddenStash | None = None  # the prefill's hidden states, while it runs

    def _stream_weights(self, offload: bool) -> None:
        """Offloads the parameters that only one layer uses (when `offload`), and
        streams those already offloaded (by an earlier call or a compiled graph)."""
        from slcompile.runtime.weights import WeightStreamer

        prefix = f"{self.plan.layers_name}."
        for index, params in enumerate(_streamed_parameters(self.model, self.plan, offload)):
            for name, param in params:
                if self.streamer is None:
                    key = (id(self.engine), self.plan.weights)
                    if key not in _STREAMERS or _STREAMERS[key].engine is not self.engine:
                        _STREAMERS[key] = WeightStreamer(self.engine, self.plan.weights, live_blocks=2)
                    self.streamer = _STREAMERS[key]
                stored = self.streamer.stored_key_for(f"{prefix}{index}.{name}", param)
                self.streamer.offload(stored, param, f"{prefix}{index}.{name}")
                self.streamed[index][name] = self.streamer.graph_key(stored)

    def _weights_move(self) -> bool:
        """Whether a fetched weight is copied (it rests on a tier other than the device's memory)."""
        from slcompile.runtime.weights import weight_home

        return any(not self.engine.copies_nothing(weight_home(param)[2], Tier.DEVICE)
                   for layer, names in zip(self.layers, self.streamed)
                   for name, param in layer.named_parameters() if name in names)

    # -- weights --------------------------------------------------------------
    def _issue_weights(self, index: int) -> None:
        if self.streamer is not None and index < len(self.layers):
            for key in self.streamed[index].values():
                self.streamer.issue(key)
            if self.weights_move and self.streamed[index]:
                self.trace.append(f"load blk{index}.w")

    def _weights(self, index: int) -> dict[str, torch.Tensor]:
        layer = self.layers[index]
        tensors = {name: p.detach() for name, p in layer.named_parameters() if name not in self.streamed[index]}
        tensors.update((name, b) for name, b in layer.named_buffers())
        if self.streamer is not None:
            tensors.update((name, self.streamer.fetch(key)) for name, key in self.streamed[index].items())
        return tensors

    def _issue_kv(self, index: int, sb: int) -> None:
        if self.kv.issue(index, sb) and self.kv.appends:
            self.trace.append(f"load blk{index}.kv.sb{sb}")

    def _store_decoded(self, parts, index: int, position: int, keys, values, new: int) -> None:
        self._store_kv(index, parts[position][0], keys, values, new)

    def _store_kv(self, index: int, sb: int, keys, values, new: int) -> None:
        self.kv.store(index, sb, keys, values, new)
        if self.kv.appends:
            self.trace.append(f"store blk{index}.kv.sb{sb}")

    def _store_filled(self, index: int, sb: int, filled) -> None:
        self.kv.store_rows(index, sb, filled)
        if self.kv.appends:
            self.trace.append(f"store blk{index}.kv.sb{sb}")

    # -- one forward pass -------------------------------------------------------
    def _capture(self, inputs: dict) -> list[dict[str, Any]]:
        return _capture(self.model, self.layers, self.plan.layers_name, inputs)

    def _tail(self, inputs: dict, output) -> torch.Tensor:
        return _tail(self.model, self.layers, inputs, output)

    def _arguments(self, phase: str, inputs: dict, parts: list[tuple[int, int, int]], batch: int):
        """Each part's layer arguments: rows of one capture of the whole batch, or,
        where that does not give what a capture of the part alone gives, one
        capture per part."""
        def alone(part):
            return self._capture(_rows(inputs, part[1], part[2], batch))

        first = None
        if self.shared_capture.get(phase, True):
            calls = self._capture(inputs)
            if phase not in self.shared_capture and len(parts) > 1:
                part, first = parts[0], alone(parts[0])
                shared = [_rows(call, part[1], part[2], batch) for call in calls]
                cache_argument = self.plan.layer_cache_argument
                same = all(_same_arguments({k: v for k, v in a.items() if k != cache_argument},
                                           {k: v for k, v in s.items() if k != cache_argument})
                           for a, s in zip(first, shared))  # one dict of arguments per layer
                if not same:
                    log.info("%s: the layers' arguments of one sub-batch captured alone differ from its rows of "
                             "the whole batch's; capturing each sub-batch of the %s separately",
                             type(self.model).__name__, phase)
                self.shared_capture[phase] = same
            if self.shared_capture.get(phase, True):
                return [[_rows(call, start, count, batch) for call in calls] for _, start, count in parts], True
        return [first if index == 0 and first is not None else alone(part) for index, part in enumerate(parts)], False

    def _forward(self, phase: str, inputs: dict, parts: list[tuple[int, int, int]], batch: int,
                 cache, store: Callable) -> torch.Tensor:
        """One forward pass of the `parts` (sub-batch, first row, rows) of the `batch`
        rows of `inputs`, layer-major; the last position's logits of those rows.
        `store(index, position, keys, values, new)` keeps the updated cache of
        `parts[position]` at layer `index`, whose last `new` positions are new."""
        from slcompile.runtime.stats import compute_region

        self.trace = []
        n, nparts = len(self.layers), len(parts)
        stash = None
        if phase == "prefill" and offloads_hidden(self.kv.appends, nparts, n):
            # Each sub-batch is captured just before each layer step (what a capture
            # makes, such as masks, is not held for every sub-batch through the
            # pass) and its logits computed just after its last: nothing of the
            # whole batch is held at once.
            stash = self.stash = _HiddenStash(self.engine, self.kv.tier, f"{self.kv.name}.prefill")
            hidden: list[Any] = [None] * nparts
            logits = None  # every sequence's, filled sub-batch by sub-batch
            shared = False
        else:
            arguments, shared = self._arguments(phase, inputs, parts, batch)
            hidden = [calls[0][self.hidden_name] for calls in arguments]
        outputs: list[Any] = [None] * nparts
        layouts: list[tuple[int, int, torch.dtype]] = []
        self._issue_weights(0)
        if phase == "decode":
            self._issue_kv(0, parts[0][0])
        for index in range(n):
            tensors = self._weights(index)
            self._issue_weights(index + 1)
            for position, (sb, start, rows) in enumerate(parts):
                if stash is not None:
                    # The next step's input loads while this one runs.
                    later, after = divmod(index * nparts + position + 1, nparts)
                    if 1 <= later < n:
                        stash.issue(later - 1, parts[after][0])
                        self.trace.append(f"load blk{later - 1}.h.sb{parts[after][0]}")
                    call = self._capture(_rows(inputs, start, rows, batch))[index]
                    embedded = call.pop(self.hidden_name)  # the layer's input past the first: loaded
                    hidden[position] = embedded if index == 0 else stash.take(index - 1, sb)
                    del embedded
                else:
                    call = arguments[position][index]
                if phase == "decode":
                    # The caches of the next KV_AHEAD (layer, sub-batch)s load while this one runs.
                    for later in range(position + 1, position + 1 + KV_AHEAD):
                        if index + later // nparts < n:
                            self._issue_kv(index + later // nparts, parts[later % nparts][0])
                kwargs = dict(call)
                kwargs[self.hidden_name] = hidden[position]
                kwargs.pop(self.plan.layer_cache_argument)
                window = self.windows[index]
                if phase == "prefill":
                    with compute_region(region_label(f"blk{index}.sb{sb}", "prefill")):
                        output, keys, values = self.prefill_step(self.templates[index], tensors, window, kwargs,
                                                                 self.plan.layer_cache_argument)
                else:
                    past = self.kv.take(index, sb)
                    _mark_length_dynamic(past, kwargs)
                    with compute_region(region_label(f"blk{index}.sb{sb}", "decode")):
                        output, keys, values = self.decode_step(self.templates[index], tensors, *past, window,
                                                                kwargs, self.plan.layer_cache_argument)
                    del past
                self.trace.append(f"blk{index}.sb{sb}")
                outputs[position] = output
                hidden[position] = output if isinstance(output, torch.Tensor) else output[0]
                added = hidden[position].shape[-2]
                store(index, position, keys, values, added)
                kv_layout = (keys.shape[1], keys.shape[-1], keys.dtype)
                # The layer's input, past and new cache are dropped now, not when the
                # next sub-batch overwrites them (the memory model counts one of each).
                del kwargs, call, keys, values
                if stash is not None:
                    if index < n - 1:
                        stash.store(index, sb, hidden[position])
                        self.trace.append(f"store blk{index}.h.sb{sb}")
                    else:
                        part = self._tail(_rows(inputs, start, rows, batch), output)
                        if logits is None:
                            logits = part.new_empty((batch, part.shape[-1]))
                        logits[start:start + rows] = part
                        del part
                    hidden[position] = outputs[position] = None
                del output
            layouts.append(kv_layout)
            del tensors
        # The model's cache object learns the new shapes (values stay on the tier),
        # after the pass: captures during it see the cache as it was before.
        for layer, (heads, head_dim, dtype) in zip(cache.layers, layouts):
            meta = torch.empty((self.batch, heads, added, head_dim), dtype=dtype, device="meta")
            layer.update(meta, meta)
        self.kv.flush()
        if stash is not None:
            stash.close()
            self.stash = None
            return logits
        if shared:
            first = outputs[0]
            whole = torch.cat([output if isinstance(output, torch.Tensor) else output[0] for output in outputs])
            return self._tail(inputs, whole if isinstance(first, torch.Tensor) else (whole, *first[1:]))
        return torch.cat([self._tail(_rows(inputs, start, count, batch), output)
                          for (_, start, count), output in zip(parts, outputs)])

    # -- the generation loop -----------------------------------------------------
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        from slcompile.runtime.stats import runtime_stats

        plan, model = self.plan, self.model
        k = plan.num_subbatches
        batch = self.batch = input_ids.shape[0]
        device = input_ids.device
        position_ids = _position_ids(model, input_ids, attention_mask)
        if attention_mask is not None and bool(attention_mask.all()):
            attention_mask = None  # as model.generate: no padding, no mask
        processors = LogitsProcessorList()
        if plan.do_sample:
            if plan.temperature != 1.0:
                processors.append(TemperatureLogitsWarper(plan.temperature))
            if plan.top_k is not None and plan.top_k != 0:
                processors.append(TopKLogitsWarper(top_k=plan.top_k, min_tokens_to_keep=1))
            if plan.top_p < 1.0:
                processors.append(TopPLogitsWarper(top_p=plan.top_p, min_tokens_to_keep=1))
        size = batch // k
        cache = self.cache_factory()
        prefill_store = _PrefillStore(self.kv, self._store_kv, self._store_filled, batch // plan.prefill_subbatches,
                                      size)
        sequences = input_ids
        unfinished = torch.ones(batch, dtype=torch.long, device=device)
        active = list(range(k))  # the decode sub-batches still generating
        eos = torch.tensor(plan.eos_token_ids, dtype=torch.long, device=device) if plan.eos_token_ids else None
        bar = _progress_bar(plan.max_new_tokens, self.progress)
        try:
            for step in range(plan.max_new_tokens):
                phase = "prefill" if step == 0 else "decode"
                if step == 0:
                    rows, parts = None, _split(batch // plan.prefill_subbatches, plan.prefill_subbatches)
                    store = prefill_store
                else:
                    rows = None if len(active) == k else torch.cat(
                        [torch.arange(sb * size, (sb + 1) * size, device=device) for sb in active])
                    parts = [(sb, position * size, size) for position, sb in enumerate(active)]

                    store = functools.partial(self._store_decoded, parts)
                if step == plan.max_new_tokens - 1:
                    store = _no_store  # no pass reads the cache of the last one

                def of_active(tensor):
                    return tensor if rows is None or tensor is None else tensor[rows]

                inputs = _pass_inputs(model, plan, of_active(sequences), cache, of_active(attention_mask),
                                      of_active(position_ids), step == 0)
                before = dict(runtime_stats().cumulative.bytes_moved)
                began = time.perf_counter()
                computed = self._forward(phase, inputs, parts, len(parts) * parts[0][2], cache, store)
                self.steps.append(GenerationStep(phase, tuple(sb for sb, _, _ in parts), " | ".join(self.trace),
                                                 _bytes_moved_since(before), time.perf_counter() - began))
                if rows is None:
                    logits = computed
                else:
                    # A finished sub-batch's rows get pad tokens whatever their scores.
                    logits = computed.new_zeros((batch, computed.shape[-1]))
                    logits[rows] = computed
                scores = processors(sequences, logits)
                if plan.do_sample:
                    probs = torch.softmax(scores, dim=-1)
                    next_tokens = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
                else:
                    next_tokens = torch.argmax(scores, dim=-1)
                # The pass's logits are not held through the next pass.
                computed = logits = scores = probs = None
                if eos is not None:
                    next_tokens = next_tokens * unfinished + plan.pad_token_id * (1 - unfinished)
                sequences = torch.cat([sequences, next_tokens[:, None]], dim=-1)
                if attention_mask is not None:
                    attention_mask = torch.cat([attention_mask, attention_mask.new_ones((attention_mask.shape[0], 1))],
                                               dim=-1)
                if position_ids is not None:
                    position_ids = torch.cat([position_ids, position_ids[:, -1:] + 1], dim=-1)
                bar.update(1)
                if eos is not None:
                    unfinished = unfinished & ~torch.isin(next_tokens, eos)
                    if not bool(unfinished.any()):
                        break
                    for sb in [sb for sb in active if not bool(unfinished[sb * size:(sb + 1) * size].any())]:
                        active.remove(sb)
                        for index in range(len(self.layers)):
                            self.kv.drop(index, sb)
        finally:
            bar.close()
            if self.stash is not None:
                self.stash.close()
            self.kv.close()
        return sequences


def _no_store(*args) -> None:
    pass


class _PrefillStore:
    """Stores the prefill's caches by decode sub-batch: each prefill part's rows go
    to the decode sub-batches that hold them, stored at once when a part holds a
    whole decode sub-batch, else copied into that sub-batch's rows
    (`KVStore.empty_rows`) and stored once they are all there."""

    def __init__(self, kv, store: Callable, store_rows: Callable, prefill_size: int, decode_size: int):
        self.kv, self.store, self.store_rows = kv, store, store_rows
        self.prefill_size, self.decode_size = prefill_size, decode_size
        self.filling: dict[tuple[int, int], Any] = {}

    def __call__(self, index: int, position: int, keys, values, new: int) -> None:
        first = position * self.prefill_size
        row = first
        while row < first + self.prefill_size:
            sb = row // self.decode_size
            end = min((sb + 1) * self.decode_size, first + self.prefill_size)
            if end - row == self.decode_size:
                whole = end - row == keys.shape[0]
                self.store(index, sb, keys if whole else keys.narrow(0, row - first, end - row),
                           values if whole else values.narrow(0, row - first, end - row), new)
            else:
                if (index, sb) not in self.filling:
                    self.filling[index, sb] = self.kv.empty_rows(keys, values, self.decode_size)
                if self.filling[index, sb].add(keys.narrow(0, row - first, end - row),
                                               values.narrow(0, row - first, end - row)):
                    self.store_rows(index, sb, self.filling.pop((index, sb)))
            row = end


# -- explain ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class GenerationExplanation:
    """What `generate` would do, predicted from the model's config and the options,
    for every sequence generating all `max_new_tokens` (no early EOS).

    Attributes:
        model: the model's class name.
        layers_name: where its decoder layers are (`model.layers`).
        num_layers: how many there are.
        batch, prompt_length, max_new_tokens: the generation's sizes.
        prefill_subbatches, num_subbatches: K of the prefill and of the decode steps.
        weights, kv_cache: the tiers.
        weight_store_bytes: bytes of layer weights stored on their tier before the prefill.
        steps: one `GenerationStep` per pass, as `generate(...,
            return_dict_in_generate=True)` measures them.
        prefill_memory: the device memory of the prefill (`PassMemory`; None, with a
            logged warning, for a model whose forward cannot be traced on fake tensors).
        decode_memory: that of the decode pass with the highest peak (the last, but
            for sliding-window caches); None with one new token.
        prefill_time: with `profile=`, the prefill's predicted timeline
            (`slcompile.analysis.time.TimePrediction`), else None.
        decode_time: with `profile=`, that of the middle decode pass (whose cache
            length is the mean of all decode passes'); None with one new token.
    """

    model: str
    layers_name: str
    num_layers: int
    batch: int
    prompt_length: int
    max_new_tokens: int
    prefill_subbatches: int
    num_subbatches: int
    weights: str
    kv_cache: str
    weight_store_bytes: int
    steps: tuple[GenerationStep, ...]
    prefill_memory: PassMemory | None = None
    decode_memory: PassMemory | None = None
    prefill_time: Any = None
    decode_time: Any = None

    @property
    def seconds(self) -> float | None:
        """The predicted time of the whole generation: the prefill and
        `max_new_tokens - 1` decode passes (None without a profile)."""
        if self.prefill_time is None:
            return None
        decode = self.decode_time.step_seconds if self.decode_time is not None else 0.0
        return self.prefill_time.step_seconds + (len(self.steps) - 1) * decode

    @property
    def peak_bytes(self) -> int | None:
        """The device's peak over the whole generation (None when not predicted)."""
        return max((m.peak_bytes for m in (self.prefill_memory, self.decode_memory) if m is not None), default=None)

    @property
    def prefill_schedule(self) -> str:
        return self.steps[0].schedule

    @property
    def decode_schedule(self) -> str:
        return self.steps[1].schedule if len(self.steps) > 1 else ""

    def __str__(self) -> str:
        from slcompile.units import format_bytes

        kv = (TransferKind.KV, Tier.DEVICE, Tier(self.kv_cache))
        kv_back = (TransferKind.KV, Tier(self.kv_cache), Tier.DEVICE)
        hidden = (TransferKind.ACTIVATION, Tier.DEVICE, Tier(self.kv_cache))

        def weight_bytes(step):
            return sum(n for (kind, _, destination), n in step.bytes_moved.items()
                       if kind is TransferKind.WEIGHT and destination is Tier.DEVICE)

        lines = [
            f"generate {self.model} ({self.num_layers} layers, {self.layers_name}): batch {self.batch}, "
            f"prompts of {self.prompt_length} tokens, {self.max_new_tokens} new tokens",
            f"  prefill: {self.prefill_subbatches} sub-batches of {self.batch // self.prefill_subbatches}; "
            f"decode: {self.num_subbatches} sub-batches of {self.batch // self.num_subbatches}",
            f"  weights on {self.weights} ({format_bytes(self.weight_store_bytes)} stored before the prefill), "
            f"kv cache on {self.kv_cache}",
            f"  prefill schedule: {self.prefill_schedule}",
        ]
        if len(self.steps) > 1:
            lines.append(f"  decode schedule:  {self.decode_schedule}")
        for memory in (self.prefill_memory, self.decode_memory):
            if memory is not None:
                lines.append(f"  {memory}")
        for name, timeline in (("prefill", self.prefill_time), ("middle decode pass", self.decode_time)):
            if timeline is not None:
                lines.append(f"  {name}: " + str(timeline).replace("\n", "\n  "))
        if self.seconds is not None:
            tokens = self.batch * self.max_new_tokens
            lines.append(f"  predicted generation: {self.seconds:.3f} s, {tokens / self.seconds:,.0f} tokens/s")
        if self.steps[0].bytes_of(*hidden):
            lines.append(f"  prefill hidden states between layers on {self.kv_cache}: "
                         f"{format_bytes(self.steps[0].bytes_of(*hidden))} stored and loaded")
        lines.append(f"  {'pass':<10} {'weights loaded':>15} {'kv stored':>12} {'kv loaded':>12}")
        names = ["prefill"] + [f"decode {t}" for t in range(1, len(self.steps))]
        shown = range(len(self.steps)) if len(self.steps) <= 8 else [0, 1, 2, len(self.steps) - 1]
        for row in shown:
            if row == len(self.steps) - 1 and row not in (0, 1, 2) and len(self.steps) > 8:
                lines.append(f"  {'...':<10}")
            step = self.steps[row]
            lines.append(f"  {names[row]:<10} {format_bytes(weight_bytes(step)):>15} "
                         f"{format_bytes(step.bytes_of(*kv)):>12} {format_bytes(step.bytes_of(*kv_back)):>12}")
        lines.append(f"  {'total':<10} {format_bytes(sum(map(weight_bytes, self.steps))):>15} "
                     f"{format_bytes(sum(step.bytes_of(*kv) for step in self.steps)):>12} "
                     f"{format_bytes(sum(step.bytes_of(*kv_back) for step in self.steps)):>12}")
        return "\n".join(lines)


def explain_generation(
    model: nn.Module,
    input_shape: Sequence[int],
    max_new_tokens: int = 20,
    num_subbatches: int = 1,
    *,
    prefill_subbatches: int | None = None,
    weights: str = "device",
    kv_cache: str = "device",
    offload_dir: str | None = None,
    load_granularity: int | None = None,
    load_overhead: int = 0,
    padded: bool = False,
    profile: Any = None,
    backend: str = "inductor",
) -> GenerationExplanation:
    """The schedules, bytes and device memory per pass of `generate(model,
    input_ids, ...)` with these options, without running the model (the memory of
    a layer step and of the tail comes from their graphs traced on fake tensors);
    `print` it for a summary.

    Args:
        model, max_new_tokens, num_subbatches, prefill_subbatches, weights, kv_cache,
            offload_dir: as for `generate`.
        input_shape: `input_ids.shape`, `(batch, length)`.
        load_granularity: a tensor loaded from a tier that copies takes its size
            rounded up to this (default: the page on a CPU machine, whose loads read
            files straight into page-padded memory; 1 on a GPU).
        load_overhead: bytes each loaded tensor takes beyond that (one page inside
            `slcompile.runtime.nvme.buffers_seen_by_profiler`).
        padded: predict the memory for left-padded prompts, every sequence padded
            (the masks the model then builds for each sub-batch are counted); the
            bound for any `attention_mask`.
        profile: the machine to predict the passes' time on: "current" (this
            machine's measured profile), a named profile ("h100-pcie5-nvme") or a
            `MachineProfile`; None (default) predicts no time.
        backend: the layer steps' lowering, as `generate`'s (the time model fuses
            elementwise ops under "inductor").

    Returns:
        The prediction; its `steps` equal those `generate(...,
        return_dict_in_generate=True)` measures when no sequence stops early, and
        `prefill_memory`/`decode_memory` give the device peak of the prefill and of
        the largest decode pass, for greedy decoding of prompts without padding
        (with `padded`: every prompt padded).

    Raises:
        OptionError, RefusedError: as `generate` raises them.
    """
    machine = None
    if profile is not None:
        from slcompile.profile import machine_profile

        machine = machine_profile(profile, offload_dir=offload_dir)
    return _explain_generation(model, input_shape, max_new_tokens, num_subbatches, prefill_subbatches, weights,
                               kv_cache, offload_dir, load_granularity, load_overhead, {}, padded, machine, backend)


def _explain_generation(model, input_shape, max_new_tokens, num_subbatches, prefill_subbatches, weights, kv_cache,
                        offload_dir, load_granularity, load_overhead, memo: dict,
                        padded: bool = False, machine=None, backend: str = "inductor") -> GenerationExplanation:
    """`explain_generation`; `memo` keeps the traced memory of the capture, the layer
    steps and the tail between calls for one model and input shape (they do not
    depend on the tiers)."""
    from slcompile.runtime.engine import get_engine
    from slcompile.pipeline import load_granularity as default_granularity
    from slcompile.runtime.kv import forgettable_segments, merged_segments
    from slcompile.runtime.weights import weight_home

    if load_granularity is None:
        load_granularity = default_granularity()
    plan = _plan(model, tuple(input_shape), None, max_new_tokens, num_subbatches, prefill_subbatches, weights,
                 kv_cache, False, 1.0, None, 1.0, [], None, offload_dir)
    engine = get_engine(offload_dir)
    batch, length = tuple(input_shape)
    layers = plan.layers
    streamed = _streamed_parameters(model, plan, not engine.copies_nothing(Tier(weights), Tier.DEVICE))
    weight_loads: dict[TransferKey, int] = {}
    weight_store_bytes = 0
    for params in streamed:
        for _, param in params:
            home = weight_home(param)
            tier = home[2] if home is not None else Tier(weights)
            nbytes = param.numel() * param.element_size()
            if home is None and not engine.copies_nothing(Tier.DEVICE, tier):
                weight_store_bytes += nbytes
            if not engine.copies_nothing(tier, Tier.DEVICE):
                key = (TransferKind.WEIGHT, tier, Tier.DEVICE)
                weight_loads[key] = weight_loads.get(key, 0) + nbytes
    weights_move = bool(weight_loads)
    kv_moves = not engine.copies_nothing(Tier(kv_cache), Tier.DEVICE)
    windows = _cache_windows(model, len(layers))
    caps = [length + max_new_tokens if window is None else window - 1 for window in windows]
    position_bytes = [2 * batch * per_row for per_row in _kv_row_bytes(model, layers)]
    store_key, load_key = (TransferKind.KV, Tier.DEVICE, Tier(kv_cache)), (TransferKind.KV, Tier(kv_cache), Tier.DEVICE)
    n, kp, kd = len(layers), plan.prefill_subbatches, plan.num_subbatches
    size_p, size_d = batch // kp, batch // kd
    offloads = offloads_hidden(kv_moves, kp, n)

    def weight_loads_of(index):
        return [f"load blk{index}.w"] if weights_move and index < n and streamed[index] else []

    def prefill_order(stores: bool) -> str:
        # Decode sub-batch d is stored after the prefill part that holds its last row.
        # Offloaded hidden states: stored after each layer but the last, the next
        # step's loaded while a step runs.
        order = weight_loads_of(0)
        for index in range(n):
            order += weight_loads_of(index + 1)
            for part in range(kp):
                later, after = divmod(index * kp + part + 1, kp)
                if offloads and 1 <= later < n:
                    order.append(f"load blk{later - 1}.h.sb{after}")
                order.append(f"blk{index}.sb{part}")
                if stores:
                    order += [f"store blk{index}.kv.sb{d}" for d in range(kd)
                              if part * size_p < (d + 1) * size_d <= (part + 1) * size_p]
                if offloads and index < n - 1:
                    order.append(f"store blk{index}.h.sb{part}")
        return " | ".join(order)

    def decode_order(stores: bool) -> str:
        # Each (layer, sub-batch)'s cache loads while the KV_AHEAD before it run.
        order = weight_loads_of(0) + (["load blk0.kv.sb0"] if kv_moves else [])
        for index in range(n):
            order += weight_loads_of(index + 1)
            for sb in range(kd):
                step = index * kd + sb
                if kv_moves:
                    first = step + KV_AHEAD if step else 1  # the loads not issued before
                    order += [f"load blk{later // kd}.kv.sb{later % kd}"
                              for later in range(first, min(step + 1 + KV_AHEAD, n * kd))]
                order.append(f"blk{index}.sb{sb}")
                if stores:
                    order.append(f"store blk{index}.kv.sb{sb}")
        return " | ".join(order)

    def moved(stored: int, loaded: int, hidden: int = 0) -> dict[TransferKey, int]:
        kv = {store_key: stored, load_key: loaded} if kv_moves else {}
        stashed = {(TransferKind.ACTIVATION, Tier.DEVICE, Tier(kv_cache)): hidden,
                   (TransferKind.ACTIVATION, Tier(kv_cache), Tier.DEVICE): hidden}
        return {key: v for key, v in {**weight_loads, **kv, **stashed}.items() if v}

    # The last pass stores no cache: no pass reads it.
    segments = [[min(length, cap)] for cap in caps]
    last = max_new_tokens == 1
    hidden = (n - 1) * batch * length * _hidden_row_bytes(model, layers) if offloads else 0
    steps = [GenerationStep("prefill", tuple(range(kp)), prefill_order(kv_moves and not last),
                            moved(0 if last else sum(b * s[0] for b, s in zip(position_bytes, segments)), 0,
                                  hidden))]
    # A decode step: each (layer, sub-batch) loads the segments it keeps and stores
    # its one new position merged with the last segments (`merged_segments`).
    loaded_segments, written_positions = {}, {}
    for step in range(1, max_new_tokens):
        last = step == max_new_tokens - 1
        loaded_segments[step] = [tuple(s) for s in segments]
        loaded = sum(b * sum(s) for b, s in zip(position_bytes, segments))
        stored = 0
        for layer, cap in enumerate(caps):
            kept = min(length + step, cap)
            replaced, written = merged_segments(segments[layer], 1, kept)
            segments[layer][len(segments[layer]) - replaced:] = [written]
            del segments[layer][:forgettable_segments(segments[layer], kept)]
            stored += position_bytes[layer] * written
            written_positions.setdefault(step, []).append(written)
        steps.append(GenerationStep("decode", tuple(range(kd)), decode_order(kv_moves and not last),
                                    moved(0 if last else stored, loaded)))
    try:
        memory = _MemoryModel(model, plan, engine, batch, length, streamed, load_granularity, load_overhead,
                              memo.setdefault("padded", {}) if padded else memo, padded)
        prefill_memory = memory.pass_memory("prefill", 0, kv_moves and max_new_tokens > 1)
        # Every decode pass's layer steps are traced with the last one's cache length:
        # the longest, so no step's temporaries are underestimated.
        longest = length + max_new_tokens - 2
        decode_memory = max((memory.pass_memory("decode", length + step - 1, kv_moves and step < max_new_tokens - 1,
                                                loaded_segments[step], longest)
                             for step in range(1, max_new_tokens)), key=lambda m: m.peak_bytes, default=None)
    except Exception as error:  # noqa: BLE001 - the schedules and bytes stand without the memory
        log.warning("explain_generation: the device memory of %s's passes is not predicted: tracing its forward "
                    "on fake tensors failed (%s: %s)", type(model).__name__, type(error).__name__, error)
        prefill_memory = decode_memory = memory = None
    prefill_time = decode_time = None
    if machine is not None and memory is not None:
        from slcompile.runtime.weights import weight_home

        layer_loads = [tuple(param.numel() * param.element_size() for _, param in params
                             if not engine.copies_nothing(
                                 (weight_home(param) or (None, None, Tier(weights)))[2], Tier.DEVICE))
                       for params in streamed]
        hidden_part = size_p * length * _hidden_row_bytes(model, layers)
        row_bytes = _kv_row_bytes(model, layers)

        def pass_time(step: int) -> Any:
            phase = "prefill" if step == 0 else "decode"
            past = 0 if step == 0 else length + step - 1

            def kv_bytes(index: int, positions: int) -> int:
                return 2 * size_d * positions * row_bytes[index]  # keys and values, one tensor

            transfers = {}
            for index in range(n):
                transfers[f"blk{index}.w"] = (weights, layer_loads[index])
                if offloads:
                    transfers.update((f"blk{index}.h.sb{sb}", (kv_cache, (hidden_part,))) for sb in range(kp))
                for sb in range(kd):
                    if step == 0:
                        stored = (kv_bytes(index, min(length, caps[index])),)
                        transfers[f"blk{index}.kv.sb{sb}"] = (kv_cache, stored)
                    else:
                        loaded = tuple(kv_bytes(index, seg) for seg in loaded_segments[step][index])
                        transfers[f"load blk{index}.kv.sb{sb}"] = (kv_cache, loaded)
                        transfers[f"store blk{index}.kv.sb{sb}"] = (kv_cache, (kv_bytes(
                            index, written_positions[step][index]),))
            costs, tail = memory.pass_costs(phase, past)
            return predict_pass_time(_pass_actions(steps[step].schedule, transfers, costs, tail, n,
                                                   offloads and step == 0),
                                     profile=machine, phase=phase, lowering=backend,
                                     tokens=batch * (length if step == 0 else 1))

        from slcompile.analysis.time import predict_pass_time

        try:
            prefill_time = pass_time(0)
            decode_time = pass_time(max(1, max_new_tokens // 2)) if max_new_tokens > 1 else None
        except Exception as error:  # noqa: BLE001 - the rest of the explanation stands without the time
            log.warning("explain_generation: the time of %s's passes is not predicted (%s: %s)",
                        type(model).__name__, type(error).__name__, error)
    return GenerationExplanation(type(model).__name__, plan.layers_name, n, batch, length, max_new_tokens, kp, kd,
                                 weights, kv_cache, weight_store_bytes, tuple(steps), prefill_memory, decode_memory,
                                 prefill_time, decode_time)


def _pass_actions(schedule: str, transfers: Mapping[str, tuple[str, tuple[int, ...]]], costs, tail, layers: int,
                  tail_per_subbatch: bool) -> list:
    """The `PassAction`s of a pass from its schedule text (`GenerationStep.schedule`,
    the order the pass runs in): each `load`/`store` a transfer of the sizes
    `transfers` gives (by name, or by "load name"/"store name" where the two
    differ), each `blkI.sbS` a compiled layer step of `costs[I]` that waits for the
    layer's weights, its cache and its hidden states, and the tail (`tail`'s ops)
    after each sub-batch's last layer or once at the end."""
    from slcompile.analysis.time import PassAction

    actions = []
    for item in schedule.split(" | ") if schedule else ():
        if item.startswith(("load ", "store ")):
            kind, name = item.split(" ")
            tier, sizes = transfers.get(item, transfers.get(name, ("device", ())))
            actions.append(PassAction(kind, name, tier, tuple(sizes)))
            continue
        layer, sb = item.split(".")
        index = int(layer[3:])
        waits = (f"{layer}.w", f"{layer}.kv.{sb}") + ((f"blk{index - 1}.h.{sb}",) if index else ())
        actions.append(PassAction("compute", layer, nodes=costs[index], waits=waits, calls=1))
        if tail_per_subbatch and index == layers - 1:
            actions.append(PassAction("compute", "suffix", nodes=tail, calls=0))
    if not tail_per_subbatch:
        actions.append(PassAction("compute", "suffix", nodes=tail, calls=0))
    return actions


def _kv_row_bytes(model: nn.Module, layers: Sequence[nn.Module]) -> list[int]:
    """Per layer, the bytes of one position of one sequence's keys (as many again
    for its values), from the model's config: key-value heads times head size in
    the layers' floating-point type."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    rows = []
    for layer in layers:
        dtype = next((p.dtype for p in layer.parameters() if p.is_floating_point()), torch.get_default_dtype())
        rows.append(kv_heads * head_dim * dtype.itemsize)
    return rows


def _hidden_row_bytes(model: nn.Module, layers: Sequence[nn.Module]) -> int:
    """The bytes of one position of one sequence's hidden states between layers:
    the model's hidden size in the layers' floating-point type."""
    dtype = next((p.dtype for p in layers[0].parameters() if p.is_floating_point()), torch.get_default_dtype())
    return model.config.hidden_size * dtype.itemsize


# -- device memory -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class PassMemory:
    """The device memory of one forward pass of a generation, predicted.

    Attributes:
        phase: "prefill" or "decode".
        peak_bytes: the device's peak during the pass.
        resident_bytes: the parameters and buffers the device holds for the whole
            generation (all but the streamed layer weights): the part of the peak
            that exists before `generate` is called.
        moment: where the peak is: ``blk1.sb0`` (the layer step of one
            (layer, sub-batch)), ``take blk1.sb0`` (its cache's segments joined),
            ``store after blk1.sb0`` (the prefill's caches it completes, stored),
            ``tail`` (final norm and head) or ``tail sb0`` (those of one sub-batch,
            in a prefill whose hidden states rest on the KV cache's tier).
        terms: the peak's parts, by name (they add up to `peak_bytes`).
    """

    phase: str
    peak_bytes: int
    resident_bytes: int
    moment: str
    terms: Mapping[str, int]

    def __str__(self) -> str:
        """One line, e.g. ``prefill peak 1.50 MiB at blk1.sb0: parameters 1.00 MiB, ...``."""
        from slcompile.units import format_bytes

        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.terms.items() if n)
        return f"{self.phase} peak {format_bytes(self.peak_bytes)} at {self.moment}: {parts}"


class _MemoryModel:
    """The device memory of the passes of one generation, for `explain_generation`.

    At every moment of a pass the device holds:

    - the parameters and buffers that are not streamed (`resident`);
    - what the capture made for all sub-batches (embeddings, rotary tables, masks),
      until the pass ends (`captured`), and each sub-batch's hidden states between
      layers (`hidden`); in a prefill that offloads them, what the computing
      sub-batch's capture made but its hidden states, its hidden states, the next
      one's loading and the sources of the stores in flight;
    - the streamed weights of `live_blocks` = 2 layers: the one computing and the
      next, prefetched (`weights`), each tensor padded as loads pad it;
    - the KV cache (`kv`): on a tier that copies nothing, every cache (the caches
      already computed by this pass at their new length); on one that copies, the
      cache of the (layer, sub-batch) computing and the loaded segments of the next
      `KV_AHEAD` (each segment its own tensor, or one buffer for all where
      `reads_in_place`), and the stores still in flight (the positions they write);
    - the temporaries of the compiled layer step (`step`): the peak of the values
      its graph makes (new cache included), from the lifetimes of the step's ATen
      graph traced on fake tensors, as `aot_eager` runs it (Inductor's fused
      kernels hold less: an upper bound there);
    - at the tail, the last layer's outputs, their concatenation, and the forward
      run again (what it computes before the layers, held through it as the
      capture is, then the final norm and the logits, traced likewise: `tail`);
      in a prefill that offloads hidden states, one sub-batch's, after its last
      layer step;
    - when the prefill stores its caches: a sub-batch's output and new cache, the
      stores in flight, and the rows copied out for the store (those of a decode
      sub-batch that several prefill sub-batches fill, from the first one on).

    The pass's peak is the largest such sum over its layer steps and its tail.
    Not counted: the growing sequences and masks (a few bytes a token), the
    sampling warpers' temporaries, and the transients of the capture itself.
    """

    def __init__(self, model, plan: _Plan, engine, batch: int, length: int, streamed, load_granularity: int,
                 load_overhead: int, memo: dict, padded: bool = False):
        from torch._subclasses.fake_tensor import FakeTensorMode

        from slcompile.runtime.weights import weight_home

        self.model, self.plan, self.batch, self.length, self.padded = model, plan, batch, length, padded
        self.layers = plan.layers
        self.granularity, self.overhead = max(1, load_granularity), load_overhead
        self.kv_moves = not engine.copies_nothing(Tier(plan.kv_cache), Tier.DEVICE)
        loaded = set()
        self.weights = []
        for params in streamed:
            nbytes = 0
            for _, param in params:
                home = weight_home(param)
                if not engine.copies_nothing(home[2] if home is not None else Tier(plan.weights), Tier.DEVICE):
                    loaded.add(id(param))
                    nbytes += self._padded(param.numel() * param.element_size())
            self.weights.append(nbytes)
        self.resident = sum(p.numel() * p.element_size() for p in model.parameters() if id(p) not in loaded) + sum(
            b.numel() * b.element_size() for b in model.buffers())
        self.windows = _cache_windows(model, len(self.layers))
        self.caps = [None if window is None else window - 1 for window in self.windows]
        self.key_bytes = _kv_row_bytes(model, self.layers)  # one position of one sequence's keys
        signature = inspect.signature(type(self.layers[0]).forward)
        self.hidden_name = list(signature.parameters)[1]
        first_of: dict[tuple, int] = {}
        self.group = [first_of.setdefault((type(layer), getattr(layer, "attention_type", None), window), index)
                      for index, (layer, window) in enumerate(zip(self.layers, self.windows))]
        if "mode" not in memo:  # one mode for every fake tensor the memo keeps
            memo["mode"] = FakeTensorMode(allow_non_fake_inputs=True)
        self.mode = memo["mode"]
        self.device = next(iter(model.parameters())).device
        # Traced peaks by (layer group, sequences, query, past) and ("tail", shape),
        # the captures by (phase, past), and a layer step's output (its structure).
        self.peaks: dict[tuple, int] = memo.setdefault("peaks", {})
        self.costs: dict[tuple, tuple] = memo.setdefault("costs", {})  # each traced graph's ops' costs
        self.captures: dict[tuple, tuple] = memo.setdefault("captures", {})
        self.outputs: dict[str, Any] = memo.setdefault("output", {})

    def _padded(self, nbytes: int) -> int:
        return -(-nbytes // self.granularity) * self.granularity + self.overhead

    def _vocab(self) -> int:
        """The logits of one sequence: the output embeddings' rows."""
        head = self.model.get_output_embeddings()
        return head.weight.shape[0] if head is not None else self.model.config.vocab_size

    def _kept(self, index: int, positions: int) -> int:
        cap = self.caps[index]
        return positions if cap is None else min(positions, cap)

    def _cache_bytes(self, index: int, sequences: int, positions: int) -> int:
        return 2 * sequences * positions * self.key_bytes[index]

    def _in_place(self, index: int, sequences: int) -> bool:
        """Whether a (layer, sub-batch)'s segments are read into one buffer."""
        from slcompile.runtime.kv import reads_in_place

        return reads_in_place(self._cache_bytes(index, sequences, 1), self.granularity)

    def _loaded_bytes(self, index: int, sequences: int, segments: Sequence[int]) -> int:
        # One tensor per segment (its positions' keys and values), or one buffer for all.
        if len(segments) > 1 and self._in_place(index, sequences):
            return self._padded(self._cache_bytes(index, sequences, sum(segments)))
        return sum(self._padded(self._cache_bytes(index, sequences, size)) for size in segments)

    def _layout(self, index: int) -> tuple[int, int, torch.dtype]:
        config = self.model.config
        heads = getattr(config, "num_attention_heads", None)
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        dtype = next((p.dtype for p in self.layers[index].parameters() if p.is_floating_point()),
                     torch.get_default_dtype())
        return kv_heads, head_dim, dtype

    def _grow(self, cache, sequences: int, positions: int) -> None:
        for index, layer in enumerate(cache.layers[:len(self.layers)]):
            heads, head_dim, dtype = self._layout(index)
            meta = torch.empty((sequences, heads, positions, head_dim), dtype=dtype, device="meta")
            layer.update(meta, meta)

    def _fake_like(self, tensor: torch.Tensor) -> torch.Tensor:
        with self.mode:
            return torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=tensor.device)

    def _traced_peak(self, function: Callable, args: Any, key: tuple) -> int:
        """The peak bytes of the values `function(*args)` makes (its inputs not
        counted), from the lifetimes of its ATen graph traced on fake tensors; the
        cost of each of its ops is kept under `key` (`costs`)."""
        import torch.utils._pytree as pytree
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.fx.experimental.proxy_tensor import make_fx

        from slcompile.analysis.lifetimes import analyze_lifetimes

        flat, spec = pytree.tree_flatten(args)
        where = [i for i, leaf in enumerate(flat) if isinstance(leaf, torch.Tensor)]

        def run(*tensors):
            leaves = list(flat)
            for i, tensor in zip(where, tensors):
                leaves[i] = tensor
            return function(*pytree.tree_unflatten(leaves, spec))

        tensors = [flat[i] if isinstance(flat[i], FakeTensor) else self.mode.from_tensor(flat[i]) for i in where]
        from slcompile.analysis.time import graph_cost

        gm = make_fx(run, tracing_mode="fake", _allow_non_fake_inputs=True)(*tensors)
        self.costs[key] = graph_cost(gm)
        return analyze_lifetimes(gm, "inference").peak()

    def _step_peak(self, index: int, sequences: int, past: int, call: dict) -> int:
        group = self.group[index]
        query = call[self.hidden_name].shape[-2]
        key = (group, sequences, query, past)
        if key not in self.peaks:
            template, window = self.layers[group], self.windows[group]
            cache_argument = self.plan.layer_cache_argument
            kwargs = _rows({k: v for k, v in call.items() if k != cache_argument}, 0, sequences, self.batch)
            tensors = {name: self._fake_like(t) for name, t in (*template.named_parameters(),
                                                                 *template.named_buffers())}
            heads, head_dim, dtype = self._layout(group)
            with self.mode:
                pasts = [torch.empty((sequences, heads, past, head_dim), dtype=dtype, device=self.device)
                         if past else None for _ in range(2)]

            def step(tensors, past_keys, past_values, kwargs):
                result = _layer_step(template, tensors, past_keys, past_values, window, kwargs, cache_argument)
                self.outputs["step"] = result[0]
                return result

            self.peaks[key] = self._traced_peak(step, (tensors, *pasts, kwargs), key)
        return self.peaks[key]

    def _tail_peak(self, inputs: dict, hidden: torch.Tensor) -> int:
        key = ("tail", tuple(hidden.shape))
        if key not in self.peaks:
            tensors, fakes = {}, {}
            for name, t in (*self.model.named_parameters(remove_duplicate=False), *self.model.named_buffers()):
                tensors[name] = fakes.setdefault(id(t), self._fake_like(t))
            cache_argument = self.plan.cache_argument
            cache = inputs[cache_argument]
            others = {k: v for k, v in inputs.items() if k != cache_argument}
            first = self.outputs["step"]

            def tail(tensors, whole, others):
                output = whole if isinstance(first, torch.Tensor) else (whole, *first[1:])
                with _layers_replaced(self.layers, lambda index: (lambda *args, **kwargs: output)):
                    logits = torch.func.functional_call(
                        self.model, tensors, (), {**others, cache_argument: cache, "return_dict": True}).logits
                return logits[:, -1].to(copy=True, dtype=torch.float32)

            self.peaks[key] = self._traced_peak(tail, (tensors, self._fake_like(hidden), others), key)
        return self.peaks[key]

    def _captured(self, phase: str, past: int, rows: int) -> tuple[dict, list[dict], int, int]:
        """The capture of `rows` sequences after `past` positions, on fake tensors:
        its inputs, the layers' arguments, the bytes of the tensors it makes (held
        by those arguments through the pass), and those bytes but the hidden states'."""
        from torch._subclasses.fake_tensor import FakeTensor
        from torch.multiprocessing.reductions import StorageWeakRef

        if (phase, past, rows) not in self.captures:
            query = self.length if phase == "prefill" else 1
            inputs, cache, _ = self._inputs(phase, past, rows, self.padded)
            with self.mode:
                calls = _capture(self.model, self.layers, self.plan.layers_name, inputs)
            storages, hidden = {}, StorageWeakRef(calls[0][self.hidden_name].untyped_storage())
            for call in calls:
                for name, value in call.items():
                    for leaf in (value if isinstance(value, (tuple, list)) else (value,)):
                        if name != self.plan.layer_cache_argument and isinstance(leaf, FakeTensor):
                            storages[StorageWeakRef(leaf.untyped_storage())] = leaf.untyped_storage().nbytes()
            self._grow(cache, rows, query)  # the tail sees the pass's new positions
            captured = sum(storages.values())
            self.captures[phase, past, rows] = (inputs, calls, captured, captured - storages.get(hidden, 0))
        return self.captures[phase, past, rows]

    def _inputs(self, phase: str, past: int, rows: int, padded: bool) -> tuple[dict, Any, set]:
        """The model's inputs for a pass of `rows` sequences after `past` positions
        (every sequence padded by its first position when `padded`), their cache
        object, and the storages of what the generation itself holds among them
        (sequences, mask, position ids)."""
        from torch.multiprocessing.reductions import StorageWeakRef
        from transformers import DynamicCache

        query = self.length if phase == "prefill" else 1
        cache = DynamicCache(config=self.model.config)
        if past:
            self._grow(cache, rows, past)
        sequences = torch.zeros((rows, past + query), dtype=torch.long, device=self.device)
        mask = None
        if padded:
            mask = torch.ones_like(sequences)
            mask[:, 0] = 0
        position_ids = _position_ids(self.model, sequences, mask)
        inputs = _pass_inputs(self.model, self.plan, sequences, cache, mask, position_ids, phase == "prefill")
        given = {StorageWeakRef(t.untyped_storage()) for t in (sequences, mask, position_ids) if t is not None}
        return inputs, cache, given

    def _input_bytes(self, phase: str, past: int) -> int:
        """The bytes of the tensors `model.prepare_inputs_for_generation` makes for
        a pass over the whole batch (position ids made contiguous, ...), held
        through the pass."""
        from torch.multiprocessing.reductions import StorageWeakRef

        key = ("inputs", phase, past)
        if key not in self.peaks:
            inputs, _, given = self._inputs(phase, past, self.batch, False)
            made = {StorageWeakRef(v.untyped_storage()): v.untyped_storage().nbytes() for v in inputs.values()
                    if isinstance(v, torch.Tensor)}
            self.peaks[key] = sum(n for ref, n in made.items() if ref not in given)
        return self.peaks[key]

    def _traced(self, phase: str, past: int, size: int, rows: int) -> tuple[int, int, int, list[int], int]:
        """The traced parts of a pass after `past` positions with sub-batches of
        `size`, captured `rows` sequences at a time: the bytes a capture makes, those
        but its hidden states, its hidden states, each layer step's peak and the
        tail's (of `rows` sequences)."""
        inputs, calls, captured, other = self._captured(phase, past, rows)
        hidden = calls[0][self.hidden_name]
        steps = [self._step_peak(index, size, self._kept(index, past), calls[index])
                 for index in range(len(self.layers))]
        tail = self._tail_peak(inputs, hidden)
        return captured, other, hidden.numel() * hidden.element_size(), steps, tail

    def pass_costs(self, phase: str, past: int) -> tuple[list[tuple], tuple]:
        """The cost of each op (`slcompile.analysis.time.ComputeCost`) of each
        layer's step for one sub-batch, and of the tail, in the pass after `past`
        positions (the tail of one sub-batch where the prefill offloads its hidden
        states, else of the batch), from the graphs `pass_memory` traces."""
        parts = self.plan.prefill_subbatches if phase == "prefill" else self.plan.num_subbatches
        size = self.batch // parts
        offloads = phase == "prefill" and offloads_hidden(self.kv_moves, parts, len(self.layers))
        inputs, calls, _, _ = self._captured(phase, past, size if offloads else self.batch)
        steps = []
        for index in range(len(self.layers)):
            call = calls[index]
            self._step_peak(index, size, self._kept(index, past), call)
            steps.append(self.costs[(self.group[index], size, call[self.hidden_name].shape[-2],
                                     self._kept(index, past))])
        hidden = calls[0][self.hidden_name]
        self._tail_peak(inputs, hidden)
        return steps, self.costs[("tail", tuple(hidden.shape))]

    def pass_memory(self, phase: str, past: int, stores: bool, segments: Sequence[Sequence[int]] = (),
                    traced_past: int | None = None) -> PassMemory:
        """The device memory of the pass that follows `past` positions.

        Args:
            phase: "prefill" or "decode".
            past: positions each sequence has before the pass (0 for the prefill).
            stores: whether the pass stores its caches (on a tier that copies).
            segments: per layer, the positions of each stored segment the decode
                pass loads (on a tier that copies).
            traced_past: the past the capture and the layer steps are traced with
                (default: `past`).
        """
        from slcompile.runtime.kv import merged_segments

        plan, batch, n = self.plan, self.batch, len(self.layers)
        parts = plan.prefill_subbatches if phase == "prefill" else plan.num_subbatches
        size, decode_size = batch // parts, batch // plan.num_subbatches
        query = self.length if phase == "prefill" else 1
        # An offloading prefill captures, and computes the logits of, one sub-batch at a time.
        offloads = phase == "prefill" and offloads_hidden(self.kv_moves, parts, n)
        captured, other, hidden_bytes, steps, tail = self._traced(
            phase, past if traced_past is None else traced_past, size, size if offloads else batch)
        part_hidden = hidden_bytes if offloads else hidden_bytes // parts

        # 2. The stores' sources in the order they are issued (the last
        # `stores_in_flight` (layer, sub-batch)s' are alive), and how many precede
        # each layer step.
        issued, before = [], {}
        for index in range(n):
            for part in range(parts):
                before[index, part] = len(issued)
                if not (stores and self.kv_moves):
                    continue
                if phase == "decode":
                    written = merged_segments(segments[index], 1, self._kept(index, past + 1))[1]
                    issued.append(self._cache_bytes(index, size, written))
                else:
                    issued += [self._cache_bytes(index, decode_size, self._kept(index, self.length))
                               for d in range(plan.num_subbatches)
                               if part * size < (d + 1) * decode_size <= (part + 1) * size]

        def in_flight(count: int) -> int:
            return sum(issued[max(0, count - 4):count])

        # An offloading prefill fills every sequence's logits from its first tail on,
        # and holds the inputs made for the whole batch.
        logits = batch * self._vocab() * 4 if offloads else 0
        inputs = self._input_bytes(phase, past) if offloads else 0

        def hidden_held(index: int, part: int) -> int:
            """The hidden states an offloading prefill holds at a layer step: what the
            step's capture keeps but its hidden states, the step's input, the next
            step's input loading, and the sources of the stores in flight."""
            step = index * parts + part
            loaded = self._padded(part_hidden)  # a load pads what it reads
            loading = 1 <= (step + 1) // parts < n
            storing = min(HIDDEN_STORES_IN_FLIGHT, step, (n - 1) * parts)
            return (inputs + other + (part_hidden if index == 0 else loaded) + loading * loaded
                    + storing * part_hidden)

        # 3. Every moment of the pass.
        held = 0 if self.kv_moves else sum(self._cache_bytes(i, batch, self._kept(i, past)) for i in range(n))
        growth = [self._cache_bytes(i, size, self._kept(i, past + query)) - self._cache_bytes(
            i, size, self._kept(i, past)) for i in range(n)]
        moments: list[tuple[str, dict[str, int]]] = []
        grown = 0
        for index in range(n):
            weights = self.weights[index] + (self.weights[index + 1] if index + 1 < n else 0)
            for part in range(parts):
                common = {"parameters": self.resident, "weights": weights,
                          "hidden": hidden_held(index, part) if offloads
                          else captured + (parts if index else part) * part_hidden}
                if not self.kv_moves:
                    # Prefill parts smaller than a decode sub-batch wait as pieces: the same bytes.
                    moments.append((f"blk{index}.sb{part}", {**common, "kv": held + grown, "step": steps[index]}))
                    grown += growth[index]
                    continue
                stored = in_flight(before[index, part])
                if phase == "prefill":
                    whole = self._cache_bytes(index, decode_size, self._kept(index, self.length))

                    def filling(part: int) -> int:
                        # The rows of a decode sub-batch that earlier parts began to fill.
                        return whole if size < decode_size and (part * size) % decode_size else 0

                    if offloads and index == n - 1 and part:
                        common["logits"] = logits
                    moments.append((f"blk{index}.sb{part}", {**common, "kv": stored + filling(part),
                                                             "step": steps[index]}))
                    # Its stores: the step's output and new cache, the stores in
                    # flight, and the rows of the decode sub-batch it fills (one per
                    # store where it holds whole decode sub-batches, copied out).
                    first, last = before[index, part], (before[index, part + 1] if part + 1 < parts
                                                        else len(issued))
                    made = self._cache_bytes(index, size, self._kept(index, self.length))
                    hidden = common["hidden"] + part_hidden
                    if size < decode_size:
                        moments.append((f"store after blk{index}.sb{part}", {
                            **common, "hidden": hidden, "kv": in_flight(first) + made + whole}))
                    else:
                        moments += [(f"store after blk{index}.sb{part}", {
                            **common, "hidden": hidden, "kv": in_flight(count) + made + issued[count]})
                            for count in range(first, last)]
                    if offloads and index == n - 1:
                        # The sub-batch's tail, once its caches are stored: its last
                        # output instead of the step, and the forward again.
                        after = before[index, part + 1] if part + 1 < parts else len(issued)
                        moments.append((f"tail sb{part}", {
                            **common, "hidden": common["hidden"] + captured, "logits": logits,
                            "kv": in_flight(after) + filling(part + 1), "tail": tail}))
                    continue
                step = index * parts + part
                ahead = sum(self._loaded_bytes(later // parts, size, segments[later // parts])
                            for later in range(step + 1, min(step + 1 + KV_AHEAD, n * parts)))
                own = segments[index]
                if len(own) > 1 and not self._in_place(index, size):
                    joined = self._padded(self._cache_bytes(index, size, sum(own)))
                    moments.append((f"take blk{index}.sb{part}", {
                        **common, "kv": stored + ahead + self._loaded_bytes(index, size, own) + joined}))
                else:
                    joined = self._loaded_bytes(index, size, own)
                moments.append((f"blk{index}.sb{part}", {**common, "kv": stored + ahead + joined,
                                                         "step": steps[index]}))
        # The tail: every sub-batch's last output, their concatenation, and the
        # forward again, holding what it computes before the layers as the capture does.
        if not offloads:
            moments.append(("tail", {"parameters": self.resident, "hidden": 2 * captured + 2 * hidden_bytes,
                                     "kv": 0 if self.kv_moves else held + grown, "tail": tail}))
        moment, terms = max(moments, key=lambda item: sum(item[1].values()))
        return PassMemory(phase, sum(terms.values()), self.resident, moment, terms)


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


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress_bar(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    from tqdm.auto import tqdm

    return tqdm(total=total, desc="generate", unit="tok")
