"""Machine profiles: the rates the time model (`slcompile.analysis.time`) scales
FLOPs and bytes by; and machine facts (`MachineFacts`): what the memory model
depends on about the machine (which tiers copy, how loads pad, how many ranks the
weights shard over), found once per compile.

A `MachineProfile` is plain data: measured on the current machine once
(`slcompile.profile.measure_profile`, a few seconds, cached on disk), or one of
`NAMED_PROFILES` for a machine you are not on (`profile("h100-pcie5-nvme")`). The
named profiles' rates are published figures derated to what is usually reached;
they are assumptions, and say so in their `source`.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Mapping
from types import MappingProxyType

__all__ = ["MachineProfile", "MachineFacts", "ProcessFacts", "NAMED_PROFILES", "named_profile", "LARGE_OUTPUT"]

LARGE_OUTPUT = 64 << 10
"""Outputs of at least this many bytes pay `MachineProfile.output_seconds_per_byte`."""

TRUSTED_SPREAD = 0.25
"""A measured matmul or bandwidth rate whose repeats' median lies further than this
fraction beyond their best was disturbed while measured (`MachineProfile.trust_problem`)."""

_INF = math.inf


@dataclasses.dataclass(frozen=True)
class MachineFacts:
    """What a plan's memory depends on about the machine, found once
    (`slcompile.facts.machine_facts`) and handed to the analyses as plain data.
    The defaults are a GPU's with one rank: only the device tier is the device's
    memory, loads take their own size.

    Attributes:
        device: the compute device's type ("cpu", "cuda").
        resident_tiers: the tiers whose memory is the device's own, so a transfer
            between them copies nothing ("device"; "host" too on a CPU-only machine).
        load_granularity: a tensor loaded from a tier that copies takes its size
            rounded up to this (a page on a CPU machine, whose loads read files
            straight into page-padded memory; 1 on a GPU).
        load_overhead: bytes each loaded tensor takes beyond that (0; a page where the
            allocator's own view is measured: `slcompile.runtime.storage.nvme.buffers_seen_by_profiler`).
        world_size: the ranks the streamed weights are sharded over (`shard_weights`;
            1: not sharded).
    """

    device: str = "cuda"
    resident_tiers: frozenset[str] = frozenset({"device"})
    load_granularity: int = 1
    load_overhead: int = 0
    world_size: int = 1

    def copies(self, tier: str) -> bool:
        """Whether moving a tensor between the device and `tier` copies it."""
        return tier not in self.resident_tiers

    def loaded_bytes(self, nbytes: int) -> int:
        """The device bytes a tensor of `nbytes` loaded from a tier that copies takes."""
        return -(-nbytes // self.load_granularity) * self.load_granularity + self.load_overhead

    @property
    def host_is_device(self) -> bool:
        """The host tier is the device's own memory (a CPU-only machine)."""
        return not self.copies("host")


@dataclasses.dataclass(frozen=True)
class ProcessFacts:
    """What the Dynamo stage's passes need to know of the machine and of the process
    it runs in, found once by the backend before they run
    (`slcompile.facts.process_facts`) and handed to them as plain data, so
    that compiling never asks the runtime.

    Attributes:
        machine: the machine's facts (which tiers copy, how loads pad, the ranks
            sharded weights are split over).
        stored_keys: `id` of each of the graph's parameters that an earlier graph
            already offloaded -> the key its values are stored under.
        optimizer_held: `id` of each of the graph's parameters an offloaded
            optimizer steps (their gradients leave the device) -> the tier that
            optimizer takes gradients on.
    """

    machine: MachineFacts = MachineFacts()
    stored_keys: Mapping[int, str] = dataclasses.field(default_factory=dict)
    optimizer_held: Mapping[int, str] = dataclasses.field(default_factory=dict)

    def stored_key(self, streamer: str, name: str, param) -> str:
        """The key `param` is stored under when the streamer named `streamer` streams
        it as `name`: the key it already has if an earlier graph offloaded it."""
        return self.stored_keys.get(id(param), f"{streamer}:{name}")


@dataclasses.dataclass(frozen=True)
class MachineProfile:
    """The rates of one machine.

    Attributes:
        name: what the profile is of (a host name, or a named profile's name).
        matmul_flops: FLOP/s of a large dense matrix product in the compute dtype.
        memory_bandwidth: bytes/s the device reads plus writes in an elementwise op
            (the fastest of `bandwidth_curve` where it is measured).
        op_overhead_seconds: fixed time per op (eager dispatch on a CPU; a kernel
            launch on a GPU).
        transfer_op_seconds: fixed compute-lane time of each `slc::` transfer op
            (issuing or waiting: Python and bookkeeping on the compute thread),
            where `transfer_op_costs` names no time of its own for the op.
        transfer_op_costs: ("op@tier", seconds) pairs: the host time of each kind
            of `slc::` op as a compiled step runs it, by the tier its data rests on
            (`fetch_issue@nvme`, `unstash_wait@host`, `mark@nvme`), measured by
            `slcompile.profile.measure_profile` (`steps=True`) with
            `slcompile.step_profile`; an op not listed costs `transfer_op_seconds`.
        output_seconds_per_byte: time per byte of an op's large output (at least
            `LARGE_OUTPUT` bytes) beyond its roofline: writing fresh memory (on a
            CPU, first touches of pages the allocator maps anew). Fitted from
            measured steps (`slcompile.profile.measure_profile(steps=True)`); 0 where
            unknown.
        compute_scale: what a compiled step's compute nodes take over the roofline
            of the measured rates (the rates themselves stay as measured): fitted on
            a CPU from compiled steps (`slcompile.profile.measure_profile(steps=True)`),
            where the products of a step's shapes reach a different share of the
            rate than square ones, and where it carries the level the rates were
            measured at in that run into every prediction alike; 1.0 where unknown.
        call_overhead_seconds: fixed time of one call of a compiled region from
            Python (Dynamo's guards and the compiled wrapper): what each layer step
            of a generation pays beyond its ops.
        layer_step_seconds: what each (layer, sub-batch) step of a generation pass
            pays beyond its ops and its call: the executor's bookkeeping, the layer's
            arguments and the guards of a real layer's inputs, its cache taken and
            kept. Fitted from generation passes of a small Hugging Face Llama
            (`measure_profile(steps=True)`); 0 where unknown.
        pass_seconds: what each generation pass pays once beyond its predicted
            ops: the capture of the layers' arguments through the model's own
            forward, the tail's Python, the pass's records. Fitted with
            `layer_step_seconds`; 0 where unknown.
        link_h2d, link_d2h: host <-> device bytes/s (pinned copies); `inf` where the
            host's memory is the device's (a CPU-only machine: nothing is copied).
        link_latency_seconds: fixed cost of one host transfer.
        nvme_read, nvme_write: the disk's bytes/s for large O_DIRECT transfers.
        nvme_latency_seconds: fixed cost of one nvme transfer (so small transfers
            reach less of the bandwidth: `bytes / (latency + bytes / rate)`).
        network: bytes/s per rank of a collective (all-gather, reduce-scatter).
        network_latency_seconds: fixed cost of one collective.
        source: how the rates were found ("measured on ... in 3.1 s", or the
            assumptions of a named profile).
        matmul_curve: (FLOPs of one product, FLOP/s it reached) at a few sizes,
            smallest first: small products reach less of the rate. An op's rate is
            interpolated in log FLOPs between them (clamped at the ends; capped by
            `matmul_flops`); empty: `matmul_flops` for every op.
        bandwidth_curve: (bytes an elementwise op read plus wrote, bytes/s it
            reached) at a few working sets, smallest first: one that fits in the
            caches moves its bytes faster than one that streams from memory. An op's
            rate is interpolated in log bytes between them (clamped at the ends;
            capped by `memory_bandwidth`); empty: `memory_bandwidth` for every op.
        measured_on: what a measurement ran on, as (what, value) pairs: the device
            ("cpu", "cuda NVIDIA H100 80GB HBM3"), the compute dtype, the compute
            thread count and the torch version (`slcompile.profile.profile_key`);
            empty for a named profile. Rates hold for those alone: a CPU profile
            measured with 2 threads predicts a 1-thread run at about half its time.
        load: the cores other processes kept busy while the rates were measured
            (None: unknown, as for a named profile). Rates measured beside other
            work are that work's leftovers (`trust_problem`).
        cores: the machine's core count when measured (0: unknown).
        spread: (rate, how far the median of its repeats lay beyond their best, as
            a fraction) for each measured rate: "matmul", "bandwidth", "op",
            "transfer_op", "call", "link_h2d", "link_d2h", "nvme_write",
            "nvme_read". The profile's rates are the bests; `at_spread` gives the
            medians', the slow end of a prediction's interval.
    """

    name: str
    matmul_flops: float
    memory_bandwidth: float
    op_overhead_seconds: float = 0.0
    transfer_op_seconds: float = 0.0
    call_overhead_seconds: float = 0.0
    output_seconds_per_byte: float = 0.0
    compute_scale: float = 1.0
    layer_step_seconds: float = 0.0
    pass_seconds: float = 0.0
    link_h2d: float = _INF
    link_d2h: float = _INF
    link_latency_seconds: float = 0.0
    nvme_read: float = _INF
    nvme_write: float = _INF
    nvme_latency_seconds: float = 0.0
    network: float = _INF
    network_latency_seconds: float = 0.0
    source: str = ""
    matmul_curve: tuple[tuple[float, float], ...] = ()
    bandwidth_curve: tuple[tuple[float, float], ...] = ()
    transfer_op_costs: tuple[tuple[str, float], ...] = ()
    measured_on: tuple[tuple[str, str], ...] = ()
    load: float | None = None
    cores: int = 0
    spread: tuple[tuple[str, float], ...] = ()

    def trust_problem(self) -> str | None:
        """Why the rates of this measurement are not this machine's own, or None.

        A measurement during which other processes kept more than a quarter of
        the cores (and at least half a core) busy measured what that work left
        over; one whose matmul or bandwidth repeats spread by more than
        `TRUSTED_SPREAD` was disturbed while it ran. Either way every time
        predicted from it is off by an unknown factor."""
        problems = []
        if self.load is not None and self.load > max(0.5, 0.25 * (self.cores or 1)):
            problems.append(f"other processes kept {self.load:.1f} of {self.cores or '?'} cores busy while it measured")
        wide = [f"{rate} {fraction:.0%}" for rate, fraction in self.spread
                if rate in ("matmul", "bandwidth") and fraction > TRUSTED_SPREAD]
        if wide:
            problems.append(f"its repeats spread by {', '.join(wide)} (median over best)")
        return "; ".join(problems) or None

    def describe(self) -> str:
        """The rates, what they were measured on, the load meanwhile and each rate's
        spread, one per line."""
        spread = dict(self.spread)

        def line(label: str, value: str, rate: str) -> str:
            return f"  {label:<22} {value}" + (f"  (spread {spread[rate]:.0%})" if rate in spread else "")

        def per_second(value: float, unit: str) -> str:
            return "-" if math.isinf(value) else f"{value / 1e9:.3g} G{unit}/s"

        lines = [f"{self.name}: {self.source or 'no source recorded'}"]
        if self.measured_on:
            lines.append("  " + ", ".join(f"{what} {value}" for what, value in self.measured_on))
        if self.load is not None:
            lines.append(f"  other processes kept {self.load:.2f} of {self.cores or '?'} cores busy meanwhile")
        lines += [
            line("matmul", per_second(self.matmul_flops, "FLOP"), "matmul"),
            line("memory bandwidth", per_second(self.memory_bandwidth, "B"), "bandwidth"),
            line("op overhead", f"{self.op_overhead_seconds * 1e6:.3g} us", "op"),
            *([f"  {'compute over roofline':<22} {self.compute_scale:.3g}x (fitted to compiled steps)"]
              if self.compute_scale != 1.0 else []),
            line("transfer op", f"{self.transfer_op_seconds * 1e6:.3g} us", "transfer_op"),
            line("compiled call", f"{self.call_overhead_seconds * 1e6:.3g} us", "call"),
            line("host -> device", per_second(self.link_h2d, "B"), "link_h2d"),
            line("device -> host", per_second(self.link_d2h, "B"), "link_d2h"),
            line("nvme write", per_second(self.nvme_write, "B"), "nvme_write"),
            line("nvme read", per_second(self.nvme_read, "B"), "nvme_read"),
        ]
        return "\n".join(lines)

    def at_spread(self) -> MachineProfile:
        """This profile with each measured rate at the median of its repeats instead
        of their best (times longer by the rate's `spread`): the slow end of the
        interval a prediction from it lies in."""
        if not self.spread:
            return self
        slower = dict(self.spread)

        def rate(value: float, name: str) -> float:
            return value / (1.0 + slower.get(name, 0.0))

        def seconds(value: float, name: str) -> float:
            return value * (1.0 + slower.get(name, 0.0))

        return dataclasses.replace(
            self, matmul_flops=rate(self.matmul_flops, "matmul"),
            memory_bandwidth=rate(self.memory_bandwidth, "bandwidth"),
            matmul_curve=tuple((flops, rate(value, "matmul")) for flops, value in self.matmul_curve),
            bandwidth_curve=tuple((nbytes, rate(value, "bandwidth")) for nbytes, value in self.bandwidth_curve),
            op_overhead_seconds=seconds(self.op_overhead_seconds, "op"),
            transfer_op_seconds=seconds(self.transfer_op_seconds, "transfer_op"),
            transfer_op_costs=tuple((op, seconds(value, "transfer_op")) for op, value in self.transfer_op_costs),
            call_overhead_seconds=seconds(self.call_overhead_seconds, "call"),
            link_h2d=rate(self.link_h2d, "link_h2d"), link_d2h=rate(self.link_d2h, "link_d2h"),
            nvme_read=rate(self.nvme_read, "nvme_read"), nvme_write=rate(self.nvme_write, "nvme_write"),
            spread=())

    def transfer_op_cost(self, op: str, tier: str) -> float:
        """Host seconds of one call of the `slc::` op named `op` ("fetch_issue") on
        data resting on `tier`: measured on that tier, else on any, else
        `transfer_op_seconds`."""
        on_any = None
        for name, seconds in self.transfer_op_costs:
            if name == f"{op}@{tier}":
                return seconds
            if on_any is None and name.split("@")[0] == op:
                on_any = seconds
        return self.transfer_op_seconds if on_any is None else on_any

    @property
    def host_is_device(self) -> bool:
        """The host tier is the device's own memory: host transfers copy nothing."""
        return math.isinf(self.link_h2d) and math.isinf(self.link_d2h)

    def compute_seconds(self, cost, lowering: str = "aot_eager") -> float:
        """A compute node's time: its launch, then the slower of its FLOPs at the
        matmul rate and its bytes at the memory bandwidth, each at the node's size on
        the profile's curves (a roofline, times `compute_scale`), then its large
        outputs' bytes at `output_seconds_per_byte`.

        Under "inductor", elementwise work (no FLOPs counted) is fused into its
        neighbours: it costs the bytes of its output alone (inputs come from
        registers) and no launch of its own."""
        if lowering == "inductor" and cost.flops == 0:
            return self.compute_scale * cost.nbytes / 2 / self.memory_rate(cost.nbytes)
        rate = self.matmul_rate(cost.flops)
        return (self.op_overhead_seconds
                + self.compute_scale * max(cost.flops / rate, cost.nbytes / self.memory_rate(cost.nbytes))
                + cost.large_output_bytes * self.output_seconds_per_byte)

    def matmul_rate(self, flops: float) -> float:
        """The FLOP/s a product of `flops` reaches (`matmul_curve`)."""
        return _on_curve(self.matmul_curve, flops, self.matmul_flops)

    def memory_rate(self, nbytes: float) -> float:
        """The bytes/s an op that reads plus writes `nbytes` reaches (`bandwidth_curve`)."""
        return _on_curve(self.bandwidth_curve, nbytes, self.memory_bandwidth)

    def transfer_seconds(self, tier: str, direction: str, nbytes: int) -> tuple[str, float]:
        """(lane, seconds) of one transfer of `nbytes` between the device and `tier`.

        Args:
            tier: "device" (nothing moves), "host" or "nvme".
            direction: "read" (to the device) or "write" (from it).
            nbytes: bytes moved.
        """
        if tier == "device" or nbytes == 0:
            return "compute", 0.0
        if tier == "host":
            rate = self.link_h2d if direction == "read" else self.link_d2h
            lane = "link.h2d" if direction == "read" else "link.d2h"
            if math.isinf(rate):
                return lane, 0.0
            return lane, self.link_latency_seconds + nbytes / rate
        if tier == "nvme":
            rate = self.nvme_read if direction == "read" else self.nvme_write
            # On a GPU machine the bytes cross the link too; the disk is the slower.
            link = self.link_h2d if direction == "read" else self.link_d2h
            return "disk", self.nvme_latency_seconds + nbytes / min(rate, link)
        if tier == "network":
            return "network", self.network_latency_seconds + nbytes / self.network
        raise ValueError(f"unknown tier {tier!r}; expected 'device', 'host', 'nvme' or 'network'")

    def to_json(self) -> str:
        return json.dumps({k: (None if isinstance(v, float) and math.isinf(v) else v)
                           for k, v in dataclasses.asdict(self).items()}, indent=1)

    @classmethod
    def from_json(cls, text: str) -> MachineProfile:
        data: Mapping = json.loads(text)
        known = {f.name for f in dataclasses.fields(cls)}
        # JSON holds an infinite rate as null; `load` is null where unknown.
        values = {k: (_INF if v is None and k != "load" else v) for k, v in data.items() if k in known}
        values["matmul_curve"] = tuple(tuple(point) for point in values.get("matmul_curve", ()))
        values["bandwidth_curve"] = tuple(tuple(point) for point in values.get("bandwidth_curve", ()))
        values["transfer_op_costs"] = tuple(tuple(pair) for pair in values.get("transfer_op_costs", ()))
        values["measured_on"] = tuple(tuple(pair) for pair in values.get("measured_on", ()))
        values["spread"] = tuple(tuple(pair) for pair in values.get("spread", ()))
        return cls(**values)


def _on_curve(curve: tuple[tuple[float, float], ...], x: float, peak: float) -> float:
    """The rate at `x` on a measured (x, rate) curve, smallest x first: interpolated in
    log x between its points, clamped at its ends, capped by `peak`; `peak` where the
    curve is empty."""
    if not curve or x <= 0:
        return peak
    if x <= curve[0][0]:
        return min(curve[0][1], peak)
    for (low, low_rate), (high, high_rate) in zip(curve, curve[1:]):
        if x <= high:
            share = (math.log(x) - math.log(low)) / (math.log(high) - math.log(low))
            return min(low_rate + share * (high_rate - low_rate), peak)
    return min(curve[-1][1], peak)


_GB = 1e9
_H100_SOURCE = ("assumed, not measured: H100 bf16 dense 989 TFLOP/s peak at 65%, HBM3 3.35 TB/s at 80%, "
                "a CUDA kernel launch 5 us, a compiled call from Python 50 us, PCIe Gen5 x16 at 52 GB/s each way, NVMe 6.5 GB/s read, "
                "5 GB/s write; the host time of each slc:: op on the host tier as measured by torch.profiler in "
                "training steps of a 4-layer Llama on an H100 and an H200 (torch 2.11, 2026-11-26)")
# Host microseconds per slc:: op on the host tier (bench/results/gpu_bench_h200.json): the
# issues of a visit are held and loaded together at its first fetch.
_HOPPER_HOST_OPS = tuple((f"{op}@host", us * 1e-6) for op, us in (
    ("fetch_issue", 12.7), ("fetch_weight", 31.0), ("mark", 13.2), ("stash", 269.9), ("wait", 28.5),
    ("unstash", 121.4), ("unstash_wait", 14.9)))

NAMED_PROFILES: Mapping[str, MachineProfile] = MappingProxyType({
    "h100-pcie5-nvme": MachineProfile(
        name="h100-pcie5-nvme", matmul_flops=989e12 * 0.65, memory_bandwidth=3.35e12 * 0.8,
        op_overhead_seconds=5e-6, transfer_op_seconds=10e-6, call_overhead_seconds=50e-6,
        link_h2d=52 * _GB, link_d2h=52 * _GB, link_latency_seconds=10e-6,
        nvme_read=6.5 * _GB, nvme_write=5 * _GB, nvme_latency_seconds=80e-6,
        source=_H100_SOURCE, transfer_op_costs=_HOPPER_HOST_OPS,
    ),
    "8xh100-ib": MachineProfile(
        name="8xh100-ib", matmul_flops=989e12 * 0.65, memory_bandwidth=3.35e12 * 0.8,
        op_overhead_seconds=5e-6, transfer_op_seconds=10e-6, call_overhead_seconds=50e-6,
        link_h2d=52 * _GB, link_d2h=52 * _GB, link_latency_seconds=10e-6,
        nvme_read=6.5 * _GB, nvme_write=5 * _GB, nvme_latency_seconds=80e-6,
        network=40 * _GB, network_latency_seconds=20e-6, transfer_op_costs=_HOPPER_HOST_OPS,
        source=_H100_SOURCE + "; per GPU one 400 Gb/s InfiniBand NIC at 80% (40 GB/s) for collectives "
        "across machines",
    ),
})
"""Profiles of machines one may not be on, by name."""


def named_profile(name: str) -> MachineProfile:
    """The named profile (`NAMED_PROFILES`).

    Raises:
        ValueError: no profile has that name (the message lists them).
    """
    try:
        return NAMED_PROFILES[name]
    except KeyError:
        raise ValueError(f"no machine profile named {name!r}; named profiles: {', '.join(NAMED_PROFILES)}, "
                         "or 'current' (measured here)") from None
