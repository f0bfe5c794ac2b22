"""Generation layer-major over sub-batches, with weights and KV cache on tiers.

`generate(model, input_ids, ...)` returns what `model.generate(...)` returns (the
sequences, prompt included, pad after EOS) for a Hugging Face decoder-only causal LM,
computed in SpeedLoader's order: the batch is split into K sub-batches, and every
forward pass (the prefill, then one decode step per token) runs each decoder layer
for all K sub-batches before the next layer starts.

How a pass runs, with no per-family code:

1. Capture. For each sub-batch, the model's own forward runs on the inputs that
   `model.prepare_inputs_for_generation` builds, with every decoder layer's forward
   replaced by a recorder: the embeddings, masks, rotary tables and positions that
   each layer would receive are recorded, and the pass stops at the last layer.
2. Layers. For each layer: its weights are fetched from the `weights` tier once (the
   next layer's are prefetched), then for each sub-batch its (layer, sub-batch) KV
   cache is taken from the `kv_cache` tier (the next one's load already issued), the
   layer runs in a compiled step, and the updated cache is stored back.
3. Tail. For each sub-batch the forward runs once more with the layers returning
   the outputs of step 2: final norm and head give the logits of the last position.

The compiled step is `torch.func.functional_call` of one template layer per layer
class, with the layer's weights and the past keys and values as inputs: every layer
of a class shares one graph, and decode steps share one graph (the cache length is a
dynamic dimension). The prefill has its own graph.

The Hugging Face cache object of each sub-batch is kept for what the model's forward
reads from it (lengths, sliding-window offsets); its tensors are shape-only `meta`
placeholders, updated with each layer's new shapes, while the values rest on the
`kv_cache` tier.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from slcompile.config import TIERS
from slcompile.errors import OptionError, RefusedError

__all__ = ["generate", "find_decoder_layers"]

log = logging.getLogger(__name__)


def generate(
    model: nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    *,
    max_new_tokens: int = 20,
    num_subbatches: int = 1,
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
) -> torch.Tensor:
    """Generates tokens like `model.generate(...)`, layer-major over sub-batches.

    Args:
        model: a Hugging Face decoder-only causal LM (`GenerationMixin`) with a KV cache.
        input_ids: the prompts, `(batch, length)`, left-padded when their lengths differ.
        attention_mask: `(batch, length)`, 0 at padding (None: no padding).
        max_new_tokens: tokens to generate per sequence (fewer when every sequence
            has reached EOS).
        num_subbatches: K; the batch size must be divisible by it.
        weights: where the decoder layers' weights rest between uses: "device",
            "host" or "nvme"; off the device, each layer's weights are loaded once
            per forward pass for all K sub-batches. They stay offloaded afterwards
            (read them inside `slcompile.gathered_weights(model)`).
        kv_cache: where each (layer, sub-batch)'s keys and values rest between
            decode steps: "device", "host" or "nvme".
        do_sample: sample the next token (else greedy).
        temperature, top_k, top_p: Hugging Face's warpers, applied in that order
            when sampling (defaults: those of `GenerationConfig`).
        generator: the random generator sampling draws from (same seed, same tokens).
        eos_token_id: the end-of-sequence token(s) (default: the model's generation
            config's); a finished sequence gets `pad_token_id` from then on.
        pad_token_id: default: the model's, else the first EOS token.
        offload_dir: parent directory of the nvme tier's files (default: temp dir).
        backend: the `torch.compile` backend of the layer steps ("inductor",
            "aot_eager", or a backend callable).
        progress: show a progress bar over the generated tokens.

    Returns:
        The sequences, `(batch, length + generated)`, as `model.generate` returns them.

    Raises:
        OptionError: a bad argument (the message names it and a fix).
        RefusedError: the model has no repeated decoder layers or no KV cache.
    """
    plan = _plan(model, input_ids, attention_mask, max_new_tokens, num_subbatches, weights, kv_cache,
                 do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, offload_dir)
    with torch.no_grad():
        return _Generation(model, plan, backend, generator, progress).run(input_ids, attention_mask)


# -- checks and the plan -------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Plan:
    layers: tuple[nn.Module, ...]
    layers_name: str
    max_new_tokens: int
    num_subbatches: int
    weights: str
    kv_cache: str
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    offload_dir: str | None


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


def _plan(model, input_ids, attention_mask, max_new_tokens, num_subbatches, weights, kv_cache,
          do_sample, temperature, top_k, top_p, eos_token_id, pad_token_id, offload_dir) -> _Plan:
    for option, value in (("weights", weights), ("kv_cache", kv_cache)):
        if value not in TIERS:
            raise OptionError(f"generate: {option}={value!r} is not a tier; use one of {', '.join(map(repr, TIERS))}")
    if not isinstance(input_ids, torch.Tensor) or input_ids.ndim != 2:
        raise OptionError("generate: input_ids must be a (batch, length) tensor of token ids; "
                          f"got {getattr(input_ids, 'shape', type(input_ids).__name__)}")
    if attention_mask is not None and attention_mask.shape != input_ids.shape:
        raise OptionError(f"generate: attention_mask has shape {tuple(attention_mask.shape)}, input_ids "
                          f"{tuple(input_ids.shape)}; pass a mask of the same shape (1 = token, 0 = padding)")
    batch = input_ids.shape[0]
    if not isinstance(num_subbatches, int) or num_subbatches < 1 or batch % num_subbatches:
        divisors = [k for k in range(1, batch + 1) if batch % k == 0]
        raise OptionError(f"generate: num_subbatches={num_subbatches!r} does not divide the batch of {batch} "
                          f"sequences; use a divisor of {batch} ({', '.join(map(str, divisors))}) or pad the batch")
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise OptionError(f"generate: max_new_tokens={max_new_tokens!r} must be a positive int")
    config = getattr(model, "config", None)
    forward_params = inspect.signature(model.forward).parameters
    if (config is None or getattr(config, "is_encoder_decoder", False)
            or not hasattr(model, "prepare_inputs_for_generation") or "past_key_values" not in forward_params):
        raise RefusedError(
            f"{type(model).__name__} has no KV cache to generate with (slcompile.generate needs a Hugging "
            "Face decoder-only causal LM whose forward takes past_key_values); use model.generate, "
            "or a model class ending in ForCausalLM", "generate")
    layers_name, layers = find_decoder_layers(model)
    if "past_key_values" not in inspect.signature(layers[0].forward).parameters:
        raise RefusedError(f"the layers {layers_name} of {type(model).__name__} take no past_key_values: the "
                           "model has no KV cache per layer; use model.generate", "generate")
    limit = next((getattr(config, name) for name in ("max_position_embeddings", "n_positions", "max_seq_len")
                  if isinstance(getattr(config, name, None), int)), None)
    total = input_ids.shape[1] + max_new_tokens
    if limit is not None and total > limit:
        raise OptionError(
            f"generate: max_new_tokens={max_new_tokens} with prompts of {input_ids.shape[1]} tokens makes "
            f"{total} positions, over the model's {limit} (config max_position_embeddings); set "
            f"max_new_tokens <= {limit - input_ids.shape[1]} or shorten the prompts")
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
    return _Plan(tuple(layers), layers_name, max_new_tokens, num_subbatches, weights, kv_cache, do_sample,
                 float(temperature), top_k, float(top_p), eos, pad_token_id, offload_dir)


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


def _layer_step(template, tensors, past_keys, past_values, window, kwargs):
    slot = _KVSlot(past_keys, past_values, window)
    output = torch.func.functional_call(template, tensors, (), {**kwargs, "past_key_values": slot})
    return output, slot.keys, slot.values


def _prefill_layer(template, tensors, window, kwargs):
    return _layer_step(template, tensors, None, None, window, kwargs)


def _decode_layer(template, tensors, past_keys, past_values, window, kwargs):
    return _layer_step(template, tensors, past_keys, past_values, window, kwargs)


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


# -- the engine ----------------------------------------------------------------------


class _Generation:
    """One call of `generate`: the plan, the tiers and the per-sub-batch state."""

    def __init__(self, model, plan: _Plan, backend, generator, progress):
        from transformers import DynamicCache
        from transformers.cache_utils import DynamicLayer, DynamicSlidingWindowLayer

        from slcompile.pipeline import engine_for
        from slcompile.runtime.kv import KVStore
        from slcompile.runtime.tiers import Tier

        self.model, self.plan, self.generator, self.progress = model, plan, generator, progress
        self.layers = plan.layers
        self.engine = engine_for(plan.offload_dir)
        self.kv = KVStore(self.engine, plan.kv_cache)
        self.prefill_step = _compiled(backend, "prefill")
        self.decode_step = _compiled(backend, "decode")
        self.signature = inspect.signature(type(self.layers[0]).forward)
        self.hidden_name = list(self.signature.parameters)[1]  # after self
        self.cache_factory = lambda: DynamicCache(config=model.config)
        # The sliding window of each layer (None: full attention), from the cache
        # layers the model's own DynamicCache builds.
        windows = []
        for cache_layer in self.cache_factory().layers[: len(self.layers)]:
            if type(cache_layer) is DynamicSlidingWindowLayer:
                windows.append(cache_layer.sliding_window)
            elif type(cache_layer) is DynamicLayer:
                windows.append(None)
            else:
                raise RefusedError(f"{type(model).__name__}'s cache layers are {type(cache_layer).__name__}; "
                                   "slcompile.generate handles full and sliding-window attention caches; "
                                   "use model.generate", "generate")
        if len(windows) != len(self.layers):
            windows += [None] * (len(self.layers) - len(windows))
        self.windows = windows
        # One template per (layer class, attention type): same code, same graph.
        self.templates = []
        first_of: dict[tuple, nn.Module] = {}
        for layer, window in zip(self.layers, windows):
            group = (type(layer), getattr(layer, "attention_type", None), window)
            self.templates.append(first_of.setdefault(group, layer))
        self.streamer, self.streamed = None, [{} for _ in self.layers]
        self._stream_weights(offload=not self.engine.copies_nothing(Tier(plan.weights), Tier.DEVICE))

    def _stream_weights(self, offload: bool) -> None:
        """Offloads the parameters that only one layer uses (when `offload`), and
        streams those already offloaded (by an earlier call or a compiled graph)."""
        from slcompile.runtime.weights import WeightStreamer, weight_home

        prefix = f"{self.plan.layers_name}."
        outside = {id(p) for name, p in self.model.named_parameters(remove_duplicate=False)
                   if not name.startswith(prefix)}
        owners: dict[int, int] = {}
        for index, layer in enumerate(self.layers):
            for param in layer.parameters():
                owners[id(param)] = index if owners.get(id(param), index) == index else -1
        for index, layer in enumerate(self.layers):
            for name, param in layer.named_parameters():
                resting = weight_home(param) is not None
                if not resting and (not offload or id(param) in outside or owners[id(param)] != index):
                    continue
                if self.streamer is None:
                    key = (id(self.engine), self.plan.weights)
                    if key not in _STREAMERS or _STREAMERS[key].engine is not self.engine:
                        _STREAMERS[key] = WeightStreamer(self.engine, self.plan.weights, live_blocks=2)
                    self.streamer = _STREAMERS[key]
                stored = self.streamer.stored_key_for(f"{prefix}{index}.{name}", param)
                self.streamer.offload(stored, param)
                self.streamed[index][name] = self.streamer.graph_key(stored)

    # -- weights --------------------------------------------------------------
    def _issue_weights(self, index: int) -> None:
        if self.streamer is not None and index < len(self.layers):
            for key in self.streamed[index].values():
                self.streamer.issue(key)

    def _weights(self, index: int) -> dict[str, torch.Tensor]:
        layer = self.layers[index]
        tensors = {name: p.detach() for name, p in layer.named_parameters() if name not in self.streamed[index]}
        tensors.update((name, b) for name, b in layer.named_buffers())
        if self.streamer is not None:
            tensors.update((name, self.streamer.fetch(key)) for name, key in self.streamed[index].items())
        return tensors

    # -- one forward pass -------------------------------------------------------
    def _capture(self, inputs: dict) -> list[dict[str, Any]]:
        calls: list[dict[str, Any]] = [None] * len(self.layers)  # type: ignore[list-item]

        def recorder(index):
            def forward(*args, **kwargs):
                calls[index] = _as_keywords(self.signature, (None, *args), kwargs)
                calls[index].pop("self")
                if index == len(self.layers) - 1:
                    raise _Captured
                return calls[index][self.hidden_name]
            return forward

        with _layers_replaced(self.layers, recorder):
            try:
                _model_call(self.model, inputs)
            except _Captured:
                pass
        if any(call is None for call in calls):
            raise RefusedError(f"{type(self.model).__name__}'s forward did not call every layer of "
                               f"{self.plan.layers_name}; use model.generate", "generate")
        return calls

    def _tail(self, inputs: dict, output) -> torch.Tensor:
        with _layers_replaced(self.layers, lambda index: (lambda *args, **kwargs: output)):
            logits = _model_call(self.model, inputs).logits
        return logits[:, -1].to(copy=True, dtype=torch.float32)

    def _forward(self, inputs_of: list[dict]) -> torch.Tensor:
        """One forward pass of every sub-batch, layer-major; the last position's logits."""
        k = self.plan.num_subbatches
        calls = [self._capture(inputs) for inputs in inputs_of]
        hidden = [call[0][self.hidden_name] for call in calls]
        outputs: list[Any] = [None] * k
        self._issue_weights(0)
        self.kv.issue(0, 0)
        for index, layer in enumerate(self.layers):
            tensors = self._weights(index)
            self._issue_weights(index + 1)
            for sb in range(k):
                nxt = (index, sb + 1) if sb + 1 < k else (index + 1, 0)
                if nxt[0] < len(self.layers):
                    self.kv.issue(*nxt)
                past = self.kv.take(index, sb)
                kwargs = dict(calls[sb][index])
                kwargs[self.hidden_name] = hidden[sb]
                kwargs.pop("past_key_values")
                window = self.windows[index]
                if past is None:
                    output, keys, values = self.prefill_step(self.templates[index], tensors, window, kwargs)
                else:
                    _mark_length_dynamic(past, kwargs)
                    output, keys, values = self.decode_step(self.templates[index], tensors, *past, window, kwargs)
                outputs[sb] = output
                hidden[sb] = output if isinstance(output, torch.Tensor) else output[0]
                self.kv.store(index, sb, keys, values)
                # The model's cache object learns the new shapes (values stay on the tier).
                query = hidden[sb].shape[-2]
                new_keys = keys.new_empty((*keys.shape[:-2], query, keys.shape[-1]), device="meta")
                new_values = values.new_empty((*values.shape[:-2], query, values.shape[-1]), device="meta")
                calls[sb][index]["past_key_values"].layers[index].update(new_keys, new_values)
            del tensors
        self.kv.flush()
        return torch.cat([self._tail(inputs, output) for inputs, output in zip(inputs_of, outputs)])

    # -- the generation loop -----------------------------------------------------
    def run(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
        from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

        plan, model = self.plan, self.model
        k = plan.num_subbatches
        device = input_ids.device
        accepts_positions = "position_ids" in inspect.signature(model.forward).parameters
        keep_logits = "logits_to_keep" in inspect.signature(model.forward).parameters
        position_ids = None
        if accepts_positions:
            if attention_mask is not None:
                position_ids = attention_mask.long().cumsum(-1) - 1
                position_ids = position_ids.masked_fill(attention_mask == 0, 0)
            else:
                position_ids = torch.arange(input_ids.shape[1], device=device).unsqueeze(0).expand_as(input_ids)
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
        size = input_ids.shape[0] // k
        caches = [self.cache_factory() for _ in range(k)]
        sequences = input_ids
        unfinished = torch.ones(input_ids.shape[0], dtype=torch.long, device=device)
        eos = torch.tensor(plan.eos_token_ids, dtype=torch.long, device=device) if plan.eos_token_ids else None
        bar = _progress_bar(plan.max_new_tokens, self.progress)
        try:
            for step in range(plan.max_new_tokens):
                inputs_of = []
                for sb in range(k):
                    rows = slice(sb * size, (sb + 1) * size)
                    kwargs = {"past_key_values": caches[sb], "use_cache": True}
                    if attention_mask is not None:
                        kwargs["attention_mask"] = attention_mask[rows]
                    if position_ids is not None:
                        kwargs["position_ids"] = position_ids[rows]
                    if keep_logits:
                        kwargs["logits_to_keep"] = 1
                    inputs = model.prepare_inputs_for_generation(
                        sequences[rows], next_sequence_length=None if step == 0 else 1,
                        is_first_iteration=step == 0, **kwargs)
                    inputs_of.append(inputs)
                logits = self._forward(inputs_of)
                scores = processors(sequences, logits)
                if plan.do_sample:
                    probs = torch.softmax(scores, dim=-1)
                    next_tokens = torch.multinomial(probs, num_samples=1, generator=self.generator).squeeze(1)
                else:
                    next_tokens = torch.argmax(scores, dim=-1)
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
        finally:
            bar.close()
            self.kv.close()
        return sequences


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
