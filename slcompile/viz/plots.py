"""Matplotlib pictures: resident memory over a step, and a static view of the timeline.

Where it sits: the CLI calls these after recording one step; the inputs are the
compiled graphs (`CompileReport.graphs`), the runtime's timeline events and the
`ResidentSampler` samples.

Needs: matplotlib (drawn with the Agg backend, no display).
Guarantees:
- `plot_memory` draws two panels and labels which is which: measured resident bytes
  per tier (runtime accounting) and, when recorded, the bytes torch's allocator of
  the device held (every allocation of the step: what the prediction counts) on
  top, predicted live bytes of the compiled graphs
  below (the memory model: held inputs, streamed weights and everything else stacked,
  peaking at the device peak `explain` prints). When the timeline holds the
  graphs' region markers, both panels share the step's time axis (each node is placed
  inside its region's measured interval); otherwise the prediction is drawn over the
  node order, said in its title.
- `plot_timeline` draws the lanes of `trace.chrome_trace` as bars, the same slices a
  trace viewer shows, for a quick look without one; transfers take one colour per
  kind of data (weights, activations, gradients, optimizer state: `TRANSFER_COLORS`).
  `plot_timelines` draws several (policies compared) one above the other. A
  predicted timeline (`trace.predicted_chrome_trace`) is drawn the same way, on its
  own lanes (compute, link.h2d, disk, ...), its compute in one colour.
"""

from __future__ import annotations

import collections
import logging
import pathlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import torch.fx

from slcompile.analysis.memory import MemoryPrediction, predict_step_memory
from slcompile.runtime.stats import TimelineEvent
from slcompile.units import bytes_unit, format_bytes
from slcompile.viz.memory import DeviceLayers, ResidentSample, device_layers
from slcompile.viz.trace import trace_lanes
from slcompile.vocabulary import parse_region_label

__all__ = ["plot_memory", "plot_timeline", "plot_timelines", "align_regions", "TRANSFER_COLORS"]

log = logging.getLogger(__name__)

_TIER_COLORS = MappingProxyType({"device": "#3182bd", "host": "#31a354", "nvme": "#756bb1"})
_WEIGHTS_COLOR = "#f2c80f"
_HELD_COLOR = "#d9d9d9"
_OTHER_COLOR = "#9ecae1"
_LANE_COLORS = MappingProxyType({"compute": "#6baed6", "stall": "#de2d26", "load": "#f2c80f", "store": "#c994c7"})
_SHARED_COLOR = "#9e9ac8"
_PHASES = (("forward", "fwd"), ("backward", "bwd"), ("inference", "fwd"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _unit(peak: float) -> tuple[float, str]:
    name, scale = bytes_unit(peak)
    return float(scale), name


def align_regions(
    graphs: Mapping[str, torch.fx.GraphModule], events: Sequence[TimelineEvent]
) -> dict[str, dict[str, float]] | None:
    """Node -> time for each graph, from the regions' measured intervals.

    The compute events of the timeline are matched, in order, to the marked regions
    of the forward graph and then the backward graph (the order one training step
    runs them). Each node of a region is placed evenly inside the region's interval.

    Args:
        graphs: the compiled graphs by kind.
        events: timeline events covering one step.

    Returns:
        kind -> node name -> perf_counter seconds, or None when the regions are not
        all found (no markers, or a step that did not run every graph).
    """
    from slcompile.passes.mark_regions import marked_regions

    computes = [e for e in events if e.lane == "compute"]
    sequence = []
    for kind, _ in _PHASES:
        if kind in graphs:
            sequence += [(kind, region) for region in marked_regions(graphs[kind].graph)]
    if not sequence or not computes:
        return None
    cursor = 0
    times: dict[str, dict[str, float]] = collections.defaultdict(dict)
    for event in computes:
        if cursor < len(sequence) and event.label == sequence[cursor][1].label:
            kind, region = sequence[cursor]
            count = max(len(region.nodes), 1)
            for index, name in enumerate(region.nodes):
                times[kind][name] = event.start + (event.end - event.start) * (index + 1) / count
            times[kind][f"<start {cursor}>"] = event.start
            cursor += 1
    if cursor < len(sequence):
        log.info("memory plot: %d of %d regions found on the timeline; drawing over node order", cursor, len(sequence))
        return None
    for kind, gm in graphs.items():
        if kind not in times:
            continue
        # Nodes outside every region (inputs, the output) take their neighbour's time.
        known = times[kind]
        previous = min(known.values())
        for node in gm.graph.nodes:
            previous = known.setdefault(node.name, previous)
    return times


def plot_memory(
    path: str | pathlib.Path,
    graphs: Mapping[str, torch.fx.GraphModule],
    samples: Sequence[ResidentSample] = (),
    events: Sequence[TimelineEvent] = (),
    title: str = "memory over one training step",
    memory: MemoryPrediction | None = None,
    allocations: Sequence[tuple[float, int]] = (),
) -> pathlib.Path:
    """Writes the memory picture (PNG) to `path`.

    Args:
        path: the PNG to write.
        graphs: the compiled graphs by kind (`CompileReport.graphs`).
        samples: measured resident bytes (`ResidentSampler.samples`); none: the
            measured panel is left out.
        events: the timeline of the recorded step, to put the prediction on its
            time axis.
        title: the figure's title.
        memory: the step's prediction (`CompileReport.memory`); default: predicted
            from `graphs`. The lower panel stacks it (`viz.memory.device_layers`), so
            its peak is the device peak `explain` prints.
        allocations: the device allocator's bytes over the step
            (`RecordedStep.allocations`): drawn in the measured panel, they count
            what the prediction counts (activations, saved values, gradients), which
            the per-tier samples do not.

    Returns:
        the path written.
    """
    plt = _pyplot()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if memory is None:
        memory = predict_step_memory(graphs)
    layers = device_layers(memory) if memory is not None else DeviceLayers((), (), (), ())
    times = align_regions(graphs, events) if events else None
    origin = _origin(samples, events)
    peaks = [layers.peak] + [max(s.resident.values(), default=0) for s in samples] + [n for _, n in allocations]
    scale, unit = _unit(max(peaks, default=0))
    panels = 2 if samples or allocations else 1
    figure, axes = plt.subplots(panels, 1, figsize=(12, 3.4 * panels + 0.6), sharex=times is not None, squeeze=False)
    axes = [row[0] for row in axes]
    if samples or allocations:
        _draw_measured(axes[0], samples, origin, scale, unit, allocations)
    _draw_predicted(axes[-1], layers, times, origin, scale, unit)
    if times is not None:
        for axis in axes:
            _shade_regions(axis, events, origin, label=axis is axes[0])
    if times is None and samples:
        axes[0].set_xlabel("time since the step started (ms)")
    axes[-1].set_xlabel("time since the step started (ms)" if times is not None else "position in the graph (forward, then backward)")
    figure.suptitle(title, fontsize=13)
    figure.tight_layout()
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


def _origin(samples: Sequence[ResidentSample], events: Sequence[TimelineEvent]) -> float:
    starts = [s.time for s in samples[:1]] + [e.start for e in events if e.lane == "compute"][:1]
    return min(starts, default=0.0)


def _draw_measured(axis, samples, origin, scale, unit, allocations=()) -> None:
    tiers = sorted({tier for s in samples for tier, count in s.resident.items() if count} | {"device"},
                   key=lambda t: list(_TIER_COLORS).index(t) if t in _TIER_COLORS else 9)
    xs = [(s.time - origin) * 1e3 for s in samples]
    for tier in tiers if samples else ():
        ys = [s.resident.get(tier, 0) / scale for s in samples]
        peak = max(ys, default=0)
        axis.step(xs, ys, where="post", color=_TIER_COLORS.get(tier, "black"), linewidth=1.8,
                  linestyle="-" if tier == "device" else "--", zorder=3 if tier == "device" else 2,
                  label=f"{tier}: runtime accounting (peak {format_bytes(peak * scale)})")
    top = max((max(s.resident.values(), default=0) for s in samples), default=0)
    if allocations:
        peak = max(n for _, n in allocations)
        axis.fill_between([(t - origin) * 1e3 for t, _ in allocations], [n / scale for _, n in allocations],
                          step="post", color=_OTHER_COLOR, alpha=0.45, linewidth=0, zorder=1,
                          label=f"device: torch's allocator (peak {format_bytes(peak)})")
        top = max(top, peak)
    when = "at region boundaries" if any(s.label not in ("start", "end", "timer") for s in samples) else "on a timer"
    what = [f"bytes resident per tier (runtime accounting, sampled {when})"] if samples else []
    if allocations:
        what.append("every device allocation of the step (torch.profiler)")
    else:
        what[-1] = what[-1][:-1] + "; activations excluded)"
    axis.set_title("measured: " + " and ".join(what), fontsize=10, loc="left")
    if not allocations and not any(count for s in samples for count in s.resident.values()):
        axis.text(0.5, 0.5, "the runtime held nothing on any tier during this step (no weights streamed)",
                  transform=axis.transAxes, ha="center", va="center", fontsize=10, color="#555555")
    axis.set_ylabel(unit)
    axis.set_ylim(0, top / scale * 1.35 or 1)
    axis.legend(loc="upper right", fontsize=9, ncol=len(tiers) + bool(allocations))
    axis.grid(alpha=0.3)


def _draw_predicted(axis, layers: DeviceLayers, times, origin, scale, unit) -> None:
    xs: list[float] = []
    boundaries = []
    for kind, nodes in layers.graphs:
        if not nodes:
            continue
        if times is not None:
            # A node the compiled graph no longer has (a transfer joined into its run's
            # `_many` call by `coalesce_transfers`) takes the time of the node before it.
            known, positions = times[kind], []
            previous = min(known.values())
            for name in nodes:
                previous = known.get(name, previous)
                positions.append((previous - origin) * 1e3)
        else:
            positions = [len(xs) + index for index in range(len(nodes))]
        boundaries.append((positions[0], kind))
        xs += positions
    series = [[v / scale for v in values] for values in (layers.held, layers.weights, layers.other)]
    axis.stackplot(xs, *series, colors=(_HELD_COLOR, _WEIGHTS_COLOR, _OTHER_COLOR), step="post",
                   labels=("held by the caller (resident parameters, inputs)", "streamed weights",
                           "activations, saved values, gradients"))
    axis.plot([], [], " ", label=f"peak {format_bytes(layers.peak)}")
    for x, kind in boundaries:
        axis.axvline(x, color="black", linewidth=0.8, linestyle="--")
        axis.text(x, 1.0, f" {kind}", transform=axis.get_xaxis_transform(), va="top", fontsize=9)
    where = "placed in the measured regions" if times is not None else "over node order: no region markers recorded"
    axis.set_title(f"predicted: device bytes of the step (memory model, {where})", fontsize=10, loc="left")
    axis.set_ylabel(unit)
    axis.set_ylim(bottom=0)
    axis.legend(loc="upper right", fontsize=9)
    axis.grid(alpha=0.3)


def _shade_regions(axis, events, origin, label: bool) -> None:
    """Alternating bands per region (prefix, blk0, ..., suffix), named on the top panel."""
    spans: list[list] = []
    for event in (e for e in events if e.lane == "compute"):
        tag, phase = parse_region_label(event.label)
        head = tag.split(".")[0]
        if spans and spans[-1][0] == (head, phase):
            spans[-1][2] = event.end
        else:
            spans.append([(head, phase), event.start, event.end])
    total = (spans[-1][2] - spans[0][1]) if spans else 0.0
    for index, ((head, _), start, end) in enumerate(spans):
        if index % 2:
            axis.axvspan((start - origin) * 1e3, (end - origin) * 1e3, color="#000000", alpha=0.05, linewidth=0)
        if label and end - start > total / 40:  # narrower bands would print their names over each other
            axis.text(((start + end) / 2 - origin) * 1e3, 0.02, head, transform=axis.get_xaxis_transform(),
                      ha="center", va="bottom", fontsize=7, color="#555555", rotation=90 if len(spans) > 16 else 0)
    if label and spans:
        right = axis.get_xlim()[1]
        last = (spans[-1][2] - origin) * 1e3
        if right - last > (right - axis.get_xlim()[0]) / 10:
            axis.text((last + right) / 2, 0.5, "outside the compiled graphs\n(e.g. the optimizer step)",
                      transform=axis.get_xaxis_transform(), ha="center", va="center", fontsize=8, color="#777777")


def plot_timeline(path: str | pathlib.Path, trace: dict, title: str = "timeline of one training step") -> pathlib.Path:
    """Writes the lanes of a Chrome trace (`trace.chrome_trace`) as a bar chart PNG.

    Args:
        path: the PNG to write.
        trace: the trace document.
        title: the figure's title.

    Returns:
        the path written.
    """
    return plot_timelines(path, {title: trace})


def plot_timelines(path: str | pathlib.Path, traces: Mapping[str, dict]) -> pathlib.Path:
    """Writes the lanes of several Chrome traces as bar charts one above the other
    (one panel per trace, titled by its key: a policy's name when
    `compare_policies` draws them), on one time scale.

    Transfers are coloured by what they carry (`TRANSFER_COLORS`: weights,
    activations, gradients, optimizer state), on their load or store lane.

    Args:
        path: the PNG to write.
        traces: title -> trace document, in the order drawn.

    Returns:
        the path written.
    """
    plt = _pyplot()
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    heights = [0.55 * len(trace_lanes(trace)) + 1.2 for trace in traces.values()]
    legend_height = 0.8
    figure_height = sum(heights) + legend_height
    figure, axes = plt.subplots(len(traces), 1, figsize=(14, figure_height), squeeze=False, sharex=True,
                                gridspec_kw={"height_ratios": heights})
    # One time axis for every panel: a policy that takes longer draws longer.
    end = max((_trace_end(trace) for trace in traces.values()), default=1.0)
    kinds: set[str] = set()
    for axis, (title, trace) in zip((row[0] for row in axes), traces.items()):
        kinds |= _draw_lanes(axis, trace, title, end)
        axis.xaxis.set_tick_params(labelbottom=True)  # each panel keeps its time labels
    from matplotlib.patches import Patch

    if all(trace.get("otherData", {}).get("predicted") for trace in traces.values()):
        legend = [Patch(color=_LANE_COLORS["compute"], label="compute (predicted)")]
    else:
        legend = [Patch(color=_LANE_COLORS["compute"], label="compute of one sub-batch"),
                  Patch(color=_SHARED_COLOR, label="compute shared by the sub-batches (weight fetches, combines)")]
    legend.append(Patch(color=_LANE_COLORS["stall"], label="compute waiting on a transfer"))
    legend += [Patch(color=_transfer_color(kind), label=f"{_KIND_NAMES.get(kind, kind)} (load or store)")
                for kind in sorted(kinds, key=_kind_rank)]
    figure.legend(handles=legend, loc="lower center", ncol=min(len(legend), 4), fontsize=8, frameon=False)
    figure.tight_layout(rect=(0, legend_height / figure_height, 1, 1))
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path


# One colour per kind of data moved; the lane (load, store) says the direction.
TRANSFER_COLORS = MappingProxyType({
    "weight": "#f2c80f",
    "activation": "#31a354",
    "gradient": "#e6550d",
    "optimizer_state": "#756bb1",
    "kv": "#17becf",
})
_KIND_NAMES = MappingProxyType({"weight": "weights", "activation": "activations", "gradient": "gradients",
                                 "optimizer_state": "optimizer state", "kv": "KV cache"})
_OTHER_TRANSFER_COLOR = "#999999"


def _transfer_color(kind: str) -> str:
    return TRANSFER_COLORS.get(kind, _OTHER_TRANSFER_COLOR)


def _kind_rank(kind: str) -> tuple:
    return (list(TRANSFER_COLORS).index(kind) if kind in TRANSFER_COLORS else len(TRANSFER_COLORS), kind)


def _trace_end(trace: dict) -> float:
    return max((e["ts"] + e["dur"] for e in trace["traceEvents"] if e.get("ph") == "X"), default=1.0) / 1e3


def _draw_lanes(axis, trace: dict, title: str, end: float) -> set[str]:
    """Draws one trace's lanes on `axis`; returns the transfer kinds drawn."""
    lanes = trace_lanes(trace)
    rows = sorted(lanes)
    slices = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    # A predicted timeline's compute is per block, its sub-batches not told apart.
    predicted = trace.get("otherData", {}).get("predicted", False)
    kinds: set[str] = set()
    for event in slices:
        row = rows.index(event["tid"])
        start, width = event["ts"] / 1e3, max(event["dur"] / 1e3, end * 1e-4)
        color = _LANE_COLORS.get(event["cat"], "#999999")
        if event["cat"] in ("load", "store"):
            kind = event["args"].get("kind", "")
            kinds.add(kind)
            color = _transfer_color(kind)
        elif event["cat"] == "compute" and not predicted and ".sb" not in parse_region_label(event["name"])[0]:
            color = _SHARED_COLOR
        axis.broken_barh([(start, width)], (row - 0.4, 0.8), facecolors=color, edgecolors="white", linewidth=0.3)
        if event["cat"] == "compute" and width > end / 60:
            axis.text(start + width / 2, row, parse_region_label(event["name"])[0], ha="center", va="center", fontsize=6,
                      rotation=90 if width < end / 25 else 0, clip_on=True)
    if not any(e["cat"] == "compute" for e in slices) and "compute" in lanes.values():
        row = rows.index(next(tid for tid, name in lanes.items() if name == "compute"))
        axis.text(end / 2, row, "no compute regions recorded (graphs compiled with lowering aot_eager carry them)",
                  ha="center", va="center", fontsize=9, color="#555555")
    axis.set_yticks(range(len(rows)), [lanes[tid] for tid in rows])
    axis.set_ylim(len(rows) - 0.5, -0.5)  # every lane shown, the first on top, even when empty
    axis.set_xlim(0, end)
    axis.set_xlabel("ms since the step's start (predicted)" if predicted else "ms since the first event")
    loads = [e for e in slices if e["cat"] == "load"]
    stores = [e for e in slices if e["cat"] == "store"]
    summary = (f"{len(loads)} loads ({format_bytes(sum(e['args']['bytes'] for e in loads))}), "
               f"{len(stores)} stores ({format_bytes(sum(e['args']['bytes'] for e in stores))})")
    axis.set_title(f"{title}: {summary}", fontsize=11, loc="left")
    axis.grid(axis="x", alpha=0.3)
    return kinds
