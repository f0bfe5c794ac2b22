"""The device memory of a generation pass (`PassMemory`), predicted from the
layer steps' and the tail's graphs traced on fake tensors and the pass's
transfers (`_MemoryModel`)."""

from __future__ import annotations

import dataclasses
import inspect
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch
from torch import nn

from slcompile.analysis.machine import MachineFacts
from slcompile.inference.capture import (
    _cache_windows,
    _capture,
    _layer_step,
    _layers_replaced,
    _pass_inputs,
    _position_ids,
    _rows,
)
from slcompile.inference.executor import HIDDEN_STORES_IN_FLIGHT
from slcompile.inference.options import _Plan
from slcompile.schedules.base import Schedule
from slcompile.schedules.generation import offloads_hidden

__all__ = ["PassMemory"]


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
      cache of the (layer, sub-batch) computing and the loaded segments of those
      whose loads the schedule issued before its step (each segment its own tensor,
      or one buffer for all where `reads_in_place`), and the stores still in flight
      (the positions they write);
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

    def __init__(self, model, plan: _Plan, batch: int, length: int, layer_loads: Sequence[Sequence[int]],
                 machine: MachineFacts, memo: dict, padded: bool = False):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.model, self.plan, self.batch, self.length, self.padded = model, plan, batch, length, padded
        self.layers = plan.layers
        self.granularity, self.overhead = max(1, machine.load_granularity), machine.load_overhead
        self.kv_moves = machine.copies(plan.kv_cache)
        # Each layer's fetched weights, padded as loads pad them; the rest rests on the device.
        self.weights = [sum(self._padded(nbytes) for nbytes in sizes) for sizes in layer_loads]
        self.resident = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(map(sum, layer_loads)) \
            + sum(b.numel() * b.element_size() for b in model.buffers())
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

    def pass_memory(self, schedule: Schedule, past: int, segments: Sequence[Sequence[int]] = (),
                    traced_past: int | None = None) -> PassMemory:
        """The device memory of the pass that follows `past` positions, walked in
        its `schedule` (the one `generate` walks): its stores in the order of its
        `store_kv.issue` steps, the caches loading at a layer step those whose
        `load_kv.issue` came before it, its hidden states on the KV tier where it
        has `spill.issue` steps.

        Args:
            schedule: the pass's schedule (`generation_pass`), of every sub-batch.
            past: positions each sequence has before the pass (0 for the prefill).
            segments: per layer, the positions of each stored segment the decode
                pass loads (on a tier that copies).
            traced_past: the past the capture and the layer steps are traced with
                (default: `past`).
        """
        from slcompile.runtime.kv import merged_segments

        plan, batch, n = self.plan, self.batch, len(self.layers)
        phase = schedule.steps[0].phase
        parts = plan.prefill_subbatches if phase == "prefill" else plan.num_subbatches
        size, decode_size = batch // parts, batch // plan.num_subbatches
        query = self.length if phase == "prefill" else 1
        # An offloading prefill captures, and computes the logits of, one sub-batch at a time.
        offloads = any(step.kind == "spill.issue" for step in schedule.steps)
        captured, other, hidden_bytes, steps, tail = self._traced(
            phase, past if traced_past is None else traced_past, size, size if offloads else batch)
        part_hidden = hidden_bytes if offloads else hidden_bytes // parts

        # 2. From the schedule: the stores' sources in the order they are issued
        # (the last `stores_in_flight` (layer, sub-batch)s' are alive), how many
        # precede each layer step, and the caches loading while it runs.
        issued, before, loading = [], {}, {}
        pending: set[tuple[int, int]] = set()
        for step in schedule.steps:
            if step.kind == "store_kv.issue" and self.kv_moves:
                if phase == "decode":
                    written = merged_segments(segments[step.block], 1, self._kept(step.block, past + 1))[1]
                    issued.append(self._cache_bytes(step.block, size, written))
                else:
                    issued.append(self._cache_bytes(step.block, decode_size, self._kept(step.block, self.length)))
            elif step.kind == "load_kv.issue":
                pending.add((step.block, step.subbatch))
            elif step.kind == "compute" and step.region == "block":
                before[step.block, step.subbatch] = len(issued)
                pending.discard((step.block, step.subbatch))
                loading[step.block, step.subbatch] = tuple(pending)

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
                ahead = sum(self._loaded_bytes(block, size, segments[block]) for block, _ in loading[index, part])
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
