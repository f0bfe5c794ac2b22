"""The executor of `generate`: the token loop, in which each pass's schedule
(`slcompile.schedules.generation`) is lowered to an FX graph
(`slcompile.inference.pass_graph`) that runs the layers over the sub-batches,
fetching weights, loading and storing the KV cache and the prefill's hidden states
on their tiers; it records each pass (`GenerationStep`)."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slcompile.inference.capture import (
    _grow_cache_layer,
    _cache_windows,
    _capture,
    _compiled,
    _pass_inputs,
    _position_ids,
    _rows,
    _same_arguments,
    _split,
    _tail,
)
from slcompile.inference.options import _Plan
from slcompile.inference.pass_graph import PassGraph, PassLayout, lower_pass
from slcompile.inference.records import GenerationStep
from slcompile.meta import format_tag
from slcompile.plans import StashPlan, StreamerPlan, new_name
from slcompile.runtime.stats import TransferKey
from slcompile.runtime.step import StepRuntime
from slcompile.runtime.storage.tiers import Tier
from slcompile.runtime.weights import stored_key_for
from slcompile.schedules.base import Schedule
from slcompile.schedules.generation import PassRequest, offloads_hidden
from slcompile.vocabulary import WeightKey

log = logging.getLogger(__name__)


def _fetched(weights_move: bool, streamed: Sequence[bool]) -> tuple[bool, ...]:
    """Per layer, whether a pass fetches its weights: it has streamed weights, and
    they rest on a tier that copies."""
    return tuple(weights_move and layer for layer in streamed)


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


def _bytes_moved_since(before: Mapping[TransferKey, int]) -> dict[TransferKey, int]:
    from slcompile.runtime.stats import runtime_stats

    after = runtime_stats().cumulative.bytes_moved
    return {key: n - before.get(key, 0) for key, n in after.items() if n - before.get(key, 0)}


class GenerationRun:
    """One call of `generate`: the plan, the tiers, the cache and the records."""

    def __init__(self, model, plan: _Plan, backend, generator, progress):
        from transformers import DynamicCache

        from slcompile.runtime.storage.engine import get_engine
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
        self.streamed: list[dict[str, WeightKey]] = [{} for _ in self.layers]
        self.runtime = self._start(offload=not self.engine.copies_nothing(Tier(plan.weights), Tier.DEVICE))
        self.weights_move = self._weights_move()
        # Per layer, once: (name, tensor, graph key where it is streamed) of each
        # parameter, then each buffer (walking the modules each pass costs more).
        self.layer_tensors = tuple(
            tuple((name, p, streamed[name].format()) if name in streamed else (name, p.detach(), None)
                  for name, p in layer.named_parameters())
            + tuple((name, b, None) for name, b in layer.named_buffers())
            for layer, streamed in zip(self.layers, self.streamed))
        self.passes: dict[PassRequest, tuple[Schedule, PassGraph]] = {}
        # Whether one capture of all sub-batches gives each its layer arguments, per
        # phase (checked against a capture of one sub-batch alone on the first pass).
        self.shared_capture: dict[str, bool] = {}
        self.steps: list[GenerationStep] = []

    def _start(self, offload: bool) -> StepRuntime:
        """The call's runtime objects, made from plans as a compiled step's are: a
        weight streamer where a layer has streamed weights (those already offloaded,
        by an earlier call or a compiled graph, and when `offload` those that only
        one layer uses, offloaded now), and an activation stash on the KV cache's
        tier where the prefill keeps its hidden states there. They go with the call."""
        plan = self.plan
        prefix = f"{plan.layers_name}."
        streamed = _streamed_parameters(self.model, plan, offload)
        streamer = StreamerPlan(new_name("w"), plan.weights, live_blocks=plan.live_blocks, offload_dir=plan.offload_dir) \
            if any(streamed) else None
        spills = offloads_hidden(self.kv.appends, plan.prefill_subbatches, len(self.layers))
        stash = StashPlan(new_name("a"), plan.kv_cache, plan.offload_dir) if spills else None
        blocks = []
        for index, params in enumerate(streamed):
            blocks.append([])
            for name, param in params:
                full = f"{prefix}{index}.{name}"
                stored = stored_key_for(streamer.name, full, param)
                blocks[-1].append((stored, param, full))
                self.streamed[index][name] = streamer.graph_key(stored)
        runtime = StepRuntime(streamer, stash, None)
        runtime.start(blocks)
        return runtime

    def _weights_move(self) -> bool:
        """Whether a fetched weight is copied (it rests on a tier other than the device's memory)."""
        from slcompile.runtime.weights import weight_home

        return any(not self.engine.copies_nothing(weight_home(param)[2], Tier.DEVICE)
                   for layer, names in zip(self.layers, self.streamed)
                   for name, param in layer.named_parameters() if name in names)

    def _request(self, phase: str, parts: list[tuple[int, int, int]], stores: bool) -> PassRequest:
        n = len(self.layers)
        return PassRequest(phase, tuple(sb for sb, _, _ in parts),
                           _fetched(self.weights_move, [bool(names) for names in self.streamed]), self.kv.appends,
                           stores, (self.batch // self.plan.prefill_subbatches, self.batch // self.plan.num_subbatches),
                           phase == "prefill" and offloads_hidden(self.kv.appends, len(parts), n),
                           self.plan.live_blocks)

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

    def _pass(self, request: PassRequest, parts: list[tuple[int, int, int]]) -> tuple[Schedule, PassGraph]:
        """The schedule of a pass (the plan's policy's, validated) and its FX graph (`lower_pass`),
        lowered once per request in a call."""
        if request not in self.passes:
            schedule = self.plan.policy(request)
            stash = self.runtime.stash.name if request.spill_hidden else None
            self.passes[request] = schedule, lower_pass(schedule, PassLayout(tuple(parts), self.layer_tensors, stash))
        return self.passes[request]

    def _forward(self, graph: PassGraph, inputs: dict, cache, new_cache: _NewCache | None) -> torch.Tensor:
        """Runs one pass's graph on `inputs`; the last position's logits of its rows.
        `new_cache` holds each step's new cache from its layer step to its
        `store_kv.issue` step (None: the pass keeps none)."""
        logits, layouts = graph(self, inputs, self.kv, new_cache)
        if new_cache is not None and new_cache.ready:
            raise RuntimeError(f"generate: the pass's schedule stores no cache for "
                               f"{', '.join(format_tag('block', *where) for where in new_cache.ready)}")
        # The model's cache object learns the new shapes (values stay on the tier),
        # after the pass: captures during it see the cache as it was before.
        for layer, (heads, head_dim, dtype, added) in zip(cache.layers, layouts):
            _grow_cache_layer(layer, (self.batch, heads, added, head_dim), dtype)
        self.kv.flush()
        return logits

    def _tails(self, inputs: dict, parts: list[tuple[int, int, int]], batch: int, outputs: list, shared: bool):
        """The logits of every part from their last layer's outputs: one tail for the
        whole batch where the parts share one capture, else one per part."""
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
                else:
                    rows = None if len(active) == k else torch.cat(
                        [torch.arange(sb * size, (sb + 1) * size, device=device) for sb in active])
                    parts = [(sb, position * size, size) for position, sb in enumerate(active)]
                # No pass reads the cache of the last one.
                stores = step < plan.max_new_tokens - 1
                schedule, graph = self._pass(self._request(phase, parts, stores), parts)
                new_cache = _NewCache(self.kv, parts[0][2], size if phase == "prefill" else None) if stores else None

                def of_active(tensor):
                    return tensor if rows is None or tensor is None else tensor[rows]

                inputs = _pass_inputs(model, plan, of_active(sequences), cache, of_active(attention_mask),
                                      of_active(position_ids), step == 0)
                before = dict(runtime_stats().cumulative.bytes_moved)
                began = time.perf_counter()
                computed = self._forward(graph, inputs, cache, new_cache)
                self.steps.append(GenerationStep(phase, tuple(sb for sb, _, _ in parts), schedule,
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
            self.kv.close()
        return sequences


class _NewCache:
    """Each layer step's new cache from the step to its `store_kv.issue` step, by
    decode sub-batch (the cache's owner). A decode step's is its own; a prefill
    part's rows go to the decode sub-batches that hold them, whole where the part
    holds all of a decode sub-batch's rows, else copied into that sub-batch's rows
    (`KVStore.empty_rows`) until they are all there."""

    def __init__(self, kv, part_rows: int, owner_rows: int | None):
        self.kv, self.part_rows, self.owner_rows = kv, part_rows, owner_rows
        self.ready: dict[tuple[int, int], Any] = {}
        self.filling: dict[tuple[int, int], Any] = {}

    def collect(self, block: int, position: int, subbatch: int, keys, values, new: int) -> None:
        """Takes the cache that the step of (`block`, `subbatch`), the pass's
        `position`-th part, made; its last `new` positions are new."""
        if self.owner_rows is None:
            self.ready[block, subbatch] = keys, values, new
            return
        first = position * self.part_rows
        row = first
        while row < first + self.part_rows:
            owner = row // self.owner_rows
            end = min((owner + 1) * self.owner_rows, first + self.part_rows)
            if end - row == self.owner_rows:
                whole = end - row == keys.shape[0]
                self.ready[block, owner] = (keys if whole else keys.narrow(0, row - first, end - row),
                                            values if whole else values.narrow(0, row - first, end - row), new)
            else:
                if (block, owner) not in self.filling:
                    self.filling[block, owner] = self.kv.empty_rows(keys, values, self.owner_rows)
                if self.filling[block, owner].add(keys.narrow(0, row - first, end - row),
                                                  values.narrow(0, row - first, end - row)):
                    self.ready[block, owner] = self.filling.pop((block, owner))
            row = end

    def store(self, block: int, owner: int) -> None:
        """Issues the store of (`block`, `owner`)'s cache, complete by now."""
        item = self.ready.pop((block, owner))
        if isinstance(item, tuple):
            self.kv.store(block, owner, *item)
        else:
            self.kv.store_rows(block, owner, item)


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
