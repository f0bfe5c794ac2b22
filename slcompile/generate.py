"""Generation layer-major over sub-batches, with weights and KV cache on tiers.

`generate(model, input_ids, ...)` returns what `model.generate(...)` returns (the
sequences, prompt included, pad after EOS) for a Hugging Face decoder-only causal LM,
computed in SpeedLoader's order: the batch is split into sub-batches, and every
forward pass (the prefill, then one decode step per token) runs each decoder layer
for all sub-batches before the next layer starts. The prefill and the decode steps
may split the batch differently (`prefill_subbatches`, `num_subbatches`).

Each pass is a `Schedule` (`slcompile.schedules.generation.generation_pass`, in
training's step vocabulary) lowered to an FX graph that the pass runs;
`explain_generation` writes and lowers the same schedules from the same requests, and
predicts memory and time from those graphs, so what it explains is what runs.
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

`explain_generation(...)` gives the schedules of the prefill and of every decode
pass and the bytes each pass moves, from the model's config, without running the model;
`generate(..., return_dict_in_generate=True)` returns the same records measured. It
also predicts the device memory of the prefill and of the decode passes
(`PassMemory`; `slcompile.analysis.pass_memory.predict_pass_memory` lists what it
counts), which `slcompile.tune_generation` chooses options from.

`with generation(model, ...)` routes `model.generate(...)` through `generate` for
code that calls the model's own method.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch import nn

from slcompile.analysis.pass_memory import PassMemory
from slcompile.errors import OptionError
from slcompile.inference.executor import GenerationRun
from slcompile.inference.explain import GenerationExplanation, explain_generation
from slcompile.inference.options import (CALL_OPTIONS, ENGINE_OPTIONS, find_decoder_layers, generation_config,
                                         generation_plan, inferred_attention_mask)
from slcompile.inference.records import GenerationOutput, GenerationStep

__all__ = ["generate", "explain_generation", "find_decoder_layers", "generation", "GenerationOutput",
           "GenerationStep", "GenerationExplanation", "PassMemory"]

log = logging.getLogger(__name__)


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
    live_blocks: int = 2,
    do_sample: bool = False,
    temperature: float = 1.0,
    top_k: int | None = 50,
    top_p: float = 1.0,
    generator: torch.Generator | None = None,
    eos_token_id: int | Sequence[int] | None = None,
    pad_token_id: int | None = None,
    offload_dir: str | None = None,
    schedule: Any = "speedloader",
    backend: str | Callable = "inductor",
    progress: bool = True,
    return_dict_in_generate: bool = False,
) -> torch.Tensor | GenerationOutput:
    """Generates tokens like `model.generate(...)`, layer-major over sub-batches.

    Args:
        model: a Hugging Face decoder-only causal LM (`GenerationMixin`) with a KV cache.
        input_ids: the prompts, `(batch, length)`, left-padded when their lengths differ.
        attention_mask: `(batch, length)`, 0 at padding (None: inferred as
            `model.generate` infers it: 0 where `input_ids` holds `pad_token_id`,
            unless the pad token is also an EOS token; no padding when the pad
            token does not occur).
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
        live_blocks: the layers whose weights may be on the device at once, with
            `weights` off it: the one computing and the next `live_blocks - 1`,
            loading (each layer's load is issued `live_blocks - 1` layers ahead).
        do_sample: sample the next token (else greedy).
        temperature, top_k, top_p: Hugging Face's warpers, applied in that order
            when sampling (defaults: those of `GenerationConfig`).
        generator: the random generator sampling draws from (same seed, same tokens).
        eos_token_id: the end-of-sequence token(s) (default: the model's generation
            config's); a finished sequence gets `pad_token_id` from then on, and a
            decode sub-batch whose sequences have all finished is no longer computed.
        pad_token_id: default: the model's, else the first EOS token.
        offload_dir: parent directory of the nvme tier's files (default: temp dir).
        schedule: the policy that writes each pass's schedule: "speedloader" (each
            layer for every sub-batch before the next, `slcompile.schedules.policies.
            GENERATION`) or a `slcompile.schedules.Policy` whose build takes a
            `slcompile.schedules.generation.PassRequest`; each schedule is
            validated (`validate_pass`: PolicyError naming the first bad step).
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
    config = generation_config(num_subbatches, prefill_subbatches, weights, kv_cache, live_blocks, offload_dir,
                               schedule)
    plan = generation_plan(model, input_ids, attention_mask, config, max_new_tokens=max_new_tokens, do_sample=do_sample,
                 temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                 pad_token_id=pad_token_id)
    if attention_mask is None:
        attention_mask = inferred_attention_mask(input_ids, plan.pad_token_id, plan.eos_token_ids)
    with torch.no_grad():
        run = GenerationRun(model, plan, backend, generator, progress)
        sequences = run.run(input_ids, attention_mask)
    if return_dict_in_generate:
        return GenerationOutput(sequences, tuple(run.steps))
    return sequences


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
            num_subbatches, prefill_subbatches, weights, kv_cache, live_blocks,
            offload_dir, schedule, backend, progress.

    Inside the block `model.generate` takes `input_ids` (or `inputs`),
    `attention_mask`, `max_new_tokens` (default: the generation config's, else its
    `max_length` less the prompt), `do_sample`, `temperature`, `top_k`, `top_p`,
    `eos_token_id`, `pad_token_id` (defaults: `model.generation_config`'s or
    `generation_config=`'s), `return_dict_in_generate` and `use_cache`; any other
    argument raises OptionError.

    Raises:
        OptionError: an option that is not one of `generate`'s.
    """
    unknown = sorted(set(options) - set(ENGINE_OPTIONS))
    if unknown:
        raise OptionError(f"generation: {', '.join(unknown)} is not an option of slcompile.generate; use "
                          f"{', '.join(ENGINE_OPTIONS)} here and pass the others to model.generate")

    def routed(inputs=None, generation_config=None, **kwargs):
        config = generation_config if generation_config is not None else getattr(model, "generation_config", None)
        input_ids = kwargs.pop("input_ids", inputs)
        if not isinstance(input_ids, torch.Tensor):
            raise OptionError("model.generate inside slcompile.generation: pass the prompts as input_ids, "
                              "a (batch, length) tensor of token ids")
        call = {name: kwargs.pop(name, getattr(config, name, None)) for name in CALL_OPTIONS}
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
                              f"supported; use {', '.join(('attention_mask', *CALL_OPTIONS))}, or call "
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
