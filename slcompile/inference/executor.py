"""The executor of `generate`: it walks each pass's schedule
(`slcompile.schedules.generation`) over the sub-batches, fetching weights, loading
and storing the KV cache and the prefill's hidden states on their tiers, and
records each pass (`GenerationStep`)."""

from __future__ import annotations

import inspect
import logging
import time
from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slcompile.analysis.memory import spills_hidden
from slcompile.inference.capture import (
    _grow_cache_layer,
    _cache_windows,
    _capture,
    _compiled,
    _mark_length_dynamic,
    _pass_inputs,
    _position_ids,
    _rows,
    _same_arguments,
    _split,
    _tail,
)
from slcompile.inference.options import _Plan
from slcompile.inference.records import GenerationStep
from slcompile.meta import format_tag
from slcompile.plans import StashPlan, StreamerPlan, new_name
from slcompile.runtime import activations, ops
from slcompile.runtime.stats import TransferKey
from slcompile.runtime.step import StepRuntime
from slcompile.runtime.tiers import Tier
from slcompile.runtime.weights import fetch_issue, fetch_weight, stored_key_for
from slcompile.schedules.base import Schedule
from slcompile.schedules.generation import PassRequest, generation_pass, offloads_hidden
from slcompile.vocabulary import SPILL_MARK, WeightKey, region_label

log = logging.getLogger(__name__)


def _fetched(weights_move: bool, streamed: Sequence[bool]) -> tuple[bool, ...]:
    """Per layer, whether a pass fetches its weights: it has streamed weights, and
    they rest on a tier that copies."""
    return tuple(weights_move and layer for layer in streamed)


class _HiddenStash:
    """The prefill's hidden states between layers, in the generation's activation
    stash (on the KV cache's tier), moved by what the ops of a compiled training
    graph's spills run, at the schedule's steps: `slc::stash` at a `spill.issue`,
    `slc::wait` at a `spill.wait` (the stored output is kept alive until then, as a
    graph keeps a wait's `keepalive`), `slc::unstash` at a `fill.issue` and
    `slc::unstash_wait` at a `fill.wait` (called as Python functions, without the
    dispatcher). A stored state is freed once taken (its stash token dropped)."""

    def __init__(self, stash: activations.ActivationStash):
        self.stash = stash
        self._stored: dict[tuple[int, int], tuple] = {}  # token, shape, dtype, device
        # Each store's token and source until its `spill.wait`, which may come just
        # after the state was taken (`fill.wait`): loaded back, it was stored.
        self._storing: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._loads: dict[tuple[int, int], torch.Tensor] = {}

    def store(self, block: int, sb: int, hidden: torch.Tensor) -> None:
        token = activations.stash(hidden, self.stash.graph_key(f"blk{block}.sb{sb}.{SPILL_MARK}.hidden"))
        self._stored[block, sb] = token, tuple(hidden.shape), hidden.dtype, hidden.device
        self._storing[block, sb] = token, hidden

    def wait(self, block: int, sb: int) -> None:
        token, source = self._storing.pop((block, sb))
        ops.wait(token, [source])

    def issue(self, block: int, sb: int) -> None:
        self._loads[block, sb] = activations.unstash(self._stored[block, sb][0])

    def take(self, block: int, sb: int) -> torch.Tensor:
        token, shape, dtype, device = self._stored.pop((block, sb))
        hidden = activations.unstash_wait(self._loads.pop((block, sb)), shape, dtype, device)
        del token  # the stored copy goes with it
        return hidden

    def close(self) -> None:
        """Waits for the transfers in flight and frees what is still stored."""
        for where in list(self._storing):
            self.wait(*where)
        for where in list(self._loads):
            self.take(*where)
        self._stored.clear()


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
        self.streamed: list[dict[str, WeightKey]] = [{} for _ in self.layers]
        self.runtime = self._start(offload=not self.engine.copies_nothing(Tier(plan.weights), Tier.DEVICE))
        self.weights_move = self._weights_move()
        # Per layer, once: each parameter's graph key where it is streamed, else the
        # tensor itself, and the buffers (walking the modules each pass costs more).
        self.layer_tensors = [
            ([(name, p, streamed[name].format()) if name in streamed else (name, p.detach(), None)
              for name, p in layer.named_parameters()], list(layer.named_buffers()))
            for layer, streamed in zip(self.layers, self.streamed)]
        # Whether one capture of all sub-batches gives each its layer arguments, per
        # phase (checked against a capture of one sub-batch alone on the first pass).
        self.shared_capture: dict[str, bool] = {}
        self.steps: list[GenerationStep] = []
        self.trace: list[str] = []
        self.stash: _HiddenStash | None = None  # the prefill's hidden states, while it runs

    def _start(self, offload: bool) -> StepRuntime:
        """The call's runtime objects, made from plans as a compiled step's are: a
        weight streamer where a layer has streamed weights (those already offloaded,
        by an earlier call or a compiled graph, and when `offload` those that only
        one layer uses, offloaded now), and an activation stash on the KV cache's
        tier where the prefill keeps its hidden states there. They go with the call."""
        plan = self.plan
        prefix = f"{plan.layers_name}."
        streamed = _streamed_parameters(self.model, plan, offload)
        streamer = StreamerPlan(new_name("w"), plan.weights, live_blocks=2, offload_dir=plan.offload_dir) \
            if any(streamed) else None
        spills = offloads_hidden(self.kv.appends, plan.prefill_subbatches, len(self.layers))
        stash = StashPlan(new_name("a"), plan.kv_cache, plan.offload_dir) if spills else None
        weights = []
        for index, params in enumerate(streamed):
            for name, param in params:
                full = f"{prefix}{index}.{name}"
                stored = stored_key_for(streamer.name, full, param)
                weights.append((stored, param, full))
                self.streamed[index][name] = streamer.graph_key(stored)
        runtime = StepRuntime(streamer, stash, None)
        runtime.start(weights)
        return runtime

    def _weights_move(self) -> bool:
        """Whether a fetched weight is copied (it rests on a tier other than the device's memory)."""
        from slcompile.runtime.weights import weight_home

        return any(not self.engine.copies_nothing(weight_home(param)[2], Tier.DEVICE)
                   for layer, names in zip(self.layers, self.streamed)
                   for name, param in layer.named_parameters() if name in names)

    # -- weights --------------------------------------------------------------
    # The weights move by what a compiled graph's `slc::fetch_issue` and
    # `slc::fetch_weight` run (called as Python functions, without the dispatcher).
    def _issue_weights(self, index: int) -> None:
        for _, _, key in self.layer_tensors[index][0]:
            if key is not None:
                fetch_issue(key)

    def _weights(self, index: int) -> dict[str, torch.Tensor]:
        params, buffers = self.layer_tensors[index]
        tensors = {name: p if key is None else fetch_weight(p, key) for name, p, key in params}
        tensors.update(buffers)
        return tensors

    def _request(self, phase: str, parts: list[tuple[int, int, int]], stores: bool) -> PassRequest:
        n = len(self.layers)
        return PassRequest(phase, tuple(sb for sb, _, _ in parts),
                           _fetched(self.weights_move, [bool(names) for names in self.streamed]), self.kv.appends,
                           stores, (self.batch // self.plan.prefill_subbatches, self.batch // self.plan.num_subbatches),
                           phase == "prefill" and offloads_hidden(self.kv.appends, len(parts), n))

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

    def _forward(self, schedule: Schedule, inputs: dict, parts: list[tuple[int, int, int]], batch: int,
                 cache, new_cache: _NewCache | None) -> torch.Tensor:
        """Runs one pass by walking its `schedule` (`generation_pass`) over the
        `parts` (sub-batch, first row, rows) of the `batch` rows of `inputs`; the last
        position's logits of those rows. `new_cache` holds each step's new cache
        from its layer step to its `store_kv.issue` step (None: the pass keeps none)."""
        from slcompile.runtime.stats import compute_region

        n, phase = len(self.layers), schedule.steps[0].phase
        where = {sb: (position, start, rows) for position, (sb, start, rows) in enumerate(parts)}
        stash = None
        if spills_hidden(schedule):
            # Each sub-batch is captured just before each layer step (what a capture
            # makes, such as masks, is not held for every sub-batch through the
            # pass) and its logits computed just after its last: nothing of the
            # whole batch is held at once.
            stash = self.stash = _HiddenStash(self.runtime.stash)
        arguments, shared = None, False
        hidden: dict[int, Any] = {}  # sub-batch -> its input to its next layer step
        outputs: dict[int, Any] = {}  # sub-batch -> its last layer's output, for the tail
        logits = None
        layouts: list[tuple[int, int, torch.dtype]] = []
        tensors, current = None, None  # the weights of the layer being computed
        added = 0
        for step in schedule.steps:
            kind, block, sb = step.kind, step.block, step.subbatch
            if kind == "fetch.issue":
                self._issue_weights(block)
            elif kind == "fetch.wait":
                tensors = None
                tensors, current = self._weights(block), block
            elif kind == "load_kv.issue":
                self.kv.issue(block, sb)
            elif kind == "store_kv.issue":
                new_cache.store(block, sb)
            elif kind == "fill.issue":
                stash.issue(block, sb)
            elif kind == "spill.issue":
                stash.store(block, sb, hidden.pop(sb))
            elif kind == "spill.wait":
                stash.wait(block, sb)
            elif kind == "fill.wait":
                hidden[sb] = stash.take(block, sb)
            elif kind != "compute":
                raise ValueError(f"generate: a generation pass has no step {step.text()!r}")
            elif step.region == "prefix":
                arguments, shared = self._arguments(phase, inputs, parts, batch)
                hidden = {sb: calls[0][self.hidden_name] for (sb, _, _), calls in zip(parts, arguments)}
            elif step.region == "suffix" and sb is not None:
                _, start, rows = where[sb]
                part = self._tail(_rows(inputs, start, rows, batch), outputs.pop(sb))
                if logits is None:
                    logits = part.new_empty((batch, part.shape[-1]))
                logits[start:start + rows] = part
                del part
            elif step.region == "suffix":
                logits = self._tails(inputs, parts, batch, [outputs.pop(sb) for sb, _, _ in parts], shared)
            else:
                position, start, rows = where[sb]
                if current != block:
                    tensors = None
                    tensors, current = self._weights(block), block
                if stash is not None:
                    call = self._capture(_rows(inputs, start, rows, batch))[block]
                    embedded = call.pop(self.hidden_name)  # the layer's input past the first: filled
                    if block == 0:
                        hidden[sb] = embedded
                    del embedded
                else:
                    call = arguments[position][block]
                kwargs = dict(call)
                kwargs[self.hidden_name] = hidden.pop(sb)
                kwargs.pop(self.plan.layer_cache_argument)
                window = self.windows[block]
                if phase == "prefill":
                    with compute_region(region_label(f"blk{block}.sb{sb}", "prefill")):
                        output, keys, values = self.prefill_step(self.templates[block], tensors, window, kwargs,
                                                                 self.plan.layer_cache_argument)
                else:
                    past = self.kv.take(block, sb)
                    _mark_length_dynamic(past, kwargs)
                    with compute_region(region_label(f"blk{block}.sb{sb}", "decode")):
                        output, keys, values = self.decode_step(self.templates[block], tensors, *past, window,
                                                                kwargs, self.plan.layer_cache_argument)
                    del past
                computed = output if isinstance(output, torch.Tensor) else output[0]
                added = computed.shape[-2]
                if block == n - 1:
                    outputs[sb] = output
                else:
                    hidden[sb] = computed
                del computed
                if new_cache is not None:
                    new_cache.collect(block, position, sb, keys, values, added)
                if len(layouts) == block:
                    layouts.append((keys.shape[1], keys.shape[-1], keys.dtype))
                # The layer's input, past and new cache are dropped now, not when the
                # next sub-batch overwrites them (the memory model counts one of each).
                del kwargs, call, keys, values, output
        tensors = None
        if new_cache is not None and new_cache.ready:
            raise RuntimeError(f"generate: the {phase} schedule stores no cache for "
                               f"{', '.join(format_tag('block', *where) for where in new_cache.ready)}")
        # The model's cache object learns the new shapes (values stay on the tier),
        # after the pass: captures during it see the cache as it was before.
        for layer, (heads, head_dim, dtype) in zip(cache.layers, layouts):
            _grow_cache_layer(layer, (self.batch, heads, added, head_dim), dtype)
        self.kv.flush()
        if stash is not None:
            stash.close()
            self.stash = None
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
                schedule = generation_pass(self._request(phase, parts, stores))
                new_cache = _NewCache(self.kv, parts[0][2], size if phase == "prefill" else None) if stores else None

                def of_active(tensor):
                    return tensor if rows is None or tensor is None else tensor[rows]

                inputs = _pass_inputs(model, plan, of_active(sequences), cache, of_active(attention_mask),
                                      of_active(position_ids), step == 0)
                before = dict(runtime_stats().cumulative.bytes_moved)
                began = time.perf_counter()
                computed = self._forward(schedule, inputs, parts, len(parts) * parts[0][2], cache, new_cache)
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
            if self.stash is not None:
                self.stash.close()
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
