"""The time model of a compiled step: compute per region, transfers per lane, the
overlap the schedule allows, the predicted step time, and what bounds each block.

Where it sits: beside `slcompile.analysis.memory`, reading the same partitioned
graphs (`CompileReport.graphs`: the forward and backward with their `slc::` transfer
ops placed, or an inference graph). The graphs are the schedule as compiled: their
program order is the compute order, and each transfer is an issue + wait pair whose
distance is the overlap the schedule allows (`slcompile.vocabulary.transfer_kind`).
Nothing is changed and nothing runs.

The inputs:
- per compute node, FLOPs from torch's own formulas (`torch.utils.flop_counter`'s
  `flop_registry`, called on the node's shapes) and the bytes it reads and writes
  (its tensor inputs and outputs); its time is a roofline,
  `op_overhead + max(flops / matmul_rate(flops), bytes / memory_rate(bytes))` (each
  rate read off the profile's curve at the op's size), plus the
  bytes of its large outputs at the profile's rate for writing fresh memory;
- per transfer, its bytes (the loaded or stored tensor's) over the bandwidth of its
  tier in its direction (`MachineProfile.transfer_seconds`), plus a fixed latency.

The walk (`predict_time`): the graphs run in order (forward, backward) on one compute
lane; an issue starts its transfer on its lane (`link.h2d`, `link.d2h`, `disk`,
`network`) when both the compute lane has reached it and the lane is free (each lane
is serial); a wait blocks the compute lane until its transfer has finished. A
transfer issued by one graph for the next (the forward's last fetches, serving the
backward) carries over, and so does one issued by the backward for the next step's
forward: the step is walked three times and the second walk, the steady state, is
the prediction. The step's time is when its compute lane ends.

A generation pass is not one compiled graph: its layer steps are compiled regions
called in turn by its lowered pass graph. `predict_pass_time` reads that graph's
nodes in order (loads and stores of weights, caches and hidden states; layer steps
with the ops of their traced graphs) into the same timed actions and walks them on
the same lanes.

A block is bound by whichever resource is busiest for it: its compute, or the lane
of the transfers its compute waits for (loads) or made (stores).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple

import sympy
import torch
import torch.fx

from slcompile.meta import format_tag, get_slc_meta
from slcompile.vocabulary import stash_key_of

__all__ = [
    "ComputeCost", "TimedEvent", "BlockTime", "TimePrediction", "count_cost", "predict_time", "region_costs",
    "LANE_RESOURCE", "predict_pass_time", "graph_cost", "step_seconds",
]

log = logging.getLogger(__name__)

LANE_RESOURCE = MappingProxyType(
    {"compute": "compute", "link.h2d": "link", "link.d2h": "link", "disk": "disk", "network": "network"})
"""The resource a lane uses: what bounds a block whose busiest lane it is."""

# Loads move tier -> device; stores device -> tier.
_DIRECTION = MappingProxyType({"fetch": "read", "unstash": "read", "stash": "write", "store_grad": "write"})
# aten ops of the CPU build without a formula of their own, counted by the formula of
# the op they compute the same thing as (same leading arguments).
_SAME_FORMULA = MappingProxyType({
    "_scaled_dot_product_flash_attention_for_cpu": "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_flash_attention_for_cpu_backward": "_scaled_dot_product_flash_attention_backward",
})


@dataclasses.dataclass(frozen=True)
class ComputeCost:
    """What one compute node costs, for the example sizes.

    Attributes:
        flops: floating-point operations (torch's flop counter formulas; 0 for ops
            without one: they are bound by bytes).
        nbytes: bytes read and written (tensor inputs and outputs).
        large_output_bytes: bytes of its outputs of at least
            `slcompile.analysis.machine.LARGE_OUTPUT` bytes each.
    """

    flops: int = 0
    nbytes: int = 0
    large_output_bytes: int = 0

    def __add__(self, other: ComputeCost) -> ComputeCost:
        return ComputeCost(self.flops + other.flops, self.nbytes + other.nbytes,
                           self.large_output_bytes + other.large_output_bytes)


@dataclasses.dataclass(frozen=True)
class TimedEvent:
    """One interval of the predicted timeline.

    Attributes:
        lane: "compute", or a transfer lane ("link.h2d", "link.d2h", "disk", "network").
        kind: "compute", "stall" (the compute lane waiting for a transfer), or the
            transfer's kind ("fetch", "stash", "unstash", "store_grad"; "spill" and
            "fill" for a boundary activation stored while it waits and loaded back).
        region: the block it belongs to (`blk3`), "prefix", "suffix" or "other".
        phase: "fwd", "bwd" or "inference".
        start, end: seconds from the step's start.
        nbytes: bytes moved (transfers) or read and written (compute).
        flops: FLOPs (compute).
        subbatch: the sub-batch of the unit it belongs to, or None (work shared by
            every sub-batch, a weight load, a generation pass's action).
    """

    lane: str
    kind: str
    region: str
    phase: str
    start: float
    end: float
    nbytes: int = 0
    flops: int = 0
    subbatch: int | None = None

    @property
    def unit(self) -> str:
        """The unit's name: `blk3.sb1`, or the region alone (`blk3`, "prefix")."""
        return self.region if self.subbatch is None else f"{self.region}.sb{self.subbatch}"

    @property
    def seconds(self) -> float:
        return self.end - self.start


@dataclasses.dataclass(frozen=True)
class BlockTime:
    """One region's share of the step.

    Attributes:
        region: `blk3`, "prefix", "suffix" or "other".
        compute_seconds: its compute (both phases).
        stall_seconds: the compute lane's waits for transfers inside it.
        lane_seconds: per transfer lane, the busy time of its transfers.
        flops, nbytes: its compute's FLOPs and bytes.
    """

    region: str
    compute_seconds: float
    stall_seconds: float
    lane_seconds: Mapping[str, float]
    flops: int
    nbytes: int

    @property
    def bound(self) -> str:
        """"compute", "link", "disk" or "network": the busiest resource."""
        return _busiest({"compute": self.compute_seconds, **self.lane_seconds})


@dataclasses.dataclass(frozen=True)
class TimePrediction:
    """The predicted timeline of one steady-state step.

    Attributes:
        profile: the machine profile's name.
        step_seconds: the predicted step time.
        events: the timeline (compute runs per region, stalls, transfers).
        blocks: per region: the prefix, the blocks by index, the suffix, untagged work.
        tokens: tokens per step (the batch's elements along its batch and sequence
            dims), or None when unknown; `tokens_per_second` then None.
        peak_flops: the profile's matmul rate (for MFU).
        slow_step_seconds: the step time at the medians of the measured rates'
            repeats instead of their bests (`MachineProfile.at_spread`): with
            `step_seconds`, the interval the prediction gives; None for a profile
            that recorded no spread.
        policy: the schedule policy the step was planned by, or None (unknown).
        num_subbatches: its number of sub-batches K, or None.
    """

    profile: str
    step_seconds: float
    events: tuple[TimedEvent, ...]
    blocks: tuple[BlockTime, ...]
    tokens: int | None = None
    peak_flops: float | None = None
    slow_step_seconds: float | None = None
    policy: str | None = None
    num_subbatches: int | None = None

    @property
    def title(self) -> str:
        """`speedloader, K=4, on vm-cpu`: what was predicted, on which profile."""
        parts = [part for part, value in ((self.policy, self.policy),
                                          (f"K={self.num_subbatches}", self.num_subbatches)) if value]
        return ", ".join([*parts, f"on {self.profile}"])

    @property
    def compute_seconds(self) -> float:
        return sum(e.seconds for e in self.events if e.kind == "compute")

    @property
    def stall_seconds(self) -> float:
        return sum(e.seconds for e in self.events if e.kind == "stall")

    @property
    def flops(self) -> int:
        return sum(e.flops for e in self.events if e.kind == "compute")

    def lane_seconds(self) -> dict[str, float]:
        """Busy seconds per lane (the compute lane's stalls not counted)."""
        busy: dict[str, float] = {}
        for event in self.events:
            if event.kind != "stall":
                busy[event.lane] = busy.get(event.lane, 0.0) + event.seconds
        return busy

    def lane_bytes(self) -> dict[str, int]:
        moved: dict[str, int] = {}
        for event in self.events:
            if event.lane != "compute":
                moved[event.lane] = moved.get(event.lane, 0) + event.nbytes
        return moved

    @property
    def bound(self) -> str:
        """The step's busiest resource: "compute", "link", "disk" or "network"."""
        return _busiest(self.lane_seconds())

    @property
    def tokens_per_second(self) -> float | None:
        return self.tokens / self.step_seconds if self.tokens and self.step_seconds > 0 else None

    @property
    def mfu(self) -> float | None:
        """The model FLOPs' share of the profile's matmul rate over the step."""
        if not self.peak_flops or self.step_seconds <= 0:
            return None
        return self.flops / self.step_seconds / self.peak_flops

    def __str__(self) -> str:
        from slcompile.units import format_bytes

        lanes = self.lane_seconds()
        moved = self.lane_bytes()
        lines = [f"predicted time ({self.title}; a prediction, not a measurement):",
                 f"  step {_ms(self.step_seconds)}"
                 + (f" to {_ms(self.slow_step_seconds)} (the measured rates' best to median)"
                    if self.slow_step_seconds is not None else "")
                 + f", bound by {self.bound}"
                 + (f", {self.tokens_per_second:,.0f} tokens/s" if self.tokens_per_second else "")
                 + (f", MFU {self.mfu:.1%}" if self.mfu is not None else ""),
                 f"  compute {_ms(self.compute_seconds)} ({self.flops / 1e9:.3g} GFLOP), "
                 f"stalled {_ms(self.stall_seconds)}"]
        for lane in sorted(lane for lane in lanes if lane != "compute"):
            lines.append(f"  lane {lane}: busy {_ms(lanes[lane])}, {format_bytes(moved.get(lane, 0))}")
        lines.append("  per block: compute | stall | transfers per lane | bound")
        for block in self.blocks:
            transfers = ", ".join(f"{lane} {_ms(s)}" for lane, s in sorted(block.lane_seconds.items())) or "-"
            lines.append(f"    {block.region}: {_ms(block.compute_seconds)} | {_ms(block.stall_seconds)} | "
                         f"{transfers} | {block.bound}")
        return "\n".join(lines)


def _busiest(busy: Mapping[str, float]) -> str:
    """The resource of the busiest lane; compute on a tie (a transfer that takes as
    long as the compute it hides behind does not slow the step)."""
    lane = max(busy, key=lambda name: (busy[name], name == "compute"), default="compute")
    return LANE_RESOURCE[lane]


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


# -- counting ---------------------------------------------------------------------


def _concrete_int(value, subs: Mapping[sympy.Symbol, int]) -> int:
    if isinstance(value, torch.SymInt):
        hint = value.node.hint
        if hint is not None:
            return int(hint)
        return int(sympy.sympify(value.node.expr).subs(subs))
    return int(value)


def _concrete(value, subs: Mapping[sympy.Symbol, int]):
    """A meta tensor of the same dtype and concrete shape as a (fake) tensor value;
    other values as they are (SymInts as ints)."""
    if isinstance(value, torch.Tensor):
        shape = tuple(_concrete_int(d, subs) for d in value.shape)
        return torch.empty(shape, dtype=value.dtype, device="meta")
    if isinstance(value, torch.SymInt):
        return _concrete_int(value, subs)
    if isinstance(value, (list, tuple)):
        return type(value)(_concrete(v, subs) for v in value)
    return value


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


def _formula(target):
    from torch.utils.flop_counter import flop_registry

    packet = getattr(target, "overloadpacket", None)
    if packet is None:
        return None
    if packet in flop_registry:
        return flop_registry[packet]
    alias = _SAME_FORMULA.get(packet.__name__.split(".")[-1])
    if alias is not None:
        return flop_registry.get(getattr(torch.ops.aten, alias))
    return None


def count_cost(node: torch.fx.Node, subs: Mapping[sympy.Symbol, int] | None = None) -> ComputeCost:
    """FLOPs (torch's flop counter formula for the op, if it has one) and bytes read
    and written of one compute node, for the sizes `subs` (default: the size hints).
    """
    subs = subs or {}
    value = node.meta.get("val")
    out = _concrete(value, subs)

    def arg_value(arg):
        if isinstance(arg, torch.fx.Node):
            return _concrete(arg.meta.get("val"), subs)
        return arg

    args = torch.fx.node.map_aggregate(node.args, arg_value)
    kwargs = torch.fx.node.map_aggregate(node.kwargs, arg_value)
    from slcompile.analysis.machine import LARGE_OUTPUT

    inputs = [a for a in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(a, torch.Tensor)]
    nbytes = _tensor_bytes(out) + sum(_tensor_bytes(a) for a in inputs)
    large = sum(n for n in map(_tensor_bytes, torch.utils._pytree.tree_leaves(out)) if n >= LARGE_OUTPUT)
    flops = 0
    formula = _formula(node.target)
    if formula is not None:
        try:
            flops = int(formula(*args, **kwargs, out_val=out))
        except Exception as err:  # noqa: BLE001  (a formula that does not take this call: bytes only)
            log.debug("no FLOP count for %s: %s", node.target, err)
    return ComputeCost(flops, nbytes, large)


def _region(node: torch.fx.Node) -> str:
    return _unit(node)[0]


def _unit(node: torch.fx.Node) -> tuple[str, int | None]:
    """(region, sub-batch) of a node: `("blk3", 1)`; ("other", None) untagged."""
    meta = get_slc_meta(node) if node.op == "call_function" else None
    if meta is None:
        return "other", None
    return format_tag(meta.region, meta.block, None), meta.subbatch


def region_costs(gm: torch.fx.GraphModule, subs: Mapping[sympy.Symbol, int] | None = None) -> dict[str, ComputeCost]:
    """FLOPs and bytes of each region's compute nodes in one graph."""
    from slcompile.vocabulary import is_compute

    costs: dict[str, ComputeCost] = {}
    for node in gm.graph.nodes:
        if is_compute(node):
            region = _region(node)
            costs[region] = costs.get(region, ComputeCost()) + count_cost(node, subs)
    return costs


def step_seconds(
    gm: torch.fx.GraphModule, phase: str, profile, lowering: str = "aot_eager",
    subs: Mapping[sympy.Symbol, int] | None = None,
) -> dict[tuple[str, tuple], float]:
    """Predicted seconds of each compute step of one graph: (phase, (region, block,
    sub-batch)) -> the time of its compute nodes on `profile`. A node shared by
    the sub-batches (a weight gradient summed over all of them) counts to the step
    before it in program order, which the schedule's order puts first."""
    from slcompile.vocabulary import is_compute

    seconds: dict[tuple[str, tuple], float] = {}
    current = None
    for node in gm.graph.nodes:
        if not is_compute(node):
            continue
        meta = get_slc_meta(node) if node.op == "call_function" else None
        if meta is not None and meta.subbatch is not None:
            current = (phase, (meta.region, meta.block, meta.subbatch))
        if current is None:
            continue
        seconds[current] = seconds.get(current, 0.0) + profile.compute_seconds(count_cost(node, subs), lowering)
    return seconds


def graph_cost(gm: torch.fx.GraphModule, subs: Mapping[sympy.Symbol, int] | None = None) -> tuple[ComputeCost, ...]:
    """The cost of each compute node of a graph, in program order."""
    from slcompile.vocabulary import is_compute

    return tuple(count_cost(node, subs) for node in gm.graph.nodes if is_compute(node))


# -- the walk ---------------------------------------------------------------------


@dataclasses.dataclass
class _Lanes:
    """The state of one walk: the compute lane's clock, when each transfer lane is
    free, and the transfers in flight by key."""

    clock: float = 0.0
    free: dict[str, float] = dataclasses.field(default_factory=dict)
    # key -> (end, lane, index of its event or None)
    pending: dict[object, tuple[float, str, int | None]] = dataclasses.field(default_factory=dict)
    events: list[TimedEvent] = dataclasses.field(default_factory=list)


def predict_time(
    forward: torch.fx.GraphModule,
    backward: torch.fx.GraphModule | None = None,
    *,
    profile,
    tiers: Mapping[str, str] | None = None,
    lowering: str = "aot_eager",
    sizes: Mapping[sympy.Symbol, int] | None = None,
    tokens: int | None = None,
    phase: str | None = None,
) -> TimePrediction:
    """Predicts the steady-state step time of compiled graphs on a machine.

    Args:
        forward: the forward graph (or an inference graph).
        backward: the backward graph of a training step, or None.
        profile: the `MachineProfile` (rates of the machine).
        tiers: where each transfer kind's data rests: keys "fetch" (the weights'
            tier), "stash"/"unstash" (the activations'), "store_grad" (the
            gradients'); values "device", "host" or "nvme" (default "host").
        lowering: "aot_eager" (one launch per op) or "inductor" (fused: a launch
            and the bytes of its output alone for an op without FLOPs, see
            `MachineProfile.compute_seconds`).
        sizes: values of the size symbols; default: the example inputs'.
        tokens: tokens per step, for tokens/s.
        phase: the name of a lone graph's phase ("fwd" or "inference").
    """
    from slcompile.analysis.memory import size_hints

    graphs = [forward] + ([backward] if backward is not None else [])
    phases = ["fwd", "bwd"] if backward is not None else [phase or "fwd"]
    subs = dict(sizes if sizes is not None else size_hints(*graphs))
    tiers = dict(tiers or {})
    from slcompile.vocabulary import is_fetch

    fetch_bytes = {node.args[1]: _tensor_bytes(_concrete(node.meta.get("val"), subs))
                   for gm in graphs for node in gm.graph.nodes if is_fetch(node)}
    plans = [_graph_plan(gm, subs, profile, tiers, lowering, fetch_bytes) for gm in graphs]
    lanes = _Lanes()
    bounds = []  # (clock, number of events) at the start of each walk
    # The first walk fills the lanes as the step before would have; the third waits
    # for the loads the second issued for it, naming the region that needed them.
    for _ in range(3):
        bounds.append((lanes.clock, len(lanes.events)))
        for ph, plan in zip(phases, plans):
            _walk(plan, ph, lanes)
    (start, first_event), (end, last_event) = bounds[1], bounds[2]
    # The steady-state step: the second walk, shifted to start at 0.
    events = tuple(dataclasses.replace(e, start=e.start - start, end=e.end - start)
                   for e in lanes.events[first_event:last_event])
    step = end - start
    return TimePrediction(
        profile=profile.name, step_seconds=step, events=events, blocks=_blocks(events), tokens=tokens,
        peak_flops=profile.matmul_flops,
    )


class _Compute(NamedTuple):
    """A run of compute of one unit, its seconds on the profile."""

    region: str
    seconds: float
    flops: int = 0
    nbytes: int = 0
    subbatch: int | None = None


class _Issue(NamedTuple):
    """A transfer issued on its lane: `kind` as the timeline names it ("spill" for
    a stash of a boundary activation)."""

    key: Any
    lane: str
    seconds: float
    kind: str
    region: str
    nbytes: int
    subbatch: int | None = None


class _Wait(NamedTuple):
    """The compute lane waits for the transfer `key` (issuing `fallback` first when
    nothing issued it)."""

    key: Any
    region: str
    fallback: _Issue | None = None
    subbatch: int | None = None


def _graph_plan(gm, subs, profile, tiers, lowering, fetch_bytes) -> list[_Compute | _Issue | _Wait]:
    """The graph as a list of timed actions, in program order. An activation's
    stash or load is timed on the tier its key names (a unit's own, `Step.tier`),
    else the stash's (`tiers`); a spilled boundary activation's are named "spill"
    and "fill"."""
    from slcompile.vocabulary import is_compute, transfer_kind

    actions: list[_Compute | _Issue | _Wait] = []
    for node in gm.graph.nodes:
        kind = transfer_kind(node)
        if kind is not None:
            what, half = kind
            region, subbatch = _unit(node)
            tier, shown = tiers.get(what, "host"), what
            if what in ("stash", "unstash"):
                key = stash_key_of(node)
                if key is not None:
                    tier = key.tier or tier
                    shown = ("spill" if what == "stash" else "fill") if key.spills else what
            if half == "issue":
                nbytes = _transfer_bytes(node, what, subs, fetch_bytes)
                lane, seconds = profile.transfer_seconds(tier, _DIRECTION[what], nbytes)
                actions.append(_Issue(_transfer_key(node, what), lane, seconds, shown, region, nbytes, subbatch))
            else:
                key = _transfer_key(node, what, wait=True)
                fallback = None
                if what == "fetch":  # a fetch without an issue loads at its wait
                    nbytes = fetch_bytes.get(node.args[1], 0)
                    lane, seconds = profile.transfer_seconds(tier, "read", nbytes)
                    fallback = _Issue(key, lane, seconds, what, region, nbytes)
                actions.append(_Wait(key, region, fallback, subbatch))
            seconds = profile.transfer_op_cost(node.target._schema.name.split("::")[1], tier)
            if seconds:
                actions.append(_Compute(region, seconds, subbatch=subbatch))
        elif is_compute(node):
            cost = count_cost(node, subs)
            seconds = profile.compute_seconds(cost, lowering)
            region, subbatch = _unit(node)
            last = actions[-1] if actions else None
            if isinstance(last, _Compute) and (last.region, last.subbatch) == (region, subbatch):
                actions[-1] = last._replace(seconds=last.seconds + seconds, flops=last.flops + cost.flops,
                                            nbytes=last.nbytes + cost.nbytes)
            else:
                actions.append(_Compute(region, seconds, cost.flops, cost.nbytes, subbatch))
    return actions


def _transfer_key(node: torch.fx.Node, what: str, wait: bool = False):
    """What pairs an issue with its wait: the weight key for fetches (the issue may
    be in the graph before), else the issue node itself."""
    if what == "fetch":
        return ("fetch", node.args[1] if wait else node.args[0])
    if wait:
        return ("node", id(node.graph), node.args[0].name)
    return ("node", id(node.graph), node.name)


def _transfer_bytes(node: torch.fx.Node, what: str, subs, fetch_bytes: Mapping[str, int]) -> int:
    """Bytes a transfer issue moves: the stored tensor's, or (loads) the loaded value's."""
    from slcompile.vocabulary import UNSTASH_WAIT

    if what in ("stash", "store_grad"):
        return _tensor_bytes(_concrete(node.args[0].meta.get("val"), subs))
    if what == "unstash":
        waits = [u for u in node.users if u.op == "call_function" and u.target is UNSTASH_WAIT]
        return sum(_tensor_bytes(_concrete(w.meta.get("val"), subs)) for w in waits)
    return fetch_bytes.get(node.args[0], 0)


def _walk(plan: Sequence[_Compute | _Issue | _Wait], phase: str, lanes: _Lanes) -> None:
    for action in plan:
        if isinstance(action, _Compute):
            if action.seconds > 0:
                lanes.events.append(TimedEvent("compute", "compute", action.region, phase, lanes.clock,
                                               lanes.clock + action.seconds, action.nbytes, action.flops,
                                               action.subbatch))
                lanes.clock += action.seconds
        elif isinstance(action, _Issue):
            _issue(action, phase, lanes)
        else:
            if action.key not in lanes.pending and action.fallback is not None:
                _issue(action.fallback, phase, lanes)
            end, lane, index = lanes.pending.pop(action.key, (lanes.clock, "compute", None))
            if index is not None and lanes.events[index].kind in ("fetch", "unstash", "fill"):
                # A load belongs to the unit that needs it, not to where it was issued.
                lanes.events[index] = dataclasses.replace(lanes.events[index], region=action.region,
                                                          subbatch=action.subbatch)
            if end > lanes.clock:
                lanes.events.append(TimedEvent("compute", "stall", action.region, phase, lanes.clock, end,
                                               subbatch=action.subbatch))
                lanes.clock = end


def _issue(action: _Issue, phase: str, lanes: _Lanes) -> None:
    start = max(lanes.clock, lanes.free.get(action.lane, 0.0))
    end = start + action.seconds
    lanes.free[action.lane] = end
    index = None
    if action.seconds > 0:
        index = len(lanes.events)
        lanes.events.append(TimedEvent(action.lane, action.kind, action.region, phase, start, end, action.nbytes,
                                       subbatch=action.subbatch))
    lanes.pending[action.key] = (end, action.lane, index)


def _blocks(events: Sequence[TimedEvent]) -> tuple[BlockTime, ...]:
    order: list[str] = []
    compute: dict[str, float] = {}
    stall: dict[str, float] = {}
    lanes: dict[str, dict[str, float]] = {}
    flops: dict[str, int] = {}
    nbytes: dict[str, int] = {}
    for e in events:
        if e.region not in compute:
            order.append(e.region)
            compute[e.region], stall[e.region], lanes[e.region] = 0.0, 0.0, {}
            flops[e.region] = nbytes[e.region] = 0
        if e.kind == "compute":
            compute[e.region] += e.seconds
            flops[e.region] += e.flops
            nbytes[e.region] += e.nbytes
        elif e.kind == "stall":
            stall[e.region] += e.seconds
        else:
            lanes[e.region][e.lane] = lanes[e.region].get(e.lane, 0.0) + e.seconds
    return tuple(BlockTime(r, compute[r], stall[r], lanes[r], flops[r], nbytes[r]) for r in sorted(order, key=_order))


def _order(region: str) -> tuple[int, int]:
    """prefix, the blocks by index, suffix, then untagged work."""
    if region.startswith("blk"):
        return 1, int(region[3:])
    return {"prefix": (0, 0), "suffix": (2, 0)}.get(region, (3, 0))



# -- a generation pass, read from its lowered graph ----------------------------------


_PASS_MOVES = MappingProxyType({
    "fetch_issue": ("load", "w", "fetch"), "issue": ("load", "kv", "unstash"), "store": ("store", "kv", "stash"),
    "unstash": ("load", "h", "fill"), "stash": ("store", "h", "spill"),
})
"""What a pass graph's transfer node (`pass_role`) moves: (direction, what: "w" a
layer's weights, "kv" its cache, "h" a sub-batch's hidden states, the timeline's
kind). A weight's and a fill's wait add nothing: the layer step that takes them
waits for their load; a spill's wait (`slc::wait`) stalls until its store is done."""


def _pass_plan(graph, moves, costs, tail, profile, lowering) -> list[_Compute | _Issue | _Wait]:
    """A generation pass's lowered graph as the walk's timed actions, node by node.

    A layer's weights are one load, at its first `fetch_issue`; each load or store
    of a tier that copies is one issue of the sizes `moves` gives (one transfer a
    tensor) and pays `transfer_op_seconds`; each layer step first waits for what
    is still loading of its layer's weights, its cache and its input (each wait
    paying `transfer_op_seconds`), then runs its ops plus a compiled call and a
    layer step's fixed cost; a tail runs its ops; the pass's fixed cost comes first.
    """
    from slcompile.analysis.pass_memory import pass_nodes, pass_role

    actions: list[_Compute | _Issue | _Wait] = []
    if profile.pass_seconds:
        actions.append(_Compute("prefix", profile.pass_seconds))
    loading: set[tuple] = set()  # loads issued and not yet waited for
    storing: set[tuple] = set()  # stores issued and not yet waited for
    fetched: set[int] = set()

    def op_cost(region: str, subbatch: int | None) -> None:
        if profile.transfer_op_seconds:
            actions.append(_Compute(region, profile.transfer_op_seconds, subbatch=subbatch))

    for node in pass_nodes(graph):
        kind, block, subbatch = pass_role(node) or ("", None, None)
        region = format_tag("block", block, None) if block is not None else ""
        if kind == "fetch_issue":
            if block in fetched:
                continue
            fetched.add(block)
            subbatch = None  # a layer's weights serve every sub-batch
        if kind in _PASS_MOVES:
            direction, what, shown = _PASS_MOVES[kind]
            key = (direction, what, block, subbatch)
            tier, sizes = moves(direction, what, block, subbatch)
            lane, seconds = "compute", 0.0
            for nbytes in sizes:
                lane, part = profile.transfer_seconds(tier, "read" if direction == "load" else "write", nbytes)
                seconds += part
            if lane == "compute":
                continue  # the tier is the device's memory: nothing moves
            actions.append(_Issue(key, lane, seconds, shown, region, sum(sizes), subbatch))
            (loading if direction == "load" else storing).add(key)
            op_cost(region, subbatch)
        elif kind == "wait" and ("store", "h", block, subbatch) in storing:
            storing.discard(("store", "h", block, subbatch))
            actions.append(_Wait(("store", "h", block, subbatch), region, subbatch=subbatch))
            op_cost(region, subbatch)
        elif kind == "step":
            for key in (("load", "w", block, None), ("load", "kv", block, subbatch),
                        ("load", "h", block - 1, subbatch)):
                if key in loading:
                    loading.discard(key)
                    actions.append(_Wait(key, region, subbatch=subbatch))
                    op_cost(region, subbatch)
            total = sum(costs[block], ComputeCost())
            seconds = sum(profile.compute_seconds(cost, lowering) for cost in costs[block])
            seconds += profile.call_overhead_seconds + profile.layer_step_seconds
            actions.append(_Compute(region, seconds, total.flops, total.nbytes, subbatch))
        elif kind == "suffix":
            total = sum(tail, ComputeCost())
            seconds = sum(profile.compute_seconds(cost, lowering) for cost in tail)
            actions.append(_Compute("suffix", seconds, total.flops, total.nbytes, subbatch))
    return actions


def predict_pass_time(
    graph,
    *,
    moves,
    costs: Sequence[Sequence[ComputeCost]],
    tail: Sequence[ComputeCost],
    profile,
    phase: str,
    lowering: str = "inductor",
    tokens: int | None = None,
) -> TimePrediction:
    """Predicts one generation pass from its lowered graph (`slcompile.inference.
    pass_graph.lower_pass`, the graph `generate` runs), on the lanes and by the
    walk of a compiled step (`predict_time`), walked once from idle lanes: nothing
    carries over between passes (each loads its first layer's weights itself).

    A load or store is issued on its tier's lane when the compute lane reaches it
    and the lane is free (`MachineProfile.transfer_seconds`, one transfer per
    tensor); a layer step waits for its loads and takes its ops' time as a compiled
    graph's (`MachineProfile.compute_seconds` for the lowering) plus
    `call_overhead_seconds` and `layer_step_seconds`; the pass pays `pass_seconds`
    once; each issue and each wait pays `transfer_op_seconds` on the compute lane.
    The pass ends when its compute and every store have finished (a pass flushes
    its stores).

    Args:
        graph: the pass's `PassGraph` or its `torch.fx.Graph`.
        moves: `moves(direction, what, block, subbatch)` -> (tier, the bytes of each
            tensor moved): direction "load" or "store"; what "w" (a layer's
            weights; subbatch None), "kv" (a (layer, sub-batch)'s cache) or "h"
            (the hidden states a sub-batch's layer step made).
        costs: per layer, the cost of each op of its step (`graph_cost` of its
            traced graph).
        tail: the cost of each op of the tail.
        profile: the `MachineProfile`.
        phase: "prefill" or "decode": the events' phase.
        lowering: as `predict_time`'s.
        tokens: tokens the pass computes, for tokens/s.
    """
    lanes = _Lanes()
    end = 0.0
    for action in _pass_plan(graph, moves, costs, tail, profile, lowering):
        _walk((action,), phase, lanes)
        if isinstance(action, _Issue) and action.kind in ("stash", "spill"):
            end = max(end, lanes.pending[action.key][0])
    if end > lanes.clock:
        lanes.events.append(TimedEvent("compute", "stall", "other", phase, lanes.clock, end))
    events = tuple(lanes.events)
    return TimePrediction(profile=profile.name, step_seconds=max(end, lanes.clock), events=events,
                          blocks=_blocks(events), tokens=tokens, peak_flops=profile.matmul_flops)
