"""The memory model: of a compiled step, live bytes per node, tier and kind, and the
peaks, from the lifetimes of its graphs (`predict_memory`); of a generation pass,
its schedule walked (`predict_pass_memory`, at the end of this module). Everything
that states a predicted figure (the CompileReport, `explain`, `explain_generation`,
`tune`, `tune_generation`, the memory plot, the recompute search) reads it from
here; `measured_peak_bytes` is the one instrument tests and benches measure a step
with.

The device's peak is the larger of the forward's and the backward's, each the max
over nodes of:

    bytes of the graph's live values (`analyze_lifetimes`: activations, fetched
    weights, reloaded activations, gradients, saved tensors)
  + bytes of the weights the streamer has prefetched but the graph has not yet
    fetched (the `live_blocks - 1` block visits after the current one, in the
    cyclic forward-then-backward fetch plan)
  + in the backward, the forward's outputs the caller still holds

plus what the caller holds for the whole step: resident parameters and buffers and
the batch (`held`; streamed parameters hold no memory). `GraphMemory` keeps the
device terms per node, by kind, for the example sizes. The slower tiers hold the
streamed weights and, from the forward's stores to the backward's last read, the
offloaded activations (step totals, not per node). Everything is a sympy expression
of the size symbols, evaluated for the example inputs.

A gradient stored to a tier that copies nothing (the host tier of a CPU-only
machine) is copied first, since the graph may reuse its buffer
(`slcompile.runtime.gradients`): the backward then also holds each copy from the
store's issue to its wait, beside the graph's own buffer.

With an optimizer (`optimizer_memory`: the offloaded optimizer's step, or the one
`explain`/`tune` are told of), the step ends with `optimizer.step()`: the device
then holds the forward's outputs, the gradients the backward returned (the
resident parameters' `.grad`) and the temporaries of the resident parameters'
step, a third phase beside the forward's and the backward's peaks; and the
resident parameters' optimizer state, held from one step to the next like the
parameters. The host's and nvme's shares of the optimizer (master weights, the
streamed weights' states, the gradients a block step reads) are reported apart
(`OptimizerMemory`), not in `peak_bytes`, which sizes the transfer engine's tiers.

With the streamed weights sharded over W ranks (`shard_weights`, `MachineFacts.world_size`)
each figure is one rank's: the weights' tier holds this rank's shard of every
streamed weight, `ceil(numel / W)` elements each (the padding included), and the
optimizer's host copies, states and gradients of streamed weights are shards of
that size too. On the device (`slcompile.runtime.weights`) a fetch of a weight
takes its loaded shard (page-rounded like any load; nothing where the tier is the
device's own memory) and the all-gather's buffer, the padded
weight, `ceil(numel / W) * W` elements: both from the issue `live_blocks - 1`
visits ahead (with the prefetched weights) to the fetch, or for a fetch issued by
itself both at its node; the buffer then is the fetched weight, to its last use.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping, Sequence
from typing import Any

import sympy
import torch
import torch.fx

from slcompile.analysis.lifetimes import (
    LifetimeTable,
    analyze_lifetimes,
    analyze_training_step,
    max_of,
    tensor_bytes,
)
from slcompile.analysis.machine import MachineFacts
from slcompile.kv_segments import KV_STORES_IN_FLIGHT, merged_segments, reads_in_place
from slcompile.meta import get_slc_meta
from slcompile.units import format_bytes
from slcompile.vocabulary import UNSTASH_WAIT, StashKey, WeightKey, is_stash, prefetched_visits

__all__ = [
    "GenerationSizes",
    "GraphMemory",
    "MemoryPrediction",
    "OptimizerMemory",
    "PassMemory",
    "TracedPass",
    "optimizer_memory",
    "predict_memory",
    "predict_pass_memory",
    "predict_step_memory",
    "size_hints",
    "sharded_weight_bytes",
    "measured_peak_bytes",
]

# What the caller holds for the step; the other kinds are values the graphs make.
_STEP_KINDS = ("prefetched", "outputs_held")
# The memory of weights: fetched ones, and shards loaded for an all-gather.
_WEIGHT_KINDS = ("weight", "shard")


@dataclasses.dataclass(frozen=True)
class GraphMemory:
    """Device bytes live at each node of one graph, by kind, for the example sizes.

    Attributes:
        kind: the graph: "forward", "backward" or "inference".
        nodes: the node names, in program order.
        live: per kind, the bytes live at each node: the lifetime kinds ("weight":
            fetched weights, "activation", "saved", "gradient", "input": inputs the
            graph frees) and "prefetched" (weights loaded ahead, not yet fetched;
            sharded, their all-gathers' buffers) and "outputs_held" (in the
            backward, the forward's outputs the caller holds), with sharded
            weights "shard" (shards loaded and not yet fetched, ahead or in a fetch),
            and in a backward whose stored gradients are copied first,
            "gradient_copy" (copies of stored gradients until their store's wait).
            Inputs the caller holds through the step are not per node
            (`MemoryPrediction.held_bytes`).
    """

    kind: str
    nodes: tuple[str, ...]
    live: Mapping[str, tuple[int, ...]]

    @property
    def phase(self) -> str:
        return "bwd" if self.kind == "backward" else "fwd"

    @property
    def weights(self) -> tuple[int, ...]:
        """Fetched weights (and loaded shards) live at each node."""
        series = [self.live[k] for k in _WEIGHT_KINDS if k in self.live]
        return tuple(sum(values) for values in zip(*series)) if series else (0,) * len(self.nodes)

    @property
    def other(self) -> tuple[int, ...]:
        """Every other value the graph makes (activations, saved values, gradients,
        freed inputs), live at each node."""
        kinds = [k for k in self.live if k not in _WEIGHT_KINDS and k not in _STEP_KINDS]
        return tuple(sum(self.live[k][i] for k in kinds) for i in range(len(self.nodes)))

    @property
    def totals(self) -> tuple[int, ...]:
        """All device bytes of the step at each node, the held inputs excepted."""
        return tuple(sum(series[i] for series in self.live.values()) for i in range(len(self.nodes)))

    @property
    def peak(self) -> int:
        return max(self.totals, default=0)


@dataclasses.dataclass(frozen=True)
class OptimizerMemory:
    """The optimizer step's share of a training step's memory, in bytes, per tier
    (`optimizer_memory`).

    Attributes:
        name: the optimizer class's name.
        states_tier: where the streamed weights' optimizer state rests ("host", "nvme").
        device_state_bytes: the optimizer state of the parameters stepped on the
            device (those not streamed), held from one step to the next.
        device_step_bytes: the most bytes the temporaries of the device's step take
            at once (torch's for-loop, foreach or fused implementation).
        host_master_bytes: the host copies of the weights the host steps (fp32 for
            bf16/fp16 parameters).
        host_state_bytes: the optimizer state that rests in host memory.
        host_gradient_bytes: gradients in host memory waiting for their block's step
            (one block's; with `max_grad_norm` every streamed weight's, until `step()`).
        host_step_bytes: the temporaries of one block's step on the host, and with
            nvme states the block's state loaded for it.
        nvme_state_bytes: the optimizer state that rests in nvme files.
        host_is_device: host memory is the device's memory (a CPU-only machine).
    """

    name: str
    states_tier: str
    device_state_bytes: int
    device_step_bytes: int
    host_master_bytes: int = 0
    host_state_bytes: int = 0
    host_gradient_bytes: int = 0
    host_step_bytes: int = 0
    nvme_state_bytes: int = 0
    host_is_device: bool = False

    @property
    def host_bytes(self) -> int:
        """The host's share at its most."""
        return self.host_master_bytes + self.host_state_bytes + self.host_gradient_bytes + self.host_step_bytes


_LOW_PRECISION = (torch.bfloat16, torch.float16)
# Scalar temporaries of a step (bias corrections, a step count's copy); a few bytes.
_STEP_SCALAR_BYTES = 64


def optimizer_memory(
    optimizer_class: type[torch.optim.Optimizer],
    options: Mapping[str, Any],
    resident: Sequence[Sequence[torch.Tensor]],
    streamed: Sequence[Sequence[torch.Tensor]] = (),
    *,
    states: str = "host",
    max_grad_norm: float | None = None,
    machine: MachineFacts = MachineFacts(),
) -> OptimizerMemory:
    """The memory an optimizer step of `optimizer_class` takes, per tier, as
    `slcompile.offload_optimizer` runs it: the resident parameters stepped on the
    device by one instance, each block of streamed parameters on the host by its own.

    The state per parameter is what one step of `optimizer_class` with `options`
    leaves (found by stepping a 3-element tensor once). The temporaries follow what
    torch's implementations allocate on the CPU (measured with `measured_peak_bytes`,
    tests/test_optimizer_memory.py): the for-loop one per parameter in turn (Adam(W)
    two tensors of its size, three with maximize or L2 weight decay, while
    the previous parameter's denominator lives; SGD one with weight decay or
    maximize, one more with nesterov), the foreach one a list the size of the whole
    group (SGD none without weight decay or maximize), the fused one none. Other
    classes are given the most any other of torch's optimizers takes (Adadelta,
    NAdam): three tensors of the parameter's size and the previous one's (for-loop),
    three times the group (foreach).

    Args:
        optimizer_class: the optimizer class.
        options: its options (lr, weight_decay, foreach, ...).
        resident: the parameters stepped on the device, per param group, in order;
            bf16/fp16 ones are stepped on fp32 host copies instead.
        streamed: the streamed parameters, per block (the host steps them).
        states: where the streamed weights' state rests: "host" or "nvme".
        max_grad_norm: the clip of `offload_optimizer`: every streamed gradient then
            waits in host memory for `step()`.
        machine: the machine's facts: whether host memory is the device's (a
            CPU-only machine), and the ranks the streamed weights are sharded over
            (`world_size`; `shard_weights`): the host steps this rank's shard of each.
    """
    weight_shards = machine.world_size
    per_element, scalar_bytes = _state_layout(optimizer_class, options)

    def state_bytes(nbytes: int) -> int:
        return int(per_element * nbytes) + scalar_bytes

    device_groups = [[_nbytes(p) for p in group if p.dtype not in _LOW_PRECISION] for group in resident]
    on_host = [p for group in resident for p in group if p.dtype in _LOW_PRECISION]
    blocks = [[_master_bytes(p, weight_shards) for p in block] for block in streamed]
    if on_host:
        blocks.append([_master_bytes(p) for p in on_host])
    foreach = options.get("foreach")
    if foreach is None:  # torch's default: foreach kernels where the device has them
        foreach = any(p.device.type in ("cuda", "xpu") for group in resident for p in group)
    device_step = _temporaries(optimizer_class, options, device_groups, bool(foreach))
    host_step = max((_temporaries(optimizer_class, options, [block], bool(options.get("foreach")))
                     for block in blocks), default=0)
    masters = sum(sum(block) for block in blocks)
    host_states = sum(state_bytes(b) for block in blocks for b in block)
    scalars = scalar_bytes * sum(len(block) for block in blocks)
    nvme = 0
    if states == "nvme":
        # Tensor states rest in files (scalars stay); one block's are loaded for its step.
        nvme = host_states - scalars
        host_step += max((sum(state_bytes(b) - scalar_bytes for b in block) for block in blocks), default=0)
        host_states = scalars
    gradients = masters if max_grad_norm is not None else max((sum(block) for block in blocks), default=0)
    return OptimizerMemory(
        name=optimizer_class.__name__,
        states_tier=states,
        device_state_bytes=sum(state_bytes(b) for group in device_groups for b in group),
        device_step_bytes=device_step,
        host_master_bytes=masters,
        host_state_bytes=host_states,
        host_gradient_bytes=gradients if blocks else 0,
        host_step_bytes=host_step,
        nvme_state_bytes=nvme,
        host_is_device=machine.host_is_device,
    )


def _nbytes(tensor: torch.Tensor) -> int:
    return int(tensor.numel()) * tensor.element_size()


def _master_bytes(param: torch.Tensor, shards: int = 1) -> int:
    """Bytes of a parameter's host copy: this rank's zero-padded shard of it over `shards` ranks."""
    return -(-int(param.numel()) // shards) * (4 if param.dtype in _LOW_PRECISION else param.element_size())


@functools.lru_cache(maxsize=64)
def _state_layout_cached(optimizer_class, options: tuple) -> tuple[float, int]:
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    with unset_fake_temporarily():
        param = torch.zeros(3, requires_grad=True)
        param.grad = torch.ones(3)
        optimizer = optimizer_class([param], **dict(options))
        optimizer.step()
        state = optimizer.state[param]
    per_element, scalars = 0.0, 0
    for value in state.values():
        if not isinstance(value, torch.Tensor):
            continue
        if value.dim() == 0:
            scalars += value.element_size()
        else:
            per_element += value.numel() * value.element_size() / _nbytes(param)
    return per_element, scalars


def _state_layout(optimizer_class, options: Mapping[str, Any]) -> tuple[float, int]:
    """(state bytes per parameter byte, bytes of scalar state per parameter) after a step."""
    accepted = inspect.signature(optimizer_class.__init__).parameters
    if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in accepted.values()):
        # A group's options may hold more than the constructor takes (AdamW's decoupled_weight_decay).
        options = {key: value for key, value in options.items() if key in accepted}
    try:
        key = tuple(sorted(options.items()))
        hash(key)
    except TypeError:  # unhashable options (a tensor lr): not cached
        return _state_layout_cached.__wrapped__(optimizer_class, tuple(options.items()))
    return _state_layout_cached(optimizer_class, key)


def _temporaries(optimizer_class, options: Mapping[str, Any], groups: Sequence[Sequence[int]], foreach: bool) -> int:
    """The most bytes a step's temporaries take at once, over the param groups
    (parameter bytes, in order); see `optimizer_memory`."""
    if options.get("fused"):
        return 0
    per_param, previous, per_group = 3, 1, 3
    weight_decay = options.get("weight_decay", 0) != 0
    if issubclass(optimizer_class, torch.optim.Adam):
        decoupled = issubclass(optimizer_class, torch.optim.AdamW) or options.get("decoupled_weight_decay")
        extra = options.get("maximize") or (weight_decay and not decoupled)
        per_param, previous, per_group = (3 if extra else 2), 1, 1
    elif issubclass(optimizer_class, torch.optim.SGD):
        extra = int(bool(weight_decay or options.get("maximize")))
        per_param, previous, per_group = extra + int(bool(options.get("nesterov"))), 0, extra
    most = 0
    for group in groups:
        if not group:
            continue
        if foreach:
            most = max(most, per_group * sum(group))
        else:
            most = max(most, max(per_param * b + previous * a for a, b in zip([0, *group], group)))
    return most + (_STEP_SCALAR_BYTES if any(groups) else 0)


@dataclasses.dataclass(frozen=True)
class MemoryPrediction:
    """Predicted bytes of one compiled step.

    Attributes:
        peak_bytes: per tier ("device", "host", "nvme"), the peak for the example
            inputs; the device's includes `held_bytes` and the resident parameters'
            optimizer state (`optimizer.device_state_bytes`).
        step_peak_bytes: the device bytes the step itself allocates at its peak
            (what a profiler sees from the step's start), `optimizer.step()` included
            when there is an optimizer.
        held_bytes: device bytes the caller holds through the step (resident
            parameters and buffers, the inputs).
        prefetch_bytes: the most weight bytes prefetched ahead at once.
        offloaded_activation_bytes: saved activations stored off the device per step.
        expressions: the symbolic form of `peak_bytes` and `step_peak_bytes`.
        recompute: the recompute choice the plan was made with.
        graphs: per graph, in the order they run, the device bytes live at each node
            by kind; without an optimizer the largest total is `step_peak_bytes`.
        optimizer: the optimizer's share (`OptimizerMemory`), or None when the
            prediction has no optimizer step.
        optimizer_step_bytes: device bytes of the optimizer step's phase (the
            forward's outputs, the gradients the backward returned, the resident
            step's temporaries); part of `step_peak_bytes` when it is the largest.
        optimizer_gradient_bytes: of those, the gradients the backward returned.
        gradient_copy_bytes: the most bytes of gradient copies on their way to the
            optimizer's tier at once (see `predict_memory`'s `gradients_tier`), part
            of the backward.
        weight_shards: the ranks the streamed weights are sharded over (1: not sharded).
        shard_bytes: sharded, the most device bytes of loaded shards at once
            (waiting for their all-gather and fetch).
        gather_bytes: sharded, the most device bytes of all-gather buffers (padded
            whole weights, prefetched or fetched) at once.
    """

    peak_bytes: dict[str, int]
    step_peak_bytes: int
    held_bytes: int
    prefetch_bytes: int
    offloaded_activation_bytes: int
    expressions: dict[str, sympy.Expr]
    recompute: str = "none"
    graphs: tuple[GraphMemory, ...] = ()
    optimizer: OptimizerMemory | None = None
    optimizer_step_bytes: int = 0
    optimizer_gradient_bytes: int = 0
    gradient_copy_bytes: int = 0
    weight_shards: int = 1
    shard_bytes: int = 0
    gather_bytes: int = 0

    def __str__(self) -> str:
        tiers = ", ".join(f"{tier} {_mib(b)}" for tier, b in self.peak_bytes.items() if b)
        line = (
            f"predicted peak: {tiers or 'nothing'} (step {_mib(self.step_peak_bytes)}, held "
            f"{_mib(self.held_bytes)}, prefetched weights {_mib(self.prefetch_bytes)}, offloaded "
            f"activations {_mib(self.offloaded_activation_bytes)}; recompute={self.recompute})"
        )
        if self.weight_shards > 1:
            line += (f"\nweights sharded over {self.weight_shards} ranks, device: loaded shards "
                     f"{_mib(self.shard_bytes)}, all-gathered weights {_mib(self.gather_bytes)} at most at once")
        return "\n".join((line, *self.optimizer_lines()))

    def optimizer_lines(self) -> tuple[str, ...]:
        """The optimizer's share, one line per tier (none without an optimizer)."""
        opt = self.optimizer
        if opt is None:
            return ()
        lines = [
            f"optimizer {opt.name}, device: resident states {_mib(opt.device_state_bytes)}, step phase "
            f"{_mib(self.optimizer_step_bytes)} (gradients {_mib(self.optimizer_gradient_bytes)}, step "
            f"temporaries {_mib(opt.device_step_bytes)}), gradient copies in flight {_mib(self.gradient_copy_bytes)}",
            f"optimizer {opt.name}, host: {_mib(opt.host_bytes)} (master weights {_mib(opt.host_master_bytes)}, "
            f"states {_mib(opt.host_state_bytes)}, gradients {_mib(opt.host_gradient_bytes)}, step temporaries "
            f"{_mib(opt.host_step_bytes)})" + (f"; nvme: states {_mib(opt.nvme_state_bytes)}"
                                                if opt.nvme_state_bytes else ""),
        ]
        if opt.host_is_device:
            lines.append(
                "host memory is the device's on this machine: device peak + optimizer host = "
                f"{_mib(self.peak_bytes['device'] + opt.host_bytes)}"
            )
        return tuple(lines)


def _mib(nbytes: int) -> str:
    return format_bytes(nbytes)


def size_hints(*graphs: torch.fx.GraphModule) -> dict[sympy.Symbol, int]:
    """The example value of every size symbol of the graphs' placeholders."""
    hints: dict[sympy.Symbol, int] = {}
    for gm in graphs:
        for node in gm.graph.find_nodes(op="placeholder"):
            value = node.meta.get("val")
            dims = value.shape if isinstance(value, torch.Tensor) else (value,)
            for dim in dims:
                if isinstance(dim, torch.SymInt) and isinstance(dim.node.expr, sympy.Symbol):
                    if dim.node.hint is not None:
                        hints[dim.node.expr] = int(dim.node.hint)
    return hints


def _fetch_op():
    from slcompile.vocabulary import FETCH_WEIGHT

    return FETCH_WEIGHT


@dataclasses.dataclass(frozen=True)
class _FetchLayout:
    """Device bytes of one fetch of a streamed weight (see the module docstring).

    Attributes:
        shards: the ranks the weights are sharded over (1: whole weights).
        machine: how loads pad what they read (`MachineFacts.loaded_bytes`).
        zero_copy_shards: a shard's load is the stored tensor itself.
    """

    shards: int = 1
    machine: MachineFacts = MachineFacts()
    zero_copy_shards: bool = False

    def loaded(self, nbytes: int) -> int:
        return self.machine.loaded_bytes(nbytes)

    def weight(self, value: torch.Tensor) -> int:
        """The fetched weight: the loaded tensor, or sharded the all-gather's buffer."""
        if self.shards == 1:
            return self.loaded(int(tensor_bytes(value)))
        return -(-int(value.numel()) // self.shards) * self.shards * value.element_size()

    def shard(self, value: torch.Tensor) -> int:
        """The loaded shard of a sharded weight (0 when not sharded)."""
        if self.shards == 1 or self.zero_copy_shards:
            return 0
        return self.loaded(-(-int(value.numel()) // self.shards) * value.element_size())


def _visits(gm: torch.fx.GraphModule, size) -> tuple[list[int], list[int]]:
    """(first node index, bytes) of each block visit: a run of fetches of one
    block, or of one (block, sub-batch) when fetches are per sub-batch, as
    `place_prefetches` counts visits (a block whose sub-batches fetch one after the
    other makes as many visits); `size(value)` is what one fetch of the weight
    `value` takes."""
    fetch = _fetch_op()
    starts, sizes, last_visit = [], [], object()
    for i, node in enumerate(gm.graph.nodes):
        if node.op != "call_function" or node.target is not fetch:
            continue
        meta = get_slc_meta(node)
        visit = (meta.block if meta is not None else None, WeightKey.parse(node.args[1]).subbatch)
        nbytes = size(node.meta["val"])
        if visit != last_visit:
            starts.append(i)
            sizes.append(0)
            last_visit = visit
        sizes[-1] += nbytes
    return starts, sizes


def _prefetched(tables, graphs, live_blocks: int, size) -> list[list[int]]:
    """Per graph, per node: bytes prefetched and not yet fetched, `size(value)` per
    fetch of the weight `value`: the `live_blocks - 1` visits after the current one,
    and from its `slc::fetch_issue` on, the visit those issue (`place_prefetches`
    puts them just before the first fetch of the visit that many earlier)."""
    issued = _issued(graphs, size)
    visits = [_visits(gm, size) for gm in graphs]
    sizes = [size for _, graph_sizes in visits for size in graph_sizes]
    total = len(sizes)
    extra = []
    offset = 0
    for (starts, _), table in zip(visits, tables):
        per_node = []
        current = offset - 1  # before the graph's first fetch: the previous visit
        for i in range(len(table.resident)):
            while current + 1 - offset < len(starts) and starts[current + 1 - offset] <= i:
                current += 1
            per_node.append(sum(sizes[visit] for visit in prefetched_visits(current, live_blocks, total)))
        extra.append([a + b for a, b in zip(per_node, issued[len(extra)])])
        offset += len(starts)
    return extra


def _issued(graphs, size) -> list[list[int]]:
    """Per graph, per node: bytes of the loads issued since the graph's last fetch
    (`size(value)` per issue of the weight `value`)."""
    from slcompile.vocabulary import is_fetch, is_fetch_issue

    sizes = {node.args[1]: size(node.meta["val"]) for gm in graphs for node in gm.graph.nodes if is_fetch(node)}
    per_graph = []
    for gm in graphs:
        running, series = 0, []
        for node in gm.graph.nodes:
            if is_fetch(node):
                running = 0
            elif is_fetch_issue(node):
                running += sizes.get(node.args[0], 0)
            series.append(running)
        per_graph.append(series)
    return per_graph


def _loaded_shards(tables, graphs, live_blocks: int, layout: _FetchLayout) -> list[list[int]]:
    """Per graph, per node: bytes of sharded weights' loaded shards: prefetched
    ones, from their issue to their fetch; without prefetch, each fetch's own
    while it all-gathers (at the fetch's node only)."""
    ahead = _prefetched(tables, graphs, live_blocks, layout.shard)
    if any(map(any, ahead)):
        return ahead
    fetch = _fetch_op()
    return [[layout.shard(node.meta["val"]) if node.op == "call_function" and node.target is fetch else 0
             for node in gm.graph.nodes] for gm in graphs]


def _gathered_weights(tables, graphs, layout: _FetchLayout) -> list[list[int]]:
    """Per graph, per node: bytes the fetched weights take beyond the lifetime
    table's (a loaded tensor each): sharded, each is its all-gather's padded buffer."""
    fetch = _fetch_op()
    per_graph = []
    for gm, table in zip(graphs, tables):
        values = {v.name: v for v in table.values}
        change = [0] * (len(table.resident) + 1)
        for node in gm.graph.nodes:
            if node.op != "call_function" or node.target is not fetch or node.name not in values:
                continue
            value = values[node.name]
            delta = layout.weight(node.meta["val"]) - int(value.bytes)
            change[value.first_use] += delta
            change[value.last_use + 1] -= delta
        running, series = 0, []
        for delta in change[:-1]:
            running += delta
            series.append(running)
        per_graph.append(series)
    return per_graph


def sharded_weight_bytes(graphs: Sequence[torch.fx.GraphModule], weight_shards: int) -> int:
    """Bytes of one rank's shards of the weights `graphs` fetch, each weight once:
    `ceil(numel / weight_shards)` elements of each (`ShardGroup.shard`)."""
    from slcompile.vocabulary import WeightKey, is_fetch

    shards: dict[str, int] = {}
    for gm in graphs:
        for node in gm.graph.nodes:
            if is_fetch(node):
                value = node.meta["val"]
                shards[WeightKey.parse(node.args[1]).stored] = -(-value.numel() // weight_shards) * value.element_size()
    return sum(shards.values())


def _held_bytes(gm: torch.fx.GraphModule) -> sympy.Expr:
    """Bytes of the forward's tensor inputs, except parameters that are only fetched
    (their memory rests on another tier)."""
    fetch = _fetch_op()
    held = sympy.Integer(0)
    for node in gm.graph.find_nodes(op="placeholder"):
        value = node.meta.get("val")
        if not isinstance(value, torch.Tensor):
            continue
        # A training forward also returns a streamed parameter for the backward to fetch.
        used = [u for u in node.users if u.op != "output"]
        if used and all(u.op == "call_function" and u.target is fetch for u in used):
            continue
        held += tensor_bytes(value)
    return sympy.expand(held)


def predict_memory(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule | None = None,
    *,
    graph_kind: str = "forward",
    live_blocks: int = 1,
    weights_tier: str = "device",
    streamed_bytes: int = 0,
    activations_tier: str = "device",
    offloaded_bytes: sympy.Expr = sympy.Integer(0),
    recompute: str = "none",
    sizes: Mapping[sympy.Symbol, int] | None = None,
    optimizer: OptimizerMemory | None = None,
    gradients_tier: str | None = None,
    machine: MachineFacts = MachineFacts(),
) -> MemoryPrediction:
    """Predicts a step's memory per tier (the graphs are not changed).

    Args:
        forward: the forward graph (or the inference graph, with `graph_kind`).
        backward: the backward graph of a training step, or None.
        graph_kind: "forward" or "inference" when there is no backward.
        live_blocks: the streamer's window (1: no prefetch).
        weights_tier: where streamed weights rest; `streamed_bytes` of them.
        activations_tier: where offloaded activations rest; `offloaded_bytes` of them.
        recompute: recorded in the prediction.
        sizes: values of the size symbols; default: the example inputs'.
        optimizer: the optimizer's share (`optimizer_memory`): a training step then
            ends with its step, and the device holds its resident state.
        gradients_tier: where `slc::offload_grad` stores the streamed weights'
            gradients (None: they stay). Where that tier copies nothing and the
            weights are not sharded, each gradient is copied on the device first,
            the copy held until the store's wait.
        machine: the machine's facts (`MachineFacts`): loaded tensors take their size
            rounded up to its `load_granularity` (see `analyze_lifetimes`), plus
            `load_overhead` bytes each; with `world_size` W > 1 the streamed weights
            are sharded over W ranks: their tier holds this rank's shard of each
            (`sharded_weight_bytes`), not `streamed_bytes`, and the device each
            fetch's loaded shard (none where the weights' tier is the device's
            memory) and padded all-gather buffer (see the module docstring).
    """
    load_granularity, load_overhead = machine.load_granularity, machine.load_overhead
    weight_shards = machine.world_size
    gradient_copies = gradients_tier is not None and weight_shards == 1 and not machine.copies(gradients_tier)
    subs = dict(sizes if sizes is not None else size_hints(forward, *(g for g in (backward,) if g)))
    tables: list[LifetimeTable]
    if backward is not None:
        step = analyze_training_step(
            forward, backward, load_granularity=load_granularity, load_overhead=load_overhead
        )
        tables, graphs = [step.forward, step.backward], [forward, backward]
        before = [sympy.Integer(0), step.forward.user_output_bytes]
    else:
        tables, graphs = [analyze_lifetimes(
            forward, graph_kind, load_granularity=load_granularity, load_overhead=load_overhead
        )], [forward]
        before = [sympy.Integer(0)]
    # A shard loaded from a tier that is the device's memory (the host of a CPU-only machine) is no copy.
    zero_copy_shards = weights_tier != "device" and not machine.copies(weights_tier)
    layout = _FetchLayout(weight_shards, machine, zero_copy_shards)
    extra = _prefetched(tables, graphs, live_blocks, layout.weight)
    # Sharded weights' terms (zeros without): the loaded shards, and what the
    # fetched weights' padded buffers take beyond a loaded weight.
    shards = _loaded_shards(tables, graphs, live_blocks, layout)
    gathered = _gathered_weights(tables, graphs, layout)
    copies = [_gradient_copies(gm) if gradient_copies and kind == 1 else [sympy.Integer(0)] * len(table.resident)
              for kind, (gm, table) in enumerate(zip(graphs, tables))]
    resident = [
        sympy.expand(held_before + expr + ahead + copied + shard + padded)
        for table, per_node, held_before, copied, graph_shards, graph_gathered
        in zip(tables, extra, before, copies, shards, gathered)
        for expr, ahead, copied, shard, padded in zip(table.resident, per_node, copied, graph_shards, graph_gathered)
    ]
    # The optimizer's step: the caller holds the outputs, the resident parameters
    # their .grad (what the backward returned), and the next forward's first blocks
    # are prefetched (as at the backward's end), while the step's temporaries live.
    stepped = optimizer is not None and backward is not None
    optimizer_step = optimizer_gradients = optimizer_state = sympy.Integer(0)
    if stepped:
        optimizer_state = sympy.Integer(optimizer.device_state_bytes)
        optimizer_gradients = _returned_gradients(tables[1])
        ahead = (extra[1][-1] + shards[1][-1]) if extra[1] else 0
        optimizer_step = sympy.expand(before[1] + optimizer_gradients + ahead + optimizer.device_step_bytes)
        resident.append(optimizer_step)
    step_expr = max_of(resident)
    held_expr = _held_bytes(forward)
    device_expr = sympy.expand(held_expr + optimizer_state) + step_expr
    tier_exprs: dict[str, sympy.Expr] = {"device": device_expr, "host": sympy.Integer(0), "nvme": sympy.Integer(0)}
    if weights_tier != "device" and streamed_bytes:
        tier_exprs[weights_tier] += (streamed_bytes if weight_shards == 1
                                     else sharded_weight_bytes(graphs, weight_shards))
    if activations_tier != "device":
        tier_exprs[activations_tier] += _stored_activations(forward, offloaded_bytes)
    evaluated = {tier: int(expr.subs(subs)) for tier, expr in tier_exprs.items()}
    kinds = ["forward", "backward"] if backward is not None else [graph_kind]
    per_node = tuple(
        _graph_memory(kind, gm, table, ahead, int(sympy.sympify(held_before).subs(subs)), subs, copied,
                      graph_shards, graph_gathered)
        for kind, gm, table, ahead, held_before, copied, graph_shards, graph_gathered
        in zip(kinds, graphs, tables, extra, before, copies, shards, gathered)
    )
    return MemoryPrediction(
        peak_bytes=evaluated,
        step_peak_bytes=int(step_expr.subs(subs)),
        held_bytes=int(held_expr.subs(subs)),
        prefetch_bytes=max((max(per_node, default=0) for per_node in extra), default=0),
        offloaded_activation_bytes=int(sympy.sympify(offloaded_bytes).subs(subs)),
        expressions={**{f"peak_{tier}": expr for tier, expr in tier_exprs.items()}, "step_peak": step_expr},
        recompute=recompute,
        graphs=per_node,
        optimizer=optimizer if stepped else None,
        optimizer_step_bytes=int(sympy.sympify(optimizer_step).subs(subs)),
        optimizer_gradient_bytes=int(sympy.sympify(optimizer_gradients).subs(subs)),
        gradient_copy_bytes=max((int(sympy.sympify(c).subs(subs)) for c in copies[-1]), default=0),
        weight_shards=weight_shards,
        shard_bytes=_most(per_node, ("shard",)),
        gather_bytes=_most(per_node, ("prefetched", "weight")) if weight_shards > 1 else 0,
    )


def _stored_activations(forward: torch.fx.GraphModule, offloaded_bytes) -> sympy.Expr:
    """The most activation bytes resting on their tier at once: `offloaded_bytes` (the
    stashes, all there when the backward starts) or, with spills of the forward's
    boundary activations that no stash shares (`spill_boundaries`), the most the
    stores so far and those spills hold together at any node, a spill's copy counted
    until its fill is waited for."""
    output = forward.graph.output_node()
    handed = {v for v in output.args[0] if isinstance(v, torch.fx.Node)}
    own = {n for n in forward.graph.nodes if is_stash(n) and n not in handed and StashKey.parse(n.args[1]).spills}
    if not own:
        return offloaded_bytes
    held, most = sympy.Integer(0), [sympy.sympify(offloaded_bytes)]
    for node in forward.graph.nodes:
        if is_stash(node):
            held += tensor_bytes(node.args[0].meta["val"])
            most.append(held)
        elif node.target is UNSTASH_WAIT and node.args[0].args[0] in own:
            held -= tensor_bytes(node.args[0].args[0].args[0].meta["val"])
    return max_of(sympy.expand(expr) for expr in most)


def _most(graphs: Sequence[GraphMemory], kinds: Sequence[str]) -> int:
    """The most bytes of the `kinds` together at any node of the graphs."""
    most = 0
    for graph in graphs:
        series = [graph.live[kind] for kind in kinds if kind in graph.live]
        most = max(most, max((sum(values) for values in zip(*series)), default=0))
    return most


def _gradient_copies(backward: torch.fx.GraphModule) -> list[sympy.Expr]:
    """Per node of the backward: bytes of the gradient copies from each
    `slc::offload_grad` to its wait (to the end when none waits)."""
    from slcompile.vocabulary import WAIT, is_gradient_store

    nodes = list(backward.graph.nodes)
    index = {node: i for i, node in enumerate(nodes)}
    change = [sympy.Integer(0)] * (len(nodes) + 1)
    for node in nodes:
        if not is_gradient_store(node):
            continue
        waits = [user for user in node.users if user.target is WAIT]
        end = max((index[w] for w in waits), default=len(nodes) - 1)
        change[index[node]] += tensor_bytes(node.args[0].meta["val"])
        change[end + 1] -= tensor_bytes(node.args[0].meta["val"])
    running, series = sympy.Integer(0), []
    for i in range(len(nodes)):
        running = sympy.expand(running + change[i])
        series.append(running)
    return series


def _returned_gradients(table: LifetimeTable) -> sympy.Expr:
    """Bytes of the gradients a backward returns (alive at its output)."""
    last = len(table.resident) - 1
    return sympy.expand(sum((v.bytes for v in table.values if v.kind == "gradient" and v.last_use >= last),
                            sympy.Integer(0)))


def _graph_memory(kind, gm, table: LifetimeTable, prefetched: list[int], outputs_held: int, subs,
                  copied=(), shards=(), gathered=()) -> GraphMemory:
    """The lifetime table swept over the nodes, one series per value kind
    (`shards`, `gathered`: the sharded weights' terms of `predict_memory`)."""
    nodes = tuple(node.name for node in gm.graph.nodes)
    deltas: dict[str, list[int]] = {}
    for value in table.values:
        size = int(sympy.sympify(value.bytes).subs(subs))
        delta = deltas.setdefault(value.kind, [0] * (len(nodes) + 1))
        delta[value.first_use] += size
        delta[min(value.last_use + 1, len(nodes))] -= size
    live: dict[str, tuple[int, ...]] = {}
    for value_kind, delta in deltas.items():
        running, series = 0, []
        for index in range(len(nodes)):
            running += delta[index]
            series.append(running)
        live[value_kind] = tuple(series)
    if any(copied):
        live["gradient_copy"] = tuple(int(sympy.sympify(c).subs(subs)) for c in copied)
    if any(gathered):
        live["weight"] = tuple(w + g for w, g in zip(live["weight"], gathered))
    if any(shards):
        live["shard"] = tuple(shards)
    live["prefetched"] = tuple(prefetched)
    live["outputs_held"] = (outputs_held,) * len(nodes)
    return GraphMemory(kind, nodes, live)


def predict_step_memory(
    graphs: Mapping[str, torch.fx.GraphModule], sizes: Mapping[sympy.Symbol, int] | None = None, **options
) -> MemoryPrediction | None:
    """`predict_memory` of compiled graphs by kind (`CompileReport.graphs`): the
    forward and backward as one training step, else the inference (or forward)
    graph alone; None without graphs.

    Args:
        graphs: the graphs by kind.
        sizes: values of the size symbols; default: the example inputs'.
        **options: the other arguments of `predict_memory`.
    """
    if "forward" in graphs and "backward" in graphs:
        return predict_memory(graphs["forward"], graphs["backward"], sizes=sizes, **options)
    kind = "inference" if "inference" in graphs else "forward"
    if kind not in graphs:
        return None
    return predict_memory(graphs[kind], graph_kind=kind, sizes=sizes, **options)


# -- generation passes ------------------------------------------------------------
#
# A generation pass (`slcompile.schedules.generation`) runs compiled layer steps,
# not one graph, so its device memory is walked in its schedule: at every layer
# step of every sub-batch, what the device holds is summed by term, and the pass's
# peak is the largest sum. The sizes of what the pass makes (the capture's tensors,
# each layer step's and the tail's temporaries) are traced by the caller
# (`slcompile.inference.memory`) and handed in as `TracedPass`; the rest follows from
# the schedule, the KV cache's segment rules (`slcompile.kv_segments`) and the
# machine's facts.


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
        parts = ", ".join(f"{name} {format_bytes(n)}" for name, n in self.terms.items() if n)
        return f"{self.phase} peak {format_bytes(self.peak_bytes)} at {self.moment}: {parts}"


@dataclasses.dataclass(frozen=True)
class GenerationSizes:
    """What the passes of one generation hold that no pass traces.

    Attributes:
        batch: the sequences generated.
        length: the prompt's positions.
        num_subbatches: the decode passes' sub-batches.
        prefill_subbatches: the prefill's parts.
        resident: the bytes of the parameters and buffers that are not streamed.
        layer_loads: per layer, the bytes of each weight its pass fetches from a
            tier that copies (empty where it fetches none).
        key_bytes: per layer, one position of one sequence's keys (as many again
            for its values).
        caps: per layer, the positions its cache keeps (None: all of them).
        vocab: the logits of one sequence.
        kv_tier: where the KV cache rests between passes.
        machine: which tiers copy, and how loads pad what they read.
        kv_stores_in_flight: likewise for the stores of the KV cache.
    """

    batch: int
    length: int
    num_subbatches: int
    prefill_subbatches: int
    resident: int
    layer_loads: tuple[tuple[int, ...], ...]
    key_bytes: tuple[int, ...]
    caps: tuple[int | None, ...]
    vocab: int
    kv_tier: str
    machine: MachineFacts
    kv_stores_in_flight: int = KV_STORES_IN_FLIGHT

    @property
    def layers(self) -> int:
        return len(self.key_bytes)

    @property
    def kv_moves(self) -> bool:
        """Whether the KV cache leaves the device between passes."""
        return self.machine.copies(self.kv_tier)

    def fetched(self, index: int) -> int:
        """The device bytes of layer `index`'s fetched weights, each padded as loads pad it."""
        return sum(self.machine.loaded_bytes(nbytes) for nbytes in self.layer_loads[index])

    def kept(self, index: int, positions: int) -> int:
        """The positions of `positions` that layer `index`'s cache keeps."""
        cap = self.caps[index]
        return positions if cap is None else min(positions, cap)

    def cache_bytes(self, index: int, sequences: int, positions: int) -> int:
        """The keys and values of `positions` positions of `sequences` sequences."""
        return 2 * sequences * positions * self.key_bytes[index]

    def in_place(self, index: int, sequences: int) -> bool:
        """Whether a (layer, sub-batch)'s segments are read into one buffer."""
        return reads_in_place(self.cache_bytes(index, sequences, 1), self.machine.load_granularity)

    def loaded_cache(self, index: int, sequences: int, segments: Sequence[int]) -> int:
        """A cache of `segments` (their positions) loaded: one tensor per segment, or
        one buffer for all where they are read in place."""
        if len(segments) > 1 and self.in_place(index, sequences):
            return self.machine.loaded_bytes(self.cache_bytes(index, sequences, sum(segments)))
        return sum(self.machine.loaded_bytes(self.cache_bytes(index, sequences, size)) for size in segments)


@dataclasses.dataclass(frozen=True)
class TracedPass:
    """The sizes of what one pass makes, traced on fake tensors.

    Attributes:
        captured: the bytes the capture makes for the rows it captures at once
            (held through the pass, as the layers' arguments hold them).
        other: those bytes but the hidden states'.
        hidden: the hidden states of those rows.
        steps: per layer, the peak of the values its layer step makes for one
            sub-batch (new cache included).
        tail: the peak of the tail's values (the forward again, the final norm and
            the logits).
        inputs: the inputs made for the whole batch and held through the pass, where
            the pass captures one sub-batch at a time (0 otherwise).
    """

    captured: int
    other: int
    hidden: int
    steps: tuple[int, ...]
    tail: int
    inputs: int = 0


def spills_hidden(schedule) -> bool:
    """Whether a generation pass keeps its hidden states between layers on a tier
    (its schedule has spills): it then captures, and computes the logits of, one
    sub-batch at a time."""
    return any(step.kind == "spill.issue" for step in schedule.steps)


def predict_pass_memory(schedule, sizes: GenerationSizes, traced: TracedPass, past: int,
                        segments: Sequence[Sequence[int]] = ()) -> PassMemory:
    """The device memory of the generation pass that follows `past` positions,
    walked in its `schedule` (the one `generate` walks).

    At every moment of a pass the device holds:

    - the parameters and buffers that are not streamed (`parameters`);
    - what the capture made for all sub-batches (embeddings, rotary tables, masks),
      until the last layer step, and each sub-batch's hidden states between layers
      (`hidden`); in a prefill that offloads them, what the computing sub-batch's
      capture made but its hidden states, its hidden states, the next one's loading
      and the sources of the stores in flight;
    - the streamed weights of the layer computing and of the layers after it
      whose `fetch.issue` came before its step (`weights`: with `live_blocks=2`,
      the next one), each tensor padded as loads pad it;
    - the KV cache (`kv`): on a tier that copies nothing, every cache (the caches
      already computed by this pass at their new length); on one that copies, the
      cache of the (layer, sub-batch) computing and the loaded segments of those
      whose `load_kv.issue` came before its step, and the stores still in flight
      (the positions they write), in the order of the `store_kv.issue` steps;
    - the temporaries of the compiled layer step (`step`, traced);
    - at the tail, the last layer's outputs, their concatenation, and the forward
      run again (`tail`); in a prefill that offloads hidden states, one
      sub-batch's, after its last layer step;
    - when the prefill stores its caches: a sub-batch's output and new cache, the
      stores in flight, and the rows copied out for the store (those of a decode
      sub-batch that several prefill sub-batches fill, from the first one on).

    Not counted: the growing sequences and masks (a few bytes a token), the
    sampling warpers' temporaries, and the transients of the capture itself.

    Args:
        schedule: the pass's schedule (`generation_pass`), of every sub-batch.
        sizes: what the generation holds (`GenerationSizes`).
        traced: what the pass makes (`TracedPass`), traced for its sub-batches.
        past: positions each sequence has before the pass (0 for the prefill).
        segments: per layer, the positions of each stored segment the decode pass
            loads (on a tier that copies).
    """
    batch, n, kv_moves = sizes.batch, sizes.layers, sizes.kv_moves
    phase = schedule.steps[0].phase
    parts = sizes.prefill_subbatches if phase == "prefill" else sizes.num_subbatches
    size, decode_size = batch // parts, batch // sizes.num_subbatches
    query = sizes.length if phase == "prefill" else 1
    offloads = spills_hidden(schedule)
    captured, other, steps, tail = traced.captured, traced.other, traced.steps, traced.tail
    part_hidden = traced.hidden if offloads else traced.hidden // parts

    # The stores' sources in the order they are issued (the last
    # `kv_stores_in_flight` (layer, sub-batch)s' are alive), how many precede each
    # layer step, and the caches loading while it runs.
    issued, before, loading = [], {}, {}
    pending: set[tuple[int, int]] = set()
    # An offloading prefill: at each layer step, the spills not yet waited for
    # (their sources alive) and the fills issued but not yet waited for.
    spilling: set[tuple[int, int]] = set()
    filling: set[tuple[int, int]] = set()
    spills_alive, fills_loading = {}, {}
    fetching: set[int] = set()  # layers whose weights' loads were issued
    weights_at: dict[tuple[int, int], int] = {}
    for step in schedule.steps:
        where = (step.block, step.subbatch)
        if step.kind in ("spill.issue", "fill.issue"):
            (spilling if step.kind == "spill.issue" else filling).add(where)
        elif step.kind in ("spill.wait", "fill.wait"):
            (spilling if step.kind == "spill.wait" else filling).discard(where)
        if step.kind == "store_kv.issue" and kv_moves:
            if phase == "decode":
                written = merged_segments(segments[step.block], 1, sizes.kept(step.block, past + 1))[1]
                issued.append(sizes.cache_bytes(step.block, size, written))
            else:
                issued.append(sizes.cache_bytes(step.block, decode_size, sizes.kept(step.block, sizes.length)))
        elif step.kind == "load_kv.issue":
            pending.add((step.block, step.subbatch))
        elif step.kind == "fetch.issue":
            fetching.add(step.block)
        elif step.kind == "compute" and step.region == "block":
            weights_at[where] = sum(sizes.fetched(block) for block in fetching if block >= step.block)
            before[where] = len(issued)
            pending.discard(where)
            loading[where] = tuple(pending)
            spills_alive[where], fills_loading[where] = len(spilling), len(filling)

    def in_flight(count: int) -> int:
        return sum(issued[max(0, count - sizes.kv_stores_in_flight):count])

    # An offloading prefill fills every sequence's logits from its first tail on,
    # and holds the inputs made for the whole batch.
    logits = batch * sizes.vocab * 4 if offloads else 0

    def hidden_held(index: int, part: int) -> int:
        """The hidden states an offloading prefill holds at a layer step: what the
        step's capture keeps but its hidden states, the step's input, the next
        step's input loading, and the sources of the stores in flight."""
        loaded = sizes.machine.loaded_bytes(part_hidden)  # a load pads what it reads
        where = (index, part)
        return (traced.inputs + other + (part_hidden if index == 0 else loaded)
                + fills_loading[where] * loaded + spills_alive[where] * part_hidden)

    # Every moment of the pass.
    held = 0 if kv_moves else sum(sizes.cache_bytes(i, batch, sizes.kept(i, past)) for i in range(n))
    growth = [sizes.cache_bytes(i, size, sizes.kept(i, past + query)) - sizes.cache_bytes(
        i, size, sizes.kept(i, past)) for i in range(n)]
    moments: list[tuple[str, dict[str, int]]] = []
    grown = 0
    for index in range(n):
        for part in range(parts):
            common = {"parameters": sizes.resident, "weights": weights_at[index, part],
                      "hidden": hidden_held(index, part) if offloads
                      else captured + (parts if index else part) * part_hidden}
            if not kv_moves:
                # Prefill parts smaller than a decode sub-batch wait as pieces: the same bytes.
                moments.append((f"blk{index}.sb{part}", {**common, "kv": held + grown, "step": steps[index]}))
                grown += growth[index]
                continue
            stored = in_flight(before[index, part])
            if phase == "prefill":
                whole = sizes.cache_bytes(index, decode_size, sizes.kept(index, sizes.length))

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
                made = sizes.cache_bytes(index, size, sizes.kept(index, sizes.length))
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
            ahead = sum(sizes.loaded_cache(block, size, segments[block]) for block, _ in loading[index, part])
            own = segments[index]
            if len(own) > 1 and not sizes.in_place(index, size):
                joined = sizes.machine.loaded_bytes(sizes.cache_bytes(index, size, sum(own)))
                moments.append((f"take blk{index}.sb{part}", {
                    **common, "kv": stored + ahead + sizes.loaded_cache(index, size, own) + joined}))
            else:
                joined = sizes.loaded_cache(index, size, own)
            moments.append((f"blk{index}.sb{part}", {**common, "kv": stored + ahead + joined,
                                                     "step": steps[index]}))
    # The tail: every sub-batch's last output, their concatenation, and the
    # forward again, holding what it computes before the layers as the capture did
    # (the capture's own is gone after the last layer step).
    if not offloads:
        moments.append(("tail", {"parameters": sizes.resident, "hidden": captured + 2 * traced.hidden,
                                 "kv": 0 if kv_moves else held + grown, "tail": tail}))
    moment, terms = max(moments, key=lambda item: sum(item[1].values()))
    return PassMemory(phase, sum(terms.values()), sizes.resident, moment, terms)


def measured_peak_bytes(fn) -> int:
    """Peak bytes torch's CPU allocator handed out while `fn()` ran, relative to its
    start: the running sum of every allocation (+) and free (-) torch.profiler
    records. Memory allocated before the call is not seen; loads of the transfer
    engine are seen inside `slcompile.runtime.nvme.buffers_seen_by_profiler()`."""
    from torch.profiler import profile

    with profile(profile_memory=True) as prof:
        fn()
    events = sorted(
        (e.start_ns(), e.nbytes()) for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"
    )
    running = peak = 0
    for _, nbytes in events:
        running += nbytes
        peak = max(peak, running)
    return peak
