"""The runtime's timeline as a Chrome trace (open in Perfetto or chrome://tracing).

Where it sits: after a recorded step, `chrome_trace(timeline(), report.graphs)` turns
the runtime's `TimelineEvent`s into the Trace Event Format; the CLI writes it with
`write_chrome_trace`.

Needs: `TimelineEvent`s from `slcompile.runtime.stats.timeline()`. Compute regions
exist when the compiled graphs carry `slc::mark` markers (`passes.mark_regions`,
aot_eager lowering); transfers are recorded by the transfer engine on its own.
Guarantees:
- One process per stream (`passes.annotate_streams`, the stream the graphs annotate
  each transfer with): "slcompile default stream" holds "compute" (one slice per
  marked region, `blk3.sb1 fwd`; step boundaries as instant events) and "compute
  waits" (time compute was blocked on a transfer); "slcompile copy stream" (the
  transfer engine's) holds "load" and "store"; "slcompile comm stream" holds
  "collective" (sharded weights' all-gathers and reduce-scatters). Lanes (threads)
  are numbered in that order across processes, so a tid names one lane. Transfers
  that overlap in time (several I/O threads) go to extra lanes "load 2", "load 3",
  ... so no two slices of one lane overlap.
- Every transfer and collective slice names its stream in `args["stream"]`;
  `otherData["streams"]` maps each lane to its stream.
- Exactly one complete ("X") slice per recorded transfer, with args: bytes, kind,
  key, from, to, tier (the slower end), and the bandwidth.
- A flow arrow from each load to the compute region that consumed it: read from the
  graphs (a region that calls `slc::fetch_weight(key)` consumes one load of that key,
  matched in time order), else from the stall that waited on it.
- Timestamps are microseconds from the first event.

`predicted_chrome_trace(prediction)` writes the time model's timeline
(`slcompile.analysis.time.TimePrediction`, what `explain(..., profile=...)` prints) in
the same format: one process, one lane (thread) per lane of the prediction
("compute", then "link.h2d", "link.d2h", "disk", "network"), one complete slice per
predicted event, the compute lane's stalls on it as "stall" slices; loads (fetch,
unstash) and stores (stash, store_grad) take the categories "load" and "store" and
`args["kind"]` the data moved, as the measured trace's do, so `plots.plot_timeline`
draws either. Timestamps are microseconds from the step's start.
"""

from __future__ import annotations

import bisect
import collections
import json
import logging
import pathlib
from collections.abc import Mapping, Sequence
from types import MappingProxyType
from typing import TYPE_CHECKING

import torch
import torch.fx

from slcompile.passes.annotate_streams import STREAM_LANES
from slcompile.viz.roles import format_bytes, short_key
from slcompile.vocabulary import SPILL_MARK, WeightKey, is_fetch

if TYPE_CHECKING:  # the records only: reading a trace needs no runtime
    from slcompile.runtime.stats import TimelineEvent

__all__ = ["chrome_trace", "write_chrome_trace", "trace_lanes", "lane_stream", "TRANSFER_LANES", "DEFAULT_STREAM",
           "predicted_chrome_trace", "write_predicted_trace"]

log = logging.getLogger(__name__)

TRANSFER_LANES = ("load", "store")
DEFAULT_STREAM = "default"
"""The stream of the compute lanes (graph nodes without a stream annotation)."""
_PID = 1  # the default stream's process
_LANE_STREAMS = MappingProxyType({lane: stream for stream, lanes in STREAM_LANES.items() for lane in lanes})
_LANE_ORDER = ("compute", "stall", "load", "store")
_LANE_NAMES = MappingProxyType({"compute": "compute", "stall": "compute waits", "load": "load", "store": "store"})


def chrome_trace(
    events: Sequence[TimelineEvent], graphs: Mapping[str, torch.fx.GraphModule] | None = None
) -> dict:
    """The Trace Event Format document of `events`.

    Args:
        events: timeline events (`slcompile.runtime.stats.timeline()`).
        graphs: the compiled graphs (`CompileReport.graphs`), to draw a flow from each
            weight load to the region that fetched it.

    Returns:
        `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`.
    """
    events = sorted(events, key=lambda e: (e.start, e.end))
    origin = events[0].start if events else 0.0

    def micros(seconds: float) -> float:
        return round((seconds - origin) * 1e6, 3)

    lanes = _assign_lanes(events)
    # "compute" always exists: the flows end there, and an empty lane says "no regions".
    ordered = _ordered_lanes({"compute", *lanes.values()})
    streams = list(dict.fromkeys([DEFAULT_STREAM, *(lane_stream(name) for name in ordered)]))
    pids = {stream: pid for pid, stream in enumerate(streams, start=_PID)}
    ordered.sort(key=lambda name: streams.index(lane_stream(name)))  # a process's lanes together
    tids = {name: tid for tid, name in enumerate(ordered, start=1)}
    pid_of = {name: pids[lane_stream(name)] for name in tids}
    position = {id(event): index for index, event in enumerate(events)}
    trace: list[dict] = []
    for stream, pid in pids.items():
        trace.append({"ph": "M", "pid": pid, "name": "process_name", "args": {"name": f"slcompile {stream} stream"}})
        trace.append({"ph": "M", "pid": pid, "name": "process_sort_index", "args": {"sort_index": pid}})
    for name, tid in tids.items():
        base = name.split(" ")[0]
        title = _LANE_NAMES.get(base, base) + name[len(base):]
        pid = pid_of[name]
        trace.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": title}})
        trace.append({"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    for index, event in enumerate(events):
        if event.lane == "step":
            trace.append({"ph": "i", "s": "g", "pid": _PID, "tid": tids.get("compute", 1), "name": event.label,
                          "ts": micros(event.start), "cat": "step"})
            continue
        lane = lanes[index]
        slice_ = {"ph": "X", "pid": pid_of[lane], "tid": tids[lane], "ts": micros(event.start),
                  "dur": round(max(event.end - event.start, 0.0) * 1e6, 3), "cat": event.lane}
        if event.lane in TRANSFER_LANES:
            slice_.update(name=_transfer_name(event), args={**_transfer_args(event), "stream": lane_stream(lane)})
        elif event.lane in _LANE_STREAMS:
            slice_.update(name=event.label, args={"stream": lane_stream(lane)})
        else:
            slice_.update(name=event.label, args={})
        trace.append(slice_)
    for number, (load, consumer) in enumerate(_consumers(events, graphs or {})):
        # Both ends must lie inside their slices for the viewer to bind them.
        start = micros(load.start + (load.end - load.start) * 0.5)
        finish = micros(min(max(load.end, consumer.start), consumer.end))
        common = {"cat": "consumes", "name": "load -> compute", "id": number}
        lane = lanes[position[id(load)]]
        trace.append({**common, "ph": "s", "pid": pid_of[lane], "tid": tids[lane], "ts": start})
        trace.append({**common, "ph": "f", "bp": "e", "pid": pid_of["compute"], "tid": tids["compute"], "ts": finish})
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {
            "producer": "slcompile", "lanes": list(tids), "streams": {name: lane_stream(name) for name in tids},
        },
    }


def write_chrome_trace(
    path: str | pathlib.Path,
    events: Sequence[TimelineEvent],
    graphs: Mapping[str, torch.fx.GraphModule] | None = None,
) -> pathlib.Path:
    """Writes `chrome_trace(events, graphs)` as JSON to `path`; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(chrome_trace(events, graphs)))
    return path


# A predicted transfer's kind -> (its slice's category, the data it moves).
_PREDICTED_TRANSFERS = MappingProxyType({"fetch": ("load", "weight"), "unstash": ("load", "activation"),
                                          "stash": ("store", "activation"), "store_grad": ("store", "gradient"),
                                          "spill": ("store", "boundary activation"),
                                          "fill": ("load", "boundary activation")})
_PREDICTED_LANE_ORDER = ("compute", "link.h2d", "link.d2h", "disk", "network")


def predicted_chrome_trace(prediction) -> dict:
    """The Trace Event Format document of a predicted timeline.

    Args:
        prediction: a `slcompile.analysis.time.TimePrediction` (`explain(...,
            profile=...).time`, `tune(..., profile=...).time`).

    Returns:
        `{"traceEvents": [...], "displayTimeUnit": "ms", "otherData": {...}}`, one
        "X" slice per event of `prediction.events`, in their order.
    """
    events = prediction.events
    # A transfer carried over from the step before may start before this one.
    origin = min([0.0, *(event.start for event in events)])
    names = {event.lane for event in events} | {"compute"}
    ordered = sorted(names, key=lambda lane: (_PREDICTED_LANE_ORDER.index(lane)
                                              if lane in _PREDICTED_LANE_ORDER else len(_PREDICTED_LANE_ORDER), lane))
    tids = {lane: tid for tid, lane in enumerate(ordered, start=1)}
    trace: list[dict] = [
        {"ph": "M", "pid": _PID, "name": "process_name",
         "args": {"name": f"slcompile prediction ({prediction.title})"}},
    ]
    for lane, tid in tids.items():
        trace.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_name", "args": {"name": lane}})
        trace.append({"ph": "M", "pid": _PID, "tid": tid, "name": "thread_sort_index", "args": {"sort_index": tid}})
    for event in events:
        # Both ends rounded, not the duration: slices that meet on a lane still meet.
        start, end = (round((moment - origin) * 1e6, 3) for moment in (event.start, max(event.end, event.start)))
        slice_ = {"ph": "X", "pid": _PID, "tid": tids[event.lane], "ts": start, "dur": round(end - start, 3)}
        where = {"region": event.region, "subbatch": event.subbatch, "phase": event.phase}
        if event.kind == "compute":
            slice_.update(name=f"{event.unit} {event.phase}", cat="compute",
                          args={**where, "flops": event.flops, "bytes": event.nbytes})
        elif event.kind == "stall":
            slice_.update(name=f"wait {event.unit} {event.phase}", cat="stall", args=where)
        else:
            category, data = _PREDICTED_TRANSFERS.get(event.kind, ("transfer", event.kind))
            slice_.update(name=f"{event.kind} {event.unit} {event.phase} ({format_bytes(event.nbytes)})",
                          cat=category,
                          args={**where, "bytes": event.nbytes, "kind": data, "transfer": event.kind,
                                "lane": event.lane,
                                "MB/s": round(event.nbytes / event.seconds / 1e6, 1) if event.seconds > 0 else None})
        trace.append(slice_)
    return {
        "traceEvents": trace,
        "displayTimeUnit": "ms",
        "otherData": {"producer": "slcompile", "predicted": True, "profile": prediction.profile,
                      "policy": prediction.policy, "num_subbatches": prediction.num_subbatches,
                      "step_seconds": prediction.step_seconds, "slow_step_seconds": prediction.slow_step_seconds,
                      "lanes": ordered},
    }


def write_predicted_trace(path: str | pathlib.Path, prediction) -> pathlib.Path:
    """Writes `predicted_chrome_trace(prediction)` as JSON to `path`; returns the path."""
    path = pathlib.Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(predicted_chrome_trace(prediction)))
    return path


def trace_lanes(trace: dict) -> dict[int, str]:
    """tid -> lane name of a trace made by `chrome_trace`."""
    return {e["tid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}


def lane_stream(lane: str) -> str:
    """The stream whose work a timeline lane (`"load 2"`) shows."""
    return _LANE_STREAMS.get(lane.split(" ")[0], DEFAULT_STREAM)


def _ordered_lanes(names: set[str]) -> list[str]:
    def key(name: str):
        base, _, number = name.partition(" ")
        rank = _LANE_ORDER.index(base) if base in _LANE_ORDER else len(_LANE_ORDER)
        return rank, base, int(number or 1)

    return sorted(names, key=key)


def _assign_lanes(events: Sequence[TimelineEvent]) -> dict[int, str]:
    """Event index -> lane; overlapping transfers of one lane spill into `load 2`, ..."""
    lanes: dict[int, str] = {}
    free_at: dict[str, list[float]] = collections.defaultdict(list)  # per base lane, end of each row
    for index, event in enumerate(events):
        if event.lane == "step":
            continue
        if event.lane not in TRANSFER_LANES and event.lane != "stall":
            lanes[index] = event.lane
            continue
        rows = free_at[event.lane]
        for row, end in enumerate(rows):
            if end <= event.start:
                rows[row] = event.end
                break
        else:
            rows.append(event.end)
            row = len(rows) - 1
        lanes[index] = event.lane if row == 0 else f"{event.lane} {row + 1}"
    return lanes


def _parse_transfer(label: str) -> tuple[str, str, str, str]:
    """`"weight w0:name nvme->device"` -> (kind, key, source, destination)."""
    kind, _, rest = label.partition(" ")
    key, _, tiers = rest.rpartition(" ")
    source, _, destination = tiers.partition("->")
    return kind, key, source, destination


def _transfer_name(event: TimelineEvent) -> str:
    kind, key, source, destination = _parse_transfer(event.label)
    return f"{_spill_or(kind, key, destination)} {short_key(key)} ({format_bytes(event.bytes)})"


def _spill_or(kind: str, key: str, destination: str) -> str:
    """"spill" or "fill" for a boundary activation's store or load (its stored key
    `blk3.sb1.spill.add_7#40` carries the spill mark, as its stash key does), else
    `kind`."""
    if kind != "activation" or key.rpartition("|")[2].split(".")[2:3] != [SPILL_MARK]:
        return kind
    return "fill" if destination == "device" else "spill"


def _transfer_args(event: TimelineEvent) -> dict:
    kind, key, source, destination = _parse_transfer(event.label)
    seconds = event.end - event.start
    return {
        "bytes": event.bytes,
        "kind": kind,
        "transfer": _spill_or(kind, key, destination),
        "key": key,
        "from": source,
        "to": destination,
        "tier": source if event.lane == "load" else destination,
        "MB/s": round(event.bytes / seconds / 1e6, 1) if seconds > 0 else None,
    }


def _consumers(
    events: Sequence[TimelineEvent], graphs: Mapping[str, torch.fx.GraphModule]
) -> list[tuple[TimelineEvent, TimelineEvent]]:
    """(load, compute region that used it) pairs."""
    computes = [e for e in events if e.lane == "compute"]
    loads = [e for e in events if e.lane == "load"]
    pairs: list[tuple[TimelineEvent, TimelineEvent]] = []
    matched: set[int] = set()
    fetches = _fetches_by_region(graphs)
    by_key: dict[str, list[int]] = collections.defaultdict(list)
    for index, load in enumerate(loads):
        by_key[_parse_transfer(load.label)[1]].append(index)
    for compute in computes:
        for key in fetches.get(compute.label, ()):
            for index in by_key.get(key, ()):
                if index not in matched and loads[index].start <= compute.end:
                    matched.add(index)
                    pairs.append((loads[index], compute))
                    break
    starts = [c.start for c in computes]
    for stall in (e for e in events if e.lane == "stall"):
        waited = stall.label.removeprefix("wait ")
        for index, load in enumerate(loads):
            if index in matched or load.label != waited or load.start > stall.end:
                continue
            position = bisect.bisect_right(starts, stall.start) - 1
            if position >= 0 and computes[position].end >= stall.start:
                matched.add(index)
                pairs.append((load, computes[position]))
            break
    return pairs


def _fetches_by_region(graphs: Mapping[str, torch.fx.GraphModule]) -> dict[str, list[str]]:
    """Region label -> the stored keys its `slc::fetch_weight` calls read."""
    from slcompile.passes.mark_regions import marked_regions
    fetches: dict[str, list[str]] = collections.defaultdict(list)
    for gm in graphs.values():
        nodes = {node.name: node for node in gm.graph.nodes}
        for region in marked_regions(gm.graph):
            for name in region.nodes:
                node = nodes[name]
                if is_fetch(node):
                    fetches[region.label].append(WeightKey.parse(node.args[1]).stored)
    return fetches
