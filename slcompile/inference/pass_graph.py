"""One generation pass lowered to an FX graph of its schedule's steps.

`lower_pass(schedule, layout)` writes a `torch.fx.Graph` (in a `PassGraph`) with one
node (or a few) per step of a pass's `Schedule` (`slcompile.schedules.generation`), in the
schedule's order; a call of `generate` runs it, as a compiled training step runs
the graph its schedule was lowered to. The weights and the prefill's hidden states
move by the `slc::` ops of training's graphs, which call their implementations
directly (`slcompile.runtime.ops.bind_implementations`: the graph is run as it is,
neither traced nor differentiated):

    fetch.issue blkB      slc::fetch_issue(key), one per streamed weight of layer B
    fetch.wait blkB       slc::fetch_weight(param, key), one per streamed weight
    spill.issue blkB.sbS  slc::stash(hidden, key) -> stash token
    spill.wait blkB.sbS   slc::wait(stash token, [hidden])
    fill.issue blkB.sbS   slc::unstash(stash token) -> load token
    fill.wait blkB.sbS    slc::unstash_wait(load token, size, dtype, device)

The KV cache moves by the call's `KVStore` (`kv.issue(B, S)` at a `load_kv.issue`;
the layer step takes its cache) and the pass's new cache (`new_cache.store(B, S)` at
a `store_kv.issue`, `new_cache.collect(...)` after each layer step). Compute steps
call the functions below with the call (`run`, a `GenerationRun`) as their first
argument: the captures of the model's forward, the compiled layer steps and the
tail.

A value is freed after its last use in the graph (FX's generated code drops it),
which is where the memory model (`slcompile.analysis.pass_memory`) counts it gone: a
layer's weights after its last step, a layer's input and its new cache after its
step, a spilled output after its `spill.wait`. The memory and time models read the
graph, node by node in order: each node that moves data or computes carries its
place (`SlcMeta`: a layer step's block and sub-batch, a transfer's and, as its
role, the `slc::` op it calls, the prefix, a tail); `PassLayout.placeholders` gives
a graph to read without the model's tensors.

The graph's signature is `(run, inputs, kv, new_cache)`; it returns the pass's
logits (the last position's, float32, of every row of the pass) and, per layer,
the layout of its cache (heads, head_dim, dtype, positions added).
"""

from __future__ import annotations

import dataclasses
import operator
import types
from collections.abc import Sequence

import torch
import torch.fx

from slcompile.inference.capture import _mark_length_dynamic, _rows
from slcompile.meta import SlcMeta, format_tag, set_slc_meta
from slcompile.runtime import ops
from slcompile.runtime.stats import compute_region
from slcompile.schedules.base import Schedule
from slcompile.vocabulary import SPILL_MARK, StashKey, region_label

__all__ = ["PassLayout", "PassGraph", "lower_pass"]


@dataclasses.dataclass(frozen=True)
class PassLayout:
    """What lowering a pass needs besides its schedule (plain data).

    Attributes:
        parts: (sub-batch, first row, rows) of each part of the pass's rows, in order.
        tensors: per layer, (name, tensor, graph key of its streamed weight or None)
            of each parameter, then (name, tensor, None) of each buffer.
        stash: the name of the activation stash spilled hidden states go to (None:
            the pass spills none).
    """

    parts: tuple[tuple[int, int, int], ...]
    tensors: tuple[tuple[tuple[str, torch.Tensor, str | None], ...], ...]
    stash: str | None = None

    @property
    def batch(self) -> int:
        return sum(rows for _, _, rows in self.parts)

    @classmethod
    def placeholders(cls, parts: Sequence[tuple[int, int, int]], streamed: Sequence[int],
                     spills: bool = False) -> PassLayout:
        """A layout for a pass graph that is read, not run (the memory and time
        models): `parts` as above, `streamed[B]` streamed weights of layer B, each
        an empty meta tensor under the key `blkB.wI`, and a stash named "a" where
        the pass `spills`."""
        empty = torch.empty(0, device="meta")
        tensors = tuple(tuple((f"w{index}", empty, f"{format_tag('block', block, None)}.w{index}")
                              for index in range(count)) for block, count in enumerate(streamed))
        return cls(tuple(parts), tensors, "a" if spills else None)


# -- what the compute steps call ----------------------------------------------------
def capture_pass(run, phase: str, inputs: dict, parts, batch: int):
    """prefix: each part's arguments of every layer, and whether one capture of the
    whole batch gave them (`GenerationRun._arguments`)."""
    return run._arguments(phase, inputs, list(parts), batch)


def capture_part(run, inputs: dict, start: int, rows: int, batch: int, block: int):
    """An offloading prefill's layer step: the arguments of layer `block` for rows
    `start:start+rows`, captured just before the step, without the layer's input;
    and that input where the layer is the first (its embedding), else None."""
    call = run._capture(_rows(inputs, start, rows, batch))[block]
    embedded = call.pop(run.hidden_name)
    return call, embedded if block == 0 else None


def layer_input(run, calls: Sequence[dict]) -> torch.Tensor:
    """A part's input to the first layer, from its captured arguments."""
    return calls[0][run.hidden_name]


def layer_weights(names: tuple[str, ...], *tensors: torch.Tensor) -> dict[str, torch.Tensor]:
    """fetch.wait: the tensors a layer step computes with, by name."""
    return dict(zip(names, tensors))


def layer_step(run, phase: str, block: int, subbatch: int, weights: dict, hidden, call: dict):
    """One (layer, sub-batch) step; (its output, the output's hidden states, the
    layer's keys and values). A decode step takes its cache from the `KVStore`."""
    window, template, cache_argument = run.windows[block], run.templates[block], run.plan.layer_cache_argument
    kwargs = dict(call)
    kwargs[run.hidden_name] = hidden
    del hidden
    kwargs.pop(cache_argument)
    if phase == "prefill":
        with compute_region(region_label(format_tag("block", block, subbatch), "prefill")):
            output, keys, values = run.prefill_step(template, weights, window, kwargs, cache_argument)
    else:
        past = run.kv.take(block, subbatch)
        _mark_length_dynamic(past, kwargs)
        with compute_region(region_label(format_tag("block", block, subbatch), "decode")):
            output, keys, values = run.decode_step(template, weights, *past, window, kwargs, cache_argument)
        del past
    del kwargs
    return output, output if isinstance(output, torch.Tensor) else output[0], keys, values


def cache_layout(keys: torch.Tensor, hidden: torch.Tensor) -> tuple[int, int, torch.dtype, int]:
    """A layer's cache layout and the positions the pass added to it."""
    return keys.shape[1], keys.shape[-1], keys.dtype, hidden.shape[-2]


def tail_part(run, inputs: dict, start: int, rows: int, batch: int, output):
    """suffix.sbS: the logits of one part from its last layer's output."""
    return run._tail(_rows(inputs, start, rows, batch), output)


def put_rows(logits: torch.Tensor | None, part: torch.Tensor, start: int, batch: int) -> torch.Tensor:
    """Writes one part's logits into the pass's (made at the first part)."""
    if logits is None:
        logits = part.new_empty((batch, part.shape[-1]))
    logits[start:start + part.shape[0]] = part
    return logits


def tails(run, inputs: dict, parts, batch: int, shared: bool, *outputs):
    """suffix: the logits of every part from their last layer's outputs."""
    return run._tails(inputs, list(parts), batch, list(outputs), shared)


# -- the lowering -------------------------------------------------------------------
def _moves(block: int, subbatch: int | None = None, op: str = "transfer") -> SlcMeta:
    """The place of a node that moves a layer's weights, or a (layer, sub-batch)'s
    cache or hidden states; its role names the `slc::` op it calls (its target is
    bound to the op's implementation), or is "transfer" for the KV store's methods."""
    return SlcMeta("block", block, subbatch, role=op)


class _Lowering:
    def __init__(self, schedule: Schedule, layout: PassLayout):
        self.schedule, self.layout = schedule, layout
        self.graph = torch.fx.Graph()
        self.attributes: dict[str, torch.Tensor] = {}
        self.phase = schedule.steps[0].phase
        graph = self.graph
        self.run, self.inputs = graph.placeholder("run"), graph.placeholder("inputs")
        self.kv, self.new_cache = graph.placeholder("kv"), graph.placeholder("new_cache")
        self.position = {sb: position for position, (sb, _, _) in enumerate(layout.parts)}
        self.weights: dict[int, torch.fx.Node] = {}
        self.calls: torch.fx.Node | None = None  # the prefix's arguments of every part
        self.shared: torch.fx.Node | None = None
        self.hidden: dict[int, torch.fx.Node] = {}  # sub-batch -> its input to its next layer
        self.outputs: dict[int, torch.fx.Node] = {}  # sub-batch -> its last layer's output
        self.stored: dict[tuple[int, int], tuple[torch.fx.Node, torch.fx.Node, tuple]] = {}
        self.loads: dict[tuple[int, int], torch.fx.Node] = {}
        self.waited: set[tuple[int, int]] = set()  # spills waited for
        self.filled: set[tuple[int, int]] = set()  # spills loaded back and waited for
        self.layouts: list[torch.fx.Node] = []
        self.logits: torch.fx.Node | None = None
        # Whether the pass keeps its new cache (every layer step's is collected).
        self.stores = any(step.kind == "store_kv.issue" for step in schedule.steps)

    def call(self, target, args: tuple, name: str | None = None, place: SlcMeta | None = None) -> torch.fx.Node:
        node = self.graph.create_node("call_function", target, args, name=name)
        if place is not None:
            set_slc_meta(node, place)
        return node

    def method(self, name: str, args: tuple, place: SlcMeta) -> torch.fx.Node:
        node = self.graph.call_method(name, args)
        set_slc_meta(node, place)
        return node

    def attribute(self, block: int, name: str, tensor: torch.Tensor) -> torch.fx.Node:
        target = f"blk{block}.{name}"
        self.attributes[target] = tensor
        return self.graph.get_attr(target)

    def fetch_issue(self, block: int) -> None:
        for _, _, key in self.layout.tensors[block]:
            if key is not None:
                self.call(torch.ops.slc.fetch_issue.default, (key,), place=_moves(block, None, "fetch_issue"))

    def fetch_wait(self, block: int) -> None:
        names, values = [], []
        for name, tensor, key in self.layout.tensors[block]:
            value = self.attribute(block, name, tensor)
            if key is not None:
                value = self.call(torch.ops.slc.fetch_weight.default, (value, key),
                                  place=_moves(block, None, "fetch_weight"))
            names.append(name)
            values.append(value)
        self.weights[block] = self.call(layer_weights, (tuple(names), *values), f"w_blk{block}")

    def stash_key(self, block: int, sb: int) -> str:
        return StashKey(self.layout.stash, f"{format_tag('block', block, sb)}.{SPILL_MARK}.hidden").format()

    def compute(self, block: int, sb: int) -> None:
        parts, n = self.layout.parts, len(self.layout.tensors)
        _, start, rows = parts[self.position[sb]]
        if block not in self.weights:  # weights that are not copied: no fetch steps
            self.fetch_wait(block)
        if self.calls is None:  # an offloading prefill: captured just before the step
            captured = self.call(capture_part, (self.run, self.inputs, start, rows, self.layout.batch, block))
            call = self.call(operator.getitem, (captured, 0))
            if block == 0:
                self.hidden[sb] = self.call(operator.getitem, (captured, 1), f"h_blk0_sb{sb}")
        else:
            call = self.call(operator.getitem, (self.call(operator.getitem, (self.calls, self.position[sb])), block))
        if sb not in self.hidden:
            raise ValueError(f"generate: the {self.phase} schedule has no step fill.wait "
                             f"{format_tag('block', block - 1, sb)} before {format_tag('block', block, sb)}")
        step = self.call(layer_step, (self.run, self.phase, block, sb, self.weights[block],
                                      self.hidden.pop(sb), call), f"blk{block}_sb{sb}", SlcMeta("block", block, sb))
        output = self.call(operator.getitem, (step, 1), f"out_blk{block}_sb{sb}")
        if block == n - 1:
            self.outputs[sb] = self.call(operator.getitem, (step, 0))
        else:
            self.hidden[sb] = output
        keys, values = self.call(operator.getitem, (step, 2)), self.call(operator.getitem, (step, 3))
        if len(self.layouts) == block:
            self.layouts.append(self.call(cache_layout, (keys, output)))
        if self.stores:
            added = self.call(operator.getitem, (self.layouts[block], 3))
            self.method("collect", (self.new_cache, block, self.position[sb], sb, keys, values, added),
                        _moves(block, sb))

    def lower(self) -> PassGraph:
        steps = self.schedule.steps
        batch, parts = self.layout.batch, self.layout.parts
        for step in steps:
            kind, block, sb = step.kind, step.block, step.subbatch
            if kind == "fetch.issue":
                self.fetch_issue(block)
            elif kind == "fetch.wait":
                self.fetch_wait(block)
            elif kind == "load_kv.issue":
                self.method("issue", (self.kv, block, sb), _moves(block, sb))
            elif kind == "store_kv.issue":
                self.method("store", (self.new_cache, block, sb), _moves(block, sb))
            elif kind == "spill.issue":
                source = self.hidden.pop(sb)
                token = self.call(torch.ops.slc.stash.default, (source, self.stash_key(block, sb)),
                                  f"stash_blk{block}_sb{sb}", _moves(block, sb, "stash"))
                meta = (self.call(getattr, (source, "shape")), self.call(getattr, (source, "dtype")),
                        self.call(getattr, (source, "device")))
                self.stored[block, sb] = token, source, meta
            elif kind == "spill.wait":
                token, source, _ = self.stored[block, sb]
                self.call(torch.ops.slc.wait.default, (token, [source]), f"stored_blk{block}_sb{sb}",
                          _moves(block, sb, "wait"))
                self.waited.add((block, sb))
            elif kind == "fill.issue":
                token, _, _ = self.stored[block, sb]
                self.loads[block, sb] = self.call(torch.ops.slc.unstash.default, (token,), f"load_blk{block}_sb{sb}",
                                                  _moves(block, sb, "unstash"))
            elif kind == "fill.wait":
                _, _, meta = self.stored[block, sb]
                self.filled.add((block, sb))
                self.hidden[sb] = self.call(torch.ops.slc.unstash_wait.default, (self.loads.pop((block, sb)), *meta),
                                            f"h_blk{block + 1}_sb{sb}", _moves(block, sb, "unstash_wait"))
            elif kind != "compute":
                raise ValueError(f"generate: a generation pass has no step {step.text()!r}")
            elif step.region == "prefix":
                captured = self.call(capture_pass, (self.run, self.phase, self.inputs, parts, batch), "prefix",
                                     SlcMeta("prefix"))
                self.calls = self.call(operator.getitem, (captured, 0), "calls")
                self.shared = self.call(operator.getitem, (captured, 1), "shared")
                for position, (part, _, _) in enumerate(parts):
                    part_calls = self.call(operator.getitem, (self.calls, position))
                    self.hidden[part] = self.call(layer_input, (self.run, part_calls), f"h_blk0_sb{part}")
            elif step.region == "suffix" and sb is not None:
                _, start, rows = parts[self.position[sb]]
                part = self.call(tail_part, (self.run, self.inputs, start, rows, batch, self.outputs.pop(sb)),
                                 f"logits_sb{sb}", SlcMeta("suffix", None, sb))
                self.logits = self.call(put_rows, (self.logits, part, start, batch), "logits")
            elif step.region == "suffix":
                outputs = [self.outputs.pop(part) for part, _, _ in parts]
                self.logits = self.call(tails, (self.run, self.inputs, parts, batch, self.shared, *outputs), "logits",
                                        SlcMeta("suffix"))
            else:
                self.compute(block, sb)
        left = [f"spill.wait {format_tag('block', *where)}" for where in sorted(self.stored.keys() - self.waited)]
        left += [f"fill.wait {format_tag('block', *where)}" for where in sorted(self.stored.keys() - self.filled)]
        left += [f"suffix.sb{sb}" for sb in sorted(self.outputs)] + ["suffix"] * (self.logits is None)
        if left:
            raise ValueError(f"generate: the {self.phase} schedule has no step {', '.join(left)}")
        self.graph.output((self.logits, tuple(self.layouts)))
        ops.bind_implementations(self.graph)
        return PassGraph(self.graph, self.attributes, f"<{self.phase} pass>")


class PassGraph:
    """A lowered pass: its FX graph and the Python function FX writes for it, called
    as `pass_graph(run, inputs, kv, new_cache)`.

    The function is compiled here rather than by a `torch.fx.GraphModule`, which
    keeps every module's source in a process-wide cache for tracebacks: a call of
    `generate` lowers a few passes, and a long-running process would keep them all.

    Attributes:
        graph: the `torch.fx.Graph`.
        code: the Python source of its function.
    """

    def __init__(self, graph: torch.fx.Graph, attributes: dict[str, torch.Tensor], filename: str):
        self.graph = graph
        python = graph.python_code(root_module="self")
        self.code = python.src
        namespace = dict(python.globals)
        exec(compile(self.code, filename, "exec"), namespace)  # noqa: S102 - FX's own code for the graph
        self._forward = namespace["forward"]
        # What `get_attr` nodes read (`self.blk0.mlp.weight`), as nested namespaces.
        self._root = types.SimpleNamespace()
        for target, tensor in attributes.items():
            *path, name = target.split(".")
            owner = self._root
            for part in path:
                if not hasattr(owner, part):
                    setattr(owner, part, types.SimpleNamespace())
                owner = getattr(owner, part)
            setattr(owner, name, tensor)

    def __call__(self, run, inputs: dict, kv, new_cache):
        return self._forward(self._root, run, inputs, kv, new_cache)


def lower_pass(schedule: Schedule, layout: PassLayout) -> PassGraph:
    """The FX graph of one generation pass: its schedule's steps in order (module
    docstring). Raises ValueError where the schedule has a step generation does not
    run, or lacks one a value needs (a spill's wait, a spilled state's fill, the
    suffix of an output)."""
    return _Lowering(schedule, layout).lower()

