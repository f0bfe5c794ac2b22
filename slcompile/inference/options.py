"""Generation's options checked against the model: where its decoder layers are,
which argument takes the cache, the sub-batches and tiers (`generation_plan` -> `_Plan`). The
engine's options are the backend's own record (`SpeedLoaderConfig`:
`generation_config`)."""

from __future__ import annotations

import dataclasses
import inspect
import re
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from slcompile.config import SpeedLoaderConfig, batch_divisors, batch_split_problem
from slcompile.errors import OptionError, RefusedError

__all__ = [
    "CALL_OPTIONS", "ENGINE_OPTIONS", "cache_parameter", "find_decoder_layers", "generation_config", "generation_plan",
    "inferred_attention_mask",
]


ENGINE_OPTIONS = ("num_subbatches", "prefill_subbatches", "weights", "kv_cache", "live_blocks", "offload_dir",
                   "schedule", "backend", "progress")
CALL_OPTIONS = ("max_new_tokens", "do_sample", "temperature", "top_k", "top_p", "eos_token_id", "pad_token_id")


def generation_config(num_subbatches: int = 1, prefill_subbatches: int | None = None, weights: str = "device",
                      kv_cache: str = "device", live_blocks: int = 2, offload_dir: str | None = None,
                      schedule: Any = "speedloader") -> SpeedLoaderConfig:
    """Generation's engine options as the backend's `SpeedLoaderConfig`, checked by
    it (an error names `generate`). `schedule` is "speedloader" (the built-in
    policy) or a `Policy` whose build takes a `PassRequest`."""
    if isinstance(schedule, str) and schedule != "speedloader":
        raise OptionError(f"generate: schedule={schedule!r}: a generation pass is written by 'speedloader' (the "
                          "layer-major policy) or by a slcompile.schedules.Policy whose build takes a "
                          "slcompile.schedules.generation.PassRequest; the training policies write training steps")
    try:
        return SpeedLoaderConfig(num_subbatches=num_subbatches, prefill_subbatches=prefill_subbatches,
                                 weights=weights, kv_cache=kv_cache, live_blocks=live_blocks, offload_dir=offload_dir,
                                 schedule=schedule)
    except OptionError as err:
        raise OptionError(f"generate: {err}") from None


@dataclasses.dataclass(frozen=True)
class _Plan:
    """A generation's options checked against the model: the engine's (`config`:
    sub-batches, tiers, the window of layers whose weights are on the device), the
    call's (tokens and sampling), and where the model's layers and cache are."""

    config: SpeedLoaderConfig
    layers: tuple[nn.Module, ...]
    layers_name: str
    max_new_tokens: int
    do_sample: bool
    temperature: float
    top_k: int | None
    top_p: float
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    # The keywords through which the model's forward and its layers take the KV
    # cache (`cache` from transformers 5.24 on, `past_key_values` before).
    cache_argument: str
    layer_cache_argument: str

    @property
    def num_subbatches(self) -> int:
        return self.config.num_subbatches

    @property
    def prefill_subbatches(self) -> int:
        prefill = self.config.prefill_subbatches
        return self.config.num_subbatches if prefill is None else prefill

    @property
    def weights(self) -> str:
        return self.config.weights

    @property
    def kv_cache(self) -> str:
        return self.config.kv_cache

    @property
    def live_blocks(self) -> int:
        return self.config.live_blocks

    @property
    def offload_dir(self) -> str | None:
        return self.config.offload_dir

    @property
    def policy(self):
        """The policy that writes each pass's schedule (validated: `validate_pass`)."""
        from slcompile.schedules.policies import GENERATION

        return GENERATION if isinstance(self.config.schedule, str) else self.config.schedule


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
    if (not isinstance(value, int) or isinstance(value, bool) or value < 1
            or batch_split_problem(batch, value) is not None):
        divisors = batch_divisors(batch)
        raise OptionError(f"generate: {option}={value!r} does not divide the batch of {batch} "
                          f"sequences; use a divisor of {batch} ({', '.join(map(str, divisors))}) or pad the batch")


def inferred_attention_mask(input_ids: torch.Tensor, pad_token_id: int | None,
                             eos_token_ids: tuple[int, ...]) -> torch.Tensor | None:
    """The mask `model.generate` infers when none is passed: `input_ids != pad_token_id`
    when the pad token occurs in the prompts and is no EOS token, else none (every
    position attended). Transformers' `_prepare_attention_mask_for_generation` rule,
    with the pad and EOS tokens resolved as `generation_plan` resolves them."""
    if pad_token_id is None or input_ids.dtype not in (torch.int, torch.long):
        return None
    if pad_token_id in eos_token_ids or not bool((input_ids == pad_token_id).any()):
        return None
    return input_ids.ne(pad_token_id).long()


def generation_plan(model, input_ids, attention_mask, config: SpeedLoaderConfig, *, max_new_tokens: int,
          do_sample: bool = False, temperature: float = 1.0, top_k: int | None = None, top_p: float = 1.0,
          eos_token_id=None, pad_token_id: int | None = None) -> _Plan:
    """The checked options; `input_ids` may be a shape `(batch, length)` (explain).
    `config` is `generation_config(...)`'s."""
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
    _check_subbatches("num_subbatches", config.num_subbatches, batch)
    if config.prefill_subbatches is not None:
        _check_subbatches("prefill_subbatches", config.prefill_subbatches, batch)
    if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise OptionError(f"generate: max_new_tokens={max_new_tokens!r} must be a positive int")
    model_config = getattr(model, "config", None)
    cache_argument = cache_parameter(model.forward)
    if (model_config is None or getattr(model_config, "is_encoder_decoder", False)
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
    limit = next((getattr(model_config, name) for name in ("max_position_embeddings", "n_positions", "max_seq_len")
                  if isinstance(getattr(model_config, name, None), int)), None)
    total = shape[1] + max_new_tokens
    if limit is not None and total > limit:
        raise OptionError(
            f"generate: max_new_tokens={max_new_tokens} with prompts of {shape[1]} tokens makes "
            f"{total} positions, over the model's {limit} (config max_position_embeddings); set "
            f"max_new_tokens <= {limit - shape[1]} or shorten the prompts")
    defaults = getattr(model, "generation_config", None)
    if eos_token_id is None:
        eos_token_id = getattr(defaults, "eos_token_id", None)
    eos = () if eos_token_id is None else tuple(
        [int(eos_token_id)] if isinstance(eos_token_id, int) else [int(t) for t in eos_token_id])
    if pad_token_id is None:
        pad_token_id = getattr(defaults, "pad_token_id", None)
    if pad_token_id is None and eos:
        pad_token_id = eos[0]
    if do_sample and not temperature > 0:
        raise OptionError(f"generate: temperature={temperature!r} must be > 0 when sampling; "
                          "use do_sample=False for greedy decoding")
    return _Plan(config, tuple(layers), layers_name, max_new_tokens, do_sample, float(temperature), top_k,
                 float(top_p), eos, pad_token_id, cache_argument, layer_cache_argument)
