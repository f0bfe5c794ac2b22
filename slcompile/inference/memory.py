"""The sizes of what the passes of a generation make, traced on fake tensors
(`_MemoryModel`), for the memory model of generation passes
(`slcompile.analysis.pass_memory.predict_pass_memory`), which walks each pass's
lowered graph."""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from slcompile.analysis.machine import MachineFacts
from slcompile.analysis.pass_memory import (
    GenerationSizes,
    PassMemory,
    TracedPass,
    pass_phase,
    predict_pass_memory,
    spills_hidden,
)
from slcompile.inference.capture import (
    _cache_windows,
    _capture,
    _layer_step,
    _layers_replaced,
    _pass_inputs,
    _position_ids,
    _rows,
)
from slcompile.inference.options import _Plan
from slcompile.schedules.generation import offloads_hidden

__all__: list[str] = []


def _kv_layout(model: nn.Module, layer: nn.Module) -> tuple[int, int, torch.dtype]:
    """A layer's cache layout, from the model's config: its key-value heads, head
    size, and the layer's floating-point type."""
    config = model.config
    heads = getattr(config, "num_attention_heads", None)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    dtype = next((p.dtype for p in layer.parameters() if p.is_floating_point()), torch.get_default_dtype())
    return kv_heads, head_dim, dtype


def _kv_row_bytes(model: nn.Module, layers: Sequence[nn.Module]) -> list[int]:
    """Per layer, the bytes of one position of one sequence's keys (as many again
    for its values): key-value heads times head size in the layer's type."""
    rows = []
    for layer in layers:
        kv_heads, head_dim, dtype = _kv_layout(model, layer)
        rows.append(kv_heads * head_dim * dtype.itemsize)
    return rows


def _hidden_row_bytes(model: nn.Module, layers: Sequence[nn.Module]) -> int:
    """The bytes of one position of one sequence's hidden states between layers:
    the model's hidden size in the layers' floating-point type."""
    dtype = next((p.dtype for p in layers[0].parameters() if p.is_floating_point()), torch.get_default_dtype())
    return model.config.hidden_size * dtype.itemsize


class _MemoryModel:
    """The device memory of the passes of one generation, for `explain_generation`:
    the sizes of what each pass makes, traced on fake tensors as `generate` runs
    them (the capture, each compiled layer step, the tail), handed with the
    generation's other sizes to `slcompile.analysis.pass_memory.predict_pass_memory`,
    which walks the pass's lowered graph.

    A layer step's and the tail's temporaries are the peaks of the values their
    ATen graphs make, from the graphs' lifetimes, as `aot_eager` runs them
    (Inductor's fused kernels hold less: an upper bound there).
    """

    def __init__(self, model, plan: _Plan, batch: int, length: int, layer_loads: Sequence[Sequence[int]],
                 machine: MachineFacts, memo: dict, padded: bool = False):
        from torch._subclasses.fake_tensor import FakeTensorMode

        self.model, self.plan, self.batch, self.length, self.padded = model, plan, batch, length, padded
        self.layers = plan.layers
        resident = sum(p.numel() * p.element_size() for p in model.parameters()) - sum(map(sum, layer_loads)) \
            + sum(b.numel() * b.element_size() for b in model.buffers())
        self.windows = _cache_windows(model, len(self.layers))
        head = model.get_output_embeddings()
        self.sizes = GenerationSizes(
            batch=batch, length=length, num_subbatches=plan.num_subbatches,
            prefill_subbatches=plan.prefill_subbatches, resident=resident,
            layer_loads=tuple(tuple(sizes) for sizes in layer_loads),
            key_bytes=tuple(_kv_row_bytes(model, self.layers)),
            caps=tuple(None if window is None else window - 1 for window in self.windows),
            vocab=head.weight.shape[0] if head is not None else model.config.vocab_size,
            kv_tier=plan.kv_cache, machine=machine)
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

    def _grow(self, cache, sequences: int, positions: int) -> None:
        for index, layer in enumerate(cache.layers[:len(self.layers)]):
            heads, head_dim, dtype = _kv_layout(self.model, self.layers[index])
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
            heads, head_dim, dtype = _kv_layout(self.model, self.layers[group])
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
        steps = [self._step_peak(index, size, self.sizes.kept(index, past), calls[index])
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
        offloads = phase == "prefill" and offloads_hidden(self.sizes.kv_moves, parts, len(self.layers))
        inputs, calls, _, _ = self._captured(phase, past, size if offloads else self.batch)
        steps = []
        for index in range(len(self.layers)):
            call = calls[index]
            self._step_peak(index, size, self.sizes.kept(index, past), call)
            steps.append(self.costs[(self.group[index], size, call[self.hidden_name].shape[-2],
                                     self.sizes.kept(index, past))])
        hidden = calls[0][self.hidden_name]
        self._tail_peak(inputs, hidden)
        return steps, self.costs[("tail", tuple(hidden.shape))]

    def pass_memory(self, graph, past: int, segments: Sequence[Sequence[int]] = (),
                    traced_past: int | None = None) -> PassMemory:
        """The device memory of the pass that follows `past` positions, walked in
        its lowered graph (the one `generate` runs) by `predict_pass_memory`.

        Args:
            graph: the pass's `PassGraph` (`lower_pass`), of every sub-batch.
            past: positions each sequence has before the pass (0 for the prefill).
            segments: per layer, the positions of each stored segment the decode
                pass loads (on a tier that copies).
            traced_past: the past the capture and the layer steps are traced with
                (default: `past`).
        """
        phase = pass_phase(graph)
        parts = self.plan.prefill_subbatches if phase == "prefill" else self.plan.num_subbatches
        size = self.batch // parts
        # An offloading prefill captures, and computes the logits of, one sub-batch at a time.
        offloads = spills_hidden(graph)
        captured, other, hidden, steps, tail = self._traced(
            phase, past if traced_past is None else traced_past, size, size if offloads else self.batch)
        traced = TracedPass(captured, other, hidden, tuple(steps), tail,
                            self._input_bytes(phase, past) if offloads else 0)
        return predict_pass_memory(graph, self.sizes, traced, past, segments)
